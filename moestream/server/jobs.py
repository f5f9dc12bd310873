"""What the worker and its batch scheduler exchange with the HTTP side: a Job (its choices and the
sink its events go to) and the plain events a job's sink receives (text deltas, then one end event)."""
from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Optional

from moestream.engine.types import SamplingParams

# ------------------------------------------------------------------------------------------ events

@dataclass
class TokenLogprobInfo:
    token: str
    logprob: Optional[float]  # None: the prompt's first token (nothing predicts it)
    top: list[tuple[str, float]] = field(default_factory=list)


@dataclass
class Started:
    queue_s: float


@dataclass
class TextDelta:
    text: str
    logprobs: list[TokenLogprobInfo] = field(default_factory=list)
    index: int = 0  # the choice
    tokens: int = 0  # generated tokens whose text ends here (held text comes with a later token's)


@dataclass
class PromptLogprobs:
    """The prompt's tokens with their log-probabilities (echo), before the choice's text."""

    text: str
    logprobs: list[TokenLogprobInfo]
    index: int = 0


@dataclass
class Finished:
    finish_reason: str  # "stop" | "length" | "cancelled"
    prompt_tokens: int
    completion_tokens: int
    receipt: dict
    queue_s: float
    logprobs: list[TokenLogprobInfo] = field(default_factory=list)  # tokens whose text was not shown
    index: int = 0
    last: bool = True  # the job's last choice
    stop_string: Optional[str] = None  # the stop string that ended it, if one did


@dataclass
class Failed:
    message: str
    code: str = "engine_error"


Event = Any  # Started | PromptLogprobs | TextDelta | Finished | Failed


# ---------------------------------------------------------------------------------------- the job

@dataclass
class Choice:
    """One generation of a job: a request with n > 1 or several prompts has several (in order one at
    a time, or side by side in the batch scheduler's slots)."""

    prompt_ids: list[int]
    max_new_tokens: int
    sampling: SamplingParams
    echo: bool = False  # report the prompt's logprobs (PromptLogprobs) first


@dataclass
class Job:
    choices: list[Choice]
    sink: Callable[[Event], None]  # called on the worker thread; must be thread-safe and quick
    stops: list[str] = field(default_factory=list)
    logprobs: Optional[int] = None  # None: off; K: each token's logprob and the K most likely
    request_id: str = ""
    enqueued_at: float = field(default_factory=time.monotonic)
    choices_left: int = 0  # choices not yet ended (the worker's count of the slots it is owed)
    cancelled: threading.Event = field(default_factory=threading.Event)
    done: threading.Event = field(default_factory=threading.Event)
    _worker: Any = field(default=None, repr=False)  # the server.worker.Worker that queued it

    @property
    def engine_logprobs(self) -> int:
        """The engine's logprobs=K: the chosen token's logprob and the K most likely (0: none)."""
        return max(1, self.logprobs) if self.logprobs is not None else 0

    @property
    def prompt_tokens(self) -> int:
        """The prompt tokens it holds while it waits (each choice its own copy)."""
        return sum(len(choice.prompt_ids) for choice in self.choices)

    def cancel(self) -> None:
        """The client is gone (or the server is stopping): drop the job or stop its generation."""
        if self.done.is_set() or self.cancelled.is_set():
            return
        self.cancelled.set()
        if self._worker is not None:
            self._worker._drop_waiting(self)


def one_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return text[0] if text else type(exc).__name__
