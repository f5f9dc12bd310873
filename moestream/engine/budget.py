"""The memory ledger: what each part of a run takes, computed before anything is allocated, so
`--plan` can print it and `--memory-budget` can size the expert slots to fit."""
from __future__ import annotations

from dataclasses import asdict, dataclass

import torch

from moestream.errors import BudgetError
from moestream.experts.sizing import format_bytes
from moestream.format.reader import PackedModel
from moestream.kv.pool import KVPool
from moestream.layers.packed_matrix import packs
from moestream.models.registry import matrix_names
from moestream.quant.affine import QuantSpec
from moestream.quant.mxfp4 import MODE as MXFP4


# the CUDA caching allocator rounds blocks up: it reserved 2.5-2.8 % more than the tensors it held
# (H200, --memory-budget 8GiB: 8.004 GiB reserved with 2.5 % kept free); budgets keep 3 % free
ALLOCATOR_SLACK = 0.03
# on the CPU the budget is the process's RAM: the interpreter, torch and their libraries, the native
# kernels and the allocator's heap take this much beside what the ledger's rows count (340 MB measured
# after decoding the Qwen3-30B-A3B shape: heap 210 MB, libraries 130 MB)
CPU_RUNTIME = 384 << 20
SAFETENSORS_DTYPES = {"BF16": torch.bfloat16, "F16": torch.float16, "F32": torch.float32}


@dataclass
class Ledger:
    resident_weights: int
    kv_cache: int
    workspace: int
    expert_slots: int
    host_tier: int
    read_buffers: int
    unpacked_experts: int = 0  # CPU runs (the device is RAM): dequantized copies of the slots' experts
    runtime: int = 0  # CPU runs: the process itself (CPU_RUNTIME)

    @property
    def device_total(self) -> int:
        return (self.resident_weights + self.kv_cache + self.workspace + self.expert_slots + self.read_buffers
                + self.unpacked_experts + self.runtime)

    def to_json(self) -> dict:
        return {**asdict(self), "device_total": self.device_total}

    def table(self, *, slots: int, slot_bytes: int, total_experts: int) -> str:
        rows = [("resident weights", self.resident_weights), ("KV pool", self.kv_cache),
                ("workspace (estimate)", self.workspace),
                (f"expert slots ({slots} of {total_experts}, {100 * slots / total_experts:.0f}%)", self.expert_slots),
                ("read buffers", self.read_buffers)]
        if self.unpacked_experts:
            rows.append(("unpacked experts (CPU)", self.unpacked_experts))
        if self.runtime:
            rows.append(("runtime (interpreter, torch, libraries)", self.runtime))
        rows += [("device total", self.device_total), ("host tier (RAM)", self.host_tier)]
        return "\n".join(f"  {name:<40} {format_bytes(value):>12}" for name, value in rows)


