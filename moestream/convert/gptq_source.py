"""A GPTQ or AWQ checkpoint folder read as a checkpoint of ordinary tensors.

Each quantized module (`X.qweight`, `X.qzeros`, `X.scales`, with GPTQ `X.g_idx`) is offered in
one of two ways, chosen for the whole checkpoint:

- kept: when the requested bits equal the checkpoint's, its groups are runs of consecutive inputs
  (no act-order) of a size we store (32, 64, 128) and its scales are 16-bit floats, every module
  is offered as an MLX-style affine triple (`X.weight` codes, `X.scales`, `X.biases`, float32), and
  per-expert modules as `switch_mlp` stacks, so convert copies the codes without re-quantizing;
- dequantized: otherwise `X.weight` is s·(q − z) in float32, exactly, and convert quantizes it to
  the requested format like any float checkpoint.

Modules left in float by the quantizer (embeddings, head, routers) are read as they are."""
from __future__ import annotations

import logging
import math
import threading
from pathlib import Path

import torch

from moestream.convert.layout import ExpertNames
from moestream.convert.source import CheckpointError, CheckpointSource
from moestream.format.safetensors_io import TensorInfo
from moestream.quant.gptq import GroupwiseConfig, GroupwiseFormatError, GroupwiseWeight
from moestream.quant.mlx import MlxQuantization

log = logging.getLogger(__name__)

PARTS = ("qweight", "qzeros", "scales", "g_idx")
KEPT_GROUP_SIZES = (32, 64, 128)


def groupwise_config(config: dict) -> GroupwiseConfig | None:
    """The checkpoint's GPTQ/AWQ settings, None when it is not one."""
    q = config.get("quantization_config")
    if not isinstance(q, dict) or q.get("quant_method") not in ("gptq", "awq"):
        return None
    try:
        return GroupwiseConfig.from_config(q)
    except GroupwiseFormatError as exc:
        raise CheckpointError(f"config.json: {exc}") from None


