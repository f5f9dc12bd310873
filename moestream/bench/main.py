"""What `moestream bench` measures: prefill and decode speed, hit rate and read bandwidth per tier of
one loaded engine, and the same weights through transformers."""
from __future__ import annotations

import logging
import resource
import statistics
import subprocess
import time
from typing import Callable

import torch

from moestream.bench.plots import pyplot, save_png
from moestream.errors import MoestreamError

log = logging.getLogger(__name__)


def drop_page_cache() -> bool:
    """Empty the OS page cache so expert reads come from the disk (needs root)."""
    try:
        subprocess.run(["sync"], check=False)
        with open("/proc/sys/vm/drop_caches", "w") as fh:
            fh.write("3\n")
        return True
    except OSError:
        return False


def random_prompt(n: int, vocab: int, seed: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab, (n,), generator=g).tolist()


def parse_lengths(text: str) -> list[int]:
    """"512,2048" -> [512, 2048]; a clear error for anything that is not a positive integer."""
    lengths = []
    for part in (p.strip() for p in text.split(",")):
        if not part:
            continue
        if not part.isdigit() or int(part) < 1:
            raise MoestreamError(f"--prefill-tokens: {part!r} is not a positive number of tokens")
        lengths.append(int(part))
    return lengths


def decode_run(engine, prompt: list[int], tokens: int, speculative=None) -> tuple[dict, list[int]]:
    """One decode of `tokens` tokens from `prompt` (prefilled whole): its receipt and tokens."""
    engine.reset()
    gen = engine.generate(prompt, max_new_tokens=tokens, stop_at_eos=False, speculative=speculative)
    ids = [event.token_id for event in gen]
    return gen.result.receipt, ids


def measure_speculative(engine, prompt: list[int], tokens: int, speculative, plain: tuple[dict, list[int]]) -> dict:
    """Decode speed with and without speculation on one prompt, in the order plain (already run:
    `plain`), speculative, speculative, plain: a drift in the machine's speed (caches warming,
    other load) weighs on both sides alike. Each side's tok/s is the mean of its two runs."""
    runs = {"plain": [plain], "speculative": []}
    runs["speculative"].append(decode_run(engine, prompt, tokens, speculative))
    runs["speculative"].append(decode_run(engine, prompt, tokens, speculative))
    runs["plain"].append(decode_run(engine, prompt, tokens))
    rates = {side: [r["decode_tok_s"] or 0.0 for r, _ in pair] for side, pair in runs.items()}
    mean = {side: sum(v) / len(v) for side, v in rates.items()}
    specs = [r["speculative"] for r, _ in runs["speculative"]]
    drafted, accepted = sum(s["drafted"] for s in specs), sum(s["accepted"] for s in specs)
    steps, step_tokens = sum(s["verify_steps"] for s in specs), sum(r["generated_tokens"] for r, _ in runs["speculative"])
    return {"drafter": specs[0]["drafter"], "draft_tokens": specs[0]["draft_tokens"],
            "order": ["plain", "speculative", "speculative", "plain"],
            "plain_tok_s": rates["plain"], "speculative_tok_s": rates["speculative"],
            "plain_mean_tok_s": round(mean["plain"], 2), "speculative_mean_tok_s": round(mean["speculative"], 2),
            "speedup": round(mean["speculative"] / mean["plain"], 3) if mean["plain"] else None,
            # the first token comes from the prefill; each verification step yields the rest
            "tokens_per_step": round((step_tokens - len(specs)) / steps, 3) if steps else None,
            "accept_rate": round(accepted / drafted, 4) if drafted else None, "drafted": drafted, "accepted": accepted,
            "hit_rate": {"plain": [r["hit_rate"] for r, _ in runs["plain"]],
                         "speculative": [r["hit_rate"] for r, _ in runs["speculative"]]},
            "same_tokens": len({tuple(ids) for pair in runs.values() for _, ids in pair}) == 1,
            "receipt": specs[-1]}


