"""The Hugging Face hub: a pretrained directory found by path or downloaded by repository id (once
per node), and pushed. Hub access uses ``huggingface_hub``'s functions (``snapshot_download``,
``HfApi.upload_folder``); its ``ModelHubMixin`` is not used: its ``save_pretrained`` writes straight
into the target on every process that calls it (no single writer, no staged publish, and it replaces
files in place), and its ``from_pretrained`` fetches ``config.json`` on every rank before the class
can order the ranks.
"""

from __future__ import annotations

import shutil
import tempfile
from pathlib import Path

from parallel_latent.checkpoint import CheckpointError
from parallel_latent.coordination import barrier, broadcast_value, is_main, main_first
from parallel_latent.errors import first_line

from .directory import CONFIG_FILE, LIBRARY, PRETRAINED_FORMAT, read_pretrained_config
from .save import save_pretrained

__all__ = ["hub_repo_id", "pretrained_directory", "push_directory_to_hub", "push_to_hub"]


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


def _download(repo_id: str, revision: str | None, cache_dir, token, local_files_only: bool) -> Path:
    from huggingface_hub import snapshot_download
    from huggingface_hub.utils import HfHubHTTPError, LocalEntryNotFoundError, RepositoryNotFoundError

    try:
        return Path(
            snapshot_download(
                repo_id,
                revision=revision,
                cache_dir=cache_dir,
                token=token,
                local_files_only=local_files_only,
                library_name=LIBRARY,
            )
        )
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


def pretrained_directory(
    path_or_repo_id: str | Path, *, revision: str | None = None, cache_dir=None, token=None
) -> Path:
    """The local directory of ``path_or_repo_id``: itself if it exists (any directory the
    checkpoint loaders accept), else the hub repository's snapshot in the Hugging Face cache.

    Under a process group the first process of each node downloads and the others then read the
    cache (collective: every rank calls it)."""
    repo_id = hub_repo_id(path_or_repo_id)
    if repo_id is None:
        directory = Path(path_or_repo_id)
        read_pretrained_config(directory)  # a newer format stops here with one line
        return directory
    with main_first(per_node=True) as first:
        directory = _download(repo_id, revision, cache_dir, token, local_files_only=not first)
    if read_pretrained_config(directory) is None:
        raise CheckpointError(f"{repo_id}: not a parallel-latent model (no {PRETRAINED_FORMAT} {CONFIG_FILE})")
    return directory


def push_directory_to_hub(
    directory: str | Path, repo_id: str, *, private: bool | None = None, token=None, revision=None, message=None
) -> str:
    """Upload a pretrained directory as it is to the hub repository ``repo_id`` (created if
    needed); returns the commit's URL. One process."""
    from huggingface_hub import HfApi

    directory = Path(directory)
    if read_pretrained_config(directory) is None:
        raise CheckpointError(f"{directory}: not a pretrained directory (write one with save-pretrained)")
    api = HfApi(token=token)
    try:
        repo = api.create_repo(repo_id, private=private, exist_ok=True)
        commit = api.upload_folder(
            repo_id=repo.repo_id,
            folder_path=directory,
            revision=revision,
            commit_message=message or f"Upload {LIBRARY} autoencoder",
        )
    except Exception as error:  # HTTP status, network (httpx's errors are no OSError), offline, no token
        reason = str(error).splitlines()[0] if str(error) else ""
        raise CheckpointError(
            f"{repo_id}: push to the Hugging Face hub failed: {type(error).__name__}: {reason}"
        ) from None
    return str(getattr(commit, "commit_url", commit))


def push_to_hub(autoencoder, repo_id: str, *, private: bool | None = None, token=None, revision=None, message=None):
    """``save_pretrained`` into a temporary directory, then upload it to ``repo_id``. Collective
    under a process group (as ``save_pretrained``); global rank 0 uploads. Returns the commit URL
    on every rank."""
    scratch = broadcast_value(tempfile.mkdtemp(prefix="parallel-latent-push-") if is_main() else None)
    url, failure = None, None
    try:
        folder = save_pretrained(autoencoder, Path(scratch) / repo_id.replace("/", "--"), repo_id=repo_id)
        if is_main():
            try:
                url = push_directory_to_hub(
                    folder, repo_id, private=private, token=token, revision=revision, message=message
                )
            except CheckpointError as error:
                failure = error
    finally:
        barrier()
        if is_main():
            shutil.rmtree(scratch, ignore_errors=True)
    url, message_line = broadcast_value((url, None if failure is None else str(failure)))
    if failure is not None:
        raise failure
    if message_line is not None:
        raise CheckpointError(message_line)
    return url
