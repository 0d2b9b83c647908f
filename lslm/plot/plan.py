"""Notebook 09's figures and calculator widget: a device's memory by owner and a step's time, from ``lslm.plan``.

* :func:`plot_memory_by_owner`: one stacked bar per estimate (the most loaded device's bytes by owner: parameters,
  gradients, fp32 masters, optimizer states, activations, communication buffers) with the device's usable memory
  drawn as a line;
* :func:`plot_time_breakdown`: one stacked bar per estimate (compute, pipeline bubble, exposed communication of
  each axis), in seconds per step;
* :func:`plot_validation`: the time model against the committed benches' measured step times
  (:func:`lslm.plan.validate`), one pair of bars per configuration, and the relative error;
* :func:`plan_calculator`: an ipywidgets calculator (model, layout and hardware as controls; the two plots above
  and the roofline verdict per axis redrawn on every change). A layout that cannot run shows the
  :class:`ValueError`'s message in the widget instead of a traceback.

Everything shown is :func:`lslm.plan.estimate`'s: the widget computes nothing of its own.
"""

from __future__ import annotations

import html
from collections.abc import Mapping, Sequence
from dataclasses import replace
from typing import Any

import matplotlib.pyplot as plt
from matplotlib.axes import Axes

from lslm.plan import Estimate, Layout, ModelSpec, estimate, hardware_presets, model_presets

__all__ = ["MEMORY_OWNERS", "TIME_PARTS", "CalculatorWidget", "plan_calculator", "plot_memory_by_owner",
           "plot_time_breakdown", "plot_validation"]

#: (owner key of ``Estimate.to_dict()["memory"]``, label, colour); buffers are every other key.
MEMORY_OWNERS = (("parameters", "parameters", "#8ecae6"), ("gradients", "gradients", "#ffb703"),
                 ("master_weights", "fp32 masters", "#cdb4db"), ("optimizer_states", "optimizer states", "#90be6d"),
                 ("activations", "activations", "#f28482"))
BUFFERS_COLOR = "#adb5bd"
#: (key of ``Estimate.times``, label, colour): the parts of a step.
TIME_PARTS = (("compute", "compute", "#90be6d"), ("bubble", "pipeline bubble", "#e9ecef"),
              ("cores", "core sharing", "#6c757d"), ("tp", "tp comm", "#8ecae6"), ("pp", "pp comm", "#cdb4db"),
              ("dp", "dp comm (exposed)", "#ffb703"), ("optimizer", "optimizer step", "#f28482"),
              ("offload", "offload copies", "#b08968"))
GB = 1e9
POWERS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024)


def memory_bars(est: Estimate) -> dict[str, float]:
    """The most loaded device's bytes by owner, communication buffers summed as ``"buffers"``."""
    mem = est.to_dict()["memory"]
    assert isinstance(mem, dict)
    bars = {key: float(mem.get(key, 0.0)) for key, _, _ in MEMORY_OWNERS}
    bars["buffers"] = float(sum(v for k, v in mem.items() if k not in bars))
    return bars


def plot_memory_by_owner(estimates: Sequence[Estimate], labels: Sequence[str], *, title: str,
                         ax: Axes | None = None) -> plt.Figure:
    """Stacked bars of the most loaded device's memory by owner (GB = 1e9 B), one per estimate, with the
    device's usable memory (``hardware.usable_bytes``) as a dashed line per bar."""
    if len(estimates) != len(labels):
        raise ValueError(f"{len(estimates)} estimates but {len(labels)} labels")
    fig, ax = (plt.subplots(figsize=(9, 3.8), dpi=80) if ax is None else (ax.figure, ax))
    xs = list(range(len(estimates)))
    bottom = [0.0] * len(xs)
    parts = [(k, n, c) for k, n, c in MEMORY_OWNERS] + [("buffers", "comm buffers", BUFFERS_COLOR)]
    bars = [memory_bars(e) for e in estimates]
    for key, name, color in parts:
        vals = [b[key] / GB for b in bars]
        if any(vals):
            ax.bar(xs, vals, bottom=bottom, color=color, edgecolor="black", lw=0.5, label=name, width=0.6)
            bottom = [a + v for a, v in zip(bottom, vals)]
    for x, est in zip(xs, estimates):
        usable = est.hardware.usable_bytes / GB
        ax.hlines(usable, x - 0.4, x + 0.4, color="black", ls="--", lw=1.5,
                  label="device memory (usable)" if x == 0 else None)
        ax.text(x + 0.31, bottom[x], f"{bottom[x]:.1f}", ha="left", va="center", fontsize=8)
    ax.set_xticks(xs, list(labels), fontsize=8)
    ax.set_ylabel("GB per device (1 GB = 1e9 B)")
    top = max(bottom + [e.hardware.usable_bytes / GB for e in estimates])
    ax.set_ylim(0, 1.18 * top)
    ax.set_title(title, fontsize=10)
    ax.legend(fontsize=7, ncol=4, loc="upper left")
    return fig


