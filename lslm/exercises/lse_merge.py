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

The judge (no processes) compares with the references below and with full attention
(``F.scaled_dot_product_attention``), case by case, and names the first mistake:

* ``mask``: the diagonal block is wrong while a full block is right (the mask hides the diagonal itself,
  hides nothing, or hides the wrong triangle);
* ``scale``: a full block matches attention with scores scaled by something other than ``1/sqrt(D)``
  (a constant 0.5, ``1/len(q)``, ...). Shapes vary (batch 3 and 1, head dims 8 and 16, ``Tq != Tk`` on
  full blocks), so no other expression of the shape equals ``1/sqrt(D)`` by accident;
* ``rescale``: the merged ``lse`` is right but the merged output is not: each partial output must be
  weighted by its share ``exp(lse_x - lse)`` of the new denominator (the running output left unscaled is
  the usual form of this mistake);
* ``unstable``: right on scores of a few units, but inf or nan on larger ones: fp32 scores of several
  hundred (``exp`` overflows fp32 past 88.7), then float64 inputs with scores of a few thousand
  (``exp`` overflows float64 past 709.8, so computing the naive form in float64 fails there too);
* ``empty`` and ``both_empty``: ``lse = -inf`` on one side ("nothing seen yet", or a block no row
  reaches) must leave the other side's result; on both sides (a row no key reached yet) the output is
  0 and the ``lse`` stays ``-inf``, not nan;
* and ``type``, ``block``, ``lse`` and ``ring`` (a causal ring over four key blocks, the learner's two
  functions end to end, against full causal attention).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F

from lslm.exercises.core import Verdict, report, run_local
from lslm.exercises.registry import Exercise, register

__all__ = ["HINTS", "check_merge_partials", "reference_block_attention", "reference_merge_partials"]

TOL = 1e-4  # outputs of order 1-30 and lse up to a few thousand (relative): far above rounding, far below any mistake
# (batch, heads, query tokens, key tokens, head dim): batch and head dim differ between cases, and so do Tq and Tk
# on full blocks, so that 1/sqrt(D) is not 1/len(q), 0.5 or any other expression of the shape.
FULL_SHAPES = ((3, 2, 5, 7, 8), (1, 4, 6, 3, 16))
DIAGONAL_SHAPES = ((3, 2, 5, 5, 8), (1, 4, 6, 6, 16))  # the diagonal block: query chunk = key chunk
LARGE = ((torch.float32, 10.0), (torch.float64, 30.0))  # scores of several hundred, then of a few thousand


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
    """Our solution: ``lse = log(e^lse_a + e^lse_b)`` without exponentiating, each output weighted by its share.

    A row neither block reached has ``lse = -inf`` on both sides, and so merged: its shares measured from
    that ``lse`` would be ``exp(-inf + inf) = nan``; measured from 0 they are ``exp(-inf) = 0``, so its
    output is 0 (attention over no key sums nothing) and its ``lse`` stays ``-inf``.
    """
    lse = torch.logaddexp(lse_a, lse_b)
    base = torch.where(torch.isneginf(lse), torch.zeros_like(lse), lse)
    return (out_a * torch.exp(lse_a - base).unsqueeze(-1) + out_b * torch.exp(lse_b - base).unsqueeze(-1)), lse


