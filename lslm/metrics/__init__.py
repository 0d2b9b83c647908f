"""lslm.metrics: what memory, time and communication cost, measured and predicted by formula.

Measurement (CPU and CUDA alike; :mod:`.memory` is the entry point and re-exports the memory tools):

* :mod:`.memory` - :func:`memory_report` (process RSS, ``torch.cuda`` statistics, the rest below in one view);
* :mod:`.model_state` - :func:`model_state_bytes`, exact bytes of parameters, gradients and optimizer states,
  next to the ZeRO paper's formulas (:func:`theory_model_state_bytes`);
* :mod:`.activations` - :class:`ActivationMemory`, the bytes autograd saves for backward;
* :mod:`.owners` / :mod:`.breakdown` - :func:`memory_by_owner`, bytes by owner (parameters, gradients, master
  weights, main grads, optimizer states, communication buffers, activations) x device, resident and logical;
* :mod:`.storage` - the counting rule they share (one storage counted once);
* :mod:`.held` - :func:`held_by_owner`, model-state bytes by owner for lslm's optimizers and PyTorch's sharded
  peers (FSDP2's local shards, ZeroRedundancyOptimizer's own optimizer) in one table;
* :mod:`.dispatched_collectives` - :func:`count_collectives`, the collectives (calls and buffer bytes) a block of
  code issues through ``torch.distributed``, as the dispatcher sees them: the peers lslm's ledger cannot see;
* :mod:`.allocations` - :func:`count_allocations`, the bytes each aten op allocates (copies by name), on any
  device: what a communication layout costs in copies; :func:`track_live_bytes`, the exact peak of the bytes
  a block of code holds at once (what building a model costs a rank at start);
* :mod:`.malloc` - :func:`malloc_in_use_bytes`, what glibc's allocator has handed out now (``mallinfo2``): the
  bytes nothing has to register, a saved view's storage included;
* :mod:`.step_memory` - :func:`measure_step_memory`, one step by the allocator: live bytes before, the peak during
  and after it (CUDA's caching allocator, or glibc sampled after every op), and PyTorch's memory profiler's bytes
  by category at the peak;
* :mod:`.memory_timeline` - :func:`record_memory_timeline`, that profiler's bytes by category over the whole
  step's time, with the named ranges that ran (drawn by :func:`lslm.plot.memory_timeline.plot_memory_timeline`).

Formulas (pure functions, no processes):

* :mod:`.activation_theory` - one transformer layer's activation bytes, Korthikanti et al. (2022) Table 2;
* :mod:`.zero3_window` - ZeRO-3's gathered bytes at the step's peak from the units' sizes, and what freeing after
  forward saves against keeping units gathered and against stage 2;
* :mod:`.zero_estimates` - ZeRO's model-state bytes per device: the paper's formulas, lslm's exact count, and
  DeepSpeed's estimator rows re-derived from its conventions;
* :mod:`.step_time` - bucketed DDP's step time: ring all-reduce cost, overlap with backward, where it turns
  communication-bound (:func:`predict_step`, :class:`LinkCost`);
* :mod:`.collective_costs` - the alpha-beta-gamma model of every lslm collective: coefficients, fit, prediction;
* :mod:`.tolerance` - how far two fp32 runs of the same training may differ on any machine
  (:func:`adamw_param_atol`: AdamW turns other kernels' last bits into a share of ``lr``), with the reasons.

The measurements that check the formulas are launched experiments, one layer up: ``lslm.bench.step_time_check``
and ``lslm.demos.activation_check``.
"""

from lslm.metrics.activation_theory import korthikanti_layer_bytes, layer_terms
from lslm.metrics.allocations import AllocationCount, LiveBytes, count_allocations, track_live_bytes
from lslm.metrics.collective_costs import cost_coefficients, fit_alpha_beta, model_time
from lslm.metrics.malloc import malloc_in_use_bytes
from lslm.metrics.memory import (
    CATEGORIES,
    ActivationMemory,
    MemoryBreakdown,
    MemoryOwner,
    MemoryRegistry,
    MemoryReport,
    ModelStateBytes,
    format_bytes,
    memory_by_owner,
    memory_report,
    model_state_bytes,
    peak_rss_bytes,
    process_rss_bytes,
    reset_peak_memory,
    theory_model_state_bytes,
)
from lslm.metrics.step_memory import StepMemory, measure_step_memory
from lslm.metrics.step_time import LinkCost, StepPrediction, predict_step, ring_all_reduce_s

__all__ = [
    "CATEGORIES",
    "ActivationMemory",
    "AllocationCount",
    "LinkCost",
    "LiveBytes",
    "MemoryBreakdown",
    "MemoryOwner",
    "MemoryRegistry",
    "MemoryReport",
    "ModelStateBytes",
    "StepMemory",
    "StepPrediction",
    "cost_coefficients",
    "count_allocations",
    "fit_alpha_beta",
    "format_bytes",
    "korthikanti_layer_bytes",
    "layer_terms",
    "malloc_in_use_bytes",
    "measure_step_memory",
    "memory_by_owner",
    "memory_report",
    "model_state_bytes",
    "model_time",
    "peak_rss_bytes",
    "predict_step",
    "process_rss_bytes",
    "reset_peak_memory",
    "ring_all_reduce_s",
    "theory_model_state_bytes",
    "track_live_bytes",
]
