"""Where a checkpoint keeps its routed experts: per-expert tensors, fused 3-D stacks, or MLX stacks.

Each layer's experts are found by name, checked against config.json before anything is written,
and then read one expert at a time: a record is built from exactly one expert's bytes."""
from __future__ import annotations

import dataclasses
import re
from collections import defaultdict
from dataclasses import dataclass

import torch

from moestream.convert.summary import describe
from moestream.errors import MoestreamError
from moestream.format.manifest import EXPERT_PROJECTIONS
from moestream.format.writer import expert_record_tensors, stored_tensors
from moestream.quant import mxfp4
from moestream.quant.affine import QuantSpec, can_quantize
from moestream.quant.mlx import MlxQuantization, mlx_input_size

FLOAT_DTYPES = ("F32", "F16", "BF16", "F64")


class LayoutError(MoestreamError):
    """Expert tensors that disagree with config.json or with each other."""


@dataclass(frozen=True)
class FusedLayout:
    """How a family's fused stacks hold one expert (its module's EXPERT_FUSED; this default if unset).
    transposed: `gate_up_proj` [E, H, 2I] and `down_proj` [E, I, H] (x @ W) instead of [E, 2I, H] / [E, H, I];
    interleaved: gate and up rows alternate (gate = rows 0, 2, ...) instead of all gate rows, then up;
    bias: `gate_up_proj_bias` [E, 2I] and `down_proj_bias` [E, H] beside them (recorded as
    gate_proj.bias, up_proj.bias, down_proj.bias)."""

    transposed: bool = False
    interleaved: bool = False
    bias: bool = False


def fused_layout(family) -> FusedLayout:
    """The family module's EXPERT_FUSED (a dict of FusedLayout's fields), else the default."""
    return FusedLayout(**getattr(family, "EXPERT_FUSED", {}))


class ExpertNames:
    """A family's routed-expert tensor names in each layout convert reads, from the family's
    EXPERT_MODULE and EXPERT_NAMES: per-expert (`experts.E.<name>.weight`), fused 3-D stacks
    (`experts.gate_up_proj`), and MLX stacks (`switch_mlp.gate_proj`, MLX's own names)."""

    def __init__(self, family):
        self.module, self.names = family.EXPERT_MODULE, dict(family.EXPERT_NAMES)
        self.ours = {theirs: ours for ours, theirs in self.names.items()}
        module = rf"\.{re.escape(self.module)}" if self.module else ""  # "": experts hang off the layer itself
        prefix = rf"^(?P<prefix>.*layers\.(?P<layer>\d+){module})"
        theirs = "|".join(re.escape(n) for n in self.ours)
        self.per_expert = re.compile(prefix + rf"\.experts\.(?P<expert>\d+)\.(?P<proj>{theirs})\.weight$")
        parts = "gate_up_proj_bias|down_proj_bias|gate_up_proj|down_proj" if fused_layout(family).bias else "gate_up_proj|down_proj"
        self.fused = re.compile(prefix + rf"\.experts\.(?P<part>{parts})(?:\.weight)?$")
        self.mlx = re.compile(prefix + r"\.switch_mlp\.(?P<proj>gate_proj|up_proj|down_proj)\.(?P<part>weight|scales|biases)$")

    def expert(self, name: str) -> tuple[int, int, str] | None:
        """(layer, expert, our projection name) of a per-expert tensor, else None."""
        m = self.per_expert.match(name)
        return (int(m["layer"]), int(m["expert"]), self.ours[m["proj"]]) if m else None

    def name(self, prefix: str, expert: int, proj: str) -> str:
        return f"{prefix}.experts.{expert}.{self.names[proj]}.weight"


