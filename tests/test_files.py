"""The bounded readers of parallel_latent/files.py: every JSON file a job reads is parsed within
bounds (size, depth, finite numbers), and a directory that must be self-contained is walked without
following a link, its loops and links out said in one line."""

from __future__ import annotations

import json
import os

import pytest

from parallel_latent.errors import BadInput
from parallel_latent.files import JSON_MAX_DEPTH, JSONProblem, link_problem, load_json_file, parse_json


@pytest.mark.parametrize(
    "text, expected",
    [
        ("[" * 100_000 + "]" * 100_000, f"nested deeper than {JSON_MAX_DEPTH} levels"),
        ("[" * (JSON_MAX_DEPTH + 1) + "]" * (JSON_MAX_DEPTH + 1), f"nested deeper than {JSON_MAX_DEPTH} levels"),
        ('{"lr": NaN}', "holds NaN"),
        ('{"lr": -Infinity}', "holds -Infinity"),
        ('{"step": 1e400}', "holds the number 1e400, out of a float's range"),
        ('{"step": ' + "9" * 5000 + "}", "not readable JSON"),
        ('{"step": 1', "invalid JSON: Expecting ',' delimiter (column 11)"),
        (b'{"a": "\xc3\x28"}', "not readable JSON (not UTF-8 text)"),
    ],
)
def test_json_outside_the_bounds_is_one_line(text, expected):
    with pytest.raises(JSONProblem) as caught:
        parse_json(text)
    message = str(caught.value)
    assert expected in message and "\n" not in message and len(message) < 200, message
    assert isinstance(caught.value, BadInput)  # status 2 wherever it is not caught


def test_json_within_the_bounds_is_read_as_it_is():
    nested = "[" * JSON_MAX_DEPTH + "]" * JSON_MAX_DEPTH
    assert parse_json(nested) is not None
    value = {"step": 10**30, "lr": 2e-3, "name": "x", "list": [1, 2.5, None, True]}
    assert parse_json(json.dumps(value)) == value  # ranges beyond JSON's are the schemas' to judge


def test_a_json_file_names_itself_and_its_size_is_bounded(tmp_path):
    path = tmp_path / "client_state.json"
    path.write_text('{"lr": NaN}')
    with pytest.raises(JSONProblem, match=f"^{path}: holds NaN"):
        load_json_file(path)
    path.write_text('{"a": "' + "x" * 2000 + '"}')
    with pytest.raises(JSONProblem, match="2009 bytes, more than the 1000"):
        load_json_file(path, max_bytes=1000)
    with pytest.raises(FileNotFoundError):  # the caller's to say
        load_json_file(tmp_path / "missing.json")


def test_links_that_loop_or_leave_a_directory_are_one_line(tmp_path):
    directory = tmp_path / "checkpoint"
    (directory / "rng").mkdir(parents=True)
    (directory / "weights.bin").write_bytes(b"x")
    os.symlink("weights.bin", directory / "inside")  # a link within the directory is its own
    assert link_problem(directory, "the checkpoint's directory") is None
    os.symlink(directory / "rng" / "b", directory / "rng" / "a")
    os.symlink(directory / "rng" / "a", directory / "rng" / "b")
    assert link_problem(directory, "the checkpoint's directory") == f"{directory / 'rng' / 'a'}: a symbolic link loop"
    for name in ("a", "b"):
        (directory / "rng" / name).unlink()
    (tmp_path / "elsewhere").write_text("x")
    os.symlink(tmp_path / "elsewhere", directory / "rng" / "out")
    problem = link_problem(directory, "the checkpoint's directory")
    assert (
        problem
        == f"{directory / 'rng' / 'out'}: a link to {tmp_path / 'elsewhere'}, outside the checkpoint's directory"
    )
    (directory / "rng" / "out").unlink()
    os.symlink(tmp_path / "gone", directory / "dangling")
    assert link_problem(directory, "x").endswith(f"a link to {tmp_path / 'gone'}, which does not exist")
