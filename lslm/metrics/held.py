"""Model-state bytes a rank holds after a step, by owner, for lslm's optimizers and PyTorch's alike.

:func:`lslm.metrics.memory_by_owner` reads lslm's objects (gradient buffers, fp32 masters, ZeRO's
slices through ``memory_owners()``). PyTorch's sharded peers need two more rules to be counted the
same way: FSDP2's parameters, gradients and states are DTensors whose local shard is what the rank
holds (``to_local()``), and ``ZeroRedundancyOptimizer`` keeps this rank's optimizer in ``.optim``.
DeepSpeed's ZeRO optimizers (``engine.optimizer``) need a third: the client optimizer they step
(``.optimizer``) holds fp32 *partitions*, which are master weights unless they share storage with
the module's parameters; at stage 3 a parameter's rank-local piece is its ``ds_tensor`` (the
parameter itself is empty between steps, unless DeepSpeed keeps it whole: under
``stage3_param_persistence_threshold`` elements), and a persistent gradient partition buffer
(``grad_partitions_flat_buffer``) holds its gradients. Nothing here imports DeepSpeed: the rule reads
those attributes. :func:`held_by_owner` applies all three, so a bench or a notebook can put every
technique in one table.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
from torch import nn

from lslm.metrics.memory import memory_by_owner

__all__ = ["OWNERS", "held_by_owner"]

#: The owners :func:`held_by_owner` reports, in the ZeRO paper's model-state order.
OWNERS = ("parameters", "gradients", "master_weights", "optimizer_states")


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if hasattr(t, "to_local") else t


def _storage_bytes(tensors: Iterable[torch.Tensor]) -> int:
    seen: dict[tuple[str, int], int] = {}
    for t in tensors:
        t = _local(t)
        if t.numel():
            seen[(t.device.type, t.untyped_storage().data_ptr())] = t.untyped_storage().nbytes()
    return sum(seen.values())


def _is_deepspeed_zero(optimizer: Any) -> bool:
    return type(optimizer).__module__.startswith("deepspeed.") and hasattr(optimizer, "optimizer")


def _deepspeed_held(model: nn.Module, zero: Any) -> dict[str, int]:
    """Bytes by owner of a DeepSpeed ZeRO optimizer and its module (see the module doc for the rule)."""
    # stage 3: the rank's piece (ds_tensor), and the full tensor where one is kept (gathered, or persistent)
    params = [t for p in model.parameters() for t in (p, getattr(p, "ds_tensor", None)) if t is not None]
    keys = {t.untyped_storage().data_ptr() for t in params if t.numel()}
    # the partitions the client optimizer steps (stage 3 puts each in its param group only during the step)
    partitions = list(getattr(zero, "single_partition_of_fp32_groups", None)
                      or getattr(zero, "fp32_partitioned_groups_flat", None)
                      or [p for g in zero.optimizer.param_groups for p in g["params"]])
    masters = [p for p in partitions if p.untyped_storage().data_ptr() not in keys]
    grads = [p.grad for p in list(model.parameters()) + partitions if p.grad is not None]
    flat = getattr(zero, "grad_partitions_flat_buffer", None)  # stage 3: every gradient partition, kept
    states = [t for s in zero.optimizer.state.values() for t in s.values() if isinstance(t, torch.Tensor)]
    return {"parameters": _storage_bytes(params),
            "gradients": _storage_bytes(grads + ([flat] if flat is not None else [])),
            "master_weights": _storage_bytes(masters), "optimizer_states": _storage_bytes(states)}


def held_by_owner(model: nn.Module, optimizer: Any) -> dict[str, int]:
    """Bytes of :data:`OWNERS` this rank holds now (storages counted once; fp32 ``main_grads`` count as gradients).

    An optimizer with ``memory_owners()`` (lslm's) is counted by :func:`memory_by_owner`;
    a DeepSpeed ZeRO optimizer (``engine.optimizer``, with ``model = engine.module``) by the module doc's rule;
    any other through its parameters, their gradients and its ``state`` (``.optim``'s for
    ``ZeroRedundancyOptimizer``), each DTensor by its local shard.
    """
    if _is_deepspeed_zero(optimizer):
        return _deepspeed_held(model, optimizer)
    if hasattr(optimizer, "memory_owners"):
        resident = memory_by_owner(model, optimizer).resident
        held = {cat: sum(resident.get(cat, {}).values()) for cat in resident}
        return {"parameters": held.get("parameters", 0),
                "gradients": held.get("gradients", 0) + held.get("main_grads", 0),
                "master_weights": held.get("master_weights", 0),
                "optimizer_states": held.get("optimizer_states", 0)}
    inner = getattr(optimizer, "optim", optimizer)
    states = [t for s in inner.state.values() for t in s.values() if isinstance(t, torch.Tensor)]
    return {"parameters": _storage_bytes(model.parameters()),
            "gradients": _storage_bytes(p.grad for p in model.parameters() if p.grad is not None),
            "master_weights": 0, "optimizer_states": _storage_bytes(states)}
