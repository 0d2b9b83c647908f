"""fp8 emulated on the CPU: quantise -> dequantise with per-tensor, MX and DeepSeek-V3 scaling.

An fp8 number has 3 (e4m3) or 2 (e5m2) mantissa bits and a narrow range (e4m3: 2^-9 to
448), so a tensor is stored as ``q = fp8(x / s)`` with a *scale* ``s`` chosen so that its
largest magnitude lands near the format's maximum, and read back as ``q · s``. Formats:
Micikevicius et al. 2022, "FP8 Formats for Deep Learning", §3 (e4m3 with no inf and a max
of 448, e5m2 IEEE-like); torch's ``float8_e4m3fn`` / ``float8_e5m2`` implement them and cast
on the CPU. The schemes differ in how many elements share one scale and how it is found:

* **per tensor** (Micikevicius et al. 2022, §2: a tensor is scaled before the cast and unscaled
  after, one scale per tensor, here from its amax):
  ``s = amax / fp8_max``; with **delayed scaling** (:class:`DelayedScaling`, the recipe of
  NVIDIA's Transformer Engine) ``amax`` is the maximum of a *history* of past amaxes, so the
  scale is known before the tensor is (one pass over the data, not two) and a value above
  the history's max saturates;
* **MX** (OCP Microscaling Formats Specification v1.0, §5: blocks of k = 32 consecutive
  elements, one shared **E8M0** scale, a power of two from 2^-127 to 2^127; §6.3: the shared
  exponent is ``floor(log2 amax) - emax_elem``, ``emax_elem`` the element format's largest
  exponent, 8 for e4m3, and elements above the element max are clamped to it);
* **DeepSeek-V3 tiles** (DeepSeek-AI 2024, "DeepSeek-V3 Technical Report", §3.3.2:
  activations in 1 x 128 tiles, one scale per token per 128 channels; weights in 128 x 128
  blocks; online scales ``amax / 448`` in fp32; e4m3 for every tensor).

Blocks run along a matmul's *contraction* dimension, so each block's scale factors out of
the partial dot products: for ``y = x W^T`` both ``x`` (tokens x in) and ``W`` (out x in)
are blocked along ``in``; for the input gradient ``g W`` along ``out``; for the weight
gradient ``g^T x`` along tokens. Square 128 x 128 weight blocks serve both orientations.

What is emulated: every GEMM operand is rounded exactly as an fp8 tensor with its scales
would store it, then the product is taken in fp32 (fp8 tensor cores accumulate in higher
precision too; DeepSeek-V3 §3.3.2 promotes partial sums to fp32 every 128 elements).
Nothing here is fast: it measures what the rounding costs, not what fp8 saves.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

__all__ = ["FP8_DTYPES", "RECIPES", "SCALE_RULES", "DelayedScaling", "Fp8Linear", "Fp8Recipe", "Fp8Tensor",
           "OperandQuantizer", "block_shape", "emulate_fp8", "quantize", "relative_error"]

#: The two OCP fp8 formats by short name (torch dtypes; both cast on the CPU).
FP8_DTYPES = {"e4m3": torch.float8_e4m3fn, "e5m2": torch.float8_e5m2}

# Largest exponent of a normal element: 448 = 1.75 · 2^8, 57344 = 1.75 · 2^15 (OCP MX v1.0 §6.3's emax_elem).
_EMAX_ELEM = {torch.float8_e4m3fn: 8, torch.float8_e5m2: 15, torch.bfloat16: 127, torch.float16: 15}
_E8M0_MIN, _E8M0_MAX = -127, 127  # the exponents an E8M0 scale can hold (0xFF is NaN)
SCALE_RULES = ("amax", "e8m0", "e8m0_up", "none")


def _dtype(fmt: str | torch.dtype) -> torch.dtype:
    if isinstance(fmt, torch.dtype):
        if fmt not in _EMAX_ELEM:
            raise ValueError(f"unsupported element dtype {fmt}; use one of {list(FP8_DTYPES)}, torch.bfloat16 or "
                             "torch.float16")
        return fmt
    if fmt not in FP8_DTYPES:
        raise ValueError(f"unknown fp8 format {fmt!r}; expected one of {list(FP8_DTYPES)}")
    return FP8_DTYPES[fmt]


def _saturating_cast(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``x`` cast to ``dtype``, magnitudes above its max clamped to it (saturation, never inf; NaN stays NaN)."""
    top = torch.finfo(dtype).max
    return x.clamp(-top, top).to(dtype)


