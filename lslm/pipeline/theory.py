"""Closed forms for pipeline bubbles and activation memory, in the units the simulator reports.

Notation: ``p`` ranks, ``m`` micro-batches, ``v`` stages per rank; ``F``, ``B``, ``I``, ``W`` are the
times of one action on **one stage** (``B = I + W`` when the backward is split). Bubble fractions use
the definition of :mod:`lslm.pipeline.timeline`: ``idle / (busy + idle)`` per rank, where every rank
idles the same time when stages are balanced.

Bubble time per rank (idle over the step):

=============  ============================================  ====================================================
schedule       idle per rank                                 source / validity
=============  ============================================  ====================================================
naive          ``(p - 1) m (F + B)``                         one stage busy at a time
gpipe, 1f1b    ``(p - 1)(F + B)``                            Huang et al. 2019 sec. 2.2; Narayanan et al. 2021
                                                             sec. 2.2.1; any ``m``
interleaved    ``(p - 1)(F + B)`` with per-*chunk* F, B,     Narayanan et al. 2021 sec. 2.2.2: ``(p-1)/v`` of a
               i.e. ``1/v`` of 1F1B's                        rank-stage's time; ``m % p == 0``
zb-h1          ``(p - 1)(F + I - W)``                        Qi et al. 2023 sec. 2.1 (their ``B`` is our ``I``;
                                                             written ``(p-1)(F+B-2W)`` with a full ``B`` in
                                                             DeepSeek-V3's table 2 and the DualPipe README,
                                                             "ZB1P"); exact here for ``m >= p``
                                                             and ``W <= min(F, I)``
dualpipev      README: ``(p - 1)(F&B + B - 3W)`` per         the DualPipe repository's README (deepseek-ai/
               chunk; our serial F-then-B version            DualPipe), DualPipeV row: ``(PP/2 - 1)(F&B + B -
               measures ``(p - 1)(F + B - 2W)``              3W)`` on ``PP/2`` devices, ``PP`` the number of
                                                             chunks: ``PP = 2p`` here (DualPipe's bubble in
                                                             DeepSeek-V3's table 2, on ``PP`` devices)
=============  ============================================  ====================================================

DualPipeV note: the table's ``F&B`` is the time of one overlapped forward-and-backward chunk pair.
Our schedules write that pair as ``F`` then ``B`` (nothing overlaps on one device), so ``F&B = F + B``
and the README's count gives ``(p - 1)(F + 2B - 3W)``. The simulator's free-message timeline of our
DualPipeV idles less, ``(p - 1)(F + B - 2W)`` per rank (checked for ``B <= 2F`` with
``I = W = B/2``; larger ``B`` idles a little more); both stay below 1F1B on the same ``p`` ranks,
``(p - 1)(2F + 2B)`` in chunk units. :func:`bubble_time_theory` returns the README's value and
:func:`dualpipev_bubble_time_observed` ours. The README derives DualPipeV from DualPipe (the schedule DeepSeek-V3
trained with) by a "cut-in-half" procedure it credits to Sea AI Lab.

Activation memory (peak **in-flight** micro-batch-stages on a rank: forwards whose ``B``/``I`` has not
run, each holding one stage's activations for one micro-batch, the simulator's ``peak_in_flight``):

* gpipe ``m``; naive ``1``; 1f1b and zb-h1 ``min(p - rank, m)`` (Narayanan et al. 2021 sec. 2.2.1; Qi et al.
  2023 sec. 2.1 keeps 1F1B's peak);
* interleaved ``min((v - 1) p + 2 (p - 1 - rank) + 1, v m)``; divided by ``v`` (units of one micro-batch over
  ``L/p`` layers, the simulator's ``peak_activation_units``) rank 0 holds ``p (1 + (p - 1)/(p v))``,
  Narayanan et al. 2021 sec. 2.2.2's factor over 1F1B's ``p``;
* dualpipev ``2p + 1`` chunk-micro-batches on every rank: the DualPipe README's ``PP + 1`` per device for DualPipeV
  with ``PP = 2p`` chunks and the unit "one chunk's activations for one micro-batch"; ``p + 1/2`` in ``L/p``-layer
  units.
"""

