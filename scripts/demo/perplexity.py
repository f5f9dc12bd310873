"""Held-out perplexity of the packed demo model, through moestream and through transformers.

Both passes score the same windows of the test split (`build/demo-data/test.npy`, made by
`train_demo.py prepare`) with the same weights:

  moestream     Engine.load(--model), then per window engine.reset() and
                engine.prefill(window, all_logits=True): every position's logits, streaming the
                experts through the slot cache (the demo model's default cache is 30 % of its experts)
  transformers  export_hf(--model) writes the packed model's dequantized weights as a float32 HF
                checkpoint; AutoModelForCausalLM loads it with eager attention and experts

The windows are those of `train_demo.py check`: the split's tokens cut into consecutive windows of
--seq-len predictions (inputs tokens[s:s+L], targets tokens[s+1:s+L+1]; the last window is
shorter), crossing file boundaries (each file ends with <|endoftext|>). Without --max-windows that
is the whole split, the same windows as the bf16 figure in README.md. --original DIR also scores an
HF checkpoint (the bf16 one the packed model was converted from) on the same windows, in float32.

    python scripts/demo/perplexity.py --original build/demo-hf --out build/demo-perplexity.json
"""
from __future__ import annotations

import argparse
import hashlib
import json
import math
import os
import shlex
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

# From README.md (`train_demo.py check`): the bf16 checkpoint in float32 on CPU, whole test split.
DIFF_REPORTED = 1e-3  # positions whose log-probabilities differ by more than this are listed in the JSON
BF16_README = {"loss": 2.2601, "ppl": 9.584, "predicted_tokens": 289028, "windows": "the whole test split, seq_len 512",
               "source": "scripts/demo/README.md (train_demo.py check --model build/demo-hf --data build/demo-data)"}


def windows(n_tokens: int, seq_len: int, max_windows: int | None) -> list[tuple[int, int]]:
    """(start, length) of each window: `length` inputs predicting the `length` next tokens."""
    n_pred = n_tokens - 1
    starts = list(range(0, n_pred, seq_len))
    if max_windows is not None:
        starts = starts[:max_windows]
    return [(s, min(seq_len, n_pred - s)) for s in starts]


def load_reference(folder: str | Path):
    from transformers import AutoModelForCausalLM

    kwargs = {"attn_implementation": "eager", "dtype": torch.float32}
    try:
        model = AutoModelForCausalLM.from_pretrained(folder, experts_implementation="eager", **kwargs)
    except TypeError:  # transformers 4 has no experts_implementation (its experts are eager)
        model = AutoModelForCausalLM.from_pretrained(folder, **kwargs)
    return model.eval()


class Scorer:
    """Sum of next-token negative log-likelihoods (float64) over the windows it is given."""

    def __init__(self, name: str):
        self.name, self.nll, self.tokens, self.seconds = name, 0.0, 0, 0.0

    def add(self, logprobs: torch.Tensor, targets: torch.Tensor, seconds: float) -> None:
        self.nll += -float(logprobs.gather(1, targets[:, None]).double().sum())
        self.tokens += int(targets.numel())
        self.seconds += seconds

    def result(self) -> dict:
        loss = self.nll / max(self.tokens, 1)
        return {"loss": round(loss, 6), "ppl": round(math.exp(loss), 4), "predicted_tokens": self.tokens,
                "nll_sum": round(self.nll, 4), "seconds": round(self.seconds, 1)}


