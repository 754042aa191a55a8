"""A sister campus's signed summaries in the decision (broker.core.peering and the wire
model sluicegate.wire_peer): CATS-style offers, what is refused and counted, when a peer's
pool is a candidate, and its predicted completion. Pure: the clock is passed in."""

from __future__ import annotations

import pytest

from broker.core.decision import Placed, Refused
from broker.core.peering import (
    Capacity,
    Link,
    LinkMeter,
    PeerLimits,
    PeerOffers,
    PeerRefused,
    capacities_of,
    offers_of,
    remote_completion_s,
)
from broker.core.placement import decide
from broker.core.reference import decide_reference
from policies.agreement import Standing, judge, statement_for
from policies.evaluate import allowed, peer_origin
from sluicegate import topics
from sluicegate.errors import WireError
from sluicegate.wire_peer import Offer, SummaryBody, parse_probe, parse_summary, sign_summary
from tests.policies.policy_testkit import PARTS_TERMS, SITE_ZONES, key, policy_of, site_doc
from tests.test_broker_core_kit import NOW as NOW_KIT
from tests.test_broker_core_kit import PARAMS, caps, fleet_with, request

NOW = 1_780_000_000.0
NORTH = policy_of(site_doc("north-site", "south-site", send=PARTS_TERMS, receive={}))
SOUTH = policy_of(site_doc("south-site", "north-site", send={}, receive=PARTS_TERMS))
SOUTH_BROKER = "south-site-broker-1"
CAPACITY = [
    Capacity(
        "ocr-rec", "gpu", free_slots=3, slots=4, queue_p50_ms=4.0, queue_p99_ms=20.0, service_ms=6.0
    ),
    Capacity(
        "ocr-rec",
        "cpu",
        free_slots=1,
        slots=8,
        queue_p50_ms=40.0,
        queue_p99_ms=90.0,
        service_ms=60.0,
    ),
    Capacity(
        "surface-det",
        "gpu",
        free_slots=0,
        slots=4,
        queue_p50_ms=30.0,
        queue_p99_ms=50.0,
        service_ms=5.0,
    ),
]


def in_force() -> Standing:
    half = statement_for(SOUTH, "north-site")
    half = half.signed_by(key("officer-dan"), "dan").signed_by(key("officer-erin"), "erin")
    standing = judge(NORTH, "south-site", half, now=NOW)
    assert standing.in_force, standing.reason
    return standing


def body(**changes: object) -> SummaryBody:
    fields: dict[str, object] = {
        "campus": "south-site",
        "peer": "north-site",
        "broker": SOUTH_BROKER,
        "seq": 1,
        "at": NOW,
        "ttl_s": 3.0,
        "agreement_version": 1,
        "currency": "EUR",
        "device_second": 0.002,
        "offers": offers_of(CAPACITY, 0.002),
    }
    fields.update(changes)
    return SummaryBody.model_validate(fields)


def heard(summary: SummaryBody, signer: str = SOUTH_BROKER) -> bytes:
    return sign_summary(summary, key(signer))


def test_offers_carry_raw_figures_normalised_categories_and_one_score() -> None:
    by = {(o.model, o.device_class): o for o in offers_of(CAPACITY, 0.002)}
    gpu, cpu, full = by[("ocr-rec", "gpu")], by[("ocr-rec", "cpu")], by[("surface-det", "gpu")]
    assert (gpu.free_slots, gpu.queue_p50_ms, gpu.service_ms) == (3, 4.0, 6.0)  # L0
    assert (gpu.capacity, gpu.delay, gpu.cost) == (0.75, 0.99, 0.8)  # L1
    assert gpu.score == pytest.approx(0.4 * 0.75 + 0.4 * 0.99 + 0.2 * 0.8, abs=1e-4)  # L2
    assert cpu.score < gpu.score  # fewer free slots, a longer queue
    assert full.score == 0.0  # no free slot, no score


def test_a_summary_survives_the_wire_and_is_kept() -> None:
    book = PeerOffers()
    signed = parse_summary(heard(body()))
    assert book.hear(NORTH, signed, now=NOW + 0.5) is None
    best = book.candidate(
        NORTH, "south-site", in_force(), model="ocr-rec", data_class="ocr-crop", now=NOW + 1.0
    )
    assert isinstance(best, Offer)
    assert best.device_class == "gpu"


