"""benchmarks/gpu.sh and benchmarks/bench_gpu.py on the CPU: the whole script end to end (ALLOW_CPU=1,
the shrunk model), its deadline, and the pieces of its table. Only exit codes, lines and figures are
checked, never a timing."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time

import pytest

from benchmarks import bench_gpu, gpu_table
from tests.helpers.benchmarks import BENCHMARKS, run_in_repo


def run_gpu_script(tmp_path, env: dict, *args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "ALLOW_CPU": "1", "PYTHON": sys.executable, "TMPDIR": str(tmp_path),
           "GPU_OUT": str(tmp_path / "out"), **env}  # fmt: skip
    command = ["bash", str(BENCHMARKS / "gpu.sh"), "--quick", "--json", str(tmp_path / "gpu.json"), *args]
    return run_in_repo(command, env)


# Every kind of row in two runs well under a minute each: gpu.sh end to end with the default row and
# the projection after it, and bench_gpu.py (gpu.sh's last step) in this process with the compiled row,
# a row whose name holds a space (dropout0 micro32) and the export, no projection (every row's
# projection is tests/benchmarks/test_bench_projection.py's). The rows not run here (micro32,
# dropout0) differ from these only in the config values they pass. way -> (ROWS, the table's first
# three columns, figures among those recorded, whether the projection runs).
EVERY_ROW = {
    "gpu.sh": ("default", [["0.1", "8", "false"]], {"MFU, default"}, True),
    "bench_gpu.py": (
        "compile,dropout0 micro32,encode-corpus",
        [["0.1", "8", "true"], ["0.0", "4", "false"]],
        {"MFU, compile", "steady step, dropout0 micro32", "encode-corpus export / bare encode loop"},
        False,
    ),
}


@pytest.mark.slow
@pytest.mark.parametrize("way", list(EVERY_ROW))
def test_gpu_script_runs_every_row_on_cpu_when_allowed(tmp_path, monkeypatch, capsys, way):
    """benchmarks/gpu.sh end to end on the CPU (ALLOW_CPU=1, the shrunk model): the node's freeze
    saved, the GPU tests collected and skipped, the facts, then each training row in bf16 through
    the real trainer and the encode-corpus row, one table with the synchronised columns, and the
    projection after the rows. The rows are split between gpu.sh and a run of bench_gpu.py here
    (what gpu.sh runs after its GPU tests), so that no run takes the whole matrix's minutes."""
    rows_env, expected, wanted, projected = EVERY_ROW[way]
    out = tmp_path / "out"
    # Two steps, a window each: the first holds the first step, the second is the steady one. The
    # compile row's graphs go through dynamo and AOTAutograd (torch.compile's debug override of the
    # backend) but not inductor's C++ for the CPU, which no GPU runs and which would be most of the
    # test's time (minutes of the C compiler).
    env = {"STEPS": "2", "LOG_EVERY": "1", "DEADLINE_S": "1200", "GPU_OUT": str(out), "ROWS": rows_env,
           "TORCH_COMPILE_OVERRIDE_BACKENDS": ">=0:aot_eager", "PROJECTION": "1" if projected else "0"}  # fmt: skip
    if way == "gpu.sh":
        result = run_gpu_script(tmp_path, env)
        assert result.returncode == 0, result.stdout + result.stderr
        lines = result.stdout.strip().splitlines()
        assert lines[0].startswith("GPU tests (pytest -m gpu, exit 0): 4 skipped"), lines[0]
        assert (out / "pip-freeze.txt").read_text().strip() and (out / "gpu-tests.xml").is_file()
        facts = lines[1]
    else:
        for name, value in {**env, "ALLOW_CPU": "1"}.items():
            monkeypatch.setenv(name, value)
        for name in ("NPROC", "GPU_TESTS_XML", "GPU_SH_STARTED_AT"):
            monkeypatch.delenv(name, raising=False)
        monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))  # where its scratch directory goes
        monkeypatch.setattr(sys, "argv", ["bench_gpu.py", "--quick", "--json", str(tmp_path / "gpu.json")])
        status = bench_gpu.main()
        stdout, stderr = capsys.readouterr()
        assert status == 0, stdout + stderr
        lines = stdout.strip().splitlines()
        facts = lines[0]
    assert facts.startswith("torch ") and "DeepSpeed" in facts and "C compiler" in facts
    header = next(i for i, line in enumerate(lines) if line.split()[:3] == ["dropout", "micro", "compile"])
    assert "start-up s" in lines[header] and "1st step s" in lines[header] and "attention" in lines[header]
    rows = [line.split() for line in lines[header + 1 : header + 1 + len(expected)]]
    assert [row[:3] for row in rows] == expected
    assert all(row[7] == "-" and row[8] == "-" for row in rows)  # syncs and kernels are counted on CUDA only
    assert all(row[9] != "nan" and row[10] != "nan" for row in rows)  # start-up, first step (0.0: under 50 ms)
    assert all((row[-2] != "nan") == projected for row in rows)  # the projection, after the rows
    if "encode-corpus" in rows_env:
        assert lines[header + 1 + len(expected)].startswith("encode-corpus: export ")
    figures = {f["name"]: f["value"] for f in json.loads((tmp_path / "gpu.json").read_text())["figures"]}
    names = set(figures)
    timed = [name for name in names if name.startswith(("first step, ", "start-up to the first step, "))]
    assert len(timed) == 2 * len(expected) and all(figures[name] > 0 for name in timed)
    assert wanted <= names
    assert not list(tmp_path.glob("parallel-latent-gpu-bench.*"))  # cleaned up


