"""Training flops of a decoder-only transformer, the device's peak, and the step's MFU and HFU: one count for all.

**Model flops of one training step** (forward and backward, no recomputation) on ``T`` tokens, ``B``
sequences of ``s`` tokens (``T = B·s``), ``L`` layers of width ``h``::

    F_model = 6·N·T + 6·L·h·s·T            (= 6·N·T + 6·L·h·s²·B)

* ``6·N·T``: each weight that multiplies an activation costs 2 flops per token forward (a multiply and an
  add) and 4 backward (the gradients of the input and of the weight). ``N`` counts exactly those weights:
  every linear layer's weight matrix, the head's once whether or not it is tied to the embedding. Embedding
  lookups, position tables, biases and norms multiply nothing and are left out (Narayanan et al. 2021, §5.1,
  count the same: ``24·B·s·h²`` per layer forward and ``2·B·s·h·V`` for the head).
* ``6·L·h·s·T``: attention's two ``s x s`` products per layer, ``Q·Kᵀ`` and the scores times ``V``, are
  ``2·s²·h`` flops each forward, ``12·L·h·s²`` per sequence forward and backward, as Chowdhery et al. 2022
  (PaLM), appendix B, count it: ``6N + 12·L·H·Q·T`` per token, ``H·Q = h`` and their ``T = s``. A causal model
  needs only the pairs on and below the diagonal, so we count half: ``6·L·h·s²`` per sequence, ``6·L·h·s``
  per token (``s²/2`` pairs, as FlashAttention's benchmarks count causal attention; the exact ``s(s+1)/2``
  differs by ``1/s`` of this term). ``causal=False`` counts the full square (bidirectional attention).

**Hardware flops** add what recomputation runs again (Korthikanti et al. 2022 §5): ``"selective"`` replays
the attention core's forward, ``+ 2·L·h·s·T`` (causal); ``"full"`` every layer's forward, ``+ 2·N_layers·T +
2·L·h·s·T`` (``N_layers``: ``N`` without the head, which is not replayed). Then, for a step of ``t`` seconds
on ``D`` devices of peak ``P`` flop/s each::

    MFU = F_model / (t·D·P)        HFU = F_hardware / (t·D·P)

MFU is the paper's figure of merit: recomputing does not raise it (the same model flops take longer).

**Pitfall: MFU above 100 %.** A fused (flash) attention kernel with a causal mask skips the blocks above the
diagonal. Counting its attention as dense (``12·L·h·s²`` per sequence, as PaLM's formula and Narayanan et
al.'s do) credits the step with flops it never ran; once attention dominates (long sequences) the "MFU"
passes 100 %. The time model of :mod:`lslm.plan.timing` counts attention dense on purpose: an unfused
attention computes the whole square before masking, so that is the work it times.

**Peaks** (:data:`DEVICE_PEAKS`): the vendors' datasheet dense peaks per precision (no 2:4 sparsity); on a
CPU the rate an fp32 matmul measures here (:func:`measured_matmul_flops`), since a CPU has no datasheet figure
for what torch reaches with its threads.
"""

from __future__ import annotations

import functools
import math
import statistics
import time
from dataclasses import dataclass
from typing import Any

import torch

__all__ = ["DEVICE_PEAKS", "RECOMPUTE", "StepFlops", "Throughput", "attention_flops", "device_peak", "gpt_step_flops",
           "measured_matmul_flops", "peak_for", "throughput", "training_flops"]

RECOMPUTE = ("none", "selective", "full")

