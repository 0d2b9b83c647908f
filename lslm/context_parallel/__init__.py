"""lslm.context_parallel: the sequence split over the ``cp`` axis, attention made exact across it.

* :mod:`.layout` - contiguous and zig-zag splits, global positions, attention work per rank;
* :mod:`.group` - the cp ring as the cores see it (ledger, neighbours, one p2p step);
* :mod:`.ring` - ring attention, forward and the written-out backward, log-sum-exp merges, accumulated in fp32
  whatever the inputs' dtype;
* :mod:`.ulysses` - DeepSpeed-Ulysses: all-to-all from sequence- to head-sharded and back;
* both take fewer key/value heads than query heads (grouped-query attention);
* :mod:`.traffic` - bytes per rank of both, as formulas the ledger is checked against;
* :mod:`.apply` - :func:`apply_context_parallel` for lslm's GPT (alone or after ``apply_tensor_parallel``,
  with or without sequence parallelism), the sharded batch, loss and gradient sum (``.grad`` or the
  gradient buffers, over ``dp × cp``).

torch's own ``context_parallel`` does not run on CPU in torch 2.13 (it replaces only the CUDA
flash, memory-efficient and cuDNN attention kernels; see :mod:`.ring`): everything here is checked
against full single-process attention instead.
"""

from lslm.context_parallel.apply import (
    CPInfo,
    CPPlan,
    apply_context_parallel,
    check_context_parallel,
    context_parallel_loss,
    reduce_context_parallel_grads,
    shard_batch,
)
from lslm.context_parallel.group import CPGroup
from lslm.context_parallel.layout import attention_work, check_sequence, chunk_ids, local_positions, shard_sequence
from lslm.context_parallel.ring import merge_partials, ring_attention
from lslm.context_parallel.traffic import cp_traffic
from lslm.context_parallel.ulysses import check_heads, ulysses_attention

__all__ = ["CPGroup", "CPInfo", "CPPlan", "apply_context_parallel", "attention_work", "check_context_parallel",
           "check_heads", "check_sequence", "chunk_ids", "context_parallel_loss", "cp_traffic", "local_positions",
           "merge_partials", "reduce_context_parallel_grads", "ring_attention", "shard_batch", "shard_sequence",
           "ulysses_attention"]
