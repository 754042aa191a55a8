"""Who may use the broker's console and HTTP views: viewers and operators, by password or
token, and the signed session a login gives.

The users file (TOML) lists ``[[user]]`` entries (a name, a role and a scrypt password
hash) and ``[[token]]`` entries (a name, a role and the SHA-256 of a bearer token); nothing
secret is stored in the clear. A login returns a session: ``name|role|expiry`` with an
HMAC-SHA256 over it under a key this process draws at start, so sessions end when the
broker restarts and a tampered cookie is refused. Roles are ordered: an operator may view.

Pure but for reading the users file and drawing randomness; the clock is passed in.
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import secrets
import tomllib
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from sluicegate.errors import ConfigError

Role = Literal["viewer", "operator"]
ROLES: tuple[Role, ...] = ("viewer", "operator")
RANK = {"viewer": 1, "operator": 2}
SCRYPT_N, SCRYPT_R, SCRYPT_P = 2**14, 8, 1
TOKEN_PREFIX = "sgc_"  # console tokens are recognisable in logs and secret scanners


@dataclass(frozen=True, slots=True)
class Who:
    """An authenticated caller."""

    name: str
    role: Role
    via: Literal["password", "token", "session", "open"]

    def may(self, role: Role) -> bool:
        return RANK[self.role] >= RANK[role]


def hash_password(password: str, *, salt: bytes | None = None) -> str:
    """The users file's form of ``password``: ``scrypt$N$r$p$salt$hash`` (base64)."""
    salt = salt or secrets.token_bytes(16)
    digest = hashlib.scrypt(
        password.encode(), salt=salt, n=SCRYPT_N, r=SCRYPT_R, p=SCRYPT_P, dklen=32
    )
    b64 = base64.b64encode
    return f"scrypt${SCRYPT_N}${SCRYPT_R}${SCRYPT_P}${b64(salt).decode()}${b64(digest).decode()}"


def check_password(password: str, stored: str) -> bool:
    try:
        scheme, n, r, p, salt, digest = stored.split("$")
        if scheme != "scrypt":
            return False
        got = hashlib.scrypt(
            password.encode(),
            salt=base64.b64decode(salt),
            n=int(n),
            r=int(r),
            p=int(p),
            dklen=len(base64.b64decode(digest)),
        )
    except (ValueError, TypeError):
        return False
    return hmac.compare_digest(got, base64.b64decode(digest))


def new_token() -> str:
    return TOKEN_PREFIX + secrets.token_urlsafe(24)


def token_digest(token: str) -> str:
    return hashlib.sha256(token.encode()).hexdigest()


@dataclass(frozen=True, slots=True)
class Users:
    """The users file, read: passwords by name, tokens by digest."""

    passwords: dict[str, tuple[Role, str]]  # name -> (role, scrypt hash)
    tokens: dict[str, tuple[str, Role]]  # sha256 hex -> (name, role)

    @classmethod
    def read(cls, path: Path) -> Users:
        try:
            data = tomllib.loads(path.read_text())
        except FileNotFoundError:
            raise ConfigError(f"console users file {path} does not exist") from None
        except (OSError, tomllib.TOMLDecodeError) as exc:
            raise ConfigError(f"console users file {path}: {exc}") from None
        passwords: dict[str, tuple[Role, str]] = {}
        tokens: dict[str, tuple[str, Role]] = {}
        for i, entry in enumerate(data.get("user", [])):
            name, role = _named(path, "user", i, entry)
            stored = entry.get("password")
            if not isinstance(stored, str) or not stored.startswith("scrypt$"):
                raise ConfigError(
                    f"{path}: user {name!r} needs password = 'scrypt$...' (set it with "
                    "'sluicegate console user')"
                )
            passwords[name] = (role, stored)
        for i, entry in enumerate(data.get("token", [])):
            name, role = _named(path, "token", i, entry)
            digest = entry.get("sha256")
            if not isinstance(digest, str) or len(digest) != 64:
                raise ConfigError(f"{path}: token {name!r} needs sha256 = '<64 hex digits>'")
            tokens[digest.lower()] = (name, role)
        return cls(passwords, tokens)

    def login(self, name: str, password: str) -> Who | None:
        found = self.passwords.get(name)
        if found is None or not check_password(password, found[1]):
            return None
        return Who(name, found[0], "password")

    def bearer(self, token: str) -> Who | None:
        found = self.tokens.get(token_digest(token))
        return Who(found[0], found[1], "token") if found is not None else None


