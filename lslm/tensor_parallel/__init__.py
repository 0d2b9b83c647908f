"""lslm.tensor_parallel: Megatron-style tensor parallelism and sequence parallelism, applied to a model from outside.

* :mod:`.mappings` - ``f``/``g`` and the sequence-parallel pair as conjugate autograd functions (ledger-labelled);
* :mod:`.layers` - :class:`ColumnParallelLinear`, :class:`RowParallelLinear`, :class:`VocabParallelEmbedding`;
  :mod:`.linear_comm` - the column matmul with its backward communication overlapped;
* :mod:`.cross_entropy` - the loss over a vocabulary split across ranks; :mod:`.vocab` - padding;
* :mod:`.qkv` - the per-head rows of a fused ``[q|k|v]`` projection;
* :mod:`.random` - the default and tensor-parallel RNG streams dropout needs;
* :mod:`.recompute` - :func:`apply_recompute`: full or selective activation recomputation (Korthikanti et al.
  2022, §5) replaying both streams;
* :mod:`.plan` / :mod:`.apply` - :func:`apply_tensor_parallel` (lslm GPT; Hugging Face GPT-2 and Llama in
  :mod:`.hf_plans`);
* :mod:`.grads` - the gradient all-reduces sequence parallelism and replicated KV heads need;
* :mod:`.clip` - global-norm clipping over TP shards (replicated parameters counted once), DP-only averaging;
* :mod:`.checkpoint` - checkpoints that stay tensor-parallel, and their gather to the serial layout;
* :mod:`.overlap` - the input-gradient all-reduce hidden behind the weight gradient, measured from the ledger;
* :mod:`.dtensor_reference` - the same GPT under PyTorch DTensor, for side-by-sides.

The experiments notebook 05 launches live in :mod:`lslm.demos` (``tensor_parallel_demo``, ``activation_check``,
``dtensor_compare``); the recomputation table in ``recompute_check``.
"""

from lslm.tensor_parallel.apply import TPInfo, apply_tensor_parallel, gpt_plan, plan_for
from lslm.tensor_parallel.cross_entropy import gather_logits, vocab_parallel_cross_entropy, vocab_parallel_token_losses
from lslm.tensor_parallel.grads import sync_sequence_parallel_grads, sync_tensor_parallel_grads
from lslm.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear, VocabParallelEmbedding
from lslm.tensor_parallel.mappings import (
    copy_to_tensor_parallel_region,
    gather_from_sequence_parallel_region,
    gather_from_tensor_parallel_region,
    reduce_from_tensor_parallel_region,
    reduce_scatter_to_sequence_parallel_region,
    scatter_to_sequence_parallel_region,
    scatter_to_tensor_parallel_region,
)
from lslm.tensor_parallel.plan import Colwise, Rowwise, SequenceSharded, TPPlan, VocabEmbedding, VocabHead
from lslm.tensor_parallel.random import RNGStatesTracker, model_parallel_seed
from lslm.tensor_parallel.recompute import apply_recompute
from lslm.tensor_parallel.vocab import pad_vocab_size

__all__ = [
    "Colwise", "ColumnParallelLinear", "RNGStatesTracker", "RowParallelLinear", "Rowwise", "SequenceSharded",
    "TPInfo", "TPPlan", "VocabEmbedding", "VocabHead", "VocabParallelEmbedding", "apply_tensor_parallel",
    "copy_to_tensor_parallel_region", "gather_from_sequence_parallel_region", "gather_from_tensor_parallel_region",
    "apply_recompute", "gather_logits", "gpt_plan", "model_parallel_seed", "pad_vocab_size", "plan_for",
    "reduce_from_tensor_parallel_region", "reduce_scatter_to_sequence_parallel_region",
    "scatter_to_sequence_parallel_region", "scatter_to_tensor_parallel_region", "sync_sequence_parallel_grads",
    "sync_tensor_parallel_grads", "vocab_parallel_cross_entropy", "vocab_parallel_token_losses",
]
