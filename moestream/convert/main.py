"""`moestream convert SRC OUT`: pack a Hugging Face checkpoint into moestream's format.

The source is checked completely (headers, layouts, every tensor's shape against what the
family's model takes for config.json) before OUT is touched. Then the resident tensors are streamed into dense.safetensors, each MoE layer's experts
into its records file one expert at a time, and the manifest is written last. Memory stays near
one expert plus the largest resident tensor, whatever the model's size."""
from __future__ import annotations

import json
import logging
import os
import shutil
import sys
from collections import deque
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict
from pathlib import Path
from typing import Iterable

import torch
from tqdm import tqdm

from moestream.convert.layout import LayoutError, check_expert_layers, find_expert_layers
from moestream.convert.resident import DenseTensor, check_dense, plan_dense, select_mtp
from moestream.convert.hub import download, looks_like_repo_id
from moestream.convert.source import TOKENIZER_FILES, CheckpointError, CheckpointSource
from moestream.convert.state import STATE_NAME, ConvertState, ResumeError
from moestream.convert.summary import class_table, summary_text
from moestream.errors import MoestreamError
from moestream.format.manifest import (DENSE_NAME, FORMAT_VERSION, MANIFEST_NAME, ExpertLayer, Manifest,
                                       read_manifest, write_manifest)
from moestream.format.writer import (ExpertFileWriter, FileDigest, OutputFile, SafetensorsWriter, WriteError,
                                     stored_tensors, write_error)

log = logging.getLogger(__name__)
QUANT_BITS = {"q4": 4, "q8": 8, "none": None}
DEFAULT_QUANT = "q4"  # without --quant: a float source's experts and matrices
KEEP_MXFP4 = "mxfp4"  # without --quant, an MXFP4 source's experts keep their codes (recorded as this quant)
KEEP_SOURCE = "source"  # without --quant, a GGUF's tensors as its types allow: codes kept, else no fewer bits
GROUP_SIZES = (32, 64, 128)
DOWNLOAD_DIR = ".pull-download"  # where a pull keeps the shard it is converting
__all__ = ["convert"]


BLOCK_BYTES = 32 << 20  # resident tensors are read, quantized and written this many source bytes at a time


