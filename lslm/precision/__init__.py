"""Mixed precision: dynamic loss scaling, fp32 master weights and ``main_grad``, fp16 / bf16 modes, bytes.

* :mod:`~lslm.precision.scaler` - :class:`DynamicLossScaler`: DeepSpeed's rule (hysteresis,
  a floor, an error at the floor), GradScaler's trajectory with ``hysteresis=1`` and no
  floor; the overflow flag MAX-reduced through ``ctx.comm`` so every rank skips together.
* :mod:`~lslm.precision.master` - :class:`MixedPrecisionOptimizer`: a half-precision model,
  fp32 masters stepped by any torch optimizer, fp32 ``main_grad`` accumulation.
* :mod:`~lslm.precision.modes` - :func:`prepare_precision` for ``fp32`` / ``fp16`` / ``bf16``
  (:data:`PRECISION_MODES`): one option for every recipe.
* :mod:`~lslm.precision.bytes` - model-state bytes per parameter, measured, and the
  conventions (16, 18, 20, 8) side by side.
* :mod:`~lslm.precision.rounding` - stochastic rounding to bf16 and Kahan summation: how pure
  bf16 training (no fp32 masters) keeps updates smaller than a bf16 spacing.
* :mod:`~lslm.precision.formats` - fp32 / fp16 / bf16 / fp8 facts from ``torch.finfo``, bit
  layouts, and where a model's gradients fall in a format's range (underflow, the loss-scale window).
"""

from lslm.precision.bytes import CONVENTIONS, BytesPerParam, Convention, bytes_per_param, compare
from lslm.precision.master import HALF_DTYPES, MixedPrecisionOptimizer
from lslm.precision.modes import (
    PARAM_DTYPES,
    PRECISION_MODES,
    PlainOptimizer,
    PrecisionSetup,
    check_precision,
    prepare_precision,
)
from lslm.precision.scaler import (
    GROWTH_RULES,
    OVERFLOW_LABEL,
    DynamicLossScaler,
    LossScaleAtMinimumError,
    nonfinite_flag,
)

__all__ = ["CONVENTIONS", "GROWTH_RULES", "HALF_DTYPES", "OVERFLOW_LABEL", "PARAM_DTYPES", "PRECISION_MODES",
           "BytesPerParam", "Convention", "DynamicLossScaler", "LossScaleAtMinimumError", "MixedPrecisionOptimizer",
           "PlainOptimizer", "PrecisionSetup", "bytes_per_param", "check_precision", "compare", "nonfinite_flag",
           "prepare_precision"]
