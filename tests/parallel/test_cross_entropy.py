"""The vocabulary-parallel loss in one process: what it allocates, and that it matches torch."""

import pytest
import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

from parallel_latent.parallel import vocab_parallel_cross_entropy
from tests.helpers.gpu import gpu_test
from tests.helpers.tp_compare import order_bound

B, T, VOCAB, PADDED = 3, 5, 250, 256


class LogitSizedAllocations(TorchDispatchMode):
    """Counts the distinct new tensors of the logits' size that operators return."""

    def __init__(self, numel: int, known: list[torch.Tensor]):
        super().__init__()
        self.numel, self.storages = numel, {t.untyped_storage().data_ptr() for t in known}
        self.new = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for tensor in out if isinstance(out, (tuple, list)) else [out]:
            if isinstance(tensor, torch.Tensor) and tensor.numel() == self.numel:
                pointer = tensor.untyped_storage().data_ptr()
                if pointer not in self.storages:
                    self.storages.add(pointer)
                    self.new.append((str(func), tensor.dtype))
        return out


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_forward_keeps_one_logit_sized_temporary(dtype):
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(B, T, PADDED, generator=gen).to(dtype).requires_grad_()
    target = torch.randint(0, VOCAB, (B, T), generator=gen)
    with LogitSizedAllocations(logits.numel(), [logits]) as mode:
        loss, _ = vocab_parallel_cross_entropy(logits, target, VOCAB)
    # One fp32 tensor: the shifted logits, exponentiated and normalised in place (the softmax).
    assert [d for _, d in mode.new] == [torch.float32], mode.new
    loss.sum().backward()
    want = F.cross_entropy(logits.float()[..., :VOCAB].reshape(-1, VOCAB), target.reshape(-1), reduction="none")
    # The same log-sum-exp over VOCAB positive terms, in another order.
    assert (loss.reshape(-1) - want).abs().max().item() <= order_bound(VOCAB, want.abs().max().item())
    assert logits.grad.dtype == dtype and not logits.grad[..., VOCAB:].any()  # padding gets no gradient


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_chunked_rows_give_the_same_bits_and_no_full_fp32_temporary(dtype):
    """Rows in chunks of 4: the same loss and gradient bits as one chunk (every row's arithmetic is
    the same), no fp32 tensor of the logits' size in forward or backward, and the gradient made in
    the logits' dtype (no fp32 gradient for autograd to cast)."""
    gen = torch.Generator().manual_seed(1)
    logits = torch.randn(B, T, PADDED, generator=gen).to(dtype)
    target = torch.randint(0, VOCAB, (B, T), generator=gen)
    target[0, 1] = -100
    grad_out = torch.rand(B, T, generator=gen)
    results = {}
    for chunk_rows in (None, 4):
        leaf = logits.clone().requires_grad_()
        with LogitSizedAllocations(logits.numel(), [leaf]) as mode:
            loss, correct = vocab_parallel_cross_entropy(leaf, target, VOCAB, chunk_rows=chunk_rows)
            loss.backward(grad_out)
        results[chunk_rows] = (loss.detach(), correct, leaf.grad)
        if chunk_rows == 4:
            # Only the gradient itself, in the logits' dtype.
            assert mode.new == [("aten.empty_like.default", dtype)], mode.new
    for whole, chunked in zip(results[None], results[4], strict=True):
        assert torch.equal(whole, chunked)
    assert results[4][2].dtype == dtype and not results[4][2][0, 1].any()  # ignored: no gradient


