"""Stochastic rounding and Kahan summation (lslm.precision.rounding) against round-to-nearest and fp32."""

from __future__ import annotations

import pytest
import torch

from lslm.precision.rounding import kahan_add_, stochastic_round_bf16


def test_stochastic_rounding_picks_a_neighbour_and_is_unbiased() -> None:
    g = torch.Generator().manual_seed(0)
    x = torch.full((200_000,), 1.0 + 2.0**-9)  # a quarter of the way from 1 to the next bf16 (1 + 2^-7)
    r = stochastic_round_bf16(x, g).float()
    assert set(r.unique().tolist()) == {1.0, 1.0 + 2.0**-7}
    assert (r > 1).float().mean().item() == pytest.approx(0.25, abs=0.005)
    assert stochastic_round_bf16(-x, g).float().mean().item() == pytest.approx(-(1 + 2.0**-9), abs=1e-4)
    exact = torch.tensor([1.0, -2.5, 0.0, 2.0**-100])  # representable in bf16: never moved
    assert torch.equal(stochastic_round_bf16(exact, g).float(), exact)
    with pytest.raises(ValueError, match="float32"):
        stochastic_round_bf16(x.double())


def test_small_updates_survive_only_with_stochastic_rounding_or_kahan() -> None:
    g = torch.Generator().manual_seed(1)
    n, steps, du = 4096, 200, 1e-3  # du < half of bf16's spacing at 1 (2^-8 = 0.0039)
    nearest = torch.ones(n, dtype=torch.bfloat16)
    stoch, kahan, comp = nearest.clone(), nearest.clone(), torch.zeros(n, dtype=torch.bfloat16)
    update = torch.full((n,), du)
    for _ in range(steps):
        nearest = (nearest.float() + update).to(torch.bfloat16)
        stoch = stochastic_round_bf16(stoch.float() + update, g)
        kahan_add_(kahan, comp, update)
    target = 1 + steps * du
    assert torch.all(nearest == 1)  # every update lost
    assert stoch.float().mean().item() == pytest.approx(target, abs=2e-3)
    assert torch.all((kahan.float() - target).abs() <= 2.0**-7)  # within one bf16 spacing


def test_kahan_checks_its_buffer() -> None:
    with pytest.raises(ValueError, match="comp"):
        kahan_add_(torch.ones(3, dtype=torch.bfloat16), torch.zeros(3), torch.ones(3))
