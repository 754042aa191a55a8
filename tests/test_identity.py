"""A node's own identity: the pure checks (who it connects as, who is senior) as tables, and
the guard over the in-memory transport: claiming an identity another process holds, and
being fenced by an older instance while serving. The real-process forms are in
tests/test_campus_attacks.py."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from sluicegate import topics, wire
from sluicegate.config import MqttSettings
from sluicegate.errors import ConfigError, IdentityInUse
from sluicegate.identity import (
    IdentityGuard,
    Instance,
    check_client_identity,
    node_lock,
    rival,
    serve_guarded,
)
from sluicegate.memory_transport import MemoryBroker, MemoryTransport
from sluicegate.transport import Message

ME = Instance("me", 1000.0, "pc-a")
STATUS = topics.edge_status("line-1-pc")


def status(state: str, instance: str | None, since: float | None) -> wire.NodeStatus:
    return wire.NodeStatus(
        node="line-1-pc",
        kind="edge",
        zone="z",
        state=state,  # type: ignore[arg-type]
        instance=instance,
        since=since,
        host="pc-b",
    )


@pytest.mark.parametrize(
    ("seen", "standing"),
    [
        (status("online", "me", 1000.0), "self"),
        (status("online", "old", 900.0), "senior"),
        (status("online", "new", 1100.0), "junior"),
        (status("online", "aaa", 1000.0), "senior"),  # a tie: the smaller id is senior
        (status("offline", "old", 900.0), "gone"),
        (status("online", None, None), "gone"),
    ],
)
def test_rival_standing(seen: wire.NodeStatus, standing: str) -> None:
    assert rival(ME, seen) == standing


@pytest.mark.parametrize(
    ("settings", "cert_name", "message"),
    [
        (MqttSettings(), None, "has no TLS configured"),
        (MqttSettings(tls_ca_file=Path("ca.pem")), None, "no client certificate"),
        (
            MqttSettings(
                tls_ca_file=Path("ca.pem"),
                tls_cert_file=Path("n.pem"),
                tls_key_file=Path("n.key"),
            ),
            "line-2-pc",
            "certificate of 'line-2-pc'",
        ),
    ],
)
def test_a_node_connects_only_as_itself(
    settings: MqttSettings, cert_name: str | None, message: str
) -> None:
    with pytest.raises(ConfigError, match=message):
        check_client_identity(settings, "line-1-pc", cert_name)


def test_plaintext_and_its_own_certificate_pass() -> None:
    check_client_identity(MqttSettings(plaintext=True), "line-1-pc", None)
    tls = MqttSettings(
        tls_ca_file=Path("ca.pem"), tls_cert_file=Path("n.pem"), tls_key_file=Path("n.key")
    )
    check_client_identity(tls, "line-1-pc", "line-1-pc")


def test_a_second_process_on_the_same_state_is_refused_by_the_lock(tmp_path: Path) -> None:
    with node_lock(tmp_path, "line-1-pc"):
        with (
            pytest.raises(IdentityInUse, match="already serves from"),
            node_lock(tmp_path, "line-1-pc"),
        ):
            pass
        with node_lock(tmp_path, "line-2-pc"):  # another node beside it is fine
            pass
    with node_lock(tmp_path, "line-1-pc"):  # released when the first stopped
        pass


def _guard(transport: MemoryTransport, me: Instance, announced: asyncio.Event) -> IdentityGuard:
    return IdentityGuard(
        transport,
        node="line-1-pc",
        status_topic=STATUS,
        reannounce=announced.set,
        grace_s=0.5,
        me=me,
    )


async def test_claim_with_no_one_else_holding_it() -> None:
    broker = MemoryBroker()
    old = MemoryTransport(broker)
    old.publish_nowait(
        Message(STATUS, wire.dump(status("offline", "old", 900.0)), qos=1, retain=True)
    )
    guard = _guard(MemoryTransport(broker), ME, asyncio.Event())
    await guard.claim()  # offline: the last one stopped or died; no wait
    assert not guard.fenced.is_set()


async def test_a_newcomer_whose_connection_is_taken_back_refuses_to_start() -> None:
    broker = MemoryBroker()
    incumbent = MemoryTransport(broker)
    live = status("online", "old", 900.0)
    incumbent.publish_nowait(Message(STATUS, wire.dump(live), qos=1, retain=True))
    newcomer = MemoryTransport(broker)
    guard = _guard(newcomer, ME, asyncio.Event())
    claiming = asyncio.ensure_future(guard.claim())
    await asyncio.wait_for(guard.waiting.wait(), 5)  # it saw the live holder's status
    newcomer.crash()  # the incumbent took the connection back
    with pytest.raises(IdentityInUse, match="already served by instance old"):
        await claiming


async def test_while_serving_an_older_instance_fences_this_one_and_a_newer_is_outranked() -> None:
    broker = MemoryBroker()
    announced = asyncio.Event()
    guard = _guard(MemoryTransport(broker), ME, announced)
    await guard.claim()
    other = MemoryTransport(broker)
    other.publish_nowait(Message(STATUS, wire.dump(status("online", "new", 1100.0)), qos=1))
    await asyncio.wait_for(announced.wait(), 5)  # a junior: this one says it serves
    assert not guard.fenced.is_set()
    stop = asyncio.Event()
    started = asyncio.Event()
    ran: list[str] = []

    async def run(until: asyncio.Event) -> None:
        ran.append("started")
        started.set()
        await until.wait()
        ran.append("stopped")

    serving = asyncio.ensure_future(serve_guarded(guard, stop, run))
    await asyncio.wait_for(started.wait(), 5)
    other.publish_nowait(Message(STATUS, wire.dump(status("online", "old", 900.0)), qos=1))
    with pytest.raises(IdentityInUse, match="started first"):
        await asyncio.wait_for(serving, 5)
    assert ran == ["started", "stopped"]
