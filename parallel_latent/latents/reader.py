"""Reading a latent dataset: :func:`open_latents` memory-maps a complete export's shards; nothing is
read until indexed, and only the rows asked for are copied out.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

from parallel_latent.errors import os_reason

from .format import FORMAT, INDEX_FILE, READABLE_VERSIONS, ExportError, read_json

__all__ = ["LatentDataset", "index_summary", "open_latents"]


class LatentDataset:
    """A latent dataset, memory-mapped: ``len()`` samples; ``dataset[i]`` (or a slice, or a sequence
    of indices) gives ``{"latents", "attention_mask", "index", "num_tokens", "truncated"}`` as torch
    tensors (latents float32, or bfloat16 for a bf16 export). The shards are memory-mapped: nothing
    is read until indexed, and only the rows asked for are copied out (tensors torch may write)."""

    def __init__(self, directory: Path, index: dict):
        import pyarrow as pa

        self.directory, self.index = directory, index
        self.latent_shape = tuple(index["latents"]["shape"])
        self.max_length = int(index["corpus"]["max_length"])
        self.bfloat16 = index["latents"]["dtype"] == "bfloat16"
        self._tables = []
        for shard in index["shards"]:
            path = directory / shard["file"]
            try:
                size = path.stat().st_size
            except OSError as error:
                raise ExportError(f"{path}: shard missing ({os_reason(error)})") from None
            if size != shard["bytes"]:
                raise ExportError(f"{path}: {size} bytes, the index says {shard['bytes']} (damaged)")
            self._tables.append(pa.ipc.open_stream(pa.memory_map(str(path))).read_all())
        self._starts = np.asarray([s["first"] for s in index["shards"]] + [index["num_samples"]], dtype=np.int64)

    def __len__(self) -> int:
        return int(self.index["num_samples"])

    @property
    def mean(self) -> torch.Tensor:
        return torch.tensor(self.index["statistics"]["mean"], dtype=torch.float32)

    @property
    def std(self) -> torch.Tensor:
        return torch.tensor(self.index["statistics"]["std"], dtype=torch.float32)

    def _rows(self, table, rows: np.ndarray) -> dict[str, np.ndarray]:
        consecutive = len(rows) > 0 and bool((np.diff(rows) == 1).all())
        picked = table.slice(int(rows[0]), len(rows)) if consecutive else table.take(rows)
        length, width = self.latent_shape
        latents = picked.column("latents").combine_chunks().flatten().flatten().to_numpy(zero_copy_only=False)
        mask = picked.column("attention_mask").combine_chunks().flatten().to_numpy(zero_copy_only=False)
        return {
            "latents": latents.reshape(len(rows), length, width),
            "attention_mask": mask.reshape(len(rows), self.max_length),
            "index": picked.column("index").to_numpy(),
            "num_tokens": picked.column("num_tokens").to_numpy(),
            "truncated": picked.column("truncated").to_numpy(zero_copy_only=False),
        }

    def __getitem__(self, item) -> dict[str, torch.Tensor]:
        if isinstance(item, (int, np.integer)):
            position = int(item) + (len(self) if item < 0 else 0)
            if not 0 <= position < len(self):
                raise IndexError(f"sample {item} outside a latent dataset of {len(self)}")
            return {key: value[0] for key, value in self[[position]].items()}
        positions = np.arange(len(self))[item] if isinstance(item, slice) else np.asarray(item, dtype=np.int64)
        if positions.size and (positions.min() < 0 or positions.max() >= len(self)):
            raise IndexError(f"sample index outside a latent dataset of {len(self)}")
        shards = np.searchsorted(self._starts, positions, side="right") - 1
        parts = []
        for shard in np.unique(shards):
            chosen = np.nonzero(shards == shard)[0]
            parts.append((chosen, self._rows(self._tables[shard], positions[chosen] - self._starts[shard])))
        if not parts:  # nothing asked for: empty columns of the right shapes
            parts.append((positions, self._rows(self._tables[0], positions)))
        columns = {}
        for key in ("latents", "attention_mask", "index", "num_tokens", "truncated"):
            if len(parts) == 1:
                values = parts[0][1][key]  # the positions of one shard, in the order asked for
            else:
                values = np.empty((len(positions), *parts[0][1][key].shape[1:]), dtype=parts[0][1][key].dtype)
                for chosen, part in parts:
                    values[chosen] = part[key]
            columns[key] = values
        latents = torch.from_numpy(np.array(columns["latents"]))
        if self.bfloat16:
            latents = latents.view(torch.int16).view(torch.bfloat16)
        return {
            "latents": latents,
            "attention_mask": torch.from_numpy(np.array(columns["attention_mask"]).astype(np.int64)),
            "index": torch.from_numpy(np.array(columns["index"])),
            "num_tokens": torch.from_numpy(np.array(columns["num_tokens"]).astype(np.int64)),
            "truncated": torch.from_numpy(np.array(columns["truncated"]).astype(bool)),
        }


def open_latents(directory: str | Path) -> LatentDataset:
    """The latent dataset an export wrote into ``directory``, memory-mapped (ExportError, one line,
    if it is not a complete export)."""
    directory = Path(directory)
    path = directory / INDEX_FILE
    if not path.is_file():
        raise ExportError(f"{directory}: not a complete latent export (no {INDEX_FILE})")
    index = read_json(path)
    if index.get("format") != FORMAT or index.get("version") not in READABLE_VERSIONS:
        raise ExportError(
            f"{path}: not a {FORMAT} index of version {' or '.join(map(str, READABLE_VERSIONS))} (format "
            f"{index.get('format')}, version {index.get('version')})"
        )
    return LatentDataset(directory, index)


def index_summary(index: dict) -> str:
    """One line about an export: samples, shape, dtype, shards."""
    shape = "x".join(str(n) for n in index["latents"]["shape"])
    return (
        f"{index['num_samples']:,} samples of {shape} {index['latents']['dtype']} latents "
        f"in {len(index['shards'])} shards"
    )
