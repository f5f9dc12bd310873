"""A Hugging Face checkpoint read lazily: config, tensor index, tokenizer files.

Tensors are named as the packed model names them: the family's sanitize maps each checkpoint
name (and drops what is not a weight), so the rest of convert sees only packed names.

They are read with positional reads into fresh buffers (never mapped), so what a conversion
keeps resident is what it holds, not the pages of the checkpoint it has looked at. A block-scaled
FP8 checkpoint's matrices are handed out dequantized (float32; moestream.quant.fp8), their scale
tensors hidden, and an MXFP4 checkpoint's `X_blocks` / `X_scales` pairs as the stack `X` (bfloat16,
exact; moestream.quant.mxfp4), so convert can quantize them like any float checkpoint; `mxfp4_rows`
gives their codes and scales as they are, for records that keep them."""
from __future__ import annotations

import json
import logging
import re
from pathlib import Path

import torch

from moestream.convert.hub import INDEX_NAME, blob_sha256
from moestream.errors import MoestreamError, UnsupportedModelError
from moestream.format.safetensors_io import SafetensorsFile, TensorInfo
from moestream.format.writer import sha256_file
from moestream.models.registry import family_module, supported
from moestream.quant import fp8, mxfp4
from moestream.quant.mlx import MlxQuantization

log = logging.getLogger(__name__)

LAYER_INDEX = re.compile(r"(?:^|\.)layers\.(\d+)\.")

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja",
                   "chat_template.json", "generation_config.json", "vocab.json", "merges.txt", "tokenizer.model",
                   "added_tokens.json")


class CheckpointError(MoestreamError):
    """A source checkpoint that is missing, incomplete or inconsistent."""


