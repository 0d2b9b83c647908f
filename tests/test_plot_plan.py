"""Notebook 09's calculator widget and figures: built, driven programmatically, bars follow lslm.plan."""

from __future__ import annotations

import matplotlib

matplotlib.use("Agg")

import matplotlib.pyplot as plt  # noqa: E402
import pytest  # noqa: E402

from lslm.plan import Layout, estimate, hardware_presets, model_presets  # noqa: E402
from lslm.plot.plan import memory_bars, plan_calculator, plot_memory_by_owner, plot_time_breakdown  # noqa: E402

pytest.importorskip("ipywidgets")


def test_a_changed_control_changes_the_bar() -> None:
    calc = plan_calculator("llama3-8b", "h100-sxm", Layout(dp=8, zero=1))
    before = dict(calc.bar_data)
    assert calc.error == "" and before["optimizer_states"] > 0
    want = estimate(model_presets()["llama3-8b"], Layout(dp=8, zero=1), hardware_presets()["h100-sxm"])
    assert before == memory_bars(want) and sum(before.values()) == pytest.approx(want.peak_bytes)
    assert f"per device: {want.peak_bytes / 1e9:.2f} GB" in calc.readout.value
    calc.controls["zero"].value = 3
    after = calc.bar_data
    assert after["parameters"] == pytest.approx(before["parameters"] / 8)
    assert after["activations"] == before["activations"]
    assert f"per device: {calc.estimate.peak_bytes / 1e9:.2f} GB" in calc.readout.value
    assert f"per device: {want.peak_bytes / 1e9:.2f} GB" not in calc.readout.value


def test_an_invalid_layout_shows_its_message_not_a_traceback() -> None:
    calc = plan_calculator("llama3-8b", "h100-sxm", Layout(dp=8))
    calc.controls["pp"].value = 64  # 32 layers do not split over 64 stages
    assert calc.estimate is None and calc.bar_data == {}
    assert "n_layer=32 must be divisible by pp x v" in calc.error
    assert "cannot run" in calc.message.value and "n/a" in calc.readout.value
    calc.controls["pp"].value = 2
    assert calc.error == "" and calc.message.value == "" and calc.bar_data


def test_a_model_preset_fills_the_shape_controls() -> None:
    calc = plan_calculator("llama3-8b", "h100-sxm", Layout(dp=8))
    calc.controls["model"].value = "gpt2-small"
    c = calc.controls
    assert (c["n_layer"].value, c["hidden"].value, c["n_head"].value, c["seq_len"].value) == (12, 768, 12, 1024)
    assert calc.estimate.model.name == "GPT-2 small" and calc.error == ""
    c["seq_len"].value = 512
    assert calc.estimate.model.seq_len == 512


def test_figures_have_titles_and_units() -> None:
    hw = hardware_presets()["h100-sxm"]
    m = model_presets()["llama3-8b"]
    ests = [estimate(m, Layout(dp=8, zero=z), hw) for z in (1, 3)]
    fig = plot_memory_by_owner(ests, ["ZeRO-1", "ZeRO-3"], title="memory")
    assert fig.axes[0].get_title() == "memory" and "GB" in fig.axes[0].get_ylabel()
    fig2 = plot_time_breakdown(ests, ["ZeRO-1", "ZeRO-3"], title="time")
    assert "seconds" in fig2.axes[0].get_xlabel()
    with pytest.raises(ValueError, match="labels"):
        plot_memory_by_owner(ests, ["one"], title="x")
    plt.close("all")
