"""A pretrained directory shared through the Hugging Face hub: found by path or downloaded by
repository id (once per node), and pushed. The hub is reached through
:mod:`parallel_latent.feature_model.hub` (``huggingface_hub``'s snapshot download and folder upload);
its ``ModelHubMixin`` is not used: its ``save_pretrained`` writes straight
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
from parallel_latent.feature_model.hub import download_snapshot, hub_repo_id, push_folder

from .directory import CONFIG_FILE, LIBRARY, PRETRAINED_FORMAT, read_pretrained_config
from .save import save_pretrained

__all__ = ["hub_repo_id", "pretrained_directory", "push_directory_to_hub", "push_to_hub"]


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
        directory = download_snapshot(
            repo_id, revision=revision, cache_dir=cache_dir, token=token, local_files_only=not first, library=LIBRARY
        )
    if read_pretrained_config(directory) is None:
        raise CheckpointError(f"{repo_id}: not a parallel-latent model (no {PRETRAINED_FORMAT} {CONFIG_FILE})")
    return directory


def push_directory_to_hub(
    directory: str | Path, repo_id: str, *, private: bool | None = None, token=None, revision=None, message=None
) -> str:
    """Upload a pretrained directory as it is to the hub repository ``repo_id`` (created if
    needed); returns the commit's URL. One process."""
    directory = Path(directory)
    if read_pretrained_config(directory) is None:
        raise CheckpointError(f"{directory}: not a pretrained directory (write one with save-pretrained)")
    message = message or f"Upload {LIBRARY} autoencoder"
    return push_folder(directory, repo_id, private=private, token=token, revision=revision, message=message)


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
