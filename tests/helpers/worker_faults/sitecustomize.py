"""Fault injection into one rank of a real job (never imported by the package).

A directory with this file on ``PYTHONPATH`` makes the process whose ``RANK`` is ``$PL_FAULT_RANK``
fail at optimizer step ``$PL_FAULT_STEP`` (1-based; 0: during start-up, before its data and model
are built): ``PL_FAULT=raise`` raises a RuntimeError (an unexpected failure), ``PL_FAULT=kill``
sends itself SIGKILL (a rank that dies without a word), ``PL_FAULT=hang`` stops for good before it
joins the job's rendezvous; ``PL_FAULT=export`` makes the rank's latent shard writer raise in its
shard ``$PL_FAULT_STEP``, ``PL_FAULT=export-hang`` stops the rank's main thread for good as it
begins that shard; ``PL_FAULT=prepare`` makes the rank's preparation of the corpus raise (under
plain torchrun, where the ranks prepare it). With ``$PL_FAULT_ATTEMPT`` set, only in that attempt of a restarted
job (torchrun's ``TORCHELASTIC_RESTART_COUNT``); ``PL_FAULT_STEP=9,0`` names a step per attempt (the
first attempt at step 9, the second in its start-up, none after). Python imports ``sitecustomize`` at start-up in
every process that sees the variable; only the named rank of a training job acts on it.
"""

import os

ATTEMPT = os.environ.get("PL_FAULT_ATTEMPT")
THIS_ATTEMPT = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
STEPS = os.environ.get("PL_FAULT_STEP", "").split(",")
STEP = (
    STEPS[int(THIS_ATTEMPT)]
    if len(STEPS) > 1 and int(THIS_ATTEMPT) < len(STEPS)
    else STEPS[0]
    if len(STEPS) == 1
    else ""
)

if (
    os.environ.get("PL_FAULT")
    and STEP
    and os.environ.get("RANK") == os.environ.get("PL_FAULT_RANK")
    and (ATTEMPT is None or ATTEMPT == THIS_ATTEMPT)
):
    import signal
    import threading

    import parallel_latent.launching.rendezvous as rendezvous
    import parallel_latent.training.startup as startup
    from parallel_latent.training.trainer import Trainer

    fault, fault_step = os.environ["PL_FAULT"], int(STEP)

    def act() -> None:
        if fault == "kill":
            os.kill(os.getpid(), signal.SIGKILL)
        if fault == "hang":
            threading.Event().wait()
        raise RuntimeError(f"injected fault at step {fault_step}")

    if fault == "export":
        import parallel_latent.latents.writer as writer

        original_write = writer._OpenShard.write

        def write(self, *args, **kwargs):
            if self.index == fault_step:
                raise RuntimeError(f"injected fault in shard {fault_step}")
            return original_write(self, *args, **kwargs)

        writer._OpenShard.write = write
    elif fault == "export-hang":
        import parallel_latent.latents.writer as writer

        original_begin = writer.ShardWriter.begin

        def begin(self, index, *args, **kwargs):
            if index == fault_step:
                threading.Event().wait()
            return original_begin(self, index, *args, **kwargs)

        writer.ShardWriter.begin = begin
    elif fault == "prepare":
        import importlib

        # Not ``import ... as``: the package re-exports a function under the module's name.
        preparing = importlib.import_module("parallel_latent.data.prepare")

        def prepare(*args, **kwargs):
            raise RuntimeError("injected fault while preparing")

        preparing.prepare = prepare
    elif fault == "hang":
        rendezvous.job_store = lambda *args, **kwargs: act()
    elif fault_step == 0:
        startup.build_datasets = lambda *args, **kwargs: act()
    else:
        original_step = Trainer.train_step

        def train_step(self, *args, **kwargs):
            if self.step + 1 == fault_step:
                act()
            return original_step(self, *args, **kwargs)

        Trainer.train_step = train_step
