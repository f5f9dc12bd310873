"""The resident (non-expert) tensors of a conversion: how each is stored, and a check of all of
them against what the family's model takes, before anything is written.

The family decides: its quant_predicate gives each matrix's bits, and registry.weight_shapes (its
build, run on a recording loader) lists every tensor it takes with its shape.

A family's multi-token-prediction (MTP) layers (moestream.models.mtp) are kept where the checkpoint
has their tensors, unless the user leaves them out (`--no-mtp`, a smaller pack); kept, they are
checked like the decoder's tensors."""
from __future__ import annotations

import logging
from dataclasses import dataclass

from moestream.convert.layout import FLOAT_DTYPES, LayoutError
from moestream.convert.summary import describe
from moestream.format.safetensors_io import DTYPE_NAMES, TensorEntry
from moestream.models.registry import weight_shapes
from moestream.quant.affine import QuantSpec, can_quantize, packed_shape
from moestream.quant.mlx import mlx_input_size

log = logging.getLogger(__name__)


@dataclass
class DenseTensor:
    """One resident tensor as the packed model names it, and how it is stored."""

    name: str
    shape: tuple[int, ...]  # as the model takes it (unpacked)
    spec: QuantSpec
    parts: list[TensorEntry]  # what dense.safetensors holds for it, in order
    quantize: bool  # quantize a float source tensor, or copy the source's tensors as they are
    source_bytes: int
    codes: bool = False  # the source's own codes and block scales (source.affine_rows), neither copied nor quantized
    how: str = ""  # what it became, for the conversion's summary


def dense_spec(family, name: str, shape: list[int], bits: int | None, group_size: int) -> QuantSpec:
    """Norms, biases and odd-sized matrices stay float; a matrix keeps the bits the family's
    quant_predicate gives it (routers keep at least 8)."""
    if bits is None or not name.endswith(".weight") or not can_quantize(tuple(shape), group_size):
        return QuantSpec()
    kept = family.quant_predicate(name, bits)
    return QuantSpec() if kept is None else QuantSpec(kept, group_size)


def plan_dense(source, names: list[str], bits: int | None, group_size: int, *,
               keep_source: bool = False) -> list[DenseTensor]:
    """keep_source: each tensor as the source's plan says (`source.source_plan`: its codes kept where
    our format holds them exactly, else no fewer bits), not at `bits`."""
    if source.mlx is not None:
        return _plan_dense_mlx(source, names)
    plan = []
    for name in names:
        info = source.info(name)
        float_source = info.dtype in FLOAT_DTYPES
        origin = source.source_plan(name) if hasattr(source, "source_plan") else None
        if keep_source:
            spec = origin.spec
        else:
            spec = dense_spec(source.family_module, name, list(info.shape), bits, group_size) if float_source else QuantSpec()
        codes = keep_source and origin.kept and spec.quantized
        if spec.quantized:
            base = name[: -len(".weight")]
            scales = DTYPE_NAMES[origin.scale_dtype] if codes else info.dtype
            w_shape, s_shape = packed_shape(info.shape[0], info.shape[1], spec.bits, spec.group_size)
            parts = [TensorEntry(name, "U32", w_shape), TensorEntry(base + ".scales", scales, s_shape),
                     TensorEntry(base + ".biases", scales, s_shape)]
        else:
            parts = [TensorEntry(name, info.dtype, info.shape)]
        how = describe(spec, origin, info.dtype, kept=codes)
        plan.append(DenseTensor(name, tuple(info.shape), spec, parts, spec.quantized and not codes, info.nbytes, codes, how))
    return plan


