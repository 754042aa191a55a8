"""Who may use a broker's views, from its settings: the users file it names, else the one
the broker keeps in its state folder (made with an operator token on first start), else
nobody."""

from __future__ import annotations

import logging

from broker.console.auth import Sessions, Users, default_users
from broker.console.routes import Access
from sluicegate.config import Settings

log = logging.getLogger(__name__)
NOBODY = Users({}, {})


def access_for(settings: Settings) -> Access:
    """Who may use this broker's views: ``[console] users_file``, else the file the broker
    keeps in its state folder (made with an operator token on first start), else nobody."""
    console = settings.console
    path = console.users_file
    state_dir = settings.broker.state_dir
    if path is None and state_dir is not None:
        path, token_file = default_users(state_dir)
        if token_file is not None:
            log.warning(
                "console: made operator token 'admin' in %s (read it once; add people with "
                "'sluicegate console user --file %s')",
                token_file,
                path,
            )
    if path is None:
        log.warning(
            "console: no users (set [console] users_file or [broker] state_dir): every view "
            "but /health and /metrics is refused"
        )
        users = NOBODY
    else:
        users = Users.read(path)
    if console.open:
        log.warning("console: [console] open = true: anyone may view (debugging only)")
    return Access(users, Sessions(console.session_ttl_s), open_viewing=console.open)
