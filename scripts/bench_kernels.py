"""Time the Triton MoE kernels against the torch reference on CUDA at the Qwen3-30B-A3B expert shape
(hidden 2048, moe_intermediate 768, 128 experts, top-8) for decode (T=1, 4) and prefill (T=2048).

Reports the achieved bandwidth over the weight bytes of the experts touched (codes + scales +
biases) and, for prefill, the matmul rate; checks the result against the float64 reference;
with --sweep, tries other block sizes and reports the fastest. Writes JSON to --out.

With --rows-products, also the products over a decode step's 16-row tile (the engine's rows-at-once
products) at the same model's shapes: cuBLAS (F.linear) against moestream.kernels.triton_rows for the
fused q/k/v, o, router and head matrices, each timed in a CUDA graph over enough copies of the
matrix that it is read from HBM (as in a step, where 48 layers' matrices pass between two calls);
--rows-sweep tries the kernel's block sizes (the score of the wide ones: a step's 48 x (q/k/v + o)
+ head) and --best-out writes the fastest rows_* fields with the rest.

    python3 scripts/bench_kernels.py --out kernels.json [--sweep] [--rows-products [--rows-sweep]] [--no-experts]
"""
from __future__ import annotations

import argparse
import itertools
import json
import platform
import sys
import time
from dataclasses import asdict, replace
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from moestream.kernels.expert_layout import DEFAULT_CONFIG, SlotLayout  # noqa: E402

HIDDEN, INTER, EXPERTS, TOP_K = 2048, 768, 128, 8
DEVICE = "cuda"
TILE_ROWS, LAYERS = 16, 48  # the decoder's row tile; the model's layers (each runs q/k/v, o and router once)
# (N, K) of the row tile's products: fused q/k/v (32 + 2 x 4 heads of 128), o, router, head
ROW_SHAPES = {"qkv": (5120, HIDDEN), "o": (HIDDEN, 4096), "router": (EXPERTS, HIDDEN), "head": (151936, HIDDEN)}
L2_FLUSH_BYTES = 200 << 20  # copies of a matrix timed in turn: at least this many bytes (the H200's L2 is 50 MB)


