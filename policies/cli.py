"""The ``sluicegate policy`` command line: keygen, sign, verify, check, explain, acl,
audit-verify, schema, and peer-sign and peer-check for agreements with sister campuses, for
compliance officers and operators.

A thin shell: it reads and writes the files it is told to, reads the wall clock (the library
never does), calls the library and turns its errors into one line naming the file, the key and
what would be accepted, with exit status 1 (``audit-verify`` exits 2 when it cannot read the
log at all, so a script can tell "not checked" from "checked and bad"). It holds no policy
logic of its own.
"""

from __future__ import annotations

import datetime as dt
import os
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Annotated

import typer

from policies.agreement import PeerBook, judge, parse_statement, statement_for
from policies.audit import verify_chain
from policies.audit_file import FileAuditStore
from policies.canonical import digest_text
from policies.check import check_policy
from policies.errors import AuditLogUnreadable, PolicyError, PolicyParseError, StoreUnavailable
from policies.evaluate import allowed, explain
from policies.keys import fingerprint, load_signing_key, parse_public_key, write_key_pair
from policies.loader import load_policy, locate, read_bytes, read_document
from policies.model import Policy, policy_from_document
from policies.schema import format_time, json_schema_text
from policies.signing import (
    accept_policy,
    add_signature,
    dump_anchor,
    dump_signatures,
    parse_anchor,
    parse_signatures,
    sign_policy,
)

app = typer.Typer(
    name="policy",
    help="Signed compliance policies: keys, signing, verification, lint, ACLs, audit logs.",
    no_args_is_help=True,
    add_completion=False,
)

PolicyArg = Annotated[Path, typer.Argument(help="Policy file (TOML).", show_default=False)]


@contextmanager
def _reported() -> Iterator[None]:
    try:
        yield
    except PolicyError as exc:
        typer.echo(f"error [{exc.reason}]: {exc}", err=True)
        raise typer.Exit(1) from exc


def _now(text: str | None) -> float:
    if text is None:
        return time.time()
    try:
        moment = dt.datetime.fromisoformat(text)
    except ValueError as exc:
        raise PolicyParseError(
            f"{text!r} is not a date-time; expected e.g. 2027-06-30T00:00:00Z", source="--now"
        ) from exc
    if moment.tzinfo is None:
        raise PolicyParseError("add a time zone, e.g. 2027-06-30T00:00:00Z", source="--now")
    return moment.timestamp()


def _write_atomic(path: Path, data: bytes) -> None:
    """Replace ``path`` in one step, so a crash never leaves half an anchor or signature file."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_bytes(data)
    os.replace(tmp, path)


def _sig_path(policy_path: Path, given: Path | None) -> Path:
    return given if given is not None else policy_path.with_name(policy_path.name + ".sig")


@app.command()
def keygen(
    name: Annotated[str, typer.Argument(help="Key name, e.g. officer-alice.")],
    out_dir: Annotated[Path, typer.Option(help="Where to write NAME.key and NAME.pub.")] = Path(),
) -> None:
    """Create an Ed25519 key pair; print the line to paste into the policy."""
    with _reported():
        key_path, pub_path, key = write_key_pair(out_dir, name)
        typer.echo(f"wrote {key_path} (private: keep it offline, mode 0600) and {pub_path}")
        typer.echo(f'{name} = "{key.public_text}"')


@app.command()
def sign(
    policy_file: PolicyArg,
    key: Annotated[Path, typer.Option(help="Private key file from keygen.")],
    key_id: Annotated[str | None, typer.Option(help="Label; default: the policy's id.")] = None,
    signatures: Annotated[Path | None, typer.Option(help="Default: POLICY.sig")] = None,
) -> None:
    """Add your signature to the policy's detached signature file."""
    with _reported():
        policy = load_policy(policy_file)
        signing_key = load_signing_key(key)
        ids = [r.key_id for r in policy.signers if r.public == signing_key.public]
        label = key_id or (ids[0] if ids else key.stem)
        sig_path = _sig_path(policy_file, signatures)
        bundle = None
        if sig_path.exists():
            bundle = parse_signatures(read_bytes(sig_path), source=str(sig_path))
        bundle = add_signature(bundle, policy, sign_policy(policy, signing_key, label))
        _write_atomic(sig_path, dump_signatures(bundle))
        have = len({s.public for s in bundle.signatures} & policy.signer_keys)
        typer.echo(
            f"signed {policy.campus!r} v{policy.version} {digest_text(policy.digest)} as "
            f"{label!r} into {sig_path}; {have} of {policy.signer_threshold} required signer keys"
        )
        if not ids:
            typer.echo("note: this key is not a signer of this policy (fine for a rotation)")


