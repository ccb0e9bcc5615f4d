"""A pool of real gloo ranks that lives for a test module, or for a whole pytest process.

Starting a rank costs seconds (importing torch, transformers and DeepSpeed), so the tests start a
pool once and run many tasks on it (tests/helpers/pool_training.shared_pool: one per world size for
the whole pytest process). A task is a module-level function ``fn(*args)`` run on every
rank; its return values come back as a list indexed by rank. If any rank raises, the whole pool is
torn down (the others may be blocked in a collective) and the traceback is re-raised here.
"""

from __future__ import annotations

import datetime
import gc
import os
import queue
import sys
import time
import traceback

import torch

from benchmarks.processes import free_port, preloaded_context
from parallel_latent.cli import GC_THRESHOLD

TASK_TIMEOUT_S = float(os.environ.get("PL_TEST_TASK_TIMEOUT", "300"))


def limit_threads() -> None:
    # Several ranks on 2 cores: one thread each, or they fight over the cores.
    os.environ["OMP_NUM_THREADS"] = "1"
    torch.set_num_threads(1)


def _release_task_groups() -> None:
    """The process groups a task set up (parallel_latent.parallel.initialize_model_parallel), destroyed
    when every rank has returned from it: a pool serves the modules of a whole pytest process, and
    each test builds new groups, each with its gloo connections and threads."""
    state = sys.modules.get("parallel_latent.parallel.state")
    if state is not None:
        state.release_model_parallel()


def _worker(rank: int, world_size: int, port: int, tasks, results, env: dict) -> None:
    os.environ.update(env)
    os.environ.update(
        {
            "RANK": str(rank),
            "WORLD_SIZE": str(world_size),
            "LOCAL_RANK": str(rank),
            "LOCAL_WORLD_SIZE": str(world_size),
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": str(port),
        }
    )
    limit_threads()
    gc.set_threshold(*GC_THRESHOLD)
    import torch.distributed as dist

    dist.init_process_group(
        "gloo", init_method="env://", rank=rank, world_size=world_size, timeout=datetime.timedelta(seconds=120)
    )
    while True:
        task = tasks.get()
        if task is None:
            break
        fn, args, kwargs = task
        try:
            value = fn(*args, **kwargs)
            _release_task_groups()
            results.put((rank, True, value))
        except BaseException:  # report everything, the parent decides
            results.put((rank, False, traceback.format_exc()))
    if dist.is_initialized():
        dist.destroy_process_group()
    # The pool's owner waits for this exit: skip the interpreter's seconds of tearing down torch's
    # modules (the results queue's feeder thread is flushed first).
    results.close()
    results.join_thread()
    os._exit(0)


class DistributedPool:
    def __init__(self, world_size: int, env: dict | None = None):
        self.world_size = world_size
        self.env = dict(env or {})
        self._procs = []

    def _start(self) -> None:
        # torch, transformers and the package imported once (not DeepSpeed, which reads its
        # accelerator from the rank's environment).
        ctx = preloaded_context("parallel_latent.training.trainer")
        port = free_port()
        self._results = ctx.Queue()
        self._tasks = [ctx.Queue() for _ in range(self.world_size)]
        self._procs = [
            ctx.Process(
                target=_worker, args=(r, self.world_size, port, self._tasks[r], self._results, self.env), daemon=True
            )
            for r in range(self.world_size)
        ]
        for p in self._procs:
            p.start()

    def run(self, fn, *args, **kwargs) -> list:
        if not self._procs:
            self._start()
        for q in self._tasks:
            q.put((fn, args, kwargs))
        out, errors = [None] * self.world_size, []
        deadline = time.monotonic() + TASK_TIMEOUT_S
        for _ in range(self.world_size):
            rank, ok, value = self._next_result(fn.__name__, deadline)
            if not ok:
                errors.append(f"rank {rank}:\n{value}")
                break
            out[rank] = value
        if errors:
            self.close(force=True)
            raise RuntimeError(f"{fn.__name__} failed on " + "\n".join(errors))
        return out

    def _next_result(self, name: str, deadline: float) -> tuple:
        """The next rank's answer; a rank that died meanwhile (no answer will come) or the deadline
        ends the wait and the pool."""
        while True:
            try:
                return self._results.get(timeout=1)
            except queue.Empty:
                dead = [f"rank {r} exited with {p.exitcode}" for r, p in enumerate(self._procs) if not p.is_alive()]
                if dead or time.monotonic() > deadline:
                    self.close(force=True)
                    why = ", ".join(dead) or f"no answer from every rank within {TASK_TIMEOUT_S}s"
                    raise (RuntimeError if dead else TimeoutError)(f"{name}: {why}") from None

    def close(self, force: bool = False) -> None:
        if not self._procs:
            return
        if not force:
            for q in self._tasks:
                q.put(None)
            for p in self._procs:
                p.join(timeout=30)
        for p in self._procs:
            if p.is_alive():
                p.kill()
                p.join()
        self._procs = []