HINTS = {
    "type": "return a tuple (out, lse): out with the shape of q, lse with q's shape without its last dimension",
    "block": "scores = q @ k.transpose(-2, -1) / sqrt(D); out = softmax(scores) @ v; lse = logsumexp(scores) "
             "over the keys (the last dimension)",
    "scale": "scale the scores by 1/sqrt(D), D = q.shape[-1], the head dimension: not the batch (len(q)), not the "
             "number of tokens, not a constant (0.5 is 1/sqrt(D) only when D = 4)",
    "mask": "on the diagonal block query i sees keys 0..i, its own position included: fill the strict upper "
            "triangle (torch.ones(T, T, dtype=torch.bool).triu(1)) with -inf before the softmax, nothing else",
    "unstable": "exp of a raw score overflows fp32 past 88.7 and float64 past 709.8, so computing in float64 only "
                "moves the wall: subtract the row's maximum before exp, or use torch.logsumexp for the block and "
                "torch.logaddexp(lse_a, lse_b) for the merge",
    "lse": "the merged lse is the log of the summed denominators: log(e^lse_a + e^lse_b) = "
           "torch.logaddexp(lse_a, lse_b)",
    "rescale": "each partial output is normalised by its own denominator e^lse_x; over the union the denominator "
               "is e^lse: weight each output by its share, out = out_a * exp(lse_a - lse) + out_b * exp(lse_b - lse) "
               "(the running output must be rescaled too, not only the new block)",
    "empty": "lse_x = -inf (nothing seen yet, or a block no key of which a row sees) must leave exactly the other "
             "side's result: its share exp(-inf - lse) is 0; torch.logaddexp handles -inf, a hand-written max must "
             "too",
    "both_empty": "a row with lse = -inf on both sides has seen no key at all: its merged lse is -inf and its "
                  "output 0, but exp(lse_a - lse) is then exp(-inf + inf) = nan: take the shares from 0 where the "
                  "merged lse is -inf (torch.where(torch.isneginf(lse), 0, lse))",
    "ring": "each function passes its own cases but the ring does not: run it by hand from out = 0, lse = -inf, "
            "merging key blocks 0, 1, ... up to the query's own (diagonal=True for that one), and compare with "
            "F.scaled_dot_product_attention(q, k, v, is_causal=True)",
}


def _draw(seed: int, scale: float, shape: tuple[int, ...], dtype: torch.dtype = torch.float32) -> list[torch.Tensor]:
    """q, k, v of ``shape`` = (batch, heads, Tq, Tk, D): q has Tq rows, k and v Tk."""
    b, h, tq, tk, d = shape
    gen = torch.Generator().manual_seed(seed)  # the checker runs on the host: small tensors, fixed seeds
    q, k, v = (torch.randn(b, h, t, d, generator=gen, dtype=torch.float64) * scale  # lslm: cpu-ok (host checker)
               for t in (tq, tk, tk))
    return [t.to(dtype) for t in (q, k, v)]


def _close(got: torch.Tensor, want: torch.Tensor) -> bool:
    if got.shape != want.shape:
        return False
    got = got.detach().to(want.dtype)  # an fp32 answer to float64 inputs is judged by its values, not its dtype
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
    """What is wrong with ``got``, in a few words: values gone inf or nan, else the largest difference."""
    got = got.detach().to(want.dtype)
    odd = ~torch.isfinite(got) & (got != want)  # -inf where -inf is expected is right
    if odd.any():
        what = "nan" if torch.isnan(got[odd]).all() else "inf or nan"
        return f"{int(odd.sum())} of {got.numel()} values are {what}"
    finite = torch.isfinite(want)
    if not torch.equal(torch.isfinite(got), finite):
        return f"{int((torch.isfinite(got) & ~finite).sum())} values are finite where -inf is expected"
    if not finite.any():
        return "every value as expected"
    return f"max |got - expected| = {(got[finite] - want[finite]).abs().max().item():.3g}"


def _wrong_scale(got: tuple[torch.Tensor, torch.Tensor], q: torch.Tensor, k: torch.Tensor,
                 v: torch.Tensor) -> str | None:
    """The expression of the shape that ``got`` used to scale a full block's scores, if it is a usual one."""
    b, h, tq, d = q.shape
    tk = k.shape[-2]
    right = d ** -0.5
    usual = {"1 (no scaling)": 1.0, "0.5": 0.5, "1/D": 1 / d, "1/len(q) (the batch)": 1 / b,
             "1/sqrt(len(q))": b ** -0.5, "1/heads": 1 / h, "1/sqrt(Tq)": tq ** -0.5, "1/sqrt(Tk)": tk ** -0.5,
             "sqrt(D)": d ** 0.5}
    raw = torch.matmul(q, k.transpose(-2, -1))
    for name, c in usual.items():
        if math.isclose(c, right):
            continue
        lse = torch.logsumexp(raw * c, dim=-1)
        out = torch.matmul(torch.exp(raw * c - lse.unsqueeze(-1)), v)
        if _close(got[0], out) and _close(got[1], lse):
            return name
    return None


