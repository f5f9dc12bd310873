"""The reference the stop matcher is tested against: stop strings cut on a whole text."""
from __future__ import annotations

from typing import Sequence


def cut_at_first_stop(text: str, stops: Sequence[str]) -> tuple[str, bool]:
    """Reference for the matcher on a whole text: the text before the stop string that ends
    first (on a tie, the one that starts first), and whether one was found."""
    best: tuple[int, int] | None = None
    for stop in stops:
        if not stop:
            continue
        start = text.find(stop)
        while start >= 0:
            key = (start + len(stop), start)
            if best is None or key < best:
                best = key
            start = text.find(stop, start + 1)
    if best is None:
        return text, False
    return text[: best[1]], True
