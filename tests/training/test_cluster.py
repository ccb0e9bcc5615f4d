"""Cluster readiness on one machine: two torchrun "nodes" whose run directories differ (node-local
disks) are refused in seconds with one line instead of hanging at the first checkpoint; the first
process of a node fetches hub files before the others read them from the cache."""

from __future__ import annotations

import time

import pytest

from tests.helpers.trainer_runs import TINY, run_two_nodes

pytestmark = pytest.mark.slow


def test_node_local_run_directories_are_refused_quickly(tmp_path, monkeypatch):
    """Two agents (NNODES=2, 2 ranks each) on 127.0.0.1, each in its own working directory, with a
    relative logging.run_dir: the two "nodes" see different directories, like node-local disks.
    (torchrun would restart a job that fails this way too, and each attempt fail the same: no
    restarts here, so that the time is one attempt's.)"""
    monkeypatch.setenv("MAX_RESTARTS", "0")
    overrides = [*TINY, "parallel.tensor_parallel=2", "logging.run_dir=run", "training.max_steps=2"]
    workdirs = (tmp_path / "node0", tmp_path / "node1")
    for workdir in workdirs:
        workdir.mkdir()
    started = time.monotonic()
    agents, outputs = run_two_nodes(overrides, workdirs, timeout=400)
    elapsed = time.monotonic() - started
    assert all(agent.returncode != 0 for agent in agents), outputs
    # A bound that only catches a hang (the rendezvous would wait 900 s): about 10x the usual 20 s.
    assert elapsed < 300, f"took {elapsed:.0f}s to stop"
    errors = [line for line in "".join(outputs).splitlines() if line.startswith("parallel-latent: error:")]
    assert len(errors) == 1 and "logging.run_dir=run is not one directory for all ranks" in errors[0], outputs
    assert not (tmp_path / "node0" / "run").exists() and not (tmp_path / "node1" / "run").exists()


def load_twice(gpt2_dir: str, tokenizer_dir: str, log: str) -> tuple[int, int]:
    """Every rank loads the tokenizer and a pretrained GPT-2 the way the trainer does, recording
    when each from_pretrained call starts and ends."""
    import transformers

    from parallel_latent.config import Config, FeatureModelConfig, ModelConfig, TokenizerConfig
    from parallel_latent.feature_model.tokenizer import apply_tokenizer_facts, tokenizer_facts
    from parallel_latent.parallel import initialize_model_parallel
    from parallel_latent.training.startup import build_model_once_per_node, load_tokenizer_once_per_node

    state = initialize_model_parallel(1)
    rank = state.rank

    def recorded(cls):
        original = cls.from_pretrained.__func__

        def from_pretrained(klass, *args, **kwargs):
            with open(log, "a") as handle:
                handle.write(f"start {rank} {cls.__name__}\n")
            try:
                return original(klass, *args, **kwargs)
            finally:
                time.sleep(0.2)  # the others, if they did not wait, would start in this window
                with open(log, "a") as handle:
                    handle.write(f"end {rank} {cls.__name__}\n")

        cls.from_pretrained = classmethod(from_pretrained)

    # The classes' own attributes, put back at the end: the pool's ranks run other modules' tasks next.
    own = {cls: cls.__dict__.get("from_pretrained") for cls in (transformers.AutoTokenizer, transformers.GPT2Model)}
    for cls in own:
        recorded(cls)
    try:
        cfg = Config(
            model=ModelConfig(d_model=32, n_heads=2, n_encoder_layers=1, n_decoder_layers=1, max_length=8),
            feature_model=FeatureModelConfig(name_or_path=gpt2_dir, pretrained=True),
            tokenizer=TokenizerConfig(name_or_path=tokenizer_dir),
        )
        tokenizer = load_tokenizer_once_per_node(cfg)
        cfg = apply_tokenizer_facts(cfg, tokenizer_facts(tokenizer))
        model = build_model_once_per_node(cfg, state.tp_group)
        return len(tokenizer), model.feature_model.token_table.shape[0]
    finally:
        for cls, attribute in own.items():
            if attribute is None:
                del cls.from_pretrained
            else:
                cls.from_pretrained = attribute


def test_the_first_process_of_a_node_fetches_first(pool4, tmp_path):
    from transformers import GPT2Config, GPT2Model

    from parallel_latent.config import TokenizerConfig
    from parallel_latent.feature_model.tokenizer import load_tokenizer

    load_tokenizer(TokenizerConfig()).save_pretrained(tmp_path / "tokenizer")
    config = GPT2Config(n_layer=3, n_head=2, n_embd=32, vocab_size=50257, bos_token_id=None, eos_token_id=None)
    GPT2Model(config).save_pretrained(tmp_path / "gpt2")
    log = tmp_path / "calls.log"
    sizes = pool4.run(load_twice, str(tmp_path / "gpt2"), str(tmp_path / "tokenizer"), str(log))  # one node
    assert sizes == [(50259, 50259)] * 4
    events = log.read_text().split("\n")[:-1]
    for name in ("AutoTokenizer", "GPT2Model"):
        sequence = [line.split()[:2] for line in events if line.endswith(name)]
        assert len(sequence) == 8, sequence  # every rank loaded once
        # Rank 0 (the node's first process) finished before any other rank started.
        assert sequence[:2] == [["start", "0"], ["end", "0"]], sequence
