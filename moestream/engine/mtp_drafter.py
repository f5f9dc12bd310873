"""The multi-token-prediction drafter (`--speculative mtp`): the model's own MTP layer drafts.

The MTP layer (moestream.layers.mtp) at position p reads the main model's final residual state h_p
and the token t_{p+1} and guesses t_{p+2}. The engine hands every state slot 0 computes to
`hidden_tap`, so for a draft after L tokens the drafter brings its own KV cache up to the pairs
(h_p, t_{p+1}) for p <= L-2, whose last output guesses t_L; each further draft runs the layer on its
own output state and the token it just drafted, positions forgotten again (its cache keeps only
accepted tokens' pairs). Only the first MTP layer drafts (every published checkpoint has one); its
experts are expert layer num_hidden_layers of the same slot cache, out of traces and prefetches."""
from __future__ import annotations

from typing import Sequence

import torch

from moestream.engine.types import common_prefix
from moestream.engine.speculative import ModelDrafter
from moestream.errors import MoestreamError
from moestream.kv.pool import KVPool


class MTPDrafter(ModelDrafter):
    name = "mtp"

    def __init__(self, engine):
        super().__init__()
        layers = getattr(engine.model, "mtp", None)
        if not layers:
            raise MoestreamError(f"--speculative mtp: the model {engine.model_name!r} ({engine.packed.family}) has no "
                                 "multi-token-prediction layers (its family has none, its checkpoint had none, or it "
                                 "was converted with --no-mtp)")
        self.layer, self.engine = layers[0], engine
        self.pool = KVPool([self.layer.kv], max_sequences=1, max_context=engine.max_context, dtype=engine.dtype,
                           device=engine.device, prefill_chunk=engine.plan.prefill_chunk)
        self.cache = self.pool.sequences[0]
        self.context: list[int] = []  # the tokens the cache's pairs are built from: pair p is (h_p, context[p + 1])
        self.states: dict[int, torch.Tensor] = {}  # position -> the main model's state [H], not yet in the cache
        self.seen_end = 0  # one past the last position the engine handed over
        self.last_logits: list[torch.Tensor] = []  # the last proposal's rows [V], one per drafted token
        engine.hidden_tap = self._see
        engine.reset()  # from here on the tap sees every position slot 0 computes

    def _see(self, start: int, hidden: torch.Tensor) -> None:
        """The engine computed positions start.. (hidden [T, H]); later ones it had are stale."""
        end = start + hidden.shape[0]
        for p in range(end, self.seen_end):
            self.states.pop(p, None)
        for t in range(hidden.shape[0]):
            self.states[start + t] = hidden[t]
        self.seen_end = end

    def _run(self, hidden: torch.Tensor, tokens: list[int], start: int) -> tuple[torch.Tensor, torch.Tensor]:
        ids = torch.tensor(tokens, dtype=torch.long, device=self.engine.device)
        self.cache.reserve(start, start + len(tokens))
        self.pool.sync()
        out, logits = self.layer(hidden, ids, start, self.pool.layer(0))
        self.cache.append(tokens)
        return out, logits

    def propose(self, context: Sequence[int], k: int) -> list[int]:
        ctx = list(context)
        L = len(ctx)
        k = min(k, self.engine.max_context - L)
        self.last_logits = []
        if k <= 0 or L < 2:
            return []
        # pairs whose tokens the context still has stay; the rest are recomputed
        kept = self.cache.truncate(max(0, min(common_prefix(self.context, ctx) - 1, self.cache.length)))
        self.context = ctx[:kept + 1]
        missing = [p for p in range(kept, L - 1) if p not in self.states]
        if missing:  # computed before the drafter saw them: nothing to draft from
            return []
        with torch.inference_mode(), self.engine.experts.quiet():
            if kept < L - 1:
                chunk = max(1, self.engine.plan.prefill_chunk)  # a long prompt's pairs in prefill-sized pieces
                for start in range(kept, L - 1, chunk):
                    end = min(start + chunk, L - 1)
                    hidden = torch.stack([self.states[p] for p in range(start, end)])
                    state, logits = self._run(hidden, ctx[start + 1:end + 1], start)
                self.context = ctx
                for p in [p for p in self.states if p < L - 2]:  # the last stays: a repeated proposal reruns it
                    del self.states[p]
            else:  # the cache already ends at this context: run its last pair again for its output
                self.cache.truncate(L - 2)
                hidden = self.states.get(L - 2)
                if hidden is None:
                    return []
                state, logits = self._run(hidden[None], [ctx[L - 1]], L - 2)
            valid = self.cache.length
            draft = [self._choose(logits[-1], L)]
            self.last_logits.append(logits[-1].clone())
            while len(draft) < k:  # chained: its own state and the token it drafted, at the next position
                state, logits = self._run(state[-1:], [draft[-1]], self.cache.length)
                draft.append(self._choose(logits[-1], L + len(draft)))
                self.last_logits.append(logits[-1].clone())
            self.cache.truncate(valid)  # the chained positions are guesses: forgotten
        return draft

    def reset(self) -> None:
        self.cache.truncate(0)
        self.context, self.states, self.seen_end = [], {}, 0
        self.engine.reset()

    def close(self) -> None:
        if self.engine.hidden_tap == self._see:
            self.engine.hidden_tap = None
