"""The next optimizer step's batches, read while the current step runs.

A background thread walks its own copy of the sampler: it reads the micro-batches of the next step
from the memory-mapped copy, pins them when the device is a GPU (so the copy to the device can run
without blocking the host), and counts the step's tokens over the whole data-parallel group from
the memory-mapped lengths (every rank knows every rank's samples: the sampler is a keyed
permutation). The trainer's own sampler only advances its position, so checkpoints record where
training is, not where the reader is.
"""

from __future__ import annotations

import copy
import queue
import threading
from dataclasses import dataclass

import torch

from parallel_latent.data.prepared import get_batch, token_count
from parallel_latent.data.sampler import ShardedBatchSampler

__all__ = ["BatchPrefetcher", "StepBatches", "to_device"]


@dataclass
class StepBatches:
    position: tuple[int, int]  # the sampler's (epoch, batches consumed) before this step
    micro_batches: list[dict[str, torch.Tensor]]  # this rank's, on the host (pinned for a GPU)
    global_tokens: int  # non-pad tokens of the step's global batch (all DP ranks, all micro-steps)


class BatchPrefetcher:
    """Steps of ``grad_accum`` micro-batches, one step ahead of the consumer (a queue of one)."""

    def __init__(self, dataset, sampler: ShardedBatchSampler, grad_accum: int, pin_memory: bool):
        self.dataset, self.grad_accum, self.pin_memory = dataset, grad_accum, pin_memory
        self._sampler = copy.deepcopy(sampler)
        self._queue: queue.Queue = queue.Queue(maxsize=1)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="batch-prefetch", daemon=True)
        self._thread.start()

    def _read_step(self) -> StepBatches:
        sampler = self._sampler
        position = (sampler.epoch, sampler.batches_consumed)
        micro_batches, tokens = [], 0
        for _ in range(self.grad_accum):
            epoch, index = sampler.next_position()
            tokens += token_count(self.dataset, sampler.global_batch_at(epoch, index))
            batch = get_batch(self.dataset, sampler.next_batch())
            if self.pin_memory:
                batch = {key: value.pin_memory() for key, value in batch.items()}
            micro_batches.append(batch)
        return StepBatches(position, micro_batches, tokens)

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                item = self._read_step()
            except BaseException as error:  # handed to the consumer, raised there
                item = error
            while not self._stop.is_set():
                try:
                    self._queue.put(item, timeout=0.1)
                    break
                except queue.Full:
                    continue
            if isinstance(item, BaseException):
                return

    def next(self) -> StepBatches:
        item = self._queue.get()
        if isinstance(item, BaseException):
            raise item
        return item

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)


def to_device(
    batch: dict[str, torch.Tensor], device: torch.device
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """A batch's ids, mask and features (those of the feature cache, or None: the model computes
    them) on ``device``. Pinned host memory (the prefetcher's, on a GPU) copies without blocking the host."""
    features = batch.get("features")
    return (
        batch["input_ids"].to(device, non_blocking=True),
        batch["attention_mask"].to(device, non_blocking=True),
        None if features is None else features.to(device, non_blocking=True),
    )
