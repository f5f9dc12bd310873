"""The Hub side of `moestream pull`: a repository's files at one commit, their safetensors headers
(read with byte ranges, no weights), and downloads of one file at a time into a folder of ours.

Every Hub failure becomes a one-line HubError naming the repository; the commit is resolved once
and every later request asks for it, so a branch that moves during a pull changes nothing."""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from moestream.convert.hub import HubError, hub_errors
from moestream.format.safetensors_io import ITEMSIZE, TensorInfo


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
