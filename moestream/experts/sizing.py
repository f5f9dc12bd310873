"""Sizes as users write them: bytes (`4GiB`, `512MB`), a share of all experts (`25%`), or `min`."""
from __future__ import annotations

import re

from moestream.errors import MoestreamError

UNITS = {"": 1, "b": 1, "k": 1000, "kb": 1000, "m": 1000**2, "mb": 1000**2, "g": 1000**3, "gb": 1000**3,
         "t": 1000**4, "tb": 1000**4, "kib": 1024, "mib": 1024**2, "gib": 1024**3, "tib": 1024**4}


def parse_bytes(text: str) -> int:
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*", text)
    if not m or m.group(2).lower() not in UNITS:
        raise MoestreamError(f"cannot read size {text!r} (examples: 4GiB, 512MB, 1000000)")
    return int(float(m.group(1)) * UNITS[m.group(2).lower()])


def format_bytes(n: float) -> str:
    for unit, size in (("GiB", 1024**3), ("MiB", 1024**2), ("KiB", 1024)):
        if abs(n) >= size:
            return f"{n / size:.2f} {unit}"
    return f"{int(n)} B"


def slots_for(text: str, *, slot_bytes: int, total_experts: int, min_slots: int, flag: str = "--cache-size") -> int:
    """Number of slots a size asks for, between the floor and all experts."""
    text = text.strip().lower()
    if text == "min":
        return min_slots
    if text in ("all", "max"):
        return total_experts
    if text.endswith("%"):
        try:
            share = float(text[:-1]) / 100.0
        except ValueError:
            raise MoestreamError(f"{flag}: cannot read share {text!r} (example: 25%)") from None
        if not 0 < share <= 1:
            raise MoestreamError(f"{flag}: share must be in (0%, 100%], got {text}")
        slots = round(share * total_experts)
    else:
        slots = parse_bytes(text) // slot_bytes
    if slots < min_slots:
        raise MoestreamError(f"{flag} {text} gives {slots} expert slots; the minimum is {min_slots} "
                             f"({format_bytes(min_slots * slot_bytes)}: one token's experts in one layer)")
    return min(slots, total_experts)
