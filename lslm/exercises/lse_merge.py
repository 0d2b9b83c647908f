"""Exercise of notebook 10: one block of ring attention and the log-sum-exp merge of two partial results.

The learner writes two functions:

* ``block_attention(q, k, v, diagonal)``: softmax attention of the queries ``q`` ``(..., Tq, D)`` over one block
  of keys and values ``(..., Tk, D)`` only, scores scaled by ``1/sqrt(D)``; returns ``(out, lse)``, ``out``
  ``(..., Tq, D)`` and ``lse`` ``(..., Tq)``, the log-sum-exp of each row's scores. On the **diagonal** block
  of a causal ring (query chunk = key chunk, ``Tq == Tk``) key ``j`` is visible from query ``i`` only when
  ``j <= i``;
* ``merge_partials(out_a, lse_a, out_b, lse_b)``: the ``(out, lse)`` of attention over the union of the two
  blocks' keys, from the two partial results alone (the online softmax of Milakov and Gimelshein 2018 that
  FlashAttention and ring attention use). ``lse_a = -inf`` with ``out_a = 0`` is "nothing seen yet".

The judge (:func:`_judge`, no processes) compares with :func:`lslm.context_parallel.merge_partials` and
full attention (``F.scaled_dot_product_attention``), case by case, and names the first mistake of three the
issue asks it to tell apart, plus the rest:

* ``mask``: the diagonal block is wrong while a full block is right (the mask hides the diagonal itself,
  hides nothing, or hides the wrong triangle);
* ``rescale``: the merged ``lse`` is right but the merged output is not: each partial output must be
  weighted by its share ``exp(lse_x - lse)`` of the new denominator (the running output left unscaled is
  the usual form of this mistake);
* ``unstable``: right on scores of a few units, but inf or nan once the scores (or the ``lse``) reach a few
  hundred: ``exp`` of a raw score overflows fp32 past 88.7; subtract the row's maximum first (or use
  ``torch.logsumexp`` / ``torch.logaddexp``);
* and ``type``, ``block``, ``lse``, ``empty`` and ``ring`` (a causal ring over four key blocks, the learner's
  two functions end to end, against full causal attention).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F

from lslm.context_parallel import merge_partials
from lslm.exercises.core import Verdict, report, run_local
from lslm.exercises.registry import Exercise, register

__all__ = ["HINTS", "check_merge_partials", "reference_block_attention", "reference_merge_partials"]

TOL = 1e-4  # fp32, outputs of order 1 and lse up to ~1e3 (relative): far above rounding, far below any mistake
SHAPE = (2, 3, 8, 4)  # (batch, heads, tokens per block, head dim)


def reference_block_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                              diagonal: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Our solution: scaled scores, the causal triangle on the diagonal block, a stable softmax and its lse."""
    s = torch.matmul(q, k.transpose(-2, -1)) * q.shape[-1] ** -0.5
    if diagonal:  # key j is visible from query i when j <= i: hide the strict upper triangle
        above = torch.ones(s.shape[-2], s.shape[-1], dtype=torch.bool, device=s.device).triu(1)
        s = s.masked_fill(above, float("-inf"))
    lse = torch.logsumexp(s, dim=-1)  # subtracts the row max inside: no overflow
    return torch.matmul(torch.exp(s - lse.unsqueeze(-1)), v), lse


