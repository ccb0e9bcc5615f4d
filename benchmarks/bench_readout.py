"""What limits narrow latents, measured without training (docs/quality.md): a random k-dimensional code of
every token read back by the tied head's inner product and by the nearest normalised code, and how much
of a token a k-dimensional linear code of the frozen GPT-2's features holds.

    python -m benchmarks.bench_readout [--quick]      # 3,000 corpus lines; --quick: 300
"""

from __future__ import annotations

from benchmarks.harness import REPO, Report, command, config_with_tokenizer

CONFIG = "configs/compressed.yaml"
RANKS = (8, 12, 16, 32)
T = 32


def normalised(x):
    x = x - x.mean(-1, keepdim=True)
    return x / x.pow(2).mean(-1, keepdim=True).sqrt()


def corpus_features(lines: int):
    """(features [S, T, d] normalised, mask, ids [S, T], token table [V, d]) of the first ``lines`` lines, float64."""
    import torch

    from parallel_latent.data import read_samples
    from parallel_latent.feature_model.features import random_features_unannounced
    from parallel_latent.model import LatentAutoencoder

    cfg, tokenizer = config_with_tokenizer(REPO / CONFIG, [])
    with random_features_unannounced():
        model = LatentAutoencoder(cfg.model, cfg.feature_model, seed=cfg.training.seed).eval()
    texts = [text for text in read_samples("") if text.strip()][:lines]
    features, masks, ids = [], [], []
    with torch.no_grad():
        for start in range(0, len(texts), 64):
            batch = tokenizer(texts[start : start + 64], truncation=True, max_length=T, padding="max_length",
                              return_tensors="pt")  # fmt: skip
            features.append(normalised(model.feature_model(batch["input_ids"], batch["attention_mask"]).double()))
            masks.append(batch["attention_mask"].bool())
            ids.append(batch["input_ids"])
    table = model.feature_model.token_table.detach().double()  # every row the heads score
    return torch.cat(features), torch.cat(masks), torch.cat(ids), table


def _chunked_argmax(queries, keys, rows: int = 1024):
    import torch

    return torch.cat([(queries[i : i + rows] @ keys.t()).argmax(dim=1) for i in range(0, len(queries), rows)])


def feature_fits(report: Report, features, mask, ids, table) -> None:
    import torch
    import torch.nn.functional as F

    samples = features.shape[0]
    train = torch.arange(samples) < int(0.8 * samples)
    position, rows = F.one_hot(torch.arange(T), T).double().expand(samples, T, T), normalised(table)
    previous = torch.roll(ids, 1, dims=1)
    previous[:, 0] = ids[:, 0]

    def fit(inputs, targets):
        x, y = inputs[train][mask[train]], targets[train][mask[train]]
        return torch.linalg.solve(x.t() @ x + 1e-3 * torch.eye(x.shape[1], dtype=x.dtype), x.t() @ y)

    def held_out(tensor):
        return tensor[~train][mask[~train]]

    total = held_out(features).pow(2).mean()
    for label, parts in (("the token and its position", [rows[ids], position]),
                         ("... and the token before it", [rows[ids], rows[previous], position])):  # fmt: skip
        inputs = torch.cat(parts, -1)
        residual = held_out(features) - held_out(inputs) @ fit(inputs, features)
        report.figure(f"features explained linearly by {label} (R^2)", 1 - residual.pow(2).mean() / total)
    inputs = torch.cat([position, features], -1)
    recovered = fit(inputs, rows[ids])  # the token's row from its feature
    residual = inputs[train][mask[train]] @ recovered - rows[ids][train][mask[train]]
    signal = rows[ids][train][mask[train]]
    inverse = torch.linalg.inv(torch.linalg.cholesky(residual.t() @ residual / len(residual)
                                                     + 1e-6 * torch.eye(rows.shape[1], dtype=rows.dtype)))  # fmt: skip
    _, directions = torch.linalg.eigh(inverse @ (signal.t() @ signal / len(signal)) @ inverse.t())
    estimate, truth, generator = held_out(inputs) @ recovered, held_out(ids), torch.Generator().manual_seed(1)
    for k in RANKS:
        for label, basis in (
            ("a random subspace", torch.randn(rows.shape[1], k, generator=generator, dtype=rows.dtype)),
            ("the least mixed subspace", inverse.t() @ directions[:, -k:]),
        ):
            read = _chunked_argmax(normalised(estimate @ basis).float(), normalised(rows @ basis).float())
            report.figure(f"linear code of the features, k={k}, {label}: held-out tokens read back",
                          (read == truth).double().mean() * 100, "%")  # fmt: skip


def body(args, report: Report) -> None:
    import torch

    torch.set_num_threads(max(1, torch.get_num_threads()))
    features, mask, ids, table = corpus_features(300 if args.quick else 3000)
    generator = torch.Generator().manual_seed(0)
    asked = torch.randperm(table.shape[0], generator=generator)[: 512 if args.quick else 8192]
    for k in RANKS:
        codes = (table @ torch.randn(table.shape[1], k, generator=generator, dtype=table.dtype)).float()
        for label, scored in (("inner product", codes), ("nearest normalised code", normalised(codes))):
            read = _chunked_argmax(scored[asked], scored)
            report.figure(f"random code, k={k}: tokens read back by {label}", (read == asked).double().mean() * 100,
                          "%")  # fmt: skip
    feature_fits(report, features, mask, ids, table)


main = command("bench_readout", __doc__, body, None, __name__)