def plot_time_breakdown(estimates: Sequence[Estimate], labels: Sequence[str], *, title: str,
                        ax: Axes | None = None) -> plt.Figure:
    """Stacked horizontal bars of a step's predicted time: compute, bubble, exposed communication per axis (s)."""
    if len(estimates) != len(labels):
        raise ValueError(f"{len(estimates)} estimates but {len(labels)} labels")
    fig, ax = (plt.subplots(figsize=(9, 0.7 + 0.5 * len(estimates)), dpi=80) if ax is None else (ax.figure, ax))
    ys = list(range(len(estimates)))  # one row per estimate, the first on top
    left = [0.0] * len(ys)
    for key, name, color in TIME_PARTS:
        vals = [e.times[key].value if key in e.times else 0.0 for e in estimates]
        if any(vals):
            ax.barh(ys, vals, left=left, color=color, edgecolor="black", lw=0.5, label=name, height=0.6)
            left = [a + v for a, v in zip(left, vals)]
    for y, total in zip(ys, left):
        ax.text(total, y, f" {total:.3g} s", va="center", fontsize=8)
    ax.set_yticks(ys, list(labels), fontsize=8)
    ax.invert_yaxis()
    ax.set_xlabel("seconds per step (predicted)")
    ax.set_xlim(0, 1.2 * max(left) if max(left) > 0 else 1)
    ax.set_title(title, fontsize=10)
    ax.legend(fontsize=7, ncol=5, loc="upper center", bbox_to_anchor=(0.5, -0.22), frameon=False)
    return fig


def plot_validation(rows: Sequence[Mapping[str, Any]], *, tolerance: float = 0.20,
                    title: str = "Time model vs measured step, this 2-core CPU (gloo, fp32)") -> plt.Figure:
    """Measured and predicted step time (ms) per configuration of :func:`lslm.plan.validate`'s ``rows``, one
    panel per bench, and below them the relative error with the ``tolerance`` band."""
    if not rows:
        raise ValueError("no rows to plot: pass lslm.plan.validate()'s output")
    benches = list(dict.fromkeys(r["bench"] for r in rows))
    widths = [sum(r["bench"] == b for r in rows) for b in benches]
    fig, axes = plt.subplots(2, len(benches), figsize=(4 + 0.45 * len(rows), 6.5), dpi=80, squeeze=False,
                             gridspec_kw={"width_ratios": widths, "height_ratios": [3, 1.3]})
    for col, bench in enumerate(benches):
        mine = [r for r in rows if r["bench"] == bench]
        xs = list(range(len(mine)))
        top, low = axes[0][col], axes[1][col]
        top.bar([x - 0.2 for x in xs], [r["measured_ms"] for r in mine], 0.4, label="measured", color="#457b9d")
        top.bar([x + 0.2 for x in xs], [r["predicted_ms"] for r in mine], 0.4, label="predicted (cpu-box)",
                color="#f4a261")
        top.set_title(f"{bench}", fontsize=10)
        top.set_xticks(xs, [])
        errors = [100 * r["error"] for r in mine]
        low.bar(xs, errors, 0.6, color=["#2a9d8f" if abs(e) <= 100 * tolerance else "#e63946" for e in errors])
        low.axhspan(-100 * tolerance, 100 * tolerance, color="#e9ecef", zorder=0)
        low.axhline(0, color="black", lw=0.5)
        low.set_xticks(xs, [r["config"] for r in mine], rotation=90, fontsize=7)
        low.set_xlabel("configuration", fontsize=8)
        low.set_ylim(min(-100 * tolerance, *errors) - 5, max(100 * tolerance, *errors) + 5)
        if col == 0:
            top.set_ylabel("step time (ms)")
            low.set_ylabel("error (%)")
            top.legend(fontsize=8, loc="upper left")
    worst = max(rows, key=lambda r: abs(r["error"]))
    fig.suptitle(f"{title}; worst error {worst['error']:+.0%} ({worst['bench']} {worst['config']}); "
                 f"band: ±{tolerance:.0%}", fontsize=10)
    fig.tight_layout()
    return fig