def reference_merge_partials(out_a: torch.Tensor, lse_a: torch.Tensor, out_b: torch.Tensor,
                             lse_b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Our solution: ``lse = log(e^lse_a + e^lse_b)`` without exponentiating, each output weighted by its share."""
    lse = torch.logaddexp(lse_a, lse_b)
    return (out_a * torch.exp(lse_a - lse).unsqueeze(-1) + out_b * torch.exp(lse_b - lse).unsqueeze(-1)), lse


HINTS = {
    "type": "return a tuple (out, lse): out with the shape of q, lse with q's shape without its last dimension",
    "block": "scores = q @ k.transpose(-2, -1) / sqrt(D); out = softmax(scores) @ v; lse = logsumexp(scores) "
             "over the keys (the last dimension)",
    "mask": "on the diagonal block query i sees keys 0..i, its own position included: fill the strict upper "
            "triangle (torch.ones(T, T, dtype=torch.bool).triu(1)) with -inf before the softmax, nothing else",
    "unstable": "exp of a raw score overflows fp32 past 88.7: subtract the row's maximum before exp, or use "
                "torch.logsumexp for the block and torch.logaddexp(lse_a, lse_b) for the merge",
    "lse": "the merged lse is the log of the summed denominators: log(e^lse_a + e^lse_b) = "
           "torch.logaddexp(lse_a, lse_b)",
    "rescale": "each partial output is normalised by its own denominator e^lse_x; over the union the denominator "
               "is e^lse: weight each output by its share, out = out_a * exp(lse_a - lse) + out_b * exp(lse_b - lse) "
               "(the running output must be rescaled too, not only the new block)",
    "empty": "lse_a = -inf (nothing seen yet) must give exactly the block's own result: its share "
             "exp(-inf - lse) is 0; torch.logaddexp handles -inf, a hand-written max must too",
    "ring": "each function passes its own cases but the ring does not: run it by hand from out = 0, lse = -inf, "
            "merging key blocks 0, 1, ... up to the query's own (diagonal=True for that one), and compare with "
            "F.scaled_dot_product_attention(q, k, v, is_causal=True)",
}


def _draw(seed: int, scale: float, shape: tuple[int, ...] = SHAPE) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)  # the checker runs on the host: small tensors, fixed seeds
    return [torch.randn(*shape, generator=gen) * scale for _ in range(3)]  # lslm: cpu-ok (host-side checker)


def _close(got: torch.Tensor, want: torch.Tensor) -> bool:
    if got.shape != want.shape:
        return False
    finite = torch.isfinite(want)
    if not torch.equal(torch.isfinite(got), finite):
        return False
    if not finite.all() and not torch.equal(got[~finite], want[~finite]):
        return False
    return bool(torch.allclose(got[finite], want[finite], rtol=TOL, atol=TOL))


def _pair(result: Any, like: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor] | None:
    """``result`` as ``(out, lse)`` if it has the right types and shapes, else None."""
    if not isinstance(result, (tuple, list)) or len(result) != 2:
        return None
    out, lse = result
    if not (isinstance(out, torch.Tensor) and isinstance(lse, torch.Tensor)):
        return None
    if out.shape != like.shape or lse.shape != like.shape[:-1]:
        return None
    return out, lse


def _fail(kind: str, message: str, **details: Any) -> dict[str, Any]:
    return {"passed": False, "message": message, "hint": HINTS[kind], "details": {"kind": kind, **details}}


def _worst(got: torch.Tensor, want: torch.Tensor) -> str:
    if not torch.isfinite(got).all():
        bad = int((~torch.isfinite(got)).sum())
        return f"{bad} of {got.numel()} values are inf or nan"
    return f"max |got - expected| = {(got - want).abs().max().item():.3g}"


def _judge_block(block: Callable[..., Any]) -> dict[str, Any] | None:
    q, k, v = _draw(0, 1.0)
    for diagonal in (False, True):
        got = _pair(block(q.clone(), k.clone(), v.clone(), diagonal), q)
        if got is None:
            return _fail("type", f"block_attention(q, k, v, diagonal={diagonal}) with q, k, v of shape "
                                 f"{tuple(q.shape)} must return (out, lse) of shapes {tuple(q.shape)} and "
                                 f"{tuple(q.shape[:-1])}")
        want = reference_block_attention(q, k, v, diagonal)
        if not (_close(got[0], want[0]) and _close(got[1], want[1])):
            if diagonal:
                return _fail("mask", "block_attention on the diagonal block (diagonal=True) is wrong while a full "
                                     f"block is right: the causal mask is wrong ({_worst(got[0], want[0])} on out)")
            return _fail("block", f"block_attention on a full block (diagonal=False), scores of a few units: "
                                  f"out: {_worst(got[0], want[0])}; lse: {_worst(got[1], want[1])}")
    q, k, v = _draw(1, 10.0)  # scores of several hundred: exp() of a raw one overflows fp32
    for diagonal in (False, True):
        got = _pair(block(q.clone(), k.clone(), v.clone(), diagonal), q)
        want = reference_block_attention(q, k, v, diagonal)
        if got is None or not (_close(got[0], want[0]) and _close(got[1], want[1])):
            shown = _worst(got[0], want[0]) if got is not None else "not an (out, lse) pair"
            return _fail("unstable", "block_attention is right on scores of a few units but not on scores of "
                                     f"several hundred (largest |score| {_max_score(q, k):.0f}): {shown}; the "
                                     "numerically unstable form (exp without subtracting the maximum) overflows")
    return None


def _max_score(q: torch.Tensor, k: torch.Tensor) -> float:
    return (torch.matmul(q, k.transpose(-2, -1)) * q.shape[-1] ** -0.5).abs().max().item()


def _partials(seed: int, scale: float) -> tuple[torch.Tensor, ...]:
    q, k, v = _draw(seed, scale)
    k2, v2 = _draw(seed + 100, scale)[:2]
    out_a, lse_a = reference_block_attention(q, k, v, False)
    out_b, lse_b = reference_block_attention(q, k2, v2, False)
    return out_a, lse_a, out_b, lse_b


def _judge_merge(merge: Callable[..., Any]) -> dict[str, Any] | None:
    for scale in (1.0, 10.0):  # scores of a few units, then of several hundred
        args = _partials(7, scale)
        want = merge_partials(*args)
        got = _pair(merge(*(t.clone() for t in args)), args[0])
        if got is None:
            return _fail("type", "merge_partials(out_a, lse_a, out_b, lse_b) must return (out, lse) with the shapes "
                                 f"of out_a {tuple(args[0].shape)} and lse_a {tuple(args[1].shape)}")
        lse_ok, out_ok = _close(got[1], want[1]), _close(got[0], want[0])
        if lse_ok and out_ok:
            continue
        if scale > 1.0:
            return _fail("unstable", f"merge_partials is right for lse of a few units but not for lse of several "
                                     f"hundred (up to {args[1].max().item():.0f}): out: {_worst(got[0], want[0])}; "
                                     f"lse: {_worst(got[1], want[1])}; the numerically unstable form: exp(lse) "
                                     "overflows fp32")
        if not lse_ok:
            return _fail("lse", f"merge_partials: the merged lse is wrong ({_worst(got[1], want[1])})")
        return _fail("rescale", "merge_partials: the merged lse is right but the merged output is not "
                                f"({_worst(got[0], want[0])}): the partial outputs are not rescaled to the new "
                                "denominator")
    out_b, lse_b = _partials(8, 1.0)[2:]
    empty = (torch.zeros_like(out_b), torch.full_like(lse_b, float("-inf")))
    got = _pair(merge(empty[0], empty[1], out_b.clone(), lse_b.clone()), out_b)
    if got is None or not (_close(got[0], out_b) and _close(got[1], lse_b)):
        shown = _worst(got[0], out_b) if got is not None else "not an (out, lse) pair"
        return _fail("empty", f"merge_partials with nothing seen yet (out_a = 0, lse_a = -inf) must return the "
                              f"block's own (out, lse): {shown}")
    return None


def _ring(block: Callable[..., Any], merge: Callable[..., Any], blocks: int = 4) -> dict[str, Any] | None:
    """Causal attention of the last query block over ``blocks`` key blocks, one at a time, vs full attention."""
    q, k, v = _draw(3, 10.0, (SHAPE[0], SHAPE[1], blocks * SHAPE[2], SHAPE[3]))
    c = SHAPE[2]
    want = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    for qi in (0, blocks - 1):
        rows = slice(qi * c, (qi + 1) * c)
        out = torch.zeros_like(q[:, :, rows])
        lse = torch.full(out.shape[:-1], float("-inf"))  # lslm: cpu-ok (host-side checker)
        for kj in range(qi + 1):  # keys after the queries are skipped, as the ring skips them
            cols = slice(kj * c, (kj + 1) * c)
            part = block(q[:, :, rows], k[:, :, cols], v[:, :, cols], kj == qi)
            out, lse = merge(out, lse, *part)
        if not _close(out, want[:, :, rows]):
            return _fail("ring", f"query block {qi} merged over key blocks 0..{qi} (the last one diagonal) differs "
                                 f"from full causal attention: {_worst(out, want[:, :, rows])}")
    return None


def _judge_both(merge: Callable[..., Any], block: Callable[..., Any]) -> dict[str, Any]:
    for step in (lambda: _judge_block(block), lambda: _judge_merge(merge), lambda: _ring(block, merge)):
        failed = step()
        if failed is not None:
            return failed
    return {"passed": True, "message": "block_attention and merge_partials match full attention on every case "
                                       "(full and diagonal blocks, scores of several hundred, nothing seen yet, a "
                                       "causal ring of 4 blocks)"}


def check_merge_partials(merge: Callable[..., Any], block: Callable[..., Any]) -> Verdict:
    """Check the learner's ``merge_partials(out_a, lse_a, out_b, lse_b)`` and ``block_attention(q, k, v, diagonal)``
    (module doc); print the verdict. Nothing is launched."""
    verdict = run_local((merge, block), lambda _: _judge_both(merge, block), exercise="merge_partials")
    return report(verdict)


register(Exercise(
    name="merge_partials", notebook="10_beyond", reference=reference_merge_partials, check=check_merge_partials,
    reference_helpers=(reference_block_attention,),
    hints=("block: scores = q @ k^T / sqrt(D), masked above the diagonal on the diagonal block, then lse = "
           "logsumexp(scores) and out = exp(scores - lse) @ v. Merge: the new denominator is e^lse_a + e^lse_b; "
           "each partial output was divided by its own, so weight it by its share",
           "lse = torch.logaddexp(lse_a, lse_b); out = out_a * exp(lse_a - lse)[..., None] + out_b * "
           f"exp(lse_b - lse)[..., None]; never exp() a raw score (fp32 overflows past {math.log(2.0**128):.1f})"),
))