@app.command(name="add-node")
def add_node_command(
    policy_file: PolicyArg,
    edge: Annotated[str | None, typer.Option(help="Add this edge (line PC).")] = None,
    worker: Annotated[str | None, typer.Option(help="Add this pool worker.")] = None,
    broker: Annotated[str | None, typer.Option(help="Add this broker replica.")] = None,
    app_id: Annotated[str | None, typer.Option("--app", help="Add this vision app.")] = None,
    key: Annotated[
        str | None, typer.Option(help="The node's key, ed25519:… ('sluicegate enroll list').")
    ] = None,
    zone: Annotated[str | None, typer.Option(help="The edge's zone (or a new pool's).")] = None,
    pool: Annotated[str | None, typer.Option(help="The worker's pool.")] = None,
    encryption_key: Annotated[
        str | None,
        typer.Option(help="The worker's sealing key, x25519:… ('sluicegate pool seal-key new')."),
    ] = None,
    app_edge: Annotated[
        list[str] | None, typer.Option("--app-edge", help="An edge the app submits to.")
    ] = None,
    results: Annotated[
        list[str] | None, typer.Option(help="A topic prefix the app takes results under.")
    ] = None,
    sign_key: Annotated[
        Path | None, typer.Option("--sign", help="Sign the new version with this key file.")
    ] = None,
    key_id: Annotated[str | None, typer.Option(help="Label of that signature.")] = None,
) -> None:
    """Add a node or an app to the policy file, raise its version, and (with --sign) sign
    it afresh; the other officers add their signatures with 'policy sign'. Comments and
    layout are kept."""
    from policies.edit import add_node

    chosen = [
        (kind, name)
        for kind, name in (("edge", edge), ("worker", worker), ("broker", broker), ("app", app_id))
        if name is not None
    ]
    with _reported():
        if len(chosen) != 1:
            raise PolicyParseError(
                "name exactly one of --edge, --worker, --broker or --app", source="add-node"
            )
        kind, name = chosen[0]
        text, policy = add_node(
            read_bytes(policy_file).decode("utf-8"),
            kind,  # type: ignore[arg-type]
            name,
            key=key,
            zone=zone,
            pool=pool,
            edges=app_edge or (),
            results=results or (),
            encryption_key=encryption_key,
            source=str(policy_file),
        )
        _write_atomic(policy_file, text.encode("utf-8"))
        typer.echo(f"added {kind} {name!r}: {policy.campus!r} is now v{policy.version}")
        sig_path = _sig_path(policy_file, None)
        if sign_key is None:
            typer.echo(f"sign it: sluicegate policy sign {policy_file} --key <officer key>")
            return
        signing_key = load_signing_key(sign_key)
        ids = [r.key_id for r in policy.signers if r.public == signing_key.public]
        label = key_id or (ids[0] if ids else sign_key.stem)
        bundle = add_signature(None, policy, sign_policy(policy, signing_key, label))
        _write_atomic(sig_path, dump_signatures(bundle))
        typer.echo(
            f"signed v{policy.version} as {label!r} into {sig_path}; 1 of "
            f"{policy.signer_threshold} required signer keys"
        )


