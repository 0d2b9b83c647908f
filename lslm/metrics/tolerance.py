"""Bounds for comparing fp32 runs that must hold on every machine (the tests' and the notebooks'), with their reasons.

The same float32 program gives different last bits on different CPUs. torch picks its vectorised kernels at start-up
(``ATEN_CPU_CAPABILITY``: ``default``, ``avx2``, ``avx512``); MKL and oneDNN pick their own code paths by vendor; a
kernel that walks a slice of a tensor puts other elements in its SIMD lanes and its scalar tail than one that walks the
whole tensor (and the two may contract ``a * b + c`` into one fused multiply-add or not). So two implementations that
do "the same arithmetic" (ZeRO's AdamW over its slices against DDP's over whole tensors, DeepSpeed's flat partition,
FSDP2's per-parameter shards) agree bit for bit on one machine and not on another. Measured with this suite: ZeRO
against DDP at dp = 2 was 0.0 on AVX-512, 3.7e-9 with ``ATEN_CPU_CAPABILITY=default`` and 1.0e-8 on an AVX2 EPYC.

Bit-equality is therefore asserted only where the *same* operations run on the *same* elements in the same order on
every machine (a run against itself after a checkpoint, a copy, a permutation, an integer count); each such assert
says why next to it. Every other comparison uses a bound from here (or a local one whose comment says the same).

AdamW amplifies rounding. Its update is ``lr * m_hat / (sqrt(v_hat) + eps)``: at the first step ``g / (|g| + eps)``,
a near-sign whose derivative in ``g`` is ``eps / (|g| + eps)**2``, up to ``1 / eps`` = 1e8 for a gradient near 0. A
gradient element that is a cancelling sum (its terms 1e3 times larger than the result) carries an absolute rounding
of ~1e-7 of its terms, which the near-sign turns into a visible fraction of ``lr``. So after ``steps`` steps the
parameters of two fp32 runs of the same training differ by a fraction of the farthest AdamW can move an element,
``steps * lr`` (``|m_hat / sqrt(v_hat)| <= 1`` for these betas in practice), not by a few ulps of the parameters.
Measured here (3 steps, lr 1e-3, so ``steps * lr`` = 3e-3), worst with ``ATEN_CPU_CAPABILITY=default`` (the AVX-512
kernels this machine picks by itself give less, avx2 passes the same bounds): 4.1e-5 (1.4 %, torch's own DTensor +
pipelining + FSDP2 3D composition against one process), 2.7e-5 (the 3D demo, 2 steps), 2.3e-5 (lslm's 3D with SP),
4.9e-6 (HSDP with accumulation), 1.6e-6 (ZeRO at dp = 3); 1.2e-5 on an AVX2 EPYC (lslm's 3D). We allow
:data:`ADAMW_ROUNDING_SHARE` = 5 % of it, 3.6x the worst seen. The defects these tests exist to catch move whole
tensors by ~``lr`` per step, 7x the bound or more (a missing sequence-parallel sum: 3e-3, 20x; a wrong slice or a
missing average: >= 1e-3, 7x), or show in the loss or the gradient norm, which are checked tightly beside the parameters
(a tied copy counted twice in the clipping norm: |dparam| 4e-5 but a relative norm error of 0.12).
"""

from __future__ import annotations

#: float32's machine epsilon (spacing at 1.0).
FP32_EPS = 2.0**-23

#: The share of AdamW's largest movement (``steps * lr``) that rounding may reach between two fp32 runs of the same
#: training: see the module docstring for the measurements and the defects it still separates.
ADAMW_ROUNDING_SHARE = 0.05

#: One bf16 ulp at 1.0 (8 bits of significand): the largest parameters here are LayerNorm weights near 1.0, so a
#: master weight one fp32 rounding away can round to the neighbouring bf16 value.
BF16_ULP_AT_ONE = 2.0**-7

#: One fp16 ulp at 1.0 (11 bits of significand), for the same reason as :data:`BF16_ULP_AT_ONE`.
FP16_ULP_AT_ONE = 2.0**-10


def adamw_param_atol(steps: int, lr: float) -> float:
    """Largest |parameter difference| allowed between two fp32 AdamW runs of ``steps`` steps at learning rate ``lr``
    that compute the same training with other kernels or in another order: :data:`ADAMW_ROUNDING_SHARE` of
    ``steps * lr`` (module docstring)."""
    if steps < 1 or lr <= 0:
        raise ValueError(f"steps must be >= 1 and lr > 0, got steps={steps}, lr={lr}")
    return ADAMW_ROUNDING_SHARE * steps * lr
