"""Activation bytes per device: one layer (Korthikanti et al. 2022), how many are alive at once, and the ends.

**One layer**, ``s`` sequence, ``b`` micro-batch, ``h`` hidden, ``a`` heads, ``t`` tensor-parallel size, 2-byte
activations and 1-byte dropout masks (the paper's Table 2; §4.1 lists the tensors, §5 the recomputation):

==========================================  ==================================
no parallelism                              ``sbh (34 + 5as/h)``
tensor parallel                             ``sbh (10 + 24/t + 5as/(ht))``
tensor + sequence parallel                  ``sbh/t (34 + 5as/h)``
tensor parallel + selective recompute       ``sbh (10 + 24/t)``
tensor + sequence parallel + selective      ``sbh/t · 34``
full recompute                              ``2 sbh`` (``2 sbh / t`` with sequence parallelism)
==========================================  ==================================

(``recompute="op"``, torchtitan's op-level selective checkpointing, keeps its own list:
:mod:`lslm.plan.op_sac`.)

The first three are :func:`lslm.metrics.activation_theory.korthikanti_layer_bytes`; selective recompute drops the
``5as^2b`` (softmax, its dropout mask, the dropped probabilities), and so does a flash-attention kernel (it keeps
O(s) statistics, not counted). So with ``flash_attention`` (or ``cp > 1``) selective recomputation has nothing left
to drop: it keeps the same bytes as none and still pays the attention core's forward again
(:mod:`lslm.plan.timing`). Measured on an H200 (``bench/results/gpu/h200_recompute_2026-11-28.json``, lslm's GPT,
``F.scaled_dot_product_attention``): 26.87 -> 26.85 GB of activations, +10 % step time. Other widths keep the
paper's list of tensors (``e`` bytes per activation, ``m`` per mask; fp32 training: ``e = 4``; ``m`` is the
hardware's :attr:`~lslm.plan.hardware.Hardware.dropout_mask_bytes`: 1 for the bool mask of fused GPU dropout, 4 on a
CPU, where it is a float noise tensor; a test measures lslm's GPT on this CPU within 0.3 %, the rest being the
LayerNorm statistics and token ids the paper leaves out). For ``arch="llama"`` the same list is adapted, and this
adaptation is ours (no published table): keys and values are ``kv/a`` of the queries, there is no dropout,
and the SwiGLU MLP keeps four ``f``-wide tensors (gate and up outputs, SiLU output, their product) instead of
GELU's two ``4h``-wide ones.

**How many at once** on pipeline rank ``r`` of ``p`` with ``m`` micro-batches (``min(p - r, m)`` micro-batches
of ``L/p`` layers in 1F1B, Narayanan et al. 2021 §2.2.1; interleaved with ``v`` chunks:
``min((v - 1)p + 2(p - 1 - r) + 1, v m)`` chunks of ``L/(pv)`` layers, §2.2.2): the same counts as
:func:`lslm.pipeline.theory.activation_memory_theory` (a test checks they agree; that module sits in a layer
above this one). Rank 0 is the most loaded: ``p`` micro-batches, ``1 + (p - 1)/(p v)`` times that interleaved.

**Context parallelism** (``cp > 1``): every per-token tensor holds ``s/cp`` tokens, so ``s`` is ``seq_len / cp``
in every row above and the whole layer falls as ``1/cp``, the ends included. The attention core keeps no score
matrix: ring attention merges blockwise partial results with a log-sum-exp and its backward recomputes the
probabilities block by block (lslm's :mod:`lslm.context_parallel.ring`, as Megatron-LM's context parallelism runs
on flash attention), and Ulysses runs a fused kernel on its ``a/cp`` heads; so the ``5as^2b`` term is dropped as
with ``flash_attention``, and what the core keeps is q, k, v, its output and the ``O(s)`` log-sum-exp (not
counted). The ring's output is the output projection's input (one tensor); Ulysses' kernel output is
head-sharded and the projection's input is the sequence-sharded tensor the second all-to-all returns, so Ulysses
keeps one more ``e · sbh/t`` per layer (measured: lslm's Ulysses GPT at cp = 1, 2, 4; ``cp_method="ulysses"``
counts it at any ``cp``, since it names the attention core). What ``cp`` does not divide:
the model states (:mod:`lslm.plan.states`: parameters are replicated over ``cp``; ZeRO shards over ``dp · cp``)
and the ring's key/value blocks in flight (:mod:`lslm.plan.memory`).
Checked: lslm's context-parallel GPT (ring and Ulysses) at cp = 1, 2, 4, measured with
``lslm.metrics.ActivationMemory``, within 5 % (ring: 0.7 %; tests/test_context_parallel.py).

**The ends** (Korthikanti §4.3): the first stage also keeps the embedding's dropout mask (``m · sbh`` per
in-flight micro-batch, ``/t`` with sequence parallelism); the last keeps the final LayerNorm's input and the
head's input (``e · sbh`` each, ``/t`` with SP) and the fp32 softmax the loss saves, ``4 sbV/t`` (the head
vocabulary-parallel). The rest of the loss's peak, :func:`loss_bytes_per_logit` less those 4 bytes per logit, is
not saved for backward: :mod:`lslm.plan.memory` adds it to the last stage as the "loss temporaries" buffer
(:func:`loss_temporary_bytes`).

**The loss** (``ModelSpec.loss``). Every style runs the softmax in fp32 on a copy of the head's half logits
(no copy when the logits are fp32 already). lslm's GPT calls ``F.cross_entropy(logits.float().flatten(0, 1))``
(lslm/models/gpt.py) and its caller keeps the logits; with ``tp > 1`` it runs
:func:`lslm.tensor_parallel.cross_entropy.vocab_parallel_cross_entropy` instead. torchtitan's ``train.py``
(pytorch/torchtitan: read at 0011fb9 and in 2025 versions) runs ``pred = model(input_ids); loss = loss_fn(pred,
labels); del pred; loss.backward()`` ("need to free to before bwd to avoid peaking memory"), with the upcast in the
loss (``cross_entropy(pred.flatten(0, 1).float(), ...)``, later ``cross_entropy_loss``) or, before that move
(pytorch/torchtitan#551), at the model's end (``self.output(h).float()``): either way neither ``pred`` nor a copy of
it is alive in the backward. Megatron-LM (2021-22: ``post_language_model_processing`` calls
``vocab_parallel_cross_entropy(output.float(), labels)``, ``megatron/mpu/cross_entropy.py`` read at 34ed99d)
subtracts the maximum, exponentiates and normalises *in place* on the fp32 copy, saves that tensor as the softmax,
and in the backward turns the same tensor into the gradient in place; the half ``output`` dies when the function
returns. What torch's autograd keeps for ``F.cross_entropy`` (``tools/autograd/derivatives.yaml``): the copy to fp32
(``_to_copy``) saves nothing; ``_log_softmax`` saves its fp32 output, which ``nll_loss`` also reads; ``nll_loss``'s
backward allocates the fp32 gradient of its input and ``_log_softmax_backward_data`` another while the saved output
is alive. So, per logit with ``e``-byte logits and ``c`` = 4 bytes of fp32 copy when ``e < 4`` (else 0), at the
forward's end / at the loss's backward:

================================  ===================  ==========================  =========  ==========
style                             forward              loss backward               e = 2      e = 4
================================  ===================  ==========================  =========  ==========
lslm (``F.cross_entropy``)        ``e + c + 4``        ``e + 4 + 4 + 4``           10 / 14    8 / 16
lslm, ``tp > 1`` (vocab-parallel) ``e + 4 + 4``        ``e + 4 + 4 + e·[c > 0]``   10 / 12    12 / 12
torchtitan                        ``e + c + 4``        ``4 + 4 + 4``               10 / 12    8 / 12
megatron (in place)               ``e + c``            ``4 + e·[c > 0]``           6 / 6      4 / 4
================================  ===================  ==========================  =========  ==========

(lslm's vocabulary-parallel loss keeps the caller's logits and the fp32 softmax, and its backward clones the softmax
into the gradient and casts that to the logits' dtype.) Measured: the allocator's peak of each loss's forward +
backward alone on CPU (tests/test_plan_loss.py, Megatron's at ``t = 1`` by an in-place replica) is the larger
column, in bf16 and fp32. With half weights or in fp32 (``mixed="masters"``) :func:`loss_bytes_per_logit` counts
that peak: 4 of it saved (Korthikanti's §4.3 ``4 sbV/t``, the fp32 softmax every style keeps between its forward
and backward), the rest a buffer; under autocast :mod:`lslm.plan.autocast` counts the moments themselves.
"""