class GroupwiseSource(CheckpointSource):
    """CheckpointSource's interface over a GPTQ/AWQ folder; `bits` is what convert was asked for
    (None: unquantized), which decides whether the codes are kept."""

    def __init__(self, folder: str | Path, *, bits: int | None, origin: dict | None = None):
        self.requested_bits = bits
        self._last = threading.local()  # each convert worker's last unpacked module
        super().__init__(folder, origin=origin)

    def _sanitize(self) -> None:
        self.quant = groupwise_config(self.config)
        super()._sanitize()
        modules: dict[str, dict[str, str]] = {}  # packed module name -> part -> packed tensor name
        for name in list(self.packed_names):
            base, _, part = name.rpartition(".")
            if part in PARTS:
                modules.setdefault(base, {})[part] = name
        for base, parts in modules.items():
            for part in ("qweight", "qzeros", "scales"):
                if part not in parts:
                    raise CheckpointError(f"{self.folder}: {base}.{part} is missing ({base}.qweight is {self.quant.method})")
            if base + ".weight" in self.packed_names:
                raise CheckpointError(f"{self.folder}: {base} has both a float weight and {self.quant.method} codes")
        self.modules = {base: {part: self.packed_names.pop(name) for part, name in parts.items()}
                        for base, parts in modules.items()}
        if not self.modules:
            raise CheckpointError(f"{self.folder}: config.json says {self.quant.method}, but no tensor has qweight")
        self.keep = self._can_keep()
        self.imported = self.quant.method if self.keep else None
        self.dequantized_from = None if self.keep else self.quant.method
        self._virtual: dict[str, tuple] = {}  # packed name -> (how, module or stack, part)
        self.mlx = MlxQuantization(self.quant.bits, self.quant.group_size) if self.keep else None
        if self.keep:
            self._offer_affine()
        else:
            for base in self.modules:
                shape = self._module_shape(base)
                self._add(base + ".weight", ("float", base, None), "F32", shape)
        log.info("%s checkpoint (%d-bit, group %d%s): %s", self.quant.method.upper(), self.quant.bits,
                 self.quant.group_size, ", act-order" if self.quant.act_order else "",
                 "codes kept as they are" if self.keep else "dequantized exactly, then quantized as asked")

    # -- what is offered -----------------------------------------------------------
    def _can_keep(self) -> bool:
        q = self.quant
        if self.requested_bits != q.bits or q.act_order or q.group_size not in KEPT_GROUP_SIZES:
            return False
        return all(self._info_raw(m["scales"]).dtype in ("F16", "BF16") for m in self.modules.values())

    def _module_shape(self, base: str) -> tuple[int, int]:
        """[O, I] of a quantized module, from its packed shapes."""
        qweight = self._info_raw(self.modules[base]["qweight"])
        scales = self._info_raw(self.modules[base]["scales"])
        if qweight.dtype != "I32" or len(qweight.shape) != 2 or len(scales.shape) != 2:
            raise CheckpointError(f"{self.folder}: {base}.qweight is {qweight.dtype} {list(qweight.shape)}, "
                                  f"not a 2-D I32 {self.quant.method} tensor")
        per_word = 32 // self.quant.bits
        if self.quant.method == "gptq":
            return qweight.shape[1], qweight.shape[0] * per_word
        return qweight.shape[1] * per_word, qweight.shape[0]

    def _offer_affine(self) -> None:
        spelling = ExpertNames(self.family_module)
        stacks: dict[tuple[str, str], dict[int, str]] = {}
        for base in self.modules:
            out_features, in_features = self._module_shape(base)
            if m := spelling.per_expert.match(base + ".weight"):
                stacks.setdefault((m["prefix"], spelling.ours[m["proj"]]), {})[int(m["expert"])] = base
                continue
            self._offer_triple(base, ("affine", base), (), out_features, in_features)
        for (prefix, proj), by_expert in stacks.items():
            experts = sorted(by_expert)
            if experts != list(range(len(experts))):
                raise CheckpointError(f"{self.folder}: {prefix} has {self.quant.method} codes for experts {experts[:3]}..., "
                                      "not 0..E-1")
            shapes = {self._module_shape(by_expert[e]) for e in experts}
            if len(shapes) != 1:
                raise CheckpointError(f"{self.folder}: {prefix} experts' {proj} differ in shape")
            for e in experts:  # a stack has no place for per-expert biases
                if by_expert[e] + ".bias" in self.packed_names:
                    raise CheckpointError(f"{self.folder}: {by_expert[e]}.bias: biased expert projections are not read")
            out_features, in_features = shapes.pop()
            self._offer_triple(f"{prefix}.switch_mlp.{proj}", ("stack", [by_expert[e] for e in experts]),
                               (len(experts),), out_features, in_features)

    def _offer_triple(self, base: str, how: tuple, lead: tuple, out_features: int, in_features: int) -> None:
        groups = in_features // self.quant.group_size
        self._add(base + ".weight", (*how, 0), "U32", (*lead, out_features, in_features * self.quant.bits // 32))
        self._add(base + ".scales", (*how, 1), "F32", (*lead, out_features, groups))
        self._add(base + ".biases", (*how, 2), "F32", (*lead, out_features, groups))

    def _add(self, name: str, how: tuple, dtype: str, shape: tuple) -> None:
        self.packed_names[name] = name
        self._virtual[name] = (how, TensorInfo(name, dtype, tuple(shape), -1, 4 * math.prod(shape)))  # U32 and F32

    # -- reading ---------------------------------------------------------------------
    def _info_raw(self, key: str) -> TensorInfo:
        """A checkpoint tensor by its checkpoint name (the parts are no longer offered by name)."""
        return self._open(self.index[key]).info(key)

    def _read_raw(self, key: str) -> torch.Tensor:
        return self._open(self.index[key]).read(key)

    def _module(self, base: str) -> GroupwiseWeight:
        last = getattr(self._last, "module", None)
        if last is not None and last[0] == base:
            return last[1]
        parts = self.modules[base]
        try:
            weight = GroupwiseWeight.unpack(self.quant, self._read_raw(parts["qweight"]), self._read_raw(parts["qzeros"]),
                                            self._read_raw(parts["scales"]),
                                            self._read_raw(parts["g_idx"]) if "g_idx" in parts else None)
        except GroupwiseFormatError as exc:
            raise CheckpointError(f"{self.folder}: {base}: {exc}") from None
        self._last.module = (base, weight)
        return weight

    def _affine(self, base: str, part: int) -> torch.Tensor:
        return self._module(base).to_affine(self.quant.bits)[part]

    def info(self, name: str) -> TensorInfo:
        if name in self._virtual:
            return self._virtual[name][1]
        return super().info(name)

    def get(self, name: str) -> torch.Tensor:
        if name not in self._virtual:
            return super().get(name)
        how = self._virtual[name][0]
        if how[0] == "float":
            return self._module(how[1]).dequantize()
        if how[0] == "affine":
            return self._affine(how[1], how[2])
        return torch.stack([self._affine(base, how[2]) for base in how[1]])

    def get_rows(self, name: str, start: int, count: int = 1) -> torch.Tensor:
        if name not in self._virtual:
            return super().get_rows(name, start, count)
        how = self._virtual[name][0]
        if how[0] == "stack":
            return torch.stack([self._affine(base, how[2]) for base in how[1][start:start + count]])
        return self.get(name)[start:start + count]
