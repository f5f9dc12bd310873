"""Which kernels compute a layer's routed experts: the Triton kernels over the slot pool on CUDA when
the record layout is one they handle, else the torch reference (the caller's per-expert loop).

The choice depends only on the device, the provider and the record layout, never on what is cached,
so a layer takes the same path (and gives the same bits) for every cache size and policy.
Set MOESTREAM_KERNELS=torch to force the reference, =triton to fail loudly instead of falling back."""
from __future__ import annotations

import logging
import os
import weakref
from typing import Sequence

import torch

from moestream.format.records import decode_record, plan_record
from moestream.kernels.reference import expert_ffn
from moestream.quant.affine import QuantSpec

log = logging.getLogger(__name__)

BACKENDS = ("auto", "torch", "triton")
_backend = os.environ.get("MOESTREAM_KERNELS", "auto")
_layouts: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # provider -> {layer: SlotLayout | None}
_triton = None  # the triton_moe module, False when it cannot be imported


def set_backend(name: str) -> None:
    """"auto" (Triton where supported), "torch" (always the reference), "triton" (error if unsupported)."""
    global _backend
    if name not in BACKENDS:
        raise ValueError(f"kernel backend {name!r} (choose from {', '.join(BACKENDS)})")
    _backend = name
    _layouts.clear()


def triton_module():
    """moestream.kernels.triton_moe, or None where Triton is not installed."""
    global _triton
    if _triton is None:
        try:
            from moestream.kernels import triton_moe
            _triton = triton_moe
        except ImportError as exc:
            log.info("Triton kernels unavailable (%s); using the torch reference", exc)
            _triton = False
    return _triton or None


def triton_layout(x: torch.Tensor, provider, layer: int):
    """The layer's SlotLayout when its routed experts can run on the Triton kernels, else None."""
    if _backend == "torch" or not x.is_cuda:
        return None
    try:
        known = _layouts.setdefault(provider, {})
    except TypeError:  # not weak-referenceable: decide every call
        known = {}
    if layer in known:
        layout = known[layer]
    else:
        layout, reason = None, None
        mod = triton_module()
        if mod is None:
            reason = "triton is not installed"
        elif not (hasattr(provider, "pool") or hasattr(provider, "slot_pool")) or \
                not all(hasattr(provider, a) for a in ("slots_of", "record_fields")):
            reason = f"{type(provider).__name__} has no slot pool"
        elif slot_pool(provider, layer).device != x.device:
            reason = f"slot pool on {slot_pool(provider, layer).device}, activations on {x.device}"
        else:
            try:
                layout = mod.SlotLayout.from_fields(provider.record_fields(layer), provider.quant(layer))
            except mod.UnsupportedLayout as exc:
                reason = str(exc)
        if reason is not None:
            if _backend == "triton":
                raise RuntimeError(f"layer {layer}: Triton kernels cannot run: {reason}")
            log.info("layer %d: torch reference for routed experts (%s)", layer, reason)
        known[layer] = layout
    if layout is not None and x.dtype not in triton_module().ACT_DTYPES:
        return None
    return layout


def slot_pool(provider, layer: int) -> torch.Tensor:
    """The uint8 [slots, slot_bytes] tensor `slots_of` indexes: `slot_pool(layer)` where a provider
    keeps one per layer, else its one shared `pool`."""
    return provider.slot_pool(layer) if hasattr(provider, "slot_pool") else provider.pool


def routed_experts(x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, num_experts: int, provider,
                   layer: int, layout, *, residual: torch.Tensor | None = None, after_fetch=None) -> torch.Tensor:
    """sum over a of weights[t, a] * FFN_{ids[t, a]}(x[t]) on the Triton kernels, reading the pool
    (plus `residual` when given, added by the last kernel).

    Where every expert of the layer is resident (`provider.resident_table`), the kernels index that
    table with the router's ids: no lookup and no host sync. Else the distinct ids come to the host
    (the one sync), and experts are pinned in batches of at most `provider.batch_limit(layer)`;
    each batch computes only its own (token, expert) pairs, so the result is the same bits for any
    batching, and the same as from the resident table."""
    plan = triton_module().MoEPlan(x, ids, weights, num_experts, layout)
    pool = slot_pool(provider, layer)
    table = provider.resident_table(layer) if hasattr(provider, "resident_table") else None
    if table is not None:
        plan.run_table(pool, table)
        provider.count_resident(layer, ids)
        return plan.finish(residual)
    experts = torch.unique(ids).tolist()  # sorted; the one host sync this layer needs
    limit = max(1, provider.batch_limit(layer))
    for i in range(0, len(experts), limit):
        batch = experts[i:i + limit]
        provider.fetch(layer, batch, views=False)
        if i == 0 and after_fetch is not None:
            after_fetch(layer, x)
        try:
            plan.run(pool, batch, provider.slots_of(layer, batch))
        finally:  # a victim slot is rewritten only after the kernels queued above (stream order)
            provider.release(layer)
    return plan.finish(residual)


