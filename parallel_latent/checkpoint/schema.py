"""What a training checkpoint's files hold, checked before a job that reads it is accepted.

The file record (:mod:`.integrity`) says whether the files are the ones that were saved; a record
can be rewritten to match anything, so this says whether they are files a resume can use: the
client state and every rank's RNG state have the keys and types the loaders read, one RNG file per
rank of the recorded layout, and every torch file unpickles nothing but tensors, containers and
DeepSpeed's plain data holders (read from its pickle opcodes, never by unpickling it) and whose
zip entries pass their CRC, each of DeepSpeed's files is the one written under its name (a key
the save adds: their contents name no rank) and a model state's sizes, step and tensor shapes
are the checkpoint's, and the portable export reads whole against its checksums. A file that
fails is damage, handled as a truncated one is: one line naming it.
"""

from __future__ import annotations

import json
import zipfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from parallel_latent.files import JSONProblem, link_problem, load_json_file
from parallel_latent.zero.checkpoint_files import state_file_problem

from .layout import CLIENT_STATE_FILE, PORTABLE_DIR, RNG_DIR, CheckpointError
from .shards import PortableCheckpoint

__all__ = ["CHECKPOINT_INFO", "CLIENT_STATE", "RNG_STATE", "content_damage", "schema_problem"]

# The classes DeepSpeed pickles into its checkpoint files beside tensors (zero/checkpoint_files.safe_torch_load
# allows the same): data holders whose unpickling runs no code of theirs.
ALLOWED_GLOBALS = frozenset(
    {
        "deepspeed.runtime.fp16.loss_scaler.LossScaler",
        "deepspeed.runtime.fp16.loss_scaler.DynamicLossScaler",
        "deepspeed.runtime.zero.config.ZeroStageEnum",
        "deepspeed.utils.tensor_fragment.fragment_address",
    }
)
MT_STATE_WORDS = 625  # Python's Mersenne Twister: 624 words and the position
WORD_MAX = 2**32 - 1  # each word of a Mersenne Twister's state


def _is_int(value: Any, low: int = 0) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= low


def _int_list(value: Any, length: int | None = None, high: int | None = None) -> bool:
    return (
        isinstance(value, list)
        and (length is None or len(value) == length)
        and all(_is_int(v) and (high is None or v <= high) for v in value)
    )


# A schema: a check of a value (a predicate and what it wants), or an object's keys, each with its
# schema and whether it must be there. Objects refuse keys they do not list: what a loader would
# read into an object's attributes must be known.
Check = tuple[Callable[[Any], bool], str]
COUNT: Check = (lambda v: _is_int(v) and v < 2**63, "an integer from 0 to 2^63 - 1")
POSITIVE: Check = (lambda v: _is_int(v, 1), "an integer >= 1")
INT: Check = (lambda v: _is_int(v, -(2**63)), "an integer")
TOKEN_ID: Check = (lambda v: v is None or _is_int(v), "a token id or null")
TEXT: Check = (lambda v: isinstance(v, str), "a string")
FLAG: Check = (lambda v: isinstance(v, bool), "true or false")
RATES: Check = (
    lambda v: isinstance(v, list) and all(isinstance(x, int | float) and not isinstance(x, bool) for x in v),
    "a list of numbers",
)
OBJECT_OR_NULL: Check = (lambda v: v is None or isinstance(v, dict), "an object or null")
BYTES: Check = (lambda v: bool(v) and _int_list(v, high=255), "a list of bytes")


def _keys(required: dict, optional: dict | None = None, others: bool = False) -> dict[Any, tuple[Any, bool]]:
    """An object's schema; ``others``: it may hold keys beyond these (a caller's own state)."""
    keys = {**{k: (v, True) for k, v in required.items()}, **{k: (v, False) for k, v in (optional or {}).items()}}
    return {**keys, ...: (None, False)} if others else keys