def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as fh:
        for block in iter(lambda: fh.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", help="packed model directory (default: the built-in demo model)")
    p.add_argument("--data", default=str(ROOT / "build" / "demo-data"), help="prepared data folder (test.npy)")
    p.add_argument("--seq-len", type=int, default=512)
    p.add_argument("--max-windows", type=int, help="score only the first N windows (default: the whole split)")
    p.add_argument("--device", default="cpu")
    p.add_argument("--cache-size", default="auto", help="moestream expert cache (default: the model's default; demo 30%%)")
    p.add_argument("--original", help="also score this HF checkpoint (e.g. build/demo-hf, bf16) in float32, "
                                      "on the same windows")
    p.add_argument("--threads", type=int, default=1, help="torch intra-op threads (default 1)")
    p.add_argument("--out", help="write the results as JSON to this file")
    args = p.parse_args(argv)
    command = "python " + " ".join(shlex.quote(a) for a in [os.path.relpath(sys.argv[0], ROOT)] + sys.argv[1:])

    torch.set_num_threads(args.threads)
    import transformers

    from moestream.bench.machine import machine_info
    from moestream.engine.engine import Engine
    from moestream.engine.options import EngineOptions
    from moestream.convert.export_hf import export_hf

    test_path = Path(args.data) / "test.npy"
    tokens = torch.from_numpy(np.load(test_path).astype(np.int64))
    spans = windows(tokens.numel(), args.seq_len, args.max_windows)
    engine = Engine.load(args.model, options=EngineOptions(device=args.device, cache_size=args.cache_size))
    packed_dir = engine.packed.directory
    scorers = {"moestream": Scorer("moestream"), "transformers": Scorer("transformers")}
    max_diff = 0.0  # largest |log p| difference, moestream vs transformers, over every position and vocabulary entry
    differing = []  # windows with positions whose log-probabilities differ by more than DIFF_REPORTED
    tmp = tempfile.TemporaryDirectory()  # kept until the end: the reference may map its weights from it
    models = {"transformers": load_reference(export_hf(packed_dir, Path(tmp.name) / "hf"))}
    if args.original:
        models["original"] = load_reference(args.original)
        scorers["original"] = Scorer("original")
    before = engine.expert_stats()
    t_all = time.perf_counter()
    for i, (start, length) in enumerate(spans):
        inputs = tokens[start:start + length]
        targets = tokens[start + 1:start + length + 1]
        t0 = time.perf_counter()
        engine.reset()
        logits, _ = engine.prefill(inputs.tolist(), all_logits=True)
        ours = logits.float().cpu().log_softmax(-1)
        scorers["moestream"].add(ours, targets, time.perf_counter() - t0)
        for name, model in models.items():
            t0 = time.perf_counter()
            with torch.no_grad():
                ref = model(input_ids=inputs[None]).logits[0].float().log_softmax(-1)
            scorers[name].add(ref, targets, time.perf_counter() - t0)
            if name == "transformers":
                per_position = (ours - ref).abs().amax(dim=-1)  # [T]
                max_diff = max(max_diff, float(per_position.max()))
                apart = int((per_position > DIFF_REPORTED).sum())
                if apart:
                    differing.append({"window": i, "start": start, "positions": apart,
                                      "first_position": int((per_position > DIFF_REPORTED).nonzero()[0]),
                                      "max_abs_logprob_diff": round(float(per_position.max()), 6)})
        if (i + 1) % 50 == 0 or i + 1 == len(spans):
            print(f"{i + 1}/{len(spans)} windows, {time.perf_counter() - t_all:.0f} s: "
                  + ", ".join(f"{n} {s.result()['ppl']:.4f}" for n, s in scorers.items()), flush=True)
    after = engine.expert_stats()
    hits, misses = after["hits"] - before["hits"], after["misses"] - before["misses"]
    engine.close()
    tmp.cleanup()

    results = {name: s.result() for name, s in scorers.items()}
    results["moestream"].update({
        "how": "Engine.load + reset + prefill(window, all_logits=True), log-softmax, NLL of the next tokens",
        "device": str(engine.device), "dtype": str(engine.dtype).replace("torch.", ""),
        "expert_cache": {"slots": after["slots"], "total_experts": after["total_experts"], "policy": after["policy"],
                         "hits": hits, "misses": misses, "hit_rate": round(hits / max(hits + misses, 1), 4)}})
    results["transformers"].update({
        "how": "export_hf(packed) -> AutoModelForCausalLM float32, eager attention and experts; one window per forward",
        "max_abs_logprob_diff_vs_moestream": max_diff,
        f"positions_differing_over_{DIFF_REPORTED:g}": sum(d["positions"] for d in differing),
        "windows_differing": differing})
    if args.original:
        results["original"].update({"checkpoint": args.original,
                                    "how": "AutoModelForCausalLM float32 (from its stored dtype), eager"})
    whole = args.max_windows is None or args.max_windows >= len(windows(tokens.numel(), args.seq_len, None))
    record = {
        "command": command,
        "model": str(packed_dir.relative_to(ROOT) if packed_dir.is_relative_to(ROOT) else packed_dir),
        "model_manifest_sha256": sha256_file(packed_dir / "moestream.json"),
        "data": {"file": os.path.relpath(test_path, ROOT), "sha256": sha256_file(test_path), "tokens": tokens.numel()},
        "windows": {"seq_len": args.seq_len, "count": len(spans), "whole_split": whole,
                    "rule": "starts 0, L, 2L, ...; inputs tokens[s:s+L], targets tokens[s+1:s+L+1]; last window shorter",
                    "first_start": spans[0][0], "last_start": spans[-1][0], "predicted_tokens": sum(n for _, n in spans)},
        "results": results,
        "bf16_checkpoint_from_readme": BF16_README,
        "versions": {"torch": torch.__version__, "transformers": transformers.__version__},
        "threads": args.threads,
        "machine": {k: v for k, v in machine_info().items() if k != "command"},
        "seconds": round(time.perf_counter() - t_all, 1),
    }
    for name, r in results.items():
        print(f"{name:>12}: loss {r['loss']:.4f}  perplexity {r['ppl']:.4f}  over {r['predicted_tokens']} tokens")
    print(f"max |log p| difference moestream vs transformers: {max_diff:.2e} "
          f"({sum(d['positions'] for d in differing)} positions in {len(differing)} windows over {DIFF_REPORTED:g}); "
          f"moestream expert hit rate {results['moestream']['expert_cache']['hit_rate']:.3f} "
          f"({after['slots']} of {after['total_experts']} slots)")
    print(f"bf16 checkpoint (README, {BF16_README['windows']}): perplexity {BF16_README['ppl']}")
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(record, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
