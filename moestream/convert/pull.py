"""`moestream pull REPO OUT`: convert a Hub repository while downloading it, one shard at a time.

The plan (every tensor's place in dense.safetensors and every expert record's layout) comes from
the shards' headers, read with byte ranges, so the output files are laid out before any weight
arrives. Then each shard is downloaded into OUT/.pull-download, every piece of output that it
completes is written at its final offset, and the shard is deleted before the next one is fetched:
the extra disk a pull needs is the largest shard (plus the small metadata files). A piece that
needs tensors from two shards (an expert whose projections straddle a shard boundary) keeps the
tensors from the first shard in memory until the second arrives.

Resume: a shard is marked done in convert-state.json once every piece that needs it is written
and fsynced. After a kill, every piece that needs only unfinished shards is written again (the
same bytes at the same offsets), so the result is byte-identical to an uninterrupted pull."""
from __future__ import annotations

import logging
import os
import shutil
import sys
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

from tqdm import tqdm

from moestream.convert.hub import HubError, HubRepo, looks_like_repo_id
from moestream.convert.layout import FusedLayer, MlxStackLayer, PerExpertLayer, check_expert_layers, find_expert_layers
from moestream.convert.main import DOWNLOAD_DIR, Conversion, check_request, dense_blocks
from moestream.convert.pulled_source import PulledSource, ZeroSource
from moestream.convert.state import STATE_NAME, ConvertState, ResumeError
from moestream.errors import MoestreamError
from moestream.format.manifest import DENSE_NAME, EXPERT_PROJECTIONS, ExpertLayer, Manifest
from moestream.format.records import encode_record, plan_record
from moestream.format.safetensors_io import plan_safetensors, tensor_bytes
from moestream.format.verify import record_checksums, verify
from moestream.format.writer import FileDigest, WriteError, sha256_file, write_error

log = logging.getLogger(__name__)
SHARD_DIR = "shard"  # the one shard on disk


@dataclass
class Piece:
    """Output bytes that depend on `deps` (source tensor names) and are written by `write`."""

    deps: tuple[str, ...]
    write: Callable[[], None]
    what: str


@dataclass
class PlanSizes:
    """What a pull downloads and writes, known from the headers alone."""

    downloads: dict[str, int]  # file -> bytes
    packed_bytes: int
    largest_shard: int
    files: dict[str, int] = field(default_factory=dict)  # output file -> bytes


class OutputFiles:
    """The packed model's data files, created at their final size and written at offsets."""

    def __init__(self, out: Path, sizes: dict[str, int]):
        self.out, self.sizes = out, sizes
        self.fds: dict[str, int] = {}

    def open(self, *, fresh: bool) -> None:
        for name, size in self.sizes.items():
            path = self.out / name
            try:
                fd = os.open(path, os.O_RDWR | os.O_CREAT | (os.O_TRUNC if fresh else 0), 0o644)
                if fresh:
                    os.ftruncate(fd, size)
            except OSError as exc:
                raise write_error(path, exc) from None
            self.fds[name] = fd

    def intact(self) -> bool:
        return all((self.out / n).is_file() and (self.out / n).stat().st_size == s for n, s in self.sizes.items())

    def pwrite(self, name: str, data, offset: int) -> None:
        view = memoryview(data).cast("B")
        try:
            while view:
                done = os.pwrite(self.fds[name], view, offset)
                view, offset = view[done:], offset + done
        except OSError as exc:
            raise write_error(self.out / name, exc) from None

    def sync(self) -> None:
        for name, fd in self.fds.items():
            try:
                os.fsync(fd)
            except OSError as exc:
                raise write_error(self.out / name, exc) from None

    def close(self) -> None:
        for fd in self.fds.values():
            os.close(fd)
        self.fds.clear()


