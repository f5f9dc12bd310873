"""Measure `moestream convert`'s peak memory on a synthetic checkpoint of a few GB.

Builds a qwen3_moe checkpoint with random bf16 weights (one shard per layer, written shard by
shard, never holding the model), then runs `python -m moestream convert` in a subprocess while
sampling its RSS with psutil. Prints one JSON object with the sizes, peak RSS and wall time.

    python scripts/measure_convert_rss.py --workdir /tmp/moestream-rss --quant q4 none
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import subprocess
import sys
import time
from pathlib import Path

import psutil


def build_checkpoint(folder: Path, *, layers: int, experts: int, hidden: int, moe_intermediate: int, vocab: int,
                     heads: int, kv_heads: int, head_dim: int, seed: int = 0) -> int:
    """Write the checkpoint one layer-shard at a time; returns its size in bytes."""
    import torch
    from safetensors.torch import save_file

    folder.mkdir(parents=True, exist_ok=True)
    config = {"architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe", "hidden_size": hidden,
              "intermediate_size": 4 * hidden, "moe_intermediate_size": moe_intermediate, "num_hidden_layers": layers,
              "num_attention_heads": heads, "num_key_value_heads": kv_heads, "head_dim": head_dim,
              "num_experts": experts, "num_experts_per_tok": 8, "norm_topk_prob": True, "decoder_sparse_step": 1,
              "mlp_only_layers": [], "vocab_size": vocab, "max_position_embeddings": 4096, "rope_theta": 1000000.0,
              "rms_norm_eps": 1e-6, "tie_word_embeddings": False, "torch_dtype": "bfloat16"}
    (folder / "config.json").write_text(json.dumps(config, indent=1))
    g = torch.Generator().manual_seed(seed)

    def rand(*shape):
        return (torch.randn(*shape, generator=g) * 0.02).to(torch.bfloat16)

    shards = layers + 1
    weight_map, total = {}, 0
    for shard in range(shards):
        name = f"model-{shard + 1:05d}-of-{shards:05d}.safetensors"
        if shard == layers:
            tensors = {"model.embed_tokens.weight": rand(vocab, hidden), "lm_head.weight": rand(vocab, hidden),
                       "model.norm.weight": torch.ones(hidden, dtype=torch.bfloat16)}
        else:
            p = f"model.layers.{shard}."
            tensors = {p + "input_layernorm.weight": torch.ones(hidden, dtype=torch.bfloat16),
                       p + "post_attention_layernorm.weight": torch.ones(hidden, dtype=torch.bfloat16),
                       p + "self_attn.q_proj.weight": rand(heads * head_dim, hidden),
                       p + "self_attn.k_proj.weight": rand(kv_heads * head_dim, hidden),
                       p + "self_attn.v_proj.weight": rand(kv_heads * head_dim, hidden),
                       p + "self_attn.o_proj.weight": rand(hidden, heads * head_dim),
                       p + "self_attn.q_norm.weight": torch.ones(head_dim, dtype=torch.bfloat16),
                       p + "self_attn.k_norm.weight": torch.ones(head_dim, dtype=torch.bfloat16),
                       p + "mlp.gate.weight": rand(experts, hidden)}
            for e in range(experts):
                q = f"{p}mlp.experts.{e}."
                tensors[q + "gate_proj.weight"] = rand(moe_intermediate, hidden)
                tensors[q + "up_proj.weight"] = rand(moe_intermediate, hidden)
                tensors[q + "down_proj.weight"] = rand(hidden, moe_intermediate)
        save_file(tensors, str(folder / name), metadata={"format": "pt"})
        weight_map.update({k: name for k in tensors})
        total += sum(t.numel() * t.element_size() for t in tensors.values())
        del tensors
        print(f"  wrote {name}", file=sys.stderr)
    (folder / "model.safetensors.index.json").write_text(json.dumps({"metadata": {"total_size": total},
                                                                     "weight_map": weight_map}))
    return sum(p.stat().st_size for p in folder.iterdir())


def run_sampled(cmd: list[str], interval: float = 0.01) -> dict:
    """Run `cmd`, sampling its RSS (and the kernel's high-water mark, VmHWM) until it exits.

    (getrusage's children maxrss is not used: a forked child starts with this script's pages.)"""
    start = time.perf_counter()
    proc = psutil.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    peak_sampled, hwm = 0, 0
    while proc.poll() is None:
        try:
            peak_sampled = max(peak_sampled, proc.memory_info().rss)
            with open(f"/proc/{proc.pid}/status") as fh:
                for line in fh:
                    if line.startswith("VmHWM:"):
                        hwm = max(hwm, int(line.split()[1]) * 1024)
        except (psutil.NoSuchProcess, FileNotFoundError, ProcessLookupError):
            pass
        time.sleep(interval)
    stderr = proc.stderr.read().decode(errors="replace")
    wall = time.perf_counter() - start
    if proc.returncode != 0:
        raise SystemExit(f"command failed ({proc.returncode}): {' '.join(cmd)}\n{stderr[-2000:]}")
    return {"peak_rss_sampled": peak_sampled, "peak_rss_hwm": hwm, "wall_s": round(wall, 1)}


def baseline_rss() -> int:
    """RSS of a Python process that has imported the converter (torch included) and done nothing."""
    code = "import moestream.convert.main, psutil; print(psutil.Process().memory_info().rss)"
    return int(subprocess.check_output([sys.executable, "-c", code], text=True).strip())


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--workdir", type=Path, default=Path("/tmp/moestream-rss"))
    p.add_argument("--quant", nargs="+", default=["q4", "none"])
    p.add_argument("--layers", type=int, default=12)
    p.add_argument("--experts", type=int, default=64)
    p.add_argument("--hidden", type=int, default=1024)
    p.add_argument("--moe-intermediate", type=int, default=512)
    p.add_argument("--vocab", type=int, default=32000)
    p.add_argument("--keep", action="store_true", help="keep the checkpoint and outputs")
    args = p.parse_args()

    src = args.workdir / "src"
    if not (src / "model.safetensors.index.json").exists():
        shutil.rmtree(src, ignore_errors=True)
        build_checkpoint(src, layers=args.layers, experts=args.experts, hidden=args.hidden,
                         moe_intermediate=args.moe_intermediate, vocab=args.vocab, heads=16, kv_heads=4, head_dim=64)
    checkpoint_bytes = sum(p.stat().st_size for p in src.iterdir())
    layer_expert_bytes = args.experts * 3 * args.hidden * args.moe_intermediate * 2
    result = {
        "machine": {"cpu": platform.processor() or platform.machine(), "cpus": os.cpu_count(),
                    "ram_bytes": psutil.virtual_memory().total, "python": platform.python_version()},
        "checkpoint_bytes": checkpoint_bytes, "one_layer_experts_bytes": layer_expert_bytes,
        "largest_resident_tensor_bytes": args.vocab * args.hidden * 2,
        "baseline_rss_after_import": baseline_rss(), "runs": {},
    }
    for quant in args.quant:
        out = args.workdir / f"out-{quant}"
        cmd = [sys.executable, "-m", "moestream", "convert", str(src), str(out), "--quant", quant, "--force", "--no-progress"]
        run = run_sampled(cmd)
        run["command"] = " ".join(["python", "-m", "moestream", "convert", str(src), str(out), "--quant", quant, "--force"])
        run["output_bytes"] = sum(p.stat().st_size for p in out.iterdir())
        result["runs"][quant] = run
        print(f"  {quant}: peak RSS {run['peak_rss_hwm'] / 2**20:.0f} MiB, {run['wall_s']} s", file=sys.stderr)
        if not args.keep:
            shutil.rmtree(out)
    if not args.keep:
        shutil.rmtree(src)
    print(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
