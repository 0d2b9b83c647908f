"""``estimate(model, layout, hardware) -> Estimate``: memory, communication and time of one layout, traced.

The entry point of :mod:`lslm.plan`. It checks the layout (:func:`lslm.plan.layout.check_layout`), then asks
each module for its part: parameter counts (:mod:`.params`), memory by owner on the first and last pipeline
stages (:mod:`.memory`, :mod:`.states`, :mod:`.activations`), communication per axis (:mod:`.comm`) and time
(:mod:`.timing`). Every number in :meth:`Estimate.table` carries its formula and source.

Limits, in one place: dense decoder-only transformers; Adam's states; 1F1B / interleaved 1F1B; ring collectives
with one alpha-beta cost per link kind, or per algorithm where the link has its own fits (no hierarchical or
tree algorithms, no congestion between concurrent groups); no overlap of tensor-parallel or pipeline
communication (the context-parallel ring's overlap with attention is modelled); the optimizer step's time only
where the hardware gives a streaming rate (the ``cpu-box`` does) or a GPU calibration (the GPU presets:
:mod:`.calibrated` prices their half-precision compute operation by operation at measured efficiencies);
memory fragmentation is ``Hardware.reserved_bytes``, not modelled. Mixed precision is Megatron's half weights
with fp32 masters, or ``torch.autocast`` over fp32 weights (``Layout.mixed``, :mod:`.autocast`).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from lslm.plan.comm import AxisComm, communication
from lslm.plan.hardware import Hardware, Link
from lslm.plan.layout import Layout, check_layout, microbatches
from lslm.plan.memory import StageMemory, most_loaded
from lslm.plan.model import ModelSpec
from lslm.plan.params import param_parts, playbook_params
from lslm.plan.terms import Term, format_bytes_gb
from lslm.plan.timing import Verdict, model_flops, step_time

__all__ = ["Estimate", "estimate"]


def _adapters(link: Link) -> str:
    """Why an inter-node ring runs faster than one adapter (:meth:`Hardware.link`), or nothing."""
    return "" if link.adapters == 1 else f" ({link.adapters} network adapters, a ring through each)"


@dataclass(frozen=True)
class Estimate:
    """What one layout costs (module doc). ``memory`` is the most loaded device; ``stages`` the first and last."""

    model: ModelSpec
    layout: Layout
    hardware: Hardware
    microbatches: int
    params: dict[str, Term]
    memory: StageMemory
    stages: list[StageMemory]
    comm: dict[str, AxisComm]
    times: dict[str, Term]
    verdicts: list[Verdict]
    notes: list[str] = field(default_factory=list)

    @property
    def peak_bytes(self) -> float:
        """Bytes the most loaded device needs."""
        return self.memory.total

    @property
    def fits(self) -> bool:
        """Whether the most loaded device fits in ``hardware.usable_bytes``."""
        return self.peak_bytes <= self.hardware.usable_bytes

    @property
    def step_s(self) -> float:
        """Predicted seconds per step."""
        return self.times["step"].value

    @property
    def mfu(self) -> float:
        """Model flops (no recompute) per second over the devices' peak: the fraction of peak the step reaches."""
        peak = self.hardware.peak_flops[self.layout.precision] * self.layout.world
        return model_flops(self.model) / self.step_s / peak

    def to_dict(self) -> dict[str, object]:
        """The headline numbers as plain JSON-able values (bytes, seconds), for plots and widgets."""
        return {"layout": self.layout.describe(), "microbatches": self.microbatches,
                "params": self.params["total (exact)"].value, "fits": self.fits, "peak_bytes": self.peak_bytes,
                "memory": {name: t.value for name, t in self.memory.owners.items()},
                "host_memory": {name: t.value for name, t in self.memory.states.host.items()},
                "activations_without_recompute": self.memory.activations_without_recompute.value,
                "comm_wire_bytes": {a: c.wire_bytes for a, c in self.comm.items()},
                "comm_s": {a: c.time_s for a, c in self.comm.items()},
                "times": {name: t.value for name, t in self.times.items()},
                "comm_bound": {v.axis: v.comm_bound for v in self.verdicts}, "mfu": self.mfu}

    def table(self) -> list[tuple[str, str, str, str]]:
        """Printable rows ``(section, item, value, formula / source)``: memory by owner, comm per axis, time."""
        rows: list[tuple[str, str, str, str]] = []
        for name, term in self.params.items():
            rows.append(("parameters", name, f"{term.value:,.0f}", f"{term.formula}  [{term.source}]"))
        mem = self.memory
        rows.append(("memory", f"most loaded: stage {mem.stage} of {self.layout.pp}",
                     f"{mem.params:,} params", "first/last stage: embedding / head"))
        for name, term in mem.owners.items():
            rows.append(("memory", name, term.formatted(), f"{term.formula}  [{term.source}]"))
        a0 = mem.activations_without_recompute
        rows.append(("memory", "(activations without recompute)", a0.formatted(), a0.formula))
        if not mem.grads_at_peak:
            rows.append(("memory", "(gradients created in backward)", format_bytes_gb(mem.states_before_forward),
                         "states before the forward: .grad set to None, created as activations are freed (autocast, "
                         "no accumulation); peak = max(these + activations, all states at the backward's end)"))
        for moment, value in mem.moments.items():
            rows.append(("memory", f"(activations at {moment})", format_bytes_gb(value),
                         "lslm.plan.autocast: the peak is the largest moment"))
        verdict = "fits" if self.fits else "does NOT fit"
        rows.append(("memory", "total", format_bytes_gb(mem.total),
                     f"{verdict} in {format_bytes_gb(self.hardware.usable_bytes)} usable"))
        for name, term in mem.states.host.items():
            rows.append(("host memory", name, term.formatted(), f"{term.formula}  [{term.source}]"))
        rows.append(("communication", f"per step, pipeline stage {self.layout.pp - 1}", "",
                     "the last stage: it also runs the head, so it sets the pipeline's pace"))
        for axis, ax in self.comm.items():
            if not ax.collectives:
                rows.append(("communication", axis, "none", "an axis of size 1"))
                continue
            name = "dp x cp" if axis == "dp" and self.layout.cp > 1 else axis
            rows.append(("communication", f"{name} (group {ax.group})", format_bytes_gb(ax.wire_bytes) + " sent",
                         f"{ax.time_s * 1e3:.3f} ms back to back; link {ax.link.bandwidth_Bps / 1e9:g} GB/s, "
                         f"alpha {ax.link.alpha_s * 1e6:g} µs" + _adapters(ax.link)))
            for c in ax.collectives:
                rows.append(("communication", f"  {c.label}", f"{c.count:g} x {format_bytes_gb(c.payload)}",
                             f"{c.algorithm} on {c.n}: {c.formula}"))
        for name, term in self.times.items():
            rows.append(("time", name, term.formatted(), f"{term.formula}  [{term.source}]"))
        calibrated = self.hardware.calibration is not None and self.layout.precision != "fp32"
        rows.append(("time", "MFU (model flops / peak)", f"{self.mfu:.1%}",
                     "flops without recompute over peak; " + (
                         f"each operation at {self.hardware.calibration.provenance()}"
                         if calibrated else f"compute assumed at {self.hardware.compute_efficiency:g} x peak")))
        for v in self.verdicts:
            state = "COMMUNICATION-BOUND" if v.comm_bound else "compute-bound"
            rows.append(("roofline", v.axis, state, f"comm/compute = {v.ratio:.3f} {v.scope}"))
        rows += [("note", "", "", n) for n in self.notes]
        return rows

    def format(self) -> str:
        """:meth:`table` as fixed-width text."""
        lines = [f"{self.model.name} on {self.layout.world} x {self.hardware.name}: {self.layout.describe()}; "
                 f"{self.microbatches} micro-batches of {self.model.micro_batch} x {self.model.seq_len} tokens"]
        section = None
        for sec, item, value, formula in self.table():
            if sec != section:
                lines.append(f"-- {sec}")
                section = sec
            lines.append(f"   {item:<40}{value:>18}   {formula}")
        return "\n".join(lines)


