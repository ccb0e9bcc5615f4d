"""Starting and watching the rank processes of a job, and what the terminal shows for them.

- :mod:`.cluster`: who started this process (torchrun, the deepspeed launcher, accelerate, SLURM,
  Open MPI) and the rank facts its environment gives;
- :mod:`.rendezvous`: where the ranks of one attempt meet (a store of the attempt's own, every rank
  checked in within a bound) and :func:`~.rendezvous.join_job`, the process groups built on it;
- :mod:`.local`: ``train --nproc`` / ``encode-corpus --nproc``: the torchrun command, the process
  that dies with its launcher, the Ctrl-C forwarded to the ranks;
- :mod:`.agent`: the torchrun agent those commands run (``python -m parallel_latent.launching.agent``);
- :mod:`.worker_logs`: the launch's log directory, the ranks' output redirected into it, the
  warning filters;
- :mod:`.reports`: one line per failure (torchrun's error files, the agent's last line), the
  restart line, the hang watchdog's report.

Nothing is imported here: :mod:`.agent` runs as a module (imported here first, ``python -m`` would
warn that it runs twice), and the worker logs are set up before torch loads, which
:mod:`.rendezvous` imports.
"""