SAMPLER = _keys(
    {"epoch": COUNT, "batches_consumed": COUNT},
    {"grad_accum": POSITIVE, "seed": INT, "num_samples": COUNT, "global_batch_size": POSITIVE, "order": TEXT},
)
# torch's LambdaLR state, which its load_state_dict reads into the scheduler's attributes.
LR_SCHEDULER = _keys(
    {
        "base_lrs": RATES,
        "last_epoch": INT,
        "_step_count": COUNT,
        "_last_lr": RATES,
        "lr_lambdas": (lambda v: isinstance(v, list) and all(x is None or isinstance(x, dict) for x in v), "a list"),
    },
    {"_is_initial": FLAG, "_get_lr_called_within_step": FLAG, "verbose": FLAG},
)
CLIENT_STATE = _keys(
    {
        "step": COUNT,
        # The caller's state (the trainer's keys checked; a caller of the checkpoint package may add its own).
        "client": _keys({}, {"step": COUNT, "skipped_steps": COUNT, "sampler": SAMPLER}, others=True),
        "engine": _keys({"global_steps": COUNT, "global_samples": COUNT, "skipped_steps": COUNT}),
        "lr_scheduler": (LR_SCHEDULER, None),
        "tokenizer": (
            _keys(
                {},
                {"vocab_size": POSITIVE, "mask_token_id": TOKEN_ID, "pad_token_id": TOKEN_ID, "eos_token_id": TOKEN_ID},
            ),
            None,
        ),
        # The run's config: its model and decoder are compared with the job's (the rest is not read).
        "config": (_keys({}, {"model": OBJECT_OR_NULL, "feature_model": OBJECT_OR_NULL}, others=True), None),
    }
)
RNG_STATE = _keys(
    {
        "python": (
            lambda v: (
                isinstance(v, list)
                and len(v) == 3
                and _is_int(v[0])
                and _int_list(v[1], MT_STATE_WORDS, high=WORD_MAX)
                and v[1][-1] <= MT_STATE_WORDS - 1
                and (v[2] is None or isinstance(v[2], float))
            ),
            "a Python random state [version, 625 integers, gauss]",
        ),
        "numpy": (
            lambda v: (
                isinstance(v, list)
                and len(v) == 5
                and isinstance(v[0], str)
                and _int_list(v[1], 624, high=WORD_MAX)
                and _is_int(v[2])
                and v[2] <= 624
                and v[3] in (0, 1)
                and isinstance(v[4], float)
            ),
            "a NumPy random state [name, 624 integers, position, has_gauss, gauss]",
        ),
        "torch": BYTES,
        "dropout": (_keys({"seed": INT, "step": INT, "sample_offset": COUNT}), None),
    },
    {
        "cuda": (
            lambda v: v is None or (isinstance(v, list) and all(BYTES[0](s) for s in v)),
            "a list of CUDA RNG states or null",
        ),
        "rank": COUNT,
        "step": COUNT,
    },
)


def _map_of(schema: Any, wanted: str) -> Check:
    return (lambda v: isinstance(v, dict) and all(schema_problem(x, schema) is None for x in v.values()), wanted)


FILE_RECORD = _keys({"bytes": COUNT}, {"sha256": TEXT, "zip_crcs": TEXT})
SIZE_MAX = 2**31 - 1  # a tensor dimension, a stride: what a resume at another layout allocates
SIZES: Check = (lambda v: _int_list(v, high=SIZE_MAX), f"a list of sizes up to {SIZE_MAX}")
TENSOR_SPLIT = _keys(
    {
        "partition_dim": (lambda v: v is None or (_is_int(v) and v < 64), "a dimension or null"),
        "local_shape": SIZES,
        "full_shape": SIZES,
        "dtype": TEXT,
    },
    {
        "partition_stride": (lambda v: _is_int(v, 1) and v <= SIZE_MAX, f"an integer from 1 to {SIZE_MAX}"),
        "trainable": FLAG,
    },
)
CHECKPOINT_INFO = _keys(
    {
        "step": COUNT,
        "layout": _keys(
            {"tensor_parallel": POSITIVE, "data_parallel": POSITIVE, "zero_stage": COUNT, "world_size": POSITIVE},
            {"precision": TEXT},
        ),
    },
    {
        "tag": TEXT,
        "portable": FLAG,
        "universal": FLAG,
        "saved_at": TEXT,
        "deepspeed_version": TEXT,
        "optimizer_class": TEXT,
        "optimizer_param_names": (lambda v: isinstance(v, list) and all(isinstance(x, str) for x in v), "names"),
        "model_record": OBJECT_OR_NULL,  # read by the model's record reader, which names its keys
        "tensors": _map_of(TENSOR_SPLIT, "an object of tensor splits"),
        "aliases": (
            lambda v: v == [] or (isinstance(v, dict) and all(isinstance(x, str) for x in v.values())),
            "an object of tensor names",
        ),
        "files": _map_of(FILE_RECORD, "an object of file records ({bytes, sha256})"),
    },
    others=True,
)


