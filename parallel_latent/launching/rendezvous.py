"""How the ranks of a job meet: the store behind the process groups, new for every attempt of the
job, with every rank accounted for within a bound; :func:`join_job` builds this process's groups on
it, from its launcher's environment (:mod:`.cluster`).

A launcher hands every rank ``MASTER_ADDR`` and ``MASTER_PORT``. Two cases:

- torchrun's elastic agent hosts a store there that it shares with its own rendezvous and keeps for
  the whole job (``TORCHELASTIC_USE_AGENT_STORE=True``). After a restart, the new workers would meet
  in the store the previous attempt's workers used, where that attempt's process-group keys (gloo's
  peer addresses, NCCL's unique id) are still set: the new group reads the dead group's addresses
  (``Connection refused``) or waits on keys that never change (a hang). Here global rank 0 opens a
  store of its own on a free port and names it, with a random nonce, in the agent's store; every
  other rank takes it only once it reaches a live store that holds that nonce. A name an earlier
  attempt left behind points at a store that is gone, or that holds another nonce, so it is never
  taken, and no key of an earlier attempt is ever read.
- every other launcher (the deepspeed launcher, ``srun``, ``accelerate launch``, an environment set
  by hand): rank 0 hosts the store at ``MASTER_PORT``, new with every process.

Then every rank checks in and rank 0 waits for all of them: a rank that does not come within
``timeout_s`` ends the job with one line naming the phase and the ranks missing
(:class:`StartupTimeout`), instead of a wait as long as the process groups' own timeout.

:mod:`parallel_latent.parallel.state` knows no launcher: it is handed the launcher's rank facts and
:func:`job_store`.
"""

from __future__ import annotations

import datetime
import os
import secrets
import socket
import time

import torch.distributed as dist

from parallel_latent.errors import BadInput, ExitStatus
from parallel_latent.parallel.state import DEFAULT_TIMEOUT_S, ParallelState, init_distributed

from .cluster import launcher_environment

__all__ = ["AGENT_STORE_ENV", "ATTEMPT_KEY", "StartupTimeout", "job_store", "join_job"]

AGENT_STORE_ENV = "TORCHELASTIC_USE_AGENT_STORE"
ATTEMPT_KEY = "parallel_latent/attempt_store"  # in the agent's store: "<port> <nonce>" of this attempt's
PREFIX = "parallel_latent"
PROBE_S = 2.0  # how long one look at an advertised store may take
POLL_S = 0.1


class StartupTimeout(RuntimeError):
    """A rank did not come to the job's rendezvous within its bound (one line, exit status 5)."""

    exit_status = ExitStatus.HANG


def _seconds(deadline: float) -> float:
    return max(0.1, deadline - time.monotonic())


def _store(host: str, port: int, seconds: float, is_master: bool = False):
    return dist.TCPStore(
        host, port, is_master=is_master, timeout=datetime.timedelta(seconds=seconds), wait_for_workers=False
    )


def _open_attempt_store(host: str, agent) -> object:
    """Global rank 0: a new store on a free port, named with a nonce in the agent's store."""
    own = _store(host, 0, PROBE_S, is_master=True)
    nonce = secrets.token_hex(8)
    own.set("nonce", nonce)
    agent.set(ATTEMPT_KEY, f"{own.port} {nonce}")
    return own


def _find_attempt_store(host: str, agent, deadline: float, timeout_s: float) -> object:
    """Every other rank: the store rank 0 named, once it is live and holds the nonce named with it."""
    while time.monotonic() < deadline:
        try:
            if agent.check([ATTEMPT_KEY]):
                port, nonce = agent.get(ATTEMPT_KEY).decode().split()
                socket.create_connection((host, int(port)), timeout=PROBE_S).close()  # refused at once when gone
                own = _store(host, int(port), min(PROBE_S, _seconds(deadline)))
                if own.check(["nonce"]) and own.get("nonce").decode() == nonce:
                    return own
        except (RuntimeError, ValueError, OSError):
            pass  # named by an earlier attempt, whose store is gone: look again
        time.sleep(POLL_S)
    raise StartupTimeout(f"start-up: rank 0 did not open the job's store within {timeout_s:g} s")


