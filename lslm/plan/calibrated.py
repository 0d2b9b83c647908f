"""Compute time priced operation by operation at measured efficiencies, for hardware with a GPU calibration.

Where ``Hardware.calibration`` is set (the ``h200`` preset; ``h100-sxm`` and ``a100-80gb`` scale it),
:mod:`lslm.plan.timing` takes one micro-batch's time on a device from :func:`microbatch_times` instead of
``flops / (peak x compute_efficiency)``, and the optimizer step from :func:`optimizer_seconds`. Each operation at
its own rate (:mod:`lslm.plan.gpu_calibration`), per device (``t`` tensor-parallel, ``c`` context-parallel ranks;
``T = b s / c`` tokens of a micro-batch):

* **GEMMs** of a layer, each ``2 T n k`` flops forward and twice that backward (data and weight gradients, at the
  forward's efficiency), at the measured efficiency of its kind and shape: GPT ``qkv`` (``3h/t x h``), ``proj``
  (``h x h/t``), ``fc1`` (``f/t x h``), ``fc2`` (``h x f/t``); Llama the same with ``qkv`` of
  ``(h + 2 n_kv d)/t`` outputs and two ``fc1``-kind GEMMs (gate, up). The head (``V/t x h``) as ``fc1``.
* **Attention** as causal flash attention: ``3.5 x 2 b s^2 h / (t c)`` flops forward + backward at the measured
  efficiency for the sequence ``s/c`` and the head dimension. Without flash attention
  (``Layout.flash_attention = False``: Megatron-LM's attention of 2021-22) the core is two batched matmuls over
  the whole ``s x s`` square, ``4 b s^2 h / (t c)`` flops forward and twice that backward, priced at the same
  measured efficiency (an assumption: no unfused attention was measured), plus the passes over the
  ``b (a/t) (s/c) s`` scores at ``hbm_Bps`` (:func:`unfused_attention_seconds`): forward the fused
  scale-mask-softmax (read and write: ``2e`` bytes per score) and dropout (read, write, a 1-byte mask: ``2e + 1``),
  backward dropout's (``2e + 1``) and softmax's (``3e``); ``e`` = 2 in half precision, 4 in fp32 or under
  autocast (whose softmax outputs fp32). A GEMM's own reads and writes of the scores are inside its time.
* **Memory-bound elementwise work** at ``hbm_Bps``, bytes counted per token (:func:`elementwise_bytes`): per layer
  forward, with ``e = 2``: two norms (read + write their input width ``w``: ``2 w h`` each), two residual adds
  (``3 w h`` each), the activation (GELU: read and write ``f`` half elements, ``2 e f``; SwiGLU: read two, write
  one, ``3 e f``), the attention output's transpose copy (``2 e h``); under autocast (``w = 4``, the fp32 residual)
  also the two casts of the norms' fp32 outputs to half (``6 h`` each). Backward twice the forward's bytes. Under
  autocast each micro-batch also casts every linear weight to half (``4 + 2`` bytes per element) and each half
  weight gradient to fp32 (``2 + 4``). The last stage adds the final norm and the loss over the vocabulary,
  ``36 V/t`` bytes per token: the fp32 copy of the half logits (6), log-softmax (8), the loss's gradient (4),
  log-softmax's backward (12), the cast back (6). Tensor-parallel ranks each do their shard (``/t``).
* **torchtitan's eager Llama block** (``ModelSpec.kernels == "torchtitan"``): every aten op its own pass, counted
  op by op from its code (pytorch/torchtitan at 9dec370, the 2024 H100 benchmarks' commit:
  ``torchtitan/models/norms.py``'s ``RMSNorm``, ``x.float()``, ``pow(2)``, ``mean``, ``+ eps``, ``rsqrt``, ``*``,
  ``type_as``, ``* weight``; ``torchtitan/models/llama/model.py``'s rotary embedding as complex products on fp32
  copies of q and k, ``repeat_kv`` copying k and v to every query head, SwiGLU as ``silu`` then ``*``; no transpose
  copy: flash attention's output is already token-major) and checked against
  :class:`lslm.metrics.traffic.ElementwiseTraffic` on a block written op for op the same
  (tests/test_plan_elementwise.py): per token of one layer, with ``k`` = key/value width ``n_kv · d`` and ``r`` = 1
  where ``repeat_kv`` copies (``n_kv < n_head``), forward ``84h + 48`` (two norms, two residual adds; ``/t`` with
  SP) ``+ (20h + 20k + r(4h + 4k) + 10f) / t`` (rotary, repeat, SwiGLU), backward ``214h + 80`` ``+ (20h + 20k +
  r(4h + 4k) + 18f) / t``: for Llama 3 8B, 3.4 times the fused count. Its final norm is counted as the fused one.
* **Recomputation**: selective repeats the attention's forward (``1/3.5`` of its time), full the whole layer's
  forward (GEMMs, attention, elementwise); ``"op"`` (torchtitan's op-level selective) the GEMMs whose outputs
  it does not keep, each at its own shape's efficiency, and the layer's elementwise forward, not the attention
  (:mod:`lslm.plan.op_sac`).
* **The optimizer**: fused AdamW, ``28`` bytes per element it updates (fp32 parameter, gradient, two moments: read
  4 x 4, write 3 x 4) under autocast, ``30`` with half weights and fp32 masters (``+ 2``: the half copy written),
  at the measured AdamW rate for that many elements. SGD is priced at AdamW's rate with its own bytes (4 x 4).

Not modelled: kernel launch and Python overhead (eager torch: a few µs per op), the embedding lookup and its
gradient's scatter, fused kernels (Megatron's fused bias-GELU, fused softmax and LayerNorm move fewer bytes than
counted here), tile quantization of awkward shapes beyond what the tables hold.
"""