@pytest.mark.parametrize(
    ("summary", "signer", "now", "code"),
    [
        (body(peer="west-site"), SOUTH_BROKER, NOW, "wrong_parties"),
        (body(campus="west-site"), SOUTH_BROKER, NOW, "wrong_parties"),
        (body(broker="south-site-broker-9"), "south-site-broker-9", NOW, "unknown_broker"),
        (body(), "north-site-broker-1", NOW, "bad_signature"),  # signed by another key
        (body(at=NOW - 10.0), SOUTH_BROKER, NOW, "stale"),
        (body(at=NOW + 60.0), SOUTH_BROKER, NOW, "from_the_future"),
    ],
)
def test_a_summary_that_fails_a_check_is_refused_counted_and_not_kept(
    summary: SummaryBody, signer: str, now: float, code: str
) -> None:
    book = PeerOffers()
    refusal = book.hear(NORTH, parse_summary(heard(summary, signer)), now=now)
    assert isinstance(refusal, PeerRefused)
    assert refusal.code == code, refusal.reason
    assert book.refused == {code: 1}
    assert book.latest == {}


def test_a_replayed_or_older_summary_is_refused_and_the_newer_kept() -> None:
    book = PeerOffers()
    first, second = heard(body(seq=7)), heard(body(seq=8, at=NOW + 1.0))
    assert book.hear(NORTH, parse_summary(first), now=NOW) is None
    assert book.hear(NORTH, parse_summary(second), now=NOW + 1.0) is None
    again = book.hear(NORTH, parse_summary(first), now=NOW + 1.1)
    assert again is not None
    assert again.code == "replayed"
    assert book.latest["south-site"].seq == 8


def test_a_changed_byte_breaks_the_signature() -> None:
    data = heard(body()).replace(b'"free_slots":3', b'"free_slots":30')
    refusal = PeerOffers().hear(NORTH, parse_summary(data), now=NOW)
    assert refusal is not None
    assert refusal.code == "bad_signature"


def test_a_malformed_summary_is_a_wire_error_naming_the_field() -> None:
    with pytest.raises(WireError, match=r"body\.ttl_s"):
        parse_summary(heard(body()).replace(b'"ttl_s":3.0', b'"ttl_s":-1.0'))
    with pytest.raises(WireError, match="peer summary"):
        parse_summary(b"{not json")


def _candidate(book: PeerOffers, standing: Standing, **kw: object) -> Offer | PeerRefused:
    args: dict[str, object] = {"model": "ocr-rec", "data_class": "ocr-crop", "now": NOW + 1.0}
    args.update(kw)
    return book.candidate(NORTH, "south-site", standing, **args)  # type: ignore[arg-type]


def test_a_peer_pool_is_a_candidate_only_for_listed_classes_fresh_offers_and_free_slots() -> None:
    book = PeerOffers()
    book.hear(NORTH, parse_summary(heard(body())), now=NOW)
    standing = in_force()
    wafer = _candidate(book, standing, data_class="wafer-image")
    assert isinstance(wafer, PeerRefused)
    assert (wafer.code, "lists ocr-crop" in wafer.reason) == ("class_not_listed", True)
    full = _candidate(book, standing, model="surface-det")
    assert isinstance(full, PeerRefused)
    assert full.code == "no_capacity"
    stale = _candidate(book, standing, now=NOW + 3.0)
    assert isinstance(stale, PeerRefused)
    assert stale.code == "stale"


def test_a_peer_that_withdrew_gets_no_work_from_its_next_summary() -> None:
    book = PeerOffers()
    standing = in_force()
    book.hear(NORTH, parse_summary(heard(body(seq=1))), now=NOW)
    assert isinstance(_candidate(book, standing), Offer)
    # Its next summary (a second later) says no half of it is in force any more.
    book.hear(
        NORTH, parse_summary(heard(body(seq=2, at=NOW + 1.0, agreement_version=0))), now=NOW + 1.0
    )
    withdrawn = _candidate(book, standing, now=NOW + 1.2)
    assert isinstance(withdrawn, PeerRefused)
    assert withdrawn.code == "withdrawn"


