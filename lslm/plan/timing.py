"""Time per step: compute at the device's rate, each axis's communication (alpha-beta), the pipeline bubble.

**Flops** (Narayanan et al. 2021, §5.1 and Appendix): one layer's forward on ``B`` sequences of ``s`` tokens is
``2 B s P_mm`` for its matrix multiplications (``P_mm = 12 h^2`` for GPT: ``24 B s h^2``) plus ``4 B s^2 h`` for
the attention scores and their product with the values (causal masking not discounted, as they count); the
head ``2 B s h V``; backward twice the forward. Summed: ``72 B s L h^2 (1 + s/(6h) + V/(12 h L))`` per step
(their equation without recomputation), ``96 B s L h^2 (1 + s/(6h) + V/(16 h L))`` with full recomputation
(a second forward of every layer). Selective recomputation repeats only the attention core (``4 B s^2 h``
per layer), also under flash attention, where it saves no bytes (:mod:`lslm.plan.activations`). Full
recomputation's ``4/3`` assumes the replay runs in the forward's precision (lslm's did not before it re-entered
autocast: its fp32 replay took the H200 step to 7.5-9.6x, ``bench/results/gpu/``). A device does
``1/(t · cp)`` of its stage's layers' work (and of the head, vocabulary-parallel).

**On calibrated hardware** (``hw.calibration``: the GPU presets) a micro-batch's half-precision compute is not
``flops / rate``: :mod:`lslm.plan.calibrated` prices each GEMM by its shape, the attention by its sequence and
head dimension, the elementwise work by the bytes it streams, each at a rate measured on an H200; the optimizer
step at the measured fused-AdamW rate. With uneven stages (``Layout.stage_layers``) the slowest stage's
micro-batch sets the pace.

**The step** of the most loaded stage, 1F1B or interleaved, ``m`` micro-batches, ``T_mb`` one micro-batch's
forward + backward (+ recompute) of the stage::

    compute = m · T_mb              bubble = (p - 1)/v · T_mb    (fraction (p - 1)/(v m), Narayanan §2.2)
    step    = compute + bubble + tp + pp + exposed cp + exposed dp

Tensor-parallel and pipeline communication is on the critical path (not overlapped: lslm's, and Megatron's
without its overlap options); with ``Layout.dp_overlap=False`` (Megatron-LM's ``local`` DDP of 2021) all
data-parallel communication follows the backward, exposed; otherwise data-parallel communication is
overlapped with the backward of the last micro-batch where it can be: stage 0's all-reduce and stage 1's
reduce-scatter start during that backward, stage 2's per-micro-batch reduce-scatters during each
micro-batch's backward, and the all-gather of stages 1-2 follows the optimizer step (exposed); stage 3's
per-micro-batch gathers and reduce-scatters
are prefetched behind that micro-batch's compute (exposed only beyond it). Offload's host copies and disk
traffic are timed only where the hardware gives their rates (below); the optimizer step itself is timed at the
device's ``optimizer_Bps`` wherever it runs. HSDP's all-reduce of the gradient slices across replicas runs in the
step, after the backward (exposed, as lslm does it).

**Terms a CPU box needs** (each zero, or off, on the GPU presets, whose hardware leaves them unset; the
course's ``cpu-box`` preset calibrates them, :mod:`lslm.plan.calibrate`):

* *fixed cost per layer pass* (``hw.layer_overhead_s``): a layer's forward and backward each take a fixed time
  on top of ``flops / rate`` (elementwise ops, softmax, layer norms, op dispatch: work that does not scale with
  the matmuls), and the head with the loss one more of each. On small widths it is a third of a layer's time.
* *core sharing* (``hw.cores``): ``world`` processes on ``cores`` cores time-slice, so a step takes at least
  the total compute over the cores, ``world/cores · m · T_mb`` (every stage's work counted as the last
  stage's, head included: slightly more than the first stages do); the term is what that adds to the schedule
  (``m T_mb + bubble``): all of it without a pipeline, only beyond the bubble with one.
* *no overlap without a spare core*: with ``world >= cores`` every core computes, so data-parallel
  communication is exposed whole.
* *the optimizer step* (``hw.optimizer_Bps``): the elements a device updates (``/dp`` under ZeRO, ``/dp_shard``
  under HSDP) times the bytes torch's single-tensor loop reads and writes per element
  (:data:`~lslm.plan.hardware.OPTIMIZER_BYTES`), over a streaming rate; times the core sharing.
* *offload copies* (``hw.host_copy_Bps``, ``hw.disk_Bps``; :func:`offload_bytes`): with ``offload`` each step
  copies the gradient slice a device owns to the host (fp32, the copy the host steps) and the updated
  parameter slice back; with ``"disk"`` the fp32 masters and Adam's moments of that slice (``4 + 8`` bytes
  per element) are also read from and written back to their files. Each at a per-process rate, on the
  critical path (lslm's offload is synchronous), times the core sharing.

**Roofline verdicts** (the reasoning of the JAX scaling book, "How to Scale Your Model": its rooflines chapter
and its chapter on parallelising a transformer for training): an axis is
*communication-bound* when its communication takes longer than the computation it could hide behind, so
that no overlap can save it: tensor parallelism per layer and micro-batch against that layer's compute;
pipeline sends per micro-batch against the stage's compute for it; data parallelism per step against the
step's backward (the most an ideal overlap could hide behind). ``ratio = T_comm / T_compute``.

**Context parallelism.** The ring overlaps each step's key/value transfer with the attention of the block in hand:
the verdict compares one forward step's send (``alpha + 2 u_kv beta``) with that block's attention, ``2 b (s/c)^2 h
/ t`` flops (causal, zig-zag: half of a full ``(s/c) x (s/c)`` block; the backward sends K/V and dK/dV against
twice the flops, the same ratio). With ``u_kv ∝ s/c`` and the flops ``∝ (s/c)^2`` the ratio falls as the tokens
per rank grow: the ring hides only above ``s/c ≈ e · rate · (kv/a) / bandwidth`` tokens. Exposed per layer and
micro-batch: ``(c - 1) max(0, T_kv - T_block)`` forward (per pass), ``(c - 1) max(0, 2T_kv - 2T_block) + T_kv``
backward (the accumulator's last hop home waits on nothing); on a CPU box without a spare core, all of it.
Ulysses' all-to-alls sit between the projections and attention, on the critical path: exposed whole, judged per
layer and micro-batch like tensor parallelism.
"""