def _judge_block(block: Callable[..., Any]) -> dict[str, Any] | None:
    for seed, (shape, diagonal) in enumerate([(s, False) for s in FULL_SHAPES] + [(s, True) for s in DIAGONAL_SHAPES]):
        q, k, v = _draw(seed, 1.0, shape)
        got = _pair(block(q.clone(), k.clone(), v.clone(), diagonal), q)
        if got is None:
            return _fail("type", f"block_attention(q, k, v, diagonal={diagonal}) with q of shape {tuple(q.shape)} "
                                 f"and k, v of shape {tuple(k.shape)} must return (out, lse) of shapes "
                                 f"{tuple(q.shape)} and {tuple(q.shape[:-1])}")
        want = reference_block_attention(q, k, v, diagonal)
        if _close(got[0], want[0]) and _close(got[1], want[1]):
            continue
        if diagonal:
            return _fail("mask", "block_attention on the diagonal block (diagonal=True) is wrong while full blocks "
                                 f"are right: the causal mask is wrong ({_worst(got[0], want[0])} on out)")
        used = _wrong_scale(got, q, k, v)
        if used is not None:
            return _fail("scale", f"block_attention on a full block, q {tuple(q.shape)}, k {tuple(k.shape)}: the "
                                  f"scores were scaled by {used}, not 1/sqrt(D) = {q.shape[-1] ** -0.5:.4g} "
                                  f"(D = q.shape[-1] = {q.shape[-1]})", used=used)
        return _fail("block", f"block_attention on a full block (diagonal=False), q {tuple(q.shape)}, k "
                              f"{tuple(k.shape)}, scores of a few units: out: {_worst(got[0], want[0])}; lse: "
                              f"{_worst(got[1], want[1])}")
    for dtype, scale in LARGE:  # exp() of a raw score overflows fp32, then float64
        for shape, diagonal in ((FULL_SHAPES[0], False), (DIAGONAL_SHAPES[0], True)):
            q, k, v = _draw(11, scale, shape, dtype)
            got = _pair(block(q.clone(), k.clone(), v.clone(), diagonal), q)
            want = reference_block_attention(q, k, v, diagonal)
            if got is None or not (_close(got[0], want[0]) and _close(got[1], want[1])):
                shown = _worst(got[0], want[0]) if got is not None else "not an (out, lse) pair"
                name = _dtype(dtype)
                return _fail("unstable", f"block_attention is right on scores of a few units but not on {name} "
                                         f"scores up to {_max_score(q, k):.0f} (diagonal={diagonal}): {shown}; the "
                                         f"numerically unstable form (exp without subtracting the maximum) overflows "
                                         f"{name} past {_exp_limit(dtype):.1f}", dtype=name)
    return None


