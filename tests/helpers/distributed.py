"""A pool of real gloo ranks that lives for one test module.

Spawning a rank costs seconds (importing torch, and DeepSpeed where used), so a module starts its
pool once and runs many tasks on it. A task is a module-level function ``fn(*args)`` run on every
rank; its return values come back as a list indexed by rank. If any rank raises, the whole pool is
torn down (the others may be blocked in a collective) and the traceback is re-raised here.
"""

from __future__ import annotations

import datetime
import os
import queue
import socket
import traceback

import torch
import torch.multiprocessing as mp

TASK_TIMEOUT_S = float(os.environ.get("PL_TEST_TASK_TIMEOUT", "300"))


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def limit_threads() -> None:
    # Several ranks on 2 cores: one thread each, or they fight over the cores.
    os.environ["OMP_NUM_THREADS"] = "1"
    torch.set_num_threads(1)


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
            results.put((rank, True, fn(*args, **kwargs)))
        except BaseException:  # report everything, the parent decides
            results.put((rank, False, traceback.format_exc()))
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
        ctx = mp.get_context("spawn")
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
        for _ in range(self.world_size):
            try:
                rank, ok, value = self._results.get(timeout=TASK_TIMEOUT_S)
            except queue.Empty:
                self.close(force=True)
                raise TimeoutError(f"{fn.__name__}: no answer from every rank within {TASK_TIMEOUT_S}s") from None
            if not ok:
                errors.append(f"rank {rank}:\n{value}")
                break
            out[rank] = value
        if errors:
            self.close(force=True)
            raise RuntimeError(f"{fn.__name__} failed on " + "\n".join(errors))
        return out

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
