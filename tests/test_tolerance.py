"""lslm.metrics.tolerance: the AdamW bound's arithmetic and its refusals."""

from __future__ import annotations

import pytest
import torch

from lslm.metrics.tolerance import ADAMW_ROUNDING_SHARE, BF16_ULP_AT_ONE, FP16_ULP_AT_ONE, adamw_param_atol


def test_the_adamw_bound_is_a_share_of_the_farthest_adamw_moves() -> None:
    assert adamw_param_atol(steps=3, lr=1e-3) == pytest.approx(ADAMW_ROUNDING_SHARE * 3e-3)
    assert adamw_param_atol(steps=4, lr=1e-3) == pytest.approx(2e-4)  # notebook 08 prints this bound
    for steps, lr in ((0, 1e-3), (3, 0.0), (3, -1e-3)):
        with pytest.raises(ValueError, match="steps must be >= 1 and lr > 0"):
            adamw_param_atol(steps=steps, lr=lr)


def test_the_half_precision_ulps_are_the_spacing_at_one() -> None:
    assert (torch.tensor(1.0 + BF16_ULP_AT_ONE).bfloat16().float() - 1).item() == BF16_ULP_AT_ONE
    assert (torch.tensor(1.0 + BF16_ULP_AT_ONE / 2).bfloat16().float() - 1).item() == 0.0  # ties to even: below one ulp
    assert (torch.tensor(1.0 + FP16_ULP_AT_ONE).half().float() - 1).item() == FP16_ULP_AT_ONE
    assert torch.finfo(torch.bfloat16).eps == BF16_ULP_AT_ONE and torch.finfo(torch.float16).eps == FP16_ULP_AT_ONE
