"""The Ultra-Scale Playbook's overlap conditions, predicted by the plan's model and read from a profiler trace.

A collective is hidden when the computation that can run while it is in flight takes at least as long:

* **DP** (bucketed DDP): a bucket's all-reduce starts when its last gradient is ready and runs during the
  backward of the layers before it, so it hides when that backward takes at least the all-reduce's time:
  ``T_backward(bucket) >= T_all_reduce(bucket bytes)``, with the bucket's backward the model's backward
  times its share of the gradient bytes.
* **ZeRO-3**: the next block's all-gather is prefetched during this block's compute:
  ``T_forward(block) >= T_all_gather(block's parameter bytes)``.
* **TP** (Megatron, plain schedule): nothing can hide the all-reduce, the next operation needs its result
  (the LayerNorm after ``g``, the matmuls after ``f``). Its only overlap is in backward, with
  ``async_grad_allreduce``: the input gradient's all-reduce against the weight gradient's matmul,
  ``T_wgrad(layer) >= T_all_reduce(b·s·h)``; the verdict for the plain schedule is "exposed" whatever the sizes.

The times are the plan's model on a :class:`~lslm.plan.hardware.Hardware` (the ``cpu-box`` preset for this
machine: measured matmul rate and per-pass fixed cost, gloo's collectives priced off their measured tables):
compute from :func:`~lslm.plan.timing.layer_forward_flops`, communication as
:class:`~lslm.plan.comm.Collective`. The plan's own rule is applied on top: without a spare core (as many
processes as cores) every core computes and no communication overlaps, so the predicted verdict is
"exposed (no spare core)" even where the inequality holds. The traced side is what
:mod:`lslm.metrics.overlap` reads from a ``--trace`` run: each collective kind's issue-to-wait time and the part
of it the main thread spent blocked (exposed). :func:`verdict_row` puts the two side by side.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

from lslm.metrics.overlap import StepOverlap
from lslm.plan.comm import Collective
from lslm.plan.hardware import Hardware
from lslm.plan.model import ModelSpec
from lslm.plan.timing import layer_forward_flops

__all__ = ["HIDDEN_BELOW", "EXPOSED_ABOVE", "OverlapRow", "block_forward_s", "collective_s", "describe_row",
           "model_backward_s", "predicted_verdict", "traced_share", "traced_verdict", "verdict_row", "weight_grad_s"]

#: A traced collective counts as hidden when at most this share of its issue-to-wait time was exposed...
HIDDEN_BELOW = 0.25
#: ... and as exposed from this share up; in between it is "partly hidden".
EXPOSED_ABOVE = 0.75


def collective_s(hw: Hardware, algorithm: str, payload: float, n: int) -> float:
    """Seconds of one call of ``algorithm`` (e.g. ``"all_reduce_ring"``) on ``n`` ranks of one node of ``hw``."""
    return Collective("", "", algorithm, float(payload), n, 1.0, hw.link(n), "").time_s


def block_forward_s(model: ModelSpec, hw: Hardware, sequences: int, tp: int = 1) -> float:
    """One transformer block's forward on ``sequences`` sequences, split ``tp`` ways: its flops at the fp32 rate
    plus the hardware's fixed cost of a forward pass."""
    mm, core = layer_forward_flops(model, sequences)
    return (mm + core) / tp / hw.flops("fp32") + hw.layer_overhead_s[0]


def weight_grad_s(model: ModelSpec, hw: Hardware, sequences: int, tp: int = 1) -> float:
    """One block's weight-gradient matmuls on ``sequences`` sequences, split ``tp`` ways: as many flops as the
    block's forward matmuls (``dL/dW = dL/dy^T x`` for every ``y = x W^T``), at the fp32 rate, no fixed cost."""
    mm, _ = layer_forward_flops(model, sequences)
    return mm / tp / hw.flops("fp32")


def model_backward_s(model: ModelSpec, hw: Hardware, sequences: int) -> float:
    """The whole model's backward on ``sequences`` sequences (twice each block's forward flops, the head's
    ``2 · 2·s·h·V`` per sequence, each pass's fixed cost)."""
    mm, core = layer_forward_flops(model, sequences)
    rate, bwd = hw.flops("fp32"), hw.layer_overhead_s[1]
    head = 2 * sequences * model.seq_len * model.hidden * model.vocab
    return model.n_layer * (2 * (mm + core) / rate + bwd) + 2 * head / rate + bwd


