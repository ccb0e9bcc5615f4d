"""Helpers for comparing a tensor-parallel module with its TP=1 twin inside one rank, and the error
bounds those comparisons use.

Why the bounds look like this. A TP=N model computes the same sums as TP=1 in another order (each
rank sums its slice, then the all-reduce adds the slices), and so does a GEMM kernel that blocks
differently. Recursive summation of n terms has an error of at most (n - 1) * u * sum|terms|, with u
the unit roundoff (Higham, *Accuracy and Stability of Numerical Algorithms*, eq. 4.4); a dot product
adds one rounding per product. Two evaluations of the same quantity therefore differ by at most
``2 * n * u * scale`` where ``scale`` bounds sum|terms|. :func:`order_bound` is that formula with n the
total length of the reductions on the path to the quantity (chained GEMMs, softmax sums, the
all-reduce) and a factor 2 more for the products and the elementwise operations between them. It
depends on no machine, BLAS or thread count. A real defect (a bias added twice, a missing
all-reduce, a wrong slice) changes results by O(scale), many orders of magnitude above it.

Multi-step comparisons do not use fp32 at all: Adam divides a gradient by sqrt(v) + eps, so a
gradient whose true value is ~0 turns fp32 noise (~1e-9) into an update of ~lr * 1e-9 / 1e-8. They
run in float64, where the same noise is ~1e-16 * scale and stays far below Adam's eps; see
:func:`adam_steps_bound`.
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist


def unit_roundoff(dtype: torch.dtype) -> float:
    return torch.finfo(dtype).eps / 2


def order_bound(reduction_length: int, scale: float, dtype: torch.dtype = torch.float32) -> float:
    """Largest difference of two evaluations, in different summation orders, of a quantity reached
    through reductions of ``reduction_length`` terms in all whose absolute values sum to at most
    ``scale``: 2 (two evaluations) x 2 (products and elementwise steps) x n x u x scale."""
    return 4.0 * reduction_length * unit_roundoff(dtype) * scale


def terms_scale(reference: float, reduction_length: int) -> float:
    """sum|terms| of a quantity whose value is ``reference``: terms of random sign cancel, so their
    absolute sum is ~sqrt(n) times the result (the tests' inputs and weights are random)."""
    return math.sqrt(reduction_length) * reference


def autoencoder_reduction_length(model_cfg, tokens: int, tp: int) -> int:
    """Terms summed on the longest path from the input of a LatentAutoencoder to its loss and back
    to a weight gradient: per Perceiver block three LayerNorms over d, q/k/v (d), scores (d/heads),
    the softmax sum and the weighted sum over context + stream (2 x 2T), the output projection (d)
    and its all-reduce (tp), the MLP (d + 4d) and its all-reduce; then the query MLP, the final
    LayerNorms, the head (d), the softmax over the vocabulary, and the ``tokens`` (B*T) a weight
    gradient sums over."""
    d, heads, length = model_cfg.d_model, model_cfg.n_heads, model_cfg.max_length
    hidden = model_cfg.mlp_ratio * d
    blocks = model_cfg.n_encoder_layers + model_cfg.n_decoder_layers
    per_block = 3 * d + d + d // heads + 2 * (2 * length) + d + tp + d + hidden + tp
    return blocks * per_block + (d + hidden + tp) + 2 * d + d + model_cfg.vocab_size + tokens


def gpt2_reduction_length(n_embd: int, n_head: int, length: int, blocks: int) -> int:
    """Terms summed on the path through ``blocks`` GPT-2 blocks: per block two LayerNorms (f each),
    q/k/v (f), scores (f / heads), the softmax sum and the weighted sum (T each), the output
    projection (f), the MLP (f and 4f), and 16 roundings for the GELU's elementwise steps (the tanh
    form written out, against the fused kernel)."""
    return blocks * (2 * n_embd + n_embd + n_embd // n_head + 2 * length + n_embd + n_embd + 4 * n_embd + 16)


def adam_steps_bound(steps: int, lr: float, adam_eps: float, grad_bound: float) -> float:
    """Weight difference after ``steps`` Adam steps whose gradients differ by at most ``grad_bound``
    per element: each step's update m/(sqrt(v)+eps) moves by at most grad_bound/eps per unit of lr
    (the derivative of g/(|g|+eps) is at most 1/eps), and weight decay contracts; so at most
    steps * lr * grad_bound / eps, doubled for the change the weights themselves feed back into
    the next gradients over these few small steps."""
    return 2.0 * steps * lr * grad_bound / adam_eps


def argmax_agrees(reference: torch.Tensor, other: torch.Tensor, bound: float) -> bool:
    """Whether two evaluations of the same logits pick the same argmax wherever the choice is
    decided: a position may differ only where the reference's two best logits are within twice the
    logits' error bound of each other (a tie that summation order may break either way)."""
    top2 = reference.topk(2, dim=-1).values
    decided = (top2[..., 0] - top2[..., 1]) > 2 * bound
    return bool(((reference.argmax(-1) == other.argmax(-1)) | ~decided).all())


def gather_full(tensor: torch.Tensor, param_like, group) -> torch.Tensor:
    """Reassemble a TP-split tensor (a parameter or its gradient) along its partition dim."""
    if not getattr(param_like, "tensor_model_parallel", False) or group is None or dist.get_world_size(group) == 1:
        return tensor.detach().clone()
    parts = [torch.empty_like(tensor) for _ in range(dist.get_world_size(group))]
    dist.all_gather(parts, tensor.detach().contiguous(), group=group)
    return torch.cat(parts, dim=param_like.partition_dim)


def gathered_params(reference: torch.nn.Module, parallel: torch.nn.Module, group, grads: bool = False) -> dict:
    """{name: (gathered TP tensor, TP=1 tensor)} for every trainable parameter (or its gradient).

    Padded vocabulary rows (present only at some TP degrees) are cut to the reference shape."""
    pairs = {}
    ref_params = dict(reference.named_parameters())
    for name, p in parallel.named_parameters():
        if name not in ref_params or not p.requires_grad:
            continue
        ref = ref_params[name]
        mine = gather_full(p.grad if grads else p, p, group)
        want = (ref.grad if grads else ref).detach()
        slices = tuple(slice(0, min(a, b)) for a, b in zip(mine.shape, want.shape, strict=True))
        pairs[name] = (mine[slices], want[slices])
    return pairs


def max_param_diff(reference: torch.nn.Module, parallel: torch.nn.Module, group, grads: bool = False) -> dict:
    """Largest absolute difference per parameter name between the gathered TP model and TP=1."""
    return {
        name: (mine - want).abs().max().item()
        for name, (mine, want) in gathered_params(reference, parallel, group, grads).items()
    }


def weights_after_adam(reference, parallel, group, steps: int, lr: float, adam_eps: float, grad_scale: float, k: int):
    """(largest gathered weight difference, its bound) after ``steps`` float64 Adam steps whose
    gradients, of magnitude up to ``grad_scale``, came through reductions of ``k`` terms."""
    grad_bound = order_bound(k, terms_scale(grad_scale, k), torch.float64)
    return max(max_param_diff(reference, parallel, group).values()), adam_steps_bound(steps, lr, adam_eps, grad_bound)


def max_abs(tensors) -> float:
    return max((t.detach().abs().max().item() for t in tensors if t is not None and t.numel()), default=0.0)


# torch 2.13 renamed the tensor collectives; where the new name is missing (torch 2.11) the project
# calls the old one, logged under the new name so that every count reads the same on both.
RENAMED_COLLECTIVES = {"all_gather_into_tensor": "all_gather_single", "reduce_scatter_tensor": "reduce_scatter_single"}


def count_collectives(monkeypatch_target=dist):
    """Wrap torch.distributed collectives; returns (log, restore). Each entry: (name, numel, op)."""
    log = []
    originals = {}
    for name in (
        "all_reduce",
        "all_gather",
        "all_gather_into_tensor",
        "reduce_scatter",
        "broadcast",
        "reduce_scatter_tensor",
        "all_gather_single",
        "reduce_scatter_single",
    ):
        fn = getattr(monkeypatch_target, name, None)
        if fn is None:  # a name this torch does not have
            continue
        originals[name] = fn
        new_name = RENAMED_COLLECTIVES.get(name, name)
        logged = name if hasattr(monkeypatch_target, new_name) else new_name

        def wrapped(tensor_or_list, *args, _fn=fn, _name=logged, **kwargs):
            tensor = tensor_or_list if isinstance(tensor_or_list, torch.Tensor) else args[0]
            op = kwargs.get("op")
            log.append((_name, tensor.numel(), str(op) if op is not None else "SUM"))
            return _fn(tensor_or_list, *args, **kwargs)

        setattr(monkeypatch_target, name, wrapped)

    def restore():
        for name, fn in originals.items():
            setattr(monkeypatch_target, name, fn)

    return log, restore


def collectives_of(forward) -> tuple[list, list]:
    """The collectives (name, numel, op) that ``forward()`` issues, and those of the backward of
    the scalar it returns."""
    log, restore = count_collectives()
    try:
        loss = forward()
        forward_log = list(log)
        log.clear()
        loss.backward()
        return forward_log, list(log)
    finally:
        restore()


def model_collectives_task(tp: int, cfg, batch: int) -> list:
    """A pool task: the collectives the model of ``cfg`` issues in one training forward and backward
    (its summed loss) of ``batch`` samples over ``tp`` real ranks (float32 on the CPU)."""
    from parallel_latent.feature_model.features import random_features_unannounced
    from parallel_latent.model import build_model
    from parallel_latent.parallel import initialize_model_parallel

    group = initialize_model_parallel(tp).tp_group
    with random_features_unannounced():
        model = build_model(cfg, group).train()
    ids = torch.randint(0, 50257, (batch, cfg.model.max_length), generator=torch.Generator().manual_seed(0))
    forward, backward = collectives_of(lambda: model(ids, torch.ones_like(ids)).trained_loss_sum)
    return forward + backward


def _split_last(x: torch.Tensor, group) -> torch.Tensor:
    return x.chunk(dist.get_world_size(group), dim=-1)[dist.get_rank(group)].contiguous()


def _gather_last(x: torch.Tensor, group) -> torch.Tensor:
    x = x.contiguous()
    parts = [torch.empty_like(x) for _ in range(dist.get_world_size(group))]
    dist.all_gather(parts, x, group=group)
    return torch.cat(parts, dim=-1)


class _ScatterLastDim(torch.autograd.Function):
    """This rank's slice of the last dimension; backward all-gathers the slices' gradients."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return _split_last(x, group)

    @staticmethod
    def backward(ctx, grad):
        return _gather_last(grad, ctx.group), None


class _GatherLastDim(torch.autograd.Function):
    """Every rank's slice of the last dimension, concatenated; backward keeps this rank's slice."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return _gather_last(x, group)

    @staticmethod
    def backward(ctx, grad):
        return _split_last(grad, ctx.group), None


def scatter_last_dim(x: torch.Tensor, group) -> torch.Tensor:
    """Test harness: hand a layer with a split input (row-parallel) a tensor every rank holds whole."""
    return x if group is None or dist.get_world_size(group) == 1 else _ScatterLastDim.apply(x, group)


def gather_last_dim(x: torch.Tensor, group) -> torch.Tensor:
    """Test harness: the whole output of a layer whose output stays split (column-parallel)."""
    return x if group is None or dist.get_world_size(group) == 1 else _GatherLastDim.apply(x, group)
