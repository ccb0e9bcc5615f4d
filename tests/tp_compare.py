"""Helpers for comparing a tensor-parallel module with its TP=1 twin inside one rank."""
from __future__ import annotations

import torch
import torch.distributed as dist


def gather_full(tensor: torch.Tensor, param_like, group) -> torch.Tensor:
    """Reassemble a TP-split tensor (a parameter or its gradient) along its partition dim."""
    if not getattr(param_like, "tensor_model_parallel", False) or group is None or dist.get_world_size(group) == 1:
        return tensor.detach().clone()
    parts = [torch.empty_like(tensor) for _ in range(dist.get_world_size(group))]
    dist.all_gather(parts, tensor.detach().contiguous(), group=group)
    return torch.cat(parts, dim=param_like.partition_dim)


def max_param_diff(reference: torch.nn.Module, parallel: torch.nn.Module, group, grads: bool = False) -> dict:
    """Largest absolute difference per parameter name between the gathered TP model and TP=1.

    Padded vocabulary rows (present only at some TP degrees) are cut to the reference shape."""
    diffs = {}
    ref_params = dict(reference.named_parameters())
    for name, p in parallel.named_parameters():
        if name not in ref_params or not p.requires_grad:
            continue
        ref = ref_params[name]
        mine = gather_full(p.grad if grads else p, p, group)
        want = ref.grad if grads else ref
        slices = tuple(slice(0, min(a, b)) for a, b in zip(mine.shape, want.shape))
        diffs[name] = (mine[slices] - want.detach()[slices]).abs().max().item()
    return diffs


def count_collectives(monkeypatch_target=dist):
    """Wrap torch.distributed collectives; returns (log, restore). Each entry: (name, numel, op)."""
    log = []
    originals = {}
    for name in ("all_reduce", "all_gather", "all_gather_into_tensor", "reduce_scatter", "broadcast",
                 "reduce_scatter_tensor"):
        fn = getattr(monkeypatch_target, name)
        originals[name] = fn

        def wrapped(tensor_or_list, *args, _fn=fn, _name=name, **kwargs):
            tensor = tensor_or_list if isinstance(tensor_or_list, torch.Tensor) else args[0]
            op = kwargs.get("op")
            log.append((_name, tensor.numel(), str(op) if op is not None else "SUM"))
            return _fn(tensor_or_list, *args, **kwargs)
        setattr(monkeypatch_target, name, wrapped)

    def restore():
        for name, fn in originals.items():
            setattr(monkeypatch_target, name, fn)
    return log, restore
