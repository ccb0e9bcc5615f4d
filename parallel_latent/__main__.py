"""``python -m parallel_latent ...`` is the ``parallel-latent`` command (what launchers run)."""

import atexit
import contextlib
import logging
import os
import sys
import threading

from parallel_latent.launching.worker_logs import redirect_worker_output

redirect_worker_output()  # a rank of `train --nproc` other than 0 writes to its log file, from the start

from parallel_latent.cli import main  # noqa: E402


def exit_without_teardown(status: int) -> None:
    """Exit as the interpreter would (its threads joined, its exit handlers run, its streams flushed)
    but without tearing down every module and object first: a rank that has imported torch,
    transformers and DeepSpeed spends seconds on that teardown after its job is done, and its
    launcher waits for them. Everything the command writes is closed before it returns."""
    for thread in threading.enumerate():
        if thread is not threading.main_thread() and not thread.daemon:
            thread.join()
    atexit._run_exitfuncs()
    logging.shutdown()
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(OSError, ValueError):  # a closed pipe or stream: nothing left to say
            stream.flush()
    os._exit(int(status or 0))


exit_without_teardown(main())  # an unexpected failure raises out of main(): Python's traceback, exit 1
