"""Who started this process: the rank facts of whichever launcher did (torchrun, the deepspeed
launcher, ``accelerate launch``, ``srun``, ``mpirun``), read from its environment variables.

The process groups (:mod:`parallel_latent.parallel.state`) are told these facts; they never read a
launcher's variables themselves. Torch-free: the worker logs read the rank before the CLI loads.
"""

from __future__ import annotations

import os
import re

__all__ = ["environment_rank", "first_slurm_host", "launcher_environment", "slurm_tasks_on_node", "under_launcher"]


def under_launcher() -> bool:
    """Started by torchrun / the deepspeed launcher / accelerate launch / mpirun (they set RANK
    or OMPI_*).  A bare SLURM allocation does not count: its batch step is a plain shell."""
    return "RANK" in os.environ or "OMPI_COMM_WORLD_RANK" in os.environ


def environment_rank() -> int:
    """This process's global rank as its launcher names it (0 without one)."""
    return int(os.environ.get("RANK", os.environ.get("SLURM_PROCID", "0")))


def first_slurm_host(nodelist: str) -> str:
    """``gpu[03-05,9],cpu1`` -> ``gpu03``: the host that runs rank 0 under srun."""
    match = re.match(r"([^,\[]+)(\[([^\]]+)\])?", nodelist.strip())
    if not match:
        raise ValueError(f"cannot parse SLURM node list {nodelist!r}")
    prefix, _, ranges = match.groups()
    if not ranges:
        return prefix
    return prefix + ranges.split(",")[0].split("-")[0]


def slurm_tasks_on_node(tasks_per_node: str, node_id: int) -> int:
    """``SLURM_TASKS_PER_NODE`` (``8(x2),4``: 8 on each of two nodes, then 4) for node ``node_id``."""
    counts = []
    for part in tasks_per_node.split(","):
        match = re.fullmatch(r"(\d+)(?:\(x(\d+)\))?", part.strip())
        if not match:
            raise ValueError(f"cannot parse SLURM_TASKS_PER_NODE={tasks_per_node!r}")
        counts += [int(match.group(1))] * int(match.group(2) or 1)
    return counts[min(node_id, len(counts) - 1)]


def launcher_environment(env=None) -> dict:
    """Rank facts from whichever launcher started us: torchrun, the deepspeed launcher and
    ``accelerate launch`` set RANK/WORLD_SIZE/LOCAL_RANK; plain ``srun`` sets SLURM_*; ``mpirun``
    sets OMPI_*. No launcher at all means a single process.

    ``local_world_size`` is the number of processes on this node (None when the launcher does not
    say): torchrun's LOCAL_WORLD_SIZE, the deepspeed launcher's LOCAL_SIZE, SLURM's tasks per node,
    Open MPI's local size."""
    env = os.environ if env is None else env
    if "RANK" in env and "WORLD_SIZE" in env:
        rank, world = int(env["RANK"]), int(env["WORLD_SIZE"])
        local_rank = int(env.get("LOCAL_RANK", 0))
        local_world = env.get("LOCAL_WORLD_SIZE") or env.get("LOCAL_SIZE")
        addr, port = env.get("MASTER_ADDR", "127.0.0.1"), env.get("MASTER_PORT", "29500")
    elif "SLURM_PROCID" in env and "SLURM_NTASKS" in env:
        rank, world = int(env["SLURM_PROCID"]), int(env["SLURM_NTASKS"])
        local_rank = int(env.get("SLURM_LOCALID", 0))
        local_world = env.get("SLURM_NTASKS_PER_NODE")
        if not local_world and env.get("SLURM_TASKS_PER_NODE"):
            local_world = slurm_tasks_on_node(env["SLURM_TASKS_PER_NODE"], int(env.get("SLURM_NODEID", 0)))
        addr = env.get("MASTER_ADDR") or first_slurm_host(env.get("SLURM_JOB_NODELIST", "127.0.0.1"))
        port = env.get("MASTER_PORT") or str(20000 + int(env.get("SLURM_JOB_ID", "9500")) % 20000)
    elif "OMPI_COMM_WORLD_RANK" in env:
        rank, world = int(env["OMPI_COMM_WORLD_RANK"]), int(env["OMPI_COMM_WORLD_SIZE"])
        local_rank = int(env.get("OMPI_COMM_WORLD_LOCAL_RANK", 0))
        local_world = env.get("OMPI_COMM_WORLD_LOCAL_SIZE")
        addr, port = env.get("MASTER_ADDR", "127.0.0.1"), env.get("MASTER_PORT", "29500")
    else:
        return {
            "rank": 0,
            "world_size": 1,
            "local_rank": 0,
            "local_world_size": 1,
            "master_addr": None,
            "master_port": None,
        }
    return {
        "rank": rank,
        "world_size": world,
        "local_rank": local_rank,
        "local_world_size": int(local_world) if local_world else None,
        "master_addr": addr,
        "master_port": str(port),
    }