from __future__ import annotations

from dataclasses import dataclass

from lslm.metrics.flops import training_flops
from lslm.plan.calibrated import microbatch_times, optimizer_bytes, optimizer_seconds
from lslm.plan.comm import AxisComm
from lslm.plan.hardware import OPTIMIZER_BYTES, Hardware
from lslm.plan.layout import Layout, layers_on_stage
from lslm.plan.memory import stage_params
from lslm.plan.model import ModelSpec
from lslm.plan.states import bytes_per_element
from lslm.plan.terms import Term

__all__ = ["Verdict", "core_share", "layer_forward_flops", "model_flops", "narayanan_flops", "offload_bytes",
           "offload_s", "optimizer_s", "ring_block_flops", "step_time"]

NARAYANAN = "Narayanan et al. 2021, §5.1"


def _matmul_params(model: ModelSpec) -> int:
    h, f = model.hidden, model.ffn
    if model.arch == "gpt":
        return 4 * h * h + 2 * h * f
    kv = model.kv_heads * model.head_dim
    return 2 * h * h + 2 * h * kv + 3 * h * f


def layer_forward_flops(model: ModelSpec, sequences: int = 1) -> tuple[float, float]:
    """(matrix multiplications, attention core) flops of one layer's forward on ``sequences`` sequences."""
    s = model.seq_len
    return 2 * sequences * s * _matmul_params(model), 4 * sequences * s * s * model.hidden


def model_flops(model: ModelSpec, recompute: str = "none", sequences: int | None = None) -> float:
    """Flops of one training step on ``sequences`` (default ``global_batch``) sequences (module doc)."""
    sequences = model.global_batch if sequences is None else sequences
    # lslm.metrics.flops' count, attention dense: the work an unfused attention computes before masking
    return training_flops(n_layer=model.n_layer, hidden=model.hidden, seq_len=model.seq_len,
                          layer_matmul_params=model.n_layer * _matmul_params(model),
                          head_params=model.hidden * model.vocab, tokens=sequences * model.seq_len, causal=False,
                          recompute=recompute).hardware


def narayanan_flops(model: ModelSpec, full_recompute: bool = False) -> float:
    """Narayanan et al. 2021's closed form for a GPT step (``72`` or ``96 B s L h^2 (...)``, module doc)."""
    B, s, L, h, V = model.global_batch, model.seq_len, model.n_layer, model.hidden, model.vocab
    if full_recompute:
        return 96 * B * s * L * h * h * (1 + s / (6 * h) + V / (16 * h * L))
    return 72 * B * s * L * h * h * (1 + s / (6 * h) + V / (12 * h * L))


