"""Model-agnostic tensor parallelism: process groups, autograd mappings, parallel layers,
coordinate-keyed dropout and the vocabulary-parallel loss. Nothing here knows the Perceiver."""

from .attention import ParallelAttention
from .compile import CompiledWithFallback, CompileOutcome
from .cross_entropy import LossKernels, vocab_parallel_argmax, vocab_parallel_cross_entropy
from .dropout import DropoutRNG, ParallelDropout, ParallelGaussianNoise
from .layers import (
    ColumnParallelLinear,
    ColumnParallelWeights,
    RowParallelLinear,
    VocabParallelHead,
    normal_init,
    scaled_init,
)
from .mappings import (
    copy_to_tp_region,
    gather_from_sequence_parallel_region,
    reduce_from_tp_region,
    reduce_scatter_to_sequence_parallel_region,
    scatter_to_sequence_parallel_region,
    split_along_sequence,
    split_batch_and_gather,
    with_gradients_summed_together,
)
from .mlp import ParallelMLP
from .state import (
    ModelParallelUnit,
    ParallelState,
    destroy_distributed,
    device_kind,
    get_dp_rank,
    get_parallel_state,
    init_distributed,
    initialize_model_parallel,
    release_model_parallel,
)
from .utils import (
    TensorParallelOptions,
    group_rank,
    group_size,
    mark_replicated,
    mark_sequence_parallel,
    pad_vocab_size,
)

__all__ = [
    "ColumnParallelLinear",
    "ColumnParallelWeights",
    "CompileOutcome",
    "CompiledWithFallback",
    "DropoutRNG",
    "LossKernels",
    "ModelParallelUnit",
    "ParallelAttention",
    "ParallelDropout",
    "ParallelGaussianNoise",
    "ParallelMLP",
    "ParallelState",
    "RowParallelLinear",
    "TensorParallelOptions",
    "VocabParallelHead",
    "copy_to_tp_region",
    "destroy_distributed",
    "device_kind",
    "gather_from_sequence_parallel_region",
    "get_dp_rank",
    "get_parallel_state",
    "group_rank",
    "group_size",
    "init_distributed",
    "initialize_model_parallel",
    "mark_replicated",
    "mark_sequence_parallel",
    "normal_init",
    "pad_vocab_size",
    "reduce_from_tp_region",
    "reduce_scatter_to_sequence_parallel_region",
    "release_model_parallel",
    "scaled_init",
    "scatter_to_sequence_parallel_region",
    "split_along_sequence",
    "split_batch_and_gather",
    "vocab_parallel_argmax",
    "vocab_parallel_cross_entropy",
    "with_gradients_summed_together",
]
