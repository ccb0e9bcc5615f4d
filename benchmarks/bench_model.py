"""Model benchmarks: the autoencoder at TP=1 against its plain PyTorch twin (goal <= 1.05 at dropout 0); the
truncated GPT-2 against the full one's ``output_hidden_states[-3]`` (goal <= 0.87); the operators and
Python-data tensors of one training step and of a dropout site, counted; the loss's peak extra memory.

Usage: python -m benchmarks.bench_model [--batch 16 --seq 32 --d-model 256 --repeats 16] [--quick]
"""

from __future__ import annotations

import logging

import torch
import torch.nn.functional as F

from benchmarks.harness import GPT2, GPT2_SHRUNK, Report, add_repeat_arguments, command, interleaved
from benchmarks.op_counter import OpCounter
from benchmarks.plain_twins import plain_twin
from benchmarks.processes import peak_extra_bytes
from parallel_latent.config import FeatureModelConfig, ModelConfig, load_config
from parallel_latent.feature_model import FeatureModel
from parallel_latent.feature_model.features import load_decoder
from parallel_latent.model import LatentAutoencoder
from parallel_latent.parallel import DropoutRNG, ParallelDropout, vocab_parallel_cross_entropy
from parallel_latent.parallel.dropout import drop_threshold, keep_mask_core, layer_key

GPT2_VOCAB = 50259  # GPT-2's 50257 tokens plus mask and pad (ids vocab-2, vocab-1 here)


