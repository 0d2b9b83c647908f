"""Pipeline schedules: per-rank compute orders for naive, GPipe, 1F1B, interleaved 1F1B, ZB-H1 and DualPipeV.

A schedule is data (:class:`PipelineSchedule`): which rank holds which virtual stage, and
for every rank the order of its compute actions. Communication follows from the order by
one rule (:func:`lslm.pipeline.comm_plan.add_communication`). The same object drives the
executor on real processes and the simulator (:mod:`lslm.pipeline.simulator`).

Notation: ``p`` ranks, ``m`` micro-batches, ``v`` virtual stages per rank, ``S = p * v``
stages. Warm-up lengths, chunk orders and constraints follow the references named in each
generator; ``tests/test_pipeline_sched_torch.py`` checks the orders against
``torch.distributed.pipelining`` wherever torch has the schedule.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

from lslm.pipeline.actions import Action
from lslm.pipeline.comm_plan import add_communication

__all__ = ["SCHEDULES", "PipelineSchedule", "build_schedule", "check_schedule_config", "schedule_from_lists",
           "stage_to_rank_map"]

SCHEDULES = ("naive", "gpipe", "1f1b", "interleaved", "zb-h1", "dualpipev")


@dataclass(frozen=True)
class PipelineSchedule:
    """A pipeline schedule as data: ``compute[rank]`` is rank ``rank``'s compute actions in execution order.

    ``stage_to_rank[s]`` is the rank holding virtual stage ``s`` (``num_ranks * stages_per_rank`` stages).
    ``comm_plan`` says where :meth:`actions` puts the sends and receives (:mod:`lslm.pipeline.comm_plan`):
    ``"jit"`` (just in time, next to the compute) or ``"timed"`` (interleaved and DualPipeV, where ``"jit"`` deadlocks).
    """

    name: str
    num_ranks: int
    num_microbatches: int
    stages_per_rank: int
    stage_to_rank: tuple[int, ...]
    compute: tuple[tuple[Action, ...], ...]
    comm_plan: str = "jit"

    @property
    def num_stages(self) -> int:
        """Number of virtual stages, ``num_ranks * stages_per_rank``."""
        return len(self.stage_to_rank)

    def rank_stages(self, rank: int) -> list[int]:
        """The virtual stages rank ``rank`` holds, ascending."""
        return [s for s, r in enumerate(self.stage_to_rank) if r == rank]

    def actions(self, rank: int) -> list[Action]:
        """Rank ``rank``'s compute actions with the send/receive actions inserted (``comm_plan.add_communication``)."""
        return add_communication(self, rank)

    def __str__(self) -> str:
        head = (f"{self.name}: p={self.num_ranks} m={self.num_microbatches} v={self.stages_per_rank}, "
                f"stage->rank {list(self.stage_to_rank)}")
        return "\n".join([head] + [f"rank {r}: " + " ".join(map(str, acts)) for r, acts in enumerate(self.compute)])


def stage_to_rank_map(name: str, num_ranks: int, virtual_stages: int = 1) -> tuple[int, ...]:
    """Rank of every virtual stage: a loop (stage ``s`` on rank ``s % p``), or DualPipeV's V (``s`` or ``2p-1-s``)."""
    p, v = num_ranks, virtual_stages
    if name == "dualpipev":
        return tuple(s if s < p else 2 * p - 1 - s for s in range(2 * p))
    return tuple(s % p for s in range(p * v))


def _positive_int(what: str, value: object) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"{what} must be a positive int, got {value!r} ({type(value).__name__})")
    if value < 1:
        raise ValueError(f"{what} must be >= 1, got {value}")
    return value


