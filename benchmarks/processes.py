"""Other processes of a benchmark: their environment, their commands, their peak memory, the ranks of a
job on this machine and the port of their store."""

from __future__ import annotations

import contextlib
import gc
import os
import queue
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

from benchmarks.harness import REPO


def child_environment(threads: int | None = None, *, cpu: bool = False, **variables: str) -> dict[str, str]:
    """This process's environment with ``threads`` compute threads (None: as inherited), DeepSpeed on the CPU
    with ``cpu``, and ``variables`` (TOKENIZERS_PARALLELISM="false": the tokenizers' fork warning off)."""
    env = {**os.environ, **variables}
    if threads is not None:
        env["OMP_NUM_THREADS"] = str(threads)
    if cpu:
        env["DS_ACCELERATOR"] = "cpu"
    return env


def run_checked(command: list[str], env: dict[str, str], what: str) -> subprocess.CompletedProcess:
    """``command`` run from the repository, its output captured; an error naming ``what`` if it fails."""
    result = subprocess.run(command, cwd=REPO, env=env, capture_output=True, text=True, check=False)
    if result.returncode != 0:
        raise RuntimeError(f"{what} failed:\n{result.stdout[-3000:]}\n{result.stderr[-3000:]}")
    return result


def watched_run(command: list[str], env: dict[str, str], watch: Callable[[subprocess.Popen], bool] = lambda _: False):
    """(peak RSS MB, exit status, output's end) of ``command``, output in a file; ``watch(process)``: True stops."""
    with tempfile.TemporaryFile() as output:
        process = subprocess.Popen(command, cwd=REPO, env=env, stdout=output, stderr=subprocess.STDOUT)
        peak = 0.0
        while process.poll() is None:  # its peak resident set (MB), sampled every 10 ms
            peak = max(peak, (status_kb("VmHWM:", process.pid) or 0) / 1024)
            if watch(process):
                break
            time.sleep(0.01)
        process.wait()
        output.seek(0)
        return peak, process.returncode, output.read().decode(errors="replace")[-3000:]


def status_kb(key: str, pid: int | str = "self") -> int | None:
    """A figure of ``/proc/PID/status`` in kB (``VmHWM:``: the peak resident set of the current program)."""
    with contextlib.suppress(OSError, ValueError, IndexError):
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith(key):
                return int(line.split()[1])
    return None


def peak_extra_bytes(fn) -> int:
    """Peak resident memory over ``fn()`` above what was resident before (the high-water mark reset first)."""
    gc.collect()
    Path("/proc/self/clear_refs").write_text("5")
    before = status_kb("VmRSS:")
    fn()
    return (status_kb("VmHWM:") - before) * 1024


def free_port() -> int:
    """A port for a store a later process hosts, left in TIME_WAIT (~60 s): never handed to ``bind(0)`` or
    ``connect()`` (a closed port could go to a gloo listener first); the store's SO_REUSEADDR bind takes it."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as listener:
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        listener.bind(("127.0.0.1", 0))
        listener.listen(1)
        port = listener.getsockname()[1]
        with socket.create_connection(("127.0.0.1", port)):
            accepted, _ = listener.accept()
            accepted.close()  # the side that closes first holds the TIME_WAIT, on this port
    return port


def _rank(rank: int, world: int, port: int, task, args: tuple, results) -> None:
    import torch

    # What a launcher tells rank ``rank`` of a job of ``world`` processes on this machine; DeepSpeed on the CPU.
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world),
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), DS_ACCELERATOR="cpu",
                      OMP_NUM_THREADS="1")  # fmt: skip
    torch.set_num_threads(1)  # several ranks on few cores: one thread each, or they fight over the cores
    value = task(*args)
    if rank == 0:
        results.put(value)


def preloaded_context(*modules: str):
    """Processes forked from a server that imported ``modules`` once (spawned ones import them: 3-4 CPU-s)."""
    import torch.multiprocessing as mp

    (context := mp.get_context("forkserver")).set_forkserver_preload(list(modules))
    return context


def on_ranks(world: int, task, *args):
    """Rank 0's ``task(*args)`` on each of ``world`` ranks; a rank that fails ends them all."""
    module = sys.modules["__main__"].__spec__.name if task.__module__ == "__main__" else task.__module__
    context = preloaded_context("torch", module)  # (python -m benchmarks.X runs as __main__)
    results, port = context.Queue(), free_port()
    processes = [context.Process(target=_rank, args=(r, world, port, task, args, results)) for r in range(world)]
    for process in processes:
        process.start()
    while True:
        with contextlib.suppress(queue.Empty):
            value = results.get(timeout=5)
            break
        if failed := [p.exitcode for p in processes if p.exitcode not in (None, 0)]:
            for process in processes:
                process.kill()
            raise RuntimeError(f"a rank exited with status {failed[0]}")
    for process in processes:
        process.join()
    return value