def record_layout(bits: int):
    """The packed record layout (fields, record size) and quantization of one expert at `bits`."""
    from moestream.format.records import plan_record
    from moestream.quant.affine import QuantSpec

    shapes = {"gate_proj": (INTER, HIDDEN), "up_proj": (INTER, HIDDEN), "down_proj": (HIDDEN, INTER)}
    tensors = {}
    for proj, (out_f, in_f) in shapes.items():
        tensors[f"{proj}.weight"] = torch.empty((out_f, in_f * bits // 32), dtype=torch.uint32)
        tensors[f"{proj}.scales"] = torch.empty((out_f, in_f // 64), dtype=torch.bfloat16)
        tensors[f"{proj}.biases"] = torch.empty((out_f, in_f // 64), dtype=torch.bfloat16)
    return (*plan_record(tensors), {proj: QuantSpec(bits, 64) for proj in shapes})


def reference_moe(x, pool, fields, quant, ids, weights, slot_of, *, dtype=None):
    """The per-expert torch path: decode each chosen expert's record, dequantize, SwiGLU, weight,
    index_add (dtype: compute dtype, default x's)."""
    from moestream.format.records import decode_record
    from moestream.kernels.reference import expert_ffn

    dtype = dtype or x.dtype
    out = torch.zeros(x.shape, dtype=dtype, device=x.device)
    for e in torch.unique(ids).tolist():
        tok, k = torch.where(ids == e)
        y = expert_ffn(x[tok].to(dtype), decode_record(fields, pool[slot_of[e]]), quant)
        out.index_add_(0, tok, y * weights[tok, k, None].to(dtype))
    return out


def build_pool(bits: int, slots: int, device: str):
    """Random records for EXPERTS experts in the packed layout, made on the device (fast at this size).
    Codes are random bytes; scales/biases are drawn so the expert outputs have unit scale."""
    fields, record_size, quant = record_layout(bits)
    gen = torch.Generator(device=device).manual_seed(0)
    pool = torch.randint(0, 256, (slots, record_size), dtype=torch.uint8, device=device, generator=gen)
    levels = (1 << bits) - 1
    for f in fields:
        if f.name.endswith(".scales"):
            proj = f.name.split(".")[0]
            in_f = INTER if proj == "down_proj" else HIDDEN
            half_range = (3.0 / in_f) ** 0.5
            n = f.nbytes // 2
            s = 2 * half_range / levels * (0.5 + torch.rand((slots, n), device=device, generator=gen))
            b = -s * levels / 2 + 0.3 * half_range * torch.randn((slots, n), device=device, generator=gen)
            pool[:, f.offset:f.offset + f.nbytes].view(torch.bfloat16).copy_(s)
            bf = next(g for g in fields if g.name == f"{proj}.biases")
            pool[:, bf.offset:bf.offset + bf.nbytes].view(torch.bfloat16).copy_(b)
    slot_of = torch.randperm(slots, generator=torch.Generator().manual_seed(1))[:EXPERTS].tolist()
    return pool, fields, quant, slot_of


def routing(tokens: int, device: str, seed: int = 0):
    g = torch.Generator(device=device).manual_seed(seed)
    x = torch.randn(tokens, HIDDEN, device=device, generator=g).to(torch.bfloat16)
    ids = torch.rand(tokens, EXPERTS, device=device, generator=g).topk(TOP_K, dim=-1).indices
    weights = torch.softmax(torch.randn(tokens, TOP_K, device=device, generator=g), dim=-1).to(torch.bfloat16)
    return x, ids, weights


def proj_bytes(layout, projs) -> int:
    return sum(layout_bytes(layout, p) for p in projs)


def layout_bytes(layout, proj: str) -> int:
    out_f, in_f, bits = ((layout.hidden, layout.inter, layout.bits_down) if proj == "down_proj"
                         else (layout.inter, layout.hidden, layout.bits_gate_up))
    return out_f * in_f * bits // 8 + 2 * out_f * (in_f // 64) * 2


def bench(fn, ms: int = 200) -> float:
    """Median milliseconds per call (CUDA events; L2 cleared between calls)."""
    import triton.testing

    return float(triton.testing.do_bench(fn, warmup=25, rep=ms, return_mode="median"))


def graph_ms(fns, reps: int = 20) -> float:
    """Milliseconds per call of fns (run in turn), timed as one CUDA graph replayed `reps` times:
    no launch cost from Python, as in a decode step (a plain timer of a ~10 us kernel measures its launch)."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):  # compile and warm outside the capture
        for fn in fns:
            fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for fn in fns:
            fn()
    graph.replay()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(reps):
        graph.replay()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / reps / len(fns)


def decode_plans(tokens: int, layout, config, calls: int = 16):
    """`calls` plans of `tokens` tokens, each with its own random routing: timed back to back, each
    reads other experts' bytes (the pool is several times the L2), like the layers of a decode step."""
    from moestream.kernels import triton_moe as tm

    return [tm.MoEPlan(*routing(tokens, DEVICE, seed=1000 + c), EXPERTS, layout, config=config) for c in range(calls)]


def one_case(pool_set, bits: int, tokens: int, config, *, reference_ms: bool, check: bool) -> dict:
    from moestream.kernels import triton_moe as tm
    from moestream.kernels.reference import projection

    pool, fields, quant, slot_of = pool_set
    layout = SlotLayout.from_fields(fields, quant)
    x, ids, weights = routing(tokens, DEVICE, seed=tokens)
    experts = torch.unique(ids).tolist()
    slots = [slot_of[e] for e in experts]
    unique = len(experts)
    gu_bytes = unique * proj_bytes(layout, ("gate_proj", "up_proj"))
    d_bytes = unique * proj_bytes(layout, ("down_proj",))
    flops = 2 * tokens * TOP_K * 3 * HIDDEN * INTER

    plan = tm.MoEPlan(x, ids, weights, EXPERTS, layout, config=config)
    r = {"tokens": tokens, "bits": bits, "mode": plan.mode, "unique_experts": unique,
         "weight_bytes": gu_bytes + d_bytes}
    full = torch.tensor([slot_of[e] for e in range(EXPERTS)], dtype=torch.int32, device=DEVICE)
    plans = decode_plans(tokens, layout, config) if plan.mode == "gemv" else [plan]
    r["timing"] = "CUDA graph of 16 calls with their own routing" if plan.mode == "gemv" else "CUDA graph"
    r["gate_up_ms"] = graph_ms([lambda p=p: p.gate_up(pool, full) for p in plans])
    r["down_ms"] = graph_ms([lambda p=p: p.down(pool, full) for p in plans])
    r["combine_ms"] = graph_ms([p.finish for p in plans])
    r["kernels_ms"] = graph_ms([lambda p=p: (p.gate_up(pool, full), p.down(pool, full), p.finish()) for p in plans])
    r["call_ms"] = bench(lambda: tm.grouped_moe_ffn(x, pool, layout, ids, weights, experts, slots, config=config,
                                                               num_experts=EXPERTS))
    r["gate_up_gb_s"] = gu_bytes / r["gate_up_ms"] / 1e6
    r["down_gb_s"] = d_bytes / r["down_ms"] / 1e6
    r["kernels_gb_s"] = (gu_bytes + d_bytes) / r["kernels_ms"] / 1e6
    r["call_gb_s"] = (gu_bytes + d_bytes) / r["call_ms"] / 1e6
    r["kernels_tflop_s"] = flops / r["kernels_ms"] / 1e9
    if reference_ms:  # the per-expert torch path: dequantize each record, SwiGLU, weight, index_add
        r["torch_reference_ms"] = bench(lambda: reference_moe(x, pool, fields, quant, ids, weights, slot_of),
                                        ms=400)
        # torch with weights already dequantized to bf16 (no quantization at all): a matmul baseline
        from moestream.format.records import decode_record
        from moestream.layers.mlp import swiglu
        dense = {e: [projection(decode_record(fields, pool[slot_of[e]]), p, quant[p], torch.bfloat16)
                     for p in ("gate_proj", "up_proj", "down_proj")] for e in experts}
        where = {e: torch.where(ids == e) for e in experts}

        def dense_loop():
            out = torch.zeros_like(x)
            for e in experts:
                tok, k = where[e]
                out.index_add_(0, tok, swiglu(x[tok], *dense[e]) * weights[tok, k, None])
            return out

        r["torch_bf16_dense_ms"] = bench(dense_loop, ms=400)
        r["speedup_vs_torch_reference"] = r["torch_reference_ms"] / r["call_ms"]
        del dense
    if check:
        y = tm.grouped_moe_ffn(x, pool, layout, ids, weights, experts, slots, config=config, num_experts=EXPERTS)
        ref = reference_moe(x, pool, fields, quant, ids, weights, slot_of, dtype=torch.float64)
        r["max_rel_error_vs_fp64"] = ((y.double() - ref).abs().max() / ref.abs().max()).item()
        ref16 = reference_moe(x, pool, fields, quant, ids, weights, slot_of)
        r["torch_bf16_max_rel_error_vs_fp64"] = ((ref16.double() - ref).abs().max() / ref.abs().max()).item()
    return r


def skewed_routing(tokens: int, device: str, seed: int = 0, s: float = 1.1):
    """Like `routing`, but the experts drawn with Zipf weights (p of rank r ~ 1 / r^s, in a random order)
    without replacement (Gumbel top-k): a few experts take many of the pairs, as model routing does."""
    x, _, weights = routing(tokens, device, seed)
    g = torch.Generator(device=device).manual_seed(seed + 1)
    ranks = torch.randperm(EXPERTS, device=device, generator=g).float() + 1
    logp = -s * torch.log(ranks)
    gumbel = -torch.log(-torch.log(torch.rand(tokens, EXPERTS, device=device, generator=g).clamp_min(1e-20)))
    ids = (logp + gumbel).topk(TOP_K, dim=-1).indices
    return x, ids, weights


# the grouped (prefill) kernels' candidates: (block_m (0: a power of two from the mean pairs per expert
# times block_m_scale, up to block_m_max), block_m_scale, block_m_max, gate_up block_n, down block_n, warps,
# stages), each with the product swapped or not and the codes unpacked by joins or not
GROUPED_TILES = [(0, 1, 64, 64, 64, 4, 3), (0, 2, 128, 64, 128, 4, 3), (0, 2, 128, 64, 128, 8, 3),
                 (0, 2, 64, 64, 128, 4, 3), (0, 1, 128, 64, 128, 4, 3), (0, 2, 128, 128, 128, 8, 3),
                 (0, 2, 128, 64, 64, 4, 4), (0, 4, 128, 64, 128, 4, 3), (0, 2, 256, 64, 128, 8, 3),
                 (0, 2, 128, 128, 128, 4, 3)]
def sweep(pool_set, bits: int, tokens: int, base, seconds: float) -> dict:
    """Time other block sizes at `tokens` tokens (CUDA graphs, as `one_case`); the gemv kernels
    (decode) are independent, so each gets its own best; the grouped kernels (prefill) share
    block_m, warps and stages, so their tiles are timed together, with uniform and with skewed
    routing (the best is the lowest sum of both). Returns every timing and the best."""
    from moestream.kernels import triton_moe as tm

    pool, fields, quant, slot_of = pool_set
    layout = SlotLayout.from_fields(fields, quant)
    full = torch.tensor([slot_of[e] for e in range(EXPERTS)], dtype=torch.int32, device=DEVICE)
    decode = tokens <= base.gemv_max_tokens
    if decode:
        # bytes in flight per program (rows x words per step) against registers per thread
        tiles = [(n, w, nw) for n, w, nw in itertools.product((4, 8, 16, 32, 64), (32, 64, 128, 256), (2, 4, 8))
                 if 32 * nw <= n * w <= 64 * 32 * nw]
        kinds = {"gate_up": [dict(gemv_gate_up_n=n, gemv_gate_up_words=w, gemv_gate_up_warps=nw) for n, w, nw in tiles],
                 "down": [dict(gemv_down_n=n, gemv_down_words=w, gemv_down_warps=nw) for n, w, nw in tiles
                          if w <= 128]}  # down's rows are I * bits / 32 = 96 words at 4 bits
        routings = {"uniform": routing}
    else:
        kinds = {"grouped": [dict(block_m=bm, block_m_scale=sc, block_m_max=mx, gate_up_n=gn, down_n=dn,
                                  grouped_warps=nw, grouped_stages=st)
                             for bm, sc, mx, gn, dn, nw, st in GROUPED_TILES]}
        routings = {"uniform": routing, "skewed": skewed_routing}
    out = {}
    for kind, options in kinds.items():
        def measure(cfg, row, kind=kind):
            for name, draw in routings.items():
                plans = decode_plans(tokens, layout, cfg) if decode else \
                    [tm.MoEPlan(*draw(tokens, DEVICE, seed=tokens), EXPERTS, layout, config=cfg)]
                if kind == "gate_up":
                    fns = [lambda p=p: p.gate_up(pool, full) for p in plans]
                elif kind == "down":
                    fns = [lambda p=p: p.down(pool, full) for p in plans]
                else:
                    fns = [lambda p=p: (p.gate_up(pool, full), p.down(pool, full)) for p in plans]
                row[f"{name}_ms"] = graph_ms(fns)
            row["ms"] = sum(row[f"{name}_ms"] for name in routings)

        out[kind] = swept(options, seconds / len(kinds), base, measure, "ms")
    return out


def swept(options: list[dict], seconds: float, base, measure, score: str) -> dict:
    """Each option's row ({"config": option} filled by measure(config, row)) until `seconds` run out,
    the rest marked skipped and a tile that does not fit kept with its error; then the best row and
    the current settings' row by `score`."""
    deadline = time.monotonic() + seconds
    rows = []
    for opt in options:
        if time.monotonic() > deadline:
            rows.append({"config": opt, "skipped": "time budget"})
            continue
        row = {"config": opt}
        try:
            measure(replace(base, **opt), row)
        except Exception as exc:  # a tile that does not fit (shared memory, registers)
            row["error"] = f"{type(exc).__name__}: {str(exc)[:160]}"
        rows.append(row)
        torch.cuda.synchronize()
    timed = [r for r in rows if score in r]
    best = min(timed, key=lambda r: r[score]) if timed else None
    current = next((r for r in timed if all(getattr(base, k) == v for k, v in r["config"].items())), None)
    return {"best": best, "current": current, "all": rows}


def best_config(sweeps: dict) -> dict:
    """The fastest block sizes of every kernel swept: a MOESTREAM_KERNEL_CONFIG object. The grouped
    kernels take one setting for every prefill length: the lowest sum over the token counts swept of
    its time over that count's best time (so each length counts alike)."""
    chosen, scores, cases = {}, {}, 0
    for result in sweeps.values():
        for kind, found in result.items():
            if kind != "grouped":
                if found["best"]:
                    chosen.update(found["best"]["config"])
                continue
            cases += 1
            best = found["best"]["ms"] if found["best"] else float("inf")
            for row in found["all"]:
                key = json.dumps(row["config"], sort_keys=True)
                scores[key] = scores.get(key, 0.0) + (row["ms"] / best if "ms" in row else float("inf"))
    if scores:
        chosen.update(json.loads(min(scores, key=scores.get)))
    return chosen


def row_operands(name: str, seed: int = 0):
    """x [16, K] and enough copies of a random [N, K] bf16 matrix that a graph of calls over them reads HBM."""
    N, K = ROW_SHAPES[name]
    g = torch.Generator(device=DEVICE).manual_seed(seed)
    x = torch.randn(TILE_ROWS, K, device=DEVICE, generator=g).to(torch.bfloat16)
    copies = max(2, min(256, -(-L2_FLUSH_BYTES // (N * K * 2))))
    ws = [(torch.randn(N, K, device=DEVICE, generator=g) / K ** 0.5).to(torch.bfloat16) for _ in range(copies)]
    return x, ws


def rows_case(name: str, config) -> dict:
    """cuBLAS and the Triton kernel on one of ROW_SHAPES: microseconds per call, GB/s of the matrix,
    error against float64."""
    from moestream.kernels.triton_rows import tile_linear

    x, ws = row_operands(name)
    N, K = ROW_SHAPES[name]
    nbytes = N * K * 2
    r = {"shape": [TILE_ROWS, N, K], "matrix_bytes": nbytes, "copies": len(ws)}
    ref = torch.nn.functional.linear(x.double(), ws[0].double())
    for kind, fn in (("cublas", torch.nn.functional.linear), ("triton", lambda a, w: tile_linear(a, w, config=config))):
        ms = graph_ms([lambda w=w: fn(x, w) for w in ws])
        y = fn(x, ws[0])
        r[kind] = {"us": ms * 1e3, "gb_s": nbytes / ms / 1e6,
                   "max_rel_error_vs_fp64": ((y.double() - ref).abs().max() / ref.abs().max()).item()}
    r["speedup"] = r["cublas"]["us"] / r["triton"]["us"]
    return r


def rows_table(config) -> dict:
    out = {}
    for name in ROW_SHAPES:
        r = out[name] = rows_case(name, config)
        print(f"rows {name:6s} [16 x {r['shape'][2]}] x [{r['shape'][1]} x {r['shape'][2]}]^T: cuBLAS "
              f"{r['cublas']['us']:7.1f} us ({r['cublas']['gb_s']:6.0f} GB/s)  Triton {r['triton']['us']:7.1f} us "
              f"({r['triton']['gb_s']:6.0f} GB/s)  {r['speedup']:.2f}x  err {r['triton']['max_rel_error_vs_fp64']:.1e} "
              f"(cuBLAS {r['cublas']['max_rel_error_vs_fp64']:.1e})", flush=True)
        torch.cuda.empty_cache()
    per_layer = {k: sum(out[n][k]["us"] for n in ("qkv", "o", "router")) for k in ("cublas", "triton")}
    out["per_step_us"] = {k: LAYERS * per_layer[k] + out["head"][k]["us"] for k in per_layer}
    print(f"rows per step (48 x (q/k/v + o + router) + head): cuBLAS {out['per_step_us']['cublas']:.0f} us, "
          f"Triton {out['per_step_us']['triton']:.0f} us", flush=True)
    return out


def rows_tiles(kind: str) -> list[dict]:
    """Block sizes the rows sweep tries for one class of product (triton_rows.row_class), likelier
    ones first, within ~200 KB of shared memory for the pipeline stages; each tile with K split in
    1..16 (more programs in flight where the product has few column blocks). Narrow (the router's
    128 outputs): 16 columns per program, so that 8 programs share it (times the split)."""
    prefix = {"narrow": "rows_narrow_", "deep": "rows_deep_", "wide": "rows_"}[kind]
    if kind == "narrow":
        tiles = [(16, k, warps, stages, 0) for k, warps, stages in itertools.product((256, 128, 512), (4, 2), (3, 2))]
        splits = (8, 16, 4, 2, 1)
    else:  # the weights on the MMA's M side: Hopper's wgmma, 64 columns, a warpgroup of 4 warps
        tiles = [(64, 256, 4, 4, 1), (64, 128, 4, 4, 1), (32, 128, 2, 4, 0), (16, 256, 2, 4, 0), (64, 128, 4, 3, 1),
                 (32, 128, 2, 3, 0), (32, 256, 2, 4, 0), (16, 128, 2, 4, 0), (32, 128, 4, 4, 0), (64, 256, 4, 3, 1)]
        splits = (1, 2, 4, 8)
    return [{prefix + "n": n, prefix + "k": k, prefix + "warps": warps, prefix + "stages": stages,
             prefix + "swap": swap, prefix + "split": sp}
            for (n, k, warps, stages, swap), sp in itertools.product(tiles, splits)
            if (TILE_ROWS + n) * k * 2 * stages <= 200 << 10]


def rows_sweep(base, seconds: float) -> dict:
    """Time rows_tiles on each class of product, scored as a step runs them: the router (narrow),
    48 x o (deep), 48 x q/k/v + head (wide), each within a third of `seconds`. Returns every timing
    and the best."""
    from moestream.kernels.triton_rows import tile_linear

    out = {}
    for kind, names in (("narrow", ("router",)), ("deep", ("o",)), ("wide", ("qkv", "head"))):
        operands = {name: row_operands(name) for name in names}

        def measure(cfg, row, operands=operands):
            for name, (x, ws) in operands.items():
                row[f"{name}_us"] = graph_ms([lambda w=w: tile_linear(x, w, config=cfg) for w in ws]) * 1e3
            row["score_us"] = row.get("router_us", 0) + LAYERS * (row.get("o_us", 0) + row.get("qkv_us", 0)) + \
                row.get("head_us", 0)

        out[kind] = swept(rows_tiles(kind), seconds / 3, base, measure, "score_us")
        del operands, measure
        torch.cuda.empty_cache()
        best, current = out[kind]["best"], out[kind]["current"]
        if best:
            print(f"rows sweep {kind}: best {best['score_us']:.1f} us with {best['config']} (current "
                  f"{current['score_us'] if current else float('nan'):.1f} us)", flush=True)
    return out


def write(path: str, result: dict) -> None:
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(path).with_suffix(".tmp")
    tmp.write_text(json.dumps(result, indent=1))
    tmp.replace(path)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True, help="write the results here (JSON)")
    ap.add_argument("--bits", default="4,8")
    ap.add_argument("--tokens", default="1,4,2048")
    ap.add_argument("--sweep", action="store_true", help="also try other block sizes (4-bit; --sweep-tokens)")
    ap.add_argument("--sweep-tokens", default="1,2048", help="the token counts the sweep tries")
    ap.add_argument("--sweep-seconds", type=float, default=120.0, help="time budget of the whole sweep")
    ap.add_argument("--best-out", help="write the fastest block sizes found here (JSON for MOESTREAM_KERNEL_CONFIG)")
    ap.add_argument("--no-reference", action="store_true", help="skip timing the torch reference")
    ap.add_argument("--rows-products", action="store_true",
                    help="also time the decode step's 16-row tile products: cuBLAS against the Triton kernel")
    ap.add_argument("--rows-sweep", action="store_true", help="also sweep the row tile kernel's block sizes")
    ap.add_argument("--rows-sweep-seconds", type=float, default=240.0, help="time budget of the rows sweep")
    ap.add_argument("--no-experts", action="store_true", help="skip the expert kernels (only the rows products)")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        print("needs a CUDA GPU", file=sys.stderr)
        return 2
    import triton

    config = DEFAULT_CONFIG
    result = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "triton": triton.__version__,
              "python": platform.python_version(),
              "shape": {"hidden": HIDDEN, "moe_intermediate": INTER, "experts": EXPERTS, "top_k": TOP_K},
              "config": asdict(config), "cases": [], "sweep": {}}
    for bits in [] if args.no_experts else [int(b) for b in args.bits.split(",")]:
        pool_set = build_pool(bits, EXPERTS + 16, DEVICE)
        for tokens in [int(t) for t in args.tokens.split(",")]:
            t0 = time.perf_counter()
            r = one_case(pool_set, bits, tokens, config, reference_ms=not args.no_reference, check=True)
            r["wall_s"] = round(time.perf_counter() - t0, 1)
            result["cases"].append(r)
            write(args.out, result)  # after every case: a run cut short still leaves its results
            print(f"{bits}-bit T={tokens:5d} {r['mode']:7s} U={r['unique_experts']:3d} "
                  f"call {r['call_ms'] * 1e3:8.1f} us ({r['call_gb_s']:7.1f} GB/s)  "
                  f"kernels {r['kernels_ms'] * 1e3:8.1f} us ({r['kernels_gb_s']:7.1f} GB/s, "
                  f"{r['kernels_tflop_s']:6.1f} TFLOP/s)  gate_up {r['gate_up_gb_s']:7.1f} GB/s  "
                  f"down {r['down_gb_s']:7.1f} GB/s  torch {r.get('torch_reference_ms', float('nan')) * 1e3:9.1f} us  "
                  f"err {r['max_rel_error_vs_fp64']:.2e} (torch bf16 {r['torch_bf16_max_rel_error_vs_fp64']:.2e})",
                  flush=True)
        if args.sweep and bits == 4:
            for tokens in [int(t) for t in args.sweep_tokens.split(",")]:
                s = sweep(pool_set, bits, tokens, config, args.sweep_seconds / 2)
                result["sweep"][f"{bits}bit_T{tokens}"] = s
                write(args.out, result)
                for kind, found in s.items():
                    best, current = found["best"], found["current"]
                    if best:
                        print(f"sweep {bits}-bit T={tokens} {kind}: best {best['ms'] * 1e3:.1f} us "
                              f"with {best['config']} (current {current['ms'] * 1e3 if current else float('nan'):.1f} us)",
                              flush=True)
                if args.best_out:
                    write(args.best_out, best_config(result["sweep"]))
        del pool_set
        torch.cuda.empty_cache()
    if args.rows_products or args.rows_sweep:
        result["rows_products"] = rows_table(config)
        write(args.out, result)
    if args.rows_sweep:
        result["rows_sweep"] = rows_sweep(config, args.rows_sweep_seconds)
        if args.best_out:
            chosen = best_config(result["sweep"])
            for found in result["rows_sweep"].values():
                if found["best"]:
                    chosen.update(found["best"]["config"])
            write(args.best_out, chosen)
    write(args.out, result)
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
