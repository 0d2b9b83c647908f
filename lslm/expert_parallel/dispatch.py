"""Which (token, expert) assignments an expert processes: capacity, priority and the dropped count.

Capacity (Switch Transformer, Fedus et al. 2021, Section 2.2; GShard, Lepikhin et al. 2020,
Section 2.2): each expert takes at most ``ceil(capacity_factor · T · k / E)`` assignments of
the ``T`` tokens routed together (``k`` per token); the rest are *dropped*: they add nothing
and the token continues through the residual connection alone. ``capacity_factor=None`` is the
dropless mode (every assignment processed, as in MegaBlocks-style dropless MoE).

Priority when an expert is full: every token's first choice before any token's second
choice, then token order (GShard's ordering for k = 2), so a second choice never evicts a
first one. Under expert parallelism each rank applies the capacity to its own tokens (its
batch shard is the routing group), before dispatch: the decision needs no communication.
"""

from __future__ import annotations

import math
import numbers
from dataclasses import dataclass

import torch

__all__ = ["Assignments", "assign", "check_capacity_factor", "expert_capacity"]


def check_capacity_factor(capacity_factor: float | None) -> None:
    """ValueError unless ``capacity_factor`` is None (dropless) or a finite number > 0.

    Infinity is refused rather than read as dropless: the capacity ``ceil(inf)`` has no integer value (an
    OverflowError at the first forward), and None already says "no limit".
    """
    if capacity_factor is None:
        return
    if isinstance(capacity_factor, bool) or not isinstance(capacity_factor, numbers.Real) or \
            not math.isfinite(capacity_factor) or not capacity_factor > 0:
        raise ValueError(f"capacity_factor must be > 0 and finite (or None for dropless), got {capacity_factor!r}")


def expert_capacity(tokens: int, num_experts: int, top_k: int, capacity_factor: float | None) -> int | None:
    """``ceil(capacity_factor · tokens · top_k / num_experts)``, or None (dropless) when ``capacity_factor`` is None."""
    check_capacity_factor(capacity_factor)
    if capacity_factor is None:
        return None
    return math.ceil(capacity_factor * tokens * top_k / num_experts)


@dataclass
class Assignments:
    """The kept assignments, sorted by expert: ``tokens``, ``experts``, ``gates`` (``M`` each), and counts.

    ``per_expert`` ``(E,)``: kept assignments per expert; ``routed`` ``(E,)``: assignments the router
    made per expert before the capacity cut; ``dropped``: ``routed.sum() − per_expert.sum()``.
    """

    tokens: torch.Tensor
    experts: torch.Tensor
    gates: torch.Tensor
    per_expert: torch.Tensor
    routed: torch.Tensor

    @property
    def dropped(self) -> int:
        """Assignments dropped by the capacity limit."""
        return int(self.routed.sum() - self.per_expert.sum())


def assign(experts: torch.Tensor, gates: torch.Tensor, num_experts: int, capacity: int | None) -> Assignments:
    """Apply ``capacity`` to the router's choices ``experts``/``gates`` ``(T, k)`` (priority: see module doc)."""
    T, k = experts.shape
    # choice-major order: all first choices (in token order), then all second choices, ...
    flat_e = experts.t().reshape(-1)
    flat_g = gates.t().reshape(-1)
    flat_t = torch.arange(T, device=experts.device).repeat(k)
    onehot = torch.nn.functional.one_hot(flat_e, num_experts)
    slot = (onehot.cumsum(0) * onehot).sum(-1) - 1  # place of each assignment in its expert's queue
    keep = slot < capacity if capacity is not None else torch.ones_like(slot, dtype=torch.bool)
    kept_e = flat_e[keep]
    order = torch.sort(kept_e, stable=True).indices  # grouped by expert, priority order kept inside
    return Assignments(tokens=flat_t[keep][order], experts=kept_e[order], gates=flat_g[keep][order],
                       per_expert=torch.bincount(kept_e, minlength=num_experts),
                       routed=torch.bincount(flat_e, minlength=num_experts))