def _wait_for(store, keys: list[str], deadline: float) -> list[str]:
    """Poll until every key is set or the deadline passes (no blocking wait: its timeout would print
    a warning of its own); the keys still missing."""
    while True:
        missing = [key for key in keys if not store.check([key])]
        if not missing or time.monotonic() >= deadline:
            return missing
        time.sleep(POLL_S)


def _check_in(store, rank: int, world_size: int, deadline: float, timeout_s: float) -> None:
    """Every rank says it is here; rank 0 waits for all, then lets them go on."""
    if rank != 0:
        store.set(f"joined/{rank}", "1")
        if _wait_for(store, ["ready"], deadline):
            raise StartupTimeout(
                f"start-up: the job's ranks did not all join within {timeout_s:g} s (rank 0 did not see them)"
            )
        return
    missing = _wait_for(store, [f"joined/{r}" for r in range(1, world_size)], deadline)
    if missing:
        ranks = [int(key.split("/")[1]) for key in missing]
        raise StartupTimeout(
            f"start-up: rank{'s' if len(ranks) > 1 else ''} {', '.join(map(str, ranks))} of {world_size} did not "
            f"join the job within {timeout_s:g} s"
        )
    store.set("ready", "1")


def job_store(env: dict, timeout_s: float, timeout: datetime.timedelta):
    """The store the process groups of this attempt are built on (see the module), every rank of
    the launcher's world checked in within ``timeout_s``; its own timeout is then ``timeout``."""
    rank, world_size, host = env["rank"], env["world_size"], env["master_addr"]
    deadline = time.monotonic() + timeout_s
    try:
        if os.environ.get(AGENT_STORE_ENV) == str(True):
            agent = _store(host, int(env["master_port"]), timeout_s)
            store = (
                _open_attempt_store(host, agent) if rank == 0 else _find_attempt_store(host, agent, deadline, timeout_s)
            )
        else:
            store = _store(host, int(env["master_port"]), timeout_s, is_master=rank == 0)
    except RuntimeError as error:
        if isinstance(error, StartupTimeout):
            raise
        if rank == 0 and "EADDRINUSE" in str(error):
            # Another process holds the port: the other ranks would wait out their bound on it.
            raise BadInput(
                f"start-up: rank 0 cannot host the job's store at {host}:{env['master_port']}: the port is in use "
                "(MASTER_PORT: give the job a free one)"
            ) from None
        raise StartupTimeout(
            f"start-up: the job's store at {host}:{env['master_port']} could not be reached within {timeout_s:g} s"
        ) from None
    store.set_timeout(datetime.timedelta(seconds=_seconds(deadline)))
    _check_in(store, rank, world_size, deadline, timeout_s)
    store.set_timeout(timeout)
    return dist.PrefixStore(PREFIX, store)


def join_job(
    tensor_parallel: int = 1,
    backend: str = "auto",
    timeout_s: float = DEFAULT_TIMEOUT_S,
    startup_timeout_s: float | None = None,
    launcher: dict | None = None,
) -> ParallelState:
    """This process's place in its launcher's job: the process groups of
    :func:`~parallel_latent.parallel.state.init_distributed` (TP x DP, every group with
    ``timeout_s``), built on this attempt's store (:func:`job_store`), which every rank joins within
    ``startup_timeout_s`` (default ``timeout_s``). ``launcher``: the rank facts of
    :func:`.cluster.launcher_environment`, read from this process's environment when not given.
    Collective: every rank calls it."""
    launcher = launcher_environment() if launcher is None else launcher
    return init_distributed(
        tensor_parallel, backend, timeout_s, startup_timeout_s, launcher=launcher, job_store=job_store
    )
