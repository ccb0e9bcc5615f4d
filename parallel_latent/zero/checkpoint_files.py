"""DeepSpeed's checkpoint files: read without running pickled code, written with the OS's reason
for a failed write kept, and its model and optimizer states of any ZeRO stage read back as whole
per-parameter tensors.

The readers know DeepSpeed's file names and private keys (``optimizer_state_dict``,
``base_optimizer_state``, ``single_partition_of_fp32_groups``, ``fp32_flat_groups``,
``param_slice_mappings``, ...) as the releases of :data:`.version.SUPPORTED` write them; what is made
of the tensors they return (the universal state) is the checkpoint package's.
"""

import io
import math
import pickle
from pathlib import Path

import torch

from parallel_latent.errors import CheckpointError

from .params import adam_step
from .patches import checkpoint_reads
from .version import import_deepspeed

__all__ = [
    "MASTER",
    "OWN_NAME_KEY",
    "OWN_STEP_KEY",
    "read_tp_rank",
    "safe_torch_load",
    "save_keeping_errno",
    "state_file_problem",
    "weights_only_loading",
]

# The key each of DeepSpeed's files gets beside DeepSpeed's own, holding the file's own name: their
# contents name no rank, so a file moved to another rank's name is found only by this.
OWN_NAME_KEY = "parallel_latent_file_name"
OWN_STEP_KEY = "parallel_latent_step"  # the step that wrote the file (checkpoints before it: absent)
# The key of a parameter's fp32 master beside its optimizer state in what the readers return (the
# universal state names its tensors by these keys).
MASTER = "fp32"


def safe_torch_load(path: str | Path, map_location=None, mmap: bool = False):
    """``torch.load(weights_only=True)`` with DeepSpeed's allowlist; a file that needs anything
    else raises :class:`CheckpointError` naming the offending global instead of being unpickled.
    ``mmap``: tensors map the file instead of being read (a check of structure and shapes)."""
    import_deepspeed()
    # The DeepSpeed types in its checkpoint files: plain data holders whose unpickling runs no code
    # of theirs beyond setting attributes or building an enum/namedtuple.
    from deepspeed.runtime.fp16.loss_scaler import DynamicLossScaler, LossScaler
    from deepspeed.runtime.zero.config import ZeroStageEnum
    from deepspeed.utils.tensor_fragment import fragment_address

    try:
        with torch.serialization.safe_globals([LossScaler, DynamicLossScaler, ZeroStageEnum, fragment_address]):
            return torch.load(path, map_location=map_location, weights_only=True, mmap=mmap)
    except FileNotFoundError:
        raise CheckpointError(f"{path}: file missing") from None
    except (pickle.UnpicklingError, RuntimeError, AttributeError, TypeError) as error:
        lines = str(error).splitlines() or [type(error).__name__]
        detail = next((line.strip() for line in lines if "global" in line.lower()), lines[0])
        raise CheckpointError(f"{path}: refused to load with weights_only=True ({detail[:300]})") from None


def state_file_problem(
    path: Path, parallel_sizes: tuple[int, int], step: int, local_shapes: dict[str, list[int]]
) -> str | None:
    """What in one of DeepSpeed's files does not fit the checkpoint it is in (saved at ``step`` by
    (TP, DP) = ``parallel_sizes`` ranks, its parameters' per-rank shapes ``local_shapes``): the
    file it was written as, and for a model state those sizes, the step and its tensors' shapes.
    Read with its tensors mapped, not loaded; CheckpointError where it does not load at all."""
    state = safe_torch_load(path, "cpu", mmap=True)
    if not isinstance(state, dict):
        return f"a {type(state).__name__}, not DeepSpeed's object of states"
    if (own := state.get(OWN_NAME_KEY, path.name)) != path.name:
        return f"holds the state written as {own!r} (files swapped or renamed)"
    if (written := state.get(OWN_STEP_KEY, step)) != step:
        return f"written at step {written!r}, in the checkpoint of step {step} (a file of another checkpoint)"
    if path.name.endswith("optim_states.pt"):
        return None if isinstance(state.get("optimizer_state_dict"), dict) else "optimizer_state_dict is missing"
    for key, saved in zip(("mp_world_size", "dp_world_size"), parallel_sizes, strict=True):
        if key in state and state[key] != saved:
            return f"{key} {state[key]!r}, the checkpoint's layout says {saved}"
    if "step" in state and state["step"] != step:
        return f"step {state['step']!r}, the checkpoint's is {step}"
    if not isinstance(module := state.get("module"), dict):
        return "module is missing"
    for name, tensor in module.items():
        if not isinstance(tensor, torch.Tensor):
            return f"module.{name} is not a tensor"
        if name in local_shapes and (shape := list(tensor.shape)) != (recorded := local_shapes[name]):
            return f"module.{name} has shape {shape}, the checkpoint's record says {recorded}"
    return None


