"""Fetch a checkpoint from the Hugging Face Hub: config, shards and tokenizer files only."""
from __future__ import annotations

import contextlib
import errno
import json
import logging
import re
from pathlib import Path

from moestream.errors import MoestreamError

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