def parse_step_tokens(text: str) -> list[int]:
    """--step-tokens: comma-separated token counts of 1..16 (a step's most)."""
    from moestream.engine.decoder import MAX_STEP_TOKENS

    out = []
    for part in text.split(","):
        part = part.strip()
        if not part.isdigit() or not 1 <= int(part) <= MAX_STEP_TOKENS:
            raise MoestreamError(f"--step-tokens: {part!r} is not a token count of 1..{MAX_STEP_TOKENS}")
        out.append(int(part))
    return sorted(set(out))


def measure(engine, *, prefill_sizes: list[int], decode_tokens: int, seed: int, prompt: list[int] | None = None,
            speculative=None, prefill_repeats: int = 1, on_phase: Callable[[str], None] | None = None) -> dict:
    """on_phase(name): told as each phase starts ("prefill 512", "decode 128", "speculative"), for a progress display."""
    phase = on_phase or (lambda name: None)
    vocab = engine.args.vocab_size
    out = {"prefill": []}
    for n in prefill_sizes:
        if n + 1 >= engine.max_context:
            raise MoestreamError(f"a prefill of {n} tokens does not fit the context of {engine.max_context} tokens")
        phase(f"prefill {n}")
        times, before = [], engine.expert_stats()
        # with repeats, one run first that is not counted: a prefill graph's bucket is captured at its
        # second prompt, so the counted runs are the capture and replays (their median a replay)
        for _ in range(prefill_repeats + (prefill_repeats > 1)):  # the same prompt each time, from an empty cache
            engine.reset()
            t0 = time.perf_counter()
            engine.prefill(random_prompt(n, vocab, seed + n))
            engine._sync()
            times.append(time.perf_counter() - t0)
        after = engine.expert_stats()
        first, times = times[0], times[-prefill_repeats:]
        dt = statistics.median(times)
        out["prefill"].append({"tokens": n, "s": round(dt, 4), "tok_s": round(n / dt, 2),
                               "hit_rate": _hit_rate(before, after),
                               **({"runs_s": [round(t, 4) for t in times], "first_s": round(first, 4)}
                                  if prefill_repeats > 1 else {})})
    engine.reset()
    cuda = engine.device.type == "cuda"
    if cuda:
        run_peak = torch.cuda.max_memory_reserved(engine.device)
        engine.release_workspace()
        torch.cuda.reset_peak_memory_stats(engine.device)
    decode_start = engine.expert_stats()
    prompt = prompt or random_prompt(16, vocab, seed)
    phase(f"decode {decode_tokens}")
    plain = decode_run(engine, prompt, decode_tokens)
    r = plain[0]
    decode_end = engine.expert_stats()
    host_gb_s = r["bytes_read_host"] / r["read_wait_s"] / 1e9 if r["read_wait_s"] > 0 else None
    out["decode"] = {"tokens": r["generated_tokens"], "s": r["decode_s"], "tok_s": r["decode_tok_s"],
                     "hit_rate": r["hit_rate"], "misses": r["misses"], "bytes_read_disk": r["bytes_read_disk"],
                     "bytes_read_host": r["bytes_read_host"], "read_wait_s": r["read_wait_s"],
                     "disk_gb_s_while_waiting": round(r["bytes_read_disk"] / r["read_wait_s"] / 1e9, 3) if r["read_wait_s"] > 0 else None,
                     "host_gb_s_while_waiting": round(host_gb_s, 3) if host_gb_s else None}
    if "cpu_share" in decode_end and "cpu_share" in decode_start:  # what the CPU computed during the decode
        out["decode"].update({k: decode_end[k] - decode_start[k] for k in (
            "cpu_experts", "cpu_fallbacks", "cpu_timeouts", "cpu_jobs", "cpu_empty_calls", "cpu_late_calls",
            "cpu_pairs", "cpu_errors", "cpu_bytes")})
        kernel_s = decode_end["cpu_compute_s"] - decode_start["cpu_compute_s"]
        out["decode"]["cpu_kernel_gb_s"] = round(out["decode"]["cpu_bytes"] / kernel_s / 1e9, 3) if kernel_s > 0 else None
        out["decode"].update({k: decode_end[k] for k in (
            "cpu_share", "cpu_worker_threads", "cpu_worker_pinned", "cpu_worker_activations", "cpu_share_now",
            "cpu_kernel_gb_s_ema", "cpu_handover_us_ema", "cpu_misses_per_job_ema", "copy_gb_s", "copy_gb_s_timed")})
    if speculative is not None:
        phase("speculative")
        out["speculative"] = measure_speculative(engine, prompt, decode_tokens, speculative, plain)
    out["experts"] = engine.expert_stats()
    if cuda:  # what the run really held (prefills included), and what the decode alone held
        decode_peak = torch.cuda.max_memory_reserved(engine.device)
        out["device_memory"] = {"max_reserved": max(run_peak, decode_peak), "decode_max_reserved": decode_peak,
                                "decode_max_allocated": torch.cuda.max_memory_allocated(engine.device)}
    out["memory"] = engine.memory_ledger()
    if not cuda:  # the device is RAM: what the process held at its peak, to set beside the ledger's total
        out["memory"]["max_rss"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    return out


def _hit_rate(before: dict, after: dict) -> float:
    hits = after.get("hits", 0) - before.get("hits", 0)
    misses = after.get("misses", 0) - before.get("misses", 0)
    return round(hits / (hits + misses), 4) if hits + misses else 1.0


def compare_transformers(model_dir: str, *, device: str, prefill: int, decode_tokens: int, seed: int) -> dict:
    """The same (dequantized) weights through transformers, bf16, everything on the device."""
    import tempfile

    from transformers import AutoModelForCausalLM

    from moestream.convert.export_hf import export_hf

    with tempfile.TemporaryDirectory() as tmp:
        export_hf(model_dir, tmp, dtype=torch.bfloat16)
        model = AutoModelForCausalLM.from_pretrained(tmp, dtype=torch.bfloat16).to(device).eval()
    vocab = model.config.vocab_size
    ids = torch.tensor([random_prompt(prefill, vocab, seed)], device=device)
    sync = torch.cuda.synchronize if device.startswith("cuda") else (lambda: None)
    with torch.inference_mode():
        model(ids[:, :8])
        sync()
        t0 = time.perf_counter()
        model(ids)
        sync()
        prefill_s = time.perf_counter() - t0
        short = torch.tensor([random_prompt(16, vocab, seed)], device=device)
        t0 = time.perf_counter()
        model.generate(short, max_new_tokens=decode_tokens, min_new_tokens=decode_tokens, do_sample=False)
        sync()
        decode_s = time.perf_counter() - t0
    return {"prefill_tokens": prefill, "prefill_tok_s": round(prefill / prefill_s, 2),
            "decode_tokens": decode_tokens, "decode_tok_s": round(decode_tokens / decode_s, 2)}


def plot(results: dict, path: str) -> None:
    runs = results["runs"]
    labels = [r["cache_size"] for r in runs]
    fig, ax1 = pyplot().subplots(figsize=(6, 3.5))
    ax1.bar(labels, [r["decode"]["tok_s"] or 0 for r in runs], color="#4C72B0")
    ax1.set_xlabel("device expert cache")
    ax1.set_ylabel("decode tok/s")
    ax2 = ax1.twinx()
    ax2.plot(labels, [r["decode"]["hit_rate"] for r in runs], "o-", color="#DD8452")
    ax2.set_ylabel("expert hit rate")
    ax2.set_ylim(0, 1.05)
    ax1.set_title(f"{results['model']} on {results['machine'].get('gpu') or results['machine']['cpu']}", fontsize=9)
    save_png(fig, path)