@dataclass(frozen=True)
class Verdict:
    """Whether an axis is communication-bound: its time against the compute it could hide behind."""

    axis: str
    comm_s: float
    compute_s: float
    scope: str  #: what is compared, e.g. "per layer and micro-batch"

    @property
    def ratio(self) -> float:
        """``T_comm / T_compute`` (inf without compute)."""
        return self.comm_s / self.compute_s if self.compute_s > 0 else float("inf")

    @property
    def comm_bound(self) -> bool:
        """True when communication takes longer than the computation it could overlap."""
        return self.comm_s > self.compute_s


def _stage_microbatch_s(model: ModelSpec, layout: Layout, hw: Hardware,
                        stage: int | None = None) -> tuple[float, float, float]:
    """(forward+backward+recompute, backward, one layer's F+B+R) seconds of one micro-batch on one device of
    pipeline stage ``stage`` (default the last: its layers and the head), each pass with its fixed cost
    (``hw.layer_overhead_s``; the head and the loss count as one more layer's)."""
    stage = layout.pp - 1 if stage is None else stage
    head = stage == layout.pp - 1
    if hw.calibration is not None and layout.precision != "fp32":
        t = microbatch_times(model, layout, hw.calibration, layers_on_stage(model, layout, stage), head=head,
                             peak=hw.flops(layout.precision))
        return t.total, t.backward, t.layer
    rate = hw.flops(layout.precision)
    fwd_fixed, bwd_fixed = hw.layer_overhead_s
    shard = layout.tp * layout.cp
    mm, core = layer_forward_flops(model, model.micro_batch)
    extra = {"none": 0.0, "selective": core, "full": mm + core}[layout.recompute]
    fixed_extra = fwd_fixed if layout.recompute == "full" else 0.0
    layer = (3 * (mm + core) + extra) / shard / rate + fwd_fixed + bwd_fixed + fixed_extra
    layers = layers_on_stage(model, layout, stage)
    head = 2 * model.micro_batch * model.seq_len * model.hidden * model.vocab / shard if head else 0.0
    total = layers * layer + 3 * head / rate + fwd_fixed + bwd_fixed
    backward = layers * (2 * (mm + core) / shard / rate + bwd_fixed) + 2 * head / rate + bwd_fixed
    return total, backward, layer


def optimizer_s(model: ModelSpec, layout: Layout, hw: Hardware) -> float | None:
    """Seconds of one optimizer step on a device of the last stage: the elements it updates (its stage's
    parameters, ``/dp`` under ZeRO, ``/dp_shard`` under HSDP) x :data:`~lslm.plan.hardware.OPTIMIZER_BYTES`
    over ``hw.optimizer_Bps``; None when the hardware has no such rate."""
    elements = stage_params(model, layout, layout.pp - 1) / (layout.dp_shard_size * layout.cp if layout.zero else 1)
    if hw.calibration is not None:
        return optimizer_seconds(elements, layout, hw.calibration)
    if hw.optimizer_Bps is None:
        return None
    return elements * OPTIMIZER_BYTES[layout.optimizer] / hw.optimizer_Bps


def offload_bytes(model: ModelSpec, layout: Layout) -> tuple[float, float]:
    """(host copy, disk read + write) bytes per step of one device of the last stage with ``layout.offload``:
    its owned slice's fp32 gradients down and parameters up; with ``"disk"``, the slice's fp32 masters and
    optimizer states read and written once each (module doc). (0, 0) without offload."""
    if layout.offload == "none":
        return 0.0, 0.0
    width = bytes_per_element(layout)
    owned = stage_params(model, layout, layout.pp - 1) / (layout.dp_shard_size * layout.cp)
    host = owned * (4 + width["parameters"])
    disk = 2 * owned * (4 + width["optimizer_states"]) if layout.offload == "disk" else 0.0
    return host, disk


def offload_s(model: ModelSpec, layout: Layout, hw: Hardware) -> float | None:
    """Seconds of one step's offload copies on one process (:func:`offload_bytes` over ``hw.host_copy_Bps`` and
    ``hw.disk_Bps``), before core sharing; None without offload or where the hardware lacks a rate it needs."""
    host, disk = offload_bytes(model, layout)
    if layout.offload == "none" or hw.host_copy_Bps is None or (disk and hw.disk_Bps is None):
        return None
    return host / hw.host_copy_Bps + (disk / hw.disk_Bps if disk else 0.0)