def predicted_verdict(compute_s: float, comm_s: float, spare_core: bool = True) -> str:
    """``"hidden"`` when ``compute_s >= comm_s`` (the overlap condition) and a core is free to communicate,
    else ``"exposed"`` with the reason (without a spare core, also whether the inequality alone would hold)."""
    holds = compute_s >= comm_s
    if not spare_core:
        return f"exposed (no spare core; the inequality {'holds' if holds else 'fails too'})"
    return "hidden" if holds else "exposed (comm-bound)"


def traced_verdict(exposed_fraction: float | None) -> str:
    """``"hidden"`` / ``"partly hidden"`` / ``"exposed"`` from the traced share of a collective's time the main
    thread spent blocked (:data:`HIDDEN_BELOW`, :data:`EXPOSED_ABOVE`); ``"not traced"`` for None."""
    if exposed_fraction is None:
        return "not traced"
    if exposed_fraction <= HIDDEN_BELOW:
        return "hidden"
    return "exposed" if exposed_fraction >= EXPOSED_ABOVE else "partly hidden"


def traced_share(per_rank: dict[int, list[StepOverlap]], key: str) -> tuple[int, float, float]:
    """Calls, issue-to-wait seconds and exposed seconds of the collectives ``key`` (``"op@axis"``), summed over
    every rank and traced step of ``per_rank`` (:func:`lslm.metrics.overlap.analyse_files`)."""
    calls = sum(s.calls_by_kind.get(key, 0) for steps in per_rank.values() for s in steps)
    comm = sum(s.comm_s.get(key, 0.0) for steps in per_rank.values() for s in steps)
    exposed = sum(s.exposed_by_kind.get(key, 0.0) for steps in per_rank.values() for s in steps)
    return calls, comm, exposed


@dataclass(frozen=True)
class OverlapRow:
    """One overlap condition, predicted and traced (times per call, in seconds)."""

    technique: str
    collective: str
    condition: str
    predicted_compute_s: float
    predicted_comm_s: float
    predicted: str
    traced_calls: int
    traced_comm_s: float | None  #: mean issue-to-wait time of one call
    traced_exposed_fraction: float | None
    traced: str

    @property
    def agree(self) -> bool:
        """Whether prediction and trace give the same verdict ("partly hidden" agrees with neither)."""
        return self.predicted.split(" ")[0] == self.traced

    def to_dict(self) -> dict[str, Any]:
        """Plain JSON-able dict (with ``agree``)."""
        return {**asdict(self), "agree": self.agree}


def verdict_row(technique: str, collective: str, condition: str, compute_s: float, comm_s: float, traced: tuple[
        int, float, float], spare_core: bool = True) -> OverlapRow:
    """The row of one condition: the predicted times of one call and its verdict, and ``traced`` =
    :func:`traced_share`'s ``(calls, issue-to-wait s, exposed s)`` read as a mean time per call and an exposed
    fraction."""
    calls, comm, exposed = traced
    fraction = exposed / comm if calls and comm > 0 else None
    return OverlapRow(technique, collective, condition, compute_s, comm_s,
                      predicted_verdict(compute_s, comm_s, spare_core), calls, comm / calls if calls else None,
                      fraction, traced_verdict(fraction))


def describe_row(row: dict[str, Any], hardware: str, world_size: int) -> str:
    """Three lines for one row of ``bench/results/overlap_verdicts.json`` (an :meth:`OverlapRow.to_dict`): the
    condition, the model's times of one call and its verdict on ``hardware``, what the trace saw."""
    comm = row["traced_comm_s"]
    traced = ("no call traced" if comm is None else
              f"{row['traced_calls']} calls, {1e3 * comm:.3f} ms each from issue to wait on average, "
              f"{100 * row['traced_exposed_fraction']:.0f} % of it exposed -> {row['traced']}")
    return (f"{row['technique']} at {world_size} ranks, {row['collective']}: hidden if {row['condition']}\n"
            f"  predicted on '{hardware}': compute {1e3 * row['predicted_compute_s']:.3f} ms, communication "
            f"{1e3 * row['predicted_comm_s']:.3f} ms -> {row['predicted']}\n"
            f"  traced: {traced}; prediction and trace {'agree' if row['agree'] else 'disagree'}")