@dataclass
class Fp8Tensor:
    """A tensor as fp8 stores it: ``data`` (the element dtype, ``x``'s shape) and one ``scale`` per block.

    ``x ≈ data · scale``, the scale broadcast over its block. ``block``: the block shape on the
    2-D view ``(rows, last dim)`` of ``x``; ``scale`` has shape ``(ceil(rows / br), ceil(cols / bc))``.
    """

    data: torch.Tensor
    scale: torch.Tensor
    block: tuple[int, int]

    def dequantize(self) -> torch.Tensor:
        """``data · scale`` in fp32, in ``data``'s shape."""
        shape = self.data.shape
        q = self.data.float().reshape(-1, shape[-1]) if self.data.dim() else self.data.float().reshape(1, 1)
        s = self.scale.repeat_interleave(self.block[0], 0).repeat_interleave(self.block[1], 1)
        return (q * s[:q.shape[0], :q.shape[1]]).reshape(shape)


def block_shape(shape: tuple[int, int], block: tuple[int | None, int | None]) -> tuple[int, int]:
    """``block`` on a 2-D ``shape`` with ``None`` meaning the whole dimension; sizes checked to be >= 1."""
    out = tuple(n if b is None else b for n, b in zip(shape, block))
    if len(block) != 2 or any(not isinstance(b, int) or b < 1 for b in out):
        raise ValueError(f"block must be two sizes >= 1 (or None for a whole dimension), got {block!r}")
    return out  # type: ignore[return-value]


