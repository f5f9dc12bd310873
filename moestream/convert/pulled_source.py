"""A Hub checkpoint whose shards arrive one at a time.

Everything a conversion plans with (config.json, the index, every tensor's dtype and shape) is
known before any weight is downloaded: the shards' headers are read with byte ranges. Tensor data
comes from the one shard on disk, or from the few tensors kept in memory because work that needs
them also needs a later shard."""
from __future__ import annotations

from pathlib import Path

import torch

from moestream.convert.hub import INDEX_NAME, HubRepo
from moestream.convert.source import TOKENIZER_FILES, CheckpointError, CheckpointSource
from moestream.format.safetensors_io import SafetensorsFile, TensorInfo
from moestream.quant.fp8 import Fp8Quantization
from moestream.quant.mxfp4 import is_mxfp4


class TensorNotHere(LookupError):
    """A tensor was asked for whose shard is not on disk (a bug in the work order)."""


class PulledSource(CheckpointSource):
    """CheckpointSource's interface over a HubRepo: metadata files in `folder`, shards on demand."""

    def __init__(self, repo: HubRepo, folder: Path, *, bar=None):
        self.repo, self.folder = repo, Path(folder)
        self.origin = repo.origin
        for name in ("config.json", INDEX_NAME, *TOKENIZER_FILES):
            if name in repo.files and not (self.folder / name).is_file():
                repo.download(name, self.folder, bar=bar)
        if "config.json" not in repo.files:
            raise CheckpointError(f"{repo.repo_id}: not a Hugging Face checkpoint (config.json is missing)")
        self._headers: dict[str, dict[str, TensorInfo]] = {}  # each shard's tensors, from its header
        self.shard: SafetensorsFile | None = None  # the shard on disk now
        self.kept: dict[str, torch.Tensor] = {}
        self._open_checkpoint()

    def _read_config(self) -> dict:
        config = super()._read_config()
        quant = config.get("quantization_config")
        if isinstance(quant, dict) and quant.get("quant_method") in ("gptq", "awq"):
            raise CheckpointError(f"{self.repo.repo_id}: a {quant['quant_method'].upper()} checkpoint: pull does not "
                                  "read it yet (download it, then moestream convert the folder)")
        if Fp8Quantization.from_config(config) is not None or is_mxfp4(config):
            raise CheckpointError(f"{self.repo.repo_id}: pull streams float and MLX checkpoints; for an FP8 or MXFP4 "
                                  "one, download it and run moestream convert on the folder")
        return config

    def _where(self, name: str = "") -> str:
        return f"{self.repo.repo_id}: {name}" if name else self.repo.repo_id

    def _has_file(self, name: str) -> bool:
        return name in self.repo.files

    def _safetensors_names(self) -> list[str]:
        return sorted(n for n in self.repo.files if n.endswith(".safetensors") and "/" not in n)

    def _shard_tensors(self, shard: str) -> list[str]:
        self._headers[shard] = self.repo.header(shard)
        return list(self._headers[shard])

    # -- the shard on disk --------------------------------------------------------
    def open_shard(self, name: str, path: Path) -> None:
        """Make `path` (the downloaded `name`) the shard tensors are read from; its header must match the remote one."""
        self.close_shard()
        shard = SafetensorsFile(path)
        for tname, shard_name in self.index.items():
            if shard_name != name:
                continue
            want = self.info(tname)
            if tname not in shard.tensors:
                shard.close()
                raise CheckpointError(f"{path}: tensor {tname} is missing (the Hub's header lists it)")
            got = shard.info(tname)
            if (got.dtype, got.shape) != (want.dtype, want.shape):
                shard.close()
                raise CheckpointError(f"{path}: tensor {tname} is {got.dtype} {list(got.shape)}, the Hub's header says "
                                      f"{want.dtype} {list(want.shape)}")
        self.shard, self.shard_name = shard, name

    def close_shard(self) -> None:
        if self.shard is not None:
            self.shard.close()
        self.shard, self.shard_name = None, None

    def keep(self, name: str) -> None:
        """Hold `name` in memory: later work needs it after its shard is gone."""
        if name not in self.kept:
            self.kept[name] = self.get(name)

    def release(self, names) -> None:
        for name in names:
            self.kept.pop(name, None)

    def available(self, name: str) -> bool:
        return name in self.kept or (self.shard is not None and self.index.get(name) == self.shard_name)

    # -- CheckpointSource -----------------------------------------------------------
    def info(self, name: str) -> TensorInfo:
        return self._headers[self.index[name]][name]

    def get(self, name: str) -> torch.Tensor:
        if name in self.kept:
            return self.kept[name]
        if self.shard is None or self.index.get(name) != self.shard_name:
            raise TensorNotHere(f"{name} is in {self.index.get(name)}, which is not on disk now")
        return self.shard.read(name)

    def get_rows(self, name: str, start: int, count: int = 1) -> torch.Tensor:
        if name in self.kept:
            return self.kept[name][start:start + count]
        if self.shard is None or self.index.get(name) != self.shard_name:
            raise TensorNotHere(f"{name} is in {self.index.get(name)}, which is not on disk now")
        return self.shard.read_rows(name, start, count)

    def file_sizes(self) -> dict[str, int]:
        return {f: self.repo.files[f].size for f in self.files}

    def file_hash(self, name: str) -> str:
        raise NotImplementedError("a pulled shard is hashed when it is downloaded")

    def close(self) -> None:
        self.close_shard()
        self.kept.clear()


class ZeroSource:
    """The same tensors, all zeros: building expert 0's record from it gives a layer's record
    layout (field shapes, offsets, size) before any weight is downloaded."""

    def __init__(self, source: CheckpointSource):
        self._source = source

    def __getattr__(self, name):
        return getattr(self._source, name)

    def __contains__(self, name: str) -> bool:
        return name in self._source

    def get(self, name: str) -> torch.Tensor:
        info = self._source.info(name)
        return torch.zeros(info.shape, dtype=info.torch_dtype)

    def get_rows(self, name: str, start: int, count: int = 1) -> torch.Tensor:
        info = self._source.info(name)
        return torch.zeros((count, *info.shape[1:]), dtype=info.torch_dtype)
