"""The demo corpus: the Python standard library's own source files.

Every machine with CPython has this text offline, so the demo model can be rebuilt anywhere. The
file list depends on the exact CPython release, so `prepare` records the version and refuses a
different one unless told otherwise.

Definition (applied to `sysconfig.get_paths()["stdlib"]` of the interpreter that runs `prepare`):
  * every regular file whose name ends in `.py`, found recursively, tests included;
  * except anything under a directory named `site-packages` (third-party code, differs per
    install), `__pycache__`, `encodings` (generated codec tables), `pydoc_data` (documentation
    text) or `config-<version>-<platform>` (build configuration);
  * except `_sysconfigdata_*.py` (paths of the machine that built Python);
  * keeping only files that decode as UTF-8 and parse with that interpreter's `ast.parse`
    (this drops the deliberately broken test-data files).
Files are sorted by their path relative to the stdlib directory (POSIX separators).

Split: the first 8 hex digits of sha256(relative path) as an integer, modulo 100:
  0-4 → test (5 %), 5-6 → val (2 %, used only to pick the checkpoint), 7-99 → train.
"""

from __future__ import annotations

import ast
import hashlib
import os
import sys
import sysconfig
import warnings
from dataclasses import dataclass

EXCLUDED_DIRS = ("site-packages", "__pycache__", "encodings", "pydoc_data")
TEST_BUCKETS = range(0, 5)
VAL_BUCKETS = range(5, 7)


@dataclass(frozen=True)
class SourceFile:
    path: str  # relative to the stdlib dir, POSIX separators
    split: str  # train | val | test
    sha256: str  # of the file's bytes
    n_bytes: int
    text: str


def stdlib_dir() -> str:
    return sysconfig.get_paths()["stdlib"]


def python_version() -> str:
    return ".".join(str(v) for v in sys.version_info[:3])


def split_of(rel_path: str) -> str:
    bucket = int(hashlib.sha256(rel_path.encode("utf-8")).hexdigest()[:8], 16) % 100
    if bucket in TEST_BUCKETS:
        return "test"
    if bucket in VAL_BUCKETS:
        return "val"
    return "train"


def _excluded_dir(name: str) -> bool:
    return name in EXCLUDED_DIRS or name.startswith("config-")


def list_corpus(root: str) -> tuple[list[SourceFile], list[tuple[str, str]]]:
    """Return (kept files sorted by path, [(path, reason)] for .py files that were dropped)."""
    candidates: list[str] = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames if not _excluded_dir(d))
        for name in filenames:
            if not name.endswith(".py") or name.startswith("_sysconfigdata_"):
                continue
            full = os.path.join(dirpath, name)
            if os.path.isfile(full) and not os.path.islink(full):
                candidates.append(os.path.relpath(full, root).replace(os.sep, "/"))
    kept: list[SourceFile] = []
    dropped: list[tuple[str, str]] = []
    for rel in sorted(candidates):
        with open(os.path.join(root, rel), "rb") as f:
            data = f.read()
        try:
            text = data.decode("utf-8")
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")  # SyntaxWarnings from odd test files
                ast.parse(text, filename=rel)
        except (UnicodeDecodeError, SyntaxError, ValueError) as exc:
            dropped.append((rel, type(exc).__name__))
            continue
        kept.append(SourceFile(rel, split_of(rel), hashlib.sha256(data).hexdigest(), len(data), text))
    return kept, dropped
