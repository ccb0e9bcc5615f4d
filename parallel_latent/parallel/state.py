"""Process groups for world = TP x DP, and the ``mpu`` object DeepSpeed expects.

This registry is the one piece of global mutable state in the project. TP groups are consecutive
ranks (so they stay inside a node, where bandwidth is highest); DP groups take one rank of each
TP group. Layers never read it: they receive their ``tp_group`` explicitly. Who the ranks are and
the store where they meet are the caller's to say (:func:`init_distributed`); nothing here parses a
launcher's environment.
"""

from __future__ import annotations

import datetime
import os
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist

from parallel_latent.errors import BadInput


@dataclass(frozen=True)
class ParallelState:
    rank: int
    world_size: int
    local_rank: int
    tp_size: int
    tp_rank: int
    dp_size: int
    dp_rank: int
    tp_ranks: tuple[int, ...]
    dp_ranks: tuple[int, ...]
    tp_group: object
    dp_group: object
    backend: str
    device: torch.device
    # Host-side coordination (stop votes, barriers while a corpus is prepared, agreeing on what to
    # resume) goes over gloo: CPU tensors, no wait on the GPU stream, no NCCL watchdog on long waits.
    control_group: object = None
    local_world_size: int | None = None  # processes on this node, when the launcher says


_STATE: ParallelState | None = None


def select_device_index(local_rank: int, device_count: int) -> int:
    """The one CUDA device this process uses, chosen once (DeepSpeed is then told the same index):

    * one device visible (``srun --gpus-per-task=1`` binds each task to its GPU through
      CUDA_VISIBLE_DEVICES, or a mask set by hand): that device, whatever the local rank;
    * several visible (torchrun, the deepspeed launcher, ``srun`` with all of a node's GPUs per
      task): the local rank's, which must exist; two ranks on one GPU are refused, not wrapped.
    """
    if device_count < 1:
        raise RuntimeError("no CUDA device is visible to this process")
    if device_count == 1:
        return 0
    if not 0 <= local_rank < device_count:
        raise RuntimeError(
            f"local rank {local_rank} has no GPU of its own: {device_count} are visible to this process; start at "
            "most one process per GPU (check --nproc_per_node / --gpus-per-task and CUDA_VISIBLE_DEVICES)"
        )
    return local_rank


def check_processes_fit_devices(nproc: int, device_count: int) -> None:
    """``nproc`` processes on one host need ``nproc`` GPUs: NCCL refuses two ranks on one device
    ("Duplicate GPU detected"), and only after the whole start-up. Raises ValueError (one line)."""
    if nproc > device_count:
        visible = os.environ.get("CUDA_VISIBLE_DEVICES")
        mask = f" (CUDA_VISIBLE_DEVICES={visible})" if visible is not None else ""
        raise ValueError(
            f"--nproc {nproc} needs {nproc} GPUs but {device_count} {'is' if device_count == 1 else 'are'} visible"
            f"{mask}: start at most one process per GPU, or train on the CPU with training.device=cpu"
        )


class DeviceSharedError(BadInput):
    """Two ranks of one job drive the same GPU."""


def device_identity(device_index: int) -> str:
    """What tells GPUs apart across processes: the UUID (a device index is relative to each
    process's CUDA_VISIBLE_DEVICES mask, so two processes may both call one GPU "0")."""
    return str(torch.cuda.get_device_properties(device_index).uuid)


def check_one_process_per_device(identity: str, control_group=None) -> None:
    """Every rank publishes (host, GPU identity) over the gloo ``control_group``; a GPU driven by
    two ranks stops every rank with one line naming both, before the first NCCL collective (where
    NCCL would abort with "Duplicate GPU detected"). Collective over the world."""
    import socket

    seen = [None] * dist.get_world_size()
    dist.all_gather_object(seen, (socket.gethostname(), identity), group=control_group)
    owner: dict[tuple[str, str], int] = {}
    for rank, key in enumerate(seen):
        key = tuple(key)
        if key in owner:
            raise DeviceSharedError(
                f"ranks {owner[key]} and {rank} both use GPU {key[1]} on host {key[0]}: start at most one "
                "process per GPU (check --nproc_per_node / --gpus-per-task and CUDA_VISIBLE_DEVICES)"
            )
        owner[key] = rank


