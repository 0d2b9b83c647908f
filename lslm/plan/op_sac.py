"""Op-level selective activation checkpointing (``Layout.recompute = "op"``): torchtitan's ``selective`` ``op``.

What torchtitan runs (read in pytorch/torchtitan, ``torchtitan/models/llama/parallelize_llama.py`` at 0596be3,
``_apply_ac_to_transformer_block`` with ``selective_ac_option = "op"``; the December 2024 benchmarks' code): every
transformer block is wrapped in a non-reentrant checkpoint with a selective-checkpoint policy. The block's input
is kept (the checkpoint replays from it); during the forward the policy counts the block's ``aten.mm`` calls and
marks as *must save* the outputs of the odd-numbered ones (the 1st, 3rd, 5th, ...; the even ones are recomputed),
and the outputs of the ops in its save list: the fused attention kernels (``_scaled_dot_product_flash_attention``
and ``_efficient_attention``: the attention output and its O(s) log-sum-exp), ``reduce_scatter_tensor`` (the
sequence-parallel reduce-scatter of a row-parallel layer) and ``max`` (float8 scales; none in bf16). Every other
op (norms, RoPE, the key/value head repeat, SiLU and the gate product, residual adds, casts, the all-gathers of
sequence parallelism) is recomputed: in backward the block's forward runs again from its input, with the saved
outputs served from the cache instead of being computed.

**Which matmuls are kept**, in forward order. Llama (torchtitan's block: ``wq, wk, wv`` on the normed input,
attention, ``wo``; ``w2(silu(w1(x)) * w3(x))``): ``wq`` (1, kept), ``wk`` (2), ``wv`` (3, kept), ``wo`` (4),
``w1`` (5, kept), ``w3`` (6), ``w2`` (7, kept). GPT (lslm's: ``qkv``, ``proj``, ``fc1``, ``fc2``): ``qkv`` and
``fc1`` kept, ``proj`` and ``fc2`` recomputed. (torchtitan's policy matches ``aten.mm``: a linear with a bias
runs ``addmm``, which it would not save; the rule is applied here to the matmuls in order, bias or not.)

**Saved bytes per layer and micro-batch** on one device, ``e`` bytes an activation, ``T = b s / cp`` tokens,
``t`` tensor-parallel ranks (which torchtitan runs with sequence parallelism only, so ``t > 1`` needs it), ``kv``
the key/value width ``n_kv · d`` split over ``min(t, n_kv)`` ranks:

* Llama: ``e T (h/t [input] + h/t [wq] + kv/min(t, n_kv) [wv] + h/t [attention] + f/t [w1] + h [w2])``, the
  ``w2`` output whole with ``t > 1`` (a row-parallel matmul's partial sums, before the reduce-scatter), plus
  ``e T h/t`` for each reduce-scatter output with ``t > 1`` (after ``wo`` and ``w2``: in the save list);
  without tensor parallelism ``w2``'s output is ``e T h``.
* GPT: ``e T (h/t [input] + 3h/t [qkv] + h/t [attention] + f/t [fc1])`` plus the two reduce-scatter outputs
  with ``t > 1``. Dropout masks are regenerated in the replay (torch's checkpoint restores the RNG state), not
  kept.
* The attention kernel's log-sum-exp, ``4 b a s / (t cp)`` bytes (fp32, per head and query), is counted.

Llama 3 8B at ``t = 1``: ``e T (4h + kv + f) + 4 T a``; with ``h = 4096, kv = 1024, f = 14336, a = 32`` and
``e = 2``: 63,616 bytes per token and layer, against 167,936 kept with no recomputation (the module
:mod:`lslm.plan.activations`' Llama list).

**Extra compute per layer and micro-batch**: the recomputed matmuls' forward (Llama: ``wk`` ``2 T h kv``, ``wo``
``2 T h^2``, ``w3`` ``2 T h f``, each ``/t``; GPT: ``proj`` and ``fc2``), and the block's memory-bound forward
work again (norms, activation, residual adds: all recomputed); not the attention (its output is kept).
"""

from __future__ import annotations

from lslm.plan.layout import Layout
from lslm.plan.model import ModelSpec

__all__ = ["op_layer_bytes", "op_recompute_flops", "op_recomputed_gemms", "op_saved_tensors"]


def _kv_local(model: ModelSpec, t: int) -> int:
    """Key/value width on one tensor-parallel rank: ``n_kv · d`` split over ``min(t, n_kv)`` ranks."""
    return model.kv_heads // min(t, model.kv_heads) * model.head_dim


def op_saved_tensors(model: ModelSpec, layout: Layout) -> list[tuple[str, float]]:
    """``(tensor, bytes)`` one layer keeps for backward on one device for one micro-batch under torchtitan's
    op-level selective checkpointing (module doc)."""
    e = 4 if layout.precision == "fp32" else 2
    t = layout.tp
    tokens = model.micro_batch * model.seq_len / layout.cp
    h, f = model.hidden, model.ffn
    rows = [("block input", e * tokens * h / t)]
    if model.arch == "gpt":
        rows += [("qkv output (matmul 1)", e * tokens * 3 * h / t), ("attention output", e * tokens * h / t),
                 ("fc1 output (matmul 3)", e * tokens * f / t)]
    else:
        rows += [("wq output (matmul 1)", e * tokens * h / t),
                 ("wv output (matmul 3)", e * tokens * _kv_local(model, t)),
                 ("attention output", e * tokens * h / t), ("w1 output (matmul 5)", e * tokens * f / t),
                 ("w2 output (matmul 7)", e * tokens * h)]  # row-parallel: partial sums, whole (before the reduce)
    rows.append(("attention log-sum-exp (fp32)", 4 * tokens * model.n_head / t))
    if t > 1:
        rows += [("reduce-scatter outputs (2, after the row-parallel layers)", 2 * e * tokens * h / t)]
    return rows


def op_layer_bytes(model: ModelSpec, layout: Layout) -> float:
    """Bytes one layer keeps per micro-batch on one device under ``recompute="op"`` (module doc)."""
    return sum(b for _, b in op_saved_tensors(model, layout))


def op_recomputed_gemms(model: ModelSpec, tp: int) -> list[tuple[str, int, int]]:
    """``(kind, n, k)`` of the matmuls the replay recomputes on one tensor-parallel rank (the even-numbered ones,
    module doc), in :func:`lslm.plan.calibrated.layer_gemms`' kinds."""
    h, f = model.hidden, model.ffn
    if model.arch == "gpt":
        return [("proj", h, h // tp), ("fc2", h, f // tp)]
    return [("qkv", _kv_local(model, tp), h), ("proj", h, h // tp), ("fc1", f // tp, h)]


def op_recompute_flops(model: ModelSpec, layout: Layout) -> float:
    """Extra forward flops of one layer and micro-batch on one device under ``recompute="op"``: ``2 T n k`` per
    recomputed matmul (module doc)."""
    tokens = model.micro_batch * model.seq_len / layout.cp
    return sum(2 * tokens * n * k for _, n, k in op_recomputed_gemms(model, layout.tp))
