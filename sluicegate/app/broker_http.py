"""Reading the broker's HTTP views as a client, with a console token (``Authorization:
Bearer``): what the local campus, its tests and the benches use. Errors come back as the
status and body the broker sent, never as an exception, except when it cannot be reached.
"""

from __future__ import annotations

import json
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any


def get(url: str, token: str | None, *, timeout: float = 5.0) -> tuple[int, bytes]:
    """``GET url`` with ``token``; the status and the body."""
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    request = urllib.request.Request(url, headers=headers)
    try:
        with urllib.request.urlopen(request, timeout=timeout) as response:
            return int(response.status), bytes(response.read())
    except urllib.error.HTTPError as exc:
        return int(exc.code), bytes(exc.read())


def get_json(url: str, token: str | None, *, timeout: float = 5.0) -> tuple[int, Any]:
    """``GET url``: the status and the JSON body (text when it is not JSON)."""
    status, body = get(url, token, timeout=timeout)
    if body[:1] in (b"{", b"["):
        return status, json.loads(body)
    return status, body.decode(errors="replace")


def post_json(url: str, token: str | None, data: Any, *, timeout: float = 5.0) -> tuple[int, Any]:
    """``POST url`` with a JSON body: the status and the JSON answer."""
    headers = {"Content-Type": "application/json"}
    if token:
        headers["Authorization"] = f"Bearer {token}"
    request = urllib.request.Request(
        url, data=json.dumps(data).encode(), headers=headers, method="POST"
    )
    try:
        with urllib.request.urlopen(request, timeout=timeout) as response:
            return int(response.status), json.loads(response.read() or b"null")
    except urllib.error.HTTPError as exc:
        body = exc.read()
        return int(exc.code), json.loads(body) if body[:1] == b"{" else body.decode()


def token_beside(users_file: Path | None, role: str = "viewer") -> str | None:
    """The console token a local campus wrote beside its users file
    (``console-<role>.token``, :func:`sluicegate.app.campus.write_campus`), if any."""
    if users_file is None:
        return None
    path = users_file.with_name(f"console-{role}.token")
    return path.read_text().strip() if path.exists() else None
