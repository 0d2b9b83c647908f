"""lslm.plot.precision: every figure returns a Figure with titled, labelled axes and no text under 8 pt.

Inputs are built by hand (or by the format functions on hand-made tensors): no training here.
"""

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import pytest  # noqa: E402
import torch  # noqa: E402
from matplotlib.figure import Figure  # noqa: E402

from lslm.plot.precision import (  # noqa: E402
    plot_formats,
    plot_loss_curves,
    plot_scale_trajectory,
    plot_underflow_window,
)
from lslm.precision.formats import grad_exponent_histogram, underflow_window  # noqa: E402

GRADS = [torch.tensor([2.0**-30, 2.0**-26, 2.0**-20, 1e-3, 0.5, 8.0, 0.0])]


def _check(fig: Figure) -> None:
    assert isinstance(fig, Figure)
    for ax in fig.axes:
        assert ax.get_ylabel().strip(), "every axis needs a y label"
    main = fig.axes[0]
    assert main.get_title().strip() and main.get_xlabel().strip()
    small = [t.get_text() for t in fig.findobj(matplotlib.text.Text)
             if t.get_text().strip() and t.get_visible() and t.get_fontsize() < 8]
    assert small == [], small
    plt.close(fig)


@pytest.mark.parametrize("histogram", [None, grad_exponent_histogram(GRADS)])
def test_plot_formats(histogram) -> None:
    fig = plot_formats(histogram=histogram)
    assert len(fig.axes) == (1 if histogram is None else 2)
    _check(fig)
    _check(plot_formats(["fp16", "bf16"], xlim=(-40, 20)))
    with pytest.raises(ValueError, match="unknown|no float format"):
        plot_formats(["fp12"])


def test_plot_underflow_window() -> None:
    _check(plot_underflow_window(underflow_window(GRADS, "fp16", range(0, 25, 2)), mark=16))
    with pytest.raises(ValueError, match="no rows"):
        plot_underflow_window([])


def test_plot_loss_curves_and_scale_trajectory() -> None:
    _check(plot_loss_curves({"fp32": [7.0, 6.5, 6.1], "fp16": [7.0, 6.6, 6.3]}))
    fig = plot_scale_trajectory({"lslm": [2.0**20, 2.0**19, 2.0**18, 2.0**18], "GradScaler": [2.0**20, 2.0**19,
                                                                                               2.0**18, 2.0**18]},
                                {"lslm": [False, False, True, True], "GradScaler": [False, False, True, True]},
                                ceiling_log2=18)
    ax = fig.axes[0]
    assert ax.get_lines()[0].get_ydata()[0] == 20  # log2 of the scale
    _check(fig)
    with pytest.raises(ValueError):
        plot_loss_curves({})