def _dtype(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _exp_limit(dtype: torch.dtype) -> float:
    """The largest x whose exp(x) is finite in ``dtype``."""
    return math.log(torch.finfo(dtype).max)


def _max_score(q: torch.Tensor, k: torch.Tensor) -> float:
    return (torch.matmul(q, k.transpose(-2, -1)) * q.shape[-1] ** -0.5).abs().max().item()


def _partials(seed: int, scale: float, dtype: torch.dtype = torch.float32) -> tuple[torch.Tensor, ...]:
    """Two blocks' (out, lse) for the same queries: key blocks of 7 and 3 tokens."""
    q, k, v = _draw(seed, scale, FULL_SHAPES[0], dtype)
    k2, v2 = _draw(seed + 100, scale, (*FULL_SHAPES[0][:3], 3, FULL_SHAPES[0][4]), dtype)[1:]
    out_a, lse_a = reference_block_attention(q, k, v, False)
    out_b, lse_b = reference_block_attention(q, k2, v2, False)
    return out_a, lse_a, out_b, lse_b


def _judge_merge(merge: Callable[..., Any]) -> dict[str, Any] | None:
    for dtype, scale in ((torch.float32, 1.0), *LARGE):  # lse of a few units, of several hundred, of thousands
        args = _partials(7, scale, dtype)
        want = reference_merge_partials(*args)
        got = _pair(merge(*(t.clone() for t in args)), args[0])
        if got is None:
            return _fail("type", "merge_partials(out_a, lse_a, out_b, lse_b) must return (out, lse) with the shapes "
                                 f"of out_a {tuple(args[0].shape)} and lse_a {tuple(args[1].shape)}")
        lse_ok, out_ok = _close(got[1], want[1]), _close(got[0], want[0])
        if lse_ok and out_ok:
            continue
        if scale > 1.0:
            return _fail("unstable", f"merge_partials is right for lse of a few units but not for {_dtype(dtype)} lse "
                                     f"of up to {args[1].max().item():.0f}: out: {_worst(got[0], want[0])}; lse: "
                                     f"{_worst(got[1], want[1])}; the numerically unstable form: exp(lse) overflows "
                                     f"{_dtype(dtype)} past {_exp_limit(dtype):.1f}", dtype=_dtype(dtype))
        if not lse_ok:
            return _fail("lse", f"merge_partials: the merged lse is wrong ({_worst(got[1], want[1])})")
        return _fail("rescale", "merge_partials: the merged lse is right but the merged output is not "
                                f"({_worst(got[0], want[0])}): the partial outputs are not rescaled to the new "
                                "denominator")
    out_a, lse_a, out_b, lse_b = _partials(8, 1.0)
    nothing = (torch.zeros_like(out_b), torch.full_like(lse_b, float("-inf")))
    for side, args, want in (("lse_a = -inf (nothing seen yet), out_a = 0", (*nothing, out_b, lse_b), (out_b, lse_b)),
                             ("lse_b = -inf (a block no row sees), out_b = 0", (out_a, lse_a, *nothing),
                              (out_a, lse_a))):
        got = _pair(merge(*(t.clone() for t in args)), out_b)
        if got is None or not (_close(got[0], want[0]) and _close(got[1], want[1])):
            shown = _worst(got[0], want[0]) if got is not None else "not an (out, lse) pair"
            return _fail("empty", f"merge_partials with {side} must return the other side's (out, lse): {shown}")
    # Every other row has seen no key on either side: out 0 and lse -inf there, the merge elsewhere.
    none = torch.zeros(lse_a.shape[-1], dtype=torch.bool)  # lslm: cpu-ok (host-side checker)
    none[::2] = True
    args = (out_a.masked_fill(none.unsqueeze(-1), 0.0), lse_a.masked_fill(none, float("-inf")),
            out_b.masked_fill(none.unsqueeze(-1), 0.0), lse_b.masked_fill(none, float("-inf")))
    want = reference_merge_partials(*args)
    got = _pair(merge(*(t.clone() for t in args)), out_a)
    if got is None or not (_close(got[0], want[0]) and _close(got[1], want[1])):
        shown = (f"out: {_worst(got[0][..., none, :], want[0][..., none, :])}; lse: "
                 f"{_worst(got[1][..., none], want[1][..., none])}" if got is not None else "not an (out, lse) pair")
        return _fail("both_empty", "merge_partials on rows with lse_a = lse_b = -inf (no key seen on either side) "
                                   f"must give out = 0 and lse = -inf there: {shown}")
    return None


def _ring(block: Callable[..., Any], merge: Callable[..., Any], blocks: int = 4) -> dict[str, Any] | None:
    """Causal attention of the first and last query blocks over their key blocks, one at a time, vs full attention."""
    b, h, c, _, d = DIAGONAL_SHAPES[0]
    q, k, v = _draw(3, 10.0, (b, h, blocks * c, blocks * c, d))
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
                                       "(full blocks with Tq != Tk and diagonal blocks of two shapes, fp32 scores "
                                       "of several hundred and float64 ones of thousands, a side or both with "
                                       "lse = -inf, a causal ring of 4 blocks)"}


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
           "lse = torch.logaddexp(lse_a, lse_b); base = lse where finite, 0 where -inf (a row no key reached); "
           "out = out_a * exp(lse_a - base)[..., None] + out_b * exp(lse_b - base)[..., None]; never exp() a raw "
           f"score (fp32 overflows past {_exp_limit(torch.float32):.1f}, float64 past "
           f"{_exp_limit(torch.float64):.1f})"),
))