@app.command()
def verify(
    policy_file: PolicyArg,
    signatures: Annotated[Path | None, typer.Option(help="Default: POLICY.sig")] = None,
    anchor: Annotated[
        Path | None, typer.Option(help="Last accepted policy (JSON); absent: first install.")
    ] = None,
    update_anchor: Annotated[bool, typer.Option(help="Write the new anchor on success.")] = False,
    now: Annotated[str | None, typer.Option(help="Evaluate at this time (ISO 8601).")] = None,
) -> None:
    """Check signatures, threshold, rollback, rotation and expiry."""
    with _reported():
        policy = load_policy(policy_file)
        sig_path = _sig_path(policy_file, signatures)
        bundle = parse_signatures(read_bytes(sig_path), source=str(sig_path))
        if update_anchor and anchor is None:
            raise PolicyParseError("--update-anchor needs --anchor PATH", source="verify")
        previous = None
        if anchor is not None and anchor.exists():
            previous = parse_anchor(read_bytes(anchor), source=str(anchor))
        else:
            typer.echo("note: no anchor: trusting this policy's own signers (first install)")
        accepted = accept_policy(policy, bundle, now=_now(now), anchor=previous)
        if update_anchor and anchor is not None:
            _write_atomic(anchor, dump_anchor(accepted))
            typer.echo(f"anchor updated: {anchor}")
        typer.echo(
            f"OK {policy.campus!r} v{policy.version} {digest_text(policy.digest)}, expires "
            f"{format_time(policy.expires)}, threshold {policy.signer_threshold} met"
        )


@app.command(name="peer-sign")
def peer_sign(
    policy_file: PolicyArg,
    peer: Annotated[str, typer.Option(help="The sister campus the half is for.")],
    key: Annotated[Path, typer.Option(help="Your private key file from keygen.")],
    key_id: Annotated[str | None, typer.Option(help="Label; default: the policy's id.")] = None,
    out: Annotated[
        Path | None, typer.Option(help="Default: CAMPUS.to-PEER.agreement.json beside the policy.")
    ] = None,
) -> None:
    """Add your signature to this campus's half of the agreement with PEER: its [peers]
    entry's terms, or a withdrawal when the policy no longer lists PEER. Hand the file to
    PEER's officers (or let the broker publish it)."""
    with _reported():
        policy = load_policy(policy_file)
        signing_key = load_signing_key(key)
        ids = [r.key_id for r in policy.signers if r.public == signing_key.public]
        label = key_id or (ids[0] if ids else key.stem)
        path = out or policy_file.with_name(f"{policy.campus}.to-{peer}.agreement.json")
        statement = statement_for(policy, peer)
        if path.exists():
            held = parse_statement(read_bytes(path), source=str(path))
            if held.digest == statement.digest:
                statement = held  # the other officers' signatures stay
        statement = statement.signed_by(signing_key, label)
        _write_atomic(path, statement.to_bytes())
        what = "a withdrawal" if statement.withdrawn else "the terms"
        have = len(statement.signer_keys() & policy.signer_keys)
        typer.echo(
            f"signed {policy.campus!r}'s half for {peer!r} (v{policy.version}, {what}) as "
            f"{label!r} into {path}; {have} of {policy.signer_threshold} officer keys"
        )
        if not ids:
            typer.echo("note: this key is not a signer of this policy: the peer will refuse it")


@app.command(name="peer-check")
def peer_check(
    policy_file: PolicyArg,
    half: Annotated[Path, typer.Argument(help="The peer's signed half (JSON).")],
    now: Annotated[str | None, typer.Option(help="Evaluate at this time (ISO 8601).")] = None,
) -> None:
    """Whether the agreement with the campus that signed HALF is in force under this policy:
    its officers' signatures, the terms mirrored, expiry. Exit 1 when it is not."""
    with _reported():
        policy = load_policy(policy_file)
        theirs = parse_statement(read_bytes(half), source=str(half))
        PeerBook().offer(policy, theirs)
        standing = judge(policy, theirs.campus, theirs, now=_now(now))
        typer.echo(f"{standing.code}: {standing.reason}")
        if not standing.in_force:
            raise typer.Exit(1)