def weights_only_loading(engine):
    """Route DeepSpeed's checkpoint reads through :func:`safe_torch_load` (its own engine calls
    ``torch.load(weights_only=False)``)."""
    return checkpoint_reads(engine, lambda path, map_location=None: safe_torch_load(path, map_location))


class _ErrnoFile(io.FileIO):
    """An unbuffered file that keeps the first OSError of its writes (torch.save's zip writer turns
    it into an opaque RuntimeError) and writes every byte it is given, or raises."""

    error: OSError | None = None

    def write(self, data) -> int:
        view, done = memoryview(data).cast("B"), 0
        try:
            while done < len(view):
                done += super().write(view[done:])
        except OSError as error:
            self.error = self.error or error
            raise
        return done


def save_keeping_errno(state_dict, path: str, zipfile: bool) -> None:
    """DeepSpeed's ``TorchCheckpointEngine.save``, with the OS's reason for a failed write kept."""
    with _ErrnoFile(path, "wb") as handle:
        try:
            torch.save(state_dict, handle, _use_new_zipfile_serialization=zipfile)
        except RuntimeError as error:
            raise handle.error or error from None


def _with_state(master: torch.Tensor, state: dict, moments: tuple[str, ...]) -> dict[str, torch.Tensor]:
    """A master and the optimizer's state of it, zeros where there is none (before the first step;
    SGD without momentum)."""
    return {MASTER: master, **{k: torch.zeros_like(master) if state.get(k) is None else state[k] for k in moments}}


def _optimizer_files(step_dir: Path, mp_rank: int, saved: dict):
    """Every DP rank's ZeRO optimizer state, in order."""
    prefix = "bf16_" if saved["precision"] == "bf16" else ""
    for dp_rank in range(saved["data_parallel"]):
        path = step_dir / f"{prefix}zero_pp_rank_{dp_rank}_mp_rank_{mp_rank:02d}_optim_states.pt"
        yield safe_torch_load(path, "cpu")["optimizer_state_dict"]


def _param_shapes(model_states: dict) -> dict[str, tuple[int, ...]]:
    return {name: tuple(shape) for group in model_states["param_shapes"] for name, shape in group.items()}


def _whole(step_dir: Path, shapes: dict, runs: list[tuple[dict, dict]], moments: tuple[str, ...]) -> dict:
    """Each parameter's master and moments from the flat runs that hold its pieces, in order: a run
    is (flat tensors by key, ``{name: (start, length)}``)."""
    pieces = {name: {key: [] for key in (MASTER, *moments)} for name in shapes}
    for flat, mapping in runs:
        for name, (start, length) in mapping.items():
            for key, tensor in flat.items():
                pieces[name][key].append(tensor.narrow(0, start, length))
    for name, shape in shapes.items():
        for key, parts in pieces[name].items():
            whole = torch.cat(parts) if parts else torch.empty(0)
            if whole.numel() != math.prod(shape):
                raise CheckpointError(
                    f"{step_dir}: ZeRO fragments of {name!r} hold {whole.numel()} elements, expected {math.prod(shape)}"
                )
            pieces[name][key] = whole.view(shape).float()
    return pieces