@dataclass(frozen=True)
class ExpertShapes:
    """What config.json says the routed experts look like (the family's ModelArgs reads it)."""

    num_experts: int
    shapes: dict[str, tuple[int, int]]  # [out, in] of each projection
    intermediate_key: str
    experts_key: str

    @staticmethod
    def from_args(args, config: dict) -> "ExpertShapes":
        experts_key = args.config_key(config, "num_experts")
        shapes = args.expert_shapes()
        checks = ((experts_key, args.num_experts), (args.EXPERT_INTERMEDIATE, args.expert_intermediate_size),
                  ("hidden_size", args.hidden_size))
        for key, value in checks:
            if not isinstance(value, int) or isinstance(value, bool):
                raise LayoutError(f"config.json: {key} is missing or not an integer")
        return ExpertShapes(args.num_experts, shapes, args.EXPERT_INTERMEDIATE, experts_key)

    def projection(self, proj: str) -> tuple[int, int]:
        """[out, in] of one expert's projection."""
        return tuple(self.shapes[proj])

    def describe(self, proj: str) -> str:
        return (f"hidden_size × {self.intermediate_key}" if proj == "down_proj" else f"{self.intermediate_key} × hidden_size")


def expert_activation(family) -> str:
    """The gate activation a family's routed experts use (QuantSpec.activation): "silu" unless the
    family module sets EXPERT_ACTIVATION."""
    return getattr(family, "EXPERT_ACTIVATION", "silu")


def activation_params(family, config: dict) -> dict:
    """The activation's settings from config.json (clamped_swiglu's alpha and limit), from the
    family module's `expert_activation_params(config)` where it has one."""
    hook = getattr(family, "expert_activation_params", None)
    return dict(hook(config)) if hook is not None else {}


def with_activation(specs: dict[str, QuantSpec], activation: str, **params) -> dict[str, QuantSpec]:
    return {p: dataclasses.replace(s, activation=activation, **params) for p, s in specs.items()}


class LayerExperts:
    """One layer's routed experts in some source layout."""

    layer: int
    prefix: str
    num_experts: int
    activation: str = "silu"  # recorded in every projection's QuantSpec (find_expert_layers sets it)
    activation_params: dict = {}  # the activation's alpha / limit, recorded beside it
    keep_mxfp4: bool = False  # records keep the source's MXFP4 codes (convert sets it where can_keep_mxfp4)
    keep_source: bool = False  # each projection as the source's plan says (source.source_plan), not at `bits`

    def can_keep_mxfp4(self) -> bool:
        """Whether the source holds every weight of this layer's experts as MXFP4 codes and scales."""
        return False

    def check(self, expect: ExpertShapes) -> None:
        raise NotImplementedError

    def source_bytes(self) -> int:
        return sum(self.source.nbytes(n) for n in self.names.values())

    def source_name(self, proj: str) -> str | None:
        """The source tensor expert 0's `proj` is read from (None where records are copied as they are)."""
        return None

    def origin(self, proj: str):
        """The source's plan for `proj` (moestream.quant.ggml.SourcePlan), None for a source without plans."""
        name = self.source_name(proj)
        return self.source.source_plan(name) if name is not None and hasattr(self.source, "source_plan") else None

    def stored_spec(self, proj: str, bits: int | None, group_size: int) -> tuple[QuantSpec, bool]:
        """How the records store `proj`, and whether the values are the source's own."""
        if self.keep_mxfp4:
            return mxfp4.spec(), True
        if self.keep_source:
            origin = self.origin(proj)
            return origin.spec, origin.kept
        return (QuantSpec(bits, group_size) if bits else QuantSpec()), bits is None

    def describe(self, bits: int | None, group_size: int) -> dict[str, str]:
        """{`prefix.experts.proj`: what the records make of it} for the conversion's summary."""
        out = {}
        for proj in EXPERT_PROJECTIONS:
            name, (spec, kept) = self.source_name(proj), self.stored_spec(proj, bits, group_size)
            dtype = self.source.info(name).dtype if name is not None else "F32"
            out[f"{self.prefix}.experts.{proj}"] = describe(spec, self.origin(proj), dtype, kept=kept)
        return out

    def record(self, expert: int, bits: int | None, group_size: int) -> tuple[dict[str, torch.Tensor], dict[str, QuantSpec]]:
        """The record's named tensors for one expert and each projection's QuantSpec."""
        tensors, specs = self._record(expert, bits, group_size)
        return tensors, with_activation(specs, self.activation, **self.activation_params)

    def _record(self, expert: int, bits: int | None, group_size: int):
        raise NotImplementedError

    def _check_count(self, what: str, count: int, expect: ExpertShapes) -> None:
        if count != expect.num_experts:
            raise LayoutError(f"{what}: {count} experts, but config.json says {expect.experts_key}={expect.num_experts}")

    def _check_float(self, name: str, shape, dtype: str, want: tuple[int, ...], proj: str, expect: ExpertShapes) -> None:
        if tuple(shape) != tuple(want):
            raise LayoutError(f"{name}: shape {list(shape)}, but config.json implies {list(want)} ({expect.describe(proj)})")
        if dtype not in FLOAT_DTYPES:
            raise LayoutError(f"{name}: dtype {dtype} is not a float type (quantized formats other than MLX are not read)")


