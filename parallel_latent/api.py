"""Text in, latents out, and back: the trained autoencoder with the tokenizer it was trained with.

    from parallel_latent.api import TextAutoencoder

    autoencoder = TextAutoencoder.from_checkpoint("runs/tiny")   # run, checkpoints, step or portable dir
    latents = autoencoder.encode(["It is a truth universally acknowledged."])
    latents.latents.shape                  # [B, N, k]; latents.attention_mask [B, T] marks real tokens
    autoencoder.decode(latents)            # ["It is a truth universally acknowledged."]
    autoencoder.latent_stats               # per-feature mean and std [k], to standardise the latents
    autoencoder.interpolate("first text", "second text", steps=5)   # texts along the line between
    autoencoder.save_pretrained("tiny")    # a Hugging Face model directory; from_pretrained("tiny" or "org/name")

This module sits above both the model and the checkpoint packages (the model does not know how it
is stored). In one process it needs no process group. At TP=N every rank of a tensor-parallel group
loads it with that ``tp_group`` (each rank then holds only its slices of the split layers) and calls
the same methods with the same texts, in the same order: the forward passes are collectives over
the group, and every rank gets the same latents and the same texts back.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist

from parallel_latent import pretrained
from parallel_latent.checkpoint import (
    CheckpointError,
    PortableCheckpoint,
    load_portable,
    read_newest,
    resolve_portable_dir,
)
from parallel_latent.checkpoint.layout import MANIFEST_NAME
from parallel_latent.config import FeatureModelConfig, ModelConfig, build_dataclass
from parallel_latent.data import tokenize_samples
from parallel_latent.evaluation.latent_space import LatentStats
from parallel_latent.evaluation.records import detokenize
from parallel_latent.feature_model.features import random_features_unannounced
from parallel_latent.feature_model.from_record import (
    feature_config_from_record,
    recorded_feature_model,
    tokenizer_from_record,
)
from parallel_latent.latents import export_latents, plan_export
from parallel_latent.launching.rendezvous import join_job
from parallel_latent.model import LatentAutoencoder, eval_mode
from parallel_latent.model.autoencoder import length_mask, predicted_lengths
from parallel_latent.parallel import device_kind
from parallel_latent.training.watchdog import Progress, Watchdog, collective_timeout_s

__all__ = ["Latents", "TextAutoencoder", "encode_corpus", "load_autoencoder", "load_checkpoint_tokenizer"]


def autoencoder_configs(directory: Path, manifest: dict) -> tuple[ModelConfig, FeatureModelConfig, int, dict | None]:
    """(model config, feature model config, seed, the feature model's recorded transformers config)
    of the portable ``directory`` whose manifest is
    ``manifest``, from the manifest alone: one line naming the manifest and the key when it is not
    an autoencoder's, or when its feature model could only come from outside the directory."""
    if not manifest.get("model_config") or not manifest.get("feature_model_config"):
        raise CheckpointError(f"{directory}: the manifest has no model config; not a LatentAutoencoder checkpoint")
    source = str(directory / MANIFEST_NAME)
    model_cfg = build_dataclass(ModelConfig, ModelConfig.saved(manifest["model_config"]), source, "model_config")
    feature_cfg = feature_config_from_record(manifest, source)
    seed = ((manifest.get("config") or {}).get("training") or {}).get("seed", 1234)
    return model_cfg, feature_cfg, seed, recorded_feature_model(manifest, source)


def _build_and_load(directory: Path, configs: tuple, tp_group, verify_checksums: bool) -> LatentAutoencoder:
    model_cfg, feature_cfg, seed, recorded = configs
    with random_features_unannounced():  # every weight is loaded next: the warning does not apply
        model = LatentAutoencoder(model_cfg, feature_cfg, tp_group=tp_group, seed=seed, recorded_feature_model=recorded)
    load_portable(directory, model, tp_group, verify_checksums=verify_checksums)
    return model.eval()


def load_autoencoder(path: str | Path, tp_group=None, *, verify_checksums: bool = True) -> LatentAutoencoder:
    """Build a ``LatentAutoencoder`` from a checkpoint's manifest and load its weights (eval mode).

    ``path``: a portable directory, a consolidated directory or a training checkpoint (its
    ``model/``). With ``tp_group=None`` it runs in a single process without any process group. The
    GPT-2 is rebuilt from the recorded architecture and filled from the checkpoint: no path or hub
    id that the manifest names is read (:mod:`parallel_latent.feature_model.from_record`).
    """
    directory = resolve_portable_dir(path)
    manifest = PortableCheckpoint(directory, verify_checksums=False).manifest
    return _build_and_load(directory, autoencoder_configs(directory, manifest), tp_group, verify_checksums)


@dataclass
class Latents:
    """One row per input text: ``latents`` [B, N, k] (N = T and k = d_model unless the model
    compresses: ``model.num_latents``, ``model.latent_dim``) and ``attention_mask`` [B, T] (1 = a
    real token); ``truncated`` [B] says which texts were longer than ``T`` tokens and were cut."""

    latents: torch.Tensor
    attention_mask: torch.Tensor
    truncated: torch.Tensor

    def __len__(self) -> int:
        return self.latents.shape[0]


def load_checkpoint_tokenizer(directory: Path, manifest: dict, tokenizer: str | None = None):
    """The tokenizer a portable checkpoint was trained with, from the checkpoint alone (or
    ``tokenizer``, a name or path the caller gives), checked against its recorded facts."""
    return tokenizer_from_record(directory, manifest, str(Path(directory) / MANIFEST_NAME), tokenizer)


class TextAutoencoder:
    """A :class:`LatentAutoencoder` and its tokenizer. Every method runs the model in eval mode and
    leaves its mode as it found it (a trainer can call them between steps)."""

    def __init__(
        self, model: LatentAutoencoder, tokenizer, source: Path | None = None, latent_stats: LatentStats | None = None
    ):
        self.model = model
        self.tokenizer = tokenizer
        self.source = source  # the directory it was loaded from: save_pretrained's model card reads its record
        # The latents' per-feature mean and standard deviation [k] at the checkpoint's last
        # evaluation (see :mod:`parallel_latent.evaluation.latent_space`); None for checkpoints
        # written before they were recorded. save_pretrained records them again.
        self.latent_stats = latent_stats

    @classmethod
    def from_checkpoint(
        cls, path: str | Path, tp_group=None, device: str | torch.device | None = None, *, tokenizer: str | None = None
    ) -> TextAutoencoder:
        """Load from a run directory, a checkpoints directory, a training checkpoint, or a portable
        or consolidated directory, saved at any TP degree (``tp_group=None``: one process), onto
        ``device`` (default: the CPU). Everything comes from that directory, never from a path or
        hub id its manifest names; ``tokenizer`` (a name, path or hub id), if given, is used
        instead of the checkpoint's: for a checkpoint that does not hold its own."""

        def load(directory: Path) -> TextAutoencoder:
            manifest = PortableCheckpoint(directory, verify_checksums=False).manifest
            # What the manifest alone decides comes first: a feature model or a tokenizer that the
            # checkpoint cannot supply is refused before anything else is read or built.
            configs = autoencoder_configs(directory, manifest)
            loaded_tokenizer = load_checkpoint_tokenizer(directory, manifest, tokenizer)
            model = _build_and_load(directory, configs, tp_group, verify_checksums=True)
            try:
                stats = LatentStats.from_dict(
                    manifest.get("latent_stats"), f"{directory / MANIFEST_NAME}: latent_stats"
                )
            except ValueError as problem:
                raise CheckpointError(str(problem)) from None
            return cls(model.eval(), loaded_tokenizer, directory, stats)

        # A run that trains meanwhile may prune the checkpoint found first: the newest is read.
        autoencoder = read_newest(path, load)
        if device is not None:
            autoencoder.model = autoencoder.model.to(device)
        return autoencoder

    @classmethod
    def from_pretrained(
        cls,
        path_or_repo_id: str | Path,
        tp_group=None,
        device: str | torch.device | None = None,
        *,
        tokenizer: str | None = None,
        **hub_options,
    ) -> TextAutoencoder:
        """Load a :meth:`save_pretrained` directory, or a Hugging Face hub repository by id (downloaded
        once per node; ``hub_options``: ``revision``, ``cache_dir``, ``token``), at any TP degree as
        :meth:`from_checkpoint` (``tokenizer`` too). Under a process group every rank calls it."""
        directory = pretrained.pretrained_directory(path_or_repo_id, **hub_options)
        return cls.from_checkpoint(directory, tp_group, device, tokenizer=tokenizer)

    def save_pretrained(self, directory: str | Path, **options) -> Path:
        """Write a hub-layout directory (config.json, model.safetensors at TP=1, the tokenizer's
        files, a model card with the held-out evaluation); see :mod:`parallel_latent.pretrained`.
        Under a process group every rank calls it."""
        return pretrained.save_pretrained(self, directory, **options)

    def push_to_hub(self, repo_id: str, **options) -> str:
        """:meth:`save_pretrained` into a temporary directory and upload it to the hub repository
        ``repo_id`` (``options``: ``private``, ``token``, ``revision``, ``message``); the commit URL."""
        return pretrained.push_to_hub(self, repo_id, **options)

    @property
    def device(self) -> torch.device:
        return next(self.model.parameters()).device

    @torch.no_grad()
    def encode(self, texts: list[str]) -> Latents:
        """Latents of ``texts`` (each cut to ``model.max_length`` tokens; an empty text gives a row
        without tokens)."""
        cfg = self.model.model_cfg
        batch = tokenize_samples(texts, self.tokenizer, cfg.max_length, cfg.pad_token_id, keep_empty=True)
        input_ids, attention_mask = batch.input_ids.to(self.device), batch.attention_mask.to(self.device)
        with eval_mode(self.model):
            latents = self.model.encode(input_ids, attention_mask)
        return Latents(latents, attention_mask, batch.truncated)

    @torch.no_grad()
    def decode_ids(self, latents: torch.Tensor, attention_mask: torch.Tensor | None = None) -> torch.Tensor:
        """Token ids [B, T] (the pad id where ``attention_mask`` is 0). Without a mask (a model
        trained with ``model.predict_length``) T is ``max_length`` and each row ends at its
        predicted length."""
        check_decode_inputs(latents, attention_mask)
        largest = latents.abs().max().item() if latents.numel() else 0.0
        latents = latents.to(self.device, next(self.model.parameters()).dtype)
        with eval_mode(self.model):
            ids = self.model.decode(latents, None if attention_mask is None else attention_mask.to(self.device))
        # Latents so large that the decoder's arithmetic overflows leave no largest logit to pick:
        # the argmax then names no token.
        if ((ids < 0) | (ids >= self.model.model_cfg.vocab_size)).any():
            raise ValueError(
                f"latents too large for the decoder (the largest |value| is {largest:.3g}): its output is not finite"
            )
        return ids

    def decode(self, latents: Latents | torch.Tensor, attention_mask: torch.Tensor | None = None) -> list[str]:
        """Texts of ``latents`` (a :class:`Latents`, or a tensor with its ``attention_mask``; a model
        with ``model.predict_length`` decodes a tensor without one, at its predicted lengths)."""
        if isinstance(latents, Latents):
            latents, attention_mask = latents.latents, latents.attention_mask
        if attention_mask is None and not self.model.model_cfg.predict_length:
            raise ValueError(
                "decode needs the attention_mask that encode returned with the latents "
                "(this model was not trained with model.predict_length)"
            )
        ids = self.decode_ids(latents, attention_mask)
        if attention_mask is None:
            attention_mask = length_mask(predicted_lengths(ids, self.model.model_cfg.pad_token_id), ids.shape[1])
        return detokenize(self.tokenizer, ids, attention_mask)

    def reconstruct(self, texts: list[str]) -> list[str]:
        """``decode(encode(texts))``: what the model makes of each text (as far as it saw it)."""
        return self.decode(self.encode(texts))

    def interpolate(self, first: str, second: str, steps: int = 5) -> list[str]:
        """The decodings of ``steps`` (>= 2) latents evenly spaced on the straight line from the
        latents of ``first`` to those of ``second``. The endpoints are decoded with their own masks
        (they are the two texts' reconstructions); the points between at their predicted lengths
        where the model predicts them, else with the longer of the two masks."""
        if steps < 2:
            raise ValueError(f"interpolate needs at least 2 steps (the two endpoints), got {steps}")
        both = self.encode([first, second])
        start, end = both.latents[0].double(), both.latents[1].double()
        weights = torch.linspace(0.0, 1.0, steps, dtype=torch.float64)[1:-1]
        between = torch.stack([(1 - w) * start + w * end for w in weights]) if steps > 2 else None
        texts = self.decode(both)
        if between is None:
            return texts
        between = between.to(both.latents.dtype)
        if self.model.model_cfg.predict_length:
            middle = self.decode(between)
        else:
            longer = both.attention_mask[both.attention_mask.sum(dim=1).argmax()]
            middle = self.decode(between, longer.expand(steps - 2, -1))
        return [texts[0], *middle, texts[1]]


def check_decode_inputs(latents: torch.Tensor, attention_mask: torch.Tensor | None) -> None:
    """What decode takes, checked before the model sees it (a ValueError in one line): floating-point
    latents [B, N, k] of finite values, and a mask [B, T] of 0s and 1s (integers or booleans) for their B
    samples. Their shape against the model is the model's own check."""
    if latents.dim() != 3:
        raise ValueError(
            f"latents of shape {tuple(latents.shape)}: expected 3 dimensions [samples, latents, width], as encode "
            "returns them"
        )
    if not latents.is_floating_point():
        raise ValueError(f"latents of dtype {latents.dtype}: expected floating point, as encode returns them")
    finite = torch.isfinite(latents)
    if not finite.all():
        count = int((~finite).sum())
        raise ValueError(f"latents hold {count} value{'s' if count > 1 else ''} that {'are' if count > 1 else 'is'} "
                         "not finite (NaN or inf)")  # fmt: skip
    if attention_mask is None:
        return
    if attention_mask.is_floating_point() or attention_mask.is_complex():
        raise ValueError(
            f"attention_mask of dtype {attention_mask.dtype}: expected integers or booleans (1 a token, 0 none)"
        )
    if attention_mask.dim() != 2 or attention_mask.shape[0] != latents.shape[0]:
        raise ValueError(
            f"attention_mask {tuple(attention_mask.shape)} does not match {latents.shape[0]} latent samples"
        )
    if not ((attention_mask == 0) | (attention_mask == 1)).all():
        raise ValueError("attention_mask holds values other than 0 and 1")


def encode_corpus(
    checkpoint: str | Path,
    data: str | Path,
    out: str | Path,
    overrides: list[str] | tuple[str, ...] = (),
    *,
    progress: bool | None = None,
) -> dict:
    """Encode every sample of the corpus ``data`` (anything ``data.path`` accepts) with the
    autoencoder of ``checkpoint`` into the latent dataset ``out``, and return its index (see
    :mod:`parallel_latent.latents`; read it with :func:`parallel_latent.latents.open_latents` or
    ``datasets.load_from_disk``). ``overrides``: ``export.*`` (batch size, shard size, precision),
    ``data.*``, ``parallel.tensor_parallel``, ``parallel.backend``, ``training.device``.

    Collective: under a launcher every rank calls it (world = TP x DP); in one process it runs at
    TP=1 without a launcher. Rerun on a directory it left unfinished, it continues."""
    plan = plan_export(checkpoint, data, overrides)
    training = plan.cfg.training
    on_cuda = device_kind(training.device, "training.device") == "cuda"
    timeout_s = collective_timeout_s(training.hang_timeout_s, training.hang_long_phase_s)
    state = join_job(plan.tensor_parallel, plan.cfg.parallel.backend, timeout_s, training.hang_long_phase_s)
    autoencoder = TextAutoencoder.from_checkpoint(
        plan.directory, tp_group=state.tp_group, device=state.device if on_cuda else None
    )
    if plan.export.precision == "bf16":
        autoencoder.model.to(torch.bfloat16)

    def watch(directory: Path):
        """The hang watchdog over this rank's share of the export (training.hang_timeout_s)."""
        if not training.hang_timeout_s or state.world_size == 1:
            return None
        return Watchdog(
            Progress(), directory, state.rank, state.world_size, training.hang_timeout_s, training.hang_long_phase_s,
            directory / "stacks", active=dist.is_initialized,
        ).start()  # fmt: skip

    return export_latents(autoencoder, plan, out, progress=progress, watch=watch)
