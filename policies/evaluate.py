"""Evaluation: may data class D from zone O be processed in zone T, and why.

Deny rules are checked first and a matching deny always wins; then allow rules; anything no
allow rule matches is denied, and so is every unknown data class or zone. A job from a
sister campus has the origin ``peer:<campus>`` (no zone of ours can be spelled so): what the
agreement's ``receive`` terms list (class and zone) is allowed, unless a deny rule of the
class without an origin (one for every origin) matches the zone; nothing else is. Verdicts are
memoised per (class, origin, target) in the policy's bounded cache, so a repeated query is a
dict lookup. Pure: no I/O, no clock, no mutation except that cache.
"""

from __future__ import annotations

from policies.model import EVERYWHERE, Policy, Rule, Verdict

VERDICT_CACHE_LIMIT = 65_536


PEER_ORIGIN = "peer:"  # the origin of a job a sister campus asks this one to run


def peer_origin(campus: str) -> str:
    return PEER_ORIGIN + campus


def peer_of_origin(origin: str) -> str:
    """The sister campus a ``peer:<campus>`` origin names; "" for one of our zones."""
    return origin.removeprefix(PEER_ORIGIN) if origin.startswith(PEER_ORIGIN) else ""


def decide(policy: Policy, data_class: str, origin_zone: str, target_zone: str) -> Verdict:
    """The verdict, computed from the rules without the cache."""
    cls = policy.classes.get(data_class)
    if cls is None:
        return Verdict(False, "unknown-class", data_class, origin_zone, target_zone)
    if origin_zone.startswith(PEER_ORIGIN):
        return _from_peer(policy, data_class, origin_zone, target_zone)
    origin = policy.zone_segments.get(origin_zone)
    if origin is None:
        return Verdict(False, "unknown-origin", data_class, origin_zone, target_zone)
    target = policy.zone_segments.get(target_zone)
    if target is None:
        return Verdict(False, "unknown-target", data_class, origin_zone, target_zone)
    for rule in cls.deny:
        if rule.matches(origin, target):
            return Verdict(False, "deny-rule", data_class, origin_zone, target_zone, rule)
    for rule in cls.allow:
        if rule.matches(origin, target):
            return Verdict(True, "allow-rule", data_class, origin_zone, target_zone, rule)
    return Verdict(False, "default-deny", data_class, origin_zone, target_zone)


def _from_peer(policy: Policy, data_class: str, origin_zone: str, target_zone: str) -> Verdict:
    entry = policy.peers.get(origin_zone.removeprefix(PEER_ORIGIN))
    if entry is None:
        return Verdict(False, "unknown-origin", data_class, origin_zone, target_zone)
    target = policy.zone_segments.get(target_zone)
    if target is None:
        return Verdict(False, "unknown-target", data_class, origin_zone, target_zone)
    for rule in policy.classes[data_class].deny:
        if rule.origin == EVERYWHERE and rule.target.matches(target):
            return Verdict(False, "deny-rule", data_class, origin_zone, target_zone, rule)
    terms = entry.receive
    if data_class in terms.classes and target_zone in terms.zones:
        return Verdict(True, "peer-agreement", data_class, origin_zone, target_zone)
    return Verdict(False, "peer-not-agreed", data_class, origin_zone, target_zone)


def allowed(policy: Policy, data_class: str, origin_zone: str, target_zone: str) -> Verdict:
    """May ``data_class`` from ``origin_zone`` be processed in ``target_zone``? With the rule."""
    cache = policy.verdict_cache
    key = (data_class, origin_zone, target_zone)
    verdict = cache.get(key)
    if verdict is None:
        verdict = decide(policy, data_class, origin_zone, target_zone)
        if len(cache) >= VERDICT_CACHE_LIMIT:
            cache.clear()
        cache[key] = verdict
    return verdict


def kept_on_site(policy: Policy, data_class: str, site: str) -> bool:
    """Whether ``policy`` lets ``data_class`` leave the site (the zones under ``site``) from
    none of its zones: no zone outside it may process the class, whatever the origin."""
    zones = sorted(policy.zones)
    off_site = [z for z in zones if z != site and not z.startswith(site + "/")]
    return not any(allowed(policy, data_class, o, t).allowed for o in zones for t in off_site)


def allowed_targets(policy: Policy, data_class: str, origin_zone: str) -> list[str]:
    """Every declared zone that may process ``data_class`` from ``origin_zone``, sorted."""
    return sorted(z for z in policy.zones if allowed(policy, data_class, origin_zone, z).allowed)


def _rule_line(rule: Rule, origin: tuple[str, ...], target: tuple[str, ...]) -> str:
    o_ok = rule.origin.matches(origin)
    t_ok = rule.target.matches(target)
    parts = [
        f"origin {'matches' if o_ok else 'does not match'} {rule.origin.text!r}",
        f"target {'matches' if t_ok else 'does not match'} {rule.target.text!r}",
    ]
    verdict = "MATCHES" if o_ok and t_ok else "does not apply"
    return f"  {rule.key}: {', '.join(parts)} -> {verdict}"


def explain(policy: Policy, data_class: str, origin_zone: str, target_zone: str) -> list[str]:
    """The reasoning behind ``allowed`` in words, one line per step, for people."""
    verdict = allowed(policy, data_class, origin_zone, target_zone)
    lines = [
        f"Question: may data class {data_class!r} from zone {origin_zone!r} be processed "
        f"in zone {target_zone!r}? (policy {policy.campus!r} version {policy.version})"
    ]
    cls = policy.classes.get(data_class)
    if cls is None:
        known = ", ".join(sorted(policy.classes))
        lines.append(f"Data class {data_class!r} is not in the policy; known: {known}.")
    if origin_zone.startswith(PEER_ORIGIN):
        lines.append(
            f"The job comes from sister campus {origin_zone.removeprefix(PEER_ORIGIN)!r}: "
            "what [peers] receive terms list is allowed, unless a deny rule for every origin "
            "matches the zone."
        )
    for zone in (origin_zone, target_zone):
        if zone not in policy.zone_segments and not zone.startswith(PEER_ORIGIN):
            lines.append(f"Zone {zone!r} is not declared in the policy; unknown zones are denied.")
    if verdict.decision in ("deny-rule", "allow-rule", "default-deny") and cls is not None:
        origin = policy.zone_segments[origin_zone]
        target = policy.zone_segments[target_zone]
        lines.append(f"Deny rules are checked first ({len(cls.deny)}); any match wins:")
        lines.extend(_rule_line(rule, origin, target) for rule in cls.deny)
        lines.append(f"Then allow rules ({len(cls.allow)}); the first match allows:")
        lines.extend(_rule_line(rule, origin, target) for rule in cls.allow)
    answer = "ALLOWED" if verdict.allowed else "DENIED"
    lines.append(f"Answer: {answer}: {verdict}.")
    return lines


def reachable_zones(policy: Policy, origin_zone: str) -> list[str]:
    """Declared zones where at least one data class from ``origin_zone`` may be processed."""
    return sorted(
        zone
        for zone in policy.zones
        if any(allowed(policy, cls, origin_zone, zone).allowed for cls in policy.classes)
    )