def estimate(model: ModelSpec, layout: Layout, hardware: Hardware, devices: int | None = None) -> Estimate:
    """Memory, communication and time of ``model`` laid out as ``layout`` on ``hardware`` (module doc).

    ``devices``: if given, the layout must use exactly that many (``dp · tp · pp · cp``).
    """
    check_layout(model, layout, devices)
    m = microbatches(model, layout)
    parts = param_parts(model)
    same_as = "lslm's GPT(cfg).parameters()" if model.arch == "gpt" else "Hugging Face's LlamaForCausalLM"
    params = {"total (exact)": Term("parameters", parts.total, "", "embedding + L x layer + final norm + head",
                                    f"lslm.plan.params (= {same_as})")}
    if model.arch == "gpt":
        params["Playbook N"] = Term("Playbook N", playbook_params(model.hidden, model.vocab, model.n_layer), "",
                                    "h·v + L(12h² + 13h) + 2h (tied head, no position embedding)",
                                    "Ultra-Scale Playbook")
    memory, stages = most_loaded(model, layout, m, mask_bytes=hardware.dropout_mask_bytes)
    comm = communication(model, layout, hardware, m, layout.pp - 1)
    times, verdicts = step_time(model, layout, hardware, m, comm)
    notes = []
    if layout.cp > 1:
        notes.append(f"cp = {layout.cp}: activations hold s/cp tokens per device (no s^2 scores: {layout.cp_method} "
                     f"attention); parameters are replicated over cp, gradients reduced over dp x cp = "
                     f"{layout.dp * layout.cp}")
    if layout.zero >= 2 and layout.pp > 1:
        notes.append("ZeRO-2/3 with pipeline parallelism: gradients (and stage 3's parameters) move every "
                     "micro-batch; DeepSpeed refuses this combination and Megatron shards only the optimizer "
                     "(stage 1)")
    if layout.offload != "none" and "offload" not in times:
        notes.append("offload: host transfers" + (" and disk reads and writes" if layout.offload == "disk" else "")
                     + " are not timed (the hardware has no rate for them)")
    return Estimate(model, layout, hardware, m, params, memory, stages, comm, times, verdicts, notes)