def check_schedule_config(name: str, num_ranks: int, num_microbatches: int, virtual_stages: int = 1,
                          num_layers: int | None = None) -> None:
    """Raise ValueError, saying what to change, unless ``build_schedule(name, ...)`` can build this configuration.

    Constraints: ``v`` must be 1 except for ``"interleaved"`` (``v >= 2``; with ``v = 1`` use ``"1f1b"``)
    and ``"dualpipev"`` (``v = 2`` exactly: a V of two chunks per rank); ``"interleaved"`` needs ``m`` to be a
    multiple of ``p`` (Megatron-LM's rule; micro-batches enter each chunk in groups of ``p``); ``"dualpipev"``
    needs ``m >= 2p`` (DeepSeek's reference and torch's ``ScheduleDualPipeV``). ``naive``, ``gpipe``, ``1f1b`` and
    ``zb-h1`` accept any ``m >= 1`` (with ``m < p`` 1F1B's warm-up is clipped to ``m``, as in Megatron-LM; torch's
    ``Schedule1F1B`` refuses ``m < p``). With ``num_layers`` given, every stage needs at least one layer.
    """
    if not isinstance(name, str) or name not in SCHEDULES:
        raise ValueError(f"unknown schedule {name!r}; choose one of {SCHEDULES}")
    p = _positive_int("num_ranks (pipeline size p)", num_ranks)
    m = _positive_int("num_microbatches (m)", num_microbatches)
    v = _positive_int("virtual_stages (v, stages per rank)", virtual_stages)
    if name == "dualpipev":
        if v != 2:
            raise ValueError(f"dualpipev holds exactly 2 stages per rank (a V); pass virtual_stages=2, got {v}")
        if m < 2 * p:
            raise ValueError(f"dualpipev needs num_microbatches >= 2 * num_ranks = {2 * p}, got {m}; "
                             f"use at least {2 * p} micro-batches")
    elif name == "interleaved":
        if v < 2:
            raise ValueError(f"interleaved needs virtual_stages >= 2 (got {v}); with one stage per rank use '1f1b'")
        if m % p:
            lo, hi = (m // p) * p, (m // p + 1) * p
            alt = f"{lo} or {hi}" if lo else f"{hi}"
            raise ValueError(f"interleaved needs num_microbatches to be a multiple of num_ranks={p} (micro-batches "
                             f"enter each chunk in groups of p), got {m}; use {alt}")
    elif v != 1:
        raise ValueError(f"{name!r} holds one stage per rank; pass virtual_stages=1 (got {v}), or use 'interleaved' "
                         "(v >= 2) or 'dualpipev' (v = 2)")
    if num_layers is not None:
        layers = _positive_int("num_layers", num_layers)
        if p * v > layers:
            raise ValueError(f"{name} with p={p}, v={v} needs {p * v} stages but the model has {layers} layers; "
                             f"every stage needs at least one layer: lower p or v, or use a deeper model")


# ---------------------------------------------------------------- generators (one list of Actions per rank)


def _naive(p: int, m: int, v: int, s2r: Sequence[int]) -> list[list[Action]]:
    # One micro-batch at a time through the whole model and back: no two ranks ever work at once.
    out: list[list[Action]] = [[] for _ in range(p)]
    for mb in range(m):
        for s in range(len(s2r)):
            out[s2r[s]].append(Action(s, "F", mb))
        for s in reversed(range(len(s2r))):
            out[s2r[s]].append(Action(s, "B", mb))
    return out


def _gpipe(p: int, m: int, v: int, s2r: Sequence[int]) -> list[list[Action]]:
    # Huang et al. 2019: all forwards, then all backwards. Backwards in micro-batch order 0..m-1, like torch's
    # ScheduleGPipe (the order inside the flush does not change the bubble).
    return [[Action(r, "F", mb) for mb in range(m)] + [Action(r, "B", mb) for mb in range(m)] for r in range(p)]


def _one_f_one_b(p: int, m: int, v: int, s2r: Sequence[int]) -> list[list[Action]]:
    # PipeDream-Flush (Narayanan et al. 2021, sec. 2.2.1; Megatron-LM forward_backward_pipelining_without_
    # interleaving): rank r runs p-1-r warm-up forwards, then alternates F (newest) and B (oldest), then drains.
    out = []
    for r in range(p):
        warm = min(p - 1 - r, m)
        acts = [Action(r, "F", mb) for mb in range(warm)]
        for i in range(m - warm):
            acts += [Action(r, "F", warm + i), Action(r, "B", i)]
        acts += [Action(r, "B", mb) for mb in range(m - warm, m)]
        out.append(acts)
    return out


def _interleaved_rank(p: int, m: int, v: int, rank: int, warm: int, zero_bubble: bool, w_delay: int) -> list[Action]:
    """Megatron's interleaved 1F1B order on ``rank`` (optionally with the backward split into I + W).

    Virtual micro-batch ``k`` (0 .. v*m-1) of the forward stream goes to chunk ``(k // p) % v`` and is the
    ``(k // (p v)) * p + k % p``-th micro-batch: groups of ``p`` micro-batches per chunk (Narayanan et al. 2021,
    sec. 2.2.2; Megatron ``get_model_chunk_id``). The backward stream visits the chunks in reverse.
    """
    total = v * m

    def fwd(k: int) -> Action:
        return Action(((k // p) % v) * p + rank, "F", (k // (p * v)) * p + k % p)

    def bwd(k: int) -> Action:
        return Action((v - 1 - (k // p) % v) * p + rank, "I" if zero_bubble else "B", (k // (p * v)) * p + k % p)

    acts = [fwd(k) for k in range(warm)]
    pending_w: list[Action] = []

    def backward(k: int) -> None:
        b = bwd(k)
        acts.append(b)
        if zero_bubble:
            pending_w.append(Action(b.stage, "W", b.mb))
            if k >= w_delay:
                acts.append(pending_w.pop(0))

    for i in range(total - warm):
        acts.append(fwd(warm + i))
        backward(i)
    for k in range(total - warm, total):
        backward(k)
    acts += pending_w
    return acts


def _interleaved(p: int, m: int, v: int, s2r: Sequence[int]) -> list[list[Action]]:
    # Warm-up (v-1)*p + 2*(p-1-r) forwards (Megatron-LM; torch ScheduleInterleaved1F1B with m % p == 0). Megatron
    # additionally runs every forward first when m == p; torch does not, and we follow torch.
    return [_interleaved_rank(p, m, v, r, min((v - 1) * p + 2 * (p - 1 - r), v * m), False, 0) for r in range(p)]


def _zb_h1(p: int, m: int, v: int, s2r: Sequence[int]) -> list[list[Action]]:
    # Qi et al. 2023, sec. 2.1 (ZB-H1): 1F1B's warm-up (p-1-r forwards, so the same in-flight limit p-r) with the
    # backward split into I (input grad, on the critical path) and W (weight grad, off it). Rank r holds back
    # its first W until its r-th steady I, so later ranks keep W work in hand for the cool-down, where in 1F1B they
    # would idle waiting for gradients. This is torch's ScheduleInterleavedZeroBubble rule at v = 1.
    return [_interleaved_rank(p, m, 1, r, min(p - 1 - r, m), True, r) for r in range(p)]


def _dualpipev_rank(p: int, m: int, rank: int) -> list[Action]:
    """DualPipeV on ``rank`` (deepseek-ai/DualPipe ``dualpipev.py``: the V-shaped "cut-in-half" of DualPipe, the
    bidirectional schedule of the DeepSeek-V3 report, sec. 3.2.1).

    Chunk 0 is stage ``rank`` (going down the V), chunk 1 is stage ``2p-1-rank`` (coming back). Eight phases;
    the overlapped "F&B" of the reference (a forward of one chunk computed while the backward of the other
    runs) is written as the forward then the backward.
    """
    s0, s1 = rank, 2 * p - 1 - rank
    acts: list[Action] = []
    nxt = {(s0, "F"): 0, (s1, "F"): 0, (s0, "B"): 0, (s1, "B"): 0}
    w_queue: list[Action] = []

    def f(s: int) -> None:
        acts.append(Action(s, "F", nxt[s, "F"]))
        nxt[s, "F"] += 1

    def b(s: int, split: bool) -> None:
        mb = nxt[s, "B"]
        nxt[s, "B"] += 1
        acts.append(Action(s, "I" if split else "B", mb))
        if split:
            w_queue.append(Action(s, "W", mb))

    def w() -> None:
        if w_queue:
            acts.append(w_queue.pop(0))

    for _ in range(2 * (p - rank - 1)):          # 1: forwards of chunk 0 only
        f(s0)
    for _ in range(rank + 1):                    # 2: F0 F1
        f(s0)
        f(s1)
    for _ in range(p - rank - 1):                # 3: I1 W1 F1 (zero bubble)
        b(s1, True)
        w()
        f(s1)
    for _ in range(m - 2 * p + rank + 1):        # 4: main phase, (F0 & B1) (F1 & B0)
        f(s0)
        b(s1, False)
        f(s1)
        b(s0, False)
    for _ in range(p - rank - 1):                # 5: B1 (F1 & B0)
        b(s1, False)
        f(s1)
        b(s0, False)
    half = (rank + 1) // 2                       # 6: B1 B0, the second half split
    split = False
    for i in range(rank + 1):
        if i == half and rank % 2 == 1:
            split = True
        b(s1, split)
        if i == half and rank % 2 == 0:
            split = True
        b(s0, split)
    for _ in range(p - rank - 1):                # 7: W B0
        w()
        b(s0, True)
    for _ in range(rank + 1):                    # 8: drain the W queue
        w()
    acts += w_queue                              # defensive: nothing is left for valid configurations
    return acts


def _dualpipev(p: int, m: int, v: int, s2r: Sequence[int]) -> list[list[Action]]:
    return [_dualpipev_rank(p, m, r) for r in range(p)]


_GENERATORS: dict[str, Callable[[int, int, int, Sequence[int]], list[list[Action]]]] = {
    "naive": _naive, "gpipe": _gpipe, "1f1b": _one_f_one_b, "interleaved": _interleaved, "zb-h1": _zb_h1,
    "dualpipev": _dualpipev,
}


def build_schedule(name: str, num_ranks: int, num_microbatches: int, virtual_stages: int = 1) -> PipelineSchedule:
    """The schedule ``name`` (one of :data:`SCHEDULES`) for ``p`` ranks, ``m`` micro-batches and ``v`` stages per rank.

    Raises ValueError (from :func:`check_schedule_config`) for configurations the schedule does not support.
    """
    check_schedule_config(name, num_ranks, num_microbatches, virtual_stages)
    s2r = stage_to_rank_map(name, num_ranks, virtual_stages)
    compute = _GENERATORS[name](num_ranks, num_microbatches, virtual_stages, s2r)
    # The just-in-time comm rule deadlocks for the looped and V placements under strict NCCL matching
    # (lslm.pipeline.comm_plan); those two post receives when the data is sent instead.
    plan = "timed" if name in ("interleaved", "dualpipev") else "jit"
    return PipelineSchedule(name, num_ranks, num_microbatches, virtual_stages, s2r,
                            tuple(tuple(acts) for acts in compute), plan)


def schedule_from_lists(per_rank: Sequence[Sequence[Action | str]], num_microbatches: int,
                        stage_to_rank: Sequence[int] | None = None, name: str = "custom") -> PipelineSchedule:
    """A :class:`PipelineSchedule` from hand-written per-rank compute lists (``Action`` or strings like ``"0F1"``).

    ``stage_to_rank`` defaults to one stage per rank (stage ``r`` on rank ``r``). Communication actions in the
    lists are dropped: they are re-derived by the comm plan. Nothing is checked here; use
    :func:`lslm.pipeline.validate.validate_schedule`.
    """
    from lslm.pipeline.actions import parse_action

    p = len(per_rank)
    if p < 1:
        raise ValueError("give one list of actions per rank (at least one rank)")
    s2r = tuple(range(p)) if stage_to_rank is None else tuple(int(r) for r in stage_to_rank)
    if len(s2r) % p or sorted(set(s2r)) != list(range(p)):
        raise ValueError(f"stage_to_rank {list(s2r)} must place the same number of stages on each of the {p} ranks")
    compute = []
    for acts in per_rank:
        parsed = [a if isinstance(a, Action) else parse_action(a) for a in acts]
        compute.append(tuple(a for a in parsed if a.is_compute))
    return PipelineSchedule(name, p, num_microbatches, len(s2r) // p, s2r, tuple(compute))
