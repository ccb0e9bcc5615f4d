"""The held-out split and the DP-sharded, resumable batch order: both lazy, O(1) memory per rank."""

from __future__ import annotations

import math
from collections.abc import Iterator

import numpy as np

from parallel_latent.data.permutation import KeyedPermutation, derive_key
from parallel_latent.errors import DataError

__all__ = ["HeldOutSplit", "ShardedBatchSampler", "held_out_size"]

# The held-out split depends on nothing but the number of samples: not on training.seed, TP or DP,
# so runs with different seeds or layouts are evaluated on the same samples.
SPLIT_KEY = derive_key("parallel-latent held-out split", 1)
# Recorded in the sampler's state: a checkpoint written with another order scheme resumes at the
# same position but not with the same samples.
ORDER_SCHEME = "feistel-1"


def held_out_size(num_samples: int, eval_fraction: float, min_eval_samples: int, source: str = "<data>") -> int:
    """``max(min_eval_samples, ceil(eval_fraction * num_samples))`` (0 when both are 0); DataError if
    that leaves nothing to train on."""
    num_eval = max(min_eval_samples, math.ceil(eval_fraction * num_samples - 1e-9))
    if num_eval >= num_samples:
        raise DataError(
            f"{source}: corpus of {num_samples} samples is too small to hold out "
            f"{num_eval} for evaluation and still train (data.eval_fraction={eval_fraction}, "
            f"data.min_eval_samples={min_eval_samples})"
        )
    return num_eval


class HeldOutSplit:
    """Samples ``[0, n)`` in a fixed pseudo-random order: the first ``num_eval`` of it are held out,
    the rest train. ``held_out_rows(i)`` / ``train_rows(i)`` map split-local indices to samples."""

    def __init__(self, num_samples: int, eval_fraction: float, min_eval_samples: int, source: str = "<data>"):
        self.num_samples = num_samples
        self.num_eval = held_out_size(num_samples, eval_fraction, min_eval_samples, source)
        self.num_train = num_samples - self.num_eval
        self._order = KeyedPermutation(num_samples, SPLIT_KEY)

    def held_out_rows(self, indices) -> np.ndarray:
        indices = np.asarray(indices, dtype=np.int64)
        if indices.size and (indices.min() < 0 or indices.max() >= self.num_eval):
            raise IndexError(f"held-out index outside [0, {self.num_eval})")
        return self._order(indices)

    def train_rows(self, indices) -> np.ndarray:
        indices = np.asarray(indices, dtype=np.int64)
        if indices.size and (indices.min() < 0 or indices.max() >= self.num_train):
            raise IndexError(f"train index outside [0, {self.num_train})")
        return self._order(indices + self.num_eval)


