"""The packed model's manifest, `moestream.json`: what is where, how it is quantized, and hashes."""
from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass, field
from pathlib import Path

from moestream.errors import FormatError

FORMAT_NAME = "moestream-packed"
FORMAT_VERSION = 1
MANIFEST_NAME = "moestream.json"
DENSE_NAME = "dense.safetensors"
RECORD_ALIGN = 4096  # a record starts on a page / O_DIRECT boundary
FIELD_ALIGN = 256  # each tensor inside a record starts on a GPU-friendly boundary
EXPERT_PROJECTIONS = ("gate_proj", "up_proj", "down_proj")


@dataclass
class RecordField:
    """One tensor inside an expert record (e.g. `gate_proj.weight`)."""

    name: str
    dtype: str  # safetensors-style name: "U32", "F32", "BF16", "F16"
    shape: list[int]
    offset: int
    nbytes: int


@dataclass
class ExpertLayer:
    """The records of one MoE layer: `num_experts` records of `record_size` bytes in `file`."""

    layer: int
    file: str
    num_experts: int
    record_size: int
    fields: list[RecordField]
    quant: dict[str, dict | None]  # projection -> QuantSpec json
    crc32: list[int] = field(default_factory=list)  # one per record, for --check-records

    @staticmethod
    def from_json(obj: dict) -> "ExpertLayer":
        return ExpertLayer(**{**obj, "fields": [RecordField(**f) for f in obj["fields"]]})


@dataclass
class Manifest:
    family: str
    config: dict
    source: dict
    quantization: dict  # {"mode", "default_bits", "group_size", "tensors": {name: spec json | None}}
    expert_layers: list[ExpertLayer]
    files: dict[str, dict]  # file name -> {"sha256", "size"}
    format: str = FORMAT_NAME
    format_version: int = FORMAT_VERSION
    # multi-token-prediction layers kept (moestream.models.mtp): their tensors resident, MTP layer j's
    # experts the records of expert layer num_hidden_layers + j; written only where there are some
    mtp_layers: int = 0

    def expert_layer(self, layer: int) -> ExpertLayer | None:
        return next((entry for entry in self.expert_layers if entry.layer == layer), None)

    def to_json(self) -> dict:
        obj = asdict(self)
        if not obj["mtp_layers"]:
            del obj["mtp_layers"]
        return {"format": obj.pop("format"), "format_version": obj.pop("format_version"), **obj}

    @staticmethod
    def from_json(obj: dict) -> "Manifest":
        if not isinstance(obj, dict):
            raise FormatError(f"not a moestream manifest (a JSON {type(obj).__name__}, not an object)")
        if obj.get("format") != FORMAT_NAME:
            raise FormatError(f"not a moestream manifest (format={obj.get('format')!r})")
        if obj.get("format_version") != FORMAT_VERSION:
            raise FormatError(f"manifest format version {obj.get('format_version')} is not supported (this moestream reads {FORMAT_VERSION})")
        _check_types(obj)
        return Manifest(family=obj["family"], config=obj["config"], source=obj["source"], quantization=obj["quantization"],
                        expert_layers=[ExpertLayer.from_json(e) for e in obj["expert_layers"]], files=obj["files"],
                        mtp_layers=obj.get("mtp_layers", 0))


def _count(value, what: str, low: int = 0) -> None:
    if type(value) is not int or value < low:
        raise FormatError(f"manifest: {what} must be a whole number >= {low}, not {value!r}"[:200])


def _plain_name(value, what: str) -> None:
    """A file inside the model directory: no folders, so a hostile manifest cannot point elsewhere."""
    if not isinstance(value, str) or not value or "/" in value or "\\" in value or value in (".", "..") or "\0" in value:
        raise FormatError(f"manifest: {what} must be a file name inside the model directory, not {value!r}"[:200])


def _check_types(obj: dict) -> None:
    """The manifest's shape, before anything sizes a buffer or opens a file from it."""
    for key, kind in (("family", str), ("config", dict), ("source", dict), ("quantization", dict),
                      ("expert_layers", list), ("files", dict)):
        if not isinstance(obj.get(key), kind):
            raise FormatError(f"manifest: {key!r} is missing or not a {kind.__name__}")
    _count(obj.get("mtp_layers", 0), "mtp_layers")
    for name, info in obj["files"].items():
        _plain_name(name, "a file's name")
        if not isinstance(info, dict) or not isinstance(info.get("sha256"), str):
            raise FormatError(f"manifest: file {name!r} has no sha256"[:200])
        _count(info.get("size"), f"the size of {name!r}")
    for e in obj["expert_layers"]:
        if not isinstance(e, dict) or not isinstance(e.get("fields"), list) or not isinstance(e.get("quant"), dict):
            raise FormatError("manifest: an expert layer is not an object with 'fields' and 'quant'")
        _count(e.get("layer"), "an expert layer's index")
        _plain_name(e.get("file"), f"layer {e['layer']}'s expert file")
        _count(e.get("num_experts"), f"layer {e['layer']}'s num_experts", 1)
        _count(e.get("record_size"), f"layer {e['layer']}'s record_size", 1)
        crc = e.get("crc32", [])
        if not isinstance(crc, list) or not all(type(c) is int and 0 <= c < 1 << 32 for c in crc):
            raise FormatError(f"manifest: layer {e['layer']}'s crc32 must be a list of 32-bit values")
        for f in e["fields"]:
            if not isinstance(f, dict) or not isinstance(f.get("name"), str) or not isinstance(f.get("dtype"), str):
                raise FormatError(f"manifest: layer {e['layer']} has a record field without a name or dtype")
            if not isinstance(f.get("shape"), list):
                raise FormatError(f"manifest: layer {e['layer']} field {f['name']!r}: shape is not a list"[:200])
            for dim in f["shape"]:
                _count(dim, f"layer {e['layer']} field {f['name']!r}'s shape")
            _count(f.get("offset"), f"layer {e['layer']} field {f['name']!r}'s offset")
            _count(f.get("nbytes"), f"layer {e['layer']} field {f['name']!r}'s nbytes")


def write_json(path: Path, obj) -> None:
    """Atomically: written to `path`.tmp and fsynced, then renamed over `path`."""
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "w") as fh:
        json.dump(obj, fh, indent=1)
        fh.flush()
        os.fsync(fh.fileno())
    os.replace(tmp, path)


def write_manifest(directory: Path, manifest: Manifest) -> None:
    """The manifest appears last (atomically), so a half-written model never looks complete."""
    write_json(Path(directory) / MANIFEST_NAME, manifest.to_json())


def read_manifest(directory: str | os.PathLike) -> Manifest:
    directory = Path(directory)
    if not directory.exists():
        raise FormatError(f"{directory}: no such directory")
    path = directory / MANIFEST_NAME
    if not path.is_file():
        hint = " (an unfinished conversion? run convert again with --resume)" if (directory / "convert-state.json").exists() else ""
        raise FormatError(f"{directory}: not a packed moestream model, {MANIFEST_NAME} is missing{hint}")
    try:
        obj = json.loads(path.read_bytes())
    except (json.JSONDecodeError, UnicodeDecodeError, RecursionError) as exc:
        raise FormatError(f"{path}: corrupt manifest ({exc})") from None
    try:
        return Manifest.from_json(obj)
    except FormatError as exc:
        raise FormatError(f"{path}: {exc}") from None
    except (KeyError, TypeError, ValueError) as exc:
        raise FormatError(f"{path}: manifest is missing or has a malformed field ({exc})"[:300]) from None