def device_kind(wanted: str = "auto", setting: str = "device") -> str:
    """``cpu`` or ``cuda`` for a device setting (``auto``: cuda when one is visible); BadInput (one
    line naming ``setting``) for ``cuda`` when none is."""
    if wanted == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if wanted == "cuda" and not torch.cuda.is_available():
        raise BadInput(f"{setting}=cuda but no CUDA device is visible")
    return wanted


def _choose_backend(backend: str) -> str:
    if backend == "auto":
        return "nccl" if torch.cuda.is_available() else "gloo"
    if backend == "nccl" and not torch.cuda.is_available():
        raise RuntimeError("backend nccl needs CUDA, and no CUDA device is visible")
    return backend


# How long any collective may wait by default: an hour of legitimate waiting (one rank preparing a
# corpus or writing a checkpoint while the others wait) plus two minutes. The trainer passes its
# hang watchdog's longest allowance instead, so that the watchdog's one line always comes first.
DEFAULT_TIMEOUT_S = 3600.0 + 120.0


def init_distributed(
    tensor_parallel: int = 1,
    backend: str = "auto",
    timeout_s: float = DEFAULT_TIMEOUT_S,
    startup_timeout_s: float | None = None,
    *,
    launcher: dict,
    job_store: Callable,
) -> ParallelState:
    """Join (or create) the default process group of the job that ``launcher`` describes (the rank
    facts of :func:`parallel_latent.launching.cluster.launcher_environment`: rank, world_size,
    local_rank, local_world_size, master_addr, master_port), then build the TP and DP groups (every
    group, the gloo control group included, with ``timeout_s``). The ranks meet in the store that
    ``job_store(launcher, startup_timeout_s or timeout_s, timeout)`` opens (this attempt's own:
    :func:`parallel_latent.launching.rendezvous.job_store`, where every rank is there within
    ``startup_timeout_s``, or the job ends with one line naming the missing ones). Safe to call when
    the default group already exists (tests, DeepSpeed)."""
    if not dist.is_initialized():
        backend = _choose_backend(backend)
        device_id = None
        if backend == "nccl":
            torch.cuda.set_device(select_device_index(launcher["local_rank"], torch.cuda.device_count()))
            device_id = torch.device("cuda", torch.cuda.current_device())  # communicators made now, not in step 1
        timeout = datetime.timedelta(seconds=timeout_s)
        if launcher["world_size"] == 1 and launcher["master_addr"] is None:
            store = dist.HashStore()  # no launcher: a private in-memory store, no port to pick
        else:
            os.environ.setdefault("MASTER_ADDR", launcher["master_addr"])
            os.environ.setdefault("MASTER_PORT", launcher["master_port"])
            store = job_store(launcher, startup_timeout_s or timeout_s, timeout)
        dist.init_process_group(
            backend,
            store=store,
            rank=launcher["rank"],
            world_size=launcher["world_size"],
            timeout=timeout,
            device_id=device_id,
        )
        os.environ.setdefault("LOCAL_RANK", str(launcher["local_rank"]))
    state = initialize_model_parallel(tensor_parallel, timeout_s, launcher["local_world_size"])
    if state.backend == "nccl":  # over gloo, before any NCCL collective
        check_one_process_per_device(device_identity(torch.cuda.current_device()), state.control_group)
    return state