def _float_record(projections: dict[str, torch.Tensor], bits: int | None, group_size: int,
                  specs: dict[str, QuantSpec] | None = None):
    """specs None: every projection at `bits` (float where it cannot be quantized)."""
    if specs is None:
        specs = {p: QuantSpec(bits, group_size) if bits and can_quantize(tuple(t.shape), group_size) else QuantSpec()
                 for p, t in projections.items()}
    return expert_record_tensors(projections, specs), specs


class PerExpertLayer(LayerExperts):
    """`experts.E.<name>.weight` (the family's names: Mixtral's `w1`), one tensor per expert and projection."""

    def __init__(self, source, layer: int, prefix: str, names: dict[tuple[int, str], str], spelling: ExpertNames):
        self.source, self.layer, self.prefix, self.names, self.spelling = source, layer, prefix, names, spelling
        self.num_experts = len({e for e, _ in names})

    def name(self, expert: int, proj: str) -> str:
        return self.names.get((expert, proj)) or self.spelling.name(self.prefix, expert, proj)

    def check(self, expect: ExpertShapes) -> None:
        ids = sorted({e for e, _ in self.names})
        if ids[-1] >= expect.num_experts:
            raise LayoutError(f"{self.name(ids[-1], 'gate_proj').rsplit('.', 2)[0]}: expert index {ids[-1]}, but "
                              f"config.json says {expect.experts_key}={expect.num_experts}")
        for expert in range(expect.num_experts):
            for proj in EXPERT_PROJECTIONS:
                name = self.name(expert, proj)
                if (expert, proj) not in self.names:
                    raise LayoutError(f"{name} is missing (config.json says {expect.experts_key}={expect.num_experts})")
                info = self.source.info(name)
                self._check_float(name, info.shape, info.dtype, expect.projection(proj), proj, expect)
        self.num_experts = expect.num_experts

    def source_name(self, proj: str) -> str:
        return self.name(0, proj)

    def _record(self, expert, bits, group_size):
        if not self.keep_source:
            return _float_record({p: self.source.get(self.name(expert, p)) for p in EXPERT_PROJECTIONS}, bits, group_size)
        tensors, specs = {}, {}
        for proj in EXPERT_PROJECTIONS:
            name, origin = self.name(expert, proj), self.origin(proj)
            if origin.kept and origin.spec.quantized:  # the source's codes and block scales
                rows = self.source.info(name).shape[0]
                tensors.update({f"{proj}.{k}": v for k, v in self.source.affine_rows(name, 0, rows).items()})
            else:
                tensors.update(stored_tensors(f"{proj}.weight", self.source.get(name), origin.spec))
            specs[proj] = origin.spec
        return tensors, specs