class CalculatorWidget:
    """The calculator's widget (``.widget``, an ipywidgets ``VBox``) and its state, readable from Python.

    ``controls``: every control by name (model: ``model``, ``n_layer``, ``hidden``, ``n_head``, ``n_kv_head``,
    ``seq_len``, ``micro_batch``, ``global_batch``; layout: ``dp``, ``tp``, ``pp``, ``v``, ``cp``, ``zero``,
    ``offload``, ``sequence_parallel``, ``recompute``, ``precision``, ``flash_attention``; ``hardware``).
    After each change: ``estimate`` (None when invalid), ``bar_data`` (bytes by owner of the most loaded
    device; empty when invalid), ``error`` (the ValueError's message or ``""``), ``readout`` (an HTML widget
    whose text names the per-device total).
    """

    def __init__(self, model: str = "llama3-8b", hardware: str = "h100-sxm", layout: Layout | None = None,
                 extra_models: Mapping[str, ModelSpec] | None = None) -> None:
        import ipywidgets as w

        self.models = {**(extra_models or {}), **model_presets()}
        self.hardwares = hardware_presets()
        if model not in self.models:
            raise ValueError(f"unknown model {model!r}; choose one of {sorted(self.models)}")
        if hardware not in self.hardwares:
            raise ValueError(f"unknown hardware {hardware!r}; choose one of {sorted(self.hardwares)}")
        layout = layout or Layout()
        self.estimate: Estimate | None = None
        self.bar_data: dict[str, float] = {}
        self.error = ""
        self._quiet = False
        style = {"description_width": "110px"}
        lay = w.Layout(width="250px")

        def num(name: str, lo: int, hi: int) -> Any:
            return w.BoundedIntText(value=lo, min=lo, max=hi, description=name, style=style, layout=lay)

        def choice(name: str, options: Sequence[Any], value: Any) -> Any:
            return w.Dropdown(options=list(options), value=value, description=name, style=style, layout=lay)

        c: dict[str, Any] = {
            "model": choice("model preset", list(self.models), model),
            "n_layer": w.IntSlider(value=1, min=1, max=128, description="layers L", style=style, layout=lay,
                                   continuous_update=False),
            "hidden": num("hidden h", 1, 65536), "n_head": num("heads a", 1, 256),
            "n_kv_head": num("KV heads", 1, 256), "seq_len": num("sequence s", 1, 1 << 20),
            "micro_batch": num("micro-batch b", 1, 4096), "global_batch": num("global batch", 1, 1 << 20),
            "dp": choice("dp", POWERS, layout.dp), "tp": choice("tp", POWERS[:8], layout.tp),
            "pp": choice("pp", POWERS[:8], layout.pp), "v": choice("v (interleave)", (1, 2, 3, 4, 6, 8), layout.v),
            "cp": choice("cp", POWERS[:6], layout.cp), "zero": choice("ZeRO stage", (0, 1, 2, 3), layout.zero),
            "offload": choice("offload", ("none", "cpu", "disk"), layout.offload),
            "sequence_parallel": w.Checkbox(value=layout.sequence_parallel, description="sequence parallel"),
            "recompute": choice("recompute", ("none", "selective", "full"), layout.recompute),
            "precision": choice("precision", ("bf16", "fp16", "fp32"), layout.precision),
            "flash_attention": w.Checkbox(value=layout.flash_attention, description="flash attention"),
            "hardware": choice("hardware", list(self.hardwares), hardware),
        }
        self.controls = c
        self._load_model(model)
        self.readout = w.HTML()
        self.readout.add_class("lslm-plan-readout")  # the browser test reads the total here
        self.verdicts = w.HTML()
        self.message = w.HTML()
        self.plot = w.Output()
        model_box = w.VBox([c[k] for k in ("model", "n_layer", "hidden", "n_head", "n_kv_head", "seq_len",
                                           "micro_batch", "global_batch")])
        layout_box = w.VBox([c[k] for k in ("dp", "tp", "pp", "v", "cp", "zero", "offload", "recompute",
                                            "precision", "sequence_parallel", "flash_attention")])
        self.widget = w.VBox([w.HBox([model_box, layout_box, w.VBox([c["hardware"]])]), self.readout,
                              self.message, self.plot, self.verdicts])
        self.widget.add_class("lslm-plan-calculator")
        c["model"].observe(self._on_model, names="value")
        for name, control in c.items():
            if name != "model":
                control.observe(self._on_change, names="value")
        self.update()

    def _repr_mimebundle_(self, **kwargs: Any) -> Any:
        """Display as the widget itself (a cell ending in this object shows the calculator)."""
        return self.widget._repr_mimebundle_(**kwargs)

    def _load_model(self, name: str) -> None:
        spec = self.models[name]
        self._quiet = True
        try:
            for key, value in (("n_layer", spec.n_layer), ("hidden", spec.hidden), ("n_head", spec.n_head),
                               ("n_kv_head", spec.kv_heads), ("seq_len", spec.seq_len),
                               ("micro_batch", spec.micro_batch), ("global_batch", spec.global_batch)):
                self.controls[key].value = value
        finally:
            self._quiet = False

    def _on_model(self, change: dict[str, Any]) -> None:
        self._load_model(change["new"])
        self.update()

    def _on_change(self, change: dict[str, Any]) -> None:
        if not self._quiet:
            self.update()

    def current(self) -> tuple[ModelSpec, Layout, Any]:
        """The model, layout and hardware the controls describe (``ValueError`` if they cannot exist)."""
        c = {k: ctl.value for k, ctl in self.controls.items()}
        base = self.models[c["model"]]
        hidden = c["hidden"]
        # A GPT's MLP is 4h wide whatever h is; a Llama's width is its own (kept from the preset).
        model = replace(base, n_layer=c["n_layer"], hidden=hidden, n_head=c["n_head"], n_kv_head=c["n_kv_head"],
                        seq_len=c["seq_len"], micro_batch=c["micro_batch"], global_batch=c["global_batch"],
                        max_positions=None if base.arch == "gpt" else base.max_positions,
                        ffn_hidden=base.ffn_hidden if base.arch == "llama" else None)
        layout = Layout(dp=c["dp"], tp=c["tp"], pp=c["pp"], v=c["v"], cp=c["cp"], zero=c["zero"],
                        offload=c["offload"], sequence_parallel=c["sequence_parallel"], recompute=c["recompute"],
                        precision=c["precision"], flash_attention=c["flash_attention"])
        return model, layout, self.hardwares[c["hardware"]]

    def update(self) -> None:
        """Recompute the estimate from the controls and redraw (called on every change)."""
        try:
            model, layout, hw = self.current()
            est = estimate(model, layout, hw)
            est.step_s  # noqa: B018 (the time model may refuse hardware without a compute rate)
        except ValueError as exc:
            self.estimate, self.bar_data, self.error = None, {}, str(exc)
            self.message.value = (f'<div style="color:#b00020"><b>This layout cannot run:</b> '
                                  f"{html.escape(self.error)}</div>")
            self.readout.value = "<b>per device: n/a</b>"
            self.verdicts.value = ""
            self.plot.clear_output()
            return
        self.estimate, self.bar_data, self.error = est, memory_bars(est), ""
        self.message.value = ""
        verdict = "fits" if est.fits else "does NOT fit"
        self.readout.value = (f"<b>per device: {est.peak_bytes / GB:.2f} GB</b> of "
                              f"{hw.usable_bytes / GB:.1f} GB usable ({verdict}); {layout.world} devices, "
                              f"{est.microbatches} micro-batches, step {est.step_s:.3g} s, MFU {est.mfu:.1%}")
        rows = "".join(f"<li>{v.axis}: {'<b>communication-bound</b>' if v.comm_bound else 'compute-bound'} "
                       f"(comm / compute = {v.ratio:.3f} {html.escape(v.scope)})</li>" for v in est.verdicts)
        self.verdicts.value = f"<ul>{rows}</ul>" if rows else "<i>one device: no communication</i>"
        self._draw(est)

    def _draw(self, est: Estimate) -> None:
        from IPython.display import display

        fig, (left, right) = plt.subplots(1, 2, figsize=(11, 3.6), dpi=72, width_ratios=(1, 2))
        plot_memory_by_owner([est], ["most loaded device"], title="memory per device by owner", ax=left)
        plot_time_breakdown([est], [est.layout.describe().split(",")[0]], title="time per step", ax=right)
        fig.tight_layout()
        with self.plot:
            self.plot.clear_output(wait=True)
            display(fig)
        plt.close(fig)


def plan_calculator(model: str = "llama3-8b", hardware: str = "h100-sxm", layout: Layout | None = None,
                    extra_models: Mapping[str, ModelSpec] | None = None) -> CalculatorWidget:
    """The calculator widget (:class:`CalculatorWidget`) started on ``model`` (a key of
    :func:`lslm.plan.model_presets` or of ``extra_models``), ``hardware`` (a key of
    :func:`lslm.plan.hardware_presets`) and ``layout``. A cell ending in the returned object shows it."""
    return CalculatorWidget(model, hardware, layout, extra_models)
