"""benchmarks/harness.py's timing ratios: the repeats run the variants in turn, in alternating order;
a ratio is the median of the per-repeat ratios with its min, max, CPU-time ratio and load; repeats
go on until the two halves agree, or up to the limit, when the ratio is reported unstable. Timings
are supplied by the variants themselves here, so every figure is known exactly."""

from __future__ import annotations

import json

import pytest

from benchmarks import harness, run_all


def scripted(walls: list[float]):
    """A variant that reports these wall times, one per call (its own clock, as a barrier-synced
    variant does), and the order of the calls."""
    calls = iter(walls)
    return lambda: next(calls)


def test_the_variants_run_in_turn_in_alternating_order():
    order = []
    fns = {name: (lambda name=name: order.append(name) or 1.0) for name in ("a", "b", "c")}
    harness.interleaved(fns, repeats=4, warmup=1)
    assert order == ["a", "b", "c"] + ["a", "b", "c", "c", "b", "a"] * 2  # warm-up, then A B C, C B A, ...


def test_a_ratio_is_the_median_of_the_per_repeat_ratios_with_its_extremes():
    ours = scripted([9.0, 2.0, 3.0, 4.0, 5.0])  # the first call is the warm-up's
    base = scripted([9.0, 2.0, 2.0, 2.0, 4.0])
    spread = harness.interleaved({"ours": ours, "base": base}, repeats=4, warmup=1).spread("ours", "base")
    ratios = [1.0, 1.5, 2.0, 1.25]
    assert (spread.low, spread.median, spread.high, spread.repeats) == (1.0, 1.375, 2.0, 4)
    assert spread.median == pytest.approx(sorted(ratios)[1] / 2 + sorted(ratios)[2] / 2)
    assert not spread.stable  # halves 1.25 and 1.625: far apart


def test_repeats_go_on_until_the_halves_agree_or_the_limit():
    # After 4 repeats the halves' medians are 1.0 and 1.2; after 4 more, 1.1 and 1.1: it stops at 8.
    drifting = [1.0] + [1.0, 1.0, 1.2, 1.2] * 5
    base = [1.0] * len(drifting)
    samples = harness.interleaved({"a": scripted(drifting), "b": scripted(base)}, repeats=4, warmup=1,
                                 ratios=[("a", "b")], most=12)  # fmt: skip
    assert len(samples.wall["a"]) == 8 and samples.spread("a", "b").stable
    noisy = [1.0] + [1.0, 1.0, 1.5, 1.5, 1.5, 1.5, 1.5, 1.5]  # halves 1.0 / 1.5, then 1.25 / 1.5
    samples = harness.interleaved({"a": scripted(noisy), "b": scripted([1.0] * 9)}, repeats=4, warmup=1,
                                 ratios=[("a", "b")], most=8)  # fmt: skip
    spread = samples.spread("a", "b")
    assert spread.repeats == 8 and not spread.stable
    # Every process of a measurement stops together: their verdicts are combined before acting on one.
    verdicts = []
    harness.interleaved({"a": scripted(drifting), "b": scripted(base)}, repeats=4, warmup=1, ratios=[("a", "b")],
                       most=20, agree=lambda settled: verdicts.append(settled) or False)  # fmt: skip
    assert verdicts == [False, True, False, True]  # after 4, 8, 12 and 16 repeats (halves of 12: 1.0 / 1.2)


def test_halves_agree_within_the_stated_fraction():
    assert harness.halves_agree([1.0, 1.0, 1.02, 1.02])
    assert not harness.halves_agree([1.0, 1.0, 1.03, 1.03])
    assert not harness.halves_agree([1.0, 1.0, 1.0])  # too few to say


def test_a_figure_with_a_spread_prints_and_records_it(tmp_path, capsys, monkeypatch):
    spread = harness.Spread(low=0.9, median=0.95, high=1.01, cpu=0.96, repeats=16, load=1.25, stable=False)
    monkeypatch.setattr("sys.argv", ["bench_x.py", "--json", str(tmp_path / "x.json")])
    args = type("Args", (), {"quick": False, "json": str(tmp_path / "x.json")})()
    report = harness.Report("bench_x", args)
    report.figure("x / y", spread.median, "x", at_most=1.0, spread=spread)
    report.write()
    line = capsys.readouterr().out.strip()
    words = "0.9-1.01 over 16 repeats, CPU time 0.96, load 1.2, unstable"
    assert line == f"figure: x / y = 0.95 x [{words}] (goal <= 1: met)"
    [figure] = json.loads((tmp_path / "x.json").read_text())["figures"]
    assert figure["spread"] == {"low": 0.9, "median": 0.95, "high": 1.01, "cpu": 0.96, "repeats": 16, "load": 1.25,
                                "stable": False}  # fmt: skip
    assert run_all.value_cell(figure) == f"0.95 x ({words})"
