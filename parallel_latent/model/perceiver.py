"""The Perceiver encoder and the latent decoder, built on the tensor-parallel layers.

A Perceiver block (pre-LayerNorm, the Perceiver-resampler form)::

    x = x + attn(ln_query(x), context=ln_context(context))   # keys/values = cat(context, stream)
    x = x + mlp(ln_mlp(x))                                   # h->4h, GELU, dropout, 4h->h, dropout

Attention and MLP are Megatron-split (two all-reduces forward, two backward per block); the
LayerNorms, latents, position tables and the query scale are replicated on every TP rank.

With sequence parallelism (``TensorParallelOptions.sequence_parallel``) the stream and the context
hold this rank's 1/tp of the positions between the TP regions: LayerNorms, residuals, positions and
dropout run on 1/tp of the activations, and each all-reduce becomes an all-gather at a region's
entry plus a reduce-scatter at its exit. The parameters used there see only this rank's positions,
so their gradients are summed over the TP group (``mark_sequence_parallel``).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from parallel_latent.config import ModelConfig
from parallel_latent.parallel import (
    DropoutRNG,
    ParallelAttention,
    ParallelMLP,
    TensorParallelOptions,
    VocabParallelHead,
    copy_to_tp_region,
    group_rank,
    group_size,
    mark_sequence_parallel,
    normal_init,
    scaled_init,
    scatter_to_sequence_parallel_region,
    split_along_sequence,
    with_gradients_summed_together,
)
from parallel_latent.parallel.layers import InitMethod, NearestVocabParallelHead, TiedVocabParallelHead
from parallel_latent.parallel.utils import SINGLE_PROCESS

# How a position lookup starts (the decoder's blocks, and the encoder's with
# model.encoder_context_positions; see LatentDecoder), at any width and init_std:
# - its position rows at the scale of the normalised vectors they are added to (unit root-mean-
#   square: the latents on the decoder's side, the features on the encoder's), so that the position
#   is half of each key's variance;
# - query and key projections equal and scaled so that a query's score for its own (uninformative)
#   stream position starts at LOOKUP_SELF_SCORE;
# - its context LayerNorm's gain, so that the score for the context row of its own position starts
#   at LOOKUP_CONTEXT_GAIN / sqrt(2) times that (about 5.3): a sharp lookup, far above the other
#   rows (whose expected score is 0).
LOOKUP_POSITION_STD = 1.0
LOOKUP_SELF_SCORE = 2.5
LOOKUP_CONTEXT_GAIN = 3.0


def _position_table(length: int, width: int, std: float) -> nn.Parameter:
    table = nn.Parameter(torch.empty(length, width))
    normal_init(std)(table.data)
    return table


def latent_of_position(num_positions: int, num_latents: int) -> torch.Tensor:
    """[T] the latent that position t starts in: floor(t * N / T), contiguous runs of T/N positions
    (as even as N and T allow, at most ceil(T / N) each)."""
    return torch.arange(num_positions) * num_latents // num_positions


def _offsets(num_positions: int, num_latents: int) -> torch.Tensor:
    """[T] each position's place in its latent's run of positions (0, 1, ...)."""
    latent = latent_of_position(num_positions, num_latents)
    first = torch.searchsorted(latent, torch.arange(num_latents))
    return torch.arange(num_positions) - first[latent]


def _head_of_feature(cfg: ModelConfig) -> torch.Tensor:
    """[d] the head whose block of features each feature is (head h: features h*d/H .. (h+1)*d/H)."""
    return torch.arange(cfg.d_model) // (cfg.d_model // cfg.n_heads)


def _offset_of_head(cfg: ModelConfig) -> torch.Tensor:
    """[H] the place in a latent's run of positions that head h reads (heads split evenly over the
    ceil(T / N) places; config validation keeps n_heads >= ceil(T / N))."""
    places = -(-cfg.max_length // cfg.latent_count)
    return torch.arange(cfg.n_heads) * places // cfg.n_heads


def _unit_rows(length: int, cfg: ModelConfig) -> torch.Tensor:
    """[length, d] position rows of unit root-mean-square whose blocks of d/H features (one per
    head) are orthogonal across rows where a block is wide enough (length <= d/H): a per-head
    lookup then scores another row at exactly 0, not at the noise of two random vectors (relative
    size sqrt(H / d), large for a head of 8 or 16 features)."""
    rows = torch.empty(length, cfg.d_model)
    normal_init(LOOKUP_POSITION_STD)(rows)
    head_dim = cfg.d_model // cfg.n_heads
    if length <= head_dim:
        for start in range(0, cfg.d_model, head_dim):
            q, _ = torch.linalg.qr(rows[:, start : start + head_dim].T.double())  # [head_dim, length]
            rows[:, start : start + head_dim] = (q.T * math.sqrt(head_dim)).float()
    return rows


def _compressed_encoder_positions(cfg: ModelConfig) -> tuple[nn.Parameter, nn.Parameter]:
    """(the latents' position table [N, d], the features' [T, d]) of an encoder with fewer latents
    than positions. The features' rows are drawn; in head h's block of features the row of latent
    j is the row of the position at place ``_offset_of_head(h)`` of its run. With every block
    starting as a per-head lookup (``_start_as_head_lookup``), head h of latent j then reads exactly
    that position: the latent's heads share out its positions, each position's features arrive in
    heads of their own (not summed with the others' in one head's value), and which latent holds
    which position is fixed before the first step, not learned."""
    positions = _unit_rows(cfg.max_length, cfg)
    latent = latent_of_position(cfg.max_length, cfg.latent_count)
    first = torch.searchsorted(latent, torch.arange(cfg.latent_count))
    size = torch.bincount(latent, minlength=cfg.latent_count)
    place = _offset_of_head(cfg)[_head_of_feature(cfg)]  # [d]
    rows = first[:, None] + place[None, :] % size[:, None]  # [N, d]: the position each feature copies
    latent_rows = positions.gather(0, rows)
    return nn.Parameter(latent_rows), nn.Parameter(positions)


def _compressed_decoder_positions(cfg: ModelConfig) -> tuple[nn.Parameter, nn.Parameter]:
    """(the latents' position table [N, d], the queries' [T, d]) of a decoder with fewer latents
    than positions: the latents' rows are drawn; in the block of features of each head that reads
    place o of a run, the query of a position at place o carries its latent's row, every other
    query a row of its own. So query t reads its latent in the heads of its place, and itself in
    the others (``_start_as_head_lookup``)."""
    latent_rows = _unit_rows(cfg.latent_count, cfg)
    own = _unit_rows(cfg.max_length, cfg)
    latent = latent_of_position(cfg.max_length, cfg.latent_count)
    place = _offset_of_head(cfg)[_head_of_feature(cfg)]  # [d]
    mine = _offsets(cfg.max_length, cfg.latent_count)[:, None] == place[None, :]  # [T, d]
    return nn.Parameter(latent_rows), nn.Parameter(torch.where(mine, latent_rows[latent], own))


def _replicated_linear(fan_in: int, fan_out: int) -> nn.Linear:
    """A small projection every TP rank holds whole (the bottleneck): weights of variance 1/fan_in, so
    unit-scale inputs give unit-scale outputs; no bias (a LayerNorm follows or a position row is added)."""
    linear = nn.Linear(fan_in, fan_out, bias=False)
    normal_init(1.0 / math.sqrt(fan_in))(linear.weight.data)
    return linear


def _local_rows(length: int, tp_group, sequence_parallel: bool) -> slice:
    """The positions this rank holds between the regions: all, or its 1/tp under sequence parallelism."""
    if not sequence_parallel:
        return slice(0, length)
    size = group_size(tp_group)
    if length % size != 0:
        raise ValueError(f"sequence length {length} is not divisible by tensor_parallel={size} (sequence parallelism)")
    per_rank = length // size
    start = group_rank(tp_group) * per_rank
    return slice(start, start + per_rank)


def _mark_sequence_parallel(tp_group, *modules_or_params) -> None:
    for item in modules_or_params:
        for param in item.parameters() if isinstance(item, nn.Module) else [item]:
            mark_sequence_parallel(param, tp_group)


def _latent_side(params: list[nn.Parameter], tp_group, sequence_parallel: bool) -> list[torch.Tensor]:
    """The parameters a side uses on its latents only (the learned latents, the compressed model's
    latent position table and bottleneck projection), as its forward uses them: under sequence
    parallelism through one gradient all-reduce for all of them, so that the bottleneck costs at
    most one small collective per side (they are marked ``summed_by_caller`` at construction)."""
    return with_gradients_summed_together(params, tp_group) if sequence_parallel else params


def _mark_latent_side(tp_group, params: list[nn.Parameter]) -> None:
    for param in params:
        mark_sequence_parallel(param, tp_group, summed_by_caller=True)


class PerceiverBlock(nn.Module):
    def __init__(
        self,
        cfg: ModelConfig,
        num_layers: int,
        rng: DropoutRNG,
        tp_group=None,
        options: TensorParallelOptions = SINGLE_PROCESS,
    ):
        super().__init__()
        d = cfg.d_model
        init, output_init = normal_init(cfg.init_std), scaled_init(cfg.init_std, num_layers)
        self.ln_query = nn.LayerNorm(d)
        self.ln_context = nn.LayerNorm(d)
        self.attn = ParallelAttention(
            d,
            cfg.n_heads,
            dropout=cfg.dropout,
            rng=rng,
            tp_group=tp_group,
            init_method=init,
            output_init_method=output_init,
            options=options,
        )
        self.ln_mlp = nn.LayerNorm(d)
        self.mlp = ParallelMLP(
            d,
            cfg.mlp_ratio * d,
            dropout=cfg.dropout,
            rng=rng,
            tp_group=tp_group,
            init_method=init,
            output_init_method=output_init,
            options=options,
        )
        if options.sequence_parallel:
            _mark_sequence_parallel(tp_group, self.ln_query, self.ln_context, self.ln_mlp)

    def forward(self, x: torch.Tensor, context: torch.Tensor, context_mask: torch.Tensor | None = None) -> torch.Tensor:
        x = x + self.attn(
            self.ln_query(x), context=self.ln_context(context), context_mask=context_mask, attend_to_self=True
        )
        return x + self.mlp(self.ln_mlp(x))


class PerceiverStack(nn.Module):
    """Blocks applied in turn, each optionally recomputed in backward (activation checkpointing).

    Recomputation is exact even with dropout: masks are a pure function of (seed, rng.step, layer,
    coordinates), so the trainer must only not advance ``rng.step`` between forward and backward.
    """

    def __init__(
        self,
        cfg: ModelConfig,
        num_layers: int,
        rng: DropoutRNG,
        tp_group=None,
        options: TensorParallelOptions = SINGLE_PROCESS,
    ):
        super().__init__()
        self.blocks = nn.ModuleList(PerceiverBlock(cfg, num_layers, rng, tp_group, options) for _ in range(num_layers))
        self.activation_checkpointing = cfg.activation_checkpointing
        self.rng = rng

    def forward(self, x, context, context_mask=None):
        recompute = self.activation_checkpointing and self.training and torch.is_grad_enabled()
        if self.training and self.rng is not None:  # keys on the blocks' device before a compiled block reads them
            self.rng.device_keys(x.device)
        for block in self.blocks:
            if recompute:
                x = checkpoint(block, x, context, context_mask, use_reentrant=False)
            else:
                x = block(x, context, context_mask)
        return x


def _start_as_position_lookup(block: PerceiverBlock, cfg: ModelConfig) -> None:
    """A block whose attention starts by sending query t to context row t (decoder: query t to
    latent t; encoder: latent t to the features of position t).

    The key projection starts equal to the query projection W, so a score is x^T W W^T y with
    W W^T positive semi-definite: a query prefers the keys most like itself, and query t and context
    row t carry the same position row. With W's entries of variance v, a head of dimension h scores two
    LayerNorm'd vectors x, y at about sqrt(h) v x.y, and x.x = d: W is rescaled to the v that
    makes the self score LOOKUP_SELF_SCORE. Rescaling (and copying) the local slices equals doing
    it to the master weight and slicing it (TP=N stays TP=1)."""
    head_dim = cfg.d_model // cfg.n_heads
    std = math.sqrt(LOOKUP_SELF_SCORE / (cfg.d_model * math.sqrt(head_dim)))
    with torch.no_grad():
        block.attn.query.weight.mul_(std / cfg.init_std)
        block.attn.key.weight.copy_(block.attn.query.weight)
        block.ln_context.weight.fill_(LOOKUP_CONTEXT_GAIN)


def _start_as_head_lookup(block: PerceiverBlock, cfg: ModelConfig, tp_group) -> None:
    """A block whose attention starts as a position lookup in each head separately (fewer latents
    than positions): the query and key projections start equal and block-diagonal, head h reading
    only its own block of d/H features through an orthogonal matrix times s, so that head h scores
    a query against a key by their blocks' dot product alone, s^2 / sqrt(d/H) x_h . y_h, where the
    position tables give each head its own position (see ``_compressed_encoder_positions``). s
    makes the self score LOOKUP_SELF_SCORE (a block of unit-scale features has x_h . x_h = d/H).
    Orthogonal, not random: the d/H x d/H random block of a narrow head is far from a multiple of
    an orthogonal one and would blur the lookup. Each orthogonal block is the QR factor of the
    block drawn for that head, on this rank's heads: the same as doing it to the master weight."""
    head_dim = cfg.d_model // cfg.n_heads
    scale = math.sqrt(LOOKUP_SELF_SCORE / math.sqrt(head_dim))
    weight = block.attn.query.weight  # [d / tp, d]: this rank's output features (its heads)
    first_head = group_rank(tp_group) * (weight.shape[0] // head_dim)
    with torch.no_grad():
        start_as = torch.zeros_like(weight)
        for local in range(weight.shape[0] // head_dim):
            rows = slice(local * head_dim, (local + 1) * head_dim)
            columns = slice((first_head + local) * head_dim, (first_head + local + 1) * head_dim)
            orthogonal, _ = torch.linalg.qr(weight[rows, columns].double())
            start_as[rows, columns] = (scale * orthogonal).to(weight.dtype)
        weight.copy_(start_as)
        block.attn.key.weight.copy_(weight)
        block.ln_context.weight.fill_(LOOKUP_CONTEXT_GAIN)


def _start_reading_uniformly(block: PerceiverBlock) -> None:
    """An encoder block whose latents start reading every position alike: the query projection
    starts at zero (its bias already does), so every score starts equal. The start of
    ``model.encoder_context_positions=false``, which checkpoints without that key mean (which latent
    comes to read which position is then learned, and can go wrong: see LatentDecoder)."""
    with torch.no_grad():
        block.attn.query.weight.zero_()


class PerceiverEncoder(nn.Module):
    """T learned latents (plus their own position table) read the GPT-2 features: [B, T, d]; or,
    with ``model.num_latents`` N < T, N latents with a position table of their own, each starting
    as the reader of a run of T/N adjacent positions (``_compressed_encoder_positions``); with
    ``model.latent_dim`` k < d, a d -> k projection and a LayerNorm without gain or bias last.

    Ends with a LayerNorm: the pre-LN residual stream is unnormalised and grows with depth; a final
    norm (GPT-2's ``ln_f``) gives the latents a per-position bounded scale that the decoder, and
    any model trained on the latents, can rely on.

    With ``cfg.encoder_context_positions`` its position table is added to the latents (the queries)
    and to the normalised features (the context), and every block starts as a position lookup:
    latent t reads position t from the first step (see LatentDecoder for why).
    """

    def __init__(
        self,
        cfg: ModelConfig,
        rng: DropoutRNG,
        tp_group=None,
        options: TensorParallelOptions = SINGLE_PROCESS,
    ):
        super().__init__()
        self.tp_group, self.sequence_parallel = tp_group, options.sequence_parallel
        self.context_positions = cfg.encoder_context_positions
        # One latent per position (the default): a latent's row in ``positions`` is its position's.
        self.one_per_position = not cfg.compresses_positions
        self.latents = _position_table(cfg.latent_count, cfg.d_model, cfg.init_std)
        # With context positions the latents' query is mostly their position row (as the decoder's
        # queries are), so that it finds the same row in the context.
        position_std = LOOKUP_POSITION_STD if self.context_positions else cfg.init_std
        if self.one_per_position:  # one table: latent t's row is position t's
            self.positions = _position_table(cfg.latent_count, cfg.d_model, position_std)
        else:  # the latents' own table, and the features' of T rows
            self.latent_positions, self.positions = _compressed_encoder_positions(cfg)
        self.stack = PerceiverStack(cfg, cfg.n_encoder_layers, rng, tp_group, options)
        for block in self.stack.blocks:
            if not self.one_per_position:
                _start_as_head_lookup(block, cfg, tp_group)
            elif self.context_positions:
                _start_as_position_lookup(block, cfg)
            else:
                _start_reading_uniformly(block)
        self.ln_f = nn.LayerNorm(cfg.d_model)
        self.to_latent = _replicated_linear(cfg.d_model, cfg.latent_width) if cfg.has_bottleneck else None
        if self.sequence_parallel:
            _mark_sequence_parallel(tp_group, self.positions, self.ln_f)
            _mark_latent_side(tp_group, self._latent_side_params())

    def _latent_side_params(self) -> list[nn.Parameter]:
        """What this side uses on its latents only: the learned latents, their own position table
        (fewer latents than positions) and the bottleneck projection (narrower latents)."""
        own = [self.latents] if self.one_per_position else [self.latents, self.latent_positions]
        return own + ([self.to_latent.weight] if self.to_latent is not None else [])

    def forward(self, features: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        """Latents [B, N, k] (this rank's N/tp of them under sequence parallelism). N is the
        input's length in the default model (one latent per position), ``num_latents`` otherwise."""
        batch, length, _ = features.shape
        rows = _local_rows(length, self.tp_group, self.sequence_parallel)
        own = _latent_side(self._latent_side_params(), self.tp_group, self.sequence_parallel)
        if self.one_per_position:
            x = own[0][rows] + self.positions[rows]
        else:
            latent_rows = _local_rows(self.latents.shape[0], self.tp_group, self.sequence_parallel)
            x = own[0][latent_rows] + own[1][latent_rows]
        x = x.expand(batch, -1, -1)
        if self.sequence_parallel:  # the features are whole on every rank: keep this rank's positions
            if features.requires_grad:  # a trained feature model needs every position's gradient
                features = scatter_to_sequence_parallel_region(features, self.tp_group)
            else:
                features = split_along_sequence(features, self.tp_group)
        if self.context_positions:
            # Normalised first: the position is half of each key's variance at any feature scale.
            features = F.layer_norm(features, features.shape[-1:]) + self.positions[rows]
        latents = self.ln_f(self.stack(x, features, attention_mask))
        if self.to_latent is None:
            return latents
        # The fixed scale of narrow latents: a LayerNorm without gain or bias, so every latent has
        # mean 0 and root-mean-square 1 over its k features, whatever the weights learn; a model
        # trained on them (and the noise of the latent evaluations) can rely on that scale.
        latents = F.linear(latents, own[-1])
        return F.layer_norm(latents, latents.shape[-1:])


def token_table_scale(table: torch.Tensor) -> float:
    """The factor that gives the rows of ``table`` [V, d] a root-mean-square norm of 1 (standard
    deviation 1/sqrt(d)), whatever the feature model's scale (0.02 for a random GPT-2, ~0.14 for
    the pretrained one).

    The final LayerNorm gives the decoder's output a norm of about sqrt(d), so a hidden state
    aligned with a row scores about sqrt(d) (8 at d=64, 28 at d=768) against ~N(0, 1) for an
    unrelated row: the softmax starts decisive enough to learn from, at every width, for a head
    whose rows cannot move (tied) as for one that starts there (token_table_init). Computed in
    float64 from the whole table, which every TP rank holds: the same number at every TP degree."""
    return 1.0 / (math.sqrt(table.shape[1]) * table.detach().double().std().item())


def _copy_of(table: torch.Tensor, factor: float) -> InitMethod:
    def init(tensor: torch.Tensor) -> None:
        tensor.copy_(table.detach() * factor)

    return init


def build_head(
    cfg: ModelConfig, token_embedding: nn.Module | None, tp_group=None, options: TensorParallelOptions = SINGLE_PROCESS
) -> nn.Module:
    """The projection to the vocabulary that ``cfg.head`` names (see ModelConfig.head). Under
    sequence parallelism (``options``) its entry all-gathers the positions (and its backward
    reduce-scatters), like every column-parallel entry."""
    split = {"tp_group": tp_group, "options": options}
    if cfg.head == "normal":
        return VocabParallelHead(cfg.d_model, cfg.vocab_size, **split, init_method=normal_init(cfg.init_std))
    if token_embedding is None:
        raise ValueError(f"model.head={cfg.head} needs the feature model's token embedding")
    table = token_embedding.weight
    if tuple(table.shape) != (cfg.vocab_size, cfg.d_model):
        raise ValueError(
            f"model.head={cfg.head}: the token table is {list(table.shape)}, the head needs "
            f"[model.vocab_size={cfg.vocab_size}, model.d_model={cfg.d_model}]"
        )
    if cfg.head == "nearest":
        # Decodes in as many features as the latents hold per token (N x k / T; k with one latent per
        # position): a code wider than what reaches a position would be read by a projection of it,
        # and a projected code scores the longest codes highest again. The softmax scale starts
        # where a reading on its token's code (|code|^2 = rank) scores it ln(V) above an unrelated
        # token, whatever the rank.
        rank = max(1, cfg.latent_count * cfg.latent_width // cfg.max_length)
        return NearestVocabParallelHead(
            token_embedding, cfg.vocab_size, rank, **split, scale=math.log(cfg.vocab_size) / rank
        )
    factor = token_table_scale(table)
    if cfg.head == "tied":
        return TiedVocabParallelHead(token_embedding, cfg.vocab_size, **split, scale=factor)
    # token_table_init: every rank takes the full rescaled table and keeps its rows, as a TP=1
    # model would (the master-weight split), so gathered weights equal TP=1's bit for bit.
    return VocabParallelHead(cfg.d_model, cfg.vocab_size, **split, init_method=_copy_of(table, factor))


class LatentDecoder(nn.Module):
    """Latents [B, N, k] -> this rank's slice of the vocabulary logits [B, T, V_padded / tp] (N = T
    and k = d unless ``model.num_latents`` / ``model.latent_dim`` compress; a k -> d projection
    first, and with N < T a second position table for the latents: ``_compressed_decoder_positions``).

    Every position is a query made from the mask vector: mask -> query MLP -> x scale -> + positions.
    The latents get the same positions; the queries attend to cat(latents, queries) through the
    blocks; LayerNorm; vocabulary-parallel projection (``cfg.head``; ``token_embedding`` is the
    feature model's token embedding, which the ``tied`` head uses and ``token_table_init`` copies).

    Initialisation: nothing in the architecture ties latent t to position t. With random attention
    weights on both sides the latents start as interchangeable slots: encoder and decoder must agree
    on an arbitrary assignment of positions to latents, and where two positions start out sharing a
    latent (both decoder queries reading it, the encoder writing both tokens into it) each stays
    near 50% accuracy for good. So every decoder block starts as a position lookup (query t reads
    latent t, ``_start_as_position_lookup``). That alone is not enough when the encoder has to learn
    which position each latent reads: while its latents all hold the same mixture of tokens, one
    latent comes to hold a second position's token first (its queries share one projection), the
    decoder query of that position moves to it, and the latent of that position is then read by no
    query, gets no gradient and stays empty: the pair forms within the first ~150 steps and never
    separates. So the encoder starts as a position lookup too (``cfg.encoder_context_positions``:
    latent t reads the features of position t). Then from the first step the token of position t is
    in latent t far more than in any other, so no decoder query is drawn to another latent, and
    each latent's loss comes from its own position's query: the identity assignment is where
    training starts and what every gradient reinforces, not an outcome that depends on the seed.
    """

    def __init__(
        self,
        cfg: ModelConfig,
        mask_vector: torch.Tensor,
        rng: DropoutRNG,
        tp_group=None,
        train_mask_vector: bool = False,
        token_embedding: nn.Module | None = None,
        options: TensorParallelOptions = SINGLE_PROCESS,
    ):
        super().__init__()
        d = cfg.d_model
        self.tp_group, self.sequence_parallel = tp_group, options.sequence_parallel
        self.one_per_position = not cfg.compresses_positions
        if self.one_per_position:  # one table: latent t's row is query t's
            self.positions = _position_table(cfg.latent_count, d, LOOKUP_POSITION_STD)
        else:  # the latents' table, and the queries' of T rows
            self.latent_positions, self.positions = _compressed_decoder_positions(cfg)
        mask_vector = mask_vector.detach().clone().float()
        if train_mask_vector:  # the feature model trains, so does the vector copied from it
            self.mask_vector = nn.Parameter(mask_vector)
        else:
            self.register_buffer("mask_vector", mask_vector)
        # The query MLP writes a fresh tensor, not a residual: plain init for both projections.
        self.query_mlp = ParallelMLP(
            d, cfg.mlp_ratio * d, dropout=cfg.dropout, rng=rng, tp_group=tp_group, init_method=normal_init(cfg.init_std)
        )
        # Starts as the identity. Shape [1] rather than 0-dim, so code that flattens, partitions or
        # reshards parameters (ZeRO, checkpoints) sees an ordinary 1-D tensor.
        self.query_scale = nn.Parameter(torch.ones(1))
        self.stack = PerceiverStack(cfg, cfg.n_decoder_layers, rng, tp_group, options)
        for block in self.stack.blocks:
            if self.one_per_position:
                _start_as_position_lookup(block, cfg)
            else:
                _start_as_head_lookup(block, cfg, tp_group)
        self.ln_f = nn.LayerNorm(d)
        self.head = build_head(cfg, token_embedding, tp_group, options)
        self.from_latent = _replicated_linear(cfg.latent_width, d) if cfg.has_bottleneck else None
        if self.sequence_parallel:
            _mark_sequence_parallel(tp_group, self.positions, self.ln_f)
            _mark_latent_side(tp_group, self._latent_side_params())

    def _latent_side_params(self) -> list[nn.Parameter]:
        """What this side uses on the latents only: their own position table (fewer latents than
        positions; otherwise ``positions`` serves queries and latents alike) and the projection back
        from narrower latents."""
        own = [] if self.one_per_position else [self.latent_positions]
        return own + ([self.from_latent.weight] if self.from_latent is not None else [])

    def queries(self, batch: int, length: int) -> torch.Tensor:
        """The prepared queries [B, T, d] (this rank's positions of them under sequence parallelism,
        for a sequence of ``length``)."""
        rows = _local_rows(length, self.tp_group, self.sequence_parallel)
        local = rows.stop - rows.start
        if self.training and self.query_mlp.hidden_dropout.p > 0:
            # Dropout draws a different mask per (sample, position): the MLP must see [B, T, d].
            queries = self.query_mlp(self.mask_vector.expand(batch, length, -1)) * self.query_scale
            if self.sequence_parallel:  # every position's gradient reaches the replicated MLP
                queries = scatter_to_sequence_parallel_region(queries, self.tp_group)
        else:
            # Same input everywhere and no dropout: compute once, broadcast (autograd sums the grads).
            query = self.query_mlp(self.mask_vector.view(1, 1, -1)) * self.query_scale
            if self.sequence_parallel:  # each rank's positions add their share of its gradient
                query = copy_to_tp_region(query, self.tp_group)
            queries = query.expand(batch, local, -1)
        return queries + self.positions[rows]

    def forward(self, latents: torch.Tensor, length: int) -> torch.Tensor:
        """Logits [B, length, V_padded / tp] of ``length`` positions (the attention mask's, or the
        most a predicted length can be) from latents [B, N, k] (this rank's N/tp of them under
        sequence parallelism; the logits always cover every position)."""
        batch, local, _ = latents.shape
        count = local * (group_size(self.tp_group) if self.sequence_parallel else 1)
        rows = _local_rows(count, self.tp_group, self.sequence_parallel)
        own = _latent_side(self._latent_side_params(), self.tp_group, self.sequence_parallel)
        positions = self.positions[rows] if self.one_per_position else own[0][rows]
        if self.from_latent is not None:
            latents = F.linear(latents, own[-1])
        x = self.stack(self.queries(batch, length), latents + positions)
        return self.head(self.ln_f(x))
