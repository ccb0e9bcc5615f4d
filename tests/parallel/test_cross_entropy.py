"""The vocabulary-parallel loss in one process: what it allocates, and that it matches torch."""

import pytest
import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

from parallel_latent.parallel import vocab_parallel_cross_entropy
from tests.tp_compare import order_bound

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