#: Dense peak flop/s per GPU and precision, no sparsity. Sources: NVIDIA H100 Tensor Core GPU datasheet (H100
#: SXM: FP32 67 TFLOPS; TF32, BF16, FP16 989, 1,979, 1,979 TFLOPS "with sparsity", dense is half); NVIDIA H200
#: Tensor Core GPU datasheet (H200 SXM: the same compute figures as H100 SXM); NVIDIA A100 Tensor Core GPU
#: datasheet (FP32 19.5, TF32 156, BF16 and FP16 312 TFLOPS dense). H100/H200 PCIe and NVL parts run lower
#: clocks and are not listed (no MFU shown). L40S, A10G and L4: bf16 only, the figures lslm.bench.calibrate used.
DEVICE_PEAKS: dict[str, dict[str, float]] = {
    "H200": {"fp32": 67e12, "tf32": 494.5e12, "bf16": 989e12, "fp16": 989e12},
    "H100": {"fp32": 67e12, "tf32": 494.5e12, "bf16": 989e12, "fp16": 989e12},
    "A100": {"fp32": 19.5e12, "tf32": 156e12, "bf16": 312e12, "fp16": 312e12},
    "L40S": {"bf16": 362e12},
    "A10G": {"bf16": 70e12},
    "L4": {"bf16": 121e12},
}
_OTHER_PARTS = ("PCIE", "NVL")  # the same chip names at lower clocks: the SXM figures would flatter them


def peak_for(device_name: str, precision: str) -> float | None:
    """The datasheet dense peak of the GPU called ``device_name`` at ``precision``; None if not in the table."""
    name = device_name.upper()
    if any(part in name for part in _OTHER_PARTS):
        return None
    for key, peaks in DEVICE_PEAKS.items():
        if key in name:
            return peaks.get(precision)
    return None


@functools.lru_cache(maxsize=8)
def _matmul_rate(threads: int, n: int, repeats: int) -> float:
    gen = torch.Generator().manual_seed(0)  # its own generator: measuring must not move the training's seed
    a = torch.randn(n, n, generator=gen, device="cpu")  # lslm: cpu-ok (the CPU's own matmul rate)
    b = torch.randn(n, n, generator=gen, device="cpu")  # lslm: cpu-ok (the CPU's own matmul rate)
    a @ b  # warm-up: the first call allocates and picks its kernel
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        a @ b
        times.append(time.perf_counter() - t0)
    return 2 * n**3 / statistics.median(times)


def measured_matmul_flops(n: int = 512, repeats: int = 5) -> float:
    """Flop/s of an ``n x n`` fp32 matmul on the CPU with torch's current thread count (median of ``repeats``;
    measured once per process and thread count). A fair ceiling for the small models the course trains, not a
    hardware peak: the share of the cores other processes take is not in it."""
    return _matmul_rate(torch.get_num_threads(), n, repeats)


def device_peak(device: torch.device | str, precision: str) -> tuple[float | None, str]:
    """``(flop/s, where it comes from)`` of one ``device`` at ``precision`` (``fp32``, ``tf32``, ``bf16``, ``fp16``):
    a CUDA device's datasheet peak (fp32 with TF32 matmuls allowed counts as ``tf32``), a CPU's measured fp32 matmul
    rate (:func:`measured_matmul_flops`, whatever the precision: half matmuls on a CPU are not faster); None for a
    GPU not in :data:`DEVICE_PEAKS`."""
    device = torch.device(device)
    if device.type == "cuda":
        if precision == "fp32" and torch.backends.cuda.matmul.allow_tf32:
            precision = "tf32"
        name = torch.cuda.get_device_name(device)
        peak = peak_for(name, precision)
        return peak, f"{name} {precision} datasheet peak" if peak else f"{name} {precision}: no datasheet peak known"
    return measured_matmul_flops(), f"{torch.get_num_threads()}-thread fp32 matmul measured"


def attention_flops(n_layer: int, hidden: int, seq_len: int, tokens: int, causal: bool = True) -> float:
    """Attention's ``s x s`` products of one forward and backward over ``tokens`` tokens: ``6·L·h·s·T`` causal,
    ``12·L·h·s·T`` dense (module doc; PaLM appendix B)."""
    return (6 if causal else 12) * n_layer * hidden * seq_len * tokens


@dataclass(frozen=True)
class StepFlops:
    """One training step's flops over all devices: ``model`` (no recomputation) and ``hardware`` (with it)."""

    tokens: int
    model: float
    hardware: float
    precision: str = "fp32"


