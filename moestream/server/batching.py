"""Continuous batching: up to `parallel` jobs generate together, each in its own sequence slot.

The scheduler runs on the worker's thread and owns the engine's slots. Each turn of its loop is
one step boundary:
- admit: waiting jobs are admitted while a slot is free (a job is owed one per choice not yet ended)
  and the KV pool has room for the first's first choice, first in first out, and their choices take
  free slots in order. A choice starts only where the pool holds its prompt plus its max_tokens beside
  what the running ones may still take (`Engine.kv_room`: its prompt's blocks a running one holds are
  free to it), so no sequence runs out of blocks mid-generation; else it waits, and the jobs after it
  too, until running ones end. One that cannot fit even alone is refused (400). A choice's prompt goes to the free slot
  whose cached tokens share the longest start with it (that start is not computed again); where
  none shares any, the least recently used slot (eviction is slot reuse). So the prefix cache is
  the slots' KV caches, shared by all requests.
- decode: one `step_many` for every sequence that has a token to run: each MoE layer loads the
  experts its rows route to once, and each row gets the bits it gets alone. On CUDA, newcomers whose
  prompt the engine would prefill as one step of its own (a few new tokens) join it while a step's
  rows last (`Engine.prompt_step`): a row's bits never depend on the other rows, so their first
  choice is the one their own prefill gives.
- prefill: one chunk (--prefill-chunk-tokens) of the oldest newcomer's prompt still to compute, so
  a long prompt costs the running streams one chunk's time per token, not the whole prefill at once.
- retire: a sequence leaves at EOS, its length, a stop string or its client's disconnect (seen at
  the next boundary); its slot keeps its tokens for a later prompt's prefix.

With speculation (`serve --speculative ngram`): before a decode step each sequence may draft a
few tokens by prompt lookup (how many: its own adaptive policy, from its acceptance and the measured
step times); the step verifies every sequence's drafts together, each sequence keeps its drafts up
to the first its own choice rejects, and its cache forgets the rest. Its text is what it gets
alone, with or without drafts. Drafting and verifying are the decode loop's own pieces
(moestream.engine.decode_loop: a Speculation's `draft` and `verify`, `Emitter.take`), driven here
over `step_many`; they reach this module through the engine's objects, never imported (no torch here).

Each sequence has its own sampler settings (seed, penalties, grammar state), detokenizer, stop
matcher and event sink, and chooses through the same Emitter as `engine.generate`, so a request's
text does not depend on what else runs: greedy, the tokens it gets alone; sampled, the same seeded
draws. A job's choices (n > 1, several prompts) run side by side, each in a slot of its own as
slots free up (an admitted job's choices before later jobs); a choice whose prompt an earlier choice
of its job is still prefilling starts once that prompt is in the KV pool, so it shares its blocks
(the pool shares a prompt's full blocks by content) and computes only the rest. The worker counts a
job's choices not yet ended as the slots it is owed, so it admits a job only where a slot is free.
"""
from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import Any, Iterator

from moestream.engine.receipt import COUNTERS, Receipt
from moestream.engine.types import common_prefix
from moestream.errors import MoestreamError
from moestream.server.jobs import Failed, Job, Started, one_line
from moestream.server.stops import ChoiceText

log = logging.getLogger(__name__)


def _echoed(choice: Any) -> dict:
    """kv_room's arguments for a choice whose prompt is scored (echo): computed whole, it shares no block."""
    return {"share": False} if choice.echo else {}


@dataclass
class Running:
    """One choice of a job, generating in sequence slot `slot`."""

    job: Job
    slot: int
    run: "JobRun"
    prompt: list[int]
    budget: int  # tokens it may generate
    emit: Any  # the engine's Emitter: logits row -> TokenEvent, or None at the end
    state: dict  # the Emitter's: tokens, finish
    text: ChoiceText
    before: dict  # the expert cache's counters when it started
    computed: int = 0  # prompt tokens in the slot's KV cache so far
    reused: int = 0
    next_token: int | None = None  # the token the next decode step runs
    speculation: Any = None  # its drafting (moestream.engine.speculative.Speculation), where it drafts
    spec_off: str | None = None  # why the server's speculation sits this one out
    t0: float = field(default_factory=time.perf_counter)
    prefill_s: float = 0.0
    t_decode: float = 0.0

    @property
    def prefilling(self) -> bool:
        return self.computed < len(self.prompt)