def schema_problem(value: Any, schema: Any, where: str = "") -> str | None:
    """What in ``value`` does not follow ``schema`` (its key path and what was wanted), or None.
    ``(object_schema, None)``: that object or null."""
    if isinstance(schema, tuple) and isinstance(schema[0], dict):  # an object, or null
        return None if value is None else schema_problem(value, schema[0], where)
    if isinstance(schema, tuple):
        check, wanted = schema
        return None if check(value) else f"{where or 'the file'} must be {wanted}, not {_shown(value)}"
    if not isinstance(value, dict):
        return f"{where or 'the file'} must be an object, not {_shown(value)}"
    for key in value:
        if key not in schema and ... not in schema:
            return f"{where + '.' if where else ''}{key} is not a key this file holds"
    for key, (inner, required) in schema.items():
        if key is ... or key not in value:
            if required:
                return f"{where + '.' if where else ''}{key} is missing"
            continue
        if (problem := schema_problem(value[key], inner, f"{where + '.' if where else ''}{key}")) is not None:
            return problem
    return None


def _shown(value: Any) -> str:
    text = json.dumps(value)
    return text if len(text) <= 40 else f"a JSON {type(value).__name__}"


def _client_state_problem(state: Any, step: int) -> str | None:
    if (problem := schema_problem(state, CLIENT_STATE)) is not None:
        return problem
    return None if state["step"] == step else f"step {state['step']}, the checkpoint's is {step}"


def _unsafe_globals(path: Path) -> list[str]:
    """The globals a torch file's pickle would import beyond tensors, containers and
    ALLOWED_GLOBALS: torch reads them from the pickle's opcodes, running none of it."""
    return [name for name in torch.serialization.get_unsafe_globals_in_checkpoint(path) if name not in ALLOWED_GLOBALS]


def content_damage(step_dir: Path, info: dict) -> str | None:
    """Why the files of the intact-by-record checkpoint ``step_dir`` (its ``checkpoint.json`` is
    ``info``, which follows CHECKPOINT_INFO) cannot be resumed from (one file and what is wrong
    with it), or None."""
    step, world = info["step"], info["layout"]["world_size"]
    if (link := link_problem(step_dir, "the checkpoint's directory")) is not None:
        return link
    client = step_dir / CLIENT_STATE_FILE
    try:
        problem = _client_state_problem(load_json_file(client), step)
    except JSONProblem as error:
        return str(error)
    except (OSError, UnicodeDecodeError, ValueError):
        problem = "not readable JSON" if client.exists() else "missing"
    if problem is not None:
        return f"{client}: {problem}"
    rng_files = sorted((step_dir / RNG_DIR).glob("*.json"))
    if [p.name for p in rng_files] != [f"rank_{r:05d}.json" for r in range(world)]:
        return f"{step_dir / RNG_DIR}: {len(rng_files)} RNG states for the {world} ranks that saved it"
    for rank, path in enumerate(rng_files):
        try:
            state = load_json_file(path)
            problem = schema_problem(state, RNG_STATE)
        except JSONProblem as error:
            return str(error)
        except (OSError, UnicodeDecodeError, ValueError):
            problem = "not readable JSON"
        if problem is None and state.get("rank", rank) != rank:
            problem = f"rank {state['rank']}'s RNG state, in rank {rank}'s file"
        if problem is None and state.get("step", step) != step:
            problem = f"the RNG state of step {state['step']}, in the checkpoint of step {step}"
        if problem is not None:
            return f"{path}: {problem}"
    for path in sorted(step_dir.rglob("*.pt")):
        if not zipfile.is_zipfile(path):
            return f"{path}: not a whole torch file (no zip directory at its end)"
        try:
            with zipfile.ZipFile(path) as archive:
                bad = archive.testzip()
            unsafe = _unsafe_globals(path)
        except Exception as error:  # any unreadable archive or pickle is damage, named here
            return f"{path}: not a readable torch file ({type(error).__name__})"
        if bad is not None:
            return f"{path}: its entry {bad} fails its CRC (bytes changed after it was written)"
        if unsafe:
            return f"{path}: holds pickled objects of {', '.join(sorted(unsafe)[:3])}, which are never unpickled"
        layout = info["layout"]
        splits = info.get("tensors", {}) if layout["zero_stage"] < 3 else {}  # ZeRO-3 keeps no whole tensor here
        shapes = {name: split["local_shape"] for name, split in splits.items()}
        try:
            problem = state_file_problem(path, (layout["tensor_parallel"], layout["data_parallel"]), step, shapes)
        except CheckpointError as error:
            return str(error)
        if problem is not None:
            return f"{path}: {problem}"
    return _portable_damage(step_dir / PORTABLE_DIR)


def _portable_damage(directory: Path) -> str | None:
    """The checkpoint's portable export (what reshard, export and inspect read), read whole: its
    manifest, its files and every tensor against its checksum."""
    if not directory.exists():
        return None
    try:
        portable = PortableCheckpoint(directory)
        for name in portable.tensors:
            portable.read_full(name)
    except CheckpointError as error:
        return str(error)
    return None
