"""Model-agnostic tensor parallelism: process groups, autograd mappings, parallel layers,
coordinate-keyed dropout and the vocabulary-parallel loss. Nothing here knows the Perceiver."""
from .attention import ParallelAttention
from .cross_entropy import vocab_parallel_argmax, vocab_parallel_cross_entropy
from .layers import ColumnParallelLinear, RowParallelLinear, VocabParallelHead, normal_init, scaled_init
from .mappings import copy_to_tp_region, gather_from_tp_region, reduce_from_tp_region, scatter_to_tp_region
from .mlp import ParallelMLP
from .random import DropoutRNG, ParallelDropout
from .state import (ModelParallelUnit, ParallelState, destroy_distributed, get_dp_group, get_dp_rank,
                    get_dp_size, get_parallel_state, get_tp_group, get_tp_rank, get_tp_size, init_distributed,
                    initialize_model_parallel, launcher_environment)
from .utils import group_rank, group_size, mark_replicated, pad_vocab_size

__all__ = [
    "ColumnParallelLinear", "RowParallelLinear", "VocabParallelHead", "ParallelAttention", "ParallelMLP",
    "ParallelDropout", "DropoutRNG", "vocab_parallel_cross_entropy", "vocab_parallel_argmax", "copy_to_tp_region", "reduce_from_tp_region",
    "scatter_to_tp_region", "gather_from_tp_region", "ModelParallelUnit", "ParallelState", "init_distributed",
    "initialize_model_parallel", "destroy_distributed", "get_parallel_state", "get_tp_group", "get_tp_size",
    "get_tp_rank", "get_dp_group", "get_dp_size", "get_dp_rank", "launcher_environment", "group_size",
    "group_rank", "mark_replicated", "pad_vocab_size", "normal_init", "scaled_init",
]
