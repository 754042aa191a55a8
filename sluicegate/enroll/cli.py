"""``sluicegate ca ...`` and ``sluicegate enroll ...``: the operator's side of identities.

``ca init`` makes the campus CA folder; ``ca server-cert`` the certificate Mosquitto serves;
``ca issue`` a node's key and certificate on the CA's own machine (the first broker);
``enroll token`` a join token for one node; ``enroll list`` who enrolled, with the line that
adds each to the policy. Thin: flags in, library calls, one clear line on error (exit 2).
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Annotated

import typer

from sluicegate.errors import SluicegateError
from sluicegate.topics import PEER_BRIDGE_PREFIX

ca_app = typer.Typer(help="The campus certificate authority.", no_args_is_help=True)
enroll_app = typer.Typer(help="Join tokens and enrolled nodes.", no_args_is_help=True)

CaDir = Annotated[Path, typer.Option("--ca-dir", help="The campus CA folder ('ca init').")]


def _fail(message: str) -> None:
    typer.secho(f"error: {message}", fg=typer.colors.RED, err=True)
    raise typer.Exit(2)


def _duration(text: str) -> float:
    units = {"s": 1, "m": 60, "h": 3600, "d": 86400}
    number, unit = (text[:-1], text[-1]) if text[-1:] in units else (text, "s")
    try:
        return float(number) * units[unit]
    except ValueError:
        raise SluicegateError(f"{text!r} is not a duration like 30m, 2h or 1d") from None


@ca_app.command("init")
def ca_init(
    ca_dir: CaDir,
    campus: Annotated[str, typer.Option(help="The campus's name, as in the policy.")],
) -> None:
    """Make the campus CA (ECDSA P-256) and the join-token key, private to this folder."""
    from sluicegate.enroll.authority import init_folder

    try:
        ca = init_folder(ca_dir, campus, now=time.time())
    except SluicegateError as exc:
        _fail(str(exc))
        return
    typer.echo(f"campus CA in {ca_dir}: {ca.fingerprint}; give ca.pem to Mosquitto")


@ca_app.command("server-cert")
def ca_server_cert(
    ca_dir: CaDir,
    host: Annotated[list[str], typer.Option(help="A name or address clients use (repeat).")],
    out_dir: Annotated[Path, typer.Option(help="Where to write server.pem and server.key.")],
) -> None:
    """A server certificate for Mosquitto (its hosts as SANs) and its key."""
    from sluicegate import pki

    try:
        ca = pki.load_authority(ca_dir)
        key, cert = pki.server_identity(ca, host, now=time.time())
        pki.write_private(out_dir / "server.key", pki.key_pem(key))
        (out_dir / "server.pem").write_bytes(pki.cert_pem(cert))
        (out_dir / "ca.pem").write_bytes(pki.cert_pem(ca.cert))
    except (SluicegateError, OSError) as exc:
        _fail(str(exc))
        return
    typer.echo(f"wrote {out_dir}/server.pem, server.key and ca.pem for {', '.join(host)}")


# Who 'ca issue' makes identities for: the first broker replica, an observer, and a sister
# campus's bridge (its key and certificate go to that campus's Mosquitto).
LOCAL_ROLES = ("broker", "observer", "bridge")


@ca_app.command("issue")
def ca_issue(
    ca_dir: CaDir,
    node: Annotated[str, typer.Option(help="The node id (its certificate's CN).")],
    state_dir: Annotated[Path, typer.Option(help="The node's state folder.")],
    role: Annotated[
        str,
        typer.Option(help="broker, observer (a twin recorder) or bridge (a sister campus's)."),
    ] = "broker",
) -> None:
    """A key made here and its certificate, for a node on this very machine (the first
    broker replica, which holds the CA, or an observer), or for a sister campus's bridge
    (--node peer.<its campus>; hand the three files to its operators): node.key, node.pem
    and ca.pem in STATE_DIR, and the node in the registry 'enroll list' reads."""
    from sluicegate.enroll.authority import Authority

    if role not in LOCAL_ROLES:
        _fail(
            f"--role {role!r}: 'ca issue' makes {' or '.join(LOCAL_ROLES)} identities; "
            "edges, pool workers and apps enroll with a join token ('enroll token')"
        )
    if (role == "bridge") != node.startswith(PEER_BRIDGE_PREFIX):
        _fail(
            f"--node {node!r} --role {role}: a sister campus's bridge is "
            f"'{PEER_BRIDGE_PREFIX}<its campus id>' with --role bridge, and only it"
        )
    try:
        public = Authority(ca_dir).issue_here(node, role, state_dir, now=time.time())
    except (SluicegateError, OSError) as exc:
        _fail(str(exc))
        return
    typer.echo(f"{node}: key and certificate in {state_dir}; its key {public}")


@enroll_app.command("token")
def enroll_token(
    ca_dir: CaDir,
    node: Annotated[str, typer.Option(help="The new node's id.")],
    role: Annotated[str, typer.Option(help="edge, pool, broker or app.")],
    zone: Annotated[str, typer.Option(help="The zone it sits in.")],
    url: Annotated[str, typer.Option(help="The enrollment endpoint, http://broker:8780/v1/enroll")],
    mqtt: Annotated[str, typer.Option(help="The campus Mosquitto, host:port (TLS).")],
    policy: Annotated[Path, typer.Option(help="The signed campus policy (its anchor is pinned).")],
    ttl: Annotated[str, typer.Option(help="How long the token is valid: 30m, 2h, 1d.")] = "1h",
) -> None:
    """Print a single-use join token for one node; hand it to the plant engineer."""
    from policies import load_policy
    from policies.signing import TrustAnchor
    from sluicegate.enroll.authority import Authority
    from sluicegate.enroll.token import anchor_fingerprint, claims_for, make_token

    try:
        authority = Authority(ca_dir)
        anchor = anchor_fingerprint(TrustAnchor.of(load_policy(policy)))
        claims = claims_for(
            node=node,
            role=role,  # type: ignore[arg-type]
            zone=zone,
            ttl_s=_duration(ttl),
            now=time.time(),
            url=url,
            mqtt=mqtt,
            ca=authority.ca_fingerprint,
            anchor=anchor,
        )
        typer.echo(make_token(authority.token_key, claims))
    except SluicegateError as exc:
        _fail(str(exc))


@enroll_app.command("list")
def enroll_list(
    ca_dir: CaDir,
    policy: Annotated[Path | None, typer.Option(help="Mark the nodes it already lists.")] = None,
) -> None:
    """Every enrolled node and its key, with the line that adds it to the policy."""
    from policies import load_policy
    from sluicegate.enroll.authority import Authority
    from sluicegate.enroll.listing import Listing

    try:
        authority = Authority(ca_dir)
        listed = load_policy(policy) if policy is not None else None
    except SluicegateError as exc:
        _fail(str(exc))
        return
    for entry in authority.enrolled():
        for line in Listing.of(entry, listed).lines():
            typer.echo(line)


@enroll_app.command("app")
def enroll_app_command(
    join: Annotated[str, typer.Option("--join", help="The app's join token (role app).")],
    out_dir: Annotated[Path, typer.Option(help="Where its key and certificate go.")],
) -> None:
    """Enroll a vision app: its key made here, its certificate and the campus CA in
    OUT_DIR, for any MQTT client to log in with (tls_cert_file, tls_key_file)."""
    from sluicegate.enroll.client import enroll

    try:
        done = enroll(join, out_dir, role="app", now=time.time())
    except SluicegateError as exc:
        _fail(str(exc))
        return
    typer.echo(
        f"app {done.node}: key, certificate and CA in {out_dir}; connect to "
        f"{done.mqtt_host}:{done.mqtt_port} with TLS (node.pem, node.key, ca.pem)"
    )
