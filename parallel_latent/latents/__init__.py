"""Latent datasets: a whole corpus encoded by a trained autoencoder into shards that a downstream
trainer memory-maps, and reading them back.

:func:`export_latents` (behind :func:`parallel_latent.api.encode_corpus` and ``parallel-latent
encode-corpus``) writes an export directory (:mod:`.format` lists its files) and continues one that
was stopped; :func:`open_latents` reads it.

- :mod:`.format`: the files, the errors, the index;
- :mod:`.plan`: what an export does, and what an output directory holds, checked before any work;
- :mod:`.writer`: the shard writer thread;
- :mod:`.export`: the distributed, resumable export;
- :mod:`.reader`: :class:`LatentDataset`, memory-mapped.
"""

from .export import export_latents, remove_work_files
from .format import (
    FORMAT,
    FORMAT_VERSION,
    INDEX_FILE,
    PAUSE_IN_SHARD_ENV,
    PAUSE_MARKER,
    WORK_DIR,
    ExportError,
    ExportWriteError,
)
from .plan import ExportPlan, output_state, plan_export
from .reader import LatentDataset, index_summary, open_latents

__all__ = [
    "FORMAT",
    "FORMAT_VERSION",
    "INDEX_FILE",
    "PAUSE_IN_SHARD_ENV",
    "PAUSE_MARKER",
    "WORK_DIR",
    "ExportError",
    "ExportPlan",
    "ExportWriteError",
    "LatentDataset",
    "export_latents",
    "index_summary",
    "open_latents",
    "output_state",
    "plan_export",
    "remove_work_files",
]
