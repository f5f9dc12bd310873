"""The one thread that owns the engine, and the bounded first-in-first-out queue in front of it.

The HTTP side never calls the engine: it tokenizes (through a lock shared with this thread),
submits a Job and receives plain events (text deltas, then one end event) through a sink it
provides. Only this thread loads the engine, generates, detokenizes and matches stop strings, so
a streamed reply and a whole one are made of exactly the same pieces.

With `parallel` 1 it runs one job at a time through `engine.generate`, speculating where the
server was started with a drafter or the hot head (the same text, faster); with more, the batch
scheduler (server/batching.py) runs up to `parallel` jobs together, one sequence slot each. The
queue in front holds jobs beyond those within its limits (server/queue_limits.py: their prompt
tokens, and a count where one is set).

A job whose client goes away is cancelled: a waiting one leaves the queue at once, a running one
stops at the engine's next `should_stop()` check (between tokens and between prefill chunks).
"""
from __future__ import annotations

import collections
import itertools
import logging
import math
import threading
import time
from typing import Any, Callable

from moestream.errors import MoestreamError
from moestream.server.jobs import (Choice, Event, Failed, Finished, Job, PromptLogprobs, Started, TokenLogprobInfo,
                                   one_line)
from moestream.server.queue_limits import QueueLimits, default_queue_tokens
from moestream.server.stops import ChoiceText

log = logging.getLogger(__name__)


class QueueFull(Exception):
    def __init__(self, reason: str, retry_after_s: int):
        super().__init__(reason)
        self.retry_after_s = retry_after_s


class NotReady(Exception):
    def __init__(self, state: str, message: str):
        super().__init__(message)
        self.state = state


class LockedTokenizer:
    """The engine's tokenizer behind a lock: the HTTP side encodes while this thread decodes,
    and not every tokenizer is safe to use from two threads at once."""

    def __init__(self, tokenizer: Any) -> None:
        self._tokenizer = tokenizer
        self._lock = threading.Lock()
        self.eos_token_ids = frozenset(getattr(tokenizer, "eos_token_ids", ()) or ())
        size = getattr(tokenizer, "vocab_size", None)
        self.vocab_size: int | None = size if isinstance(size, int) else None

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        with self._lock:
            return list(self._tokenizer.encode(text, add_special_tokens=add_special_tokens))

    def decode(self, ids: list[int]) -> str:
        with self._lock:
            return self._tokenizer.decode(list(ids))

    @property
    def chat_template(self) -> str | None:
        template = getattr(self._tokenizer, "chat_template", None)
        return template if isinstance(template, str) else None

    def token_id(self, text: str) -> int | None:
        """The id of the token spelled `text` (a special token such as <|fim_prefix|>), or None."""
        lookup = getattr(self._tokenizer, "token_id", None)
        if lookup is None:
            return None
        with self._lock:
            return lookup(text)

    def chat_ids(self, messages: list[dict], add_generation_prompt: bool = True,
                 tools: list[dict] | None = None) -> list[int]:
        extra = {"tools": tools} if tools else {}  # a tokenizer without tool support is never passed none
        with self._lock:
            return list(self._tokenizer.chat_ids(messages, add_generation_prompt=add_generation_prompt, **extra))


# ------------------------------------------------------------------------------------------ worker