def test_no_agreement_no_candidate() -> None:
    book = PeerOffers()
    book.hear(NORTH, parse_summary(heard(body())), now=NOW)
    none = judge(NORTH, "south-site", None, now=NOW)
    refusal = _candidate(book, none)
    assert isinstance(refusal, PeerRefused)
    assert refusal.code == "no_agreement"


def test_a_remote_completion_is_the_link_both_ways_and_the_peers_estimate() -> None:
    offer = offers_of(CAPACITY, 0.002)[1]  # ocr-rec on gpu: queue 4 ms, service 6 ms
    link = Link(rtt_s=0.020, bytes_per_s=10e6)
    got = remote_completion_s(offer, link, image_bytes=100_000, result_bytes=1_000)
    assert got == pytest.approx(0.010 + 0.010 + 0.010 + 0.0001 + 0.010)


def test_capacities_come_from_the_workers_in_the_zones_the_agreement_opens() -> None:
    here, elsewhere = SITE_ZONES["south-site"], "campus/fab-south/dc"
    fleet = fleet_with(
        SOUTH,
        [
            (
                caps("south-site-gpu-1", here, device_class="gpu", models=("ocr-rec",)),
                {
                    "capacity": 4,
                    "in_flight": 1,
                    "backlog_ms": 12.0,
                    "service_ms": {"ocr-rec": 6.0},
                },
            ),
            (
                caps("south-npu-1", elsewhere, device_class="npu", models=("ocr-rec",)),
                {"capacity": 8, "service_ms": {"ocr-rec": 9.0}},
            ),
        ],
    )
    (only,) = capacities_of(fleet, {here})
    assert (only.model, only.device_class, only.free_slots, only.slots) == ("ocr-rec", "gpu", 3, 4)
    assert (only.queue_p50_ms, only.service_ms) == (12.0, 6.0)
    assert {c.device_class for c in capacities_of(fleet, {here, elsewhere})} == {"gpu", "npu"}
    assert capacities_of(fleet, set()) == []


def test_a_link_is_known_from_small_and_padded_probes_and_forgotten_when_silent() -> None:
    meter = LinkMeter()
    assert meter.link(NOW) is None
    meter.sent("a" * 32, NOW, 0)
    assert meter.echoed("a" * 32, NOW + 0.040) == pytest.approx(0.040)
    assert meter.link(NOW + 0.05) is None  # no throughput yet
    meter.sent("b" * 32, NOW + 1.0, 32_768)
    meter.echoed("b" * 32, NOW + 1.0 + 0.040 + 0.0032768)  # 32 KiB at 10 MB/s more
    link = meter.link(NOW + 1.1)
    assert link is not None
    assert link.rtt_s == pytest.approx(0.040)
    assert link.bytes_per_s == pytest.approx(10e6, rel=1e-4)
    assert meter.echoed("c" * 32, NOW + 1.2) is None  # not one of ours
    assert meter.link(NOW + 1.0 + 0.05 + 6.0) is None  # no echo for too long


def test_a_probe_never_echoed_is_counted_lost() -> None:
    meter = LinkMeter()
    meter.sent("a" * 32, NOW, 0)
    meter.sent("b" * 32, NOW + 11.0, 0)
    assert (meter.lost, list(meter.pending)) == (1, ["b" * 32])
    assert meter.echoed("a" * 32, NOW + 11.1) is None


def test_a_malformed_probe_is_a_wire_error() -> None:
    with pytest.raises(WireError, match="nonce"):
        parse_probe(b'{"kind": "probe", "broker": "b", "nonce": "xyz", "sent_at": 1.0}')


# -- a sister campus's job, decided inside this campus's own policy -------------------------

FROM_NORTH = peer_origin("north-site")
SOUTH_DC = SITE_ZONES["south-site"]


