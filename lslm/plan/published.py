"""The calibrated time model against published multi-GPU training runs: step time and the fits verdict per row.

Each :data:`PUBLISHED` row is one configuration a paper trained (or benchmarked end to end) and reported a
throughput for: the table and row it comes from, the hardware (A100 80 GB or H100 80 GB: the ``a100-80gb`` and
``h100-sxm`` presets, whose efficiencies are the H200's measured ones scaled by peak and bandwidth, never fitted to
these rows), the model and layout, and what we had to assume (the paper does not say it) or cannot model. The
paper's throughput is turned into seconds per step with the paper's own flop count:

* **Narayanan et al. 2021, Table 1** (weak scaling on Selene, A100 80 GB; GPT, sequence 2,048, vocabulary 51,200;
  "achieved teraFLOP/s per GPU" counted with the ``96 B s l h^2 (1 + s/6h + V/16lh)`` flops of full
  recomputation, their eq. 3): step = that count / (GPUs x Tflop/s). This row and the next source ran
  Megatron-LM, whose loss works in place on the fp32 logits (``ModelSpec.loss="megatron"``, 6 bytes per logit at
  its peak; :mod:`lslm.plan.activations`).
* **Korthikanti et al. 2022, Table 3** (configurations) **and Table 5** (model flops utilization with sequence
  parallelism and selective recomputation, data-parallel size 1, A100 80 GB, 312 Tflop/s; the MFU figures also in
  Megatron-LM's README): step = ``72 B s l h^2 (1 + s/6h + V/12lh)`` / (GPUs x 312e12 x MFU).
* **Llama 3 (Grattafiori et al. 2024), Table 4** (405B pre-training on H100 80 GB: TP, CP, PP, DP, sequence, batch
  per DP rank, Tflop/s per GPU, bf16 MFU): step = :func:`lslm.plan.timing.model_flops` (``6N`` + ``4 b s^2 h`` per
  layer forward, non-causal) / (GPUs x Tflop/s): the paper does not give its flop count, so the attention part
  (8 % of the flops at 8K) is uncertain by about that much.
* **torchtitan's benchmarks** (FSDP2, :data:`TORCHTITAN`): ``docs/performance.md`` (Llama 3 8B and 70B, Llama 2 13B
  and 70B on 64 A100, tokens/s per GPU; every row but the "selective layer" ones, a policy not modelled; the file does
  not state the cluster's network: the ``a100-80gb`` preset's one 200 Gb/s adapter per GPU, eight per node, is priced,
  and each row again at 400 Gb/s per GPU; FSDP's collectives over the 64 GPUs run through all eight adapters of a node
  at once, :meth:`lslm.plan.hardware.Hardware.link`) and ``benchmarks/llama3_h100_202412_torchtitan.md`` Tables 1 and
  3 (Llama 3.1 8B on 8 and 128 H100 96 GB HBM2e at 500 W, the eager ``FSDP`` rows, tokens/s per GPU, with the peak
  memory they report): step = local batch x sequence (8,192 for Llama 3, 4,096 for Llama 2) tokens / tokens/s per GPU;
  their op-level selective checkpointing is the calculator's ``recompute="op"`` (:mod:`lslm.plan.op_sac`), their loss
  ``ModelSpec.loss="torchtitan"`` (the logits deleted before the backward; :mod:`lslm.plan.activations`), and the
  predicted peak (tensor bytes) is printed beside the reported one (the allocator's reserved maximum) and, in
  ``--validate``, beside the prediction times the reserved / allocated range measured on the H200 runs
  (:func:`lslm.plan.validate_memory.reserved_ratio_range`). The H100 file says its GPUs' peak is unknown ("between SXM
  and NVL") and states no rate, so the calculator prices the SXM's and again the NVL's (:attr:`PublishedRun.what_if`):
  with torchtitan's eager block counted op by op (``ModelSpec.kernels="torchtitan"``, :mod:`lslm.plan.calibrated`)
  both rows are within the target at either end. No torchtitan file read here reports a standard H100 SXM (80 GB) run:
  the 2025 async-TP benchmark uses the same 96 GB HBM2e 500 W GPUs (its numbers only in an image), the 2025 H200 rows
  run float8. Read in pytorch/torchtitan: ``docs/performance.md`` at 0413364 (the "Llama 3 performance numbers" table,
  rows "8B | 1 | selective op | 2973" and "70B | 1 | full | 331"; the "Llama 2 performance numbers" table, rows "13B |
  2 | no | 2162", "13B | 2 | selective op | 1904", "70B | 1 | selective op | 355", "70B | 2 | full | 353"),
  ``benchmarks/llama3_h100_202412_torchtitan.md`` at 31a17bf (Hardware; Tables 1 and 3, row "FSDP"; footnote 2), the
  sequence and checkpointing options from ``train_configs/llama3_8b.toml`` at 0011fb9 ("seq_len = 8192", "selective" /
  "op"), and the checkpointing policy from ``torchtitan/models/llama/parallelize_llama.py`` at 0596be3
  (:mod:`lslm.plan.op_sac`).

``error = predicted / published - 1`` on the step time (the throughput's error is ``1/(1 + error) - 1``).
:func:`validate_published` reports every row, met or not; ``fits`` must be True for each row (they trained). A row
may be marked outside the target (:attr:`PublishedRun.outside`), its reason printed beside it; none is now. No
constant is fitted to these rows: what changed a row's prediction is a fact about what it ran (Megatron-LM's 2021
data parallelism reducing after the backward; Megatron-LM's attention of 2021-22, unfused, its softmax and dropout
passing over every score; Llama 3's one-layer virtual stages; torchtitan's eager block, op by op, and its loss) or
about the machines (a ring collective spanning nodes runs one ring per network adapter of a node: priced at one
adapter's rate, Llama 2 70B at local batch 1 was +89.5 %).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from lslm.plan.estimate import estimate
from lslm.plan.gpu_calibration import H200_CALIBRATION
from lslm.plan.hardware import GiB, Hardware, hardware_presets
from lslm.plan.layout import Layout
from lslm.plan.model import ModelSpec, model_presets
from lslm.plan.timing import model_flops, narayanan_flops

__all__ = ["PUBLISHED", "PUBLISHED_TOLERANCE", "TORCHTITAN", "TORCHTITAN_H100", "PublishedRun", "format_published",
           "published_hardware", "validate_published"]

PUBLISHED_TOLERANCE = 0.25  #: the issue's target: step time within 25 % per row


@dataclass(frozen=True)
class PublishedRun:
    """One published training configuration and its reported throughput (module doc)."""

    source: str  #: paper, table, row
    hardware: str  #: a :func:`~lslm.plan.hardware.hardware_presets` key
    model: ModelSpec
    layout: Layout
    reported: str  #: what the paper reports, as printed
    published_step_s: float  #: seconds per step derived from it (module doc)
    assumptions: str  #: what the paper does not say and we assumed, or what the model leaves out
    outside: str = ""  #: non-empty: the row is outside the target, and why (printed beside it)
    measured_peak_bytes: float | None = None  #: the peak memory the source reports, where it does
    #: (label, :func:`published_hardware` key): the same row priced on hardware the source leaves open (an
    #: unstated peak or network), printed under it; never the row's own prediction
    what_if: tuple[tuple[str, str], ...] = ()


def _gpt(n_layer: int, hidden: int, heads: int, micro: int, batch: int, name: str) -> ModelSpec:
    # Megatron-LM's loss of 2021-22: in place on the fp32 copy of the logits (lslm.plan.activations, "The loss")
    return ModelSpec(n_layer, hidden, heads, 51200, 2048, micro_batch=micro, global_batch=batch, tied=True,
                     name=name, loss="megatron")


def _narayanan(n_layer: int, hidden: int, heads: int, t: int, p: int, gpus: int, batch: int, tflops: float,
               micro: int, name: str, extra: str = "") -> PublishedRun:
    model = _gpt(n_layer, hidden, heads, micro, batch, name)
    # Megatron-LM's data parallelism of 2021 (its default ``--DDP-impl local``) all-reduced the gradient buffer
    # in train_step after the forward-backward function returned: no overlap with the backward (dp_overlap=False).
    layout = Layout(dp=gpus // (t * p), tp=t, pp=p, recompute="full", precision="fp16", dp_overlap=False)
    step = narayanan_flops(model, full_recompute=True) / (gpus * tflops * 1e12)
    return PublishedRun(f"Narayanan 2021 Table 1, {name}", "a100-80gb", model, layout,
                        f"{tflops:g} Tflop/s per GPU", step,
                        f"micro-batch {micro} and 1F1B (v = 1) assumed (not in the table); full recomputation, fp16 "
                        "with fp32 masters, no ZeRO, unfused attention (Megatron-LM's fused scale-mask-softmax and "
                        "dropout over the whole s x s scores: lslm.plan.calibrated.unfused_attention_seconds); the "
                        "data-parallel all-reduce after the backward, not overlapped (Megatron-LM's local DDP of 2021: "
                        "train_step's allreduce_gradients() once the micro-batches are done)" + extra)


def _korthikanti(n_layer: int, hidden: int, heads: int, t: int, p: int, v: int, gpus: int, batch: int, micro: int,
                 mfu: float, name: str) -> PublishedRun:
    model = _gpt(n_layer, hidden, heads, micro, batch, name)
    layout = Layout(dp=gpus // (t * p), tp=t, pp=p, v=v, sequence_parallel=True, recompute="selective",
                    precision="bf16")
    step = narayanan_flops(model) / (gpus * 312e12 * mfu)
    return PublishedRun(f"Korthikanti 2022 Tables 3 + 5, {name}", "a100-80gb", model, layout, f"MFU {mfu:.1%}",
                        step, f"v = {v} from the paper's interleaving; SP + selective recomputation; no data "
                        "parallelism; unfused attention (its softmax and dropout over the s x s scores: "
                        "lslm.plan.calibrated.unfused_attention_seconds)")


LLAMA3_405B = ModelSpec(126, 16384, 128, 128256, 8192, micro_batch=1, global_batch=2048, n_kv_head=8,
                        ffn_hidden=53248, arch="llama", dropout=False, name="Llama 3 405B")


def _llama3(gpus: int, dp: int, per_dp: int, tflops: float, mfu: str, extra: str = "") -> PublishedRun:
    model = LLAMA3_405B.with_batch(micro_batch=1, global_batch=dp * per_dp)
    # v = 8: one layer per virtual stage. The paper (§3.3.2) takes one layer off the first and the last stage so
    # that "the first model chunk on the first stage has only the embedding" and the last chunk of the last stage
    # only the head and the loss: 126 layers + those two make 16 x 8 one-layer chunks. Its bubble,
    # (PP - 1)/(V M), is the interleaved formula lslm.plan.timing prices.
    layout = Layout(dp=dp, tp=8, pp=16, v=8, zero=1, sequence_parallel=True, flash_attention=True,
                    recompute="full", precision="bf16", stage_layers=(7,) + (8,) * 14 + (7,))
    step = model_flops(model) / (gpus * tflops * 1e12)
    return PublishedRun(f"Llama 3 Table 4, {gpus:,} GPUs, TP 8 CP 1 PP 16 DP {dp}", "h100-sxm", model, layout,
                        f"{tflops:g} Tflop/s per GPU (MFU {mfu})", step,
                        "126 layers on 16 stages, one fewer on the first and last, v = 8 one-layer chunks (the "
                        "first chunk holds only the embedding, the last only the head: paper §3.3.2), bubble "
                        "(PP - 1)/(V M); micro-batch 1 and ZeRO-1 assumed; full recomputation assumed although the "
                        "paper says it pre-trained at 8K without activation checkpointing (§3.3.2): without it "
                        "the calculator's in-flight activations (interleaved 1F1B, unfused SwiGLU) exceed 80 GB, "
                        "so the verdict would be wrong, and the replay it prices adds a third to the compute; flop "
                        "count assumed 6N + non-causal attention; the loss not stated: lslm's vocabulary-parallel "
                        "one counted (12 bytes per logit at its peak)" + extra)


TORCHTITAN_H100 = "h100-96gb-hbm2e"  #: the H100 of torchtitan's 2024 benchmarks (:func:`published_hardware`)
TORCHTITAN_H100_NVL_PEAK = "h100-96gb-hbm2e-at-nvl-peak"  #: the same at the lower bound its file gives
A100_400G = "a100-80gb-400g"  #: ``a100-80gb`` with 400 Gb/s per GPU between nodes
H100_NVL_BF16 = 1671e12 / 2  #: NVIDIA's H100 datasheet: NVL bf16 tensor core 1,671 Tflop/s with sparsity; dense half


def published_hardware() -> dict[str, Hardware]:
    """Presets for GPUs of published rows that :func:`~lslm.plan.hardware.hardware_presets` lacks:

    * ``h100-96gb-hbm2e``, the H100 of torchtitan's ``benchmarks/llama3_h100_202412_torchtitan.md`` ("96GB HBM2e
      with 2.4 TB/sec peak memory bandwidth", run at a 500 W power limit): ``h100-sxm`` with 96 GiB and the H200's
      streaming rates scaled by 2.4 / 4.8 TB/s. Its compute peak is the SXM's 989 Tflop/s, which that file says
      is above the real one ("between SXM and NVL, and we don't know its exact value").
    * ``h100-96gb-hbm2e-at-nvl-peak``: the same at the NVL's 835.5 Tflop/s, that range's other end (a what-if).
    * ``a100-80gb-400g``: ``a100-80gb`` with 50 GB/s (400 Gb/s) per GPU between nodes instead of 25 (a what-if
      for rows whose source does not state its network)."""
    presets = hardware_presets()
    h100, a100 = presets["h100-sxm"], presets["a100-80gb"]
    hbm2e = dataclasses.replace(h100, name="H100 96GB HBM2e (500 W)", hbm_bytes=96 * GiB,
                                calibration=H200_CALIBRATION.scaled("H100 HBM2e", h100.flops("bf16"), 2.4 / 4.8))
    nvl_peak = {**hbm2e.peak_flops, "bf16": H100_NVL_BF16, "fp16": H100_NVL_BF16}
    at_nvl = dataclasses.replace(hbm2e, name="H100 96GB HBM2e at the NVL's peak", peak_flops=nvl_peak,
                                 calibration=H200_CALIBRATION.scaled("H100 HBM2e at the NVL's peak", H100_NVL_BF16,
                                                                     2.4 / 4.8))
    a100_400g = dataclasses.replace(a100, name="A100 SXM 80GB, 400 Gb/s per GPU between nodes",
                                    inter=dataclasses.replace(a100.inter, bandwidth_Bps=50e9))
    return {TORCHTITAN_H100: hbm2e, TORCHTITAN_H100_NVL_PEAK: at_nvl, A100_400G: a100_400g}


_TT_OP_SAC = ("torchtitan's op-level selective checkpointing (train_configs/llama3_8b.toml: mode 'selective', "
              "option 'op') as the calculator's recompute='op' (lslm.plan.op_sac: the block input, the 1st, 3rd, "
              "5th and 7th matmuls' outputs and the attention's kept, the rest replayed)")


#: Llama 3 70B (Llama 3 paper, Table 3: 80 layers, width 8,192, FFN 28,672, 64 heads, 8 key/value heads)
LLAMA3_70B = ModelSpec(80, 8192, 64, 128256, 8192, n_kv_head=8, ffn_hidden=28672, arch="llama", dropout=False,
                       name="Llama 3 70B")
#: Llama 2 13B (Touvron et al. 2023 and its model card: 40 layers, width 5,120, 40 heads, FFN 13,824, context 4,096)
LLAMA2_13B = ModelSpec(40, 5120, 40, 32000, 4096, ffn_hidden=13824, arch="llama", dropout=False, name="Llama 2 13B")
_TT_RECOMPUTE = {"op": _TT_OP_SAC, "full": "full activation checkpointing (recompute='full')",
                 "none": "no activation checkpointing"}


def _torchtitan(source: str, hardware: str, gpus: int, local: int, tps: float, memory_gib: float | None = None,
                outside: str = "", model: ModelSpec | None = None, recompute: str = "op",
                what_if: tuple[tuple[str, str], ...] = (), notes: str = "") -> PublishedRun:
    """``model`` (default Llama 3(.1) 8B), FSDP2 over all ``gpus`` (ZeRO-3), bf16 compute over fp32 sharded
    parameters, gradients reduce-scattered in fp32 (torchtitan's default; counted as bf16 parameters + fp32
    masters + fp32 gradients, 18 bytes per parameter where FSDP2's fp32 shards hold 16: 2 bytes / dp more), flash
    attention, the model's sequence (8,192 for Llama 3, ``train_configs/llama3_8b.toml``; 4,096 for Llama 2),
    ``recompute`` (op-level selective by default); step = ``local x sequence`` tokens / TPS per GPU.
    ``memory_gib``: the peak the file reports (GiB), compared with the predicted peak."""
    # docs/performance.md does not state the cluster's network: the preset's (one 200 Gb/s adapter per GPU, eight
    # per node, as in NVIDIA's DGX A100), and again at 400 Gb/s
    if hardware == "a100-80gb" and not what_if:
        what_if = (("at 400 Gb/s per GPU between nodes (the preset: 200)", A100_400G),)
    base = model_presets()["llama3-8b"] if model is None else model
    model = dataclasses.replace(base.with_batch(micro_batch=local, global_batch=local * gpus), loss="torchtitan",
                                kernels="torchtitan")
    layout = Layout(dp=gpus, zero=3, flash_attention=True, recompute=recompute, precision="bf16")
    memory = f", {memory_gib:.1f} GiB" if memory_gib is not None else ""
    return PublishedRun(source, hardware, model, layout, f"{tps:,g} tokens/s per GPU" + memory,
                        local * model.seq_len / tps, f"local batch {local}, sequence {model.seq_len:,} (the "
                        f"config's), eager (ModelSpec.kernels='torchtitan'); " + _TT_RECOMPUTE[recompute]
                        + (f"; {notes}" if notes else ""), outside,
                        None if memory_gib is None else memory_gib * GiB, what_if)


_TT_H100 = ("the file's own facts (its Hardware section, footnote 2): H100s with 96 GB HBM2e at 2.4 TB/s (modelled) "
            "at the default 500 W power limit ('tuning it up to 700W TDP can potentially provide further "
            "speedups'), whose 'actual peak TFLOPs number is between SXM and NVL, and we don't know its exact "
            "value': priced at the SXM's 989 Tflop/s with the H200's measured efficiencies, and again at the "
            "NVL's 835.5 (the 'what if' line), the range's two ends; its MFU, 33 % eager against the SXM's peak, "
            "restates the TPS. The runs were eager (no torch.compile, no float8; 1D, so no async TP): torchtitan's "
            "block counted op by op (ModelSpec.kernels='torchtitan', lslm.plan.calibrated: RMSNorm in fp32, "
            "rotary embeddings as complex products, 3.4 times the fused count); the same table's torch.compile row "
            "is 16 % faster (6,667 TPS). The peak: torchtitan's loss is cross_entropy on an fp32 copy of the bf16 "
            "logits (pred.flatten(0, 1).float(), pred deleted before the backward), counted as "
            "ModelSpec.loss='torchtitan' (12 bytes per logit at the loss's backward, 23.5 GiB at local batch 2; "
            "lslm.plan.activations); the predicted peak is tensor bytes, the reported one the allocator's maximum "
            "reserved (max_reserved_gib), set beside the H200 runs' measured reserved / allocated range")


_TT_H100_NVL = ("at the NVL's 835.5 Tflop/s, the other end of the file's 'between SXM and NVL'",
                TORCHTITAN_H100_NVL_PEAK)
_TT_DOCS = "torchtitan performance.md, "

#: torchtitan's published benchmarks (the issue's "115-176 % too fast" and "does NOT fit" rows): every row of
#: docs/performance.md's Llama 3 and Llama 2 tables on 64 A100s but the "selective layer" ones (torchtitan's
#: every-second-block checkpointing, which the calculator does not model), and the eager FSDP rows of the 2024
#: H100 file (its other rows run torch.compile and float8, not modelled)
TORCHTITAN: tuple[PublishedRun, ...] = (
    _torchtitan(_TT_DOCS + "Llama 3 8B, 64 A100, op AC", "a100-80gb", 64, 1, 2973),
    _torchtitan(_TT_DOCS + "Llama 3 70B, 64 A100, full AC", "a100-80gb", 64, 1, 331, model=LLAMA3_70B,
                recompute="full"),
    _torchtitan(_TT_DOCS + "Llama 2 13B, 64 A100, no AC", "a100-80gb", 64, 2, 2162, model=LLAMA2_13B,
                recompute="none"),
    _torchtitan(_TT_DOCS + "Llama 2 13B, 64 A100, op AC", "a100-80gb", 64, 2, 1904, model=LLAMA2_13B),
    _torchtitan(_TT_DOCS + "Llama 2 70B, 64 A100, op AC", "a100-80gb", 64, 1, 355,
                model=model_presets()["llama2-70b"]),
    _torchtitan(_TT_DOCS + "Llama 2 70B, 64 A100, full AC", "a100-80gb", 64, 2, 353,
                model=model_presets()["llama2-70b"], recompute="full"),
    _torchtitan("torchtitan h100_202412 Table 1, 8B FSDP, 8 GPUs", TORCHTITAN_H100, 8, 2, 5762,
                82.4, what_if=(_TT_H100_NVL,), notes=_TT_H100),
    _torchtitan("torchtitan h100_202412 Table 3, 8B FSDP, 128 GPUs", TORCHTITAN_H100, 128, 2, 5605,
                67.0, what_if=(_TT_H100_NVL,), notes=_TT_H100),
)


#: The rows (module doc): Narayanan 2021 Table 1 (4 rows), Korthikanti 2022 (4), Llama 3 Table 4 (2), torchtitan (8).
PUBLISHED: tuple[PublishedRun, ...] = (
    _narayanan(24, 2304, 24, 1, 1, 32, 512, 137, 16, "1.7B"),
    _narayanan(40, 6144, 48, 8, 1, 256, 1024, 135, 8, "18.4B"),
    _narayanan(80, 12288, 96, 8, 8, 1536, 2304, 148, 1, "145.6B"),
    _narayanan(128, 25600, 160, 8, 64, 3072, 3072, 163, 1, "1008B"),
    _korthikanti(48, 6144, 64, 8, 1, 1, 8, 4, 4, 0.415, "22B"),
    _korthikanti(96, 12288, 96, 8, 8, 3, 64, 64, 1, 0.514, "175B"),
    _korthikanti(105, 20480, 128, 8, 35, 3, 280, 280, 1, 0.560, "530B"),
    _korthikanti(128, 25600, 160, 8, 64, 1, 512, 512, 1, 0.563, "1T"),
    _llama3(8192, 64, 32, 430, "43%"),
    _llama3(16384, 128, 16, 400, "41%"),
) + TORCHTITAN


def validate_published(runs: tuple[PublishedRun, ...] = PUBLISHED) -> list[dict[str, Any]]:
    """One row per run: ``source``, ``hardware``, ``layout``, ``published_s``, ``predicted_s``, ``error``
    (predicted / published - 1), ``fits`` (the calculator's verdict; each was trained, so True is right),
    ``peak_gb``, ``mfu`` (predicted), ``assumptions`` (module doc), ``measured_peak_gib`` and ``peak_error``
    (predicted / reported peak - 1; None where the source reports no peak), ``what_if`` (the row on each
    :attr:`PublishedRun.what_if` hardware: ``label``, ``hardware``, ``predicted_s``, ``error``, ``fits``)."""
    presets = {**hardware_presets(), **published_hardware()}
    out = []
    for r in runs:
        hw = presets[r.hardware]
        est = estimate(r.model, r.layout, hw, r.layout.world)
        what_if = []
        for label, key in r.what_if:
            alt = estimate(r.model, r.layout, presets[key], r.layout.world)
            what_if.append({"label": label, "hardware": presets[key].name, "predicted_s": alt.step_s,
                            "error": alt.step_s / r.published_step_s - 1, "fits": alt.fits})
        out.append({"what_if": what_if, "source": r.source, "hardware": hw.name, "layout": r.layout.describe(),
                    "reported": r.reported, "published_s": r.published_step_s, "predicted_s": est.step_s,
                    "error": est.step_s / r.published_step_s - 1, "fits": est.fits, "peak_gb": est.peak_bytes / 1e9,
                    "mfu": est.mfu, "assumptions": r.assumptions, "in_target": not r.outside,
                    "outside": r.outside, "measured_peak_gib": None if r.measured_peak_bytes is None else
                    r.measured_peak_bytes / GiB, "peak_error": None if r.measured_peak_bytes is None else
                    est.peak_bytes / r.measured_peak_bytes - 1})
    return out


def format_published(rows: list[dict[str, Any]], tolerance: float = PUBLISHED_TOLERANCE,
                     slack: tuple[float, float] | None = None) -> str:
    """The rows side by side (a row outside the target with its reason under it); the last line counts every row
    within ``tolerance`` (the outside ones included, so none is hidden) and the fits verdicts. ``slack``: the
    (least, most) ratio of the caching allocator's reserved bytes to its allocated peak measured elsewhere
    (:func:`lslm.plan.validate_memory.reserved_ratio_range`); where given, a reported peak (torchtitan's
    ``max_reserved_gib``) is set beside the predicted tensor bytes times that range, no constant fitted to it."""
    lines = [f"{'published run':<58}{'reported':>32}{'step s':>9}{'pred s':>9}{'error':>8}  fits  peak GB"]
    for r in rows:
        flag = " -" if not r["in_target"] else "" if abs(r["error"]) <= tolerance else " *"
        lines.append(f"{r['source']:<58}{r['reported']:>32}{r['published_s']:>9.3f}{r['predicted_s']:>9.3f}"
                     f"{r['error']:>+8.1%}{flag:2}  {'yes' if r['fits'] else 'NO ':<4}{r['peak_gb']:>8.1f}")
        if r["measured_peak_gib"] is not None:
            lines.append(f"    peak memory: predicted {r['peak_gb'] * 1e9 / GiB:.1f} GiB, reported "
                         f"{r['measured_peak_gib']:.1f} GiB ({r['peak_error']:+.1%}; predicted: tensor bytes, "
                         "reported: the allocator's reserved maximum)")
            if slack is not None:
                low, high = (r["peak_gb"] * 1e9 / GiB * k for k in slack)
                inside = "inside" if low <= r["measured_peak_gib"] <= high else "outside"
                lines.append(f"    with the H200 runs' reserved / allocated ratio ({slack[0]:.3f}-{slack[1]:.3f}): "
                             f"{low:.1f}-{high:.1f} GiB reserved, the reported {inside}")
        for w in r["what_if"]:
            lines.append(f"    what if, {w['label']}: {w['predicted_s']:.3f} s ({w['error']:+.1%})"
                         + ("" if w["fits"] else ", does NOT fit"))
        if not r["in_target"]:
            lines.append(f"    - outside the target: {r['outside']}")
    within = sum(abs(r["error"]) <= tolerance for r in rows)
    outside = len(rows) - sum(r["in_target"] for r in rows)
    lines.append(f"(* beyond {tolerance:.0%}) {within} of {len(rows)} published runs within {tolerance:.0%}"
                 + (f", {outside} outside the target for the reason under it (-)" if outside else "")
                 + f"; {sum(r['fits'] for r in rows)} of {len(rows)} fit (all were trained)")
    return "\n".join(lines)