class ShardedBatchSampler:
    """Micro-batches of sample indices for one data-parallel rank, over endless epochs.

    Epoch ``e`` orders the samples by a keyed bijection of ``[0, num_samples)`` (key: ``seed`` and
    ``e``; identity order when ``shuffle`` is false), computed per batch, never materialised.  That
    order is cut into global batches of ``batch_size * dp_size * grad_accum`` samples (one optimizer
    step), each into ``grad_accum`` micro-steps of ``batch_size * dp_size``, and DP rank ``r`` takes
    the ``r``-th slice of ``batch_size`` from each micro-step. Consequences:

    - DP ranks get disjoint indices; ranks with the same ``dp_rank`` (the
      tensor-parallel group of a replica) get identical batches;
    - the sequence of global batches depends only on ``seed`` and the global batch
      size, not on how it is split over DP ranks, micro-batches and accumulation steps
      (the tail an epoch drops is counted in global batches too);
    - with ``drop_last`` the incomplete tail of an epoch is skipped; without it the
      tail is filled up by wrapping around to the start of the epoch's order, so all
      ranks always take the same number of equal-sized batches.

    The position (epoch, micro-batches consumed in it) advances as batches are handed
    out; :meth:`state_dict` / :meth:`load_state_dict` resume exactly there, also under
    another split of the same global batch (at an optimizer-step boundary).
    Iterating the object yields the rest of the current epoch (usable as a
    DataLoader ``batch_sampler``); :meth:`iter_batches` never ends.
    """

    def __init__(
        self,
        num_samples: int,
        batch_size: int,
        dp_rank: int = 0,
        dp_size: int = 1,
        seed: int = 0,
        drop_last: bool = True,
        shuffle: bool = True,
        grad_accum: int = 1,
    ):
        if batch_size < 1 or dp_size < 1 or grad_accum < 1 or not 0 <= dp_rank < dp_size:
            raise ValueError(
                f"invalid sampler layout: batch_size={batch_size}, dp_rank={dp_rank}, dp_size={dp_size}, "
                f"grad_accum={grad_accum}"
            )
        global_batch = batch_size * dp_size * grad_accum
        if num_samples < 1 or (drop_last and num_samples < global_batch):
            accumulated = f" x {grad_accum} accumulated" if grad_accum > 1 else ""
            raise DataError(
                f"sampler: {num_samples} samples cannot fill one global batch of "
                f"{batch_size} x {dp_size} data-parallel ranks{accumulated} = {global_batch}"
            )
        self.num_samples = num_samples
        self.batch_size = batch_size
        self.dp_rank = dp_rank
        self.dp_size = dp_size
        self.grad_accum = grad_accum
        self.seed = seed
        self.drop_last = drop_last
        self.shuffle = shuffle
        self.epoch = 0
        self.batches_consumed = 0  # this rank's micro-batches, in the current epoch
        self._order_epoch: int | None = None
        self._order: KeyedPermutation | None = None

    @property
    def global_batch_size(self) -> int:
        """Samples of one optimizer step, over all DP ranks and accumulated micro-batches."""
        return self.batch_size * self.dp_size * self.grad_accum

    @property
    def batches_per_epoch(self) -> int:
        """This rank's micro-batches per epoch (whole optimizer steps)."""
        rounding = math.floor if self.drop_last else math.ceil
        return rounding(self.num_samples / self.global_batch_size) * self.grad_accum

    def __len__(self) -> int:
        return self.batches_per_epoch

    def epoch_order(self, epoch: int, positions) -> np.ndarray:
        """The samples at ``positions`` of ``epoch``'s order (int64 array)."""
        positions = np.asarray(positions, dtype=np.int64)
        if not self.shuffle:
            return positions
        if self._order_epoch != epoch:
            self._order = KeyedPermutation(self.num_samples, derive_key("epoch order", self.seed, epoch))
            self._order_epoch = epoch
        return self._order(positions)

    def batch_at(self, epoch: int, batch_index: int) -> list[int]:
        """This rank's batch number ``batch_index`` of ``epoch`` (pure: no state change)."""
        if not 0 <= batch_index < self.batches_per_epoch:
            raise IndexError(f"batch {batch_index} outside an epoch of {self.batches_per_epoch}")
        start = (batch_index * self.dp_size + self.dp_rank) * self.batch_size
        # Past the end (drop_last=False) the order wraps around to its start.
        positions = np.arange(start, start + self.batch_size, dtype=np.int64) % self.num_samples
        return self.epoch_order(epoch, positions).tolist()

    def global_batch_at(self, epoch: int, batch_index: int) -> np.ndarray:
        """Every DP rank's batch number ``batch_index`` of ``epoch``, rank after rank (pure): what
        the whole data-parallel group reads in that micro-step, e.g. to count its tokens locally."""
        if not 0 <= batch_index < self.batches_per_epoch:
            raise IndexError(f"batch {batch_index} outside an epoch of {self.batches_per_epoch}")
        micro_step = self.batch_size * self.dp_size
        start = batch_index * micro_step
        positions = np.arange(start, start + micro_step, dtype=np.int64) % self.num_samples
        return self.epoch_order(epoch, positions)

    def epoch_batches(self, epoch: int) -> list[list[int]]:
        """All of this rank's batches of ``epoch`` (pure: no state change)."""
        return [self.batch_at(epoch, index) for index in range(self.batches_per_epoch)]

    # -- position ---------------------------------------------------------- #

    def set_position(self, epoch: int, offset: int = 0) -> None:
        """Continue from batch ``offset`` of ``epoch``."""
        if epoch < 0 or not 0 <= offset <= self.batches_per_epoch:
            raise ValueError(
                f"sampler position epoch={epoch}, offset={offset} outside an epoch of {self.batches_per_epoch} batches"
            )
        self.epoch, self.batches_consumed = epoch, offset

    def set_epoch(self, epoch: int) -> None:
        """torch DistributedSampler-style: start ``epoch`` from its first batch."""
        self.set_position(epoch, 0)

    def next_position(self) -> tuple[int, int]:
        """(epoch, batch index) of the batch :meth:`next_batch` hands out next (no state change)."""
        if self.batches_consumed >= self.batches_per_epoch:
            return self.epoch + 1, 0
        return self.epoch, self.batches_consumed

    def advance(self, batches: int = 1) -> None:
        """Move past ``batches`` batches without computing them (a reader ahead of us did)."""
        for _ in range(batches):
            self.epoch, self.batches_consumed = self.next_position()
            self.batches_consumed += 1

    def next_batch(self) -> list[int]:
        epoch, index = self.next_position()
        batch = self.batch_at(epoch, index)
        self.epoch, self.batches_consumed = epoch, index + 1  # before handing it out, so state_dict() counts it
        return batch

    def __iter__(self) -> Iterator[list[int]]:
        """The remaining batches of the current epoch (all of the next one if the
        current is finished)."""
        if self.batches_consumed >= self.batches_per_epoch:
            self.epoch, self.batches_consumed = self.epoch + 1, 0
        while self.batches_consumed < self.batches_per_epoch:
            yield self.next_batch()

    def iter_batches(self) -> Iterator[list[int]]:
        """Batches without end, epoch after epoch, from the current position."""
        while True:
            yield self.next_batch()

    # -- checkpointing ------------------------------------------------------ #

    def state_dict(self) -> dict[str, int | str]:
        return {
            "epoch": self.epoch,
            "batches_consumed": self.batches_consumed,
            "grad_accum": self.grad_accum,
            "seed": self.seed,
            "num_samples": self.num_samples,
            "global_batch_size": self.global_batch_size,
            "order": ORDER_SCHEME,
        }

    def load_state_dict(self, state: dict[str, int | str]) -> None:
        """Resume at a saved position.  The saved run may have split the same global batch
        differently over DP ranks, micro-batches and accumulation steps; it must have had the same
        data, seed and global batch size, or the continuation would not be the same sequence."""
        for key in ("seed", "num_samples", "global_batch_size"):
            if key in state and int(state[key]) != getattr(self, key):
                raise ValueError(
                    f"sampler state has {key}={state[key]} but this sampler has "
                    f"{key}={getattr(self, key)}: cannot resume the same batch sequence"
                )
        # Micro-batches consumed -> whole optimizer steps -> this split's micro-batches.
        saved_accum, consumed = int(state.get("grad_accum", 1)), int(state["batches_consumed"])
        if consumed % saved_accum:
            raise ValueError(f"sampler state is inside an optimizer step ({consumed} of {saved_accum} micro-batches)")
        self.set_position(int(state["epoch"]), consumed // saved_accum * self.grad_accum)