class CheckpointSource:
    """Tensors of a local checkpoint folder; every shard's header is checked when it is opened."""

    def __init__(self, folder: str | Path, *, origin: dict | None = None):
        self.folder = Path(folder)
        if not self.folder.exists():
            raise CheckpointError(f"{self.folder}: no such file or directory")
        if not self.folder.is_dir():
            raise CheckpointError(f"{self.folder}: not a folder (give the checkpoint folder holding config.json)")
        self.origin = origin or {"path": str(self.folder.resolve())}
        self._open_checkpoint()

    def _open_checkpoint(self) -> None:
        """config.json, the quantization it names, and the index of every tensor by packed name."""
        self.config = self._read_config()
        family = self.config.get("model_type")
        if family is None:
            raise UnsupportedModelError(f"{self._where('config.json')}: no model_type (supported: {supported()})")
        self.family: str = family
        self.family_module = family_module(family)  # refuses a family that is not supported
        self.fp8: fp8.Fp8Quantization | None = fp8.Fp8Quantization.from_config(self.config)
        self.mxfp4 = mxfp4.is_mxfp4(self.config)
        self.mlx: MlxQuantization | None = (None if self.fp8 or self.mxfp4 else MlxQuantization.from_config(self.config))
        self.imported = "mlx" if self.mlx is not None else None  # whose quantized codes are kept
        self.files = self._shard_names()
        self._handles: dict[str, SafetensorsFile] = {}
        self.index: dict[str, str] = {}  # checkpoint name -> shard file
        self.packed_names: dict[str, str] = {}  # packed name -> checkpoint name
        self.fp8_scales: dict[str, tuple[str, str]] = {}  # an FP8 weight's name -> its scale's name, shard
        self.mxfp4_stacks: dict[str, tuple[str, str]] = {}  # a stack X -> X_scales, its shard (X_blocks: index[X])
        try:
            self._build_index()
            self._pair_fp8_scales()
            self._pair_mxfp4_blocks()
            self._sanitize()
        except BaseException:
            self.close()
            raise

    def _read_config(self) -> dict:
        path = self.folder / "config.json"
        if not path.is_file():
            raise CheckpointError(f"{self.folder}: not a Hugging Face checkpoint (config.json is missing)")
        try:
            config = json.loads(path.read_text())
        except (json.JSONDecodeError, UnicodeDecodeError) as exc:
            raise CheckpointError(f"{path}: not valid JSON ({exc})") from None
        if not isinstance(config, dict):
            raise CheckpointError(f"{path}: not a JSON object")
        return config

    # -- where the shards are: a folder here, the Hub for a pull ---------------------
    def _where(self, name: str = "") -> str:
        """How an error names the checkpoint, or one of its files."""
        return str(self.folder / name) if name else str(self.folder)

    def _has_file(self, name: str) -> bool:
        return (self.folder / name).is_file()

    def _safetensors_names(self) -> list[str]:
        return sorted(p.name for p in self.folder.glob("*.safetensors"))

    def _shard_tensors(self, shard: str) -> list[str]:
        return self._open(shard).keys()

    def _shard_names(self) -> list[str]:
        index = self.folder / INDEX_NAME
        if index.is_file():
            try:
                weight_map = json.loads(index.read_text())["weight_map"]
                self._index_map = {str(k): str(v) for k, v in weight_map.items()}
            except (json.JSONDecodeError, UnicodeDecodeError, KeyError, TypeError, AttributeError):
                raise CheckpointError(f"{self._where(INDEX_NAME)}: not a valid shard index (no weight_map)") from None
            files = sorted(set(self._index_map.values()))
            for name in files:
                if not self._has_file(name):
                    raise CheckpointError(f"{self._where(name)}: missing (listed in {INDEX_NAME})")
            return files
        self._index_map = None
        files = self._safetensors_names()
        if not files:
            raise CheckpointError(f"{self._where()}: no *.safetensors files (only safetensors checkpoints are read)")
        return files

    def _build_index(self) -> None:
        for name in self.files:
            for key in self._shard_tensors(name):
                if self._index_map is not None:
                    if self._index_map.get(key, name) != name:
                        continue  # the index places this tensor elsewhere; that copy wins
                elif key in self.index:
                    raise CheckpointError(f"{self._where()}: tensor {key} is in both {self.index[key]} and {name}")
                self.index[key] = name
        if self._index_map is not None:
            for key, file in self._index_map.items():
                if key not in self.index:
                    raise CheckpointError(f"{self._where(file)}: tensor {key} is missing (listed in {INDEX_NAME})")

    def _pair_fp8_scales(self) -> None:
        """Each FP8 weight with its `_scale_inv` tensor (of the grid its block size gives); the
        scales leave the index, read only with their weights."""
        scales = sorted(k for k in self.index if k.endswith(fp8.SCALE_SUFFIX))
        if self.fp8 is None:
            if scales:
                raise CheckpointError(f"{scales[0]}: an FP8 scale, but config.json has no quantization_config with "
                                      "quant_method fp8")
            return
        for key in scales:
            weight = key[: -len(fp8.SCALE_SUFFIX)]
            if weight not in self.index:
                raise CheckpointError(f"{key}: a scale without its weight {weight}")
            shape, grid = self._open(self.index[weight]).info(weight).shape, self._open(self.index[key]).info(key).shape
            if tuple(grid) != self.fp8.scale_shape(shape):
                raise CheckpointError(f"{key}: scale grid {list(grid)}, but a {list(shape)} weight in "
                                      f"{list(self.fp8.block)} blocks has {list(self.fp8.scale_shape(shape))}")
            self.fp8_scales[weight] = (key, self.index.pop(key))
        for key, file in self.index.items():
            if self._open(file).info(key).dtype in fp8.FP8_DTYPES and key not in self.fp8_scales:
                raise CheckpointError(f"{key}: an FP8 weight without its {key}{fp8.SCALE_SUFFIX}")

    def _pair_mxfp4_blocks(self) -> None:
        """Each `X_blocks` with its `X_scales`, both replaced in the index by the stack `X`."""
        blocks = sorted(k for k in self.index if k.endswith(mxfp4.BLOCKS))
        if blocks and not self.mxfp4:
            raise CheckpointError(f"{blocks[0]}: MXFP4 blocks, but config.json has no quantization_config with "
                                  "quant_method mxfp4")
        for key in blocks:
            stack = key[: -len(mxfp4.BLOCKS)]
            scales = stack + mxfp4.SCALES
            if scales not in self.index:
                raise CheckpointError(f"{key}: MXFP4 blocks without their {scales}")
            blocks_info, scales_info = self._open(self.index[key]).info(key), self._open(self.index[scales]).info(scales)
            mxfp4.check_pair(stack, blocks_info.shape, scales_info.shape, blocks_info.dtype, scales_info.dtype)
            self.mxfp4_stacks[stack] = (scales, self.index.pop(scales))
            self.index[stack] = self.index.pop(key)

    def _sanitize(self) -> None:
        dropped, beyond = 0, 0
        layers, mtp = self._decoder_layers()
        for key in sorted(self.index):
            # layers past num_hidden_layers are multi-token-prediction layers (GLM-4.5, DeepSeek-V3):
            # kept for the families that build them (moestream.models.mtp), the rest left out
            index = LAYER_INDEX.search(key)
            if isinstance(layers, int) and index and int(index[1]) >= layers + mtp:
                beyond += 1
                continue
            name = self.family_module.sanitize(key)
            if name is None:
                dropped += 1
            elif name in self.packed_names:
                raise CheckpointError(f"{self.folder}: tensors {self.packed_names[name]} and {key} are both {name} "
                                      f"in a {self.family} model")
            else:
                self.packed_names[name] = key
        if dropped:
            log.info("%d checkpoint tensors are not weights of a %s model (left out)", dropped, self.family)
        if beyond:
            log.info("%d checkpoint tensors of layers past num_hidden_layers=%d (prediction heads) left out", beyond, layers)

    def _decoder_layers(self) -> tuple[int | None, int]:
        """(num_hidden_layers, multi-token-prediction layers) as the family reads config.json."""
        try:
            args = self.family_module.ModelArgs.from_dict(self.config)
        except (MoestreamError, TypeError, ValueError):  # the layout checks say what is wrong with the config
            return self.config.get("num_hidden_layers"), 0
        return args.num_hidden_layers, args.mtp_layer_count()

    def _open(self, file: str) -> SafetensorsFile:
        if file not in self._handles:
            self._handles[file] = SafetensorsFile(self.folder / file)
        return self._handles[file]

    # -- tensors, by packed name -------------------------------------------------
    def names(self) -> list[str]:
        return sorted(self.packed_names)

    def __contains__(self, name: str) -> bool:
        return name in self.packed_names

    def _locate(self, name: str) -> tuple[SafetensorsFile, str]:
        key = self.packed_names[name]
        return self._open(self.index[key]), key

    def info(self, name: str) -> TensorInfo:
        handle, key = self._locate(name)
        if key in self.mxfp4_stacks:  # handed out dequantized: bfloat16 [E, In, Out]
            blocks = handle.info(key + mxfp4.BLOCKS)
            shape = mxfp4.dequantized_shape(blocks.shape)
            return TensorInfo(key, "BF16", shape, blocks.start, 2 * blocks.nbytes * 2)
        info = handle.info(key)
        if key in self.fp8_scales:  # handed out dequantized: float32 of the same shape
            return TensorInfo(info.name, "F32", info.shape, info.start, 4 * info.nbytes // info.torch_dtype.itemsize)
        return info

    def nbytes(self, name: str) -> int:
        return self.info(name).nbytes

    def get(self, name: str) -> torch.Tensor:
        handle, key = self._locate(name)
        if key in self.mxfp4_stacks:
            return mxfp4.dequantize(*self.mxfp4_rows(name, 0, self.info(name).shape[0]))
        if key in self.fp8_scales:
            return fp8.dequantize(handle.read(key), self._scale(key), self.fp8.block)
        return handle.read(key)

    def get_rows(self, name: str, start: int, count: int = 1) -> torch.Tensor:
        handle, key = self._locate(name)
        if key in self.mxfp4_stacks:  # rows of a stack: whole experts
            return mxfp4.dequantize(*self.mxfp4_rows(name, start, count))
        if key not in self.fp8_scales:
            return handle.read_rows(key, start, count)
        rows = handle.read_rows(key, start, count)
        if rows.dim() > 2:  # rows of a stack [E, R, C] are whole matrices: their own scale grids
            return fp8.dequantize(rows, self._scale(key, start, count), self.fp8.block)
        return fp8.dequantize(rows, self._scale(key), self.fp8.block, first_row=start)

    def mxfp4_stack(self, name: str) -> bool:
        """Whether the stack `name` is held as MXFP4 blocks and scales (`mxfp4_rows` reads them)."""
        return name in self.packed_names and self.packed_names[name] in self.mxfp4_stacks

    def mxfp4_rows(self, name: str, start: int, count: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
        """Experts start.. of an MXFP4 stack as stored: blocks uint8 [n, Out, G, 16], scales uint8 [n, Out, G]
        (a NaN scale refused)."""
        handle, key = self._locate(name)
        scales_key, file = self.mxfp4_stacks[key]
        scales = self._open(file).read_rows(scales_key, start, count)
        mxfp4.check_scales(scales_key, scales, start)
        return handle.read_rows(key + mxfp4.BLOCKS, start, count), scales

    def _scale(self, key: str, start: int | None = None, count: int = 1) -> torch.Tensor:
        scale, file = self.fp8_scales[key]
        handle = self._open(file)
        return handle.read(scale) if start is None else handle.read_rows(scale, start, count)

    # -- other files ----------------------------------------------------------
    def tokenizer_files(self) -> list[Path]:
        return [self.folder / n for n in TOKENIZER_FILES if (self.folder / n).is_file()]

    def file_sizes(self) -> dict[str, int]:
        return {f: (self.folder / f).stat().st_size for f in self.files}

    def file_hash(self, name: str) -> str:
        return blob_sha256(self.folder / name) or sha256_file(self.folder / name)

    def close(self) -> None:
        for handle in self._handles.values():
            handle.close()
        self._handles.clear()
