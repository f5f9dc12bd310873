"""The Hugging Face Hub: a checkpoint fetched into the Hub's cache for `convert` (config, shards and
tokenizer files only), and for `moestream pull` a repository's files at one commit, their
safetensors headers (read with byte ranges, no weights) and downloads of one file at a time into a
folder of ours.

Every Hub failure becomes a one-line HubError naming the repository; a pull resolves the commit
once and every later request asks for it, so a branch that moves during a pull changes nothing."""
from __future__ import annotations

import contextlib
import errno
import json
import logging
import re
from dataclasses import dataclass
from pathlib import Path

from moestream.errors import MoestreamError
from moestream.format.safetensors_io import ITEMSIZE, TensorInfo

log = logging.getLogger(__name__)

REPO_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")
COMMIT = re.compile(r"^[0-9a-f]{40}$")
METADATA_PATTERNS = ["config.json", "generation_config.json", "*.safetensors.index.json", "tokenizer*", "vocab.json",
                     "merges.txt", "special_tokens_map.json", "added_tokens.json", "chat_template*"]
INDEX_NAME = "model.safetensors.index.json"


class HubError(MoestreamError):
    """A Hub repository that cannot be found or downloaded."""


def looks_like_repo_id(src: str) -> bool:
    return bool(REPO_ID.match(src)) and ".." not in src


def _is_network_error(exc: BaseException) -> bool:
    """Connection failures surface as the HTTP client's own exceptions (httpx and its relatives)."""
    return isinstance(exc, ConnectionError) or type(exc).__module__.split(".")[0] in ("httpx", "httpx2", "httpcore")


@contextlib.contextmanager
def hub_errors(repo_id: str, revision: str | None, what: str = "download", *, local: bool = False):
    """Every Hub failure as one HubError line naming the repository. local: SRC could also have been
    a local folder (convert), which the messages say."""
    from huggingface_hub import errors as hf

    where = repo_id if revision is None else f"{repo_id}@{revision}"
    no_folder = "no such local folder, and " if local else ""
    try:
        yield
    except hf.OfflineModeIsEnabled:
        raise HubError(f"{where}: HF_HUB_OFFLINE is set, and pulling needs the Hub (unset it, or convert a local folder)") from None
    except hf.GatedRepoError:
        raise HubError(f"{where}: the repository is gated; accept its terms on the Hub and log in (hf auth login)") from None
    except hf.RepositoryNotFoundError:
        raise HubError(f"{repo_id}: {no_folder}no such repository on the Hugging Face Hub "
                       "(or it is private: log in with hf auth login)") from None
    except hf.RevisionNotFoundError:
        raise HubError(f"{repo_id}: revision {revision!r} not found on the Hugging Face Hub") from None
    except hf.LocalEntryNotFoundError:
        if local:
            raise HubError(f"{where}: not a local folder, not in the Hugging Face cache, and the Hub cannot be reached "
                           "(offline, or HF_HUB_OFFLINE is set)") from None
        raise HubError(f"{where}: the Hugging Face Hub cannot be reached (offline?)") from None
    except hf.HFValidationError:
        raise HubError(f"{repo_id}: {no_folder}not a valid Hugging Face repo id") from None
    except hf.HfHubHTTPError as exc:
        raise HubError(f"{where}: {what} from the Hugging Face Hub failed ({str(exc).splitlines()[0]})") from None
    except OSError as exc:
        if exc.errno in (errno.ENOSPC, errno.EDQUOT):
            raise HubError(f"{where}: no space left on device downloading it") from None
        if local:
            raise HubError(f"{where}: download failed ({exc.strerror or exc})") from None
        if isinstance(exc, ConnectionError):
            raise HubError(f"{where}: the Hugging Face Hub cannot be reached ({exc})") from None
        raise
    except Exception as exc:
        if _is_network_error(exc):
            raise HubError(f"{where}: the Hugging Face Hub cannot be reached ({type(exc).__name__}: "
                           f"{str(exc).splitlines()[0] if str(exc) else 'no answer'})") from None
        raise


