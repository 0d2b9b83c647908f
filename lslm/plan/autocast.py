"""Activation bytes under ``torch.autocast`` over fp32 weights (``Layout.mixed == "autocast"``), tensor by tensor.

Megatron-style mixed precision (``mixed="masters"``, :mod:`lslm.plan.activations`) keeps every activation in the
half dtype. ``torch.autocast`` does not: it casts per op, by its op lists (matmuls, ``linear`` and
``scaled_dot_product_attention`` to the half dtype; ``layer_norm``, ``log_softmax``, ``nll_loss`` to fp32), and
whatever is not cast keeps its inputs' dtype. For lslm's GPT (:mod:`lslm.models.gpt`) under bf16 or fp16
autocast that gives, with ``e = 2`` the half width and ``region`` ``t`` with sequence parallelism, else 1:

* **The residual stream is fp32.** The embeddings are not cast (``embedding`` is on no list), and
  ``x + attn(...)`` adds a half tensor to an fp32 one: type promotion gives fp32. So each LayerNorm's input,
  which it saves, is ``4 sbh/region`` instead of ``e sbh/region``: per layer ``2 (4 - e) sbh/region`` more
  than Korthikanti's list (two LayerNorms). The LayerNorm's own output is fp32 and not saved: the next linear
  saves autocast's half copy of it (``e sbh``, as in the list). With full recomputation the block's saved
  input is that fp32 residual: ``4 sbh/region`` instead of ``e``. Everything else a block saves is a matmul's
  or attention's half output (``q, k, v``, the attention output, the MLP's two ``4h``-wide tensors), as in the
  list (the attention's internals, under autocast's ``scaled_dot_product_attention``, are half too).
* **Half copies of the weights.** A linear layer casts its fp32 weight and bias to the half dtype and saves
  the copy for its backward (autocast also caches it for the rest of the region). So every micro-batch in
  flight holds ``e`` bytes for each weight and linear bias of the stage's layers (per tensor-parallel rank),
  and the last stage one of the head (``e · Vh/t``, tied or not: the cast is the head's). LayerNorm weights
  and embeddings are not cast. Assumed: one autocast region per micro-batch's forward (torch's recipe; a region
  around several micro-batches would share one copy). With full recomputation the blocks' graphs keep no
  weight; the cache still holds every layer's copy until the forward's region ends, so they count at the
  forward's end, not in backward.
* **The logits and the loss** (last stage; lslm's GPT calls ``F.cross_entropy(logits.float(), ...)``): the
  head's half logits (``e sbV/t``, returned to the caller, which holds them through the backward as a
  training loop that keeps ``logits, loss = model(x, y)`` does); their fp32 copy (``4 sbV/t``, freed once
  ``log_softmax`` has run: its backward needs no input); the fp32 log-softmax (``4 sbV/t``, saved by
  ``log_softmax`` and by ``nll_loss``, one tensor). In backward ``nll_loss`` makes the fp32 gradient of its
  input (``4 sbV/t``) and ``log_softmax``'s backward its own (``4 sbV/t``) while the saved output is alive:
  ``(2 + 4 + 4 + 4) sbV/t``, 14 bytes per logit with bf16. Under tensor parallelism lslm's GPT runs its
  vocabulary-parallel cross-entropy instead, per vocabulary shard: the same logits and saved fp32 softmax, and at
  its backward the softmax's clone turned gradient and that gradient cast back, ``(2 + 4 + 4 + 2) sbV/t``
  (:func:`lslm.plan.activations.loss_moments_per_logit` gives each style's two moments).
  With ``ModelSpec.loss == "torchtitan"`` (``del pred`` before the backward) the half logits are held only
  until the forward's end: ``12 sbV/t`` at the loss's backward, nothing after it (:mod:`lslm.plan.activations`).
  The final LayerNorm saves its fp32 input (``4 sbh/region``), the head the half copy of its output (``e sbh``).

**When the peak happens.** Three moments, each with everything saved so far: the forward's end (the loss's fp32
logits copy alive; with full recomputation the cache's copies of every layer's weights), the loss's backward
(its two fp32 gradients; with full recomputation only the head's weight copy), and, with recomputation, a
layer's replay (the log-softmax freed; one layer's bytes without recomputation and its weights' half copies
again). The activations are the largest of the three. Not counted: O(s) statistics (LayerNorm means and
reciprocal deviations, the attention's log-sum-exp), token ids, and the allocator's rounding.

The mechanism was checked tensor by tensor against lslm's GPT on one H200 (``lslm.plan.validate_memory``):
nothing here is fitted to those measurements.
"""

from __future__ import annotations

from lslm.plan.activations import (
    embedding_mask_bytes,
    in_flight_layers,
    layer_activation_bytes,
    layer_formula,
    loss_moments_per_logit,
)
from lslm.plan.layout import Layout, layers_on_stage
from lslm.plan.model import ModelSpec

__all__ = ["AutocastActivations", "autocast_activations", "autocast_layer_bytes"]

FP32 = 4


def _half(layout: Layout) -> int:
    return 2  # bf16 and fp16 alike


def autocast_layer_bytes(model: ModelSpec, layout: Layout, recompute: str | None = None, *,
                         mask_bytes: int = 1) -> float:
    """Bytes one layer keeps for backward under autocast, one micro-batch (module doc): Korthikanti's list in the
    half dtype, with the fp32 residual where it is saved (two LayerNorm inputs, or the block's input with full
    recomputation)."""
    recompute = layout.recompute if recompute is None else recompute
    s, b, h = model.seq_len // layout.cp, model.micro_batch, model.hidden
    region = layout.tp if layout.sequence_parallel else 1
    fp32_tensors = 1 if recompute == "full" else 2
    half = layer_activation_bytes(model, layout, recompute, mask_bytes=mask_bytes)
    return half + fp32_tensors * (FP32 - _half(layout)) * s * b * h / region