from __future__ import annotations

from lslm.metrics.activation_theory import korthikanti_layer_bytes
from lslm.plan.layout import Layout, layers_on_stage
from lslm.plan.model import LOSS_STYLES, ModelSpec
from lslm.plan.op_sac import op_layer_bytes

__all__ = ["core_keeps_scores", "cp_element_size", "cp_units", "embedding_mask_bytes", "in_flight_layers",
           "in_flight_microbatches", "last_stage_extra_bytes", "layer_activation_bytes", "layer_formula",
           "loss_bytes_per_logit", "loss_moments_per_logit", "loss_temporary_bytes"]


def _width(layout: Layout) -> int:
    return 4 if layout.precision == "fp32" else 2


def core_keeps_scores(layout: Layout, recompute: str | None = None) -> bool:
    """Whether the attention core keeps its ``s^2`` tensors for backward: not when they are recomputed
    (``"selective"``), not with a flash kernel, not with context parallelism (module doc)."""
    recompute = layout.recompute if recompute is None else recompute
    return not (recompute in ("selective", "op") or layout.flash_attention or layout.cp > 1)


def layer_activation_bytes(model: ModelSpec, layout: Layout, recompute: str | None = None, *,
                           mask_bytes: int = 1) -> float:
    """Bytes one layer keeps for backward on one device for one micro-batch (module doc's table).

    ``recompute`` overrides the layout's (to report the bytes without recompute next to those with it).
    ``cp`` splits the sequence: ``s`` is ``seq_len / cp`` here, and with ``cp > 1`` the attention core keeps
    no ``s^2`` scores (module doc: ring attention and Ulysses run blockwise / fused attention).
    ``mask_bytes``: a dropout mask's bytes per element (1: a bool mask; 4 on a CPU, see
    :attr:`lslm.plan.hardware.Hardware.dropout_mask_bytes`).
    """
    recompute = layout.recompute if recompute is None else recompute
    s, b, h, a, t = model.seq_len // layout.cp, model.micro_batch, model.hidden, model.n_head, layout.tp
    sp = layout.sequence_parallel
    e, m = _width(layout), (mask_bytes if model.dropout else 0)
    region = t if sp else 1  # the LayerNorm / dropout region: replicated, or split along the sequence
    if recompute == "full":
        return e * s * b * h / region
    if recompute == "op":  # torchtitan's op-level selective checkpointing: its own list of kept tensors
        return op_layer_bytes(model, layout)
    attention_core = 1 if core_keeps_scores(layout, recompute) else 0
    # Without re-gathering, the two column-parallel layers keep their gathered input: e·sbh each, not split.
    kept_whole = 2 * e * s * b * h * (1 - 1 / t) if sp and not layout.regather else 0.0
    # Ulysses: the kernel keeps its head-sharded output and the projection its sequence-sharded input, two tensors
    kept_whole += e * s * b * h / t if layout.cp_method == "ulysses" else 0.0  # (lslm's Ulysses core, any cp)
    if model.arch == "gpt" and model.ffn == 4 * h and model.kv_heads == a and m:
        total = korthikanti_layer_bytes(s, b, h, a, t, sp, act_bytes=e, mask_bytes=m)
        return total - (1 - attention_core) * a * s * s * b * (2 * e + m) / t + kept_whole
    # The paper's list of tensors, adapted (module doc): replicated region, then the head/MLP-sharded part.
    kv_frac = model.kv_heads / a
    replicated = s * b * h * (4 * e + 2 * m)
    qkv = s * b * h * e * (1 + 2 * kv_frac)  # Q, K and V (K and V kv/a of Q's width)
    core = attention_core * a * s * s * b * ((2 * e + m) if m else e)  # softmax (+ mask and dropped probs)
    proj = s * b * h * e
    f = model.ffn
    mlp = s * b * f * e * (4 if model.arch == "llama" else 2)
    return replicated / region + (qkv + core + proj + mlp) / t + kept_whole


