"""`moestream verify OUT`: every file's sha256 against the manifest, and the expert record layout.

Expert files are read once, record by record: the sha256 of the file and the crc32 of each record
come from the same pass, so a damaged file is reported with the layer and expert that hold the
damage."""
from __future__ import annotations

import hashlib
import logging
import math
import sys
import zlib
from dataclasses import dataclass, field
from pathlib import Path

from tqdm import tqdm

from moestream.errors import MoestreamError
from moestream.format.integrity import sha256_file
from moestream.format.manifest import DENSE_NAME, FIELD_ALIGN, RECORD_ALIGN, ExpertLayer, read_manifest
from moestream.format.records import DTYPES
from moestream.format.safetensors_io import SafetensorsFile
from moestream.quant import mxfp4
from moestream.quant.affine import QuantSpec

QUANT_MODES = ("affine", mxfp4.MODE)  # how a record's quantized codes are read (QuantSpec.mode)

log = logging.getLogger(__name__)
CHUNK = 8 << 20


@dataclass
class VerifyReport:
    directory: Path
    files: int = 0
    bytes: int = 0
    records: int = 0
    layers: int = 0
    problems: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.problems


def check_layout(entry: ExpertLayer, *, checksums: bool = True) -> list[str]:
    """Problems with one layer's record layout as the manifest states it (no file access);
    ``checksums``: also one crc32 per record."""
    where = f"{entry.file} (layer {entry.layer})"
    problems = []
    if entry.record_size <= 0 or entry.record_size % RECORD_ALIGN:
        problems.append(f"{where}: record size {entry.record_size} is not a positive multiple of {RECORD_ALIGN}")
    if checksums and len(entry.crc32) != entry.num_experts:
        problems.append(f"{where}: {len(entry.crc32)} crc32 values for {entry.num_experts} records")
    spans = []
    for f in entry.fields:
        if f.dtype not in DTYPES:
            problems.append(f"{where}: field {f.name} has unknown dtype {f.dtype}")
            continue
        itemsize = DTYPES[f.dtype].itemsize
        if f.nbytes != math.prod(f.shape) * itemsize:
            problems.append(f"{where}: field {f.name} is {f.nbytes} bytes, but {f.dtype} {f.shape} needs "
                            f"{math.prod(f.shape) * itemsize}")
        if f.offset % FIELD_ALIGN:
            problems.append(f"{where}: field {f.name} starts at {f.offset}, not a multiple of {FIELD_ALIGN}")
        if f.offset < 0 or f.offset + f.nbytes > entry.record_size:
            problems.append(f"{where}: field {f.name} ({f.offset}..{f.offset + f.nbytes}) lies outside the "
                            f"{entry.record_size}-byte record")
        spans.append((f.offset, f.offset + f.nbytes, f.name))
    spans.sort()
    for (_, end, name), (start, _, other) in zip(spans, spans[1:]):
        if start < end:
            problems.append(f"{where}: fields {name} and {other} overlap")
    return problems + _quant_problems(entry, where)


def _quant_problems(entry: ExpertLayer, where: str) -> list[str]:
    """A projection's quant mode must be known, and an MXFP4 one's fields must fit it (the records
    are read with the mode's layout: a mismatch would read the wrong bytes, not fail)."""
    problems, fields = [], {f.name: f for f in entry.fields}
    for proj, obj in entry.quant.items():
        mode = obj.get("mode", "affine") if isinstance(obj, dict) else "affine"
        if mode not in QUANT_MODES:
            problems.append(f"{where}: {proj} has quantization mode {mode!r} (this moestream reads {', '.join(QUANT_MODES)})"[:300])
        elif mode == mxfp4.MODE:
            weight, scales = fields.get(f"{proj}.weight"), fields.get(f"{proj}.scales")
            problem = None
            if (weight and weight.dtype != "U8") or (scales and scales.dtype != "U8"):
                problem = f"{proj}: MXFP4 weight and scales must be U8"
            problem = problem or mxfp4.record_problem(proj, QuantSpec(obj.get("bits"), obj.get("group_size"), mode=mode),
                                                      weight and weight.shape, scales and scales.shape)
            if problem:
                problems.append(f"{where}: {problem}"[:300])
    return problems


def record_checksums(path: Path, entry: ExpertLayer, bar=None) -> tuple[str, list[int]]:
    """One pass over an expert file: its sha256 and the crc32 of each record."""
    digest, crcs = hashlib.sha256(), []
    with open(path, "rb") as fh:
        for _ in range(entry.num_experts):
            record = fh.read(entry.record_size)
            digest.update(record)
            crcs.append(zlib.crc32(record))
            if bar is not None:
                bar.update(len(record))
        while block := fh.read(CHUNK):
            digest.update(block)
            if bar is not None:
                bar.update(len(block))
    return digest.hexdigest(), crcs


def verify(directory: str | Path, *, progress: bool = False) -> VerifyReport:
    """Check a packed model; problems are collected, not raised (a missing manifest still raises)."""
    directory = Path(directory)
    manifest = read_manifest(directory)
    report = VerifyReport(directory, layers=len(manifest.expert_layers))
    by_file = {e.file: e for e in manifest.expert_layers}
    for entry in manifest.expert_layers:
        if entry.file not in manifest.files:
            report.problems.append(f"{entry.file} (layer {entry.layer}): not listed among the manifest's files")
        report.problems += check_layout(entry)
    present = {}
    for name, info in manifest.files.items():
        path = directory / name
        if not path.is_file():
            report.problems.append(f"{name}: missing")
            continue
        size = path.stat().st_size
        if size != info["size"]:
            kind = "truncated" if size < info["size"] else "longer than recorded"
            report.problems.append(f"{name}: {kind} ({size} bytes, the manifest says {info['size']})")
        entry = by_file.get(name)
        if entry is not None and size != entry.num_experts * entry.record_size:
            report.problems.append(f"{name} (layer {entry.layer}): {size} bytes, but {entry.num_experts} records of "
                                   f"{entry.record_size} bytes need {entry.num_experts * entry.record_size}")
        present[name] = size
    with tqdm(total=sum(present.values()), desc="verify", unit="B", unit_scale=True, unit_divisor=1024,
              disable=not progress, file=sys.stderr) as bar:
        for name, size in present.items():
            path, entry = directory / name, by_file.get(name)
            if entry is not None:
                sha, crcs = record_checksums(path, entry, bar)
                bad = [e for e, crc in enumerate(crcs[:len(entry.crc32)]) if crc != entry.crc32[e]]
                report.records += entry.num_experts
                for expert in bad:
                    start = expert * entry.record_size
                    report.problems.append(f"{name}: layer {entry.layer} expert {expert} is corrupt (its crc32 "
                                           f"differs; bytes {start}..{start + entry.record_size})")
            else:
                sha = sha256_file(path, bar=bar)
            if sha != manifest.files[name]["sha256"]:
                if entry is None or not bad:
                    report.problems.append(f"{name}: sha256 differs from the manifest (the file is corrupt)")
            report.files += 1
            report.bytes += size
    if DENSE_NAME in present:
        try:
            SafetensorsFile(directory / DENSE_NAME).close()
        except MoestreamError as exc:
            report.problems.append(str(exc))
    return report
