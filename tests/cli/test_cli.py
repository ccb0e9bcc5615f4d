"""The command line: bad input is one line on stderr, a non-zero exit and nothing written."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from parallel_latent import cli
from parallel_latent.errors import ExitStatus
from parallel_latent.launching import local
from tests.helpers.trainer_runs import REPO, TINY, TINY_CONFIG, rank_env


def train_argv(run_dir, *overrides, nproc=None):
    argv = ["train", "--config", str(TINY_CONFIG), *TINY, f"logging.run_dir={run_dir}", *overrides]
    return argv + ([f"--nproc={nproc}"] if nproc else [])


def assert_one_line_error(capsys, expected: str) -> None:
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if line.strip()]
    assert len(lines) == 1, err
    assert lines[0].startswith("parallel-latent: error: ") and expected in lines[0], lines[0]


@pytest.mark.parametrize(
    "nproc, overrides, expected",
    [
        (2, ["model.n_headz=3"], "unknown key model.n_headz, did you mean 'n_heads'?"),
        (3, ["parallel.tensor_parallel=2"], "world size 3 is not divisible by parallel.tensor_parallel=2"),
        (None, ["parallel.tensor_parallel=3"], "parallel.tensor_parallel=3 does not divide model.n_heads=4"),
        (
            2,
            ["parallel.tensor_parallel=1", "training.global_batch_size=12"],
            "training.global_batch_size=12 != training.micro_batch_size=4 x training.grad_accum_steps=1 x "
            "data-parallel size 2",
        ),
        (2, ["data.path=/nonexistent/corpus.txt"], "/nonexistent/corpus.txt: data path does not exist"),
        (
            None,
            ["parallel.tensor_parallel=1", "data.path=/nonexistent/corpus.txt"],
            "/nonexistent/corpus.txt: data path does not exist",
        ),
        (
            None,
            ["parallel.tensor_parallel=1", "training.precision=fp16"],
            "training.precision=fp16 needs a CUDA device",
        ),
        (None, [], "parallel.tensor_parallel=2 needs 2 processes: add --nproc 2"),
    ],
    ids=[
        "unknown-key",
        "tp-vs-world",
        "tp-vs-heads",
        "global-batch-vs-dp",
        "missing-corpus-launch",
        "missing-corpus-single",
        "fp16-on-cpu",
        "tp2-without-nproc",
    ],
)
def test_bad_train_input_is_one_line_and_writes_nothing(tmp_path, capsys, nproc, overrides, expected):
    if expected.startswith("training.precision=fp16"):
        pytest.importorskip("torch")
        import torch

        if torch.cuda.is_available():
            pytest.skip("fp16 is valid with CUDA")
    run_dir = tmp_path / "run"
    assert cli.main(train_argv(run_dir, *overrides, nproc=nproc)) == ExitStatus.BAD_INPUT
    assert_one_line_error(capsys, expected)
    assert not run_dir.exists()


def test_unknown_key_in_the_yaml_file_from_a_real_shell(tmp_path):
    """The installed entry point, as a user runs it: exit 2, one line naming file and key, no
    traceback, no run directory."""
    config = tmp_path / "bad.yaml"
    text = TINY_CONFIG.read_text()
    assert "\nmodel:\n" in text
    config.write_text(text.replace("\nmodel:\n", "\nmodel:\n  dropuot: 0.2\n"))
    run_dir = tmp_path / "run"
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "parallel_latent",
            "train",
            "--config",
            str(config),
            "--nproc",
            "2",
            f"logging.run_dir={run_dir}",
        ],
        cwd=REPO,
        env=rank_env(),
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert result.returncode == 2
    assert result.stderr.strip().splitlines() == [
        f"parallel-latent: error: {config}: model.dropuot: unknown key, did you mean 'dropout'? (known: d_model, "
        "n_heads, n_encoder_layers, n_decoder_layers, mlp_ratio, max_length, dropout, init_std, vocab_size, "
        "mask_token_id, pad_token_id, activation_checkpointing, head, encoder_context_positions, num_latents, "
        "latent_dim, predict_length, latent_noise, feature_norm, feature_norm_samples, feature_window)"
    ]
    assert not run_dir.exists()


def test_resume_never_refuses_to_overwrite_existing_checkpoints(tmp_path, capsys):
    run_dir = tmp_path / "run"
    (run_dir / "checkpoints" / "step_00000010").mkdir(parents=True)
    assert cli.main(train_argv(run_dir, "checkpoint.resume=never", nproc=2)) == ExitStatus.BAD_INPUT
    assert_one_line_error(capsys, "checkpoint.resume=never but")
    assert sorted(p.name for p in (run_dir / "checkpoints").iterdir()) == ["step_00000010"]


def test_missing_resume_checkpoint(tmp_path, capsys):
    argv = train_argv(tmp_path / "run", f"checkpoint.resume={tmp_path / 'nope'}", nproc=2)
    assert cli.main(argv) == ExitStatus.BAD_INPUT
    assert_one_line_error(capsys, "no such checkpoint")


def test_deepspeed_overrides_must_be_a_json_object(tmp_path, capsys):
    argv = train_argv(tmp_path / "run", nproc=2) + ["--deepspeed-overrides", "{not json"]
    assert cli.main(argv) == ExitStatus.BAD_INPUT
    assert_one_line_error(capsys, "--deepspeed-overrides: invalid JSON")


def test_more_processes_than_gpus_is_refused_before_any_worker_starts(tmp_path, capsys, monkeypatch):
    """On a 1-GPU host, --nproc 2 would put both ranks on cuda:0 and NCCL would abort after the
    whole start-up: refused at once instead (the device count is patched: no GPU here)."""
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "3")
    monkeypatch.setattr(local, "launch_local", lambda *a: pytest.fail("workers were started"))
    assert cli.main(train_argv(tmp_path / "run", nproc=2)) == 2
    assert_one_line_error(capsys, "--nproc 2 needs 2 GPUs but 1 is visible (CUDA_VISIBLE_DEVICES=3)")
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize(
    "option, message",
    [
        ("--nproc=0", "--nproc 0: must be between 1 and 1024"),
        ("--nproc=100000", "--nproc 100000: must be between 1 and 1024"),
        ("--max-restarts=-1", "--max-restarts -1: must be between 0 and 1000"),
        ("--wait-for-lock=1e9", "--wait-for-lock 1e+09: must be between 0 and 604800 (seconds, at most a week)"),
    ],
)
def test_numeric_options_are_bounded(tmp_path, capsys, option, message):
    assert cli.main(train_argv(tmp_path / "run", nproc=2) + [option]) == ExitStatus.BAD_INPUT
    assert_one_line_error(capsys, message)
    assert not (tmp_path / "run").exists()


def test_ranks_run_the_command_without_nproc():
    args = cli.build_parser().parse_args(
        ["train", "--config", "c.yaml", "--nproc", "4", "a.b=1", "--deepspeed-overrides", "{}"]
    )
    assert cli.train._rank_argv(args) == ["train", "--config", "c.yaml", "--deepspeed-overrides", "{}", "a.b=1"]
    command = local.torchrun_command(4, cli.train._rank_argv(args))
    assert command[1:7] == ["-m", "parallel_latent.launching.agent", "--standalone", "--nproc_per_node=4",
                            "--max-restarts=0", "-m"]  # fmt: skip
    assert "--max-restarts=2" in local.torchrun_command(4, cli.train._rank_argv(args), max_restarts=2)


def test_deepspeed_launchers_local_rank_argument_is_accepted():
    args = cli.build_parser().parse_args(["--local_rank=1", "train", "--config", "c.yaml"])
    assert args.command == "train" and args.local_rank == 1


def test_deepspeed_overrides_from_a_file(tmp_path):
    path = tmp_path / "ds.json"
    path.write_text(json.dumps({"zero_optimization": {"reduce_bucket_size": 1000}}))
    assert cli.train._parse_overrides_json(str(path)) == {"zero_optimization": {"reduce_bucket_size": 1000}}
    assert cli.train._parse_overrides_json('{"a": 1}') == {"a": 1}


def test_plot_of_a_missing_run_is_one_line(tmp_path, capsys):
    assert cli.main(["plot", str(tmp_path / "nothing")]) == ExitStatus.BAD_INPUT
    assert_one_line_error(capsys, "run directory does not exist")
    (tmp_path / "empty").mkdir()
    assert cli.main(["plot", str(tmp_path / "empty")]) == ExitStatus.BAD_INPUT
    assert_one_line_error(capsys, "no metrics.jsonl")


def test_reconstruct_without_a_checkpoint_is_one_line(tmp_path, capsys):
    assert cli.main(["reconstruct", "--checkpoint", str(tmp_path / "nothing"), "hello"]) == ExitStatus.BAD_INPUT
    assert_one_line_error(capsys, "no such checkpoint or run directory")


@pytest.mark.parametrize(
    ("option", "expected"),
    [
        ("--batch-size=0", "--batch-size 0: must be between 1 and 4096"),
        ("--batch-size=10000000", "--batch-size 10000000: must be between 1 and 4096"),
        ("--max-samples=-1", "--max-samples -1: must be between 0 and 2147483647 (0: every sample)"),
    ],
)
def test_evaluate_options_are_bounded_before_the_checkpoint_is_read(tmp_path, capsys, option, expected):
    """A batch of 0 would fail deep in range(); a negative sample count would report 0 samples, loss
    0.0 and exit 0; ten million samples in one batch would run the machine out of memory. Each is
    refused like a config key, before anything is loaded."""
    argv = ["evaluate", "--checkpoint", str(tmp_path / "not read"), option]
    assert cli.main(argv) == ExitStatus.BAD_INPUT
    assert_one_line_error(capsys, f"evaluate: {expected}")


def test_help_is_instant_and_lists_the_commands():
    result = subprocess.run(
        [sys.executable, "-m", "parallel_latent", "--help"],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert result.returncode == 0
    for command in ("train", "reconstruct", "plot"):
        assert command in result.stdout


# What building the parser may not load: the libraries the commands' handlers import.
HEAVY_MODULES = ("torch", "deepspeed", "transformers", "datasets", "numpy", "safetensors")


@pytest.mark.parametrize("argv", [["--help"], ["train", "--help"], ["evaluate", "--help"]])
def test_the_parser_and_help_import_no_heavy_library(argv):
    """`--help` of every level runs in a fresh interpreter; afterwards none of the heavy libraries is
    loaded (a count of modules, not a time: the parser is declared apart from the commands' libraries)."""
    probe = (
        "import sys\n"
        "from parallel_latent.cli import main\n"
        "try:\n"
        f"    main({argv!r})\n"
        "except SystemExit as stop:\n"
        "    assert stop.code == 0, stop.code\n"
        f"print(sorted(m for m in {HEAVY_MODULES!r} if m in sys.modules))\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", probe], cwd=REPO, capture_output=True, text=True, timeout=60, check=False
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip().splitlines()[-1] == "[]"


# --------------------------------------------------------------------------- #
# Every path argument of every subcommand, pointing at the wrong kind of thing.
# --------------------------------------------------------------------------- #


@pytest.fixture(scope="module")
def paths(tmp_path_factory):
    """A file, an empty directory, a missing path, and a real portable checkpoint (tiny model)."""
    import torch

    from parallel_latent.checkpoint import save_portable
    from parallel_latent.config import Config, FeatureModelConfig, ModelConfig
    from parallel_latent.feature_model.tokenizer import apply_tokenizer_facts, load_tokenizer, tokenizer_facts
    from parallel_latent.model import build_model

    root = tmp_path_factory.mktemp("paths")
    (root / "a_file").write_text("some text\n")
    (root / "a_dir").mkdir()
    tokenizer = load_tokenizer(Config().tokenizer)
    cfg = Config(
        model=ModelConfig(d_model=32, n_heads=2, n_encoder_layers=1, n_decoder_layers=1, max_length=8, dropout=0.0),
        feature_model=FeatureModelConfig(n_layer=3, n_head=2, n_embd=32),
    )
    cfg = apply_tokenizer_facts(cfg, tokenizer_facts(tokenizer))
    torch.manual_seed(0)
    save_portable(build_model(cfg), root / "ckpt", cfg, tokenizer_facts(tokenizer), step=1)
    return root


BAD_PATHS = [
    # (argv with {file}/{dir}/{missing}/{ckpt} placeholders, expected message)
    (["train", "--config", "{dir}"], "cannot read config file"),
    (["train", "--config", "{missing}"], "config file not found"),
    (["train", "--config", "CONFIG", "--deepspeed-overrides", "{dir}"], "--deepspeed-overrides is a directory"),
    (["train", "--config", "CONFIG", "--deepspeed-overrides", "{missing}"], "--deepspeed-overrides does not exist"),
    (["train", "--config", "CONFIG", "data.path={dir}"], "directory contains no"),
    (["train", "--config", "CONFIG", "logging.run_dir={file}"], "is a file, not a directory"),
    (["train", "--config", "CONFIG", "logging.run_dir={file}/run"], "is a file, not a directory"),
    (["train", "--config", "CONFIG", "checkpoint.resume={file}"], "checkpoint.resume={file}: is a file"),
    (["reconstruct", "--checkpoint", "{file}", "hi"], "{file}: is a file; expected a checkpoint or run directory"),
    (["reconstruct", "--checkpoint", "{dir}", "hi"], "no complete training checkpoint here"),
    (["reconstruct", "--checkpoint", "{missing}", "hi"], "no such checkpoint or run directory"),
    (["reconstruct", "--checkpoint", "{ckpt}", "--file", "{dir}"], "--file is a directory"),
    (["reconstruct", "--checkpoint", "{ckpt}", "--file", "{missing}"], "--file does not exist"),
    (["encode", "--checkpoint", "{ckpt}", "--out", "{dir}", "hi"], "--out is a directory"),
    (["encode", "--checkpoint", "{ckpt}", "--out", "{file}", "hi"], "--out exists; not overwriting"),
    (["encode", "--checkpoint", "{ckpt}", "--out", "{file}/x.safetensors", "hi"], "is a file, not a directory"),
    (["encode", "--checkpoint", "{file}", "--out", "{missing}", "hi"], "is a file; expected a checkpoint"),
    (["decode", "--checkpoint", "{ckpt}", "{dir}"], "latents is a directory"),
    (["decode", "--checkpoint", "{ckpt}", "{missing}"], "latents does not exist"),
    (["decode", "--checkpoint", "{ckpt}", "{file}"], "not a readable latents file"),
    (["evaluate", "--checkpoint", "{ckpt}", "--data", "{dir}"], "directory contains no"),
    (["evaluate", "--checkpoint", "{ckpt}", "--data", "{missing}"], "data path does not exist"),
    (["evaluate", "--checkpoint", "{dir}"], "no complete training checkpoint here"),
    (["plot", "{file}"], "run directory is a file, expected a directory"),
    (["plot", "{dir}", "--out", "{file}"], "output directory is a file"),
    (["export", "{file}", "{missing}"], "is a file; expected a checkpoint"),
    (["export", "{ckpt}", "{file}"], "already exists; not overwriting"),
    (["export", "{ckpt}", "{dir}"], "already exists; not overwriting"),
    (["consolidate", "{ckpt}", "{file}"], "exists and is a file"),
    (["consolidate", "{file}", "{missing}"], "is a file; expected a checkpoint"),
    (["consolidate", "{ckpt}", "{file}/single"], "Not a directory"),
    (["inspect", "{file}"], "is a file; expected a checkpoint"),
    (["inspect", "{missing}"], "no such checkpoint or run directory"),
    (["inspect", "{dir}"], "no complete training checkpoint here"),
    (["reshard", "{file}"], "is a file; expected a checkpoint"),
    (["reshard", "{dir}"], "no complete training checkpoint here"),
    (["prepare", "--config", "{dir}"], "cannot read config file"),
    (["prepare", "--config", "{missing}"], "config file not found"),
    (["prepare", "--config", "CONFIG", "data.path={dir}"], "{dir}: directory contains no"),
    (["prepare", "--config", "CONFIG", "data.path={missing}"], "{missing}: data path does not exist"),
    (["prepare", "--config", "CONFIG", "data.cache_dir={file}"], "{file}: cannot create the data cache directory"),
]


@pytest.mark.parametrize(("argv", "expected"), BAD_PATHS, ids=[" ".join(a) for a, _ in BAD_PATHS])
def test_a_path_of_the_wrong_kind_is_one_line_and_changes_nothing(paths, capsys, argv, expected):
    names = {"file": paths / "a_file", "dir": paths / "a_dir", "missing": paths / "missing", "ckpt": paths / "ckpt"}
    fill = {key: str(value) for key, value in names.items()}
    argv = [arg.replace("CONFIG", str(TINY_CONFIG)).format(**fill) for arg in argv]
    if argv[0] == "train":  # one process, a run directory that stays unwritten; the case's keys win
        argv[3:3] = [*TINY, "parallel.tensor_parallel=1", f"logging.run_dir={paths / 'run'}"]
    before = sorted(str(p.relative_to(paths)) for p in paths.rglob("*"))
    assert cli.main(argv) == ExitStatus.BAD_INPUT
    assert_one_line_error(capsys, expected.format(**fill))
    assert sorted(str(p.relative_to(paths)) for p in paths.rglob("*")) == before  # nothing written
    assert (paths / "a_file").read_text() == "some text\n"


def test_an_unreadable_input_is_one_line(paths, capsys):
    import os

    if os.geteuid() == 0:
        pytest.skip("runs as root, which reads any file: permission bits cannot make a file unreadable")
    secret = paths / "secret.txt"
    secret.write_text("x\n")
    secret.chmod(0)
    try:
        assert cli.main(["reconstruct", "--checkpoint", str(paths / "ckpt"), "--file", str(secret)]) == 2
        assert_one_line_error(capsys, "--file is not readable")
    finally:
        secret.chmod(0o644)
