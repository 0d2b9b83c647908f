"""Floating-point formats as facts read from torch, and where real gradients fall in them.

A binary float with ``e`` exponent and ``m`` mantissa (fraction) bits stores
``(-1)^s · 2^(E - bias) · 1.M`` (normal, ``1 <= E <= 2^e - 2``) or
``(-1)^s · 2^(1 - bias) · 0.M`` (subnormal, ``E = 0``). Everything here is computed from
``torch.finfo`` (``eps = 2^-m``, ``smallest_normal = 2^(1 - bias)``, ``max``), not typed in,
so the table is whatever the installed torch implements (IEEE 754 for fp32 / fp16, bf16,
and the OCP 8-bit formats ``float8_e4m3fn`` / ``float8_e5m2`` of Micikevicius et al. 2022,
"FP8 Formats for Deep Learning", §3, Table 1).

Rounding is to nearest, ties to even: the relative error of one rounding is at most the
*unit roundoff* ``u = eps / 2`` (fp16 2^-11, bf16 2^-8). A value below half the smallest
subnormal becomes 0 (underflow); one at or above ``max + ulp(max) / 2`` becomes inf
(overflow), except in torch's ``float8_e4m3fn``, which has no inf and whose cast
*saturates* to ±448 (measured: ``torch.tensor(1e4).to(torch.float8_e4m3fn)`` is 448).

The second half measures gradients against a format: :func:`grad_exponent_histogram`
(their binary exponents), :func:`underflow_report` (what the cast of ``g · scale`` does to
them) and :func:`underflow_window` (that, for every power-of-two loss scale: the window
a loss scaler slides, Micikevicius et al. 2018, "Mixed Precision Training", §3.2, Fig. 3).
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

__all__ = ["FORMATS", "FloatFormat", "bit_layout", "format_of", "format_table", "grad_exponent_histogram",
           "underflow_report", "underflow_window"]

# The integer type of each width, to read a float's bits without changing them (Tensor.view(dtype)).
_INT_OF_WIDTH = {32: torch.int32, 16: torch.int16, 8: torch.uint8}


@dataclass(frozen=True)
class FloatFormat:
    """One binary floating-point format, every number derived from ``torch.finfo(dtype)``.

    ``max`` / ``smallest_normal`` / ``smallest_subnormal`` are magnitudes; ``eps`` is the
    spacing of the numbers in [1, 2) (``2^-mantissa_bits``); ``has_inf`` is measured (cast
    ``inf`` and look).
    """

    name: str
    dtype: torch.dtype
    bits: int
    sign_bits: int
    exponent_bits: int
    mantissa_bits: int
    bias: int
    max: float
    smallest_normal: float
    smallest_subnormal: float
    eps: float
    has_inf: bool

    @property
    def unit_roundoff(self) -> float:
        """``u = eps / 2``: the largest relative error of one rounding to nearest (Higham 2002, §2.1)."""
        return self.eps / 2

    @property
    def decimal_digits(self) -> float:
        """Significant decimal digits, ``(mantissa_bits + 1) · log10 2`` (the implicit leading bit counts)."""
        return (self.mantissa_bits + 1) * math.log10(2)

    @property
    def overflow_threshold(self) -> float:
        """The smallest magnitude that rounds past ``max``: ``max + ulp(max) / 2`` (IEEE round to nearest)."""
        return self.max + 2.0 ** (math.floor(math.log2(self.max)) - self.mantissa_bits - 1)

    @property
    def log2_range(self) -> tuple[int, int, int]:
        """``(log2 smallest_subnormal, log2 smallest_normal, floor(log2 max))``: the span on a log2 axis."""
        return (round(math.log2(self.smallest_subnormal)), round(math.log2(self.smallest_normal)),
                math.floor(math.log2(self.max)))


def _format(name: str, dtype: torch.dtype) -> FloatFormat:
    fi = torch.finfo(dtype)
    mantissa = round(-math.log2(fi.eps))  # eps = 2^-m exactly
    inf = torch.tensor(float("inf"), dtype=torch.float32, device="cpu").to(dtype)  # lslm: cpu-ok (a fact of the dtype)
    return FloatFormat(name=name, dtype=dtype, bits=fi.bits, sign_bits=1, exponent_bits=fi.bits - 1 - mantissa,
                       mantissa_bits=mantissa, bias=1 - round(math.log2(fi.smallest_normal)), max=float(fi.max),
                       smallest_normal=float(fi.smallest_normal), smallest_subnormal=float(fi.smallest_normal * fi.eps),
                       eps=float(fi.eps), has_inf=bool(torch.isinf(inf.float()).item()))


#: fp32, fp16, bf16 and the two 8-bit formats, by name.
FORMATS: dict[str, FloatFormat] = {n: _format(n, d) for n, d in (
    ("fp32", torch.float32), ("fp16", torch.float16), ("bf16", torch.bfloat16),
    ("fp8_e4m3", torch.float8_e4m3fn), ("fp8_e5m2", torch.float8_e5m2))}


def format_of(dtype: torch.dtype | str) -> FloatFormat:
    """The :class:`FloatFormat` of a torch dtype or a name of :data:`FORMATS`."""
    for f in FORMATS.values():
        if dtype == f.dtype or dtype == f.name:
            return f
    raise ValueError(f"no float format for {dtype!r}; known: {list(FORMATS)} "
                     f"({', '.join(str(f.dtype) for f in FORMATS.values())})")


def format_table() -> list[dict[str, Any]]:
    """One row per format of :data:`FORMATS` (bit counts, bias, range, eps, u, digits), for printing."""
    return [{"format": f.name, "bits": f.bits, "sign": f.sign_bits, "exponent": f.exponent_bits,
             "mantissa": f.mantissa_bits, "bias": f.bias, "max": f.max, "smallest normal": f.smallest_normal,
             "smallest subnormal": f.smallest_subnormal, "eps": f.eps, "unit roundoff": f.unit_roundoff,
             "decimal digits": round(f.decimal_digits, 2), "inf": f.has_inf} for f in FORMATS.values()]


def bit_layout(x: float, dtype: torch.dtype | str) -> dict[str, Any]:
    """``x`` rounded to ``dtype``: its sign, exponent and mantissa bit strings, the value stored and the error.

    ``x`` is a Python float (fp64). torch converts fp64 to a smaller format *through fp32*
    (measured: ``1 + 2^-11 + 2^-40``, just above an fp16 tie, gives 1.0, not ``1 + 2^-10``),
    so a value within fp32's rounding of a tie can be rounded twice. Keys: ``format``,
    ``value`` (``x``), ``stored`` (the rounded value, exact), ``sign`` / ``exponent`` /
    ``mantissa`` (bit strings, most significant first), ``kind`` (``zero``, ``subnormal``,
    ``normal``, ``inf``, ``nan``), ``abs_error`` (``stored - x``) and ``rel_error``
    (``abs_error / |x|``, at most the unit roundoff for a normal result).
    """
    f = format_of(dtype)
    t = torch.tensor([x], dtype=torch.float64, device="cpu").to(f.dtype)  # lslm: cpu-ok (one scalar's bits)
    raw = int(t.view(_INT_OF_WIDTH[f.bits]).item()) & ((1 << f.bits) - 1)  # two's complement -> unsigned
    bits = format(raw, f"0{f.bits}b")
    sign, exponent, mantissa = bits[0], bits[1:1 + f.exponent_bits], bits[1 + f.exponent_bits:]
    stored = float(t.double().item())
    if math.isnan(stored):
        kind = "nan"
    elif math.isinf(stored):
        kind = "inf"
    elif stored == 0:
        kind = "zero"
    else:
        kind = "subnormal" if abs(stored) < f.smallest_normal else "normal"
    finite = math.isfinite(stored) and math.isfinite(x)
    err = stored - x if finite else math.nan
    return {"format": f.name, "value": x, "stored": stored, "sign": sign, "exponent": exponent,
            "mantissa": mantissa, "kind": kind, "abs_error": err,
            "rel_error": abs(err) / abs(x) if finite and x != 0 else math.nan}


# -- gradients against a format -------------------------------------------------------------------
def _flat_fp32(grads: Iterable[torch.Tensor | None]) -> torch.Tensor:
    """All entries of ``grads`` (``None`` skipped) as one fp32 vector on the first tensor's device."""
    found = [g.detach().reshape(-1).float() for g in grads if g is not None]
    if not found:
        raise ValueError("no gradients given (an empty list, or every entry None): run backward first")
    return torch.cat([g.to(found[0].device) for g in found])