@app.command()
def check(
    policy_file: PolicyArg,
    strict: Annotated[bool, typer.Option(help="Fail on warnings too.")] = False,
) -> None:
    """Lint: unknown zones, shadowed or redundant rules, unprocessable classes, key reuse."""
    with _reported():
        doc, text = read_document(read_bytes(policy_file), source=str(policy_file))
        findings = check_policy(policy_from_document(doc))
        for f in findings:
            line = locate(text, f.loc)
            where = f"{policy_file}:{line}" if line else str(policy_file)
            typer.echo(f"{where}: {f.severity}[{f.code}] {f.key}: {f.message}")
        errors = sum(f.severity == "error" for f in findings)
        typer.echo(f"{errors} error(s), {len(findings) - errors} warning(s)")
        if errors or (strict and findings):
            raise typer.Exit(1)


def _zone_of(policy: Policy, name: str) -> str:
    if name in policy.zones:
        return name
    zone = policy.worker_zone(name)
    if zone is not None:
        typer.echo(f"(worker {name!r} sits in zone {zone!r})")
        return zone
    return name


@app.command(name="explain")
def explain_command(
    policy_file: PolicyArg,
    data_class: Annotated[str, typer.Argument(help="Data class, e.g. wafer-image.")],
    origin: Annotated[
        str, typer.Argument(help="Origin zone (peer:<campus> for a sister campus's job).")
    ],
    target: Annotated[str, typer.Argument(help="Target zone or worker id.")],
) -> None:
    """Say in words whether a class may go from one zone to another, and why (exit 1: no)."""
    with _reported():
        policy = load_policy(policy_file)
        target_zone = _zone_of(policy, target)
        for line in explain(policy, data_class, origin, target_zone):
            typer.echo(line)
        if not allowed(policy, data_class, origin, target_zone).allowed:
            raise typer.Exit(1)


def _hex32(text: str) -> bytes:
    try:
        value = bytes.fromhex(text)
    except ValueError:
        value = b""
    if len(value) != 32:
        raise PolicyParseError(
            f"{text[:70]!r} is not a head hash; expected 64 hex digits", source="--expected-head"
        )
    return value


@app.command(name="audit-verify")
def audit_verify(
    file: Annotated[Path | None, typer.Option(help="Audit log file (JSON lines).")] = None,
    redis_url: Annotated[str | None, typer.Option(help="Redis URL of a stream log.")] = None,
    stream: Annotated[str | None, typer.Option(help="Stream key (with --redis-url).")] = None,
    policy_file: Annotated[
        Path | None, typer.Option("--policy", help="Trust every key of this policy.")
    ] = None,
    key: Annotated[list[str] | None, typer.Option(help="Trusted key ed25519:... (repeat).")] = None,
    expected_head: Annotated[str | None, typer.Option(help="Known head hash (hex).")] = None,
) -> None:
    """Verify an audit log's chain and signatures; name the first broken record.

    Exit status 1: the log does not verify; 2: the log file cannot be read."""
    with _reported():
        trusted = {parse_public_key(k) for k in key or []}
        if policy_file is not None:
            trusted |= load_policy(policy_file).listed_keys()
        if not trusted:
            raise PolicyParseError("give --policy or at least one --key", source="audit-verify")
        head = _hex32(expected_head) if expected_head else None
        if file is not None:
            try:
                summary = verify_chain(FileAuditStore(file).entries(), trusted, expected_head=head)
            except AuditLogUnreadable as exc:
                typer.echo(f"error [{exc.reason}]: {exc}", err=True)
                raise typer.Exit(2) from exc
        elif redis_url is not None and stream is not None:
            import redis  # only this command reads a stream: the others start without it

            from policies.redis_stores import RedisStreamAuditStore

            client = redis.Redis.from_url(redis_url)
            try:
                store = RedisStreamAuditStore(client, stream)
                summary = verify_chain(store.entries(), trusted, expected_head=head)
            except StoreUnavailable as exc:
                raise StoreUnavailable(f"{redis_url}: {exc}") from exc
            finally:
                client.close()
        else:
            raise PolicyParseError(
                "give --file PATH, or --redis-url URL with --stream KEY", source="audit-verify"
            )
        signers = ", ".join(sorted(fingerprint(s).hex() for s in summary.signers)) or "none"
        typer.echo(f"OK {summary.count} records, head {summary.head.hex()}, signers: {signers}")


@app.command()
def schema() -> None:
    """Print the policy file's JSON Schema."""
    typer.echo(json_schema_text(), nl=False)
