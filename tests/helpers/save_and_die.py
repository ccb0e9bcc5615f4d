"""Run as a separate process: save step 1, then start saving step 2 with a pause before publishing,
so the test can kill -9 it between writing and publishing. ``--load`` instead resumes the latest
checkpoint and prints its step."""

from __future__ import annotations

import os
import sys

from tests.helpers.distributed import free_port, limit_threads


def main(directory: str, mode: str) -> None:
    os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))
    limit_threads()
    import torch.distributed as dist

    dist.init_process_group("gloo")
    from parallel_latent.checkpoint import load_training_checkpoint, save_training_checkpoint
    from parallel_latent.checkpoint.saving import PAUSE_BEFORE_PUBLISH_ENV
    from tests.helpers.checkpoint_engines import make_engine, train_step

    engine, model = make_engine(1, 2)
    if mode == "--load":
        loaded = load_training_checkpoint(engine, directory)
        print(f"loaded step {loaded.step} next {loaded.client_state['next_step']}", flush=True)
        return
    train_step(engine, model, 0)
    save_training_checkpoint(engine, directory, 1, {"next_step": 1}, keep_last=2)
    train_step(engine, model, 1)
    os.environ[PAUSE_BEFORE_PUBLISH_ENV] = "600"
    save_training_checkpoint(engine, directory, 2, {"next_step": 2}, keep_last=2)
    print("published step 2 (the test should have killed this process)", flush=True)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2] if len(sys.argv) > 2 else "--save")
