"""The rank grid: how global ranks map to named coordinates ``(pp, dp, cp, tp)``.

A pure function of the sizes, testable without processes. The axes, outermost to
innermost, are pipeline (``pp``), data (``dp``), context (``cp``) and tensor
(``tp``) parallelism; an axis left out has size 1. Tensor parallelism is innermost
(its ranks are consecutive, so on a GPU node they share the fastest links, NVLink),
context parallelism next (ring attention passes key/value blocks every layer),
pipeline parallelism outermost (its neighbours may sit on other nodes: pipelines
send only activations, the least traffic). This is the order Megatron-LM uses by
default ("tp-cp-ep-dp-pp", expert parallelism absent):

    rank = ((pp_rank * dp + dp_rank) * cp + cp_rank) * tp + tp_rank

which for ``cp = 1`` is ``pp_rank * (dp * tp) + dp_rank * tp + tp_rank``.

A *group* over some axes is a set of ranks that differ only in those axes:
``groups("dp")`` are the data-parallel groups, ``groups("dp", "cp")`` the groups a
gradient is reduced over when sequences are split over ``cp`` too. Virtual pipeline
stages (interleaved schedules) are a schedule concept, several model chunks per
``pp`` rank, not an axis of this grid.
"""

from __future__ import annotations

import itertools
import operator
from dataclasses import dataclass
from typing import Any, NamedTuple

AXES = ("pp", "dp", "cp", "tp")  # outermost to innermost
#: The data axis split for HSDP, outer then inner: ``dp = dp_replicate x dp_shard``.
DP_SUB_AXES = ("dp_replicate", "dp_shard")


class Coords(NamedTuple):
    """Coordinates of one rank in the grid (axes outermost to innermost; unnamed ones are 0)."""

    pp: int = 0
    dp: int = 0
    cp: int = 0
    tp: int = 0


def _positive_int(name: str, value: Any) -> int:
    # bool is an int subclass (tp=True would silently mean 1): reject it, and strings/floats too.
    if isinstance(value, bool):
        raise ValueError(f"{name} must be a positive integer, got {value!r}")
    try:
        number = operator.index(value)
    except TypeError:
        raise ValueError(f"{name} must be a positive integer, got {value!r}") from None
    if number < 1:
        raise ValueError(f"{name} must be a positive integer, got {value!r}")
    return number


def resolve_sizes(world_size: int, tp: int = 1, pp: int = 1, dp: int | None = None, cp: int = 1) -> dict[str, int]:
    """Return ``{"pp", "dp", "cp", "tp"}`` sizes after checking they tile ``world_size``.

    ``dp=None`` means "whatever is left": ``world_size // (tp * cp * pp)``. Raises
    ``ValueError`` naming the sizes when one is not a positive integer (``True``, ``2.0``
    and ``"2"`` included) or when they do not multiply to ``world_size``.
    """
    world_size = _positive_int("world_size", world_size)
    tp, pp, cp = _positive_int("tp", tp), _positive_int("pp", pp), _positive_int("cp", cp)
    fixed = [("tp", tp)] + ([("cp", cp)] if cp != 1 else []) + [("pp", pp)]
    fixed_text = " x ".join(f"{k}={v}" for k, v in fixed)
    if world_size % (tp * cp * pp) != 0:
        raise ValueError(
            f"{fixed_text} = {tp * cp * pp} does not divide world_size={world_size}; "
            f"choose sizes whose product divides the number of processes")
    dp = world_size // (tp * cp * pp) if dp is None else _positive_int("dp", dp)
    if tp * cp * pp * dp != world_size:
        raise ValueError(
            f"{fixed_text} x dp={dp} = {tp * cp * pp * dp} but world_size={world_size}; "
            f"the sizes must multiply to the number of processes")
    return {"pp": pp, "dp": dp, "cp": cp, "tp": tp}


def check_dp_shard(dp: int, dp_shard: int | None) -> int:
    """``dp_shard`` (``None``: ``dp``) after checking it is a positive integer dividing ``dp``; ValueError if not."""
    if dp_shard is None:
        return dp
    dp_shard = _positive_int("dp_shard", dp_shard)
    if dp % dp_shard:
        divisors = [k for k in range(1, dp + 1) if dp % k == 0]
        raise ValueError(f"dp_shard={dp_shard} does not divide dp={dp}: HSDP splits dp into dp_replicate x dp_shard; "
                         f"choose dp_shard among {divisors}")
    return dp_shard