def _block_amax(x2: torch.Tensor, br: int, bc: int) -> torch.Tensor:
    rows, cols = x2.shape
    pr, pc = -rows % br, -cols % bc  # zero padding does not change a block's amax
    a = torch.nn.functional.pad(x2.abs(), (0, pc, 0, pr))
    return a.reshape((rows + pr) // br, br, (cols + pc) // bc, bc).amax(dim=(1, 3))


def quantize(x: torch.Tensor, fmt: str | torch.dtype = "e4m3", block: tuple[int | None, int | None] = (None, None),
             scale_rule: str = "amax", amax: torch.Tensor | float | None = None) -> Fp8Tensor:
    """Quantise ``x`` to ``fmt`` with one scale per ``block`` of its 2-D view ``(rows, last dim)``.

    ``block``: ``(None, None)`` one scale for the tensor; ``(1, 32)`` MX along the last dim;
    ``(1, 128)`` / ``(128, 128)`` DeepSeek-V3's activation tiles / weight blocks; a block that
    does not divide the shape is cut short at the edge. ``scale_rule``:

    * ``"amax"``: ``s = amax / fmt_max`` in fp32 (per tensor, DeepSeek-V3), so the block's
      largest magnitude maps to the format's max;
    * ``"e8m0"``: ``s = 2^(floor(log2 amax) - emax_elem)`` clamped to E8M0's 2^-127..2^127 (OCP MX
      v1.0 §6.3): a power of two, so dividing by it is exact; the block max lands in
      ``[2^emax_elem, 2^(emax_elem+1))`` and values above the element max (448) saturate;
    * ``"e8m0_up"``: the smallest power of two with ``amax / s <= fmt_max``,
      ``2^ceil(log2(amax / fmt_max))``: no element saturates, at the cost of up to one binade
      of range left unused (the rounding-up variant MXFP8 training recipes use instead of §6.3's);
    * ``"none"``: ``s = 1`` (a plain cast; with ``fmt=torch.bfloat16`` the bf16 reference).

    ``amax``: use this instead of each block's own (delayed scaling; per tensor only). A
    zero block gets ``s = 1``. Out-of-range values saturate (the clamp real fp8 recipes use).
    """
    dtype = _dtype(fmt)
    if scale_rule not in SCALE_RULES:
        raise ValueError(f"scale_rule must be one of {SCALE_RULES}, got {scale_rule!r}")
    x2 = x.detach().float().reshape(-1, x.shape[-1]) if x.dim() else x.detach().float().reshape(1, 1)
    br, bc = block_shape(tuple(x2.shape), block)
    if amax is not None and (br, bc) != tuple(x2.shape):
        raise ValueError("a given amax (delayed scaling) is one number for the whole tensor: use block=(None, None)")
    if amax is None:
        a = _block_amax(x2, br, bc)
    else:
        a = torch.as_tensor(amax, dtype=torch.float32, device=x2.device).reshape(1, 1)
    if scale_rule == "amax":
        s = torch.where(a > 0, a / torch.finfo(dtype).max, torch.ones_like(a))
    elif scale_rule == "e8m0":
        exp = torch.frexp(a)[1] - 1 - _EMAX_ELEM[dtype]  # frexp: a = m · 2^e, m in [0.5, 1) -> floor(log2 a) = e - 1
        s = torch.where(a > 0, torch.ldexp(torch.ones_like(a), exp.clamp(_E8M0_MIN, _E8M0_MAX).float()),
                        torch.ones_like(a))
    elif scale_rule == "e8m0_up":
        m, e = torch.frexp(a / torch.finfo(dtype).max)  # ratio = m · 2^e: ceil(log2) is e - 1 when m == 0.5 exactly
        exp = torch.where(m == 0.5, e - 1, e)
        s = torch.where(a > 0, torch.ldexp(torch.ones_like(a), exp.clamp(_E8M0_MIN, _E8M0_MAX).float()),
                        torch.ones_like(a))
    else:
        s = torch.ones_like(a)
    full = s.repeat_interleave(br, 0).repeat_interleave(bc, 1)[:x2.shape[0], :x2.shape[1]]
    data = _saturating_cast(x2 / full, dtype).reshape(x.shape)
    return Fp8Tensor(data=data, scale=s, block=(br, bc))


class DelayedScaling:
    """Per-tensor delayed scaling: the scale of this call comes from the amax history of earlier calls.

    ``quantize(x)`` uses ``s = max(history) / fmt_max``, then appends ``amax(x)`` to the
    history (the last ``history_len`` kept). The first call has no history and uses ``x``'s
    own amax. A tensor that grew since the history was recorded saturates at the format's
    max: the price of knowing the scale in advance. Transformer Engine's ``DelayedScaling``
    recipe works this way (``amax_compute_algo="max"``); the scale itself is Micikevicius et al. 2022, §2.
    """

    def __init__(self, fmt: str | torch.dtype = "e4m3", history_len: int = 16) -> None:
        if not isinstance(history_len, int) or history_len < 1:
            raise ValueError(f"history_len must be an int >= 1, got {history_len!r}")
        self.dtype = _dtype(fmt)
        self.history: deque[float] = deque(maxlen=history_len)

    def amax(self) -> float | None:
        """The amax the next call will scale with: the history's max (None before the first call)."""
        return max(self.history) if self.history else None

    def quantize(self, x: torch.Tensor) -> Fp8Tensor:
        """``x`` quantised per tensor with the history's scale; then ``amax(x)`` joins the history."""
        current = float(x.detach().abs().max()) if x.numel() else 0.0
        past = self.amax()
        q = quantize(x, self.dtype, scale_rule="amax", amax=current if past is None else past)
        self.history.append(current)
        return q


@dataclass(frozen=True)
class Fp8Recipe:
    """How an fp8 linear layer quantises its operands.

    ``forward`` / ``backward``: element formats of activations and weights / of output
    gradients. ``scale_rule``: :func:`quantize`'s. ``block`` / ``weight_block``: blocks of an
    activation or gradient / of a weight, as ``(rows, cols)`` with the contraction along the
    *last* dim (transposed for the other orientation). ``delayed``: per-tensor scales from an
    amax history of ``history_len`` (:class:`DelayedScaling`).
    """

    name: str
    forward: str | torch.dtype = "e4m3"
    backward: str | torch.dtype = "e4m3"
    scale_rule: str = "amax"
    block: tuple[int | None, int | None] = (None, None)
    weight_block: tuple[int | None, int | None] = (None, None)
    delayed: bool = False
    history_len: int = 16
    source: str = ""

    def __post_init__(self) -> None:
        _dtype(self.forward)
        _dtype(self.backward)
        if self.scale_rule not in SCALE_RULES:
            raise ValueError(f"scale_rule must be one of {SCALE_RULES}, got {self.scale_rule!r}")
        if self.delayed and (self.block != (None, None) or self.weight_block != (None, None)):
            raise ValueError("delayed scaling keeps one amax history per tensor: it is per-tensor only")


#: The schemes notebook 07 compares, and a bf16 operand rounding as the yardstick.
RECIPES: dict[str, Fp8Recipe] = {r.name: r for r in (
    Fp8Recipe("bf16", torch.bfloat16, torch.bfloat16, scale_rule="none", source="every operand rounded to bf16"),
    Fp8Recipe("per-tensor", "e4m3", "e5m2", source="Micikevicius et al. 2022: e4m3 forward, e5m2 gradients, "
              "one scale per tensor from its current amax"),
    Fp8Recipe("per-tensor delayed", "e4m3", "e5m2", delayed=True, history_len=16,
              source="the same with scales from a 16-step amax history (Transformer Engine's DelayedScaling)"),
    Fp8Recipe("MXFP8", "e4m3", "e4m3", scale_rule="e8m0", block=(1, 32), weight_block=(1, 32),
              source="OCP MX v1.0: 32-element blocks along the contraction, E8M0 power-of-two scales"),
    Fp8Recipe("MXFP8 round-up", "e4m3", "e4m3", scale_rule="e8m0_up", block=(1, 32), weight_block=(1, 32),
              source="MXFP8 with each scale rounded up, so no block maximum saturates"),
    Fp8Recipe("DeepSeek-V3", "e4m3", "e4m3", block=(1, 128), weight_block=(128, 128),
              source="DeepSeek-V3 §3.3.2: 1 x 128 activation tiles, 128 x 128 weight blocks, fp32 scales"),
)}


def _oriented(block: tuple[int | None, int | None], along_last: bool) -> tuple[int | None, int | None]:
    return block if along_last else (block[1], block[0])


class OperandQuantizer:
    """One layer's operand rounding under ``recipe``: ``q(role, t, along_last)`` gives ``t`` as fp8 stores it.

    ``role``: ``"x"`` (activation), ``"w"`` (weight) or ``"g"`` (output gradient: the
    recipe's backward format). ``along_last``: the contraction runs along ``t``'s last dim
    (else along its first: blocks are transposed). Delayed recipes keep one
    :class:`DelayedScaling` per role, so one instance belongs to one layer.
    """

    def __init__(self, recipe: Fp8Recipe) -> None:
        self.recipe = recipe
        self.delayed = {role: DelayedScaling(recipe.forward if role != "g" else recipe.backward, recipe.history_len)
                        for role in ("x", "w", "g")} if recipe.delayed else {}

    def __call__(self, role: str, t: torch.Tensor, along_last: bool) -> torch.Tensor:
        """``t`` (2-D) rounded as the recipe stores it, blocked along its contraction dim; fp32."""
        r = self.recipe
        if r.delayed:
            return self.delayed[role].quantize(t).dequantize()
        fmt = r.backward if role == "g" else r.forward
        block = _oriented(r.weight_block if role == "w" else r.block, along_last)
        return quantize(t, fmt, block, r.scale_rule).dequantize()


class _Fp8LinearFn(torch.autograd.Function):
    """``y = x W^T + b`` with every GEMM operand rounded as the recipe stores it; fp32 products."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                quant: OperandQuantizer) -> torch.Tensor:
        x2 = x.reshape(-1, x.shape[-1])
        per_tensor = quant.recipe.delayed or quant.recipe.block == (None, None)
        xq = quant("x", x2, along_last=True)
        wq = quant("w", weight, along_last=True)
        y = xq @ wq.t()
        if bias is not None:
            y = y + bias
        # A per-tensor scale is the same in both orientations: backward reuses these roundings (and a delayed
        # history records each tensor once per step). Blocked recipes re-quantise along the other dimension.
        ctx.save_for_backward(x2, weight, xq if per_tensor else x2, wq if per_tensor else weight)
        ctx.per_tensor, ctx.quant, ctx.has_bias, ctx.x_shape = per_tensor, quant, bias is not None, x.shape
        return y.reshape(*x.shape[:-1], weight.shape[0])

    @staticmethod
    def backward(ctx: Any, grad_out: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        x2, weight, xq, wq = ctx.saved_tensors
        quant = ctx.quant
        g2 = grad_out.reshape(-1, grad_out.shape[-1])
        if ctx.per_tensor:
            gq = quant("g", g2, along_last=True)
            grad_x, grad_w = gq @ wq, gq.t() @ xq
        else:
            grad_x = quant("g", g2, along_last=True) @ quant("w", weight, along_last=False)  # contract over out
            grad_w = quant("g", g2, along_last=False).t() @ quant("x", x2, along_last=False)  # over tokens
        grad_b = g2.sum(0) if ctx.has_bias else None
        return grad_x.reshape(ctx.x_shape), grad_w, grad_b, None


class Fp8Linear(nn.Linear):
    """An ``nn.Linear`` whose three GEMMs (forward, input and weight gradients) run fp8-emulated.

    Built by :meth:`from_linear` around an existing layer's *own* parameters (same tensors, same
    names), so an optimizer built before or after sees no difference. ``recipe``: an
    :class:`Fp8Recipe` or a name of :data:`RECIPES`.
    """

    def __init__(self, in_features: int, out_features: int, bias: bool = True,
                 recipe: Fp8Recipe | str = "DeepSeek-V3", **kwargs: Any) -> None:
        super().__init__(in_features, out_features, bias=bias, **kwargs)
        self.recipe = RECIPES[recipe] if isinstance(recipe, str) else recipe
        self.quant = OperandQuantizer(self.recipe)

    @classmethod
    def from_linear(cls, linear: nn.Linear, recipe: Fp8Recipe | str) -> Fp8Linear:
        """An :class:`Fp8Linear` sharing ``linear``'s weight and bias Parameters."""
        new = cls(linear.in_features, linear.out_features, bias=linear.bias is not None, recipe=recipe,
                  device="meta")  # no storage: the real parameters are put in below
        new.weight = linear.weight
        new.bias = linear.bias
        return new

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """The linear map with fp8-rounded operands (input cast to fp32 first)."""
        return _Fp8LinearFn.apply(x.float(), self.weight.float(), None if self.bias is None else self.bias.float(),
                                  self.quant)

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, recipe={self.recipe.name!r}"


