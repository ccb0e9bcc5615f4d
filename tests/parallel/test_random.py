"""Coordinate-keyed dropout: the mask is a pure function of (seed, step, layer, global index)."""

import torch
import torch.distributed as dist

from parallel_latent.parallel import DropoutRNG, ParallelDropout, initialize_model_parallel
from parallel_latent.parallel.random import keep_mask
from tests.parallel.test_collectives import B, Block, D, T


def test_keep_rate_and_independence():
    mask = keep_mask((64, 64, 64), 0.1, (0, 0, 0), (0, 0, 0), (64, 64, 64))
    assert abs(mask.float().mean().item() - 0.9) < 0.005
    other_step = keep_mask((64, 64, 64), 0.1, (0, 1, 0), (0, 0, 0), (64, 64, 64))
    other_layer = keep_mask((64, 64, 64), 0.1, (0, 0, 1), (0, 0, 0), (64, 64, 64))
    other_seed = keep_mask((64, 64, 64), 0.1, (1, 0, 0), (0, 0, 0), (64, 64, 64))
    for other in (other_step, other_layer, other_seed):
        agree = (mask == other).float().mean().item()
        assert abs(agree - (0.9**2 + 0.1**2)) < 0.01  # independent masks agree by chance only


def test_slice_of_full_mask_equals_mask_of_slice():
    full = keep_mask((4, 6, 16), 0.3, (7, 3, 2), (0, 0, 0), (4, 6, 16))
    for rank in range(4):
        part = keep_mask((4, 6, 4), 0.3, (7, 3, 2), (0, 0, 4 * rank), (4, 6, 16))
        assert torch.equal(part, full[..., 4 * rank : 4 * rank + 4])
    second_half_batch = keep_mask((2, 6, 16), 0.3, (7, 3, 2), (2, 0, 0), (4, 6, 16))
    assert torch.equal(second_half_batch, full[2:])


def test_dropout_scales_and_is_identity_in_eval():
    rng = DropoutRNG(seed=5)
    drop = ParallelDropout(0.25, rng)
    x = torch.ones(8, 8, 8)
    y = drop(x)
    assert torch.equal(y.unique(), torch.tensor([0.0, 1.0 / 0.75]))
    rng.step += 1
    assert not torch.equal(drop(x), y)
    drop.eval()
    assert torch.equal(drop(x), x)


def test_sample_offset_makes_dp_ranks_differ_and_halves_equal_whole():
    rng = DropoutRNG(seed=3)
    drop = ParallelDropout(0.5, rng)
    x = torch.ones(4, 5, 6)
    whole = drop(x)
    first = drop(x[:2])
    rng.sample_offset = 2
    second = drop(x[2:])
    assert torch.equal(torch.cat([first, second]), whole)
    assert not torch.equal(first, second)


def replicated_params_after_steps(tp: int) -> dict:
    state = initialize_model_parallel(tp)
    torch.manual_seed(0)
    block = Block(state.tp_group)
    opt = torch.optim.AdamW(block.parameters(), lr=1e-2)
    rng = block.attention.output_dropout.rng
    for step in range(5):
        rng.step = step
        x = torch.randn(B, T, D, generator=torch.Generator().manual_seed(step))
        block(x).pow(2).mean().backward()
        opt.step()
        opt.zero_grad()
    replicated = {
        n: p.detach().clone() for n, p in block.named_parameters() if not getattr(p, "tensor_model_parallel", False)
    }
    # Compare with TP rank 0 bit for bit: all_reduce MAX and MIN must both equal our own copy.
    worst = 0.0
    for value in replicated.values():
        hi, lo = value.clone(), value.clone()
        dist.all_reduce(hi, op=dist.ReduceOp.MAX, group=state.tp_group)
        dist.all_reduce(lo, op=dist.ReduceOp.MIN, group=state.tp_group)
        worst = max(worst, (hi - lo).abs().max().item())
    return {"names": sorted(replicated), "spread": worst}


def test_replicated_parameters_stay_bit_identical_with_dropout(pool4):
    for tp in (2, 4):
        for res in pool4.run(replicated_params_after_steps, tp):
            assert res["spread"] == 0.0
            assert "mlp.dense_4h_to_h.bias" in res["names"] and "ln_mlp.weight" in res["names"]


def dp_masks(tp: int) -> list:
    state = initialize_model_parallel(tp)
    rng = DropoutRNG(seed=11, sample_offset=state.dp_rank * B)
    drop = ParallelDropout(0.5, rng)
    return drop(torch.ones(B, T, D)).tolist()


def test_masks_differ_across_dp_and_agree_within_tp(pool4):
    masks = pool4.run(dp_masks, 2)  # ranks (0,1) and (2,3) are TP groups; DP pairs are (0,2), (1,3)
    assert masks[0] == masks[1] and masks[2] == masks[3]
    assert masks[0] != masks[2]