def _zero12_tensors(step_dir: Path, mp_rank: int, info: dict, moments: tuple[str, ...]):
    """Each DP rank's flat fp32 partition holds a contiguous run of fragments;
    ``param_slice_mappings`` says which parameter each fragment belongs to, in order."""
    model_states = safe_torch_load(step_dir / f"mp_rank_{mp_rank:02d}_model_states.pt", "cpu")
    runs, step, groups = [], 0, []
    for sd in _optimizer_files(step_dir, mp_rank, info["layout"]):
        base = sd["base_optimizer_state"]
        groups = base.get("param_groups", groups)
        for index, mapping in enumerate(sd["param_slice_mappings"]):
            state = base["state"].get(index, {})
            step = adam_step(state) or step
            flat = _with_state(sd["single_partition_of_fp32_groups"][index], state, moments)
            runs.append((flat, {name: (address.start, address.numel) for name, address in mapping.items()}))
    return _whole(step_dir, _param_shapes(model_states), runs, moments), model_states["module"], step, groups


def _zero3_tensors(step_dir: Path, mp_rank: int, info: dict, moments: tuple[str, ...]):
    """Every parameter is split into ``ceil(numel / dp)`` pieces, one per DP rank (the last
    padded), and a rank's flat group is its pieces of all parameters in order."""
    dp_size = info["layout"]["data_parallel"]
    model_states = [
        safe_torch_load(step_dir / f"zero_pp_rank_{r}_mp_rank_{mp_rank:02d}_model_states.pt", "cpu")
        for r in range(dp_size)
    ]
    shapes = _param_shapes(model_states[0])
    runs, step, groups = [], 0, []
    for dp_rank, sd in enumerate(_optimizer_files(step_dir, mp_rank, info["layout"])):
        base = sd["optimizer_state_dict"]
        groups = base.get("param_groups", groups)
        step = adam_step(base["state"].get(0, {})) or step
        flats = [
            _with_state(g.reshape(-1), base["state"].get(i, {}), moments) for i, g in enumerate(sd["fp32_flat_groups"])
        ]
        mapping, offset = {}, 0
        for name, shape in shapes.items():
            per_rank = math.ceil(math.prod(shape) / dp_size)
            mapping[name] = (offset, max(0, min(per_rank, math.prod(shape) - dp_rank * per_rank)))  # padding cut
            offset += per_rank
        runs.append(({key: torch.cat([f[key].reshape(-1) for f in flats]) for key in flats[0]}, mapping))
    # Frozen parameters are stored as each rank's fragment; buffers whole in every rank's module.
    module = dict(model_states[0]["module"])
    for name, shape in (model_states[0].get("frozen_param_shapes") or {}).items():
        whole = torch.cat([ms["frozen_param_fragments"][name].reshape(-1) for ms in model_states])
        module[name] = whole[: math.prod(shape)].view(tuple(shape))
    return _whole(step_dir, shapes, runs, moments), module, step, groups


def _zero0_tensors(step_dir: Path, mp_rank: int, info: dict, moments: tuple[str, ...]):
    """ZeRO-0 (fp32): weights and the torch optimizer's state dict sit in the model states file;
    the state is keyed by position in the optimizer, mapped to names recorded at save time."""
    model_states = safe_torch_load(step_dir / f"mp_rank_{mp_rank:02d}_model_states.pt", "cpu")
    module, names = model_states["module"], info.get("optimizer_param_names", [])
    optimizer_sd = model_states.get("optimizer") or {}
    order = [i for group in optimizer_sd.get("param_groups", []) for i in group["params"]]
    if len(order) != len(names):
        raise CheckpointError(f"{step_dir}: optimizer holds {len(order)} tensors, {len(names)} names recorded")
    result, step = {}, 0
    for index, name in zip(order, names, strict=True):
        state = optimizer_sd.get("state", {}).get(index, {})
        result[name] = _with_state(module[name].float(), state, moments)
        step = adam_step(state) or step
    return result, module, step, optimizer_sd.get("param_groups", [])


def read_tp_rank(step_dir: Path, mp_rank: int, info: dict, moments: tuple[str, ...]):
    """What DeepSpeed's files of TP rank ``mp_rank`` hold, whatever the ZeRO stage of
    ``info["layout"]`` (the checkpoint's record): each trainable parameter's fp32 master and
    optimizer state ``moments``, whole (``{name: {MASTER: ..., moment: ...}}``), the module's state
    dict, Adam's step and the optimizer's param groups."""
    read = {0: _zero0_tensors, 1: _zero12_tensors, 2: _zero12_tensors, 3: _zero3_tensors}
    return read[info["layout"]["zero_stage"]](step_dir, mp_rank, info, moments)
