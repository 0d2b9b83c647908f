"""Tokens/s, achieved flop/s, MFU and HFU of a timed step: the one place recipes and benches get these figures.

The flops come from :mod:`lslm.metrics.flops` (``6·N·T + 6·L·h·s·T``, causal attention counted once; HFU adds
recomputation), the peak from the device the step ran on (a GPU's datasheet dense peak at the step's precision,
a CPU's measured fp32 matmul rate). :func:`step_throughput` gives the figures, :func:`throughput_lines` prints
the rows of a bench result that carry them.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

from lslm.metrics.flops import StepFlops, Throughput, device_peak, throughput

__all__ = ["step_throughput", "throughput_lines"]


def step_throughput(flops: StepFlops, step_s: float, device: Any, devices: int) -> Throughput:
    """Tokens/s, achieved flop/s, MFU and HFU of a step of ``flops`` (all ``devices`` together) that took ``step_s``,
    against the peak of ``device`` at ``flops.precision`` (:func:`lslm.metrics.flops.device_peak`)."""
    peak, source = device_peak(device, flops.precision)
    return throughput(flops, step_s, devices, peak, source)


def throughput_lines(rows: Iterable[dict[str, Any]], label: Callable[[dict[str, Any]], str]) -> list[str]:
    """``"<label>: tokens/s ..., MFU ..."`` for each row holding a ``throughput`` dict
    (:meth:`~lslm.metrics.flops.Throughput.to_dict`); rows of results written before the field existed give none."""
    return [f"{label(r)}: {Throughput(**r['throughput']).line()}" for r in rows if r.get("throughput")]
