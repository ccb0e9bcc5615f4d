"""Coordinate-keyed dropout: the mask is a pure function of (seed, step, layer, global index)."""

import itertools
import random

import torch
import torch.distributed as dist

from parallel_latent.parallel import DropoutRNG, ParallelDropout, ParallelGaussianNoise, initialize_model_parallel
from parallel_latent.parallel.dropout import keep_mask
from tests.helpers.blocks import B, Block, D, T
from tests.helpers.gpu import gpu_test
from tests.helpers.inductor import CUDA_LIKE_CPU_KERNELS


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


def test_keyed_noise_is_standard_normal_and_a_pure_function_of_the_coordinates():
    """The latent noise: 2**18 draws whose mean, variance and tails are a standard normal's within
    five standard errors (the mean's 1/sqrt(n), the variance's sqrt(2/n)), independent across steps
    (correlation within 5/sqrt(n)); the same draws for the same (seed, step, sample); a batch cut in
    two with the sample offset draws the whole batch's noise; the identity in eval."""
    rng = DropoutRNG(seed=11)
    noise = ParallelGaussianNoise(1.0, rng)
    x = torch.zeros(64, 64, 64)
    n = x.numel()
    first = noise(x).double().flatten()
    assert abs(first.mean().item()) < 5 / n**0.5
    assert abs(first.var().item() - 1.0) < 5 * (2 / n) ** 0.5
    beyond = (first.abs() > 2).double().mean().item()  # 4.55% of a normal lies beyond 2 sigma
    assert abs(beyond - 0.0455) < 5 * (0.0455 * 0.9545 / n) ** 0.5
    rng.step = 1
    second = noise(x).double().flatten()
    assert abs(torch.corrcoef(torch.stack([first, second]))[0, 1].item()) < 5 / n**0.5
    rng.step = 0
    assert torch.equal(noise(x).double().flatten(), first)
    half = noise(x[:32])
    rng.sample_offset = 32
    assert torch.equal(torch.cat([half, noise(x[32:])]).double().flatten(), first)
    noise.eval()
    assert torch.equal(noise(x), x)
    scaled = ParallelGaussianNoise(0.5, DropoutRNG(seed=11))
    assert torch.equal(scaled(x).double().flatten(), 0.5 * first)  # x 0.5 is exact in binary floating point


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
    from parallel_latent.parallel.dropout import _splitmix64

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
    with torch._inductor.config.patch(CUDA_LIKE_CPU_KERNELS):
        for shape in ((2, 8, 48), (3, 4, 32)):
            x = torch.randn(shape, generator=gen)
            assert torch.equal(compiled(x), eager(x))
    assert compiled.rng._kernels["mask"].failure is None and compiled.rng._kernels["mask"].compiled is not None
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


def test_device_layer_key_equals_the_host_reference():
    """The per-layer key derived on the device in wrapping int64 arithmetic is the host's uint64
    splitmix64 chain bit for bit, for keys of every width (the masks of v1 checkpoints, TP=N ==
    TP=1 and resume depend on it)."""
    from parallel_latent.parallel.dropout import _as_int64, device_layer_key, layer_key, step_key

    draw = random.Random(0)
    widths = (8, 31, 32, 33, 62, 63, 64)  # random values with their top bit w - 1 set: >= 2**31, 2**63
    values = [draw.getrandbits(w) | 1 << (w - 1) for w in widths] + [2**31, 2**32 - 1, 2**63 - 1, 2**63, 2**64 - 1, 0]
    for seed, step, layer in zip(values, reversed(values), values[3:] + values[:3], strict=True):
        rng = DropoutRNG(seed=seed)
        rng.step = step  # as train.py assigns it: the device key follows
        keys = rng.device_keys(torch.device("cpu"))
        assert keys[0].item() == _as_int64(step_key(seed, step))
        got = device_layer_key(keys[0], torch.tensor(_as_int64(layer)))
        assert tuple(int(k) for k in got) == layer_key((seed, step, layer)), (seed, step, layer)
        assert got[2].dtype == torch.int32


def test_index_tensors_are_cached_once_for_every_sample_offset():
    """The sample offset is added in the kernel: one cached index pair serves every micro-batch of
    a step (more than 32 accumulation steps included), with each micro-batch's own mask."""
    rng = DropoutRNG(seed=2)
    drop = ParallelDropout(0.5, rng)
    x = torch.ones(2, 3, 8)
    for micro_step in range(40):
        rng.sample_offset = 2 * micro_step
        keep = keep_mask((2, 3, 8), 0.5, (2, 0, drop.layer_id), (2 * micro_step, 0, 0), (2 * micro_step + 2, 3, 8))
        assert torch.equal(drop(x) != 0, keep)
    assert len(rng._indices) == 1
    assert rng.state_dict() == {"seed": 2, "step": 0, "sample_offset": 78}


