"""The context-parallel ring as the attention cores see it: ledger, group, global ranks, neighbours."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from lslm.runtime.context import ParallelContext
from lslm.runtime.ledger import Comm

__all__ = ["CPGroup"]


@dataclass(frozen=True)
class CPGroup:
    """This rank's place in the ``cp`` group: ``ranks`` (global, cp-rank order) and ``index`` (its cp rank).

    Every message goes through ``comm`` (the ledger), with peers as global ranks, as
    ``torch.distributed``'s p2p calls want them.
    """

    comm: Comm
    group: Any
    ranks: tuple[int, ...]
    index: int

    @classmethod
    def of(cls, ctx: ParallelContext) -> CPGroup:
        """The cp group of ``ctx`` (global ranks ascend with the cp coordinate inside a group)."""
        return cls(comm=ctx.comm, group=ctx.cp_group, ranks=tuple(ctx.group_ranks("cp")), index=ctx.cp_rank)

    @property
    def size(self) -> int:
        """The context-parallel degree."""
        return len(self.ranks)

    @property
    def next_rank(self) -> int:
        """Global rank this rank sends to around the ring."""
        return self.ranks[(self.index + 1) % self.size]

    @property
    def prev_rank(self) -> int:
        """Global rank this rank receives from around the ring."""
        return self.ranks[(self.index - 1) % self.size]

    def shift(self, send: torch.Tensor, recv: torch.Tensor, label: str) -> list[Any]:
        """Post one ring step: ``send`` to the next rank, ``recv`` from the previous one; the Works to wait on."""
        ops = [dist.P2POp(dist.isend, send, self.next_rank, group=self.group),
               dist.P2POp(dist.irecv, recv, self.prev_rank, group=self.group)]
        return self.comm.batch_isend_irecv(ops, label=label)