def record_deps(experts, expert: int) -> tuple[str, ...]:
    """The source tensors one expert's record is built from."""
    if isinstance(experts, PerExpertLayer):
        return tuple(experts.name(expert, p) for p in EXPERT_PROJECTIONS)
    if isinstance(experts, FusedLayer):
        return tuple(experts.names[p] for p in ("gate_up_proj", "down_proj"))
    if isinstance(experts, MlxStackLayer):
        parts = []
        for p in EXPERT_PROJECTIONS:
            kinds = ("weight", "scales", "biases") if experts.specs[p].quantized else ("weight",)
            parts += [experts.names[(p, k)] for k in kinds]
        return tuple(parts)
    raise TypeError(f"{type(experts).__name__}: no dependency rule for this expert layout")


class Pull(Conversion):
    """One run of `pull`: the plan from the headers, OUT with its state, the shard loop."""

    JOB = "pull"

    def __init__(self, source: PulledSource, out: Path, *, quant: str, group_size: int, progress: bool,
                 kill_after_shards: int | None = None, mtp: bool = True):
        super().__init__(source, out, quant=quant, group_size=group_size, progress=progress, mtp=mtp)
        self.options["pull"] = True  # a `convert --resume` of this OUT is refused, and the other way round
        self.kill_after_shards = kill_after_shards
        self.dense_order, self.dense_header, offsets = plan_safetensors([d.parts for d in self.dense], {"format": "pt"})
        self.dense_offsets = {name: len(self.dense_header) + begin for name, (begin, _) in offsets.items()}
        self.dense_size = len(self.dense_header) + sum(e.nbytes for g in self.dense_order for e in g)
        zero = ZeroSource(source)  # the record layouts, from zeros of the right shapes
        zero_layers, _ = find_expert_layers(zero)
        zero_layers = {layer: e for layer, e in zero_layers.items() if layer in self.layers}  # MTP layers as kept
        check_expert_layers(zero_layers, zero, mtp_layers=self.mtp_layers)
        self.entries: dict[int, ExpertLayer] = {}
        for layer in sorted(self.layers):
            tensors, specs = zero_layers[layer].record(0, self.bits, group_size)
            fields, record_size = plan_record(tensors)
            self.entries[layer] = ExpertLayer(layer=layer, file=f"experts-{layer:03d}.bin",
                                              num_experts=self.layers[layer].num_experts, record_size=record_size,
                                              fields=fields, quant={k: v.to_json() for k, v in specs.items()})
        sizes = {DENSE_NAME: self.dense_size}
        sizes.update({e.file: e.num_experts * e.record_size for e in self.entries.values()})
        self.outputs = OutputFiles(out, sizes)

    def sizes(self) -> PlanSizes:
        repo = self.source.repo
        meta = {n: repo.files[n].size for n in repo.files if (self.source.folder / n).is_file()}
        shards = {n: repo.files[n].size for n in self.source.files}
        tokenizer = sum(p.stat().st_size for p in self.source.tokenizer_files())
        return PlanSizes({**meta, **shards}, sum(self.outputs.sizes.values()) + tokenizer, max(shards.values()),
                         dict(self.outputs.sizes))

    # -- pieces ------------------------------------------------------------------
    def pieces(self) -> list[Piece]:
        out = []
        for item in self.dense:
            deps = (item.name,) if item.quantize else tuple(part.name for part in item.parts)
            out.append(Piece(deps, lambda item=item: self._write_resident(item), item.name))
        for layer in sorted(self.layers):
            experts = self.layers[layer]
            for expert in range(experts.num_experts):
                out.append(Piece(record_deps(experts, expert), lambda layer=layer, expert=expert: self._write_record(layer, expert),
                                 f"layer {layer} expert {expert}"))
        return out

    def _write_resident(self, item) -> None:
        for name, blocks in dense_blocks(self.source, item):
            offset = self.dense_offsets[name]
            for block in blocks:
                data = tensor_bytes(block)
                self.outputs.pwrite(DENSE_NAME, data, offset)
                offset += len(data)

    def _write_record(self, layer: int, expert: int) -> None:
        entry = self.entries[layer]
        tensors, _ = self.layers[layer].record(expert, self.bits, self.group_size)
        try:
            record = encode_record(entry.fields, entry.record_size, tensors)
        except (ValueError, KeyError) as exc:
            raise MoestreamError(f"{self.layers[layer].prefix}: expert {expert} differs from expert 0 ({exc})") from None
        self.outputs.pwrite(entry.file, record, expert * entry.record_size)

    @property
    def download_dir(self) -> Path:
        return self.out / DOWNLOAD_DIR

    # -- the shard loop ---------------------------------------------------------------
    def run(self) -> Manifest:
        source: PulledSource = self.source
        fresh = not self.outputs.intact()
        if fresh and any(k.startswith("shard:") for k in self.state.steps):
            log.warning("%s: the output files changed since the last run; converting every shard again", self.out)
            self.state.steps = {k: v for k, v in self.state.steps.items() if not k.startswith("shard:")}
            self.state.save()
        self.outputs.open(fresh=fresh)
        try:
            if fresh:
                self.outputs.pwrite(DENSE_NAME, self.dense_header, 0)
            done = {s for s in source.files if f"shard:{s}" in self.state.steps}
            pending = [p for p in self.pieces() if not any(source.index[d] in done for d in p.deps)]
            todo = [s for s in source.files if s not in done]
            total = sum(source.repo.files[s].size for s in todo)
            with tqdm(total=total, desc="pull", unit="B", unit_scale=True, unit_divisor=1024, disable=not self.progress,
                      file=sys.stderr, dynamic_ncols=True) as bar:
                for k, shard in enumerate(todo):
                    bar.set_postfix_str(f"shard {len(done) + k + 1}/{len(source.files)}: download")
                    path = self._fetch(shard, bar)
                    source.open_shard(shard, path)
                    bar.set_postfix_str(f"shard {len(done) + k + 1}/{len(source.files)}: convert")
                    ready = [p for p in pending if all(source.available(d) for d in p.deps)]
                    kill_at = len(ready) // 2 if k == self.kill_after_shards else -1
                    for i, piece in enumerate(ready):
                        if i == kill_at:
                            os._exit(75)  # simulate a kill: nothing flushed, no cleanup
                        piece.write()
                    if kill_at == 0:
                        os._exit(75)
                    taken = set(map(id, ready))
                    pending = [p for p in pending if id(p) not in taken]
                    for piece in pending:  # what later pieces need from this shard stays in memory
                        for dep in piece.deps:
                            if source.index[dep] == shard:
                                source.keep(dep)
                    source.close_shard()
                    self._delete(shard)
                    needed = {d for p in pending for d in p.deps}
                    source.release([n for n in list(source.kept) if n not in needed])
                    self.outputs.sync()
                    busy = {source.index[d] for d in needed}
                    for finished in todo[: k + 1]:
                        if finished not in busy and f"shard:{finished}" not in self.state.steps:
                            self.state.finish(f"shard:{finished}", {})
            if pending:
                raise MoestreamError(f"{len(pending)} pieces were never written (first: {pending[0].what})")
            manifest = self._finish()
        finally:
            self.outputs.close()
        shutil.rmtree(self.download_dir, ignore_errors=True)
        return manifest

    def _fetch(self, shard: str, bar) -> Path:
        """Download one shard and check it against the Hub's sha256 (recorded for the manifest)."""
        repo = self.source.repo
        for attempt in (1, 2):
            path = repo.download(shard, self.download_dir / SHARD_DIR, bar=bar)
            sha = sha256_file(path)
            want = repo.files[shard].sha256
            if want is None or sha == want:
                self.state.finish(f"sha:{shard}", {"sha256": sha})
                return path
            self._delete(shard)
            log.warning("%s: sha256 %s differs from the Hub's %s (attempt %d)", shard, sha[:12], want[:12], attempt)
        raise HubError(f"{repo.repo_id}: {shard} downloaded twice with a sha256 that differs from the Hub's")

    def _delete(self, shard: str) -> None:
        folder = self.download_dir / SHARD_DIR
        (folder / shard).unlink(missing_ok=True)
        for meta in (folder / ".cache" / "huggingface" / "download").glob(f"{shard}.*"):
            meta.unlink(missing_ok=True)

    def _finish(self) -> Manifest:
        """Record checksums and file hashes from the written files, copy the tokenizer, manifest last."""
        digests = {DENSE_NAME: FileDigest.of(self.out / DENSE_NAME)}
        entries = []
        for layer in sorted(self.entries):
            entry = self.entries[layer]
            sha, entry.crc32 = record_checksums(self.out / entry.file, entry)
            entries.append(entry)
            digests[entry.file] = FileDigest(entry.num_experts * entry.record_size, sha)
        hashes = {s: self.state.steps[f"sha:{s}"]["sha256"] for s in self.source.files}
        return self._write_manifest(entries, digests, hashes)


