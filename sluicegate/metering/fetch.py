"""Fetching a usage export from a broker replica's HTTP API
(``GET /v1/usage/export?from=&to=``, a viewer's console token), for a command that writes
it to a file (``sluicegate meter export``). Returns the export's bytes as the broker signed
them; checks nothing (``sluicegate meter verify`` does).
"""

from __future__ import annotations

import urllib.error
import urllib.parse
import urllib.request

from sluicegate.errors import SluicegateError


class ExportError(SluicegateError):
    """The broker could not be reached, or refused the export (its reason included)."""


def export_url(broker: str, from_s: float, to_s: float, peer: str = "") -> str:
    args = {"from": f"{from_s:.3f}", "to": f"{to_s:.3f}"} | ({"peer": peer} if peer else {})
    return f"{broker.rstrip('/')}/v1/usage/export?{urllib.parse.urlencode(args)}"


def fetch_export(
    broker: str,
    token: str | None,
    from_s: float,
    to_s: float,
    *,
    timeout: float = 60.0,
    peer: str = "",
) -> bytes:
    """The export of the records whose ``at_ms`` falls in ``[from_s, to_s]`` (unix
    seconds) from ``broker`` (its base URL, e.g. ``http://broker.campus:8780``); with
    ``peer``, the settlement export with that sister campus."""
    url = export_url(broker, from_s, to_s, peer)
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    try:
        with urllib.request.urlopen(
            urllib.request.Request(url, headers=headers), timeout=timeout
        ) as r:
            return bytes(r.read())
    except urllib.error.HTTPError as exc:
        body = exc.read()[:500].decode(errors="replace")
        hint = " (give a viewer's console token)" if exc.code in (401, 403) else ""
        raise ExportError(f"{url}: HTTP {exc.code}{hint}: {body}") from exc
    except (urllib.error.URLError, OSError) as exc:
        reason = getattr(exc, "reason", exc)
        raise ExportError(f"{url}: cannot reach the broker ({reason})") from exc