def core_share(layout: Layout, hw: Hardware) -> float:
    """How many processes share one core: ``max(1, world / hw.cores)`` (1 without ``hw.cores``)."""
    return max(1.0, layout.world / hw.cores) if hw.cores else 1.0


def step_time(model: ModelSpec, layout: Layout, hw: Hardware, m: int,
              comm: dict[str, AxisComm]) -> tuple[dict[str, Term], list[Verdict]]:
    """Time terms of one step on the most loaded stage, and a verdict per axis (module doc)."""
    # The last stage has the head on top of the same layers: it sets the pace of the pipeline; with uneven
    # stages (Layout.stage_layers) the slowest stage does.
    t_mb, t_bwd, t_layer = _stage_microbatch_s(model, layout, hw)
    if layout.stage_layers is not None:
        t_mb, t_bwd, t_layer = max([(t_mb, t_bwd, t_layer)] + [_stage_microbatch_s(model, layout, hw, s)
                                                               for s in range(layout.pp - 1)])
    p, v = layout.pp, layout.v
    compute = m * t_mb
    bubble = (p - 1) / v * t_mb
    fixed = hw.layer_overhead_s
    what = "m · T_mb (each GEMM, attention and elementwise pass at its measured rate: lslm.plan.calibrated)" \
        if hw.calibration is not None and layout.precision != "fp32" else \
        "m · T_mb (6N-style flops + attention, at peak x efficiency" + (
        f"; + {fixed[0] * 1e3:.3g} / {fixed[1] * 1e3:.3g} ms per layer forward / backward)" if any(fixed) else ")")
    times = {"compute": Term("compute", compute, "s", what, NARAYANAN),
             "bubble": Term("pipeline bubble", bubble, "s", f"(p - 1)/v · T_mb = {(p - 1) / (v * m):.4f} of compute",
                            "Narayanan et al. 2021, §2.2 (1F1B, interleaved)")}
    share = core_share(layout, hw)
    if share > 1:  # every rank's compute queues for hw.cores cores: a step cannot beat the total work / cores
        shared = max(0.0, share * compute - compute - bubble)
        times["cores"] = Term("core sharing", shared, "s",
                              f"max(0, world/cores · m · T_mb - m · T_mb - bubble), world/cores = {share:g}",
                              "this module (processes time-slice the cores they share)")
    no_overlap = hw.cores is not None and layout.world >= hw.cores  # no free core runs communication meanwhile
    verdicts = []
    tp, pp, dp = comm["tp"], comm["pp"], comm["dp"]
    layers = layers_on_stage(model, layout, p - 1)
    if tp is not None and tp.group > 1:
        times["tp"] = Term("tensor-parallel communication", tp.time_s, "s", "alpha-beta, not overlapped",
                           "Shoeybi et al. 2019; Korthikanti et al. 2022")
        per_layer = sum(c.time_s for c in tp.collectives if c.label.startswith("layer")) / (layers * m)
        verdicts.append(Verdict("tp", per_layer, t_layer, "per layer and micro-batch"))
    if pp is not None and pp.group > 1:
        times["pp"] = Term("pipeline communication", pp.time_s, "s", "alpha-beta per send, not overlapped",
                           "Narayanan et al. 2021")
        verdicts.append(Verdict("pp", pp.time_s / m, t_mb, "per micro-batch"))
    cp = comm["cp"]
    if cp.group > 1:
        exposed_cp, verdict = _cp_exposed(model, layout, hw, m, cp, t_layer)
        how = ("ring: per step max(0, K/V send - block attention)" if layout.cp_method == "ring"
               else "Ulysses: all-to-alls, not overlapped")
        if no_overlap:
            exposed_cp, how = cp.time_s, "all of it: every core computes, none is left to overlap the ring"
        times["cp"] = Term("context-parallel communication (exposed)", exposed_cp, "s",
                           f"{how}; {cp.time_s:.3g} s in all", "Liu et al. 2023 (ring); Jacobs et al. 2023 (Ulysses)")
        verdicts.append(verdict)
    if dp is not None and dp.group > 1:
        # HSDP: the all-reduce of the slices across replicas runs once, in the step, after the backward (exposed).
        across = sum(c.time_s for c in dp.collectives if c.axis == "dp_replicate")
        inside = dp.time_s - across
        if no_overlap or not layout.dp_overlap:
            exposed = inside
            how = ("all of it: every core computes, none is left to overlap communication" if no_overlap else
                   "all of it: the reduction starts after the backward (Layout.dp_overlap=False)")
            verdicts.append(Verdict("dp", inside, m * t_bwd, "per step, against the step's backward"))
        elif layout.zero == 3:
            per_mb = inside / m  # everything moves every micro-batch, prefetched behind its compute
            exposed = m * max(0.0, per_mb - t_mb)
            how = "m · max(0, per-micro-batch gathers and reduce-scatters - T_mb)"
            verdicts.append(Verdict("dp", per_mb, t_mb, "per micro-batch (prefetched behind its compute)"))
        else:
            reduce = sum(c.time_s for c in dp.collectives if "gather" not in c.label and c.axis != "dp_replicate")
            gather = inside - reduce
            if layout.zero == 2:  # each micro-batch's reduce-scatter hides behind that micro-batch's backward
                exposed = m * max(0.0, reduce / m - t_bwd) + gather
                how = "m · max(0, reduce-scatter - its backward) + all-gather"
            else:  # one reduction per step, behind the last micro-batch's backward
                exposed = max(0.0, reduce - t_bwd) + gather
                how = "max(0, reduction - last backward)" + (" + all-gather" if gather else "")
            verdicts.append(Verdict("dp", inside, m * t_bwd, "per step, against the step's backward"))
        if across:
            exposed += across
            how += " + the all-reduce across replicas (HSDP)"
        times["dp"] = Term("data-parallel communication (exposed)", exposed, "s",
                           f"{how}; {dp.time_s:.3g} s in all", "Rajbhandari et al. 2020; Li et al. 2020 §3.2.3")
    opt = optimizer_s(model, layout, hw)
    if opt is not None:
        if hw.calibration is not None:
            times["optimizer"] = Term("optimizer step", opt, "s",
                                      f"elements x {optimizer_bytes(layout)} B (fused {layout.optimizer}) at the "
                                      "measured AdamW rate", "lslm.plan.calibrated")
        else:
            times["optimizer"] = Term("optimizer step", share * opt, "s",
                                      f"elements x {OPTIMIZER_BYTES[layout.optimizer]} B ({layout.optimizer}) / "
                                      f"{hw.optimizer_Bps / 1e9:.3g} GB/s" + (f" x {share:g} (core sharing)"
                                                                              if share > 1 else ""),
                                      "torch's single-tensor optimizer loop, bytes counted per element")
    off = offload_s(model, layout, hw)
    if off is not None:
        host, disk = offload_bytes(model, layout)
        what = f"{host / 1e6:.4g} MB host copies / {hw.host_copy_Bps / 1e9:.3g} GB/s"
        if disk:
            what += f" + {disk / 1e6:.4g} MB disk reads and writes / {hw.disk_Bps / 1e9:.3g} GB/s"
        times["offload"] = Term("offload copies", share * off, "s",
                                what + (f" x {share:g} (core sharing)" if share > 1 else ""),
                                "Ren et al. 2021 (ZeRO-Offload); lslm.zero's offload, bytes counted per element")
    times["step"] = Term("step", sum(t.value for t in times.values()), "s",
                         "compute + bubble + core sharing + tp + pp + exposed cp + exposed dp + optimizer + offload",
                         "this module")
    return times, verdicts


