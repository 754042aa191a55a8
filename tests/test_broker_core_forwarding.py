"""Whether a job no worker here can take is asked of a sister campus, and of which
(broker.core.forwarding), and the placement turn offering it there before the waiting room
(broker.core.batch). Pure: the clock is passed in."""

from __future__ import annotations

from typing import Any

import pytest

from broker.core.batch import decide_turn
from broker.core.forwarding import ASK_MARGIN_S, Forward, forward_to
from broker.core.peering import Link, PeerOffers, PeerRefused
from policies.agreement import Standing
from sluicegate.wire_peer import parse_summary
from sluicegate.wire_pool import PlacementRequest
from tests.test_broker_core_kit import PARAMS, caps, fleet_with
from tests.test_broker_peering import NORTH, NOW, body, heard, in_force

LINK = Link(rtt_s=0.040, bytes_per_s=10e6)  # 20 ms each way, 10 MB/s
GPU_DONE_S = (4.0 + 6.0) / 1000.0  # south's best ocr-rec offer: queue p50 and service


def ask(**changes: Any) -> PlacementRequest:
    fields: dict[str, Any] = {
        "job_id": "job-1",
        "edge_id": "north-l1-pc",
        "origin_zone": "campus/fab-north/line-1",
        "model": "ocr-rec",
        "data_class": "ocr-crop",
        "payload_sha256": "0" * 64,
        "payload_bytes": 50_000,
        "priority": 5,
        "deadline_at": NOW + 1.0,
        "submitted_at": NOW,
        "max_wait_ms": 100.0,  # the edge waits 200 ms
    }
    fields.update(changes)
    return PlacementRequest.model_validate(fields)


def offers(**summary: Any) -> PeerOffers:
    book = PeerOffers()
    assert book.hear(NORTH, parse_summary(heard(body(**summary))), now=NOW) is None
    return book


def choose(
    request: PlacementRequest | None = None,
    *,
    book: PeerOffers | None = None,
    standing: Standing | None = None,
    link: Link | None = LINK,
    waited_s: float = 0.0,
) -> Forward | PeerRefused:
    held = standing or in_force()
    return forward_to(
        NORTH,
        request or ask(),
        book or offers(),
        lambda _peer: held,
        {"south-site": link},
        now=NOW + 0.1,
        waited_s=waited_s,
    )


def test_a_peer_with_a_free_slot_in_time_is_asked() -> None:
    choice = choose()
    assert isinstance(choice, Forward)
    assert (choice.peer, choice.offer.device_class) == ("south-site", "gpu")
    # The ask's round trip, the image there, the peer's queue and service, the result back.
    there = LINK.rtt_s / 2 + 50_000 / LINK.bytes_per_s
    back = LINK.rtt_s / 2 + 2048 / LINK.bytes_per_s
    expected = NOW + 0.1 + LINK.rtt_s + ASK_MARGIN_S + there + GPU_DONE_S + back
    assert choice.done_at == pytest.approx(expected)
    assert choice.answer_by == pytest.approx(NOW + 0.1 + 0.200)  # while the edge waits


@pytest.mark.parametrize(
    ("kwargs", "words"),
    [
        ({"request": ask(data_class="wafer-image")}, "may not go to 'south-site'"),
        ({"request": ask(model="surface-det")}, "no free slot"),
        ({"book": PeerOffers()}, "no fresh summary"),
        ({"link": None}, "link is not measured"),
        ({"request": ask(max_wait_ms=20.0)}, "the edge waits 40 ms more"),
        ({"waited_s": 0.180}, "the edge waits 20 ms more"),
        ({"request": ask(deadline_at=NOW + 0.15)}, "after the deadline"),
        (
            {"standing": Standing("south-site", "withdrawn", "its policy no longer lists us")},
            "no longer lists us",
        ),
    ],
)
def test_no_peer_is_asked_when_it_cannot_do_better_and_the_refusal_says_why(
    kwargs: dict[str, Any], words: str
) -> None:
    choice = choose(**kwargs)
    assert isinstance(choice, PeerRefused)
    assert choice.code == "no_peer"
    assert words in choice.reason
    assert choice.reason.startswith("south-site: ")


def test_a_campus_that_sends_nothing_asks_no_one() -> None:
    from tests.test_broker_peering import SOUTH  # south sends no class to north

    choice = forward_to(SOUTH, ask(), offers(), in_force, {}, now=NOW, waited_s=0.0)
    assert isinstance(choice, PeerRefused)
    assert "sends no class" in choice.reason


def test_the_turn_asks_a_peer_for_what_found_no_worker_before_the_waiting_room() -> None:
    fleet = fleet_with(NORTH, [])  # no worker at all
    asked: list[str] = []
    held: list[str] = []

    def forward(item: PlacementRequest, _now: float) -> bool:
        asked.append(item.job_id)
        return item.job_id != "stays"

    turn = decide_turn(
        fleet,
        [ask(job_id="goes"), ask(job_id="stays")],
        lambda r: r,
        NORTH,
        now=NOW,
        params=PARAMS,
        hold=lambda item, _now: held.append(item.job_id) or False,
        sealable=lambda _r: None,
        forward=forward,
    )
    assert asked == ["goes", "stays"]
    assert turn.forwarded == 1
    assert [r.item.job_id for r in turn.refused] == ["stays"]
    assert turn.refused[0].code == "no_worker"


def test_a_job_a_worker_here_would_finish_late_is_asked_of_the_peer() -> None:
    """North's one worker would take it, behind 2 s of work: the peer answers in time."""
    worker = "north-site-gpu-1"
    zone = "campus/north-site/dc"
    busy = fleet_with(
        NORTH,
        [
            (
                caps(worker, zone, models=("ocr-rec",)),
                {"backlog_ms": 2000.0, "service_ms": {"ocr-rec": 10.0}},
            )
        ],
        now=NOW,
    )
    asked: list[str] = []
    early = ask(job_id="early", deadline_at=NOW + 5.0)  # 2 s of work ahead is in time
    late = ask(job_id="late", deadline_at=NOW + 0.5)
    turn = decide_turn(
        busy,
        [early, late],
        lambda r: r,
        NORTH,
        now=NOW,
        params=PARAMS,
        hold=lambda _item, _now: False,
        sealable=lambda _r: None,
        forward=lambda item, _now: asked.append(item.job_id) is None,
    )
    assert asked == ["late"]
    assert turn.forwarded == 1
    assert [item.job_id for item, _placed in turn.placed] == ["early"]
