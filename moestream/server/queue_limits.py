"""How many requests may wait for a sequence slot: bounded by what they hold (their prompt tokens),
not by a small count, so a burst of clients queues as it would on llama.cpp or vLLM while a flood of
long prompts cannot exhaust the machine's memory. A count limit is there for who wants one.

A request that finds a free slot never counts against the queue: it waits only for the next step
boundary. Of those beyond the free slots, the first always waits (whatever its size: its prompt
already fits the context), and the others while their tokens stay within the budget."""
from __future__ import annotations

from dataclasses import dataclass
import psutil

# what one waiting prompt token holds: its id as a Python int (28 bytes) in the job's lists, and its
# share of the request's text, JSON and rendered prompt
QUEUED_TOKEN_BYTES = 64
RAM_SHARE = 64  # the waiting requests may hold 1/64 of the machine's memory by default
MIN_QUEUE_TOKENS = 1 << 16


def default_queue_tokens(total_ram: int | None = None) -> int:
    """The default budget of waiting prompt tokens: 1/64 of the machine's memory at 64 bytes a token
    (about 4 M tokens on 16 GiB, 34 M on 128 GiB)."""
    total = psutil.virtual_memory().total if total_ram is None else total_ram
    return max(MIN_QUEUE_TOKENS, total // RAM_SHARE // QUEUED_TOKEN_BYTES)


@dataclass(frozen=True)
class QueueLimits:
    max_tokens: int  # prompt tokens the requests beyond the free slots may hold in all
    max_requests: int | None = None  # requests that may wait beyond the free slots (None: no count limit)

    def __post_init__(self) -> None:
        if self.max_tokens < 1:
            raise ValueError("the queue's token budget must be >= 1")
        if self.max_requests is not None and self.max_requests < 0:
            raise ValueError("max_queue must be >= 0")

    def refusal(self, waiting: int, held: int, free: int, tokens: int) -> str | None:
        """Why a request of `tokens` prompt tokens may not join the `waiting` ones while `free` slots are
        free (`held`: the prompt tokens of those beyond the first `free`, which wait for a slot to end);
        None when it may."""
        if waiting < free:
            return None  # it takes a free slot at the next step boundary
        if self.max_requests is not None and waiting >= self.max_requests + free:
            return f"{waiting - free} requests are already waiting"
        if held and held + tokens > self.max_tokens:
            return (f"the waiting requests hold {held} prompt tokens and this one's {tokens} would pass the "
                    f"queue's limit of {self.max_tokens}")
        return None
