"""Parsers of flag values for argparse's `type=`: whole numbers, finite floats, shares. A bad value is
refused while the command line is parsed, before any model is opened, with one line that names the
flag: `moestream generate: error: argument --threads: must be at least 1, not 0`. Here, below the
engine, because the engine's own flags (moestream.engine.options) use them too."""
from __future__ import annotations

import argparse
import math


def at_least(low: int):
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not a whole number") from None
        if value < low:
            raise argparse.ArgumentTypeError(f"must be at least {low}, not {value}")
        return value
    parse.__name__ = f"integer >= {low}"
    return parse


def _float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
    if not math.isfinite(value):
        raise argparse.ArgumentTypeError(f"must be a finite number, not {text}")
    return value


def non_negative_float(text: str) -> float:
    value = _float(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be at least 0, not {text}")
    return value


def finite_float(text: str) -> float:
    return _float(text)


def probability_mass(text: str) -> float:
    """A top-p: in (0, 1]."""
    value = _float(text)
    if not 0 < value <= 1:
        raise argparse.ArgumentTypeError(f"must be in (0, 1], not {text}")
    return value


def unit_interval(text: str) -> float:
    """A min-p: in [0, 1]."""
    value = _float(text)
    if not 0 <= value <= 1:
        raise argparse.ArgumentTypeError(f"must be in [0, 1], not {text}")
    return value
