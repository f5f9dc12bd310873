"""Which source reads a checkpoint: a local folder (plain, or GPTQ/AWQ), a .gguf file, or a Hub repo."""
from __future__ import annotations

import json
from pathlib import Path

from moestream.convert.hub import download, looks_like_repo_id
from moestream.convert.source import CheckpointError, CheckpointSource


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
