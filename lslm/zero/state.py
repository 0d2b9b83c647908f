"""A ZeroOptimizer's state as tensors: this rank's shard, and the whole model gathered.

:func:`shard_state_dict` / :func:`load_shard_state_dict` save and restore one rank's shard (inner optimizer
state, fp32 masters of its pieces, the scaler) at the same data-parallel size; :mod:`lslm.zero.checkpoint`
writes such shards to files and reshards them to any size. :func:`full_state_dict` is every parameter whole,
by name: collective at stage 3, where each unit is gathered in turn.

``zero`` is a :class:`~lslm.zero.optimizer.ZeroOptimizer` (which imports this module; hence ``Any``).
"""

from __future__ import annotations

from typing import Any

import torch

__all__ = ["full_state_dict", "load_shard_state_dict", "shard_state_dict"]


@torch.no_grad()
def full_state_dict(zero: Any) -> dict[str, torch.Tensor]:
    """Every trainable parameter, whole, by name (the model's dtype; clones). Collective at stage 3 (each unit
    is gathered in turn, on every rank); stages 1-2 read the replicated parameters."""
    names = {id(p): n for n, p in zero.model.named_parameters()}
    out = {}
    gather = zero.gather
    for b in range(len(zero.buckets)):
        gathered_here = gather is not None and b not in gather.gathered
        if gather is not None:
            gather.ensure(b)
        for i in zero.buckets[b][2]:
            out[names[id(zero.params[i])]] = zero.params[i].detach().clone()
        if gather is not None and gathered_here:
            gather.release(b)
    return out


def shard_state_dict(zero: Any) -> dict[str, Any]:
    """This rank's shard: inner optimizer state, fp32 masters of its pieces, the scaler, the layout."""
    return {"stage": zero.stage, "rank": zero.rank, "world": zero.world,
            "optimizer": zero.optimizer.state_dict() if zero.optimizer is not None else None,
            "masters": [m.detach().clone() for m in zero.masters],
            "scaler": zero.scaler.state_dict() if zero.scaler is not None else None}


@torch.no_grad()
def load_shard_state_dict(zero: Any, state: dict[str, Any]) -> None:
    """Restore :func:`shard_state_dict` of the same rank at the same data-parallel size, then re-gather the
    model."""
    if (state["world"], state["rank"]) != (zero.world, zero.rank):
        raise ValueError(f"this shard was saved by rank {state['rank']} of {state['world']}; this is rank "
                         f"{zero.rank} of {zero.world} (resharding is not implemented here)")
    if len(state["masters"]) != len(zero.masters):
        raise ValueError(f"the shard has {len(state['masters'])} pieces, this rank {len(zero.masters)}: another "
                         "model or bucket size")
    for m, saved in zip(zero.masters, state["masters"]):
        m.copy_(saved)
    if zero.optimizer is not None:
        zero.optimizer.load_state_dict(state["optimizer"])
    if zero.scaler is not None and state.get("scaler") is not None:
        zero.scaler.load_state_dict(state["scaler"])
    zero._publish()
