"""The hooks that drive ZeRO from inside the model's forward and backward.

The state they act on lives elsewhere (FSDP2 keeps its per-parameter state apart from its hooks the same
way): the gradient slices and the reduce-scatters on their way in
:class:`~lslm.zero.reduce.BackwardReduceScatter`, the gathered units in :class:`~lslm.zero.gather.UnitGather`.
This module only wires them to the model:

* stages 2-3: every parameter's post-accumulate-grad hook counts its gradient into its bucket, which is
  reduce-scattered once complete;
* stage 3: a unit is gathered just before its forward (the next unit's gather started at the same time: one
  unit of look-ahead by default, ``prefetch`` units in general, none with 0) and freed after it; the gradient
  of its output gathers it again before its backward (:meth:`~lslm.zero.gather.UnitGather.post_forward_hook`);
  the root is gathered before the model's forward.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from torch import nn

from lslm.zero.gather import UnitGather
from lslm.zero.reduce import BackwardReduceScatter

__all__ = ["attach_grad_hooks", "attach_unit_hooks"]


def attach_grad_hooks(params: Sequence[nn.Parameter], reducer: BackwardReduceScatter) -> list[Any]:
    """Stages 2-3: hand each parameter's accumulated gradient to ``reducer``; the hooks' handles."""
    return [p.register_post_accumulate_grad_hook(reducer.on_grad) for p in params]


def attach_unit_hooks(model: nn.Module, unit_modules: Sequence[nn.Module], gather: UnitGather, root: int,
                      reshard_after_forward: bool, prefetch: int = 1) -> list[Any]:
    """Stage 3: gather, prefetch and free each unit around its forward (``unit_modules`` in reverse forward order,
    bucket ``b`` holding ``unit_modules[b]``), and the ``root`` bucket before the model's forward; the handles.
    ``prefetch``: how many units ahead a unit's forward (and backward) starts gathering; 0 gathers each unit only
    when it is needed, so nothing waits in flight beside it."""
    hooks = []
    n = len(unit_modules)
    for b, module in enumerate(unit_modules):  # bucket b holds the (n-1-b)-th unit of the forward
        following = list(range(b - 1, max(b - 1 - prefetch, -1), -1))  # the next units of the forward
        preceding = list(range(b + 1, min(b + 1 + prefetch, n)))  # the units before it: the next ones backward
        hooks.append(module.register_forward_pre_hook(gather.pre_forward_hook(b, following)))
        hooks.append(module.register_forward_hook(gather.post_forward_hook(b, preceding, reshard_after_forward)))
    hooks.append(model.register_forward_pre_hook(lambda _m, _a: gather.ensure(root)))
    return hooks
