"""Fault injection into one rank of a real job (never imported by the package).

A directory with this file on ``PYTHONPATH`` makes the process whose ``RANK`` is ``$PL_FAULT_RANK``
fail at optimizer step ``$PL_FAULT_STEP`` (1-based): ``PL_FAULT=raise`` raises a RuntimeError (an
unexpected failure), ``PL_FAULT=kill`` sends itself SIGKILL (a rank that dies without a word).
Python imports ``sitecustomize`` at start-up in every process that sees the variable; only the
named rank of a training job acts on it.
"""

import os

if os.environ.get("PL_FAULT") and os.environ.get("RANK") == os.environ.get("PL_FAULT_RANK"):
    import signal

    from parallel_latent.training.trainer import Trainer

    fault, fault_step = os.environ["PL_FAULT"], int(os.environ["PL_FAULT_STEP"])
    original_step = Trainer.train_step

    def train_step(self, *args, **kwargs):
        if self.step + 1 == fault_step:
            if fault == "kill":
                os.kill(os.getpid(), signal.SIGKILL)
            raise RuntimeError(f"injected fault at step {fault_step}")
        return original_step(self, *args, **kwargs)

    Trainer.train_step = train_step
