"""Checking the resident files of a packed model (dense weights, tokenizer, configs) at load.

Every file the manifest lists that is not an expert file is hashed (sha256) and compared with the
manifest before the engine uses it. Hashing a large dense file on every start would make warm
starts slow, so a digest once computed is remembered in a small JSON file against the file's
identity (path, size, mtime_ns, inode): a file that was rewritten, replaced or touched is hashed
again. Expert files are not hashed here: each record is checked (crc32) as it is read.
"""
from __future__ import annotations

import hashlib
import json
import logging
import os
import tempfile
import threading
from dataclasses import dataclass
from pathlib import Path

from moestream.errors import FormatError
from moestream.format.manifest import Manifest

log = logging.getLogger(__name__)

CACHE_FILE = "verified-files.json"
CACHE_VERSION = 1
_lock = threading.Lock()  # one writer per process; os.replace keeps concurrent processes safe
_memo: dict[tuple, str] = {}  # identity -> sha256 for this process, even where the cache file cannot be written


def default_cache_dir() -> Path:
    return Path.home() / ".cache" / "moestream"


def sha256_file(path: Path, *, bar=None) -> str:
    """The file's sha256, read 8 MiB at a time (`bar`: a tqdm told each block's bytes)."""
    digest = hashlib.sha256()
    with open(path, "rb") as fh:
        while block := fh.read(8 << 20):
            digest.update(block)
            if bar is not None:
                bar.update(len(block))
    return digest.hexdigest()


@dataclass
class ResidentCheck:
    files: int = 0  # resident files checked
    hashed: int = 0  # of those, hashed now (the others matched a remembered digest)
    bytes_hashed: int = 0


class DigestCache:
    """Digests remembered against file identities, in one JSON file; a broken or unwritable cache
    only costs time (the files are hashed again), never a wrong result."""

    def __init__(self, directory: Path | None):
        self.path = None if directory is None else Path(directory) / CACHE_FILE

    def _load(self) -> dict:
        if self.path is None:
            return {}
        try:
            obj = json.loads(self.path.read_text())
        except (OSError, ValueError) as exc:
            if not isinstance(exc, FileNotFoundError):
                log.debug("ignoring the digest cache %s: %s", self.path, exc)
            return {}
        if not isinstance(obj, dict) or obj.get("version") != CACHE_VERSION or not isinstance(obj.get("files"), dict):
            return {}
        return obj["files"]

    def lookup(self, identity: list) -> str | None:
        if tuple(identity) in _memo:
            return _memo[tuple(identity)]
        entry = self._load().get(identity[0])
        if isinstance(entry, dict) and entry.get("identity") == identity and isinstance(entry.get("sha256"), str):
            return entry["sha256"]
        return None

    def store(self, found: dict[str, tuple[list, str]]) -> None:
        """Remember {path: (identity, sha256)}; written atomically (temp file, then rename)."""
        if not found:
            return
        with _lock:
            for identity, sha in found.values():
                _memo[tuple(identity)] = sha
            if self.path is None:
                return
            files = self._load()
            for key, (identity, sha) in found.items():
                files[key] = {"identity": identity, "sha256": sha}
            try:
                self.path.parent.mkdir(parents=True, exist_ok=True)
                fd, tmp = tempfile.mkstemp(dir=self.path.parent, prefix=CACHE_FILE, suffix=".tmp")
                with os.fdopen(fd, "w") as fh:
                    json.dump({"version": CACHE_VERSION, "files": files}, fh)
                os.replace(tmp, self.path)
            except OSError as exc:
                log.info("could not remember file digests in %s (%s); the next start hashes them again", self.path, exc)


def check_resident_files(directory: str | os.PathLike, manifest: Manifest, *,
                         cache_dir: str | os.PathLike | None = None) -> ResidentCheck:
    """Raise FormatError naming the first resident file whose sha256 differs from the manifest's.

    ``cache_dir``: where digests are remembered (default ``~/.cache/moestream``); a file whose
    identity matches a remembered digest is not read again."""
    directory = Path(directory)
    cache = DigestCache(Path(cache_dir) if cache_dir is not None else default_cache_dir())
    report, found = ResidentCheck(), {}
    experts = {e.file for e in manifest.expert_layers}
    for name in [name for name in manifest.files if name not in experts]:  # the manifest has every one's sha256
        path = directory / name
        try:
            st = path.stat()  # what says the file has not changed since it was hashed
            identity = [str(path.resolve()), st.st_size, st.st_mtime_ns, st.st_ino]
            sha = cache.lookup(identity)
            if sha is None:
                sha = sha256_file(path)
                report.hashed += 1
                report.bytes_hashed += identity[1]
                found[identity[0]] = (identity, sha)
        except OSError as exc:
            raise FormatError(f"{path}: cannot be read ({exc.strerror or exc})") from None
        if sha != manifest.files[name]["sha256"]:
            raise FormatError(f"{path}: sha256 differs from the manifest (the file is corrupt or was changed; "
                              f"`moestream verify {directory}` checks every file)")
        report.files += 1
    cache.store(found)
    return report