def training_flops(*, n_layer: int, hidden: int, seq_len: int, layer_matmul_params: int, head_params: int,
                   tokens: int, causal: bool = True, recompute: str = "none", precision: str = "fp32") -> StepFlops:
    """Model and hardware flops of one step on ``tokens`` tokens (module doc: ``F_model = 6·N·T + 6·L·h·s·T``).

    ``layer_matmul_params``: the weights of every layer's matrix multiplications, all layers together;
    ``head_params``: the head's (``h·V``), counted whether or not it is tied to the embedding.
    """
    if recompute not in RECOMPUTE:
        raise ValueError(f"recompute must be one of {RECOMPUTE}, got {recompute!r}")
    for name, value in (("n_layer", n_layer), ("hidden", hidden), ("seq_len", seq_len), ("tokens", tokens)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{name} must be an int >= 1, got {value!r}")
    attention = attention_flops(n_layer, hidden, seq_len, tokens, causal)
    model = 6 * (layer_matmul_params + head_params) * tokens + attention
    extra = {"none": 0.0, "selective": attention / 3, "full": 2 * layer_matmul_params * tokens + attention / 3}
    return StepFlops(tokens, float(model), float(model + extra[recompute]), precision)


def gpt_step_flops(config: Any, sequences: int, *, recompute: str = "none", precision: str = "fp32",
                   seq_len: int | None = None) -> StepFlops:
    """:func:`training_flops` of lslm's GPT (a :class:`~lslm.models.gpt.GPTConfig`) on ``sequences`` sequences of
    ``seq_len`` (default ``block_size``) tokens: ``12·h²`` matmul weights per layer (``qkv 3h², proj h², fc 4h²,
    proj 4h²``) and a head of ``h·V``; causal attention."""
    h, s = config.n_embd, seq_len or config.block_size
    return training_flops(n_layer=config.n_layer, hidden=h, seq_len=s, layer_matmul_params=12 * h * h * config.n_layer,
                          head_params=h * config.vocab_size, tokens=sequences * s, recompute=recompute,
                          precision=precision)


@dataclass(frozen=True)
class Throughput:
    """A step's rates: tokens per second, achieved flop/s over all devices, MFU and HFU (None without a peak)."""

    step_s: float
    tokens_per_s: float
    flops_per_s: float
    hardware_flops_per_s: float
    devices: int
    peak_flops: float | None
    peak_source: str
    mfu: float | None
    hfu: float | None

    def line(self) -> str:
        """One printable line, e.g. ``tokens/s 1.23e+04, 0.0351 TFLOP/s, MFU 4.2 % (HFU 5.6 %) of ...``."""
        text = f"tokens/s {self.tokens_per_s:.4g}, {self.flops_per_s / 1e12:.4g} TFLOP/s achieved"
        if self.mfu is None:
            return text + f", MFU n/a ({self.peak_source})"
        text += f", MFU {self.mfu:.1%}"
        if self.hfu is not None and not math.isclose(self.hfu, self.mfu):
            text += f" (HFU {self.hfu:.1%}, recomputation counted)"
        return text + f" of {self.devices} x {self.peak_flops / 1e12:.4g} TFLOP/s ({self.peak_source})"

    def to_dict(self) -> dict[str, Any]:
        """The fields as plain values, for a run record."""
        return {k: getattr(self, k) for k in self.__dataclass_fields__}


def throughput(flops: StepFlops, step_s: float, devices: int, peak: float | None, peak_source: str = "") -> Throughput:
    """The rates of a step of ``flops`` that took ``step_s`` seconds on ``devices`` devices of ``peak`` flop/s each
    (module doc: ``MFU = F_model / (t·D·P)``)."""
    if not step_s > 0:
        raise ValueError(f"step_s must be > 0, got {step_s!r}")
    if isinstance(devices, bool) or not isinstance(devices, int) or devices < 1:
        raise ValueError(f"devices must be an int >= 1, got {devices!r}")
    if peak is not None and not 0 < peak < math.inf:
        raise ValueError(f"peak must be finite and > 0 flop/s (or None), got {peak!r}")
    total = None if peak is None else step_s * devices * peak
    return Throughput(step_s, flops.tokens / step_s, flops.model / step_s, flops.hardware / step_s, devices, peak,
                      peak_source, None if total is None else flops.model / total,
                      None if total is None else flops.hardware / total)