def layer_formula(model: ModelSpec, layout: Layout, recompute: str | None = None) -> str:
    """The Table 2 row :func:`layer_activation_bytes` evaluates, as text."""
    recompute = layout.recompute if recompute is None else recompute
    sp = layout.sequence_parallel
    if recompute == "full":
        return "2sbh/t (full recompute, SP)" if sp else "2sbh (full recompute)"
    if recompute == "op":
        return "op-level selective: block input, every other matmul's output, attention output (lslm.plan.op_sac)"
    if model.arch != "gpt":
        return "Korthikanti §4.1's tensors adapted to GQA + SwiGLU, no dropout (ours)" + _cp_note(layout)
    core = not core_keeps_scores(layout, recompute)
    idle = recompute == "selective" and not core_keeps_scores(layout, "none")
    return _table_row(layout, core) + _cp_note(layout) + (
        " (selective recompute drops nothing: the kernel keeps no s^2 scores)" if idle else "")


def _cp_note(layout: Layout) -> str:
    return f", s = seq/cp (cp {layout.cp}, {layout.cp_method}: no s^2 scores kept)" if layout.cp > 1 else ""


def _table_row(layout: Layout, core: bool) -> str:
    sp = layout.sequence_parallel
    if layout.tp == 1:
        return "34sbh" if core else "sbh(34 + 5as/h)"
    if sp:
        kept = "" if layout.regather else " + 2e·sbh(1 - 1/t) (inputs kept gathered)"
        return ("34sbh/t" if core else "sbh/t(34 + 5as/h)") + kept
    return "sbh(10 + 24/t)" if core else "sbh(10 + 24/t + 5as/(ht))"