def initialize_model_parallel(
    tensor_parallel: int, timeout_s: float = DEFAULT_TIMEOUT_S, local_world_size: int | None = None
) -> ParallelState:
    """Build TP groups of consecutive ranks and DP groups across them, and the gloo control group
    with ``timeout_s`` (collective: all ranks call). ``local_world_size``: the processes on this
    node, when the launcher says (recorded in the state)."""
    global _STATE
    world, rank = dist.get_world_size(), dist.get_rank()
    if tensor_parallel < 1 or world % tensor_parallel != 0:
        raise ValueError(f"tensor_parallel={tensor_parallel} does not divide the world size {world}")
    dp = world // tensor_parallel
    tp_group = dp_group = None
    tp_ranks = dp_ranks = ()
    # new_group is collective over the whole world: every rank creates every group, in order.
    for start in range(0, world, tensor_parallel):
        ranks = tuple(range(start, start + tensor_parallel))
        group = dist.new_group(list(ranks))
        if rank in ranks:
            tp_group, tp_ranks = group, ranks
    for offset in range(tensor_parallel):
        ranks = tuple(range(offset, world, tensor_parallel))
        group = dist.new_group(list(ranks))
        if rank in ranks:
            dp_group, dp_ranks = group, ranks
    backend = dist.get_backend()
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    device = torch.device("cuda", torch.cuda.current_device()) if backend == "nccl" else torch.device("cpu")
    # Its own group even over gloo: the default group's timeout guards the training collectives.
    control_group = dist.new_group(backend="gloo", timeout=datetime.timedelta(seconds=timeout_s))
    _STATE = ParallelState(
        rank=rank,
        world_size=world,
        local_rank=local_rank,
        tp_size=tensor_parallel,
        tp_rank=tp_ranks.index(rank),
        dp_size=dp,
        dp_rank=dp_ranks.index(rank),
        tp_ranks=tp_ranks,
        dp_ranks=dp_ranks,
        tp_group=tp_group,
        dp_group=dp_group,
        backend=backend,
        device=device,
        control_group=control_group,
        local_world_size=local_world_size,
    )
    return _STATE


def release_model_parallel() -> None:
    """Destroy the TP, DP and control groups of :func:`initialize_model_parallel` and forget them, the
    default group kept (collective: all ranks call). A process that sets up one layout after another
    (a rank of a test pool, a notebook) then holds one layout's gloo connections and threads, not
    every layout's (a destroyed group's go with the last reference to it)."""
    global _STATE
    if _STATE is None:
        return
    groups = [_STATE.tp_group, _STATE.dp_group, _STATE.control_group]
    _STATE = None
    dist.barrier()  # no rank still in a collective of a group that the others destroy
    for group in groups:
        if group is not None and group is not dist.GroupMember.WORLD:
            dist.destroy_process_group(group)


def destroy_distributed() -> None:
    global _STATE
    _STATE = None
    if dist.is_initialized():
        dist.destroy_process_group()


def is_initialized() -> bool:
    return _STATE is not None


def get_parallel_state() -> ParallelState:
    if _STATE is None:
        raise RuntimeError("process groups are not initialized: call init_distributed() first")
    return _STATE


def get_dp_rank() -> int:
    return _STATE.dp_rank if _STATE else 0


class ModelParallelUnit:
    """The ``mpu`` interface DeepSpeed calls (ZeRO's gradient norm, checkpoint naming, data
    parallel sizing). Deliberately without ``initialize_sequence_parallel``: DeepSpeed takes the
    presence of that method to mean a sequence-parallel mpu."""

    def __init__(self, state: ParallelState | None = None):
        self._state = state

    @property
    def state(self) -> ParallelState:
        return self._state or get_parallel_state()

    # tensor (model) parallel
    def get_model_parallel_group(self):
        return self.state.tp_group

    def get_model_parallel_rank(self) -> int:
        return self.state.tp_rank

    def get_model_parallel_world_size(self) -> int:
        return self.state.tp_size

    get_tensor_model_parallel_group = get_model_parallel_group
    get_tensor_model_parallel_rank = get_model_parallel_rank
    get_tensor_model_parallel_world_size = get_model_parallel_world_size
    get_slice_parallel_group = get_model_parallel_group
    get_slice_parallel_rank = get_model_parallel_rank
    get_slice_parallel_world_size = get_model_parallel_world_size

    def get_tensor_model_parallel_src_rank(self) -> int:
        return self.state.tp_ranks[0]

    # data parallel
    def get_data_parallel_group(self):
        return self.state.dp_group

    def get_data_parallel_rank(self) -> int:
        return self.state.dp_rank

    def get_data_parallel_world_size(self) -> int:
        return self.state.dp_size

    def get_data_parallel_group_ranks(self) -> list[int]:
        return list(self.state.dp_ranks)

    # no pipeline parallelism
    def get_pipeline_model_parallel_world_size(self) -> int:
        return 1

    def get_pipeline_model_parallel_rank(self) -> int:
        return 0

    def get_pipe_parallel_world_size(self) -> int:
        return 1

    def get_pipe_parallel_rank(self) -> int:
        return 0
