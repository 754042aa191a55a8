"""The link classes between a job's origin zone and a worker's zone, and which one a pair
is in: the one definition the placement parameters, the scoring and a learned placement
policy share. Pure."""

from __future__ import annotations

SAME_ZONE, SAME_SITE, OFF_SITE = 0, 1, 2
LINK_NAMES = ("same zone", "on campus", "off site")


def link_class(origin_zone: str, zone: str, campus_prefix: str) -> int:
    """Same zone, both on campus (zones under ``<campus_prefix>/``), or off site."""
    if origin_zone == zone:
        return SAME_ZONE
    prefix = campus_prefix + "/"
    if origin_zone.startswith(prefix) and zone.startswith(prefix):
        return SAME_SITE
    return OFF_SITE