def test_a_step_of_dropout_builds_no_tensor_from_python_data():
    """New keys and sample offsets each step are in-place fills of tensors made once: after the
    first step, dropout asks for no tensor built from Python data (a host-to-device copy on a GPU)
    and for no new index tensors."""
    from tests.helpers.op_counter import OpCounter

    rng = DropoutRNG(seed=4)
    drop = ParallelDropout(0.1, rng)
    x = torch.ones(2, 4, 16)
    drop(x)
    counter = OpCounter()
    with counter:
        for step in (1, 2, 3):
            rng.step, rng.sample_offset = step, 2 * step
            drop(x)
    assert counter.from_python_data == [] and counter.ops["aten.arange.start_step"] == 0, counter.ops
    assert counter.ops["aten.fill_.Scalar"] == 6  # a step key and an offset per step


def test_failure_at_the_second_compile_falls_back_with_one_warning(monkeypatch, caplog):
    """The dropout kernel compiles again for a second shape; a compiler failure there (here:
    inductor raising, as a Triton or C++ compile would) runs it eagerly with one warning naming the
    cause, the same masks as eager, and no further attempt to compile."""
    import torch._inductor.compile_fx as compile_fx_module

    real_compile_fx = compile_fx_module.compile_fx
    compiles = []

    def fails_the_second_time(*args, **kwargs):
        compiles.append(1)
        if len(compiles) == 2:
            raise RuntimeError("PTXAS error: internal compiler failure\nmore detail")
        return real_compile_fx(*args, **kwargs)

    monkeypatch.setattr(compile_fx_module, "compile_fx", fails_the_second_time)
    torch._dynamo.reset()
    eager, compiled = _dropout_pair(("cpu",))
    gen = torch.Generator().manual_seed(0)
    with caplog.at_level("WARNING"), torch._inductor.config.patch(CUDA_LIKE_CPU_KERNELS):
        for shape in ((2, 8, 48), (3, 4, 32), (3, 4, 32), (2, 8, 48)):
            x = torch.randn(shape, generator=gen)
            assert torch.equal(compiled(x), eager(x))
    assert len(compiles) == 2
    warnings = [r.getMessage() for r in caplog.records if r.levelname == "WARNING" and "dropout" in r.getMessage()]
    assert warnings == [
        "torch.compile of the dropout mask kernel failed (RuntimeError: PTXAS error: internal compiler "
        "failure); running it eagerly"
    ]


def test_compiled_dropout_kernel_compiles_once_for_every_step_offset_and_layer():
    """The compiled kernel reads the step's key and the sample offset from the model's key tensor
    and the layer from its site's buffer: new steps, micro-batches and sites reuse its one graph,
    with the eager path's masks."""
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    eager_rng, compiled_rng = DropoutRNG(seed=8), DropoutRNG(seed=8, compile_devices=("cpu",))
    sites = [(ParallelDropout(0.1, eager_rng), ParallelDropout(0.1, compiled_rng)) for _ in range(2)]
    x = torch.randn(2, 8, 48, generator=torch.Generator().manual_seed(0))
    with torch._inductor.config.patch(CUDA_LIKE_CPU_KERNELS):
        for step in (0, 1, 2):
            for micro_step in (0, 1):
                for rng in (eager_rng, compiled_rng):
                    rng.step, rng.sample_offset = step, 2 * micro_step
                for eager, compiled in sites:
                    assert torch.equal(compiled(x), eager(x))
    assert counters["stats"]["unique_graphs"] == 1 and compiled_rng._kernels["mask"].failure is None


# --------------------------------------------------------------------------- #
# On a GPU (pytest -m gpu).
# --------------------------------------------------------------------------- #

CUDA_SITES = 3
CUDA_KEYS = ((7, 0), (8, 32), (9, 96))  # (step, sample_offset): new keys, as training changes them
CUDA_SHAPES = ((32, 64, 768), (8, 64, 3072))


@gpu_test
def test_on_cuda_the_compiled_mask_kernel_gives_the_eager_bits():
    """The compiled mask kernel against eager on this GPU, over several sites (layer ids), keys and
    shapes: the same bits. With the GELU in the kernel the same elements are kept, each within one
    bf16 rounding of eager's (both compute the GELU in fp32 from the same input; CUDA's erf and
    inductor's may differ by a few fp32 ulps before that one rounding)."""
    eager_rng, compiled_rng = DropoutRNG(seed=3, compile_devices=()), DropoutRNG(seed=3)
    eager = [ParallelDropout(0.1, eager_rng).train() for _ in range(CUDA_SITES)]
    compiled = [ParallelDropout(0.1, compiled_rng).train() for _ in range(CUDA_SITES)]
    eps = torch.finfo(torch.bfloat16).eps
    for (step, offset), shape in itertools.product(CUDA_KEYS, CUDA_SHAPES):
        for rng in (eager_rng, compiled_rng):
            rng.step, rng.sample_offset = step, offset
        x = torch.randn(shape, device="cuda", dtype=torch.bfloat16)
        for c, e in zip(compiled, eager, strict=True):
            assert torch.equal(c(x), e(x))
            got, want = c(x, gelu=True).float(), e(x, gelu=True).float()
            assert torch.equal(got == 0, want == 0)
            assert ((got - want).abs() <= eps * want.abs()).all()
    assert all(kernel.failure is None for kernel in compiled_rng._kernels.values())