class AutocastActivations:
    """A stage's activation bytes under autocast at its peak moment, with each moment's bytes (module doc)."""

    def __init__(self, value: float, formula: str, moments: dict[str, float], after_backward: float) -> None:
        self.value = value
        self.formula = formula
        self.moments = moments  #: bytes at "forward end", "loss backward" (last stage) or "backward", "replay"
        self.after_backward = after_backward  #: still held once the backward is done (the caller's logits)


def autocast_activations(model: ModelSpec, layout: Layout, m: int, stage: int, recompute: str, lin: int, *,
                         mask_bytes: int = 1) -> AutocastActivations:
    """Activation bytes of pipeline stage ``stage`` (one device) under autocast with ``m`` micro-batches per step,
    at the largest of the moments of the module doc. ``lin``: elements of one layer's linears (weights and biases)
    on one tensor-parallel rank, the weights autocast casts (:func:`lslm.plan.memory.layer_linear_params`)."""
    if model.loss == "megatron":
        raise ValueError("ModelSpec.loss='megatron' counts Megatron-LM's in-place loss over half weights: use "
                         "Layout(mixed='masters') with it, or loss='lslm' / 'torchtitan' under autocast")
    e = _half(layout)
    s, b, h, t = model.seq_len // layout.cp, model.micro_batch, model.hidden, layout.tp
    region = t if layout.sequence_parallel else 1
    sbh, sbv = s * b * h, s * b * model.vocab / t
    last = stage == layout.pp - 1
    rank_layers = in_flight_layers(model, layout, m, stage)
    one = autocast_layer_bytes(model, layout, recompute, mask_bytes=mask_bytes)
    head = -(-model.vocab // t) * h if last else 0
    saved = rank_layers * one
    half = layer_activation_bytes(model, layout, recompute, mask_bytes=mask_bytes)
    fp32_part = ("the block's input in fp32, 4sbh instead of e·sbh" if recompute == "full"
                 else "2 LayerNorm inputs in fp32, +2(4-e)sbh")
    formula = (f"{rank_layers:g} layer-micro-batches x {one / sbh:.4g}·sbh [Korthikanti's tensors in the half dtype "
               f"({layer_formula(model, layout, recompute)}; {half / sbh:.4g}·sbh here), e = {e}; the fp32 residual "
               f"where saved: {fp32_part}" + (", /t with SP" if region > 1 else "") + "]")
    if stage == 0 and model.dropout and recompute != "full":
        saved += embedding_mask_bytes(model, layout, m, mask_bytes=mask_bytes)
        formula += " + embedding dropout masks"
    # Half weight copies: one per layer-micro-batch in flight (each forward's own region), unless full
    # recomputation leaves them to the cache of the forward running now only (its stage's L/p layers).
    stage_layers = layers_on_stage(model, layout, stage)
    kept_copies = 0.0 if recompute == "full" else rank_layers * lin
    cached_copies = stage_layers * lin if recompute == "full" else kept_copies
    formula += (f" + half weight copies e·({'0' if recompute == 'full' else f'{rank_layers:g}'} x {lin:,} per layer"
                + (f" + head {head:,}" if last else "") + ")")
    loss_held = 0.0
    caller = e if model.loss == "lslm" else 0  # torchtitan deletes pred before the backward
    if last:
        head_input = e * sbh / (region if layout.regather else 1)
        saved += FP32 * sbh / region + head_input
        loss_held = (caller + FP32) * sbv  # the caller's half logits (lslm's loss); the fp32 log-softmax
        formula += (" + final LayerNorm's fp32 input 4sbh + head input e·sbh + "
                    + ("logits e·sbV/t + " if caller else "") + "log-softmax 4sbV/t")
    base = saved + loss_held + e * head
    # the loss's two moments beyond what it holds between them (the caller's logits, the saved fp32 softmax): at the
    # forward's end the logits are alive whoever deletes them later, with the fp32 copy; at its backward the gradients
    loss = loss_moments_per_logit(model.loss, e, layout.tp > 1)
    moments = {"forward end": base + e * cached_copies + ((loss["forward end"] - caller - FP32) * sbv if last else 0.0)}
    moments["loss backward" if last else "backward"] = base + e * kept_copies + (
        (loss["loss backward"] - caller - FP32) * sbv if last else 0.0)
    working = autocast_layer_bytes(model, layout, "none", mask_bytes=mask_bytes) - one
    if recompute != "none" and working > 0:
        moments["replay"] = base - (FP32 * sbv if last else 0.0) + e * kept_copies + working + e * lin
    peak = max(moments, key=lambda k: moments[k])
    formula += (" + at the peak moment (" + peak + "): "
                + {"forward end": ("fp32 logits copy 4sbV/t" if last else "")
                   + (" + the cache's copies of the stage's layers" if recompute == "full" else ""),
                   "loss backward": ("the loss's fp32 gradient and its cast back (4 + e)sbV/t"
                                     if layout.tp > 1 and model.loss == "lslm" else
                                     "the loss's two fp32 input gradients 8sbV/t"),
                   "backward": "nothing more",
                   "replay": "one layer replayed (its bytes without recompute and its weight copies)"}[peak])
    return AutocastActivations(moments[peak], formula, moments, caller * sbv if last else 0.0)