def _plan_dense_mlx(source, names: list[str]) -> list[DenseTensor]:
    """MLX checkpoints are imported as they are: quantized modules keep their packed words."""
    quantized = {n[: -len(".weight")] for n in names if n.endswith(".weight") and n[: -len(".weight")] + ".scales" in source}
    plan = []
    for name in names:
        base, _, suffix = name.rpartition(".")
        if base in quantized and suffix in ("scales", "biases"):
            continue  # stored with its weight
        info = source.info(name)
        if base in quantized and suffix == "weight":
            spec = source.mlx.spec_for(base)
            if not spec.quantized:
                raise LayoutError(f"{base} has scales, but config.json's quantization leaves it float")
            if base + ".biases" not in source:
                raise LayoutError(f"{base}.biases is missing")
            scales, biases = source.info(base + ".scales"), source.info(base + ".biases")
            if info.dtype not in ("U32", "I32") or len(info.shape) != 2:
                raise LayoutError(f"{name}: {info.dtype} {list(info.shape)}, MLX packs quantized weights as 2-D U32")
            if biases.shape != scales.shape or biases.dtype != scales.dtype:
                raise LayoutError(f"{base}.biases: {biases.dtype} {list(biases.shape)} differs from its scales "
                                  f"{scales.dtype} {list(scales.shape)}")
            shape = (info.shape[0], mlx_input_size(name, info.shape, scales.shape, spec))
            parts = [TensorEntry(name, "U32", info.shape), TensorEntry(base + ".scales", scales.dtype, scales.shape),
                     TensorEntry(base + ".biases", biases.dtype, biases.shape)]
            nbytes = info.nbytes + scales.nbytes + biases.nbytes
        else:
            spec, shape, parts, nbytes = QuantSpec(), tuple(info.shape), [TensorEntry(name, info.dtype, info.shape)], info.nbytes
        plan.append(DenseTensor(name, shape, spec, parts, False, nbytes, how=describe(spec, None, info.dtype, kept=True)))
    return plan


def check_dense(plan: list[DenseTensor], source, *, mtp_layers: int = 0) -> None:
    """Every resident tensor against the family's model (with `mtp_layers` multi-token-prediction
    layers): one that it does not take, one that is missing, or one of another shape is refused,
    naming the tensor (and how many more there are)."""
    have = {d.name: d.shape for d in plan}
    want = weight_shapes(source.family, source.config, present=have, mtp_layers=mtp_layers)
    model = f"the {source.family} model of this config.json"
    unused = sorted(set(have) - set(want))
    if unused:
        more = f"; {len(unused) - 1} more like it" if len(unused) > 1 else ""
        raise LayoutError(f"{unused[0]}: not a weight of {model}{more}")
    missing = [n for n in want if n not in have]
    if missing:
        more = f"; {len(missing) - 1} more are missing" if len(missing) > 1 else ""
        raise LayoutError(f"{missing[0]} is missing ({model} takes it{more})")
    for name, shape in want.items():
        if tuple(have[name]) != tuple(shape):
            raise LayoutError(f"{name}: shape {list(have[name])}, but config.json implies {list(shape)}")


def select_mtp(source, layers: dict, dense_names: list[str], *, keep: bool) -> tuple[int, dict, list[str]]:
    """(MTP layers kept, the expert layers to write, the resident names to write)."""
    args = source.family_module.ModelArgs.from_dict(source.config)
    count = args.mtp_layer_count()
    resident = [n for n in dense_names if args.is_mtp_weight(n)]
    experts = [layer for layer in layers if layer >= args.num_hidden_layers]
    if keep and count and resident:
        have = set(dense_names)
        wanted = weight_shapes(source.family, source.config, present=have, mtp_layers=count)
        missing = [n for n in wanted if args.is_mtp_weight(n) and n not in have]
        if missing:
            raise LayoutError(f"{missing[0]} is missing: the checkpoint's multi-token-prediction layers are incomplete "
                              "(convert --no-mtp leaves them out)")
        log.info("keeping %d multi-token-prediction layer(s): %d resident tensors, %d expert layer(s)", count,
                 len(resident), len(experts))
        return count, layers, dense_names
    if resident or experts:
        why = "--no-mtp" if not keep else "the family builds none from this checkpoint"
        log.info("left out %d multi-token-prediction tensors and %d expert layer(s) (%s)", len(resident),
                 len(experts), why)
    dropped = set(resident)
    return 0, {k: v for k, v in layers.items() if k not in experts}, [n for n in dense_names if n not in dropped]