class LogitReads(TorchDispatchMode):
    """The rows of the logits each operator reads (operators reading a view of them)."""

    def __init__(self, logits: torch.Tensor):
        super().__init__()
        self.storage, self.row = logits.untyped_storage().data_ptr(), logits.shape[-1] * logits.element_size()
        self.reads: list[tuple[str, int]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if not func.is_view and "empty" not in str(func):  # (an allocation reads nothing)
            for arg in torch.utils._pytree.tree_leaves((args, kwargs)):
                if isinstance(arg, torch.Tensor) and arg.untyped_storage().data_ptr() == self.storage:
                    self.reads.append((str(func), arg.numel() * arg.element_size() // self.row))
        return func(*args, **(kwargs or {}))


def test_each_chunk_of_logits_is_read_once_each_way_and_the_gradient_is_written_in_place():
    """Forward reads each chunk of rows in one pass (the local max with the sum of exp: no extra pass
    over all the logits), backward writes each chunk's gradient straight into the one gradient buffer
    (no copy of a chunk into it); only the target logits' gather sees every row."""
    gen = torch.Generator().manual_seed(2)
    logits = torch.randn(B, T, PADDED, generator=gen).to(torch.bfloat16).requires_grad_()
    target = torch.randint(0, VOCAB, (B, T), generator=gen)
    with LogitReads(logits) as forward:
        loss, _ = vocab_parallel_cross_entropy(logits, target, VOCAB, chunk_rows=4)
    assert [name for name, rows in forward.reads if rows > 4] == ["aten.gather.default"], forward.reads
    copies = []

    class Copies(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if func in (torch.ops.aten.copy_.default, torch.ops.aten._to_copy.default) and args[0].dim() == 2:
                copies.append(str(func))
            return func(*args, **(kwargs or {}))

    with Copies():
        loss.sum().backward()
    assert copies == [], copies


def test_a_confident_model_makes_no_subnormal_numbers():
    """Logits from 80 to 110 below each row's max (a confident model's): exp() of those is subnormal
    in fp32 (below 1.2e-38), which a CPU computes in a slow path; the loss takes them as 0 instead.
    Its value and gradient stay torch's within fp32 rounding, and no gradient entry is subnormal."""
    gen = torch.Generator().manual_seed(4)
    logits = -80.0 - 30.0 * torch.rand(B, T, VOCAB, generator=gen)
    target = torch.randint(0, VOCAB, (B, T), generator=gen)
    logits.scatter_(-1, target.unsqueeze(-1), 0.0)  # the target is the max, by 80 or more
    logits[..., :8] = -20.0 * torch.rand(B, T, 8, generator=gen)  # a few columns in the normal range
    logits.requires_grad_()
    loss, _ = vocab_parallel_cross_entropy(logits, target, VOCAB)
    loss.sum().backward()
    reference = logits.detach().double().requires_grad_()
    want = F.cross_entropy(reference.view(-1, VOCAB), target.view(-1), reduction="none")
    want.sum().backward()
    u = torch.finfo(torch.float32).eps / 2
    assert (loss.double().view(-1) - want).abs().max().item() <= order_bound(VOCAB, 1.0) + 4 * u
    assert (logits.grad.double() - reference.grad).abs().max().item() <= order_bound(VOCAB, 1.0)
    grad = logits.grad.abs()
    tiny = torch.finfo(torch.float32).tiny
    assert not ((grad > 0) & (grad < tiny)).any()


def test_ties_take_the_lowest_index_padding_never_wins_and_ignored_rows_get_nothing():
    """Across chunks of rows: a row whose max is tied predicts the lowest tied id (argmax over the
    full vocabulary); padding columns, however large, hold no probability; an ignored target has
    loss 0 and no gradient."""
    logits = torch.zeros(1, 6, PADDED)
    logits[0, :, VOCAB:] = 100.0  # padding: would win if it counted
    logits[0, 0, [7, 3, 9]] = 5.0  # a three-way tie: id 3
    logits[0, 1, [200, 10]] = 4.0  # id 10
    target = torch.tensor([[3, 200, 5, 6, -100, 249]])
    leaf = logits.clone().requires_grad_()
    loss, correct = vocab_parallel_cross_entropy(leaf, target, VOCAB, chunk_rows=2)
    loss.sum().backward()
    assert correct.tolist() == [[True, False, False, False, False, False]]
    want = F.cross_entropy(logits[0, :, :VOCAB], target[0], reduction="none")
    assert (loss[0] - want).abs().max().item() <= order_bound(VOCAB, want.abs().max().item())
    assert loss[0, 4].item() == 0.0 and not leaf.grad[0, 4].any() and not leaf.grad[..., VOCAB:].any()


def assert_compiled_chunks_equal_the_plain_ones(device: str) -> None:
    """LossKernels.compiled() against the plain chunks on ``device``, bf16 logits in chunks of 4 rows
    (the last one shorter): the same predictions, the loss within another summation order's bound,
    and each gradient element (p - 1[target], rounded once to bf16) within one bf16 step of the
    largest plus the fp32 order bound of the softmax's sum."""
    from parallel_latent.parallel import LossKernels

    gen = torch.Generator().manual_seed(3)
    logits = torch.randn(B, T, PADDED, generator=gen).to(torch.bfloat16).to(device)
    target = torch.randint(0, VOCAB, (B, T), generator=gen).to(device)
    target[1, 2] = -100
    results = []
    with torch._inductor.config.patch(compile_threads=1):
        for kernels in (LossKernels(), LossKernels.compiled()):
            leaf = logits.clone().requires_grad_()
            loss, correct = vocab_parallel_cross_entropy(leaf, target, VOCAB, chunk_rows=4, kernels=kernels)
            loss.sum().backward()
            results.append((loss.detach(), correct, leaf.grad.float()))
        assert kernels.sum_exp.succeeded and kernels.grad.succeeded  # no graph broken
    (want_loss, want_correct, want_grad), (loss, correct, grad) = results
    assert torch.equal(correct, want_correct)
    assert (loss - want_loss).abs().max().item() <= order_bound(VOCAB, want_loss.abs().max().item())
    bf16_step = torch.finfo(torch.bfloat16).eps * want_grad.abs().max().item()
    assert (grad - want_grad).abs().max().item() <= bf16_step + order_bound(VOCAB, 1.0)


@pytest.mark.slow
def test_compiled_chunks_equal_the_plain_ones_on_cpu_inductor():
    """What a CUDA device runs when the dropout mask is compiled, through inductor's CPU backend."""
    assert_compiled_chunks_equal_the_plain_ones("cpu")


def test_the_loss_is_fused_where_the_dropout_mask_is_compiled():
    """A model's loss kernels are compiled on the devices where its dropout mask is (CUDA, unless
    training.compile_dropout is false), built once, plain elsewhere."""
    from parallel_latent.config import load_config
    from parallel_latent.model import build_model
    from tests.helpers.trainer_runs import TINY_CONFIG, TINY_MODEL

    cuda, cpu = torch.device("cuda"), torch.device("cpu")  # (a device name: no CUDA needed)
    for compile_dropout in (True, False):
        cfg = load_config(TINY_CONFIG, [*TINY_MODEL, f"training.compile_dropout={str(compile_dropout).lower()}"])
        kernels = build_model(cfg).loss_kernels
        assert kernels.on(cuda).compiled_kernels is compile_dropout
        assert not kernels.on(cpu).compiled_kernels and kernels.on(cuda) is kernels.on(cuda)


def chunk_arguments(dtype, rows: int = 6, real: int = VOCAB):
    """One chunk of the backward's arguments, as the loss computes them, over ``PADDED`` columns."""
    from parallel_latent.parallel.cross_entropy import chunk_max_sum_exp

    gen = torch.Generator().manual_seed(4)
    logits = torch.randn(rows, PADDED, generator=gen).to(dtype)
    row_max, argmax, row_sum = logits.new_empty(rows), torch.empty(rows, dtype=torch.long), torch.empty(rows)
    chunk_max_sum_exp(row_max, argmax, row_sum, logits, real, torch.float32)
    targets = torch.randint(0, real, (rows,), generator=gen)
    hits = (torch.arange(rows) % 3 != 0).float()  # some targets on another rank: no one-hot here
    scale = torch.rand(rows, generator=gen)
    return logits, row_max.float(), row_sum, targets, hits, scale


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("real", [VOCAB, PADDED])
def test_the_fused_backward_chunk_gives_the_indexed_ones_bits(dtype, real):
    """chunk_grad_fused (what the compiled loss runs) is chunk_grad_into's arithmetic on the same
    values: eagerly, the same bits, padding columns 0."""
    from parallel_latent.parallel.cross_entropy import chunk_grad_fused, chunk_grad_into

    logits, row_max, row_sum, targets, hits, scale = chunk_arguments(dtype, real=real)
    outs = [torch.empty_like(logits) if dtype != torch.float32 else None for _ in range(2)]
    want = chunk_grad_into(outs[0], logits.clone(), row_max, row_sum, targets, hits, scale, real, torch.float32)
    got = chunk_grad_fused(outs[1], logits.clone(), row_max, row_sum, targets, hits, scale, real, torch.float32)
    assert got.dtype == want.dtype == dtype and torch.equal(got, want)
    assert not got[:, real:].any()


@pytest.mark.slow
def test_the_compiled_backward_chunk_is_one_kernel_and_the_indexed_one_is_not():
    """Inductor (its CPU code generator, the same scheduler as CUDA's) fuses the whole fused chunk
    into one kernel that writes only the bf16 gradient; the indexed write of chunk_grad_into splits
    it (what benchmarks/bench_projection.py charges for a scatter inside a compiled region)."""
    from torch._inductor import metrics

    from parallel_latent.parallel.cross_entropy import chunk_grad_fused, chunk_grad_into

    logits, row_max, row_sum, targets, hits, scale = chunk_arguments(torch.bfloat16)
    kernels = {}
    with torch._inductor.config.patch(compile_threads=1):
        for fn in (chunk_grad_fused, chunk_grad_into):
            torch._dynamo.reset()
            metrics.reset()
            out = torch.empty_like(logits)
            torch.compile(fn, dynamic=True)(out, logits, row_max, row_sum, targets, hits, scale, VOCAB, torch.float32)
            kernels[fn.__name__] = metrics.generated_kernel_count
    assert kernels["chunk_grad_fused"] == 1 and kernels["chunk_grad_into"] > 1, kernels


@gpu_test
def test_on_cuda_the_compiled_loss_equals_eager_within_its_bound():
    assert_compiled_chunks_equal_the_plain_ones("cuda")
