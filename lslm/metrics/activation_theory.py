"""Activation memory of one transformer layer: Korthikanti et al. (2022) and the same accounting for lslm's block.

**The paper** (Korthikanti et al. 2022, "Reducing Activation Recomputation in Large
Transformer Models", Section 4.1 and Table 2) counts the bytes one layer keeps for
backward with 2-byte (fp16/bf16) activations and 1-byte dropout masks; ``s`` sequence
length, ``b`` micro-batch, ``h`` hidden size, ``a`` heads, ``t`` tensor-parallel size::

    no parallelism                 sbh (34 + 5as/h)
    tensor parallel (4.2.1)        sbh (10 + 24/t + 5as/(ht))
    tensor + sequence parallel     sbh/t (34 + 5as/h)            (4.2.2, Megatron re-gathers inputs)

:func:`korthikanti_layer_bytes` gives exactly these numbers (and the same accounting with
other byte widths, ``act_bytes``/``mask_bytes``).

**What lslm's block actually saves** (:func:`layer_terms`, one :class:`ActivationTerm` per
saved tensor, read from the autograd graph with saved-tensor hooks on torch 2.13 CPU;
``lslm.demos.activation_check`` measures it). The terms map one to one onto
the paper's, except where noted:

* dtypes: we run fp32, so every activation is ``act_bytes=4``. On CPU, dropout is
  ``input * noise`` with a *float* noise tensor (ATen's fused ``native_dropout``, which
  saves a bool mask, runs only on accelerators): masks are ``mask_bytes=4`` here, not 1.
  On CUDA they would be 1-byte bools (an expectation: not measured here).
* LayerNorm also saves its per-row mean and 1/std (fp32, ``sb`` elements each): 4 extra
  tensors of ``sb`` elements per layer, absent from the paper (negligible: ``16sb`` bytes).
* attention through SDPA's math backend (the one that runs on CPU whenever
  ``dropout_p > 0``): it saves ``q`` and ``k^T`` each scaled by ``d**-0.25`` (copies,
  like the paper's Q and K), the softmax output, the dropout noise, the dropped
  probabilities and a contiguous copy of ``v`` (the paper's "attention over values"):
  the paper's ``4sbh + 5as^2b + 2sbh`` exactly, with our dtypes.
* with a single head per rank (``a/t == 1``) ``v`` needs no copy: the saved view keeps
  the whole fused ``c_attn`` output alive (``3sbh/t`` instead of ``sbh/t``), because
  memory is freed by storage, not by view.
* the causal mask is built in the forward (``s x s``) but is not saved; nor is the
  fused ``c_attn`` output itself (q, k, v are saved as the copies above).
* ``attention="flash"`` (dropout 0, where torch picks the fused CPU kernel): q, k and v
  are saved as views of the ``c_attn`` output (one ``3sbh`` storage), with the attention
  output (the same storage as ``c_proj``'s input) and the log-sum-exp (``as`` rows,
  fp32): O(s), no ``s^2`` term. The GPU flash / memory-efficient kernels likewise keep
  O(s) statistics and recompute the probabilities in backward (not measured here).
* ``dropout=False``: ``nn.Dropout(0)`` returns its input, so no mask is saved, and the
  math path then saves the softmax output once (it is also the ``bmm`` operand).

Sharding over ``t`` follows Megatron: heads (``q, k, v``, the ``s^2`` tensors, the
attention output) and the ``4h`` MLP tensors are split over ``t``; the LayerNorm
region (LayerNorm inputs and statistics, the inputs of ``c_attn``/``c_fc``, the two
residual dropout masks) is replicated, or split along the sequence with sequence
parallelism, where the column-parallel layers save their *sharded* input and re-gather
it in backward (``regather=False``: they save the gathered one, ``sbh`` each).
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["ATTENTION_CORE_TERMS", "ActivationTerm", "adapted_layer_bytes", "format_terms", "korthikanti_layer_bytes",
           "layer_flops", "layer_terms", "recompute_extra_flops", "recompute_layer_bytes"]

ATTENTION_KINDS = ("math", "flash")
#: The terms of :func:`layer_terms` (math attention) that selective recomputation drops: the attention core's.
ATTENTION_CORE_TERMS = ("q * d^-1/4 (copy)", "k^T * d^-1/4 (copy)", "softmax output", "attention dropout noise",
                        "dropped attention probs", "v (contiguous copy)", "v (view: the whole c_attn output)")


@dataclass(frozen=True)
class ActivationTerm:
    """One tensor a transformer layer saves for backward, on one rank."""

    name: str  #: which tensor, e.g. "ln_1 input"
    saved_by: str  #: the autograd node and field that hold it, e.g. "NativeLayerNormBackward0.input"
    elements: int  #: number of elements on this rank
    bytes_per_element: int  #: its dtype's width (fp32 = 4)
    sharding: str  #: "replicated", "tensor / t" (heads or MLP columns, tensor parallel) or "sequence / t"
    paper: str  #: the paper's term it is (2-byte accounting), or "not counted"

    @property
    def bytes(self) -> int:
        """Bytes on this rank: elements x bytes per element."""
        return self.elements * self.bytes_per_element


def _check_positive(**values: int) -> None:
    for name, v in values.items():
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise ValueError(f"{name} must be a positive int, got {v!r}")


def korthikanti_layer_bytes(s: int, b: int, h: int, a: int, t: int = 1, sequence_parallel: bool = False, *,
                            act_bytes: int = 2, mask_bytes: int = 1) -> float:
    """Activation bytes of one layer per rank, Korthikanti et al. 2022, Table 2 (Sections 4.1, 4.2).

    With the defaults (2-byte activations, 1-byte masks) this is the paper exactly:
    ``sbh(34 + 5as/h)`` for ``t=1``, ``sbh(10 + 24/t + 5as/(ht))`` with tensor parallelism
    and ``sbh/t (34 + 5as/h)`` with sequence parallelism too. Other widths keep the paper's
    list of tensors: with ``e = act_bytes`` and ``m = mask_bytes`` the replicated part is
    ``sbh(4e + 2m)`` (LayerNorm inputs, the two linear inputs after them, two dropout
    masks), the head-sharded part ``sbh 12e / t + as^2b (2e + m) / t``. Returns a float
    (``24/t`` need not be whole).
    """
    _check_positive(s=s, b=b, h=h, a=a, t=t, act_bytes=act_bytes, mask_bytes=mask_bytes)
    e, m = act_bytes, mask_bytes
    replicated = s * b * h * (4 * e + 2 * m)
    sharded = s * b * h * 12 * e + a * s * s * b * (2 * e + m)
    return replicated / (t if sequence_parallel else 1) + sharded / t


def layer_terms(s: int, b: int, h: int, a: int, t: int = 1, sequence_parallel: bool = False, *,
                act_bytes: int = 4, mask_bytes: int = 4, stat_bytes: int = 4, attention: str = "math",
                dropout: bool = True, regather: bool = True) -> list[ActivationTerm]:
    """Every tensor one lslm :class:`~lslm.models.gpt.Block` saves for backward, per rank, in forward order.

    Derived from the saved-tensor hooks on torch 2.13 CPU (module doc lists each
    difference from the paper). ``act_bytes``: activation dtype width; ``mask_bytes``:
    dropout noise width (4 on CPU, where it is a float tensor; 1 for the bool mask that
    accelerators' fused dropout saves, an expectation not measured here); ``stat_bytes``: LayerNorm
    mean/rstd and log-sum-exp (fp32). ``attention`` is ``"math"`` (SDPA's math backend,
    the ``s^2`` term) or ``"flash"`` (the fused kernel, only without dropout on CPU).
    ``regather`` (sequence parallel only): column-parallel layers save their sharded
    input and all-gather it again in backward, as Megatron does.
    """
    _check_positive(s=s, b=b, h=h, a=a, t=t, act_bytes=act_bytes, mask_bytes=mask_bytes, stat_bytes=stat_bytes)
    if attention not in ATTENTION_KINDS:
        raise ValueError(f"attention must be one of {ATTENTION_KINDS}, got {attention!r}")
    if attention == "flash" and dropout:
        raise ValueError("attention='flash' models the fused CPU kernel, which has no dropout (torch falls back to "
                         "the math path when dropout_p > 0): pass dropout=False or attention='math'")
    if h % a:
        raise ValueError(f"hidden size h={h} must be divisible by the number of heads a={a}")
    if a % t:
        raise ValueError(f"the a={a} heads must split evenly over t={t} tensor-parallel ranks")
    if sequence_parallel and s % t:
        raise ValueError(f"sequence parallelism splits the sequence s={s} over t={t} ranks: s must be divisible by t")
    e, m, st = act_bytes, mask_bytes, stat_bytes
    sbh, sb = s * b * h, s * b
    seq_t = t if sequence_parallel else 1  # the LayerNorm/dropout region: replicated, or split along the sequence
    region = "sequence / t" if sequence_parallel and t > 1 else "replicated"
    heads = "tensor / t" if t > 1 else "replicated"
    linear_in_t = seq_t if regather else 1
    linear_in = region if regather else "replicated"
    # Which autograd node holds a linear layer's input: nn.Linear and a column-parallel layer
    # without SP use addmm; with SP the column-parallel layer is one autograd Function
    # (gather, matmul) that saves it itself; a row-parallel layer adds its bias after the
    # reduction, so its matmul is a bare mm.
    column_by = ("_LinearWithTPCommunicationBackward.saved_tensors[0]" if sequence_parallel and t > 1
                 else "AddmmBackward0.mat1")
    row_by = "MmBackward0.self" if t > 1 else "AddmmBackward0.mat1"

    def layer_norm(i: int) -> list[ActivationTerm]:
        node = "NativeLayerNormBackward0"
        return [ActivationTerm(f"ln_{i} input", f"{node}.input", sbh // seq_t, e, region, "2sbh"),
                ActivationTerm(f"ln_{i} mean", f"{node}.result1", sb // seq_t, st, region, "not counted"),
                ActivationTerm(f"ln_{i} rstd", f"{node}.result2", sb // seq_t, st, region, "not counted")]

    # CPU dropout multiplies by a float noise tensor; the fused accelerator kernel saves a bool mask.
    mask_by = "NativeDropoutBackward0.mask" if m == 1 else "MulBackward0.other"

    def mask(name: str, elements: int, sharding: str, paper: str) -> list[ActivationTerm]:
        return [ActivationTerm(name, mask_by, elements, m, sharding, paper)] if dropout else []

    terms = layer_norm(1)
    terms.append(ActivationTerm("c_attn input (ln_1 output)", column_by, sbh // linear_in_t, e,
                                linear_in, "2sbh (QKV input)"))
    s2 = a * s * s * b // t
    if attention == "math":
        terms += [ActivationTerm("q * d^-1/4 (copy)", "BmmBackward0.self", sbh // t, e, heads, "2sbh (Q)"),
                  ActivationTerm("k^T * d^-1/4 (copy)", "BmmBackward0.mat2", sbh // t, e, heads, "2sbh (K)"),
                  ActivationTerm("softmax output", "SafeSoftmaxBackward0.result", s2, e, heads, "2as^2b")]
        if dropout:
            terms += [*mask("attention dropout noise", s2, heads, "as^2b (mask)"),
                      ActivationTerm("dropped attention probs", "BmmBackward0.self", s2, e, heads, "2as^2b")]
        if a // t > 1:
            terms.append(ActivationTerm("v (contiguous copy)", "BmmBackward0.mat2", sbh // t, e, heads, "2sbh (V)"))
        else:  # one local head: v reshapes without a copy, and its view keeps the whole [q|k|v] output alive
            terms.append(ActivationTerm("v (view: the whole c_attn output)", "BmmBackward0.mat2", 3 * sbh // t, e,
                                        heads, "2sbh (V)"))
    else:
        node = "ScaledDotProductFlashAttentionForCpuBackward0"
        terms += [ActivationTerm("c_attn output (q, k, v views)", f"{node}.query/key/value", 3 * sbh // t, e,
                                 heads, "4sbh (Q, K) + 2sbh (V)"),
                  ActivationTerm("log-sum-exp", f"{node}.logsumexp", a * s * b // t, st, heads,
                                 "not counted (replaces the s^2 tensors)")]
    # The fused kernel writes its output (B, a, s, d) in (B, s, a, d) memory order, so the
    # reshape feeding c_proj is a view: output and c_proj input are one storage.
    proj_by = row_by if attention == "math" else f"{row_by} = {node}.output"
    terms.append(ActivationTerm("attn c_proj input", proj_by, sbh // t, e, heads, "2sbh"))
    terms += mask("attn residual dropout noise", sbh // seq_t, region, "sbh (mask)")
    terms += layer_norm(2)
    terms += [ActivationTerm("c_fc input (ln_2 output)", column_by, sbh // linear_in_t, e, linear_in, "2sbh"),
              ActivationTerm("GELU input (c_fc output)", "GeluBackward0.self", 4 * sbh // t, e, heads, "8sbh"),
              ActivationTerm("mlp c_proj input (GELU output)", row_by, 4 * sbh // t, e, heads, "8sbh")]
    terms += mask("mlp dropout noise", sbh // seq_t, region, "sbh (mask)")
    return terms


def adapted_layer_bytes(s: int, b: int, h: int, a: int, t: int = 1, sequence_parallel: bool = False,
                        **options: object) -> int:
    """Sum of :func:`layer_terms` (same arguments): the bytes one lslm block saves per rank.

    With the defaults (fp32, CPU float dropout noise, math attention, dropout on) and
    ``t=1`` this is ``72 sbh + 12 as^2b + 16 sb`` bytes; the paper's accounting at these
    widths (``korthikanti_layer_bytes(..., act_bytes=4, mask_bytes=4)``) differs from
    it only by LayerNorm's ``16 sb``.
    """
    return sum(term.bytes for term in layer_terms(s, b, h, a, t, sequence_parallel, **options))  # type: ignore[arg-type]


def recompute_layer_bytes(s: int, b: int, h: int, a: int, t: int = 1, sequence_parallel: bool = False, *,
                          mode: str = "none", **options: object) -> int:
    """Bytes one lslm block keeps for backward per rank under activation recomputation ``mode``.

    Korthikanti et al. 2022, §5 in lslm's accounting (:func:`layer_terms`' widths, default fp32 and
    CPU float dropout noise):

    * ``"none"``: :func:`adapted_layer_bytes`;
    * ``"full"``: the block input only, ``sbh`` elements (``sbh/t`` with sequence parallelism) of
      ``act_bytes`` (the paper's ``2sbh`` at 2 bytes);
    * ``"selective"`` (math attention only): the attention core's terms
      (:data:`ATTENTION_CORE_TERMS`: the ``5as^2b`` of Table 2 and the q, k, v copies) are replaced
      by the core's inputs, which are views of one ``c_attn`` output: ``3sbh/t`` elements. With
      several heads per rank that equals the copies, so exactly the ``s^2`` terms go.
    """
    e = int(options.get("act_bytes", 4))  # type: ignore[call-overload]
    if mode == "none":
        return adapted_layer_bytes(s, b, h, a, t, sequence_parallel, **options)
    if mode == "full":
        _check_positive(s=s, b=b, h=h, a=a, t=t)
        return s * b * h // (t if sequence_parallel else 1) * e
    if mode != "selective":
        raise ValueError(f"mode must be 'none', 'selective' or 'full', got {mode!r}")
    if options.get("attention", "math") != "math":
        raise ValueError("selective recomputation's bytes are modelled for attention='math' (the s^2 path)")
    terms = layer_terms(s, b, h, a, t, sequence_parallel, **options)  # type: ignore[arg-type]
    kept = sum(x.bytes for x in terms if x.name not in ATTENTION_CORE_TERMS)
    return kept + 3 * s * b * h // t * e


def layer_flops(s: int, b: int, h: int, t: int = 1) -> dict[str, int]:
    """Matmul flops of one block's forward per rank (2 per multiply-add), Korthikanti et al. 2022 §5/Narayanan 2021.

    ``"linear"``: ``24 s b h^2 / t`` (qkv ``6``, attention projection ``2``, MLP ``16``);
    ``"attention"``: ``4 s^2 b h / t`` (``q k^T`` and ``@ v``, the full ``s x s`` that the math path
    computes, causal or not). Softmax, dropout, LayerNorm and GELU are not matmuls and not counted.
    """
    _check_positive(s=s, b=b, h=h, t=t)
    return {"linear": 24 * s * b * h * h // t, "attention": 4 * s * s * b * h // t}


def recompute_extra_flops(s: int, b: int, h: int, t: int = 1, *, mode: str = "none") -> int:
    """Matmul flops that recomputation ``mode`` adds to one block's step per rank (:func:`layer_flops`).

    ``"full"``: one more forward of the block, ``24sbh^2/t + 4s^2bh/t``; ``"selective"``: the
    attention core's ``4s^2bh/t`` (Korthikanti et al. 2022, §5); ``"none"``: 0.
    """
    f = layer_flops(s, b, h, t)
    extra = {"none": 0, "selective": f["attention"], "full": f["linear"] + f["attention"]}
    if mode not in extra:
        raise ValueError(f"mode must be one of {tuple(extra)}, got {mode!r}")
    return extra[mode]


def format_terms(terms: list[ActivationTerm]) -> str:
    """A fixed-width table of ``terms``: tensor, autograd node, elements, bytes/element, bytes, the paper's term."""
    head = f"{'tensor':<36}{'saved by':<36}{'elements':>10}{'B/el':>5}{'bytes':>10}  {'sharding':<13}paper"
    lines = [head, "-" * (len(head) + 16)]
    for x in terms:
        saved_by = x.saved_by if len(x.saved_by) <= 34 else x.saved_by[:31] + "..."
        lines.append(f"{x.name:<36}{saved_by:<36}{x.elements:>10,}{x.bytes_per_element:>5}{x.bytes:>10,}  "
                     f"{x.sharding:<13}{x.paper}")
    lines.append(f"{'total':<36}{'':<36}{'':>10}{'':>5}{sum(x.bytes for x in terms):>10,}")
    return "\n".join(lines)
