"""Keeping updates smaller than a bf16 spacing without fp32 masters: stochastic rounding and Kahan summation.

"Pure bf16" training (weights and optimizer states in bf16, 8 bytes per parameter with
Adam, :mod:`lslm.precision.bytes`) stores ``w + Δ`` rounded to nearest. Near ``w = 1`` bf16's
numbers are 2^-7 apart, so every ``|Δ| < 2^-8`` rounds back to ``w``: the update is lost, on
every step. Two remedies (Zamirai et al. 2020, "Revisiting BFloat16 Training", §3-4):

* **stochastic rounding**: round up with probability equal to the distance from the lower
  neighbour over the spacing, so the stored value is ``w + Δ`` *on average* (Gupta et al.
  2015, "Deep Learning with Limited Numerical Precision", §2);
* **Kahan summation**: keep what each rounding dropped in a compensation buffer (bf16 too:
  2 more bytes per parameter) and add it back into the next update (Kahan 1965).
"""

from __future__ import annotations

import torch

__all__ = ["kahan_add_", "stochastic_round_bf16"]

_LOW_BITS = 1 << 16  # bf16 is the upper 16 bits of an fp32: the lower 16 are what rounding drops


def stochastic_round_bf16(x: torch.Tensor, generator: torch.Generator | None = None) -> torch.Tensor:
    """``x`` (fp32) rounded to bf16 stochastically: up with probability (x - lower) / spacing.

    Adds a uniform random integer in ``[0, 2^16)`` to the fp32 bit pattern and truncates the
    low 16 bits, so ``E[result] = x`` exactly for finite ``x`` within bf16's range (the carry
    into the exponent is the round-up at a binade's edge; sign-magnitude makes it work for
    negative ``x`` too).
    """
    if x.dtype != torch.float32:
        raise ValueError(f"x must be float32 (the value before rounding), got {x.dtype}")
    bits = x.contiguous().view(torch.int32)
    noise = torch.randint(0, _LOW_BITS, bits.shape, generator=generator, dtype=torch.int32, device=x.device)
    return ((bits + noise) & -_LOW_BITS).view(torch.float32).to(torch.bfloat16)  # exact: low bits are zero


@torch.no_grad()
def kahan_add_(w: torch.Tensor, comp: torch.Tensor, update: torch.Tensor) -> None:
    """``w += update`` in ``w``'s dtype with Kahan compensation ``comp`` (same dtype and shape, start at 0).

    ``comp`` holds what the last rounding of ``w`` dropped (negated), and is subtracted from the
    next update, so the small updates add up in ``w`` over the steps instead of vanishing.
    """
    if w.shape != comp.shape or w.dtype != comp.dtype:
        raise ValueError(f"comp must match w's shape and dtype, got {tuple(comp.shape)} {comp.dtype} for "
                         f"{tuple(w.shape)} {w.dtype}")
    y = update.float() - comp.float()
    t = (w.float() + y).to(w.dtype)
    comp.copy_((t.float() - w.float()) - y)
    w.copy_(t)