def _resume_revision(out: Path, revision: str | None) -> tuple[str | None, str | None]:
    """An unfinished pull continues at the commit it started from, even if the branch has moved."""
    try:
        state = ConvertState.load(out)
    except ResumeError:
        return revision, None
    source = state.options.get("source") or {}
    if not state.options.get("pull") or "revision" not in source:
        return revision, None
    if revision is not None and revision not in (source.get("requested_revision"), source["revision"]):
        raise ResumeError(f"{out}: the unfinished pull is of revision {source.get('requested_revision')!r}, not "
                          f"{revision!r}; resume without --revision, or use --force to start over")
    return source["revision"], source.get("requested_revision")


def _check_repo_id(repo_id: str) -> None:
    if not looks_like_repo_id(repo_id):
        raise MoestreamError(f"{repo_id!r} is not a Hub repo id (owner/name); to pack a local folder use moestream convert")


def pull(repo_id: str, out: str | Path, *, revision: str | None = None, quant: str = "q4", group_size: int = 64,
         force: bool = False, resume: bool = False, progress: bool = True, endpoint: str | None = None,
         kill_after_shards: int | None = None, mtp: bool = True) -> Path:
    """Download and pack `repo_id` into `out`, one shard on disk at a time; verified at the end.

    `kill_after_shards=N` ends the process abruptly (exit 75) half-way through converting the
    (N+1)-th shard of this run: how resume is tested against a real kill."""
    _check_repo_id(repo_id)
    check_request(quant, group_size, force, resume)
    out = Path(out)
    requested = revision
    if resume and (out / STATE_NAME).is_file():
        revision, requested = _resume_revision(out, revision)
    repo = HubRepo(repo_id, revision, endpoint=endpoint, requested=requested)
    # config, index and tokenizer files wait in the system's temp folder: OUT is not touched before it is checked
    with tempfile.TemporaryDirectory(prefix="moestream-pull-") as meta:
        source = PulledSource(repo, Path(meta))
        try:
            job = Pull(source, out, quant=quant, group_size=group_size, progress=progress,
                       kill_after_shards=kill_after_shards, mtp=mtp)
            sizes = job.sizes()
            log.info("pulling %s@%s (%s, %d MoE layers, %d shards, %s) into %s; extra disk at most %s (the largest "
                     "shard)", repo_id, repo.commit[:12], source.family, len(job.layers), len(source.files),
                     _gib(sum(sizes.downloads.values())), out, _gib(sizes.largest_shard))
            if job.prepare(force=force, resume=resume):
                try:
                    job.run()
                except WriteError as exc:
                    raise WriteError(f"{exc} (what is finished is kept: free space, then run again with --resume)") from None
        finally:
            source.close()
    report = verify(out, progress=progress)
    if not report.ok:
        raise MoestreamError(f"{out}: the pulled model fails verification: {report.problems[0]}")
    return out


def plan_pull(repo_id: str, *, revision: str | None = None, quant: str = "q4", group_size: int = 64,
              endpoint: str | None = None) -> tuple[HubRepo, PlanSizes]:
    """What a pull would download and write, from config, index and shard headers only."""
    _check_repo_id(repo_id)
    check_request(quant, group_size, False, False)
    repo = HubRepo(repo_id, revision, endpoint=endpoint)
    with tempfile.TemporaryDirectory(prefix="moestream-plan-") as tmp:
        source = PulledSource(repo, Path(tmp))
        try:
            job = Pull(source, Path(tmp) / "out", quant=quant, group_size=group_size, progress=False)
            return repo, job.sizes()
        finally:
            source.close()


def _gib(n: int) -> str:
    return f"{n / 2**30:.2f} GiB" if n >= 2**30 else f"{n / 2**20:.2f} MiB"