class Worker:
    """Loads the engine on its own thread, then runs queued jobs in order: one at a time, or up to
    `parallel` together (continuous batching)."""

    def __init__(self, load_engine: Callable[[], Any], *, max_queue: int | None = None,
                 queue_tokens: int | None = None, parallel: int = 1,
                 speculation: Callable[[Any], Any] | None = None, name: str = "moestream-engine"):
        """max_queue: requests that may wait beyond the free slots (None: no count limit);
        queue_tokens: the prompt tokens they may hold in all (None: queue_limits.default_queue_tokens,
        from the machine's memory). speculation: engine -> the engine's SpeculativeOptions (or None),
        made on this thread once the engine is loaded (it may load a draft model); every request it can
        serve uses it."""
        self.limits = QueueLimits(queue_tokens if queue_tokens is not None else default_queue_tokens(), max_queue)
        if parallel < 1:
            raise ValueError("parallel must be >= 1")
        self._load_engine = load_engine
        self._make_speculation = speculation
        self.speculative: Any = None  # the SpeculativeOptions every request it can serve uses
        self.on_load_failed: Callable[[str], None] | None = None  # e.g. stop the HTTP server
        self.parallel = parallel
        self.state = "loading"  # loading | ready | failed | stopped
        self.error: str | None = None
        self.engine: Any = None
        self.tokenizer: LockedTokenizer | None = None
        self.model_name: str | None = None
        self.max_context: int = 0
        self.stats_snapshot: dict = {}
        self.last_receipt: dict = {}
        self.jobs_done = 0
        # told of every job's start and every choice's end, on this thread (e.g. the server's metrics)
        self.observers: list[Any] = []
        self._waiting: collections.deque[Job] = collections.deque()
        self._waiting_tokens = 0  # the waiting jobs' prompt tokens
        self._running: list[Job] = []  # admitted, not yet done (at most `parallel`)
        self._cond = threading.Condition()
        self._stopping = False
        self._ready = threading.Event()
        self._avg_job_s = 5.0
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)

    # ---- lifecycle (any thread)

    def start(self) -> "Worker":
        self._thread.start()
        return self

    def wait_ready(self, timeout: float | None = None) -> bool:
        self._ready.wait(timeout)
        return self.state == "ready"

    def shutdown(self, timeout: float = 5.0) -> bool:
        """Cancel every waiting and running job and stop the thread, which then closes the engine.
        True if it ended in time."""
        with self._cond:
            self._stopping = True
            waiting = list(self._waiting)
            self._waiting.clear()
            self._waiting_tokens = 0
            running = list(self._running)
            self._cond.notify_all()
        for job in waiting:
            job.cancelled.set()
            self._deliver(job, Failed("the server is shutting down", code="server_shutdown"))
            job.done.set()
        for job in running:
            job.cancelled.set()
        if self._thread.is_alive() and threading.current_thread() is not self._thread:
            self._thread.join(timeout)
        return not self._thread.is_alive()

    # ---- queue (HTTP side)

    @property
    def queue_depth(self) -> int:
        with self._cond:
            return len(self._waiting)

    @property
    def max_queue(self) -> int | None:
        return self.limits.max_requests

    @property
    def queue_tokens(self) -> int:
        """The prompt tokens the waiting jobs hold."""
        return self._waiting_tokens

    @property
    def busy(self) -> bool:
        return bool(self._running)

    @property
    def running(self) -> int:
        """Jobs the engine is generating now (at most `parallel`)."""
        return len(self._running)

    def _retry_after_locked(self) -> int:
        """A guess at when a slot frees up, for Retry-After: 1 to 10 seconds (about half the work
        ahead: a slot frees when a running job ends, not when all do)."""
        ahead = (len(self._waiting) + len(self._running)) / self.parallel
        return int(min(10, max(1, math.ceil(self._avg_job_s * max(1.0, ahead) / 2))))

    def submit(self, job: Job) -> Job:
        if self.state != "ready":
            raise NotReady(self.state, self.error or f"the model is {self.state}")
        with self._cond:
            if self._stopping:
                raise NotReady("stopped", "the server is shutting down")
            free = self._free_slots_locked()
            # the first `free` waiting jobs take the free slots; the others wait for running ones to end
            held = self._waiting_tokens - sum(j.prompt_tokens for j in itertools.islice(self._waiting, free))
            reason = self.limits.refusal(len(self._waiting), held, free, job.prompt_tokens)
            if reason is not None:
                raise QueueFull(reason, self._retry_after_locked())
            job._worker = self
            job.enqueued_at = time.monotonic()
            job.choices_left = len(job.choices)
            self._waiting.append(job)
            self._waiting_tokens += job.prompt_tokens
            self._cond.notify_all()
        return job

    def _drop_waiting(self, job: Job) -> None:
        with self._cond:
            try:
                self._waiting.remove(job)
            except ValueError:
                return  # already running or finished: the engine's should_stop sees the flag
            self._waiting_tokens -= job.prompt_tokens
        job.done.set()
        log.info("request %s left the queue", job.request_id)

    # ---- the thread

    def _run(self) -> None:
        try:
            engine = self._load_engine()
            self.engine = engine
            self.tokenizer = LockedTokenizer(engine.tokenizer)
            self.model_name = str(getattr(engine, "model_name", "") or "") or None
            self.max_context = int(engine.max_context)
            if self._make_speculation is not None:
                self.speculative = self._make_speculation(engine)
                drafter = getattr(self.speculative, "drafter", None)
                if self.parallel > 1 and self.speculative is not None and not getattr(drafter, "many_sequences", False):
                    raise MoestreamError("with parallel above 1 only a drafter that serves many sequences at once "
                                         "(ngram) can speculate")
            scheduler = None
            if self.parallel > 1:
                from moestream.server.batching import BatchScheduler

                scheduler = BatchScheduler(self)  # refuses an engine without enough sequence slots
            warm = getattr(engine, "warm_steps", None)
            if warm is not None:  # the first requests should not pay for capturing steps (short prompts, batches)
                warm(16)
            self._refresh_stats()
            self.state = "ready"
            log.info("engine ready: %s, context %d tokens", self.model_name, self.max_context)
        except BaseException as exc:  # a failed load is reported by /health, not by a dead thread
            self.error = f"loading the model failed: {exc}"
            self.state = "failed"
            log.error("%s", self.error, exc_info=not isinstance(exc, MoestreamError))
            self._ready.set()
            if self.on_load_failed is not None:
                self.on_load_failed(self.error)
            return
        self._ready.set()
        if scheduler is not None:
            try:
                scheduler.run()
            except BaseException as exc:  # the scheduler itself broke: say so, fail what waits
                log.error("the batch scheduler stopped: %s", exc, exc_info=True)
                self.error, self.state = f"the batch scheduler stopped: {one_line(exc)}", "failed"
                self.shutdown(timeout=0)
                self._close_engine()
                return
        else:
            self._run_one_at_a_time()
        self.state = "stopped"
        self._close_engine()

    def _run_one_at_a_time(self) -> None:
        while True:
            with self._cond:
                while not self._waiting and not self._stopping:
                    self._cond.wait()
                if self._stopping:
                    break
                job = self._start_next()
            started = time.monotonic()
            try:
                self._run_job(job)
            except BaseException as exc:  # keep serving after any failure in one job
                log.error("request %s failed: %s", job.request_id, exc, exc_info=not isinstance(exc, MoestreamError))
                self._deliver(job, Failed(one_line(exc)))
            finally:
                self._job_done(job, started)

    def _free_slots_locked(self) -> int:
        """Slots no running job holds or is owed: each holds one per choice not yet ended, up to
        `parallel` (one at a time: one)."""
        return max(0, self.parallel - sum(min(job.choices_left, self.parallel) for job in self._running))

    def _choice_ended(self, job: Job) -> None:
        """One of a running job's choices ended: the slot it held is free for others."""
        with self._cond:
            job.choices_left -= 1

    def _start_next(self) -> Job:
        """The first waiting job, now running (the caller holds the lock)."""
        job = self._waiting.popleft()
        self._waiting_tokens -= job.prompt_tokens
        self._running.append(job)
        return job

    def _release(self, job: Job) -> None:
        """Free a running job's place (its engine slot is already closed)."""
        with self._cond:
            if job in self._running:
                self._running.remove(job)
            self._cond.notify_all()

    def _job_done(self, job: Job, started: float) -> None:
        """A running job ended (any outcome): free its place (if its last event has not), wake its
        waiter, update the figures."""
        self._release(job)
        job.done.set()
        self.jobs_done += 1
        self._avg_job_s = 0.8 * self._avg_job_s + 0.2 * (time.monotonic() - started)
        self._refresh_stats()

    def _close_engine(self) -> None:
        """Close the engine on the thread that owns it, once nothing runs: its reader threads end."""
        drafter = getattr(self.speculative, "drafter", None)
        if drafter is not None:
            try:
                drafter.close()
            except Exception as exc:
                log.warning("closing the draft model failed: %s", exc)
        try:
            self.engine.close()
        except Exception as exc:  # the server is stopping anyway; say why the engine did not close cleanly
            log.warning("closing the engine failed: %s", exc)
        log.info("engine closed")

    def _refresh_stats(self) -> None:
        try:
            self.stats_snapshot = dict(self.engine.stats())
        except Exception as exc:  # stats are informative; never let them stop the server
            log.warning("engine.stats() failed: %s", exc)

    def _observe(self, name: str, *args: Any) -> None:
        for observer in self.observers:
            try:
                getattr(observer, name)(*args)
            except Exception as exc:  # figures are informative; never let them fail a request
                log.warning("observer %s failed: %s", name, exc)

    def _deliver(self, job: Job, event: Event) -> None:
        if isinstance(event, Failed) or (isinstance(event, Finished) and event.last):
            # the job's answer is complete with this event: its place is free before the client can
            # know it, so a next request sent at once is counted against a queue without it; the
            # figures (/metrics) are the engine's after it, before anyone can see the server idle
            self._refresh_stats()
            self._release(job)
        try:
            job.sink(event)
        except Exception as exc:  # the HTTP side is gone (event loop closed): nobody is listening
            log.debug("request %s: could not deliver an event: %s", job.request_id, exc)
            job.cancelled.set()

    def _run_job(self, job: Job) -> None:
        queue_s = time.monotonic() - job.enqueued_at
        if job.cancelled.is_set():
            return
        self._deliver(job, Started(queue_s=queue_s))
        self._observe("job_started", queue_s)
        for index, choice in enumerate(job.choices):
            last = index == len(job.choices) - 1
            if not self._run_choice(job, choice, index, last, queue_s) or job.cancelled.is_set():
                return

    def _run_choice(self, job: Job, choice: Choice, index: int, last: bool, queue_s: float) -> bool:
        """One choice; False when the job ended (failed or cancelled)."""
        if choice.echo and not self._echo(job, choice, index):
            return False
        if choice.max_new_tokens <= 0:
            self._nothing_to_generate(job, choice, index, last, queue_s)
            return True
        text = ChoiceText(self, job, index)
        # the server's speculation, unless it sits this request out (not_used says why)
        not_used = self.speculative.not_used_reason(choice.sampling) if self.speculative is not None else None
        speculates = self.speculative is not None and not_used is None
        try:
            gen = self.engine.generate(choice.prompt_ids, max_new_tokens=choice.max_new_tokens,
                                       sampling=choice.sampling, logprobs=job.engine_logprobs,
                                       should_stop=job.cancelled.is_set,
                                       **({"speculative": self.speculative} if speculates else {}))
        except MoestreamError as exc:  # the engine refused the request before starting it
            self._deliver(job, Failed(one_line(exc), code="invalid_request"))
            return False
        try:
            for event in gen:
                text.token(event)
                if text.matcher.stopped or job.cancelled.is_set():
                    break
            else:
                text.flush()
        finally:
            gen.close()
        result = gen.result
        receipt = dict(result.receipt) if result is not None else {}
        if not_used is not None:
            receipt["speculative_off"] = not_used
        if text.matcher.stopped:
            reason = "stop"
        elif job.cancelled.is_set():
            reason = "cancelled"
        else:
            reason = result.finish_reason if result is not None else "length"
        return self._end_choice(text, last, queue_s, len(choice.prompt_ids), reason, receipt)

    def _end_choice(self, text: ChoiceText, last: bool, queue_s: float, prompt_tokens: int, reason: str,
                    receipt: dict, observed: dict | None = None) -> bool:
        """Report a choice's end (`observed`: the receipt the metrics see, default `receipt`);
        False when the job ends here (cancelled)."""
        job, index, generated, pending, matcher = text.job, text.index, text.generated, text.pending, text.matcher
        self.last_receipt = receipt
        self._observe("choice_done", prompt_tokens, generated, reason, receipt if observed is None else observed)
        if reason == "cancelled":
            if self._stopping:
                self._deliver(job, Failed("the server is shutting down", code="server_shutdown"))
            else:
                self._deliver(job, Finished("cancelled", prompt_tokens, generated, receipt, queue_s, pending,
                                            index=index, last=True))
            log.info("request %s cancelled after %d tokens", job.request_id, generated)
            return False
        if reason not in ("stop", "length"):
            raise RuntimeError(f"the engine ended with finish_reason {reason!r}")
        self._deliver(job, Finished(reason, prompt_tokens, generated, receipt, queue_s, pending, index=index, last=last,
                                    stop_string=matcher.matched if matcher.stopped else None))
        log.info("request %s choice %d: %d prompt tokens (%s prefilled), %d generated, %s, %.1f tok/s",
                 job.request_id, index, prompt_tokens, receipt.get("prefill_tokens", "?"), generated, reason,
                 float(receipt.get("decode_tok_s", 0.0) or 0.0))
        return True

    def _echo(self, job: Job, choice: Choice, index: int, *, seq: int = 0) -> bool:
        """Score the prompt (sequence slot `seq`) and send its PromptLogprobs; False if cancelled."""
        tokenizer = self.tokenizer
        scored = self.engine.prompt_logprobs(choice.prompt_ids, job.logprobs or 0, should_stop=job.cancelled.is_set,
                                             **({"seq": seq} if seq else {}))
        if scored is None:
            return False
        infos = [TokenLogprobInfo(tokenizer.decode([tid]), lp, [(tokenizer.decode([t]), v) for t, v in top])
                 for tid, lp, top in scored]
        self._deliver(job, PromptLogprobs(tokenizer.decode(choice.prompt_ids), infos, index))
        return True

    def _nothing_to_generate(self, job: Job, choice: Choice, index: int, last: bool, queue_s: float) -> None:
        prompt_tokens = len(choice.prompt_ids)
        receipt = {"prompt_tokens": prompt_tokens, "prefill_tokens": 0, "reused_tokens": 0, "generated_tokens": 0}
        self._observe("choice_done", prompt_tokens, 0, "length", receipt)
        self._deliver(job, Finished("length", prompt_tokens, 0, receipt, queue_s, index=index, last=last))
