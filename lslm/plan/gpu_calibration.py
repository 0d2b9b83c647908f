"""Measured GPU efficiencies as tables the time model interpolates: GEMMs by shape, attention by sequence, AdamW.

One :class:`GpuCalibration` holds what ``bench/results/gpu/h200_2026-11-28.json`` measured on one NVIDIA H200
(bf16, torch 2.11 + CUDA 13.0; the folder's README says how), as fractions of the 989 Tflop/s dense bf16 peak
(rounded to 4 digits here; ``tests/test_plan_calibrated.py`` keeps them equal to the file):

* ``gemm``: ``a @ w.t()`` of a transformer layer's four GEMMs, ``qkv`` (``n = 3h, k = h``), ``proj``
  (``h, h``), ``fc1`` (``4h, h``), ``fc2`` (``h, 4h``), at 2,048 / 8,192 / 32,768 tokens (rows) and hidden
  768 to 8,192 (columns). :meth:`GpuCalibration.gemm_efficiency` prices any GEMM ``tokens x k -> n`` by its kind
  and the hidden size whose GEMM of that kind has its ``n · k`` (``h_eff = sqrt(n k / r)``, ``r`` = 3, 1, 4, 4:
  a tensor-parallel shard of ``qkv`` at ``h`` is priced like the unsharded ``qkv`` of a narrower model),
  bilinear in (log tokens, log h_eff) between the measured points and clamped to the table's edges outside them.
  At a measured point it returns the measured efficiency exactly.
* ``attention``: causal flash attention (``F.scaled_dot_product_attention``), forward + backward, by head
  dimension (64, 128) and sequence (1K-32K); efficiency of ``3.5 x 2 B H s^2 d`` flops (the causal half of
  ``4 B H s^2 d``, the backward 2.5 forwards). Linear in log sequence between points (and in head dimension
  between 64 and 128), clamped outside.
* ``adamw``: fused ``torch.optim.AdamW.step`` on 25M-400M fp32 parameters, bytes of state traffic per second
  (28 bytes per parameter); log-linear in the parameter count, clamped (so 3.28 TB/s above 400M).
* ``hbm_Bps``: the rate the model streams memory-bound elementwise work at (norms, activations, residual adds,
  casts, the loss's softmax over the vocabulary): the largest AdamW rate measured, 3.28 TB/s, the only streaming
  rate in the file (68 % of the H200's 4.8 TB/s datasheet bandwidth). An assumption: single elementwise ops
  measured later (``h200_breakdown_2026-11-28.json``, not used here) stream at 2.1 (LayerNorm, log-softmax) to
  4.2 TB/s (an fp32 add), around it.

:meth:`GpuCalibration.scaled` carries the same efficiencies to another GPU (its own peak, its streaming rates
scaled by its datasheet bandwidth over the H200's): what the ``h100-sxm`` and ``a100-80gb`` presets assume.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

__all__ = ["GEMM_KINDS", "GpuCalibration", "H200_CALIBRATION"]

#: ``n · k / h^2`` of each measured GEMM kind (``qkv``: ``3h x h``; ``proj``: ``h x h``; ``fc1``, ``fc2``: ``4h x h``)
GEMM_KINDS = {"qkv": 3, "proj": 1, "fc1": 4, "fc2": 4}


def _interp(x: float, xs: tuple[float, ...], ys: tuple[float, ...]) -> float:
    """Linear interpolation of ``ys`` over increasing ``xs`` at ``x``, clamped to the end values outside."""
    if x <= xs[0]:
        return ys[0]
    if x >= xs[-1]:
        return ys[-1]
    for x0, x1, y0, y1 in zip(xs, xs[1:], ys, ys[1:]):
        if x <= x1:
            return y0 + (y1 - y0) * (x - x0) / (x1 - x0)
    raise AssertionError("unreachable: x is inside xs")


@dataclass(frozen=True)
class GpuCalibration:
    """Measured efficiencies of one GPU (module doc); every rate a fraction of ``peak_flops`` or bytes/s."""

    name: str
    peak_flops: float  #: the dense bf16 peak the efficiencies are fractions of
    gemm_tokens: tuple[int, ...]
    gemm_hidden: tuple[int, ...]
    #: kind -> rows (one per ``gemm_tokens``) of efficiencies (one per ``gemm_hidden``)
    gemm: tuple[tuple[str, tuple[tuple[float, ...], ...]], ...]
    #: head dim -> ((sequence, efficiency), ...) of causal flash attention, forward + backward
    attention: tuple[tuple[int, tuple[tuple[int, float], ...]], ...]
    adamw: tuple[tuple[float, float], ...]  #: (parameters, bytes/s) of fused AdamW
    hbm_Bps: float  #: streaming rate of memory-bound elementwise work
    source: str = ""
    measured_on: str = ""  #: the GPU the efficiencies were measured on, when it is not ``name`` (:meth:`scaled`)

    def provenance(self) -> str:
        """Where the efficiencies come from, for printed tables: measured on this GPU, or scaled from another."""
        if not self.measured_on or self.measured_on == self.name:
            return f"its efficiency measured on the {self.name}"
        return f"the efficiency measured on the {self.measured_on}, scaled to the {self.name} (assumed)"

    def gemm_efficiency(self, kind: str, tokens: float, n: float, k: float) -> float:
        """Fraction of peak of a bf16 GEMM ``(tokens x k) @ (k x n)`` priced as ``kind`` (module doc)."""
        if kind not in GEMM_KINDS:
            raise ValueError(f"unknown GEMM kind {kind!r}; use one of {sorted(GEMM_KINDS)}")
        table = dict(self.gemm)[kind]
        h_eff = math.sqrt(n * k / GEMM_KINDS[kind])
        lh = tuple(math.log(h) for h in self.gemm_hidden)
        by_row = tuple(_interp(math.log(h_eff), lh, row) for row in table)
        return _interp(math.log(tokens), tuple(math.log(t) for t in self.gemm_tokens), by_row)

    def attention_efficiency(self, seq: float, head_dim: int) -> float:
        """Fraction of peak of causal flash attention, forward + backward, at ``seq`` and ``head_dim``
        (module doc)."""
        dims = tuple(d for d, _ in self.attention)
        per_dim = tuple(_interp(math.log(seq), tuple(math.log(s) for s, _ in pts), tuple(e for _, e in pts))
                        for _, pts in self.attention)
        return _interp(math.log(head_dim), tuple(math.log(d) for d in dims), per_dim)

    def optimizer_Bps(self, elements: float) -> float:
        """Bytes per second fused AdamW streams when it updates ``elements`` parameters (module doc)."""
        return _interp(math.log(max(elements, 1.0)), tuple(math.log(p) for p, _ in self.adamw),
                       tuple(r for _, r in self.adamw))

    def scaled(self, name: str, peak_flops: float, bandwidth_ratio: float) -> GpuCalibration:
        """The same efficiencies on another GPU: its ``peak_flops``; the streaming rates times
        ``bandwidth_ratio`` (its datasheet HBM bandwidth over this GPU's). An assumption, not a measurement."""
        return replace(self, name=name, measured_on=self.measured_on or self.name, peak_flops=peak_flops,
                       hbm_Bps=self.hbm_Bps * bandwidth_ratio,
                       adamw=tuple((p, r * bandwidth_ratio) for p, r in self.adamw),
                       source=f"{self.source}, scaled to {name} (peak {peak_flops / 1e12:g} Tflop/s, "
                              f"bandwidth x {bandwidth_ratio:.3g})")


#: ``bench/results/gpu/h200_2026-11-28.json`` as fractions of 989 Tflop/s (module doc)
H200_CALIBRATION = GpuCalibration(
    name="H200", peak_flops=989e12, gemm_tokens=(2048, 8192, 32768), gemm_hidden=(768, 1024, 2048, 4096, 8192),
    gemm=(("qkv", ((0.1847, 0.2921, 0.5081, 0.6793, 0.7478), (0.3695, 0.4649, 0.5875, 0.7125, 0.7181),
                   (0.4368, 0.5364, 0.6663, 0.7803, 0.6617))),
          ("proj", ((0.0536, 0.1128, 0.3541, 0.5965, 0.6724), (0.2338, 0.3199, 0.5255, 0.6496, 0.6469),
                    (0.3896, 0.4082, 0.6136, 0.6568, 0.6617))),
          ("fc1", ((0.2507, 0.3204, 0.5409, 0.6738, 0.7442), (0.4111, 0.487, 0.5889, 0.7102, 0.6978),
                   (0.4892, 0.5363, 0.6922, 0.6894, 0.6962))),
          ("fc2", ((0.2474, 0.3569, 0.606, 0.6965, 0.736), (0.4718, 0.5637, 0.6273, 0.7068, 0.6553),
                   (0.5659, 0.6079, 0.7304, 0.703, 0.6924)))),
    attention=((64, ((1024, 0.2118), (2048, 0.2997), (4096, 0.3652), (8192, 0.4152), (16384, 0.4527),
                     (32768, 0.4363))),
               (128, ((1024, 0.2585), (2048, 0.3776), (4096, 0.4627), (8192, 0.5225), (16384, 0.582),
                      (32768, 0.5853)))),
    adamw=((25e6, 2.2487e12), (100e6, 2.8128e12), (400e6, 3.2764e12)), hbm_Bps=3.2764e12,
    source="bench/results/gpu/h200_2026-11-28.json")
