"""A Job's sink for tests that submit jobs to the worker or the batch scheduler directly."""
from __future__ import annotations

import threading
from typing import Callable

from moestream.server.jobs import Failed, Finished


def event_collector() -> tuple[list, threading.Event, Callable]:
    """(events, done, sink): a Job's sink that keeps its events and sets `done` at its end (its last
    choice's Finished, or Failed), for callers that submit jobs directly (benchmarks, tests)."""
    events: list = []
    done = threading.Event()

    def sink(event) -> None:
        events.append(event)
        if isinstance(event, Failed) or (isinstance(event, Finished) and event.last):
            done.set()

    return events, done, sink