@pytest.mark.slow
def test_gpu_script_stops_at_its_deadline_with_a_partial_table(tmp_path, monkeypatch, capsys):
    """A deadline too short for the matrix: the unfinished runs are named, the table of the finished
    ones (none here) is printed, and the script exits 0 soon after the deadline. bench_gpu.py runs
    here in this process as gpu.sh's last step would, told (GPU_SH_STARTED_AT) that gpu.sh started
    80 s of its 90 s deadline ago: the deadline counts from gpu.sh's start, and the first row starts
    at once (no interpreter, install or GPU tests to wait for: what the facts and the plan import is
    imported before the clock starts) and runs out of it."""
    import torch  # noqa: F401

    import parallel_latent.config  # noqa: F401

    deadline, started_ago = 90, 80
    left = deadline - started_ago
    for name, value in {"ALLOW_CPU": "1", "STEPS": "100000", "LOG_EVERY": "1000", "DEADLINE_S": str(deadline),
                        "GPU_SH_STARTED_AT": str(time.time() - started_ago)}.items():  # fmt: skip
        monkeypatch.setenv(name, value)
    for name in ("ROWS", "NPROC", "GPU_TESTS_XML", "PROJECTION"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setattr(sys, "argv", ["bench_gpu.py", "--quick", "--json", str(tmp_path / "gpu.json")])
    started = time.monotonic()
    status = bench_gpu.main()
    elapsed = time.monotonic() - started
    out, err = capsys.readouterr()
    assert status == 0, out + err
    lines = out.splitlines()
    assert any(line.split()[:3] == ["dropout", "micro", "compile"] for line in lines)
    unfinished = [line for line in lines if line.startswith("not in the table: ")]
    assert unfinished and "ran out of time (deadline" in unfinished[0]
    assert all("not started: deadline reached" in line for line in unfinished[1:])
    # The deadline, then the table: not the 100,000 steps (a bound 10x what it waits for).
    assert elapsed < 10 * left, elapsed


def test_gpu_rows_put_the_goals_first_and_their_timeouts_fit_the_deadline(monkeypatch):
    """The default row, then compile (the 50% claim), then micro-batch 32, the dropout-0 rows and
    encode-corpus; their timeouts add up inside the default deadline with room for the install and
    the GPU tests; a failed dropout-kernel test makes the training rows eager."""
    monkeypatch.delenv("ROWS", raising=False)
    rows = bench_gpu.chosen_rows(quick=False, compile_dropout=True)
    assert [name for name, *_ in rows] == ["default", "compile", "micro32", "dropout0", "dropout0 micro32",
                                           "encode-corpus"]  # fmt: skip
    assert rows[1][1] == {"model.dropout": "0.1", "training.micro_batch_size": "256", "training.compile": "true"}
    assert sum(timeout for *_, timeout in rows) + 60 + 60 <= 480  # + the GPU tests, + an install
    eager = bench_gpu.chosen_rows(quick=False, compile_dropout=False)
    assert all(s.get("training.compile_dropout") == "false" for name, s, _ in eager if name != "encode-corpus")
    monkeypatch.setenv("ROWS", "micro32,nope")
    with pytest.raises(SystemExit, match="ROWS names nope"):
        bench_gpu.chosen_rows(quick=True, compile_dropout=True)


def test_the_gpu_tests_verdict_on_the_dropout_kernel_is_read_from_their_junit_file(tmp_path):
    junit = tmp_path / "gpu-tests.xml"
    for body, verdict in (("", True), ("<failure message='x'/>", False), ("<skipped message='no CUDA'/>", None)):
        junit.write_text(f"<testsuites><testsuite><testcase name='{bench_gpu.DROPOUT_TEST}'>{body}</testcase>"
                         "</testsuite></testsuites>")  # fmt: skip
        assert bench_gpu.compiled_dropout_passed(str(junit)) is verdict
    assert bench_gpu.compiled_dropout_passed(str(tmp_path / "absent.xml")) is None


def test_gpu_table_names_what_fell_back_the_attention_kernel_and_the_projection(caplog, capsys):
    """The warning of a real failed compile (CompiledWithFallback's) marks the row; the attention
    kernels' names give the SDPA backend; the projection's figures stand after the measured ones."""
    import torch

    from parallel_latent.parallel.compile import CompiledWithFallback

    def breaks_the_graph(x):
        torch._dynamo.graph_break()  # under fullgraph=True: compiling fails, eager runs
        return x + 1

    with caplog.at_level("WARNING"):
        assert CompiledWithFallback(breaks_the_graph, "the Perceiver blocks")(torch.ones(2)).tolist() == [2.0, 2.0]
    fell_back = gpu_table.fallbacks(caplog.text)
    assert list(fell_back) == ["blocks"] and fell_back["blocks"].startswith("the Perceiver blocks: ")
    names = {"fmha_cutlassF_bf16_aligned_64x64_rf_sm80": 22, "fmha_cutlassB_bf16_aligned_64x64_k64_sm80": 24}
    assert gpu_table.attention_kernels(names) == "efficient"
    assert gpu_table.attention_kernels({"pytorch_flash::flash_fwd_kernel": 1}) == "flash"

    setting = {"model.dropout": "0.1", "training.micro_batch_size": "256", "training.compile": "true"}
    measured = {"tokens_per_s": 1e6, "step_ms": 55.0, "mfu": 0.3, "peak_gib": 40.0, "syncs": 0, "kernels": 870,
                "attention": "efficient", "startup_s": 21.0, "first_step_s": 64.0, "fallbacks": fell_back}  # fmt: skip
    projection = {"step_ms_overlapped": 49.2, "step_ms_summed": 60.4, "mfu_overlapped": 0.31, "mfu_summed": 0.26}
    gpu_table.print_table([("compile", setting, measured)], {"compile": projection})
    header, row, note = capsys.readouterr().out.splitlines()
    assert header.split()[-5:] == ["proj", "ms", "proj", "MFU", "%"]
    assert row.split() == ["0.1", "256", "true", "1,000,000", "55.0", "30.0", "40.00", "0", "870", "21.0", "64.0",
                           "efficient", "blocks", "49.2", "31.0"]  # fmt: skip
    assert note.startswith("fell back to eager in dropout=0.1, micro_batch_size=256, compile=true: the Perceiver")
    gpu_table.print_table([("compile", setting, {**measured, "fallbacks": {}})], {})  # no projection
    header, row = capsys.readouterr().out.splitlines()
    assert row.split()[-4:] == ["efficient", "-", "nan", "nan"]