class FusedLayer(LayerExperts):
    """`experts.gate_up_proj` [E, 2I, H] (gate rows, then up rows) and `experts.down_proj` [E, H, I],
    or as the family's FusedLayout says (transposed, interleaved rows, biases)."""

    def __init__(self, source, layer: int, prefix: str, names: dict[str, str], layout: FusedLayout = FusedLayout()):
        self.source, self.layer, self.prefix, self.names, self.layout = source, layer, prefix, names, layout
        self.num_experts = source.info(names["down_proj"]).shape[0] if "down_proj" in names else 0

    def _expected(self, expect: ExpertShapes):
        """(part, shape, what) of every stack the layout holds."""
        E, (gate, up, down) = expect.num_experts, (expect.projection(p) for p in EXPERT_PROJECTIONS)
        n, i = expect.experts_key, expect.intermediate_key
        if self.layout.transposed:
            out = [("gate_up_proj", (E, gate[1], gate[0] + up[0]), f"{n} × hidden_size × 2·{i}"),
                   ("down_proj", (E, down[1], down[0]), f"{n} × {i} × hidden_size")]
        else:
            out = [("gate_up_proj", (E, gate[0] + up[0], gate[1]), f"{n} × 2·{i} × hidden_size"),
                   ("down_proj", (E, *down), f"{n} × hidden_size × {i}")]
        if self.layout.bias:
            out += [("gate_up_proj_bias", (E, gate[0] + up[0]), f"{n} × 2·{i}"), ("down_proj_bias", (E, down[0]), f"{n} × hidden_size")]
        return out

    def check(self, expect: ExpertShapes) -> None:
        expected = self._expected(expect)
        for part, _, _ in expected:
            if part not in self.names:
                raise LayoutError(f"{self.prefix}.experts.{part} is missing (the layer has only {next(iter(self.names.values()))})")
        E = expect.num_experts
        for part, want, what in expected:
            name = self.names[part]
            info = self.source.info(name)
            if len(info.shape) == 3 and info.shape[0] != E:
                self._check_count(name, info.shape[0], expect)
            if tuple(info.shape) != want:
                raise LayoutError(f"{name}: shape {list(info.shape)}, but config.json implies {list(want)} ({what})")
            if info.dtype not in FLOAT_DTYPES:
                raise LayoutError(f"{name}: dtype {info.dtype} is not a float type")

    def source_name(self, proj: str) -> str:
        return self.names["down_proj" if proj == "down_proj" else "gate_up_proj"]

    def can_keep_mxfp4(self) -> bool:
        # MXFP4 blocks run along a stack's inputs for x @ W: only a transposed layout's rows are outputs
        stack = getattr(self.source, "mxfp4_stack", None)
        return (self.layout.transposed and stack is not None
                and all(stack(self.names[p]) for p in ("gate_up_proj", "down_proj")))

    def _record(self, expert, bits, group_size):
        if self.keep_mxfp4:
            tensors, specs = self._mxfp4_record(expert)
        else:
            tensors, specs = self._float_record(expert, bits, group_size)
        if self.layout.bias:
            gate_b, up_b = self._split(self.source.get_rows(self.names["gate_up_proj_bias"], expert)[0])
            down_b = self.source.get_rows(self.names["down_proj_bias"], expert)[0]
            tensors.update({"gate_proj.bias": gate_b.contiguous(), "up_proj.bias": up_b.contiguous(),
                            "down_proj.bias": down_b.contiguous()})
        return tensors, specs

    def _mxfp4_record(self, expert):
        """The expert's codes and scales as the source has them, gate and up rows split apart."""
        gate_up, gate_up_scales = (t[0] for t in self.source.mxfp4_rows(self.names["gate_up_proj"], expert))
        down, down_scales = (t[0] for t in self.source.mxfp4_rows(self.names["down_proj"], expert))
        gate, up = self._split(gate_up)  # [I, H/32, 16] each
        gate_scales, up_scales = self._split(gate_up_scales)
        tensors = {}
        for proj, blocks, scales in (("gate_proj", gate, gate_scales), ("up_proj", up, up_scales),
                                     ("down_proj", down, down_scales)):
            tensors[f"{proj}.weight"], tensors[f"{proj}.scales"] = mxfp4.record_parts(blocks, scales)
        return tensors, {p: mxfp4.spec() for p in EXPERT_PROJECTIONS}

    def _float_record(self, expert, bits, group_size):
        gate_up = self.source.get_rows(self.names["gate_up_proj"], expert)[0]
        down = self.source.get_rows(self.names["down_proj"], expert)[0]
        if self.layout.transposed:  # stored for x @ W: our matrices are [out, in]
            gate_up, down = gate_up.T, down.T
        gate, up = self._split(gate_up)  # [I, H] each
        projections = {"gate_proj": gate.contiguous(), "up_proj": up.contiguous(), "down_proj": down.contiguous()}
        specs = {p: self.origin(p).spec for p in EXPERT_PROJECTIONS} if self.keep_source else None
        return _float_record(projections, bits, group_size, specs)

    def _split(self, gate_up: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Gate and up rows of a fused [2I, ...] tensor."""
        if self.layout.interleaved:
            return gate_up[0::2], gate_up[1::2]
        half = gate_up.shape[0] // 2
        return gate_up[:half], gate_up[half:]


class MlxStackLayer(LayerExperts):
    """`switch_mlp.{gate,up,down}_proj.{weight,scales,biases}` stacks [E, O, W], copied without re-quantizing."""

    def __init__(self, source, layer: int, prefix: str, names: dict[tuple[str, str], str], quant: MlxQuantization | None):
        self.source, self.layer, self.prefix, self.names, self.quant = source, layer, prefix, names, quant
        first = names.get(("down_proj", "weight")) or next(iter(names.values()))
        self.num_experts = source.info(first).shape[0]
        self.specs: dict[str, QuantSpec] = {}

    def module(self, proj: str) -> str:
        return f"{self.prefix}.switch_mlp.{proj}"

    def check(self, expect: ExpertShapes) -> None:
        for proj in EXPERT_PROJECTIONS:
            module = self.module(proj)
            if (proj, "weight") not in self.names:
                raise LayoutError(f"{module}.weight is missing")
            weight = self.source.info(self.names[(proj, "weight")])
            if not weight.shape or weight.shape[0] != expect.num_experts:
                self._check_count(weight.name, weight.shape[0] if weight.shape else 0, expect)
            want = (expect.num_experts, *expect.projection(proj))
            if (proj, "scales") not in self.names:
                if self.quant is not None and self.quant.spec_for(module).quantized and self.quant.overrides.get(module) is not None:
                    raise LayoutError(f"{module}.scales is missing, but config.json quantizes {module}")
                self._check_float(weight.name, weight.shape, weight.dtype, want, proj, expect)
                self.specs[proj] = QuantSpec()
                continue
            if self.quant is None:
                raise LayoutError(f"{module}.scales exists, but config.json has no quantization section")
            spec = self.quant.spec_for(module)
            if not spec.quantized:
                raise LayoutError(f"{module} has scales, but config.json's quantization leaves it float")
            if (proj, "biases") not in self.names:
                raise LayoutError(f"{module}.biases is missing")
            scales = self.source.info(self.names[(proj, "scales")])
            biases = self.source.info(self.names[(proj, "biases")])
            if weight.dtype not in ("U32", "I32"):
                raise LayoutError(f"{weight.name}: dtype {weight.dtype}, MLX packs quantized weights as U32")
            if biases.shape != scales.shape:
                raise LayoutError(f"{biases.name}: shape {list(biases.shape)} differs from its scales {list(scales.shape)}")
            in_features = mlx_input_size(weight.name, weight.shape, scales.shape, spec)
            if (weight.shape[0], weight.shape[1], in_features) != want:
                raise LayoutError(f"{weight.name}: holds {[weight.shape[0], weight.shape[1], in_features]} unpacked, but "
                                  f"config.json implies {list(want)} ({expect.experts_key} × {expect.describe(proj)})")
            self.specs[proj] = spec

    def stored_spec(self, proj: str, bits: int | None, group_size: int) -> tuple[QuantSpec, bool]:
        return self.specs[proj], True

    def _record(self, expert, bits, group_size):
        tensors = {}
        for proj in EXPERT_PROJECTIONS:
            parts = ("weight", "scales", "biases") if self.specs[proj].quantized else ("weight",)
            for part in parts:
                t = self.source.get_rows(self.names[(proj, part)], expert)[0]
                tensors[f"{proj}.{part}"] = t.view(torch.uint32) if t.dtype == torch.int32 else t
        return tensors, dict(self.specs)


def find_expert_layers(source) -> tuple[dict[int, LayerExperts], list[str]]:
    """Group the checkpoint's tensors: routed experts by layer (one layout per layer, named as the
    source's family names them) and the rest."""
    spelling = ExpertNames(source.family_module)
    args = source.family_module.ModelArgs.from_dict(source.config)
    per_expert: dict[int, dict] = defaultdict(dict)
    fused: dict[int, dict] = defaultdict(dict)
    mlx: dict[int, dict] = defaultdict(dict)
    prefixes: dict[int, str] = {}
    dense = []

    def index(m) -> int:  # the expert layer (an MTP layer's experts are numbered after the decoder's)
        return args.expert_layer(m["prefix"], int(m["layer"]))

    for name in source.names():
        if m := spelling.per_expert.match(name):
            per_expert[index(m)][(int(m["expert"]), spelling.ours[m["proj"]])] = name
        elif m := spelling.fused.match(name):
            fused[index(m)][m["part"]] = name
        elif m := spelling.mlx.match(name):
            mlx[index(m)][(m["proj"], m["part"])] = name
        else:
            dense.append(name)
            continue
        prefixes.setdefault(index(m), m["prefix"])
    layers: dict[int, LayerExperts] = {}
    for layer in sorted(set(per_expert) | set(fused) | set(mlx)):
        kinds = [k for k, d in (("per-expert", per_expert), ("fused", fused), ("switch_mlp", mlx)) if layer in d]
        if len(kinds) > 1:
            raise LayoutError(f"{prefixes[layer]}: routed experts stored in two layouts ({' and '.join(kinds)})")
        if layer in per_expert:
            layers[layer] = PerExpertLayer(source, layer, prefixes[layer], per_expert[layer], spelling)
        elif layer in fused:
            layers[layer] = FusedLayer(source, layer, prefixes[layer], fused[layer], fused_layout(source.family_module))
        else:
            layers[layer] = MlxStackLayer(source, layer, prefixes[layer], mlx[layer], source.mlx)
        layers[layer].activation = expert_activation(source.family_module)
        layers[layer].activation_params = activation_params(source.family_module, source.config)
    return layers, dense


def check_expert_layers(layers: dict[int, LayerExperts], source, *, mtp_layers: int = 0) -> ExpertShapes:
    """Every routed-expert tensor against config.json as the family reads it (and the experts of
    `mtp_layers` multi-token-prediction layers); the first disagreement is raised, naming the
    tensor. (Routers are resident tensors, checked with them.)"""
    args = source.family_module.ModelArgs.from_dict(source.config)
    expect = ExpertShapes.from_args(args, source.config)
    wanted = set(args.moe_layers()) | set(args.mtp_expert_layers(mtp_layers))
    for layer in sorted(set(layers) - wanted):
        raise LayoutError(f"{layers[layer].prefix}: routed-expert tensors in layer {layer}, which config.json makes "
                          f"a dense layer ({source.family}: {len(wanted)} of {args.num_hidden_layers} layers have experts)")
    for layer in sorted(wanted - set(layers)):
        raise LayoutError(f"layer {layer}: no routed-expert tensors, but config.json makes it an MoE layer")
    for layer in sorted(layers):
        layers[layer].check(expect)
    return expect
