"""`moestream convert SRC OUT`: pack a Hugging Face checkpoint into moestream's format."""
from __future__ import annotations

import argparse
import logging
import shutil
import sys
from collections import defaultdict
from pathlib import Path

import torch
from tqdm import tqdm

from moestream.convert.layout import FUSED, PER_EXPERT, PROJ_ALIASES, expert_layer_of
from moestream.convert.source import CheckpointSource
from moestream.errors import MoestreamError
from moestream.format.writer import ExpertFileWriter, expert_record_tensors, finish_model, sha256_file, stored_tensors
from moestream.quant.affine import QuantSpec, can_quantize

log = logging.getLogger(__name__)
QUANT_BITS = {"q4": 4, "q8": 8, "none": None}


def is_router(name: str) -> bool:
    return name.endswith((".gate.weight", ".shared_expert_gate.weight"))


def dense_spec(name: str, shape: list[int], bits: int | None, group_size: int) -> QuantSpec:
    """Norms, biases and odd-sized matrices stay float; routers keep at least 8 bits."""
    if bits is None or not name.endswith(".weight") or not can_quantize(tuple(shape), group_size):
        return QuantSpec()
    return QuantSpec(max(bits, 8) if is_router(name) else bits, group_size)


def expert_spec(shape: list[int], bits: int | None, group_size: int) -> QuantSpec:
    if bits is None or not can_quantize(tuple(shape), group_size):
        return QuantSpec()
    return QuantSpec(bits, group_size)


class ExpertReader:
    """Gets one expert's gate/up/down float matrices from per-expert or fused tensors."""

    def __init__(self, source: CheckpointSource, names: list[str]):
        self.source = source
        self.per_expert: dict[tuple[int, str], str] = {}
        self.fused: dict[str, str] = {}
        self._fused_cache: dict[str, torch.Tensor] = {}
        for name in names:
            if m := PER_EXPERT.match(name):
                self.per_expert[(int(m.group("expert")), PROJ_ALIASES[m.group("proj")])] = name
            elif m := FUSED.match(name):
                self.fused[m.group("part")] = name

    @property
    def num_experts(self) -> int:
        if self.fused:
            return self.source.shape(self.fused["down_proj"])[0]
        return len({e for e, _ in self.per_expert})

    def _fused(self, part: str) -> torch.Tensor:
        if part not in self._fused_cache:  # one layer's stack, dropped when the layer is done
            self._fused_cache[part] = self.source.get(self.fused[part])
        return self._fused_cache[part]

    def get(self, expert: int) -> dict[str, torch.Tensor]:
        if self.fused:
            gate_up = self._fused("gate_up_proj")[expert]  # [2I, H]: gate rows, then up rows
            half = gate_up.shape[0] // 2
            return {"gate_proj": gate_up[:half], "up_proj": gate_up[half:], "down_proj": self._fused("down_proj")[expert]}
        try:
            return {proj: self.source.get(self.per_expert[(expert, proj)]) for proj in ("gate_proj", "up_proj", "down_proj")}
        except KeyError as exc:
            raise MoestreamError(f"expert {expert}: tensor for {exc.args[0][1]} is missing") from None


def convert(src: str | Path, out: str | Path, *, quant: str = "q4", group_size: int = 64, force: bool = False) -> Path:
    source = CheckpointSource(src)
    out = Path(out)
    if out.exists() and any(out.iterdir()):
        if not force:
            raise MoestreamError(f"{out} exists and is not empty (use --force to overwrite)")
        shutil.rmtree(out)
    out.mkdir(parents=True, exist_ok=True)
    bits = QUANT_BITS[quant]

    by_layer: dict[int, list[str]] = defaultdict(list)
    dense_names = []
    for name in source.names():
        layer = expert_layer_of(name)
        (by_layer[layer].append(name) if layer is not None else dense_names.append(name))

    specs: dict[str, dict | None] = {}
    dense: dict[str, torch.Tensor] = {}
    for name in tqdm(dense_names, desc="resident tensors", unit="tensor", leave=False):
        spec = dense_spec(name, source.shape(name), bits, group_size)
        specs[name] = spec.to_json()
        dense.update(stored_tensors(name, source.get(name), spec))

    layers = []
    total = sum(ExpertReader(source, names).num_experts for names in by_layer.values())
    with tqdm(total=total, desc="experts", unit="expert") as bar:
        for layer in sorted(by_layer):
            reader = ExpertReader(source, by_layer[layer])
            writer = None
            for expert in range(reader.num_experts):
                projections = reader.get(expert)
                quant_specs = {p: expert_spec(list(t.shape), bits, group_size) for p, t in projections.items()}
                tensors = expert_record_tensors(projections, quant_specs)
                if writer is None:
                    writer = ExpertFileWriter(out / f"experts-{layer:03d}.bin", layer, reader.num_experts, tensors, quant_specs)
                writer.write(expert, tensors)
                bar.update(1)
            layers.append(writer.close())

    extra = []
    for path in source.tokenizer_files():
        shutil.copyfile(path, out / path.name)
        extra.append(path.name)
    source_info = {"path": str(Path(src).resolve()), "files": {f: sha256_file(source.folder / f) for f in source.files}}
    quantization = {"mode": "affine", "default_bits": bits, "group_size": group_size, "tensors": specs}
    finish_model(out, family=source.family, config=source.config, source=source_info, quantization=quantization,
                 dense=dense, expert_layers=layers, extra_files=extra)
    return out


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="moestream convert", description="Pack a Hugging Face MoE checkpoint into moestream's format.")
    p.add_argument("src", help="checkpoint folder (config.json + *.safetensors) or a Hub repo id")
    p.add_argument("out", help="output directory")
    p.add_argument("--quant", choices=sorted(QUANT_BITS), default="q4", help="expert and matrix quantization (default q4)")
    p.add_argument("--group-size", type=int, default=64, help="quantization group size (default 64)")
    p.add_argument("--force", action="store_true", help="overwrite a non-empty OUT")
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    try:
        out = convert(args.src, args.out, quant=args.quant, group_size=args.group_size, force=args.force)
    except MoestreamError as exc:
        print(f"moestream convert: error: {exc}", file=sys.stderr)
        return 1
    print(f"wrote {out}")
    return 0