def resident_bytes(packed: PackedModel, dtype: torch.dtype, device: torch.device) -> int:
    """Bytes of the resident tensors on `device`: the matrices the layers keep packed there
    (moestream.layers.packed_matrix) at their stored bytes, the rest dequantized to the compute dtype."""
    item = torch.finfo(dtype).bits // 8
    kept = matrix_names(packed.family, packed.config, present=packed.logical_dense_names())
    total = 0
    for name in packed.logical_dense_names():
        shape = packed._dense.get_slice(name).get_shape()
        spec = packed.tensor_spec(name)
        if not spec.quantized:
            total += int(torch.Size(shape).numel()) * item
            continue
        logical = (shape[0], shape[1] * 32 // spec.bits)
        base = name[: -len(".weight")]
        scales = packed._dense.get_slice(base + ".scales")
        scales_dtype = SAFETENSORS_DTYPES.get(scales.get_dtype())
        if name in kept and scales_dtype is not None and packs(spec, logical, scales_dtype, device, dtype):
            total += shape[0] * shape[1] * 4 + 2 * int(torch.Size(scales.get_shape()).numel()) * scales_dtype.itemsize
        else:
            total += logical[0] * logical[1] * item
    return total


def unpacked_expert_bytes(packed: PackedModel, dtype: torch.dtype) -> int:
    """RAM one expert's dequantized gate, up and down matrices take in `dtype` (the largest layer's):
    what moestream.experts.unpacked keeps per expert."""
    item = torch.finfo(dtype).bits // 8
    largest = 0
    for entry in packed.manifest.expert_layers:
        quant = {p: QuantSpec.from_json(s) for p, s in entry.quant.items()}
        by_name = {f.name: f for f in entry.fields}
        numel = 0
        for proj in ("gate_proj", "up_proj", "down_proj"):
            rows, cols = by_name[f"{proj}.weight"].shape
            spec = quant[proj]
            if spec.mode == MXFP4:  # two codes a byte
                cols *= 2
            elif spec.quantized:  # uint32 words of 32 / bits codes
                cols = cols * 32 // spec.bits
            numel += rows * cols
        largest = max(largest, numel * item)
    return largest


def plan_ledger(args, *, resident: int, dtype: torch.dtype, max_context: int, chunk: int, slots: int,
                slot_bytes: int, host_slots: int, staging: int, cuda: bool = False, sequences: int = 1,
                unpacked: int = 0) -> Ledger:
    """resident: `resident_bytes` (the same for every size a plan tries); sequences: sequence slots of
    the paged KV pool (sized as moestream.kv.pool sizes it)."""
    item = torch.finfo(dtype).bits // 8
    kv = KVPool.bytes_for(args.kv_layout(), sequences=sequences, max_context=max_context, dtype=dtype,
                          prefill_chunk=chunk)
    workspace = prefill_workspace(args, tokens=min(chunk, max_context), context=max_context, item=item)
    if cuda:
        workspace = max(workspace, decode_workspace(args, context=max_context))
    return Ledger(resident_weights=resident, kv_cache=kv, workspace=workspace,
                  expert_slots=slots * slot_bytes, host_tier=host_slots * slot_bytes, read_buffers=staging * slot_bytes,
                  unpacked_experts=unpacked, runtime=0 if cuda else CPU_RUNTIME)


def prefill_workspace(args, *, tokens: int, context: int, item: int) -> int:
    """Peak transient bytes of one prefill chunk of `tokens` at a context of `context` (the largest
    layer's working set). Attention kernels never hold the [T, S] scores, but K/V are expanded to
    every query head (`expanded_kv_width`)."""
    H, A = args.hidden_size, args.num_experts_per_tok
    inter = args.largest_intermediate()
    heads, D = args.num_attention_heads, args.head_dim
    activations = tokens * (10 * H + 3 * heads * D) * item  # residual, norms, q/k/v, attention output
    experts = tokens * A * (inter * item + 4 * H + 16)  # the expert kernels' [P, I] and float32 [P, H] rows
    dense = tokens * 3 * inter * item
    expanded_kv = heads * context * args.expanded_kv_width() * item
    mask = tokens * context  # the boolean mask of a later chunk
    logits = 2 * args.vocab_size * 4
    return activations + experts + dense + expanded_kv + mask + logits


def decode_workspace(args, *, context: int) -> int:
    """What CUDA decode steps keep while they run: the graphs hold every layer's split-attention
    partials (float32 [heads, context / 64, head_dim + 2]) and small per-layer buffers (64 MiB
    covers them at the 30B shape, measured on the H200)."""
    layers, heads, D = args.num_hidden_layers, args.num_attention_heads, args.head_dim
    return layers * heads * -(-context // 64) * (D + 2) * 4 + (64 << 20)


def slots_within(budget: int, ledger: Ledger, *, slot_bytes: int, min_slots: int, total_experts: int) -> int:
    """The most slots that fit a device budget, or a clear refusal naming the minimum."""
    fixed = ledger.device_total - ledger.expert_slots
    slots = int(budget * (1 - ALLOCATOR_SLACK) - fixed) // slot_bytes
    if slots < min_slots:
        need = fixed + min_slots * slot_bytes
        runtime = f", runtime {format_bytes(ledger.runtime)}" if ledger.runtime else ""
        raise BudgetError(f"--memory-budget {format_bytes(budget)} cannot fit this model: it needs at least "
                             f"{format_bytes(need)} (resident weights {format_bytes(ledger.resident_weights)}, KV cache "
                             f"{format_bytes(ledger.kv_cache)}, workspace {format_bytes(ledger.workspace)}{runtime}, "
                             f"{min_slots} expert slots {format_bytes(min_slots * slot_bytes)}); "
                             "a smaller --max-context lowers it")
    return min(slots, total_experts)