def ring_block_flops(model: ModelSpec, layout: Layout) -> float:
    """Forward flops of one ring step's attention on one device: a causal zig-zag block, ``2 b (s/c)^2 h / t``
    (half of the ``4 b (s/c)^2 h / t`` of a full block: two of its four chunk pairs; module doc)."""
    s = model.seq_len // layout.cp
    return 2 * model.micro_batch * s * s * model.hidden / layout.tp


def _cp_exposed(model: ModelSpec, layout: Layout, hw: Hardware, m: int, cp: AxisComm,
                t_layer: float) -> tuple[float, Verdict]:
    """Exposed context-parallel seconds per step and the cp verdict (module doc)."""
    n = layers_on_stage(model, layout, layout.pp - 1) * m
    if layout.cp_method == "ulysses":
        return cp.time_s, Verdict("cp", cp.time_s / n, t_layer,
                                  "per layer and micro-batch (Ulysses' all-to-alls, not overlapped)")
    c, passes = layout.cp, 1 if layout.recompute == "none" else 2
    kv = cp.collectives[0]
    t_kv = kv.time_s / kv.count
    t_block = ring_block_flops(model, layout) / hw.flops(layout.precision)
    per_layer = (passes * (c - 1) * max(0.0, t_kv - t_block) + (c - 1) * max(0.0, 2 * t_kv - 2 * t_block) + t_kv)
    return n * per_layer, Verdict("cp", t_kv, t_block, "per ring step: K/V block send vs the causal block's "
                                                       "attention (zig-zag)")
