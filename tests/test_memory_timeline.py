"""lslm.metrics.memory_timeline and lslm.plot.memory_timeline: the memory profiler's bytes by category over time.

* the pure part on the profiler's row format, exact numbers (sorted by time, column 0 dropped, peak found);
* one real profile of a Linear layer's forward, backward and SGD step (one process): its parameter and gradient
  bytes exact, the activation the forward saves freed by the backward, the named ranges on the samples' clock;
* the plot draws it.
"""

from __future__ import annotations

import json

import matplotlib
import pytest
import torch
from torch.autograd.profiler import record_function

from lslm.metrics.memory_timeline import MemoryTimeline, record_memory_timeline, timeline_from_sizes
from lslm.metrics.step_memory import PROFILER_CATEGORIES
from lslm.plot.memory_timeline import plot_memory_timeline

matplotlib.use("Agg")


def _row(**by_category: int) -> list[int]:
    return [0] + [by_category.get(c, 0) for c in PROFILER_CATEGORIES]


def test_timeline_from_the_profilers_rows() -> None:
    times = [20, 10, 30, 40]  # a pre-existing tensor put at the earliest time, after the first row
    sizes = [_row(parameter=100, activation=50), _row(parameter=100), _row(parameter=100, activation=50,
             gradient=100, temporary=7), _row(parameter=100, gradient=100)]
    tl = timeline_from_sizes(times, sizes, "cpu", ranges=[("lslm.phase:B", 25, 35), ("lslm.phase:F", 12, 22)])
    assert isinstance(tl, MemoryTimeline) and tl.device == "cpu"
    assert tl.times_us == (10, 20, 30, 40)
    assert tl.totals() == [100, 150, 257, 200]
    assert tl.peak_index() == 2
    assert tl.peak() == dict.fromkeys(PROFILER_CATEGORIES, 0) | {"parameter": 100, "activation": 50,
                                                                 "gradient": 100, "temporary": 7}
    assert tl.category("activation") == [0, 50, 50, 0]
    assert tl.ranges == (("lslm.phase:F", 12, 22), ("lslm.phase:B", 25, 35)) and tl.start_us == 10
    assert MemoryTimeline.from_dict(json.loads(json.dumps(tl.to_dict()))) == tl
    with pytest.raises(ValueError, match="categories changed"):
        timeline_from_sizes([1], [[0, 1, 2]], "cpu")
    with pytest.raises(ValueError, match="one row per time"):
        timeline_from_sizes([1, 2], [_row()], "cpu")
    with pytest.raises(ValueError, match="no category"):
        tl.category("weights")
    with pytest.raises(ValueError, match="empty"):
        plot_memory_timeline(timeline_from_sizes([], [], "cpu"))


def test_a_linear_sgd_step_profiled_and_plotted() -> None:
    torch.manual_seed(0)
    lin = torch.nn.Linear(256, 256)
    opt = torch.optim.SGD(lin.parameters(), lr=0.1)
    x = torch.randn(64, 256)  # lslm: cpu-ok (the profiler under test is read on the CPU)
    params = sum(4 * p.numel() for p in lin.parameters())

    def step() -> float:
        opt.zero_grad(set_to_none=True)
        with record_function("lslm.phase:forward"):
            loss = lin(x).square().sum()
        with record_function("lslm.phase:backward"):
            loss.backward()
        opt.step()
        return float(loss.detach())

    step()
    tl, loss = record_memory_timeline(step, "cpu", range_prefixes=("lslm.phase:",))
    assert isinstance(loss, float)
    assert [n for n, *_ in tl.ranges] == ["lslm.phase:forward", "lslm.phase:backward"]
    assert all(a <= b for _, a, b in tl.ranges) and tl.ranges[0][2] <= tl.ranges[1][1]
    assert set(tl.category("parameter")) == {params}
    assert max(tl.category("gradient")) == params
    # The forward's output (64 x 256 fp32) is saved for square's backward: an activation, freed by the backward.
    act = tl.category("activation")
    assert max(act) >= 4 * 64 * 256 and act[-1] == 0
    ax = plot_memory_timeline(tl, title="one Linear step")
    assert ax.get_ylabel() == "live bytes (MB)" and ax.get_title(loc="left") == "one Linear step"
    assert any(t.get_text() == "forward" for t in ax.texts)
    matplotlib.pyplot.close(ax.figure)