from __future__ import annotations

from dataclasses import dataclass

from lslm.plan.gpu_calibration import GpuCalibration
from lslm.plan.layout import Layout
from lslm.plan.memory import layer_linear_params
from lslm.plan.model import ModelSpec
from lslm.plan.op_sac import op_recomputed_gemms

__all__ = ["LOSS_BYTES_PER_LOGIT", "MicrobatchTimes", "elementwise_bytes", "layer_gemms", "microbatch_times",
           "optimizer_bytes", "optimizer_seconds", "torchtitan_layer_bytes", "unfused_attention_seconds"]

LOSS_BYTES_PER_LOGIT = 36  #: bytes the loss streams per token and vocabulary entry, forward + backward (module doc)


def torchtitan_layer_bytes(model: ModelSpec, layout: Layout) -> tuple[float, float]:
    """(forward, backward) bytes per token that one layer of torchtitan's eager Llama block moves outside its
    matmuls and attention on one device (module doc, counted op by op)."""
    h, f, t = model.hidden, model.ffn, layout.tp
    k = model.kv_heads * model.head_dim
    region = t if layout.sequence_parallel else 1
    repeat = 4 * h + 4 * k if model.kv_heads < model.n_head else 0  # repeat_kv's copies (backward: their sums)
    return ((84 * h + 48) / region + (20 * h + 20 * k + repeat + 10 * f) / t,
            (214 * h + 80) / region + (20 * h + 20 * k + repeat + 18 * f) / t)