@dataclass
class JobRun:
    """An admitted job: its choices start in order, as slots allow."""

    job: Job
    queue_s: float
    started: float  # when it was admitted
    next: int = 0  # its next choice to start
    running: int = 0  # its choices generating now
    prefilled: list[list[int]] = field(default_factory=list)  # prompts its choices brought into the pool

    @property
    def unstarted(self) -> bool:
        return self.next < len(self.job.choices)


class BatchScheduler:
    def __init__(self, worker: Any) -> None:  # the server.worker.Worker whose thread runs it
        self.worker = worker
        self.engine = worker.engine
        self.slots = worker.parallel
        if len(getattr(self.engine, "caches", ())) < self.slots or not hasattr(self.engine, "step_many"):
            raise MoestreamError(f"--parallel {self.slots} needs an engine with {self.slots} sequence slots "
                                 "(EngineOptions.max_sequences)")
        for seq in list(self.engine.open_sequences):  # every slot is the scheduler's to open
            self.engine.close_sequence(seq)
        self.chunk = max(1, int(getattr(getattr(self.engine, "plan", None), "prefill_chunk", 2048)))
        self.active: list[Running] = []
        self.last_used = {s: 0.0 for s in range(self.slots)}
        self.runs: dict[int, JobRun] = {}  # id(job) -> its run, in the order admitted
        # the expert cache's counters as last read (once per engine call, _account): the metrics count the
        # work since, and a request's receipt starts and ends at such a reading
        self.stats: dict = {}
        self.kv_waiting = False  # an admitted job's choice waits for KV blocks (the queue waits behind it)

    # ---- the loop

    def run(self) -> None:
        w = self.worker
        self.stats = self.engine.expert_stats()
        while True:
            with w._cond:
                while not w._waiting and not self.runs and not w._stopping:
                    w._cond.wait()
                if w._stopping:
                    break
                admitted = []
                while w._waiting and w._free_slots_locked() > 0 and not self._kv_waits(w._waiting[0]):
                    admitted.append(w._start_next())
            for job in admitted:
                self._admit(job)
            self._retire_cancelled()
            self._start_choices()
            self._decode_step()
            self._prefill_one_chunk()
        for r in list(self.active):  # stopping: whatever still runs is cancelled
            r.job.cancelled.set()
            self._finish(r, "cancelled")
        for run in list(self.runs.values()):  # admitted, no choice running yet
            w._deliver(run.job, Failed("the server is shutting down", code="server_shutdown"))
            self._end_job(run)

    # ---- admission

    def _admit(self, job: Job) -> None:
        now = time.monotonic()
        run = JobRun(job, now - job.enqueued_at, now)
        self.runs[id(job)] = run
        if job.cancelled.is_set():
            self._end_job(run)
            return
        self.worker._deliver(job, Started(queue_s=run.queue_s))
        self.worker._observe("job_started", run.queue_s)

    def _kv_waits(self, job: Job) -> bool:
        """Whether the first waiting job stays in the queue for KV blocks: an admitted one's choice
        waits for them (first come first served), or its first choice does not fit beside the running
        ones now (one that never fits, or a prompt the engine refuses, is admitted to be refused)."""
        room_of = getattr(self.engine, "kv_room", None)
        if room_of is None:
            return False
        if self.kv_waiting:
            return True
        choice = job.choices[0]
        if not choice.prompt_ids or len(choice.prompt_ids) >= self.engine.max_context:
            return False
        room = room_of(choice.prompt_ids, choice.max_new_tokens, **_echoed(choice))
        return room.ever and not room.fits

    def _start_choices(self) -> None:
        """Admitted jobs' next choices take the free slots, oldest job first. A choice whose prompt an
        earlier choice of its job is prefilling waits for it: then it shares that prompt's blocks. One
        that waits for KV blocks holds back every later one."""
        self.kv_waiting = False
        for run in list(self.runs.values()):
            while run.unstarted and len(self.engine.open_sequences) < self.slots and id(run.job) in self.runs:
                prompt = run.job.choices[run.next].prompt_ids
                if prompt not in run.prefilled and \
                        any(r.run is run and r.prefilling and r.prompt == prompt for r in self.active):
                    break
                if not self._start_choice(run):
                    self.kv_waiting = True
                    return
            if len(self.engine.open_sequences) >= self.slots:
                return

    def _start_choice(self, run: JobRun) -> bool:
        """Open a slot for `run`'s next choice, or end that choice (nothing to generate) or the job
        (refused, cancelled) at once; False where it waits for KV blocks (nothing done)."""
        w, engine, job, index = self.worker, self.engine, run.job, run.next
        choice = job.choices[index]
        try:
            engine.check_prompt(choice.prompt_ids)
        except MoestreamError as exc:  # refused before starting, as engine.generate would
            return self._refuse(run, one_line(exc))
        tokens = None
        room_of = getattr(engine, "kv_room", None)
        if room_of is not None:
            budget = max(0, min(choice.max_new_tokens, engine.max_context - len(choice.prompt_ids)))
            room = room_of(choice.prompt_ids, budget, **_echoed(choice))
            if not room.ever:
                return self._refuse(run, f"the request needs {room.need} KV blocks of {room.block_size} tokens "
                                         f"(its prompt of {len(choice.prompt_ids)} tokens plus max_tokens "
                                         f"{choice.max_new_tokens}); the KV pool holds {room.total}")
            if not room.fits:
                return False
            tokens = len(choice.prompt_ids) + budget
        run.next += 1
        slot = self._open_slot(choice.prompt_ids, tokens)
        if choice.echo:
            try:
                ok = w._echo(job, choice, index, seq=slot)
            except BaseException as exc:
                engine.close_sequence(slot)
                self._fail(job, exc)
                return True
            self._account()  # the prompt's scoring is cache work too
            if not ok:  # cancelled
                engine.close_sequence(slot)
                self._end_job(run)
                return True
        if choice.max_new_tokens <= 0:
            engine.close_sequence(slot)
            w._nothing_to_generate(job, choice, index, self._last_to_end(run), run.queue_s)
            self._choice_over(run)
            return True
        self.active.append(self._running(run, index, slot))
        run.running += 1
        return True

    def _refuse(self, run: JobRun, message: str) -> bool:
        """End `run`'s job at its next choice, refused (a 400)."""
        run.next += 1
        self.worker._deliver(run.job, Failed(message, code="invalid_request"))
        self._end_job(run)
        return True

    def _last_to_end(self, run: JobRun) -> bool:
        """Whether the choice of `run` ending now (no longer counted as running) is its job's last."""
        return not run.unstarted and run.running == 0

    def _open_slot(self, prompt: list[int], tokens: int | None) -> int:
        """The free slot sharing the longest start with `prompt`; among equals the least recently used.
        `tokens`: the positions it may reach, kept free for it in the KV pool (None: no such count)."""
        engine = self.engine
        free = [s for s in range(self.slots) if s not in engine.open_sequences]
        best = max(free, key=lambda s: (common_prefix(engine.caches[s].tokens, prompt), -self.last_used[s]))
        if tokens is None:
            return engine.open_sequence(prompt, slot=best)
        return engine.open_sequence(prompt, slot=best, tokens=tokens)

    def _running(self, run: JobRun, index: int, slot: int) -> Running:
        engine, job = self.engine, run.job
        choice = job.choices[index]
        prompt = list(choice.prompt_ids)
        state: dict = {"tokens": [], "finish": "length"}
        emit = engine.emitter(prompt, state, sampling=choice.sampling, logprobs=job.engine_logprobs,
                              should_stop=job.cancelled.is_set)
        # what the slot kept of the prompt; the last prompt token is always run (its logits start decoding)
        reused = min(engine.caches[slot].length, len(prompt) - 1)
        r = Running(job, slot, run, prompt,
                    budget=min(choice.max_new_tokens, engine.max_context - len(prompt)), emit=emit, state=state,
                    text=ChoiceText(self.worker, job, index), before=self.stats, computed=reused, reused=reused)
        spec = self.worker.speculative
        if spec is not None:
            r.spec_off = spec.not_used_reason(choice.sampling)
            if r.spec_off is None:
                r.speculation = spec.for_one_sequence()
        return r

    # ---- the steps

    def _prefill_one_chunk(self) -> None:
        newcomers = [r for r in self.active if r.prefilling]
        if not newcomers:
            return
        r = newcomers[0]
        end = min(len(r.prompt), r.computed + self.chunk)
        try:
            # the slot holds prompt[:computed]: prefill reuses it and computes prompt[computed:end]
            logits, reused = self.engine.prefill(r.prompt[:end], seq=r.slot)
        except BaseException as exc:
            self._account()
            self._drop(r)
            self._fail(r.job, exc)
            return
        self._account()
        r.reused += max(0, reused - r.computed)  # blocks the pool shared (another slot computed them)
        r.computed = end
        if not r.prefilling:
            r.run.prefilled.append(r.prompt)
            r.prefill_s = time.perf_counter() - r.t0
            r.t_decode = time.perf_counter()
            self._take(r, r.emit.take(logits[-1:], room=1))

    def _joining(self, ready: list[Running]) -> dict[int, list[int]]:
        """{id(newcomer): its prompt tokens} of the newcomers that join this decode step, oldest first,
        while the step's rows last (none with speculation: the drafts' rows are not known yet)."""
        prompt_step = getattr(self.engine, "prompt_step", None)
        if prompt_step is None or self.worker.speculative is not None:
            return {}
        rows, out = len(ready), {}
        for r in self.active:
            if r.prefilling and r.computed == r.reused:  # not begun by chunks
                tokens = prompt_step(r.prompt, seq=r.slot, beside=rows)
                if tokens is not None:
                    out[id(r)] = tokens
                    rows += len(tokens)
        return out

    def _decode_step(self) -> None:
        ready = [r for r in self.active if r.next_token is not None]
        joining = self._joining(ready)
        newcomers = [r for r in self.active if id(r) in joining]
        if not ready and not newcomers:
            return
        if ready:
            self.worker._observe("batch_step", len(ready))
        drafts = {id(r): self._draft(r) for r in ready}
        batch = {r.slot: [r.next_token] + drafts[id(r)][1] for r in ready}
        batch.update({r.slot: joining[id(r)] for r in newcomers})
        t0 = time.perf_counter()
        try:
            logits = self.engine.step_many(batch)
            if any(r.speculation is not None for r in ready):
                getattr(self.engine, "_sync", lambda: None)()  # the step's time is the policies' measurement
        except BaseException as exc:  # the whole step failed: so does every request in it
            self._account()
            for r in ready + newcomers:
                self._drop(r)
                self._fail(r.job, exc)
            return
        step_s = time.perf_counter() - t0
        self._account()
        now = time.perf_counter()
        for r in newcomers:  # their prompts are in their slots now; their first choice follows
            r.computed = len(r.prompt)
            r.run.prefilled.append(r.prompt)
            r.prefill_s, r.t_decode = now - r.t0, now
        ready = newcomers + ready
        # the plain greedy rows' choices at once: one reduction and one wait for the device per step, not one each
        plain = [r for r in ready if r.speculation is None and r.emit.plain_argmax]
        choose = getattr(self.engine, "greedy_choices", None)
        if choose is None:
            plain = []
        picks = dict(zip(map(id, plain), choose([logits[r.slot][-1] for r in plain]) if plain else []))
        for r in ready:
            if r not in self.active:  # a sibling choice ended its job (cancelled) earlier in this loop
                continue
            k, draft = drafts.get(id(r), (0, []))
            rows = logits[r.slot]
            if r.speculation is None:
                pick = picks.get(id(r))
                self._take(r, r.emit.take(rows[-1:], room=1, chosen=None if pick is None else [pick]))
                continue
            self._take(r, r.speculation.verify(r.emit, rows, k, draft, room=r.budget - r.text.generated, started=t0,
                                               step_s=step_s))
            if r in self.active and r.speculation.accepted < len(draft):
                self.engine.rollback(len(r.emit.seq) - 1, seq=r.slot)  # forget the rejected drafts

    def _draft(self, r: Running) -> tuple[int, list[int]]:
        """(the length chosen, the drafted tokens) of `r`'s next step: none without speculation."""
        if r.speculation is None:
            return 0, []
        context = r.emit.seq
        k = r.speculation.length(min(r.budget - r.text.generated - 1, self.engine.max_context - len(context)))
        return k, r.speculation.draft(context, k)

    def _take(self, r: Running, events: Iterator) -> None:
        """Deliver the tokens `events` gives `r` at its next positions (text, log-probabilities), then
        retire it where it ends: an end token or a cancel (its Emitter stopped), a stop string, its length."""
        job, end = r.job, None
        r.next_token = None
        try:
            for event in events:
                r.text.token(event)
                if r.text.matcher.stopped:
                    end = "stop"
                elif job.cancelled.is_set():
                    end = "cancelled"
                elif r.text.generated >= r.budget:
                    r.text.flush()
                    end = "length"
                else:
                    r.next_token = event.token_id
                    continue
                break
        finally:
            events.close()  # its figures recorded before a receipt reads them
        if end is None and r.emit.stopped:  # EOS, or cancelled
            r.text.flush()
            end = "cancelled" if job.cancelled.is_set() else r.state["finish"]
        if end is not None:
            self._finish(r, end)

    # ---- leaving

    def _retire_cancelled(self) -> None:
        for r in [r for r in self.active if r.job.cancelled.is_set()]:
            self._finish(r, "cancelled")
        for run in [run for run in self.runs.values() if run.job.cancelled.is_set()]:  # none running
            self._end_job(run)

    def _finish(self, r: Running, reason: str) -> None:
        if r not in self.active:  # its job already ended (a sibling choice cancelled or failed it)
            return
        w, engine, run = self.worker, self.engine, r.run
        self._drop(r)
        now = time.perf_counter()
        if r.prefilling:
            r.prefill_s = now - r.t0
        decode_s = now - r.t_decode if r.t_decode else 0.0
        # the cache's counters over the steps this request shared with the others running then
        receipt = dict(Receipt.of_run(prompt_tokens=len(r.prompt), reused=r.reused, generated=r.text.generated,
                                      finish=reason, prefill_s=r.prefill_s, decode_s=decode_s, before=r.before,
                                      after=self.stats, memory=engine.memory_ledger(),
                                      device=str(engine.device), model=engine.model_name,
                                      verify=engine.options.verify))
        if r.speculation is not None:
            receipt["speculative"] = r.speculation.stats.to_json()
        elif r.spec_off is not None:
            receipt["speculative_off"] = r.spec_off
        # the metrics count the cache's work per step (_work_since), not per request, which would count a shared
        # step once for each request in it
        observed = {k: v for k, v in receipt.items() if k not in COUNTERS}
        going_on = w._end_choice(r.text, self._last_to_end(run), run.queue_s, len(r.prompt), reason, receipt,
                                 observed=observed)
        if going_on and not r.job.cancelled.is_set():
            self._choice_over(run)
        else:  # cancelled: its other choices go too
            self._end_job(run)

    def _choice_over(self, run: JobRun) -> None:
        """One of `run`'s choices ended; the job ends with its last."""
        self.worker._choice_ended(run.job)
        if not run.unstarted and run.running == 0:
            self._end_job(run)

    def _drop(self, r: Running) -> None:
        """Take `r` out of the batch and free its slot (its tokens stay cached)."""
        if r in self.active:
            self.active.remove(r)
            r.run.running -= 1
            self.engine.close_sequence(r.slot)
            self.last_used[r.slot] = time.monotonic()

    def _fail(self, job: Job, exc: BaseException) -> None:
        run = self.runs.get(id(job))
        if run is None:  # already failed (another of its choices in the same step)
            return
        log.error("request %s failed: %s", job.request_id, exc, exc_info=not isinstance(exc, MoestreamError))
        self.worker._deliver(job, Failed(one_line(exc)))
        self._end_job(run)

    def _end_job(self, run: JobRun) -> None:
        """The job is over (answered, failed or cancelled): its choices still running leave the batch."""
        for r in [r for r in self.active if r.run is run]:
            self._drop(r)
        if self.runs.pop(id(run.job), None) is not None and not run.job.done.is_set():
            self.worker._job_done(run.job, run.started)

    def _account(self) -> None:
        """Read the cache's counters once after an engine call; the metrics count its work (a step shared
        by several requests once)."""
        before, self.stats = self.stats, self.engine.expert_stats()
        self.worker._observe("expert_work", {k: self.stats.get(k, 0) - before.get(k, 0) for k in COUNTERS})