def _row_blocks(source: CheckpointSource, name: str):
    """A tensor as consecutive blocks of whole rows, so no big tensor is ever held at once."""
    info = source.info(name)
    rows = info.shape[0] if info.shape else 0
    if len(info.shape) < 2 or info.nbytes <= BLOCK_BYTES:
        yield source.get(name)
        return
    step = max(1, BLOCK_BYTES // (info.nbytes // rows))
    for start in range(0, rows, step):
        yield source.get_rows(name, start, min(step, rows - start))


def dense_blocks(source: CheckpointSource, item: DenseTensor) -> list[tuple[str, Iterable[torch.Tensor]]]:
    """Each part dense.safetensors holds for `item`, in order, as consecutive blocks of rows."""
    if item.codes:  # the source's codes and block scales, as affine parts
        rows = item.shape[0]
        step = max(1, rows * BLOCK_BYTES // max(item.source_bytes, 1))
        pieces = [source.affine_rows(item.name, start, min(step, rows - start)) for start in range(0, rows, step)]
        return [(part.name, [p[key] for p in pieces]) for part, key in zip(item.parts, ("weight", "scales", "biases"))]
    if item.quantize:  # rows quantize independently; the packed words (a quarter or half of the source) are gathered
        pieces = [stored_tensors(item.name, block, item.spec) for block in _row_blocks(source, item.name)]
        return [(part.name, [p[part.name] for p in pieces]) for part in item.parts]
    return [(part.name, (b.view(torch.uint32) if part.dtype == "U32" and b.dtype == torch.int32 else b  # copied as it is
                         for b in _row_blocks(source, part.name))) for part in item.parts]


def _our_files(out: Path) -> list[Path]:
    names = {MANIFEST_NAME, MANIFEST_NAME + ".tmp", STATE_NAME, STATE_NAME + ".tmp", DENSE_NAME, *TOKENIZER_FILES}
    return [p for p in out.iterdir() if p.name in names or (p.name.startswith("experts-") and p.suffix == ".bin")]


class Conversion:
    """One run of `convert`: the checked source, the plan, and OUT with its resume state."""

    JOB = "conversion"

    def __init__(self, source: CheckpointSource, out: Path, *, quant: str | None, group_size: int, progress: bool,
                 workers: int = 1, kill_after_layers: int | None = None, mtp: bool = True):
        """quant: "q4", "q8", "none", or None: a GGUF's tensors as its types allow (KEEP_SOURCE), else the
        source's MXFP4 experts kept as they are (KEEP_MXFP4), everything else at q4. mtp False: the
        multi-token-prediction layers left out."""
        self.source, self.out, self.group_size = source, out, group_size
        self.kill_after_layers = kill_after_layers
        self.progress = progress
        self.workers = max(1, workers)
        layers, dense_names = find_expert_layers(source)
        self.mtp_layers, self.layers, dense_names = select_mtp(source, layers, dense_names, keep=mtp)
        check_expert_layers(self.layers, source, mtp_layers=self.mtp_layers)
        keep_source = quant is None and hasattr(source, "source_plan")
        kept = [layer for layer, experts in self.layers.items() if quant is None and experts.can_keep_mxfp4()]
        for layer in kept:
            self.layers[layer].keep_mxfp4 = True
        for experts in self.layers.values():
            experts.keep_source = keep_source
        if kept and len(kept) < len(self.layers):
            log.info("%d of %d MoE layers keep their MXFP4 experts; the others are %s", len(kept), len(self.layers),
                     "stored as their source types allow" if keep_source else "quantized to q4")
        self.quant = KEEP_SOURCE if keep_source else KEEP_MXFP4 if kept else (quant or DEFAULT_QUANT)
        self.bits = QUANT_BITS[self.quant if self.quant in QUANT_BITS else DEFAULT_QUANT]
        self.dense = plan_dense(source, dense_names, self.bits, group_size, keep_source=keep_source)
        described = {d.name: d.how for d in self.dense}
        for experts in self.layers.values():
            described.update(experts.describe(self.bits, group_size))
        self.classes = class_table(described)
        check_dense(self.dense, source, mtp_layers=self.mtp_layers)
        self.options = {"source": source.origin, "source_files": source.file_sizes(), "quant": self.quant,
                        "group_size": group_size, "format_version": FORMAT_VERSION}
        if not mtp:  # a resumed conversion keeps or leaves out the MTP layers as it began
            self.options["mtp"] = False
        self.state: ConvertState | None = None

    # -- OUT -------------------------------------------------------------------
    def prepare(self, *, force: bool, resume: bool) -> bool:
        """Make OUT ready; False when it already holds this very conversion, finished."""
        out, src = self.out.resolve(), self.source.folder.resolve()
        if not self.options.get("pull") and src.is_relative_to(out):
            raise MoestreamError(f"{self.out}: OUT must not be the source folder or contain it")
        if out.exists() and not out.is_dir():
            raise MoestreamError(f"{self.out}: exists and is not a directory")
        has_state = (out / STATE_NAME).is_file()
        if resume and has_state:
            self.state = ConvertState.load(out)
            if self.options.get("pull") and not self.state.options.get("pull"):
                raise ResumeError(f"{self.out}: holds an unfinished `moestream convert`, not a pull (resume it with "
                                  "convert --resume, or use --force to start over)")
            self.state.check_options(self.options)
            log.info("resuming the %s in %s (%d steps already done)", self.JOB, out, len(self.state.steps))
            return True
        if resume and (out / MANIFEST_NAME).is_file():
            self._check_finished(out)
            log.info("%s already holds this model, finished", out)
            return False
        if out.exists() and any(p.name != DOWNLOAD_DIR for p in out.iterdir()):
            if resume:
                raise ResumeError(f"{self.out}: nothing to resume ({STATE_NAME} is missing); use --force to start over")
            if not force:
                hint = f" or --resume to continue the unfinished {self.JOB}" if has_state else ""
                raise MoestreamError(f"{self.out}: exists and is not empty (use --force to overwrite it{hint})")
            for path in _our_files(out):
                path.unlink()
            shutil.rmtree(out / DOWNLOAD_DIR, ignore_errors=True)
            left = [p.name for p in out.iterdir()]
            if left:
                log.warning("%s: kept %d file(s) that are not moestream's, e.g. %s", out, len(left), left[0])
        try:
            out.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise write_error(out, exc) from None
        self.state = ConvertState(out, self.options)
        self.state.save()
        return True

    def _check_finished(self, out: Path) -> None:
        manifest = read_manifest(out)
        requested = manifest.quantization.get("requested", {})
        have = {"source": {k: v for k, v in manifest.source.items() if k != "files"}, "quant": requested.get("quant"),
                "group_size": requested.get("group_size")}
        want = {"source": self.options["source"], "quant": self.quant, "group_size": self.group_size}
        for key in want:
            if have[key] != want[key]:
                raise ResumeError(f"{self.out}: holds a finished conversion with {key}={json.dumps(have[key])}, not "
                                  f"{json.dumps(want[key])}; use --force to convert again")

    # -- steps -----------------------------------------------------------------
    def run(self) -> Manifest:
        expert_bytes = {layer: entry.source_bytes() for layer, entry in self.layers.items()}
        total = sum(d.source_bytes for d in self.dense) + sum(expert_bytes.values())
        with tqdm(total=total, desc="convert", unit="B", unit_scale=True, unit_divisor=1024, disable=not self.progress,
                  file=sys.stderr) as bar:
            dense_record = self.state.finished("dense")
            if dense_record is None:
                dense_record = self._write_dense(bar)
            else:
                bar.update(sum(d.source_bytes for d in self.dense))
            entries, digests = [], {DENSE_NAME: FileDigest(dense_record["size"], dense_record["sha256"])}
            executor = ThreadPoolExecutor(self.workers, thread_name_prefix="convert") if self.workers > 1 else None
            try:
                for done, layer in enumerate(sorted(self.layers)):
                    step = f"layer-{layer:03d}"
                    record = self.state.finished(step)
                    if record is None:
                        abort_at = 1 if done == self.kill_after_layers else None
                        record = self._write_layer(layer, bar, abort_at, executor)
                    else:
                        bar.update(expert_bytes[layer])
                    entries.append(ExpertLayer.from_json(record["entry"]))
                    digests[record["file"]] = FileDigest(record["size"], record["sha256"])
            finally:
                if executor is not None:
                    executor.shutdown(cancel_futures=True)
        return self._write_manifest(entries, digests, self._source_hashes())

    def _write_manifest(self, entries: list[ExpertLayer], digests: dict[str, FileDigest],
                        source_hashes: dict[str, str]) -> Manifest:
        """The tokenizer files copied, then the manifest (last), and the resume state removed."""
        for path in self.source.tokenizer_files():
            digests[path.name] = self._copy(path)
        manifest = Manifest(family=self.source.family, config=self.source.config,
                            source={**self.source.origin, "files": source_hashes}, quantization=self._quantization(),
                            expert_layers=entries, files={name: d.to_json() for name, d in digests.items()},
                            mtp_layers=self.mtp_layers)
        try:
            write_manifest(self.out, manifest)
        except OSError as exc:
            raise write_error(self.out / MANIFEST_NAME, exc) from None
        self.state.path.unlink(missing_ok=True)
        return manifest

    def _quantization(self) -> dict:
        tensors = {d.name: d.spec.to_json() for d in self.dense}
        requested = {"quant": self.quant, "group_size": self.group_size}
        if self.source.mlx is not None:
            return {"mode": "affine", "imported": self.source.imported, "default_bits": self.source.mlx.bits,
                    "group_size": self.source.mlx.group_size, "tensors": tensors, "requested": requested,
                    "classes": self.classes}
        record = {"mode": "affine", "default_bits": None if self.quant == KEEP_SOURCE else self.bits,
                  "group_size": self.group_size, "tensors": tensors, "requested": requested, "classes": self.classes}
        dequantized = getattr(self.source, "dequantized_from", None)  # GPTQ/AWQ codes not kept
        if dequantized:
            record["dequantized_from"] = dequantized
        if self.source.fp8 is not None:  # dequantized to float32, then quantized as requested
            record["dequantized"] = {"quant_method": "fp8", "weight_block_size": list(self.source.fp8.block)}
        if any(experts.keep_mxfp4 for experts in self.layers.values()):  # the experts' codes and scales as they are
            record["imported"] = "mxfp4"
        elif self.source.mxfp4:  # dequantized exactly (bfloat16), then quantized as requested
            record["dequantized"] = {"quant_method": "mxfp4"}
        return record

    def _write_dense(self, bar) -> dict:
        writer = SafetensorsWriter(self.out / DENSE_NAME, [d.parts for d in self.dense], {"format": "pt"})
        by_first = {d.parts[0].name: d for d in self.dense}
        try:
            for group in writer.order:
                item = by_first[group[0].name]
                for name, blocks in dense_blocks(self.source, item):
                    writer.write_blocks(name, blocks)
                bar.update(item.source_bytes)
            digest = writer.close()
        except BaseException:
            writer.abort()
            raise
        record = {"file": DENSE_NAME, **digest.to_json()}
        self.state.finish("dense", record)
        return record

    def _records(self, experts, executor):
        """Each expert's record tensors in expert order; with workers, a few experts are built ahead."""
        if executor is None:
            for expert in range(experts.num_experts):
                yield experts.record(expert, self.bits, self.group_size)
            return
        pending, submitted = deque(), 0
        for _ in range(experts.num_experts):
            while submitted < experts.num_experts and len(pending) < 2 * self.workers:
                pending.append(executor.submit(experts.record, submitted, self.bits, self.group_size))
                submitted += 1
            yield pending.popleft().result()

    def _write_layer(self, layer: int, bar, abort_at: int | None, executor=None) -> dict:
        experts = self.layers[layer]
        path = self.out / f"experts-{layer:03d}.bin"
        per_expert = experts.source_bytes() // max(experts.num_experts, 1)
        writer = None
        try:
            for expert, (tensors, specs) in enumerate(self._records(experts, executor)):
                if abort_at is not None and expert == abort_at:
                    os._exit(75)  # simulate a kill: nothing flushed, no cleanup
                if writer is None:
                    writer = ExpertFileWriter(path, layer, experts.num_experts, tensors, specs)
                try:
                    writer.write(expert, tensors)
                except ValueError as exc:
                    raise LayoutError(f"{experts.prefix}: expert {expert} differs from expert 0 ({exc})") from None
                bar.update(per_expert)
            entry = writer.close()
        except BaseException:
            if writer is not None:
                writer.abort()
            raise
        record = {"file": path.name, **writer.digest.to_json(), "entry": asdict(entry)}
        self.state.finish(f"layer-{layer:03d}", record)
        return record

    def _copy(self, path: Path) -> FileDigest:
        out = OutputFile(self.out / path.name)
        try:
            with open(path, "rb") as fh:
                while block := fh.read(1 << 20):
                    out.write(block)
        except OSError as exc:
            out.abort()
            raise MoestreamError(f"{path}: cannot read ({exc.strerror})") from None
        return out.close()

    def _source_hashes(self) -> dict[str, str]:
        record = self.state.finished("source-hashes")
        if record is None:
            hashes = {}
            for name in tqdm(self.source.files, desc="hashing source", unit="file", disable=not self.progress,
                             file=sys.stderr, leave=False):
                hashes[name] = self.source.file_hash(name)
            record = {"files": hashes}
            self.state.finish("source-hashes", record)
        return record["files"]


def _folder_source(folder: Path, bits: int | None, origin: dict | None = None) -> CheckpointSource:
    """A folder's source: GPTQ/AWQ checkpoints get theirs (which needs the requested bits)."""
    try:
        quant = json.loads((folder / "config.json").read_text()).get("quantization_config")
    except (OSError, ValueError, AttributeError):
        quant = None  # CheckpointSource says what is wrong with it
    if isinstance(quant, dict) and quant.get("quant_method") in ("gptq", "awq"):
        from moestream.convert.gptq_source import GroupwiseSource
        return GroupwiseSource(folder, bits=bits, origin=origin)
    return CheckpointSource(folder, origin=origin)


def open_source(src: str | Path, *, revision: str | None = None, tokenizer: str | Path | None = None,
                bits: int | None = 4) -> CheckpointSource:
    """A local checkpoint folder, a .gguf file, or a Hub repo id fetched into the Hugging Face cache;
    `bits` is the quantization asked for (None: unquantized), which a GPTQ/AWQ source needs."""
    text = str(src)
    path = Path(text).expanduser()
    if path.is_file() and path.suffix == ".gguf":
        from moestream.convert.gguf_source import GgufSource
        return GgufSource(path, tokenizer=tokenizer)
    if tokenizer is not None:
        raise CheckpointError("--tokenizer applies to GGUF files only")
    if path.exists():
        if revision is not None:
            raise CheckpointError(f"{text}: --revision applies to Hub repos, and this is a local folder")
        return _folder_source(path, bits) if path.is_dir() else CheckpointSource(path)
    if looks_like_repo_id(text):
        folder, origin = download(text, revision)
        return _folder_source(Path(folder), bits, origin)
    raise CheckpointError(f"{text}: no such file or directory")


def check_request(quant: str | None, group_size: int, force: bool, resume: bool) -> None:
    """What convert and pull refuse before they look at the source."""
    if quant is not None and quant not in QUANT_BITS:
        raise MoestreamError(f"quantization {quant!r} is not supported (supported: {', '.join(QUANT_BITS)})")
    if group_size not in GROUP_SIZES:
        raise MoestreamError(f"group size {group_size} is not supported (supported: {', '.join(map(str, GROUP_SIZES))})")
    if force and resume:
        raise MoestreamError("--force and --resume exclude each other (--force starts over, --resume continues)")


def convert(src: str | Path, out: str | Path, *, quant: str | None = None, group_size: int = 64, force: bool = False,
            resume: bool = False, revision: str | None = None, progress: bool = True, workers: int = 1,
            kill_after_layers: int | None = None, tokenizer: str | Path | None = None, mtp: bool = True) -> Path:
    """Pack the checkpoint at `src` (folder, .gguf file or Hub repo id) into `out`; returns `out`.

    `quant` None: q4, except that MXFP4 experts (gpt-oss, Hub or GGUF) keep their codes and scales,
    and that a GGUF's tensors are stored as their types allow (codes kept where our layout holds them
    exactly, else no fewer bits: moestream.quant.ggml); "q4", "q8" or "none" quantizes every expert and
    matrix (quantized ones dequantized first) as asked. What each class of tensor became is logged and
    recorded as the manifest's `quantization.classes` (moestream.convert.summary).

    `workers` > 1 builds expert records on that many threads (the output is the same bytes); each
    worker's torch ops are best run single-threaded (the CLI sets that), else the pools compete.
    `kill_after_layers=N` ends the process abruptly (exit 75, nothing flushed) inside expert layer
    N once N layers are finished: how resume is tested against a real kill. `mtp=False` leaves the
    multi-token-prediction layers out (moestream.convert.resident.select_mtp)."""
    check_request(quant, group_size, force, resume)
    out = Path(out)
    source = open_source(src, revision=revision, tokenizer=tokenizer, bits=QUANT_BITS[quant or DEFAULT_QUANT])
    try:
        job = Conversion(source, out, quant=quant, group_size=group_size, progress=progress, workers=workers,
                         kill_after_layers=kill_after_layers, mtp=mtp)
        if job.quant == KEEP_SOURCE:
            log.info("the GGUF's quantized tensors keep their codes where moestream's format holds them exactly, "
                     "else are stored at no fewer bits (--quant q4|q8|none re-quantizes them)")
        elif job.quant == KEEP_MXFP4:
            log.info("the experts are MXFP4: their codes and scales are kept as they are (--quant q4|q8|none "
                     "re-quantizes them)")
        elif source.fp8 is not None or source.mxfp4:
            log.info("the source is %s: its scaled matrices are dequantized and stored as --quant %s",
                     "block-scaled FP8" if source.fp8 else "MXFP4", job.quant)
        if source.imported == "mlx" and quant not in (None, DEFAULT_QUANT):
            log.info("the source is MLX-quantized: its quantization is kept as it is (--quant %s does not apply)", quant)
        log.info("converting %s (%s, %d MoE layers, %d resident tensors) into %s", src, source.family, len(job.layers),
                 len(job.dense), out)
        if job.prepare(force=force, resume=resume):
            try:
                job.run()
                log.info("%s", summary_text(job.classes))
            except WriteError as exc:
                raise WriteError(f"{exc} (what is finished is kept: free space, then run again with --resume)") from None
    finally:
        source.close()
    return out