def layer_gemms(model: ModelSpec, tp: int) -> list[tuple[str, int, int]]:
    """``(kind, n, k)`` of one layer's GEMMs on one tensor-parallel rank (module doc)."""
    h, f = model.hidden, model.ffn
    if model.arch == "gpt":
        return [("qkv", 3 * h // tp, h), ("proj", h, h // tp), ("fc1", f // tp, h), ("fc2", h, f // tp)]
    qkv = h + 2 * model.kv_heads * model.head_dim
    return [("qkv", qkv // tp, h), ("proj", h, h // tp), ("fc1", f // tp, h), ("fc1", f // tp, h),
            ("fc2", h, f // tp)]


def elementwise_bytes(model: ModelSpec, layout: Layout) -> tuple[float, float]:
    """(per token of one layer's forward, per token of the loss forward + backward) bytes of memory-bound
    elementwise work on one device with fused kernels (module doc); the layer's backward streams twice its
    forward's. ``ModelSpec.kernels == "torchtitan"`` layers are :func:`torchtitan_layer_bytes` instead."""
    h, f, t = model.hidden, model.ffn, layout.tp
    region = t if layout.sequence_parallel else 1
    autocast = layout.mixed == "autocast"
    w = 4 if autocast or layout.precision == "fp32" else 2  # the residual stream's width
    e = 4 if layout.precision == "fp32" else 2
    norms_residuals = (2 * 2 * w * h + 2 * 3 * w * h + (2 * 6 * h if autocast else 0)) / region
    act = (2 if model.arch == "gpt" else 3) * e * f / t
    transpose = 2 * e * h / t
    loss = LOSS_BYTES_PER_LOGIT * model.vocab / t + 2 * w * h / region
    return norms_residuals + act + transpose, loss


@dataclass(frozen=True)
class MicrobatchTimes:
    """One micro-batch on one device of a stage: seconds by kind (module doc)."""

    gemm: float  #: forward + backward (+ recomputed forward) GEMMs of the stage's layers and head
    attention: float
    elementwise: float  #: norms, activations, residual adds, casts, the loss
    layer: float  #: one layer's forward + backward + recompute
    backward: float  #: the backward alone (layers and head)

    @property
    def total(self) -> float:
        """Forward + backward (+ recompute) seconds."""
        return self.gemm + self.attention + self.elementwise


def microbatch_times(model: ModelSpec, layout: Layout, cal: GpuCalibration, layers: int, head: bool,
                     peak: float | None = None) -> MicrobatchTimes:
    """Seconds of one micro-batch's forward and backward on a device holding ``layers`` layers (and the head and
    loss if ``head``), each operation at its calibrated rate (module doc). ``peak``: the flop/s the efficiencies
    are fractions of (default the calibration's; :mod:`lslm.plan.timing` passes the hardware's peak x
    ``compute_efficiency``, so ``--peak-tflops`` and ``--efficiency`` still apply)."""
    t, c = layout.tp, layout.cp
    tokens = model.micro_batch * model.seq_len / c
    peak = cal.peak_flops if peak is None else peak
    fwd_gemm = sum(2 * tokens * n * k / (cal.gemm_efficiency(kind, tokens, n, k) * peak)
                   for kind, n, k in layer_gemms(model, t))
    attn_rate = cal.attention_efficiency(model.seq_len / c, model.head_dim) * peak  # flop/s
    if layout.flash_attention:
        attn = 3.5 * 2 * model.micro_batch * model.seq_len ** 2 * model.hidden / (t * c) / attn_rate
        attn_fwd, attn_bwd = attn / 3.5, attn * 2.5 / 3.5
    else:
        attn_fwd, attn_bwd = unfused_attention_seconds(model, layout, attn_rate, cal.hbm_Bps)
    per_token, loss_per_token = elementwise_bytes(model, layout)
    bwd_cast = 0.0
    if model.kernels == "torchtitan":
        if layout.mixed == "autocast":
            raise ValueError("ModelSpec.kernels='torchtitan' counts torchtitan's bf16 block (FSDP2's mixed "
                             "precision): use Layout(mixed='masters') with it")
        fwd_b, bwd_b = torchtitan_layer_bytes(model, layout)
        fwd_ew, bwd_ew = tokens * fwd_b / cal.hbm_Bps, tokens * bwd_b / cal.hbm_Bps
    else:
        fwd_ew = tokens * per_token / cal.hbm_Bps
        if layout.mixed == "autocast":
            fwd_ew += 6 * layer_linear_params(model, t) / cal.hbm_Bps  # the weights' half copies
            bwd_cast = 6 * layer_linear_params(model, t) / cal.hbm_Bps  # half weight gradients to fp32
        bwd_ew = 2 * fwd_ew  # the fused count: each pass's backward reads and writes twice its forward's bytes
    recompute_gemm = fwd_gemm if layout.recompute == "full" else 0.0
    if layout.recompute == "op":  # the matmuls whose outputs torchtitan's policy does not keep
        recompute_gemm = sum(2 * tokens * n * k / (cal.gemm_efficiency(kind, tokens, n, k) * peak)
                             for kind, n, k in op_recomputed_gemms(model, t))
    recompute_attn = attn_fwd if layout.recompute in ("selective", "full") else 0.0
    recompute_ew = fwd_ew if layout.recompute in ("full", "op") else 0.0
    attn = attn_fwd + attn_bwd
    layer = 3 * fwd_gemm + recompute_gemm + attn + recompute_attn + fwd_ew + bwd_ew + bwd_cast + recompute_ew
    gemm = layers * (3 * fwd_gemm + recompute_gemm)
    attention = layers * (attn + recompute_attn)
    elementwise = layers * (fwd_ew + bwd_ew + bwd_cast + recompute_ew)
    backward = layers * (2 * fwd_gemm + attn_bwd + bwd_ew + bwd_cast)
    if head:
        v = -(-model.vocab // t)
        head_fwd = 2 * tokens * v * model.hidden / (cal.gemm_efficiency("fc1", tokens, v, model.hidden) * peak)
        loss = tokens * loss_per_token / cal.hbm_Bps
        gemm += 3 * head_fwd
        elementwise += loss
        backward += 2 * head_fwd + loss * 2 / 3
    return MicrobatchTimes(gemm, attention, elementwise, layer, backward)


def unfused_attention_seconds(model: ModelSpec, layout: Layout, matmul_flops_per_s: float,
                              hbm_Bps: float) -> tuple[float, float]:
    """(forward, backward) seconds of one layer's attention core without a flash kernel, on one device (module
    doc): its two batched matmuls over the whole ``s x s`` square (the causal mask applied after), ``4 b s^2 h``
    flops forward and twice that backward, at ``matmul_flops_per_s``; and the scores' elementwise passes at
    ``hbm_Bps``, per score ``e`` bytes wide (2 in half precision, 4 in fp32 or under autocast, whose softmax
    outputs fp32) and with a 1-byte dropout mask: forward the fused scale-mask-softmax (read, write) and dropout
    (read, write, mask), ``4e + 1``; backward dropout's (read, mask, write) and softmax's (read the gradient and
    the probabilities, write), ``5e + 1``; without dropout ``2e`` and ``3e``."""
    t, c = layout.tp, layout.cp
    scores = model.micro_batch * (model.n_head / t) * (model.seq_len / c) * model.seq_len
    e = 4 if layout.precision == "fp32" or layout.mixed == "autocast" else 2
    fwd_bytes, bwd_bytes = (4 * e + 1, 5 * e + 1) if model.dropout else (2 * e, 3 * e)  # + 1: dropout's mask
    matmul = 4 * model.micro_batch * model.seq_len ** 2 * model.hidden / (t * c) / matmul_flops_per_s
    return matmul + scores * fwd_bytes / hbm_Bps, 2 * matmul + scores * bwd_bytes / hbm_Bps


def optimizer_bytes(layout: Layout) -> int:
    """Bytes fused AdamW (or SGD with momentum) reads and writes per element it updates (module doc)."""
    base = 28 if layout.optimizer == "adamw" else 16
    return base + (2 if layout.mixed == "masters" and layout.precision != "fp32" else 0)


def optimizer_seconds(elements: float, layout: Layout, cal: GpuCalibration) -> float:
    """Seconds of one fused optimizer step over ``elements`` parameters at the measured AdamW rate."""
    return elements * optimizer_bytes(layout) / cal.optimizer_Bps(elements)
