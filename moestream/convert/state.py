"""`convert-state.json`: what an unfinished conversion has finished, so `--resume` can continue it.

Written atomically after every finished step (the resident tensors, each expert layer, the source
hashes). It also records the options; resuming with different ones is refused, because the
result must be byte-identical to an uninterrupted conversion."""
from __future__ import annotations

import json
import logging
from dataclasses import dataclass, field
from pathlib import Path

from moestream.errors import MoestreamError
from moestream.format.manifest import write_json
from moestream.format.writer import sha256_file, write_error

log = logging.getLogger(__name__)

STATE_NAME = "convert-state.json"
STATE_VERSION = 1


class ResumeError(MoestreamError):
    """An unfinished conversion that cannot be continued as asked."""


@dataclass
class ConvertState:
    directory: Path
    options: dict
    steps: dict[str, dict] = field(default_factory=dict)

    @property
    def path(self) -> Path:
        return self.directory / STATE_NAME

    def save(self) -> None:
        try:
            write_json(self.path, {"version": STATE_VERSION, "options": self.options, "steps": self.steps})
        except OSError as exc:
            raise write_error(self.path, exc) from None

    @staticmethod
    def load(directory: Path) -> "ConvertState":
        path = directory / STATE_NAME
        try:
            obj = json.loads(path.read_text())
            if obj.get("version") != STATE_VERSION:
                raise ValueError(f"version {obj.get('version')}")
            return ConvertState(directory, obj["options"], obj["steps"])
        except (OSError, ValueError, KeyError, TypeError, AttributeError) as exc:
            raise ResumeError(f"{path}: unreadable ({exc}); start over with --force") from None

    def check_options(self, options: dict) -> None:
        for key in sorted(set(self.options) | set(options)):
            if self.options.get(key) != options.get(key):
                raise ResumeError(f"{self.directory}: the unfinished conversion used {key}={_short(self.options.get(key))}, "
                                  f"not {_short(options.get(key))}; resume with the same options, or use --force to start over")

    def finished(self, step: str) -> dict | None:
        """The step's record if it finished and its file is still intact (size, then sha256)."""
        record = self.steps.get(step)
        if record is None:
            return None
        if "file" not in record:
            return record
        path = self.directory / record["file"]
        if not path.is_file() or path.stat().st_size != record["size"] or sha256_file(path) != record["sha256"]:
            log.warning("%s changed since it was written; redoing it", path)
            del self.steps[step]
            return None
        return record

    def finish(self, step: str, record: dict) -> None:
        self.steps[step] = record
        self.save()


def _short(value) -> str:
    text = json.dumps(value, sort_keys=True)
    return text if len(text) <= 80 else text[:77] + "..."
