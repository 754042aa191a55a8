"""Reading a node's ``/metrics`` in tests: one scrape, one parse (prometheus_client's own
parser), and the sum of the samples a test asks about."""

from __future__ import annotations

import urllib.request

from prometheus_client.parser import text_string_to_metric_families

Samples = dict[tuple[str, frozenset[tuple[str, str]]], float]


def exposition(url: str) -> str:
    """The page at ``url`` as text."""
    with urllib.request.urlopen(url, timeout=10) as reply:
        body: bytes = reply.read()
    return body.decode()


def samples(text: str) -> Samples:
    """Every sample of a Prometheus text page, by name and labels."""
    out: Samples = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            out[(s.name, frozenset(s.labels.items()))] = s.value
    return out


def scrape(url: str) -> Samples:
    return samples(exposition(url))


def total(found: Samples, name: str, **labels: str) -> float:
    """The sum of ``name``'s samples whose labels include ``labels`` (0 when none)."""
    want = set(labels.items())
    return sum(v for (n, ls), v in found.items() if n == name and want <= ls)


def has(found: Samples, name: str, **labels: str) -> bool:
    """Whether the page has a sample of ``name`` whose labels include ``labels``."""
    want = set(labels.items())
    return any(n == name and want <= ls for (n, ls) in found)