@pytest.mark.parametrize(
    ("data_class", "zone", "decision"),
    [
        ("ocr-crop", SOUTH_DC, "peer-agreement"),  # listed class, listed zone
        ("ocr-crop", "campus/fab-south/dc", "peer-not-agreed"),  # a zone the terms do not open
        ("wafer-image", SOUTH_DC, "peer-not-agreed"),  # a class the terms do not list
        ("no-such-class", SOUTH_DC, "unknown-class"),
        ("ocr-crop", "campus/nowhere", "unknown-target"),
    ],
)
def test_a_peers_job_may_go_where_our_receive_terms_say(
    data_class: str, zone: str, decision: str
) -> None:
    verdict = allowed(SOUTH, data_class, FROM_NORTH, zone)
    assert (verdict.allowed, verdict.decision) == (decision == "peer-agreement", decision)


def test_an_unlisted_campus_is_an_unknown_origin_and_a_deny_for_every_origin_wins() -> None:
    assert allowed(SOUTH, "ocr-crop", peer_origin("west-site"), SOUTH_DC).decision == (
        "unknown-origin"
    )
    doc = site_doc("south-site", "north-site", send={}, receive=PARTS_TERMS)
    doc["classes"]["ocr-crop"]["deny"] = [SOUTH_DC, "campus/fab-north/** -> campus/**"]
    strict = policy_of(doc)
    verdict = allowed(strict, "ocr-crop", FROM_NORTH, SOUTH_DC)
    assert (verdict.allowed, verdict.decision) == (False, "deny-rule")
    doc["classes"]["ocr-crop"]["deny"] = ["campus/fab-north/** -> campus/**"]  # ours only
    assert allowed(policy_of(doc), "ocr-crop", FROM_NORTH, SOUTH_DC).allowed


def test_the_placement_core_places_a_peers_job_only_on_workers_the_terms_open() -> None:
    fleet = fleet_with(
        SOUTH,
        [
            (
                caps("south-site-gpu-1", SOUTH_DC, models=("ocr-rec",)),
                {"service_ms": {"ocr-rec": 6.0}, "capacity": 4},
            ),
            (
                caps("south-npu-1", "campus/fab-south/dc", models=("ocr-rec",)),
                {"service_ms": {"ocr-rec": 1.0}, "capacity": 16},  # faster, not opened
            ),
        ],
    )
    job = request(origin_zone=FROM_NORTH, model="ocr-rec", data_class="ocr-crop")
    got = decide(fleet, job, SOUTH, now=NOW_KIT, params=PARAMS)
    assert got == decide_reference(fleet, job, SOUTH, now=NOW_KIT, params=PARAMS)
    assert isinstance(got, Placed), got
    assert got.worker_id == "south-site-gpu-1"
    wafer = decide(
        fleet,
        request(origin_zone=FROM_NORTH, model="ocr-rec", data_class="wafer-image"),
        SOUTH,
        now=NOW_KIT,
        params=PARAMS,
    )
    assert isinstance(wafer, Refused)
    assert "agreement with that campus does not list it" in wafer.reason


def test_a_peer_may_send_no_more_than_the_receive_limits() -> None:
    limits = PeerLimits()  # PARTS_TERMS: 50 jobs/s, 2e7 bytes/s
    taken = [limits.admit(SOUTH, "north-site", 100_000, NOW) for _ in range(60)]
    assert taken[:50] == [None] * 50
    over = taken[50]
    assert over is not None
    assert (over.code, "50 jobs/s" in over.reason) == ("peer_rate_limit", True)
    assert limits.admit(SOUTH, "north-site", 100_000, NOW + 0.1) is None  # 5 tokens back
    huge = limits.admit(SOUTH, "north-site", 30_000_000, NOW + 5.0)
    assert huge is not None
    assert huge.code == "peer_bytes_limit"
    closed = limits.admit(NORTH, "south-site", 1, NOW)  # north receives nothing from south
    assert closed is not None
    assert closed.code == "peer_rate_limit"
    stranger = limits.admit(SOUTH, "west-site", 1, NOW)
    assert stranger is not None
    assert stranger.code == "no_agreement"


def test_the_sender_of_a_peer_topic_is_read_from_the_topic() -> None:
    assert topics.peer_of(topics.peer_asks("north-site", "south-site")) == "north-site"
    assert topics.peer_of(topics.peer_summary("south-site", "north-site")) == "south-site"
    assert topics.peer_of(topics.edge_telemetry("line-1")) == ""
    assert topics.peer_asks_shared("a", "b").startswith("$share/brokers/")