def in_flight_layers(model: ModelSpec, layout: Layout, m: int, rank: int = 0) -> float:
    """Layer-micro-batches whose activations pipeline rank ``rank`` holds at its peak (module doc)."""
    p, v = layout.pp, layout.v
    if not 0 <= rank < p:
        raise ValueError(f"rank {rank} is outside 0..{p - 1}")
    if v == 1:
        return min(p - rank, m) * layers_on_stage(model, layout, rank)
    chunks = min((v - 1) * p + 2 * (p - 1 - rank) + 1, v * m)
    return chunks * layers_on_stage(model, layout, rank) / v


def in_flight_microbatches(layout: Layout, m: int, rank: int = 0) -> int:
    """Micro-batches in flight on ``rank`` (for the per-micro-batch tensors of the first stage)."""
    p, v = layout.pp, layout.v
    if v == 1:
        return min(p - rank, m)
    return min(-(-((v - 1) * p + 2 * (p - 1 - rank) + 1) // v), m)


def embedding_mask_bytes(model: ModelSpec, layout: Layout, m: int, *, mask_bytes: int = 1) -> float:
    """The first stage's embedding dropout masks: ``mask_bytes · sbh`` per in-flight micro-batch (``/t`` with
    SP; ``m`` is the number of micro-batches per step)."""
    if not model.dropout or layout.recompute == "full":
        return 0.0
    s, b, h = model.seq_len // layout.cp, model.micro_batch, model.hidden
    region = layout.tp if layout.sequence_parallel else 1
    return mask_bytes * in_flight_microbatches(layout, m) * s * b * h / region


def loss_moments_per_logit(loss: str, e: int, vocab_parallel: bool = False) -> dict[str, int]:
    """Bytes per logit the loss's tensors hold at the forward's end and at the loss's backward, for
    ``ModelSpec.loss`` style ``loss``, ``e``-byte logits and (style "lslm") whether the head is vocabulary-parallel
    (module doc, "The loss": the table, tensor by tensor)."""
    if loss not in LOSS_STYLES:
        raise ValueError(f"loss must be one of {LOSS_STYLES}, got {loss!r}")
    if e not in (2, 4):
        raise ValueError(f"logits of {e} bytes: expected 2 (bf16/fp16) or 4 (fp32)")
    copy = 4 if e < 4 else 0  # the fp32 copy; .float() on fp32 logits returns them
    cast_back = e if copy else 0  # the gradient cast back to the logits' dtype
    if loss == "megatron":  # one fp32 tensor: the copy, then the softmax, then the gradient, all in place
        return {"forward end": e + copy, "loss backward": 4 + cast_back}
    if loss == "lslm" and vocab_parallel:  # logits, the shifted copy and its exp; backward: softmax + its clone
        return {"forward end": e + 4 + 4, "loss backward": e + 4 + 4 + cast_back}
    caller = e if loss == "lslm" else 0  # torchtitan deletes pred before the backward
    return {"forward end": e + copy + 4, "loss backward": caller + 4 + 4 + 4}


def loss_bytes_per_logit(model: ModelSpec, layout: Layout) -> int:
    """Bytes per logit the loss holds at its peak under ``layout`` with half weights or in fp32
    (``mixed="masters"``; module doc, "The loss"): the larger of :func:`loss_moments_per_logit`'s two moments for
    ``model.loss``, the logits' width and whether ``layout.tp > 1`` makes lslm's loss vocabulary-parallel (bf16:
    lslm 14, or 12 vocabulary-parallel; torchtitan 12; megatron 6)."""
    return max(loss_moments_per_logit(model.loss, _width(layout), layout.tp > 1).values())


LOSS_SAVED_BYTES_PER_LOGIT = 4  #: what every style's loss saves for its backward: the fp32 (log-)softmax


def last_stage_extra_bytes(model: ModelSpec, layout: Layout) -> float:
    """The last stage's final norm input, head input and the fp32 (log-)softmax the loss saves (Korthikanti's
    ``4 sbV/t``) for one micro-batch (module doc): what autograd keeps between the forward and the backward. The
    rest of the loss's peak is :func:`loss_temporary_bytes`."""
    e = _width(layout)
    s, b, h, t = model.seq_len // layout.cp, model.micro_batch, model.hidden, layout.tp
    region = t if layout.sequence_parallel else 1
    head_input = e * s * b * h / (region if layout.regather else 1)  # without re-gathering: kept whole
    return e * s * b * h / region + head_input + LOSS_SAVED_BYTES_PER_LOGIT * s * b * model.vocab / t


def loss_temporary_bytes(model: ModelSpec, layout: Layout) -> float:
    """Bytes the last stage's loss holds at its peak beyond what it saves (the caller's logits, the fp32 copy, the
    gradients of the loss's backward): ``(loss_bytes_per_logit - 4) sbV/t`` for one micro-batch (module doc)."""
    logits = model.seq_len // layout.cp * model.micro_batch * model.vocab / layout.tp
    return (loss_bytes_per_logit(model, layout) - LOSS_SAVED_BYTES_PER_LOGIT) * logits


def cp_element_size(layout: Layout) -> int:
    """Bytes of one element of attention's q, k, v under ``layout``: 4 in fp32, else 2."""
    return 4 if layout.precision == "fp32" else 2


def cp_units(model: ModelSpec, layout: Layout) -> tuple[float, float]:
    """``(u_q, u_kv)``: bytes of one rank's queries, and of its keys (or values), for one layer and micro-batch
    (:mod:`lslm.plan.comm`; key/value heads split over ``min(t, kv)`` ranks, as in :mod:`lslm.plan.memory`)."""
    e = cp_element_size(layout)
    tokens = model.micro_batch * (model.seq_len // layout.cp)
    kv_local = model.kv_heads // min(layout.tp, model.kv_heads)
    return e * tokens * model.hidden / layout.tp, e * tokens * kv_local * model.head_dim
