"""The rank grid: how global ranks map to (pp, dp, tp) coordinates.

A pure function of the sizes, testable without processes. Tensor parallelism is
innermost (its ranks are consecutive, so on a GPU node they share the fastest
links, NVLink), pipeline parallelism outermost (its neighbours may sit on other
nodes: pipelines send only activations, the least traffic). This is the order
Megatron-LM uses (its "tp-dp-pp" default with context/expert parallelism absent):

    rank = pp_rank * (dp * tp) + dp_rank * tp + tp_rank
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple


class Coords(NamedTuple):
    """Coordinates of one rank in the grid."""

    pp: int
    dp: int
    tp: int


def resolve_sizes(world_size: int, tp: int = 1, pp: int = 1, dp: int | None = None) -> tuple[int, int, int]:
    """Return ``(tp, pp, dp)`` after checking they tile ``world_size``.

    ``dp=None`` means "whatever is left": ``world_size // (tp * pp)``.
    Raises ``ValueError`` naming the sizes when they do not divide.
    """
    for name, value in (("world_size", world_size), ("tp", tp), ("pp", pp)):
        if not isinstance(value, int) or value < 1:
            raise ValueError(f"{name} must be a positive integer, got {value!r}")
    if world_size % (tp * pp) != 0:
        raise ValueError(
            f"tp={tp} x pp={pp} = {tp * pp} does not divide world_size={world_size}; "
            f"choose tp and pp whose product divides the number of processes"
        )
    if dp is None:
        dp = world_size // (tp * pp)
    if not isinstance(dp, int) or dp < 1:
        raise ValueError(f"dp must be a positive integer, got {dp!r}")
    if tp * pp * dp != world_size:
        raise ValueError(
            f"tp={tp} x pp={pp} x dp={dp} = {tp * pp * dp} but world_size={world_size}; "
            f"the three sizes must multiply to the number of processes"
        )
    return tp, pp, dp


@dataclass(frozen=True)
class RankGrid:
    """The full layout of ``world_size`` ranks into pipeline x data x tensor parallel groups."""

    world_size: int
    tp: int
    pp: int
    dp: int

    @classmethod
    def build(cls, world_size: int, tp: int = 1, pp: int = 1, dp: int | None = None) -> RankGrid:
        """Validate the sizes (see :func:`resolve_sizes`) and return the grid."""
        tp, pp, dp = resolve_sizes(world_size, tp, pp, dp)
        return cls(world_size=world_size, tp=tp, pp=pp, dp=dp)

    def rank_of(self, coords: Coords) -> int:
        """Global rank at ``coords``."""
        pp, dp, tp = coords
        assert 0 <= pp < self.pp and 0 <= dp < self.dp and 0 <= tp < self.tp, coords
        return pp * (self.dp * self.tp) + dp * self.tp + tp

    def coords_of(self, rank: int) -> Coords:
        """Coordinates ``(pp, dp, tp)`` of a global rank."""
        if not 0 <= rank < self.world_size:
            raise ValueError(f"rank {rank} is outside [0, {self.world_size})")
        pp, rest = divmod(rank, self.dp * self.tp)
        dp, tp = divmod(rest, self.tp)
        return Coords(pp, dp, tp)

    def tp_groups(self) -> list[list[int]]:
        """Every tensor-parallel group (ranks that differ only in tp), in a fixed order."""
        return [[self.rank_of(Coords(p, d, t)) for t in range(self.tp)] for p in range(self.pp) for d in range(self.dp)]

    def dp_groups(self) -> list[list[int]]:
        """Every data-parallel group (ranks that differ only in dp)."""
        return [[self.rank_of(Coords(p, d, t)) for d in range(self.dp)] for p in range(self.pp) for t in range(self.tp)]

    def pp_groups(self) -> list[list[int]]:
        """Every pipeline group (ranks that differ only in pp), ordered first stage to last."""
        return [[self.rank_of(Coords(p, d, t)) for p in range(self.pp)] for d in range(self.dp) for t in range(self.tp)]

    def group_of(self, rank: int, kind: str) -> list[int]:
        """The ``kind`` ("tp", "dp" or "pp") group that contains ``rank``."""
        groups = {"tp": self.tp_groups, "dp": self.dp_groups, "pp": self.pp_groups}
        if kind not in groups:
            raise ValueError(f"kind must be one of {sorted(groups)}, got {kind!r}")
        for group in groups[kind]():
            if rank in group:
                return group
        raise AssertionError(f"rank {rank} is in no {kind} group")

    def pp_prev_rank(self, rank: int) -> int | None:
        """Global rank of the previous pipeline stage, or ``None`` on the first stage."""
        c = self.coords_of(rank)
        return None if c.pp == 0 else self.rank_of(Coords(c.pp - 1, c.dp, c.tp))

    def pp_next_rank(self, rank: int) -> int | None:
        """Global rank of the next pipeline stage, or ``None`` on the last stage."""
        c = self.coords_of(rank)
        return None if c.pp == self.pp - 1 else self.rank_of(Coords(c.pp + 1, c.dp, c.tp))

    def table(self) -> list[dict[str, int]]:
        """One row per rank: ``{"rank", "pp", "dp", "tp"}`` (handy for printing a grid)."""
        return [{"rank": r, **self.coords_of(r)._asdict()} for r in range(self.world_size)]