def grad_exponent_histogram(grads: Iterable[torch.Tensor | None], bins: Sequence[int] | None = None) -> dict[str, Any]:
    """Counts of ``floor(log2 |g|)`` over every nonzero entry of ``grads``, zeros counted apart.

    The exponent comes from ``torch.frexp`` (``|g| = m · 2^e``, ``m`` in [0.5, 1), so
    ``floor(log2 |g|) = e - 1``): exact, fp32 subnormals included. ``bins``: the integer
    exponents to count (e.g. ``range(-40, 1)``); ``None`` spans the data. Returns
    ``exponents``, ``counts`` (same length), ``zeros``, ``below`` / ``above`` (nonzero
    entries outside ``bins``), ``nonzero`` and ``total``.
    """
    g = _flat_fp32(grads)
    nonzero = g[g != 0]
    exps = torch.frexp(nonzero.abs())[1].long() - 1
    if bins is None:
        bins = range(int(exps.min()), int(exps.max()) + 1) if exps.numel() else range(0)
    bins = [int(b) for b in bins]
    if bins and bins != list(range(bins[0], bins[0] + len(bins))):
        raise ValueError(f"bins must be consecutive increasing integer exponents (e.g. range(-40, 1)), got {bins}")
    lo, hi = (bins[0], bins[-1]) if bins else (0, -1)
    inside = (exps >= lo) & (exps <= hi)
    counts = torch.bincount(exps[inside] - lo, minlength=len(bins)).tolist() if bins else []
    below = int((exps < lo).sum()) if bins else 0
    return {"exponents": bins, "counts": [int(c) for c in counts], "zeros": int((g == 0).sum()), "below": below,
            "above": int(nonzero.numel()) - below - sum(counts), "nonzero": int(nonzero.numel()),
            "total": int(g.numel())}


