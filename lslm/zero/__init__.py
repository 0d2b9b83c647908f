"""ZeRO: the model states of data parallelism partitioned over its ranks (Rajbhandari et al. 2020).

* :mod:`.layout` - which slice of the padded gradient buffer each rank owns, and the pieces of
  parameters inside it (:func:`shard_layout`), FSDP2's per-parameter padding for comparison;
* :mod:`.optimizer` - :class:`ZeroOptimizer`, stages 1-3: optimizer states and fp32 masters, gradients (2) and
  parameters (3) partitioned; gradients reduce-scattered (from stage 2: during backward), parameters all-gathered
  in place on bucket views (stage 3: unit by unit, just in time, one unit prefetched), optimizer states offloaded to
  the host or streamed from disk (:mod:`.disk`). Its parts, one job each: :mod:`.checks` (the arguments refused),
  :mod:`.placement` (stage 3's units, this rank's pieces of the weights, a meta model's parameters),
  :mod:`.reduce` (the reduce-scatters, at the step or during backward, HSDP's all-reduce, the global norm),
  :mod:`.hooks` (the forward and backward hooks that drive the reduce-scatters, gathers, frees and prefetches),
  :mod:`.inner` (the inner optimizer over this rank's pieces, its gradients on the host or streamed from disk),
  :mod:`.state` (state dicts: this rank's shard, the whole model);
* :mod:`.gather` - stage 3's gathers, frees (the unit's storage resized to zero, so the views autograd saved
  hold nothing) and prefetch, :class:`~lslm.zero.gather.UnitGather`;
* :mod:`.offload` - host buffers and the device-to-host copies of ZeRO-Offload, waited for before the host step;
* :mod:`.checkpoint` - sharded checkpoints: atomic per-rank shards, a manifest, any dp size on load, consolidation
  and export to torch.distributed.checkpoint;
* :mod:`.activations` - ZeRO-R's partitioned activation checkpoints under tensor parallelism.
"""

from lslm.zero.layout import Piece, ShardLayout, fsdp_padding, shard_layout, unit_layout
from lslm.zero.optimizer import ZeroOptimizer

__all__ = ["Piece", "ShardLayout", "ZeroOptimizer", "fsdp_padding", "shard_layout", "unit_layout"]
