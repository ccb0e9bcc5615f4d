"""Every collective the checkpoint code calls waits on the gloo control group, never on the group
the training collectives use (NCCL on GPUs, whose watchdog would kill a job whose rank 0 spends
longer than its timeout publishing, pruning or converting on a slow file system).

Observed on 4 real gloo ranks: torch.distributed's collectives are wrapped to record the group of
every call made from this project's code during a save (with portable weights), a standalone
portable export, a resume at the same layout and a resume at another one (which converts to the
universal state). DeepSpeed's own calls inside its save and load are recorded apart: they are
DeepSpeed's, on its groups."""

from __future__ import annotations

import inspect
import sys

import pytest
import torch.distributed as dist

from parallel_latent.checkpoint import load_training_checkpoint, save_portable, save_training_checkpoint
from parallel_latent.parallel import get_parallel_state
from tests.helpers.checkpoint_engines import make_engine, train_step

COLLECTIVES = (
    "barrier",
    "broadcast",
    "broadcast_object_list",
    "all_reduce",
    "all_gather",
    "all_gather_object",
    "all_gather_into_tensor",
    "gather_object",
    "scatter_object_list",
    "reduce_scatter_tensor",
    "monitored_barrier",
)


class Recorder:
    """Wraps torch.distributed's collectives; records (function, calling module, group name)."""

    def __init__(self):
        self.calls: list[tuple[str, str, str]] = []
        self.originals = {name: getattr(dist, name) for name in COLLECTIVES}

    def _wrap(self, name, function):
        signature = inspect.signature(function)

        def call(*args, **kwargs):
            caller = sys._getframe(1).f_globals.get("__name__", "?")
            group = signature.bind(*args, **kwargs).arguments.get("group")
            state = get_parallel_state()
            named = {id(state.control_group): "control", id(state.tp_group): "tp", id(state.dp_group): "dp"}
            self.calls.append((name, caller, named.get(id(group), "default" if group is None else "other")))
            return function(*args, **kwargs)

        return call

    def __enter__(self):
        for name, function in self.originals.items():
            setattr(dist, name, self._wrap(name, function))
        return self

    def __exit__(self, *exc):
        for name, function in self.originals.items():
            setattr(dist, name, function)


def checkpoint_path_task(directory: str):
    engine, model = make_engine(2, 2)
    train_step(engine, model, 0)
    with Recorder() as recorder:
        save_training_checkpoint(engine, directory, 1, {"next_step": 1}, export_portable=True)
        save_portable(model, f"{directory}/portable", step=1)
        load_training_checkpoint(engine, directory)
    engine, model = make_engine(1, 1)  # another layout: the universal state is made by rank 0
    with Recorder() as resharded:
        loaded = load_training_checkpoint(engine, directory)
    assert loaded.resharded
    return recorder.calls + resharded.calls


@pytest.mark.slow
def test_checkpoint_collectives_use_the_control_group(pool4, tmp_path):
    for calls in pool4.run(checkpoint_path_task, str(tmp_path)):
        ours = {(name, group) for name, caller, group in calls if caller.startswith("parallel_latent")}
        # What the checkpoint code waits on: shard records, the publish outcome, the conversion.
        assert {("all_gather_object", "control"), ("broadcast_object_list", "control")} <= ours
        assert {group for _, group in ours} == {"control"}, sorted(ours)
        # The recorder sees DeepSpeed's own collectives too (its save's barriers): not ours to move.
        assert any(caller.startswith("deepspeed") for _, caller, _ in calls)
