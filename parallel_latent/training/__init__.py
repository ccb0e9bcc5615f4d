"""The training runtime: everything a training job runs on every rank, from start-up to its last
checkpoint.

- :mod:`.trainer`: :func:`~.trainer.train` and the :class:`~.trainer.Trainer` loop (the step, data
  feeding, the stop vote, the non-finite watch, when to log, evaluate and save);
- :mod:`.startup`: :func:`~.startup.start_run` (checks, process groups, tokenizer, model, data, the
  checkpoint to resume, the engine); :mod:`.preflight`: :func:`~.preflight.preflight`, the checks that
  build nothing (``train --nproc`` runs them before it launches a rank, without transformers or
  DeepSpeed);
- :mod:`.engine_setup`: the DeepSpeed config, optimizer, schedule and ``deepspeed.initialize``;
- the periodic held-out evaluation that the trainer runs is :mod:`parallel_latent.evaluation.periodic`;
- :mod:`.metrics`, :mod:`.flops`, :mod:`.report`: metric sinks and records, FLOPs and MFU, the
  banner and the summary;
- :mod:`.watchdog`: the hang watchdog; :mod:`.run_lock`: one job per run directory;
  :mod:`.world`: TP x DP and the global batch.

Only the command line (:mod:`parallel_latent.cli`) and :mod:`parallel_latent.api` import this
package; nothing here is imported at package import (the command line takes the run directory's
lock through :mod:`.run_lock` before torch loads).
"""
