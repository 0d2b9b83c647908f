"""The arguments of :class:`~lslm.zero.optimizer.ZeroOptimizer`, checked before anything changes.

Every combination ZeRO does not implement here (a stage with pipeline or tensor parallelism it cannot
follow, an optimizer that already stepped, a model already wearing gradient buffers, ...) is refused with
a :class:`ValueError` that says what to use instead, before the model is touched.
"""

from __future__ import annotations

from pathlib import Path

import torch
from torch import nn

from lslm.data_parallel.grad_buffer import has_main_grad
from lslm.data_parallel.grad_sync import grad_kind
from lslm.models.deferred_init import is_meta
from lslm.precision.scaler import DynamicLossScaler
from lslm.runtime.context import ParallelContext
from lslm.zero.disk import check_writable

__all__ = ["OFFLOADS", "STAGES", "check_arguments"]

STAGES = (1, 2, 3)
#: Where the optimizer's states may live: with the parameters (``None``), in host memory (``"cpu"``) or in files
#: streamed through host memory during the step (``"disk"``).
OFFLOADS = (None, "cpu", "disk")


def check_arguments(model: nn.Module, optimizer: torch.optim.Optimizer, ctx: ParallelContext, *, stage: int,
                    dtype: torch.dtype, scaler: DynamicLossScaler | None, max_inflight: int, prefetch: int = 1,
                    offload: str | None, offload_dir: str | Path | None,
                    init_seed: int | None) -> tuple[list[nn.Parameter], bool]:
    """Refuse what ZeroOptimizer does not implement (``ValueError``, in a fixed order); return the model's
    trainable parameters and whether the model is on the meta device."""
    if isinstance(stage, bool) or not isinstance(stage, int) or stage not in STAGES:
        hint = " (stage 0 is plain data parallelism: use lslm.data_parallel's DDP)" if stage == 0 else ""
        raise ValueError(f"ZeRO stage {stage!r} is not implemented here; choose one of {STAGES}{hint}")
    if dtype not in (torch.float32, torch.float16, torch.bfloat16):
        raise ValueError(f"dtype must be torch.float32, float16 or bfloat16, got {dtype}")
    if stage == 3 and (ctx.tp_size > 1 or ctx.pp_size > 1):
        raise ValueError(f"ZeRO stage 3 gathers whole units around the model's own forward, which a pipeline "
                         f"stage or a tensor-parallel layer does not run as one (tp={ctx.tp_size}, "
                         f"pp={ctx.pp_size}): use stage 1 (or 2 without pipeline stages) there")
    if stage == 2 and ctx.pp_size > 1:
        raise ValueError(f"ZeRO stage 2 reduce-scatters gradients during backward, but a pipeline rank (pp="
                         f"{ctx.pp_size}) must still sum its tied embedding's gradient with the other end after "
                         f"the last micro-batch: use stage 1 with pipeline parallelism")
    if ctx.grid.hsdp and ctx.tp_size * ctx.pp_size > 1:
        raise ValueError(f"HSDP (dp_shard={ctx.dp_shard_size} < dp={ctx.dp_size}) is implemented for pure data "
                         f"parallelism; with tp={ctx.tp_size}, pp={ctx.pp_size} leave dp_shard = dp")
    if stage == 2 and ctx.tp_size > 1 and any(getattr(p, "replicated_heads", None) for p in model.parameters()):
        raise ValueError("ZeRO stage 2 keeps gradient slices only, and key/value heads replicated over tensor-"
                         "parallel ranks are summed slot by slot on whole gradients: use stage 1, or tp <= the "
                         "number of key/value heads")
    if ctx.cp_size > 1:
        raise ValueError(f"cp={ctx.cp_size}: context-parallel ranks must also sum gradients; ZeroOptimizer "
                         "reduces over dp only")
    if scaler is not None and dtype != torch.float16:
        raise ValueError("a loss scaler is for fp16 training; bf16 and fp32 need none")
    if optimizer.state:
        raise ValueError("the optimizer already has state: build ZeroOptimizer before the first step")
    params = [p for p in model.parameters() if p.requires_grad]
    if not params:
        raise ValueError("the model has no parameter that requires grad: nothing to optimise")
    if any(grad_kind(p) == "kv-heads" for p in params):
        raise ValueError("replicated key/value heads need a slot per head in a gradient buffer of their own; "
                         "ZeroOptimizer keeps one layout: use tp <= the number of key/value heads")
    if any(grad_kind(p) == "ep" for p in params):
        raise ValueError("an expert-parallel MoE's experts are divided by ep, not averaged over dp, and each dp "
                         "rank holds different experts: ZeroOptimizer shards one dp-averaged layout; train it with "
                         "lslm.expert_parallel.reduce_expert_parallel_grads and a plain optimizer")
    if stage == 3 and any(grad_kind(p) == "sp" for p in params):
        raise ValueError("ZeRO stage 3 gathers whole units, which sequence-parallel layers split over tp: use "
                         "stage 1 or 2 with sequence parallelism")
    in_groups = [p for g in optimizer.param_groups for p in g["params"]]
    if {id(p) for p in in_groups} != {id(p) for p in params} or len(in_groups) != len(params):
        raise ValueError("optimizer must be built over exactly the model's trainable parameters, each once")
    if any(p.dtype != torch.float32 for p in params):
        raise ValueError("build ZeroOptimizer on the fp32 model: it keeps fp32 masters before casting to dtype")
    meta = is_meta(model)
    if meta and (stage != 3 or init_seed is None):
        raise ValueError("a model on the meta device needs stage=3 and init_seed=<the seed the serial run builds "
                         "it from>: only stage 3 lets a rank hold its slice alone")
    if not meta and init_seed is not None:
        raise ValueError("init_seed is for a model built on the meta device; this model already holds weights")
    if any(has_main_grad(p) for p in params):
        raise ValueError("the model already has gradient buffers: ZeroOptimizer attaches its own, padded to the "
                         "data-parallel size")
    if offload not in OFFLOADS:
        raise ValueError(f"offload must be one of {OFFLOADS}, got {offload!r}")
    if offload == "disk" and offload_dir is None:
        raise ValueError("offload='disk' needs offload_dir, a writable folder on a local disk for the states")
    if offload == "disk":
        check_writable(offload_dir)  # before anything changes
    if isinstance(max_inflight, bool) or not isinstance(max_inflight, int) or max_inflight < 1:
        raise ValueError(f"max_inflight must be an int >= 1 (buckets reduced at once), got {max_inflight!r}")
    if isinstance(prefetch, bool) or not isinstance(prefetch, int) or prefetch < 0:
        raise ValueError(f"prefetch must be an int >= 0 (stage 3's units gathered ahead of the one computing; 0: "
                         f"none, each unit gathered only when it is needed), got {prefetch!r}")
    return params, meta