def download(repo_id: str, revision: str | None = None) -> tuple[Path, dict]:
    """Download (or find in the cache) what a conversion reads; returns the snapshot folder and its origin."""
    from huggingface_hub import snapshot_download

    where = repo_id if revision is None else f"{repo_id}@{revision}"
    with hub_errors(repo_id, revision, local=True):
        # First the small files, to learn which shards the index names (repos may hold other weight copies).
        folder = Path(snapshot_download(repo_id, revision=revision, allow_patterns=METADATA_PATTERNS))
        commit = folder.name if COMMIT.match(folder.name) else revision
        shards = ["*.safetensors"]
        if (folder / INDEX_NAME).is_file():
            try:
                shards = sorted(set(json.loads((folder / INDEX_NAME).read_text())["weight_map"].values()))
            except (json.JSONDecodeError, KeyError, TypeError, AttributeError):
                raise HubError(f"{where}: {INDEX_NAME} is not a valid shard index") from None
        log.info("downloading %s (%s)", repo_id, commit)
        folder = Path(snapshot_download(repo_id, revision=commit or revision, allow_patterns=METADATA_PATTERNS + shards))
    commit = folder.name if COMMIT.match(folder.name) else (commit or revision)
    return folder, {"repo": repo_id, "revision": commit, "requested_revision": revision or "main"}


def blob_sha256(path: Path) -> str | None:
    """The Hub cache names large-file blobs by their sha256: free hashes for downloaded shards."""
    try:
        target = path.resolve()
    except OSError:
        return None
    if target != path.absolute() and re.fullmatch(r"[0-9a-f]{64}", target.name):
        return target.name
    return None


@dataclass(frozen=True)
class RemoteFile:
    name: str
    size: int
    sha256: str | None  # the LFS object id, which is the content's sha256; None for small git files


def forwarding_bar(bar):
    """A tqdm class for huggingface_hub's per-file bars that adds their bytes to our one bar."""
    from tqdm import tqdm

    class Forward(tqdm):
        def __init__(self, *args, **kwargs):
            kwargs["disable"] = True
            super().__init__(*args, **kwargs)

        def update(self, n=1):
            if bar is not None and n:
                bar.update(n)

    return Forward


class HubRepo:
    """One repository at one commit, with the size and sha256 of every file."""

    def __init__(self, repo_id: str, revision: str | None = None, *, endpoint: str | None = None,
                 requested: str | None = None):
        from huggingface_hub import HfApi, constants

        self.repo_id, self.requested = repo_id, requested or revision
        self.endpoint = endpoint
        if constants.HF_HUB_OFFLINE:
            raise HubError(f"{repo_id}: HF_HUB_OFFLINE is set, and pulling needs the Hub (unset it, or convert a local folder)")
        self.api = HfApi(endpoint=endpoint)
        with hub_errors(repo_id, revision, "model info"):
            info = self.api.model_info(repo_id, revision=revision, files_metadata=True)
        self.commit: str = info.sha or revision or "main"
        self.files = {s.rfilename: RemoteFile(s.rfilename, int(s.size or 0), s.lfs.sha256 if s.lfs else None)
                      for s in info.siblings or []}

    @property
    def origin(self) -> dict:
        return {"repo": self.repo_id, "revision": self.commit, "requested_revision": self.requested or "main"}

    def header(self, name: str) -> dict[str, TensorInfo]:
        """A shard's tensors from its header alone (byte-range reads)."""
        from huggingface_hub import errors as hf

        with hub_errors(self.repo_id, self.commit, f"reading the header of {name}"):
            try:
                meta = self.api.parse_safetensors_file_metadata(self.repo_id, name, revision=self.commit)
            except hf.SafetensorsParsingError as exc:
                raise HubError(f"{self.repo_id}: {name} is not a valid safetensors file ({exc})") from None
        out = {}
        for tname, t in meta.tensors.items():
            if t.dtype not in ITEMSIZE:
                raise HubError(f"{self.repo_id}: {name}: tensor {tname} has dtype {t.dtype}, which is not read")
            begin, end = t.data_offsets
            out[tname] = TensorInfo(tname, t.dtype, tuple(t.shape), -1, end - begin)
        return out

    def download(self, name: str, folder: Path, *, bar=None) -> Path:
        """One file into `folder` (a partial file left by a killed run is resumed); its path."""
        from huggingface_hub import hf_hub_download

        with hub_errors(self.repo_id, self.commit, f"downloading {name}"):
            return Path(hf_hub_download(self.repo_id, name, revision=self.commit, local_dir=folder,
                                        endpoint=self.endpoint, tqdm_class=forwarding_bar(bar)))