def _named(path: Path, kind: str, i: int, entry: object) -> tuple[str, Role]:
    if not isinstance(entry, dict):
        raise ConfigError(f"{path}: [[{kind}]] #{i + 1} is not a table")
    name, role = entry.get("name"), entry.get("role")
    if not isinstance(name, str) or not name or "|" in name:
        raise ConfigError(f"{path}: [[{kind}]] #{i + 1} needs a name (no '|')")
    if role not in ROLES:
        raise ConfigError(f"{path}: {kind} {name!r}: role must be viewer or operator")
    return name, role


def add_entry(
    path: Path, kind: Literal["user", "token"], name: str, role: Role, secret: str
) -> None:
    """Append a user (``secret``: a password hash) or a token (its digest) to ``path``,
    replacing an entry of the same kind and name; the file is created 0600."""
    entries = {"user": [], "token": []} if not path.exists() else _raw(path)
    field = "password" if kind == "user" else "sha256"
    kept = [e for e in entries[kind] if e.get("name") != name]
    kept.append({"name": name, "role": role, field: secret})
    entries[kind] = kept
    lines = ["# Sluicegate console users: 'sluicegate console user|token' edits this file."]
    for section in ("user", "token"):
        for e in entries[section]:
            other = "password" if section == "user" else "sha256"
            lines += [
                "",
                f"[[{section}]]",
                f'name = "{e["name"]}"',
                f'role = "{e["role"]}"',
                f'{other} = "{e[other]}"',
            ]
    path.parent.mkdir(parents=True, exist_ok=True)
    path.touch(mode=0o600, exist_ok=True)
    path.write_text("\n".join(lines) + "\n")


def _raw(path: Path) -> dict[str, list[dict[str, str]]]:
    data = tomllib.loads(path.read_text())
    return {k: [dict(e) for e in data.get(k, [])] for k in ("user", "token")}


class Sessions:
    """Signed session values for logged-in callers, valid until their expiry."""

    def __init__(self, ttl_s: float, key: bytes | None = None) -> None:
        self.ttl_s = ttl_s
        self._key = key or secrets.token_bytes(32)

    def issue(self, who: Who, now: float) -> str:
        body = f"{who.name}|{who.role}|{int(now + self.ttl_s)}"
        return f"{body}|{self._mac(body)}"

    def check(self, value: str, now: float) -> Who | None:
        body, _, mac = value.rpartition("|")
        if not body or not hmac.compare_digest(mac, self._mac(body)):
            return None
        name, role, until = body.split("|")
        if role not in ROLES or not until.isdigit() or int(until) < now:
            return None
        return Who(name, "operator" if role == "operator" else "viewer", "session")

    def _mac(self, body: str) -> str:
        return hmac.new(self._key, body.encode(), hashlib.sha256).hexdigest()


DEFAULT_USERS = "console-users.toml"
DEFAULT_TOKEN = "console-operator.token"


def default_users(state_dir: Path) -> tuple[Path, Path | None]:
    """The users file a broker keeps in ``state_dir`` when none is configured: made on
    first start with one operator token, ``admin``, written beside it (0600) for whoever
    installs the broker to read once. Returns the file and the new token's file (None when
    the users file existed already)."""
    users = state_dir / DEFAULT_USERS
    if users.exists():
        return users, None
    token = new_token()
    add_entry(users, "token", "admin", "operator", token_digest(token))
    token_file = state_dir / DEFAULT_TOKEN
    token_file.touch(mode=0o600, exist_ok=True)
    token_file.write_text(token + "\n")
    return users, token_file