def emulate_fp8(model: nn.Module, recipe: Fp8Recipe | str, skip: Iterable[str] = ("lm_head",)) -> list[str]:
    """Replace every ``nn.Linear`` of ``model`` (in place) by an :class:`Fp8Linear` with ``recipe``.

    Layers whose qualified name ends with an entry of ``skip`` stay as they are: fp8 recipes
    keep the output head (and embeddings, norms, attention's softmax) in higher precision.
    Parameters are the layers' own, so names, optimizers and state dicts are unchanged.
    Returns the names replaced.
    """
    recipe = RECIPES[recipe] if isinstance(recipe, str) else recipe
    skip = tuple(skip)
    done = []
    for name, module in list(model.named_modules()):
        for child_name, child in list(module.named_children()):
            full = f"{name}.{child_name}" if name else child_name
            if type(child) is nn.Linear and not any(full.endswith(s) for s in skip):
                setattr(module, child_name, Fp8Linear.from_linear(child, recipe))
                done.append(full)
    if not done:
        raise ValueError("no nn.Linear found to replace (all skipped?)")
    return done


def relative_error(approx: torch.Tensor | Iterable[torch.Tensor],
                   exact: torch.Tensor | Iterable[torch.Tensor]) -> float:
    """``||approx - exact|| / ||exact||`` (Frobenius, over every tensor given), in fp64."""
    a = [approx] if isinstance(approx, torch.Tensor) else list(approx)
    e = [exact] if isinstance(exact, torch.Tensor) else list(exact)
    if len(a) != len(e) or not e:
        raise ValueError(f"need as many tensors on both sides (and at least one), got {len(a)} and {len(e)}")
    num = math.sqrt(sum(float((x.double() - y.double()).square().sum()) for x, y in zip(a, e)))
    den = math.sqrt(sum(float(y.double().square().sum()) for y in e))
    if den == 0:
        raise ValueError("the exact tensors are all zero: a relative error is undefined")
    return num / den