def canonical_axes(axes: tuple[str, ...]) -> tuple[str, ...]:
    """``axes`` in grid order (outermost first); accepts ``"dp,cp"`` strings. ValueError on unknown/duplicate axes."""
    names = [a.strip() for item in axes for a in (item.split(",") if isinstance(item, str) else [item])]
    if not names:
        raise ValueError(f"name at least one axis of {AXES}")
    unknown = [a for a in names if a not in AXES]
    if any(a in DP_SUB_AXES for a in unknown):
        raise ValueError(f"{DP_SUB_AXES} (HSDP's split of dp) name a group alone, not combined with other axes: "
                         f"got {tuple(names)}")
    if unknown:
        raise ValueError(f"unknown axis {unknown[0]!r}; the grid's axes are {AXES}")
    if len(set(names)) != len(names):
        raise ValueError(f"axis named twice in {tuple(names)}")
    return tuple(a for a in AXES if a in names)


@dataclass(frozen=True)
class RankGrid:
    """The layout of ``world_size`` ranks over the named axes ``pp x dp x cp x tp``."""

    world_size: int
    tp: int
    pp: int
    dp: int
    cp: int = 1
    #: HSDP: ranks of ``dp`` that shard the model states (module doc); ``None`` means ``dp`` (plain sharding).
    dp_shard: int | None = None

    def __post_init__(self) -> None:
        sizes = resolve_sizes(self.world_size, tp=self.tp, pp=self.pp, dp=self.dp, cp=self.cp)
        for axis, size in sizes.items():  # store plain ints (numpy integers were accepted)
            object.__setattr__(self, axis, size)
        object.__setattr__(self, "dp_shard", check_dp_shard(self.dp, self.dp_shard))

    @classmethod
    def build(cls, world_size: int, tp: int = 1, pp: int = 1, dp: int | None = None, cp: int = 1,
              dp_shard: int | None = None) -> RankGrid:
        """Validate the sizes (see :func:`resolve_sizes`, :func:`check_dp_shard`) and return the grid."""
        sizes = resolve_sizes(world_size, tp=tp, pp=pp, dp=dp, cp=cp)
        return cls(world_size=world_size, **sizes, dp_shard=dp_shard)

    # -- HSDP: the data axis split into dp_replicate x dp_shard ---------------------------------
    @property
    def dp_replicate(self) -> int:
        """Replicas of the sharded model states: ``dp // dp_shard`` (1 without HSDP)."""
        assert self.dp_shard is not None
        return self.dp // self.dp_shard

    @property
    def hsdp(self) -> bool:
        """True when the data axis is split (``dp_shard < dp``): model states sharded over part of it."""
        return self.dp_replicate > 1

    def dp_coords(self, rank: int) -> dict[str, int]:
        """``{"dp_replicate", "dp_shard"}`` coordinates of ``rank`` (``dp = dp_replicate * dp_shard + dp_shard``)."""
        assert self.dp_shard is not None
        replicate, shard = divmod(self.coords_of(rank).dp, self.dp_shard)
        return {"dp_replicate": replicate, "dp_shard": shard}

    def _dp_sub_groups(self, axis: str) -> list[list[int]]:
        assert self.dp_shard is not None
        s = self.dp_shard
        out = []
        for ranks in self.groups("dp"):  # each in ascending dp order
            if axis == "dp_shard":  # consecutive along dp: same replicate coordinate
                out += [ranks[r * s:(r + 1) * s] for r in range(self.dp_replicate)]
            else:  # same shard coordinate, one per replica
                out += [ranks[k::s] for k in range(s)]
        return out

    # -- sizes and coordinates -----------------------------------------------------
    @property
    def sizes(self) -> dict[str, int]:
        """``{axis: size}``, outermost first."""
        return {a: getattr(self, a) for a in AXES}

    def rank_of(self, coords: Coords | dict[str, int] | None = None, /, **named: int) -> int:
        """Global rank at the given coordinates: ``rank_of(Coords(...))`` or ``rank_of(pp=1, tp=0)``.

        An axis not named has coordinate 0 (which is the only one a size-1 axis has).
        """
        given = {**(coords._asdict() if isinstance(coords, Coords) else coords or {}), **named}
        unknown = set(given) - set(AXES)
        if unknown:
            raise ValueError(f"unknown axis {sorted(unknown)[0]!r}; the grid's axes are {AXES}")
        rank = 0
        for axis in AXES:
            c, size = given.get(axis, 0), getattr(self, axis)
            if isinstance(c, bool) or not isinstance(c, int) or not 0 <= c < size:
                raise ValueError(f"{axis} coordinate {c!r} is outside [0, {size})")
            rank = rank * size + c
        return rank

    def coords_of(self, rank: int) -> Coords:
        """Named coordinates ``(pp, dp, cp, tp)`` of a global rank."""
        if isinstance(rank, bool) or not isinstance(rank, int) or not 0 <= rank < self.world_size:
            raise ValueError(f"rank {rank!r} is outside [0, {self.world_size})")
        out = {}
        for axis in reversed(AXES):  # innermost varies fastest
            rank, out[axis] = divmod(rank, getattr(self, axis))
        return Coords(**out)

    # -- groups ------------------------------------------------------------------------
    def groups(self, *axes: str) -> list[list[int]]:
        """Every group of ranks that differ only in ``axes``, in a fixed order.

        Groups are ordered by the coordinates of the other axes (outermost first); the
        ranks inside a group ascend, which is also their order along the axes (so a
        ``pp`` group runs first stage to last). Together the groups partition the world.
        ``groups("dp_shard")`` / ``groups("dp_replicate")``: the HSDP sub-axes (named alone).
        """
        if len(axes) == 1 and axes[0] in DP_SUB_AXES:
            return self._dp_sub_groups(axes[0])
        varying = canonical_axes(axes)
        fixed = [a for a in AXES if a not in varying]
        out = []
        for fixed_coords in itertools.product(*(range(getattr(self, a)) for a in fixed)):
            base = dict(zip(fixed, fixed_coords))
            out.append([self.rank_of(**base, **dict(zip(varying, vc)))
                        for vc in itertools.product(*(range(getattr(self, a)) for a in varying))])
        return out

    def group_of(self, rank: int, *axes: str) -> list[int]:
        """The group over ``axes`` (e.g. ``"dp"``, or ``"dp", "cp"``, or ``"dp_shard"``) that contains ``rank``."""
        if len(axes) == 1 and axes[0] in DP_SUB_AXES:
            self.coords_of(rank)  # range check
            return next(g for g in self._dp_sub_groups(axes[0]) if rank in g)
        varying = canonical_axes(axes)
        mine = self.coords_of(rank)._asdict()
        fixed = {a: c for a, c in mine.items() if a not in varying}
        return [self.rank_of(**fixed, **dict(zip(varying, vc)))
                for vc in itertools.product(*(range(getattr(self, a)) for a in varying))]

    def tp_groups(self) -> list[list[int]]:
        """Every tensor-parallel group (ranks that differ only in tp), in a fixed order."""
        return self.groups("tp")

    def cp_groups(self) -> list[list[int]]:
        """Every context-parallel group (ranks that differ only in cp)."""
        return self.groups("cp")

    def dp_groups(self) -> list[list[int]]:
        """Every data-parallel group (ranks that differ only in dp)."""
        return self.groups("dp")

    def pp_groups(self) -> list[list[int]]:
        """Every pipeline group (ranks that differ only in pp), ordered first stage to last."""
        return self.groups("pp")

    # -- neighbours ----------------------------------------------------------------------
    def shift(self, rank: int, axis: str, offset: int, *, wrap: bool = False) -> int | None:
        """The rank ``offset`` steps along ``axis`` from ``rank`` (other coordinates kept).

        Past either end: ``None``, or with ``wrap=True`` around the ring (as ring
        attention passes blocks along ``cp``).
        """
        (axis,) = canonical_axes((axis,))
        c = self.coords_of(rank)._asdict()
        size, target = getattr(self, axis), c[axis] + offset
        if not wrap and not 0 <= target < size:
            return None
        c[axis] = target % size
        return self.rank_of(**c)

    def pp_prev_rank(self, rank: int) -> int | None:
        """Global rank of the previous pipeline stage, or ``None`` on the first stage."""
        return self.shift(rank, "pp", -1)

    def pp_next_rank(self, rank: int) -> int | None:
        """Global rank of the next pipeline stage, or ``None`` on the last stage."""
        return self.shift(rank, "pp", +1)

    def table(self) -> list[dict[str, int]]:
        """One row per rank: ``{"rank", "pp", "dp", "cp", "tp"}`` (handy for printing a grid); with HSDP also
        ``"dp_replicate"`` and ``"dp_shard"``."""
        return [{"rank": r, **self.coords_of(r)._asdict(), **(self.dp_coords(r) if self.hsdp else {})}
                for r in range(self.world_size)]

    def layout(self) -> list[Any]:
        """The global ranks as a nested list of shape ``(pp, dp, cp, tp)`` (a DeviceMesh's ``mesh``)."""
        flat = list(range(self.world_size))
        for axis in reversed(AXES[1:]):  # group the innermost axis first
            step = getattr(self, axis)
            flat = [flat[i:i + step] for i in range(0, len(flat), step)]
        return flat
