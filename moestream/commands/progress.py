"""A progress line on stderr for long commands: the phase now running and the time spent in it,
redrawn every second, so a phase that takes minutes never leaves the terminal silent."""
from __future__ import annotations

import sys
import threading

from tqdm import tqdm


class Phases:
    """`with Phases("bench", enabled=...) as show: show("load"); ...`: one tqdm line whose text is the phase."""

    def __init__(self, label: str, *, enabled: bool = True, refresh_s: float = 1.0) -> None:
        self.label, self.enabled, self.refresh_s = label, enabled, refresh_s
        self._bar: tqdm | None = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def __enter__(self) -> "Phases":
        if self.enabled:
            self._bar = tqdm(total=None, desc=self.label, file=sys.stderr, bar_format="{desc} {elapsed}", leave=False)
            self._thread = threading.Thread(target=self._redraw, name="progress", daemon=True)
            self._thread.start()
        return self

    def __call__(self, phase: str) -> None:
        if self._bar is not None:
            self._bar.set_description_str(f"{self.label}: {phase}")

    def _redraw(self) -> None:
        while not self._stop.wait(self.refresh_s):
            self._bar.refresh()

    def __exit__(self, *exc) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
        if self._bar is not None:
            self._bar.close()