def route(logits: torch.Tensor, top_k: int, *, normalize: bool, out_dtype: torch.dtype):
    """The router's softmax/top-k/renormalization as one Triton kernel on CUDA; None where the
    torch ops must do it (CPU, the torch backend, or Triton missing)."""
    if _backend == "torch" or not logits.is_cuda or triton_module() is None:
        return None
    from moestream.kernels.triton_route import route_topk

    return route_topk(logits, top_k, normalize=normalize, out_dtype=out_dtype)


# -- test and benchmark helpers ---------------------------------------------------------------------

def random_expert(hidden: int, inter: int, *, bits: int = 4, down_bits: int | None = None,
                  scale_dtype: torch.dtype = torch.bfloat16, generator: torch.Generator | None = None
                  ) -> tuple[dict[str, torch.Tensor], dict[str, QuantSpec]]:
    """One expert's record tensors with random codes and sane scales/biases (unit-variance outputs)."""
    tensors, quant = {}, {}
    for proj in ("gate_proj", "up_proj", "down_proj"):
        b = (down_bits or bits) if proj == "down_proj" else bits
        out_f, in_f = (hidden, inter) if proj == "down_proj" else (inter, hidden)
        levels = (1 << b) - 1
        codes = torch.randint(0, 1 << 32, (out_f, in_f * b // 32), dtype=torch.int64, generator=generator)
        groups = (out_f, in_f // 64)
        half_range = (3.0 / in_f) ** 0.5  # uniform weights in [-a, a] have variance 1/in_f
        scales = 2 * half_range / levels * (0.5 + torch.rand(groups, generator=generator))
        biases = -scales * levels / 2 + 0.3 * half_range * torch.randn(groups, generator=generator)
        tensors[f"{proj}.weight"] = codes.to(torch.int32).view(torch.uint32)  # wraps; a view works on every torch
        tensors[f"{proj}.scales"] = scales.to(scale_dtype)
        tensors[f"{proj}.biases"] = biases.to(scale_dtype)
        quant[proj] = QuantSpec(b, 64)
    return tensors, quant


def build_pool(num_experts: int, hidden: int, inter: int, *, bits: int = 4, down_bits: int | None = None,
               scale_dtype: torch.dtype = torch.bfloat16, extra_slots: int = 0, seed: int = 0,
               device: torch.device | str = "cpu"):
    """A slot pool holding `num_experts` random records (the packed format's record layout) in
    shuffled slots. Returns (pool [N, S] uint8, fields, quant, slot_of: the slot of each expert)."""
    gen = torch.Generator().manual_seed(seed)
    first, quant = random_expert(hidden, inter, bits=bits, down_bits=down_bits, scale_dtype=scale_dtype, generator=gen)
    fields, record_size = plan_record(first)
    slots = num_experts + extra_slots
    slot_of = torch.randperm(slots, generator=gen)[:num_experts].tolist()
    pool = torch.zeros((slots, record_size), dtype=torch.uint8, device=device)
    for e in range(num_experts):
        tensors = first if e == 0 else random_expert(hidden, inter, bits=bits, down_bits=down_bits,
                                                     scale_dtype=scale_dtype, generator=gen)[0]
        row = pool[slot_of[e]]
        for f in fields:  # the bytes encode_record would write, without a host round trip
            row[f.offset:f.offset + f.nbytes] = tensors[f.name].contiguous().reshape(-1).view(torch.uint8).to(device)
    return pool, fields, quant, slot_of


def reference_moe(x: torch.Tensor, pool: torch.Tensor, fields, quant: dict[str, QuantSpec], ids: torch.Tensor,
                  weights: torch.Tensor, slot_of: Sequence[int], *, dtype: torch.dtype | None = None) -> torch.Tensor:
    """The torch reference over a slot pool: per expert, dequantize its record and run the SwiGLU
    (moestream.kernels.reference), weight and sum. dtype: compute dtype (default x's)."""
    dtype = dtype or x.dtype
    xc = x.to(dtype)
    out = torch.zeros(x.shape, dtype=dtype, device=x.device)
    for e in torch.unique(ids).tolist():
        tok, slot = torch.where(ids == e)
        record = decode_record(fields, pool[slot_of[e]])
        y = expert_ffn(xc[tok], record, quant) * weights[tok, slot, None].to(dtype)
        out.index_add_(0, tok, y)
    return out