def model_vs_plain(args, report: Report) -> None:
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(0, args.vocab - 2, (args.batch, args.seq), generator=gen)
    lengths = torch.randint(args.seq // 2, args.seq + 1, (args.batch,), generator=gen)
    mask = (torch.arange(args.seq) < lengths[:, None]).long()
    ids = ids.masked_fill(mask == 0, args.vocab - 1)
    feature_cfg = FeatureModelConfig(n_layer=args.feature_layers, n_head=args.heads, n_embd=args.d_model)
    for dropout in args.dropouts:
        model_cfg = ModelConfig(d_model=args.d_model, n_heads=args.heads, n_encoder_layers=args.layers,
                                n_decoder_layers=args.layers, max_length=args.seq, dropout=dropout,
                                vocab_size=args.vocab, mask_token_id=args.vocab - 2, pad_token_id=args.vocab - 1,
                                head="normal")  # the plain twin has a head of its own  # fmt: skip
        ours = LatentAutoencoder(model_cfg, feature_cfg, seed=0).train()
        plain = plain_twin(ours).train()
        if dropout == 0.0:
            ours_loss, plain_loss = ours(ids, mask).loss.item(), plain(ids, mask).item()
            assert abs(ours_loss - plain_loss) <= 1e-4 * abs(plain_loss), (ours_loss, plain_loss)
            print(f"same weights, same loss: ours {ours_loss:.6f}, plain {plain_loss:.6f}")

        def ours_step(ours=ours):
            ours.dropout_rng.step += 1
            ours(ids, mask).loss.backward()
            ours.zero_grad(set_to_none=True)

        def plain_step(plain=plain):
            plain(ids, mask).backward()
            plain.zero_grad(set_to_none=True)

        samples = interleaved({"ours": ours_step, "plain": plain_step}, args.repeats, ratios=[("ours", "plain")],
                              most=args.most_repeats)  # fmt: skip
        print(f"model fwd+bwd TP=1, vocab {args.vocab}, dropout={dropout}: ours {samples.median('ours') * 1e3:.1f} "
              f"ms, plain PyTorch {samples.median('plain') * 1e3:.1f} ms")  # fmt: skip
        goal = 1.05 if dropout == 0.0 else None
        report.ratio(f"model fwd+bwd ours / plain PyTorch, dropout {dropout}", samples, "ours", "plain", at_most=goal)


def features_vs_full(args, report: Report) -> None:
    cfg = FeatureModelConfig(n_layer=args.feature_layers_full, n_head=12, n_embd=args.feature_width)
    torch.manual_seed(0)
    full = load_decoder(cfg, GPT2_VOCAB).decoder.eval()  # a random build is whole: not cut
    torch.manual_seed(0)
    truncated = FeatureModel(cfg, GPT2_VOCAB)
    ids = torch.randint(0, 50257, (args.feature_batch, args.seq), generator=torch.Generator().manual_seed(1))
    mask = torch.ones_like(ids)
    # The same function (the fused tanh GELU, causal attention without a mask), equal up to rounding:
    # tests/model/test_features.py holds it to the bound of that rounding.

    def run_full():
        with torch.no_grad():
            full(input_ids=ids, attention_mask=mask, output_hidden_states=True).hidden_states[-3]

    def run_truncated():
        truncated(ids, mask)

    samples = interleaved({"truncated": run_truncated, "full": run_full}, args.repeats,
                          ratios=[("truncated", "full")], most=args.most_repeats)  # fmt: skip
    held = sum(p.numel() for p in truncated.parameters()) / sum(p.numel() for p in full.parameters())
    print(f"features, {cfg.n_layer}-layer GPT-2 of width {cfg.n_embd}, batch {args.feature_batch}x{args.seq}: "
          f"truncated {samples.median('truncated') * 1e3:.1f} ms, full output_hidden_states "
          f"{samples.median('full') * 1e3:.1f} ms; weights held {held:.3f}x")  # fmt: skip
    report.ratio("features truncated / full GPT-2", samples, "truncated", "full", at_most=0.87)


def step_ops(args, report: Report) -> None:
    gen = torch.Generator().manual_seed(0)
    for dropout in (0.1, 0.0):  # configs/gpt2.yaml's autoencoder over a random GPT-2 of gpt2's shape
        cfg = load_config(GPT2, [*(GPT2_SHRUNK if args.quick else []), f"model.dropout={dropout}"])
        feature_cfg = FeatureModelConfig(**{**cfg.feature_model.__dict__, "pretrained": False})
        model = LatentAutoencoder(cfg.model, feature_cfg, seed=0).train()
        ids = torch.randint(0, 50257, (2, model.model_cfg.max_length), generator=gen)
        mask = torch.ones_like(ids)
        model(ids, mask).loss.backward()  # warm-up: caches
        with OpCounter() as forward:
            loss = model(ids, mask).loss
        with OpCounter() as backward:
            loss.backward()
        ours = [caller for caller in forward.from_python_data if caller is not None]
        print(f"one training forward + backward, gpt2.yaml-shaped{' (shrunk)' if args.quick else ''}, batch 2 x "
              f"{ids.shape[1]}, dropout {dropout}: {forward.total:,} + {backward.total:,} operators; "
              f"{len(forward.from_python_data)} tensors from Python data in the forward, {len(ours)} from "
              f"parallel_latent {sorted(set(ours))}")  # fmt: skip
        report.figure(f"operators per training forward, dropout {dropout}", forward.total)
        report.figure(f"operators per training backward, dropout {dropout}", backward.total)
        report.figure(f"tensors built from Python data by parallel_latent per forward, dropout {dropout}", len(ours),
                      at_most=0)  # fmt: skip
    rng = DropoutRNG(seed=1, step=5)
    site = ParallelDropout(0.1, rng).train()
    x = torch.randn(2, 64, 64 if args.quick else 768, generator=gen)
    site(x)  # the index tensors, built once per shape
    with OpCounter() as whole:
        site(x)
    row_index, columns = rng.indices(tuple(x.shape), (0, 0, 0), tuple(x.shape), x.device)
    with OpCounter() as hash_only:
        keep_mask_core(row_index, columns, *layer_key((1, 5, site.layer_id)), drop_threshold(0.1))
    print(f"one dropout site: {whole.total} operators, {hash_only.total} of them the mask hash (eager, CPU)")
    report.figure("operators per dropout site outside the mask hash", whole.total - hash_only.total, at_most=3)


def loss_memory(args, report: Report) -> None:
    rows, vocab, real = (256 if args.quick else 8192), 50304, 50257
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(rows, vocab, generator=gen).to(torch.bfloat16).requires_grad_()
    target = torch.randint(0, real, (rows,), generator=gen)

    def ours(chunk_rows=None):
        loss, _ = vocab_parallel_cross_entropy(logits, target, real, chunk_rows=chunk_rows)
        loss.sum().backward()
        logits.grad = None

    def plain():
        F.cross_entropy(logits.float()[:, :real], target, reduction="sum").backward()
        logits.grad = None

    ours()  # warm-up
    measured = {"ours": peak_extra_bytes(ours), "one chunk": peak_extra_bytes(lambda: ours(rows)),
                "F.cross_entropy in fp32": peak_extra_bytes(plain)}  # fmt: skip
    size = logits.numel() * logits.element_size()
    print(f"loss forward + backward, bf16 logits [{rows}, {vocab}] ({size / 2**20:.0f} MiB; the bf16 gradient is as "
          "large): peak extra " + ", ".join(f"{k} {v / 2**20:.0f} MiB" for k, v in measured.items()))  # fmt: skip
    for name, value in measured.items():
        report.figure(f"loss peak extra memory, B*T={rows}, V={vocab}, bf16: {name}", value / 2**20, "MiB")
    report.figure("loss peak extra memory, ours / one chunk", measured["ours"] / measured["one chunk"], "x",
                  at_most=0.5)  # fmt: skip


def body(args, report: Report) -> None:
    if args.quick:
        args.batch, args.seq, args.d_model, args.feature_layers, args.repeats, args.most_repeats = 2, 8, 32, 2, 3, None
        args.feature_batch, args.feature_width, args.feature_layers_full = 2, 48, 4
    torch.set_num_threads(args.threads)
    logging.getLogger("parallel_latent.feature_model.features").setLevel(logging.ERROR)  # random GPT-2 on purpose
    print(f"torch {torch.__version__}, {args.threads} thread(s)")
    for part in (model_vs_plain, features_vs_full, step_ops, loss_memory):
        if args.only in (None, part.__name__):
            part(args, report)


def arguments(parser) -> None:
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--seq", type=int, default=32)
    parser.add_argument("--d-model", type=int, default=256)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--vocab", type=int, default=GPT2_VOCAB, help="50304 (a multiple of 128): our padded head's")
    parser.add_argument("--layers", type=int, default=2, help="Perceiver blocks in the encoder and in the decoder")
    parser.add_argument("--feature-layers", type=int, default=4)
    parser.add_argument("--feature-batch", type=int, default=8)
    parser.add_argument("--feature-width", type=int, default=768, help="GPT-2 width of the feature comparison")
    parser.add_argument("--feature-layers-full", type=int, default=12, help="GPT-2 depth of the feature comparison")
    add_repeat_arguments(parser, repeats=16, most=64)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--dropouts", type=float, nargs="+", default=[0.0, 0.1])
    parser.add_argument("--only", choices=["model_vs_plain", "features_vs_full", "step_ops", "loss_memory"])


main = command("bench_model", __doc__, body, arguments, __name__)
