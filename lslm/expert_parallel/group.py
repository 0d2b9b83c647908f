"""The expert-parallel group: which ranks share the experts, and this rank's place among them.

The rank grid has no ``ep`` axis (its axes are ``pp, dp, cp, tp``), and expert parallelism
usually rides on the data-parallel ranks anyway (GShard, Switch, DeepSpeed-MoE: each rank
routes its own batch shard, and the experts are spread over the same ranks instead of being
replicated). So the ep group here *is* ``ctx.group("dp")``: ep = dp, each dp rank owns
``num_experts / dp`` experts, and the non-expert parameters are averaged over it as usual.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from lslm.runtime.context import ParallelContext
from lslm.runtime.ledger import Comm

__all__ = ["EPGroup"]


@dataclass(frozen=True)
class EPGroup:
    """This rank's place in the ep group: ``ranks`` (global, ep-rank order), ``index`` (its ep rank), the ledger."""

    comm: Comm
    group: Any
    ranks: tuple[int, ...]
    index: int

    @classmethod
    def of(cls, ctx: ParallelContext) -> EPGroup:
        """The ep group of ``ctx``: its data-parallel group (see the module doc)."""
        return cls(comm=ctx.comm, group=ctx.group("dp"), ranks=tuple(ctx.group_ranks("dp")), index=ctx.dp_rank)

    @property
    def size(self) -> int:
        """The expert-parallel degree."""
        return len(self.ranks)
