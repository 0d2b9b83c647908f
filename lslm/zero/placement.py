"""Where a ZeroOptimizer's parameters come from: stage 3's units, this rank's pieces of the weights.

Stage 3 gathers parameters unit by unit: :func:`stage3_units` lists the units (``model.blocks`` by default)
in the order backward meets them, with the parameter indices of each bucket. A model built on the meta device
holds no weights: :func:`owned_values` replays the serial build leaf by leaf (:mod:`lslm.models.deferred_init`)
and keeps only this rank's pieces, so the whole model never exists on one rank; :func:`replace_meta_params`
then puts a real (empty) parameter where each meta one was.
"""

from __future__ import annotations

import torch
from torch import nn

from lslm.models.deferred_init import serial_leaves
from lslm.zero.layout import ShardLayout

__all__ = ["owned_values", "replace_meta_params", "stage3_units"]


def replace_meta_params(model: nn.Module, params: list[nn.Parameter], empty: torch.Tensor) -> None:
    """Put a real parameter holding ``empty`` wherever a meta one was held; ``params`` is updated in place, in
    its order."""
    holders: dict[int, list[tuple[nn.Module, str]]] = {}
    for module in model.modules():
        for attr, p in module._parameters.items():
            if p is not None:
                holders.setdefault(id(p), []).append((module, attr))
    for i, old in enumerate(params):
        new = nn.Parameter(empty, requires_grad=old.requires_grad)
        new.__dict__.update(old.__dict__)
        for module, attr in holders.get(id(old), []):
            module._parameters[attr] = new
        params[i] = new


def stage3_units(model: nn.Module, params: list[nn.Parameter],
           units: list[nn.Module] | None) -> tuple[list[nn.Module], list[list[int]]]:
    """ZeRO-3's units in *reverse* forward order and the parameter indices of each bucket (one per unit, then the
    root: every parameter outside the units). Default units: ``model.blocks`` if it has them."""
    if units is None:
        blocks = getattr(model, "blocks", None)
        if not isinstance(blocks, nn.ModuleList):
            raise ValueError(f"ZeRO stage 3 gathers parameters unit by unit: pass units=[...] (the modules to gather "
                             f"as a whole, in forward order); {type(model).__name__} has no `blocks` to default to")
        units = list(blocks)
    index = {id(p): i for i, p in enumerate(params)}
    seen: set[int] = set()
    groups = []
    for u in units:
        idx = [index[id(p)] for p in u.parameters() if id(p) in index]
        if seen & set(idx):
            raise ValueError("a parameter belongs to two units (nested or tied units): give each parameter one unit")
        seen |= set(idx)
        groups.append(idx)
    root = [i for i in range(len(params)) if i not in seen]
    # Backward produces the last unit's gradients first: reverse forward order, the root (embedding: last) at the end.
    return list(units)[::-1], groups[::-1] + [root]


def owned_values(model: nn.Module, params: list[nn.Parameter], layout: ShardLayout,
                  seed: int) -> list[torch.Tensor]:
    """This rank's pieces of the serial build's fp32 weights for a model on the meta device, one leaf at a time."""
    index = {id(p): i for i, p in enumerate(params)}
    by_param: dict[int, list[int]] = {}
    for k, pc in enumerate(layout.pieces):
        by_param.setdefault(pc.param, []).append(k)
    values: list[torch.Tensor | None] = [None] * len(layout.pieces)
    for name, full in serial_leaves(model, seed):
        leaf = model.get_submodule(name)
        for attr, value in full.named_parameters(recurse=False):
            i = index.get(id(getattr(leaf, attr)))
            for k in by_param.get(i, []) if i is not None else []:
                pc = layout.pieces[k]
                values[k] = value.detach().reshape(-1)[pc.start:pc.stop].clone()
    assert all(v is not None for v in values)
    return values  # type: ignore[return-value]