from __future__ import annotations

from collections.abc import Mapping

from lslm.pipeline.schedules import SCHEDULES, check_schedule_config

__all__ = ["activation_memory_theory", "activation_units_theory", "bubble_fraction_theory", "bubble_time_theory",
           "busy_time", "dualpipev_bubble_time_observed"]

_DEFAULT = {"F": 1.0, "B": 2.0, "I": 1.0, "W": 1.0}


def _costs(costs: Mapping[str, float] | None) -> dict[str, float]:
    c = {**_DEFAULT, **(costs or {})}
    if costs is not None and ("I" in costs or "W" in costs) and "B" not in costs:
        c["B"] = c["I"] + c["W"]  # a split backward given: the full one is its two halves
    return c


def busy_time(name: str, p: int, m: int, v: int = 1, costs: Mapping[str, float] | None = None) -> float:
    """Compute time of one rank over a step: ``v m`` stage-micro-batches, each ``F + B`` (or ``F + I + W``)."""
    check_schedule_config(name, p, m, v)
    c = _costs(costs)
    per = c["F"] + c["I"] + c["W"] if name in ("zb-h1",) else c["F"] + c["B"]
    return v * m * per


def bubble_time_theory(name: str, p: int, m: int, v: int = 1, costs: Mapping[str, float] | None = None) -> float:
    """Idle time per rank over one step (module table; DualPipeV: the DualPipe README's value with ``F&B = F + B``).

    ``costs`` may give ``"F&B"`` for DualPipeV's overlapped pair (default ``F + B``).
    """
    check_schedule_config(name, p, m, v)
    c = _costs(costs)
    if name == "naive":
        return (p - 1) * m * (c["F"] + c["B"])
    if name in ("gpipe", "1f1b", "interleaved"):
        return (p - 1) * (c["F"] + c["B"])
    if name == "zb-h1":
        return (p - 1) * (c["F"] + c["I"] - c["W"])
    fb = (costs or {}).get("F&B", c["F"] + c["B"])
    return (p - 1) * (fb + c["B"] - 3 * c["W"])


def dualpipev_bubble_time_observed(p: int, costs: Mapping[str, float] | None = None) -> float:
    """Idle per rank of our serial (F then B) DualPipeV with free messages: ``(p - 1)(F + B - 2W)`` (module doc)."""
    c = _costs(costs)
    return (p - 1) * (c["F"] + c["B"] - 2 * c["W"])


def bubble_fraction_theory(name: str, p: int, m: int, v: int = 1, costs: Mapping[str, float] | None = None) -> float:
    """Bubble fraction ``idle / (busy + idle)`` (timeline.py's definition) from :func:`bubble_time_theory`.

    GPipe / 1F1B: ``(p-1)/(m+p-1)``; interleaved: ``(p-1)/(v m+p-1)``; naive: ``(p-1)/p``.
    """
    if name not in SCHEDULES:
        raise ValueError(f"unknown schedule {name!r}; choose one of {SCHEDULES}")
    idle = bubble_time_theory(name, p, m, v, costs)
    busy = busy_time(name, p, m, v, costs)
    return idle / (busy + idle)


def activation_memory_theory(name: str, p: int, m: int, v: int = 1, rank: int = 0) -> int:
    """Peak in-flight micro-batch-stages on ``rank`` (the simulator's ``peak_in_flight``; module doc)."""
    check_schedule_config(name, p, m, v)
    if not 0 <= rank < p:
        raise ValueError(f"rank {rank} is outside 0..{p - 1}")
    if name == "naive":
        return 1
    if name == "gpipe":
        return m
    if name in ("1f1b", "zb-h1"):
        return min(p - rank, m)
    if name == "interleaved":
        return min((v - 1) * p + 2 * (p - 1 - rank) + 1, v * m)
    return 2 * p + 1


def activation_units_theory(name: str, p: int, m: int, v: int = 1, rank: int = 0) -> float:
    """:func:`activation_memory_theory` in units of one micro-batch over ``L/p`` layers (divided by ``v``)."""
    return activation_memory_theory(name, p, m, v, rank) / v