def underflow_report(grads: Iterable[torch.Tensor | None], dtype: torch.dtype | str,
                     scale: float = 1.0) -> dict[str, Any]:
    """What casting ``g · scale`` to ``dtype`` does to the nonzero entries of ``grads``: fractions of them.

    ``g · scale`` is computed in fp32 (exact for a power-of-two scale), then cast with
    torch's rounding. ``underflow``: the cast is 0 (``|g · scale|`` at most half the smallest
    subnormal): the gradient is lost. ``subnormal``: nonzero but below the smallest normal,
    so fewer than ``mantissa_bits`` significant bits survive. ``overflow``: the cast is not
    finite, or ``|g · scale| >= max + ulp(max)/2`` (e4m3fn saturates instead of giving inf:
    counted here all the same). ``normal``: the rest. The four fractions sum to 1; ``zeros``
    (entries already 0 in fp32, left out) and ``nonzero`` are counts.
    """
    if not (math.isfinite(scale) and scale > 0):
        raise ValueError(f"scale must be a finite number > 0, got {scale!r}")
    f = format_of(dtype)
    g = _flat_fp32(grads)
    x = g[g != 0] * scale
    n = x.numel()
    if n == 0:
        raise ValueError("every gradient entry is 0: nothing to classify (did backward run?)")
    cast = x.to(f.dtype).float()
    over = ~torch.isfinite(cast) | (x.abs() >= f.overflow_threshold)
    under = (cast == 0) & ~over
    sub = (cast != 0) & (cast.abs() < f.smallest_normal) & ~over
    counts = {k: int(v.sum()) for k, v in (("underflow", under), ("subnormal", sub), ("overflow", over))}
    counts["normal"] = n - sum(counts.values())
    return {"format": f.name, "scale": float(scale), **{k: c / n for k, c in counts.items()},
            "zeros": int(g.numel() - n), "nonzero": n}


def underflow_window(grads: Iterable[torch.Tensor | None], dtype: torch.dtype | str = torch.float16,
                     log2_scales: Iterable[int] = range(0, 25)) -> list[dict[str, Any]]:
    """:func:`underflow_report` at each scale ``2^k`` of ``log2_scales``; each row also has ``log2_scale``.

    Raising the scale moves every gradient's exponent up by ``k``: underflow falls, and
    overflow appears once the largest gradient times ``2^k`` passes the format's max.
    The rows show the window of scales where both are small.
    """
    grads = [g for g in grads if g is not None]  # read several times
    return [{"log2_scale": int(k), **underflow_report(grads, dtype, 2.0 ** k)} for k in log2_scales]