def _reference_keep(row: int, column: int, p: float, key: tuple[int, int, int]) -> bool:
    """The same hash in plain Python integers: guards the int32 wrap-around arithmetic."""
    from parallel_latent.parallel.random import _splitmix64

    def mix(h):
        h ^= h >> 16
        h = (h * 0x7FEB352D) & 0xFFFFFFFF
        h ^= h >> 15
        h = (h * 0x846CA68B) & 0xFFFFFFFF
        return h ^ (h >> 16)

    seed, step, layer = key
    k_row = _splitmix64(_splitmix64(_splitmix64(seed) ^ step) ^ layer)
    k_col = _splitmix64(k_row) & 0xFFFFFFFF
    row_hash = mix(mix((row & 0xFFFFFFFF) ^ (k_row & 0xFFFFFFFF)) ^ (row >> 32) ^ (k_row >> 32))
    return mix(mix(column ^ row_hash) ^ k_col) >= round(p * 2**32)


def test_int32_hash_matches_python_reference():
    key, p = (123, 45, 6), 0.3
    shape = (3, 5, 7)
    offsets = (2**31, 1, 9)  # a row index beyond 2**32 exercises the high word
    full = (2**31 + 3, 6, 20)
    mask = keep_mask(shape, p, key, offsets, full)
    for b in range(3):
        for t in range(5):
            for c in range(7):
                row = (offsets[0] + b) * full[1] + offsets[1] + t
                assert bool(mask[b, t, c]) == _reference_keep(row, offsets[2] + c, p, key)


def test_bf16_dropout_scales_once_without_rounding_the_scale():
    """A kept bf16 element is x * 1/(1-p) rounded once to bf16: its expected value is x up to that
    rounding. A scale rounded to bf16 first (1/0.9 -> 1.109375) would make every site 0.16% low."""
    p = 0.1
    scale = 1.0 / (1.0 - p)
    gen = torch.Generator().manual_seed(0)
    x = (torch.rand(8, 16, 64, generator=gen) * 4 - 2).to(torch.bfloat16)
    rng = DropoutRNG(seed=9)
    drop = ParallelDropout(p, rng).train()
    y = drop(x.clone().requires_grad_())
    keep = keep_mask(tuple(x.shape), p, (rng.seed, rng.step, drop.layer_id), (0, 0, 0), tuple(x.shape))
    assert y.dtype == torch.bfloat16
    assert torch.equal(y.detach() != 0, keep & (x != 0))
    want = (x.float() * scale).to(torch.bfloat16)
    assert torch.equal(y.detach()[keep], want[keep])
    assert not torch.equal(want[keep], x[keep] * torch.tensor(scale, dtype=torch.bfloat16))  # the old way differs
    # The expected value: the sum over kept elements is x * scale up to bf16's rounding of each
    # product (at most half an ulp, 2^-8 relative).
    exact = (x.double() * scale)[keep]
    assert (y.detach().double()[keep] - exact).abs().sum() <= 2**-8 * exact.abs().sum()
    # Backward applies the same mask and scale.
    leaf = x.clone().requires_grad_()
    grad = (torch.rand(x.shape, generator=gen) + 0.5).to(torch.bfloat16)
    drop(leaf).backward(grad)
    assert torch.equal(leaf.grad[keep], (grad.float() * scale).to(torch.bfloat16)[keep])
    assert not leaf.grad[~keep].any()


def _dropout_pair(compile_devices):
    """Two dropout sites of identical keys, one eager and one whose kernel compiles on the CPU."""
    eager = ParallelDropout(0.1, DropoutRNG(seed=5, step=11, sample_offset=4)).train()
    other = ParallelDropout(0.1, DropoutRNG(seed=5, step=11, sample_offset=4, compile_devices=compile_devices)).train()
    return eager, other


def test_compiled_dropout_equals_eager():
    """On CUDA the mask and its application are one compiled kernel: the same bits as eager. Checked
    on the CPU through inductor's CPU backend (compiling takes a while here; the CPU path itself
    stays eager), for two shapes (the second one reuses the kernel with dynamic sizes)."""
    eager, compiled = _dropout_pair(("cpu",))
    gen = torch.Generator().manual_seed(0)
    with torch._inductor.config.patch(compile_threads=1):  # no worker pool to start on a small machine
        for shape in ((2, 8, 48), (3, 4, 32)):
            x = torch.randn(shape, generator=gen)
            assert torch.equal(compiled(x), eager(x))
    assert compiled.rng._kernel.failure is None and compiled.rng._kernel.compiled is not None
    x = torch.randn(2, 8, 48, generator=gen)
    keep = keep_mask((2, 8, 48), 0.1, (5, 11, eager.layer_id), (4, 0, 0), (6, 8, 48))
    assert torch.equal(eager(x), torch.where(keep, x * (1 / 0.9), 0.0))


def test_failed_compile_falls_back_to_eager_with_one_warning(monkeypatch, caplog):
    """No Triton or no C compiler: compiling the dropout kernel fails at its first call; the step
    goes on eagerly with the same masks, and one warning names the cause."""

    def no_compiler(fn, **options):
        def fails(*args, **kwargs):
            raise RuntimeError("Cannot find a working triton installation\nmore detail")

        return fails

    monkeypatch.setattr(torch, "compile", no_compiler)
    eager, failing = _dropout_pair(("cpu",))
    x = torch.randn(2, 8, 48, generator=torch.Generator().manual_seed(0))
    with caplog.at_level("WARNING"):
        for _ in range(3):
            assert torch.equal(failing(x), eager(x))
    warnings = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
    assert warnings == [
        "torch.compile of the dropout mask kernel failed (RuntimeError: Cannot find a working triton "
        "installation); running it eagerly"
    ]
