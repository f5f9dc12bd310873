"""A Hugging Face checkpoint folder read lazily: config, tensor index, tokenizer files."""
from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open

from moestream.errors import MoestreamError, UnsupportedModelError
from moestream.models import SUPPORTED_FAMILIES

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja",
                   "chat_template.json", "generation_config.json", "vocab.json", "merges.txt", "tokenizer.model",
                   "added_tokens.json")


class CheckpointSource:
    """Tensors of a local checkpoint folder, opened lazily, one safetensors file at a time."""

    def __init__(self, folder: str | Path):
        self.folder = Path(folder)
        if not self.folder.exists():
            raise MoestreamError(f"{self.folder}: no such file or directory")
        if not (self.folder / "config.json").is_file():
            raise MoestreamError(f"{self.folder}: not a Hugging Face checkpoint (config.json is missing)")
        try:
            self.config = json.loads((self.folder / "config.json").read_text())
        except json.JSONDecodeError as exc:
            raise MoestreamError(f"{self.folder / 'config.json'}: not valid JSON ({exc})") from None
        family = self.config.get("model_type")
        if family not in SUPPORTED_FAMILIES:
            raise UnsupportedModelError(f"model_type {family!r} is not supported (supported: {', '.join(SUPPORTED_FAMILIES)})")
        self.family = family
        self.files = sorted(p.name for p in self.folder.glob("*.safetensors"))
        if not self.files:
            raise MoestreamError(f"{self.folder}: no *.safetensors files (only safetensors checkpoints are read)")
        self._handles: dict[str, object] = {}
        self.index: dict[str, str] = {}
        for name in self.files:
            for key in self._open(name).keys():
                self.index[key] = name

    def _open(self, file: str):
        if file not in self._handles:
            try:
                self._handles[file] = safe_open(str(self.folder / file), framework="pt")
            except (SafetensorError, OSError, ValueError) as exc:
                raise MoestreamError(f"{self.folder / file}: corrupt or truncated safetensors file ({exc})") from None
        return self._handles[file]

    def names(self) -> list[str]:
        return sorted(self.index)

    def shape(self, name: str) -> list[int]:
        return list(self._open(self.index[name]).get_slice(name).get_shape())

    def get(self, name: str) -> torch.Tensor:
        try:
            return self._open(self.index[name]).get_tensor(name)
        except (SafetensorError, OSError, ValueError, RuntimeError) as exc:
            raise MoestreamError(f"{self.folder / self.index[name]}: cannot read tensor {name} ({exc})") from None

    def tokenizer_files(self) -> list[Path]:
        return [self.folder / n for n in TOKENIZER_FILES if (self.folder / n).is_file()]
