"""The one parser of `--pairs` lists ("SRC->DST,SRC->DST,..."), shared by `pyxfer doctor` (device pairs) and
`pyxfer bench` (rows, whose endpoints include pinned and pageable host memory)."""

__all__ = ["parse_pairs"]


def parse_pairs(spec, endpoint, *, expected, each="pair", accept=None):
    """[(src, dst)] in the order of ``spec``. ``endpoint(text)`` is the canonical name of an endpoint or None
    when it is not one; ``accept(src, dst)`` (optional) refuses a pair of known endpoints. Raises ValueError
    naming --pairs and the item: "expected <expected>, got 'item'" for a malformed, unknown or refused pair,
    "expected each <each> once" for a repeated one."""
    pairs = []
    for item in spec.split(","):
        a, sep, b = item.partition("->")
        a, b = endpoint(a.strip()), endpoint(b.strip())
        if not sep or a is None or b is None or (accept is not None and not accept(a, b)):
            raise ValueError(f"--pairs: expected {expected}, got {item!r}")
        if (a, b) in pairs:
            raise ValueError(f"--pairs: expected each {each} once, got {a}->{b} twice in {spec!r}")
        pairs.append((a, b))
    return pairs
