"""ZeRO's model-state bytes per device: the paper's formulas, lslm's exact counts, and DeepSpeed's estimators.

Three ways to count the same thing, per data-parallel rank, ``Ψ`` parameters over ``N`` ranks:

* **The paper** (Rajbhandari et al. 2020, §5.4, Figure 1), mixed precision with Adam: 2 bytes of
  fp16 parameters, 2 of fp16 gradients and ``K = 12`` of optimizer states (fp32 master, momentum,
  variance): ``(2 + 2 + K)Ψ`` for DDP, ``2Ψ + 2Ψ + KΨ/N`` (stage 1), ``2Ψ + (2 + K)Ψ/N`` (2),
  ``(2 + 2 + K)Ψ/N`` (3). :func:`paper_bytes`.
* **lslm** (:mod:`lslm.zero`), exactly, padding included: the flat layout of ``numel`` elements
  (``Ψ`` plus at most ``N - 1`` zeros per bucket), and this rank's ``owned`` elements of it.
  Gradients are kept in fp32 by default (Megatron's ``main_grad``), which costs 4 bytes instead
  of the paper's 2. :func:`lslm_bytes`.
* **DeepSpeed's estimators** (``estimate_zero2_model_states_mem_needs`` and
  ``estimate_zero3_model_states_mem_needs`` in DeepSpeed 0.19, read from its source): GPU bytes per
  device and CPU bytes per node for each offload option. They use an 18-byte convention for what
  is partitioned: 2 (fp16 gradient partition) + 4 (fp32 gradients) + 4 (fp32 master weights) +
  8 (Adam's moments); stage 2 keeps the fp16 parameters whole (``2Ψ + 18Ψ/N``), stage 3 adds the
  largest layer gathered in fp32 (``4 · largest + 18Ψ/N``). CPU figures carry a 1.5 safety factor.
  :func:`deepspeed_zero2_estimate`, :func:`deepspeed_zero3_estimate` re-derive them here from those
  conventions, so the course can print DeepSpeed's rows without DeepSpeed installed.

Why DeepSpeed's stages 1-2 were counted at 10 bytes per parameter per rank after an fp32 AdamW
step at 2 ranks (DESIGN §10's probe, not measured here): it keeps the module's full fp32 weights
(4) and, separately, an fp32 master *partition* (4/N) next to the moments (8/N), with the
gradients released after the step: 4 + 12/N = 10 at N = 2. lslm's fp32 stage 1 keeps the whole
gradient buffer between steps but no separate master (its masters are views of the parameters):
4 + 4 + 8/N = 12; its stage 2, 4 + (4 + 8)/N = 10.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["DeepSpeedEstimate", "deepspeed_zero2_estimate", "deepspeed_zero3_estimate", "lslm_bytes",
           "paper_bytes"]

#: DeepSpeed's partitioned bytes per parameter: fp16 gradient partition, fp32 gradients, fp32 master, Adam moments.
DEEPSPEED_PARTITIONED = 2 + 4 + 4 + 8
#: DeepSpeed's CPU-side safety factor (its ``additional_buffer_factor`` default).
DEEPSPEED_BUFFER_FACTOR = 1.5


def paper_bytes(stage: int, psi: int, n: int, k: int = 12) -> float:
    """Model-state bytes per rank by the ZeRO paper's formula (fp16 parameters and gradients, ``K`` bytes of
    optimizer state); stage 0 is plain data parallelism."""
    if stage not in (0, 1, 2, 3):
        raise ValueError(f"stage must be 0-3, got {stage!r}")
    if n < 1 or psi < 0:
        raise ValueError(f"need n >= 1 and psi >= 0, got n={n}, psi={psi}")
    return {0: (2 + 2 + k) * psi, 1: 2 * psi + 2 * psi + k * psi / n, 2: 2 * psi + (2 + k) * psi / n,
            3: (2 + 2 + k) * psi / n}[stage]


def lslm_bytes(stage: int, numel: int, owned: int, n: int, *, param_bytes: int = 2, grad_bytes: int = 4,
               masters: bool = True, state_bytes: int = 8) -> int:
    """Model-state bytes per rank of :class:`lslm.zero.optimizer.ZeroOptimizer`, exact (Adam's 4-byte ``step``
    per piece aside).

    ``numel``: elements of the padded flat layout (every bucket a multiple of ``n``); ``owned``:
    the elements of parameters in this rank's slices. ``param_bytes``/``grad_bytes``: 2 or 4;
    ``masters``: separate fp32 master copies (half-precision training or offload). Parameters are
    whole below stage 3, gradients below stage 2; the padding is held wherever a whole buffer is.
    """
    if stage not in (1, 2, 3):
        raise ValueError(f"stage must be 1-3, got {stage!r}")
    if numel % n:
        raise ValueError(f"numel={numel} is not a multiple of n={n}: the flat layout pads every bucket to n")
    params = param_bytes * (numel if stage < 3 else numel // n)
    grads = grad_bytes * (numel if stage < 2 else numel // n)
    return params + grads + (4 * owned if masters else 0) + state_bytes * owned


@dataclass(frozen=True)
class DeepSpeedEstimate:
    """One row of DeepSpeed's estimator: bytes per GPU and per CPU (node) for an offload choice."""

    offload_optimizer: bool
    offload_param: bool
    zero_init: bool
    gpu_bytes: int
    cpu_bytes: int


def deepspeed_zero2_estimate(psi: int, gpus_per_node: int = 1, nodes: int = 1) -> list[DeepSpeedEstimate]:
    """DeepSpeed 0.19's stage-2 estimator rows (optimizer offloaded to the CPU, then not), re-derived.

    Offloaded: the GPU keeps the fp16 parameters (``2Ψ``); the CPU holds, per node, the larger of
    every local rank's fp32 copy of the model at load (``4 · gpus · Ψ``) and the 16 bytes of states
    (``16Ψ``). Not offloaded: ``2Ψ + 18Ψ/N`` on the GPU, the load-time copies on the CPU.
    """
    n = gpus_per_node * nodes
    f = DEEPSPEED_BUFFER_FACTOR
    return [DeepSpeedEstimate(True, False, False, 2 * psi, int(psi * max(4 * n, 16) * f)),
            DeepSpeedEstimate(False, False, False, 2 * psi + int(DEEPSPEED_PARTITIONED * psi / n),
                              int(psi * 4 * gpus_per_node * f))]


def deepspeed_zero3_estimate(psi: int, largest_layer: int, gpus_per_node: int = 1,
                             nodes: int = 1) -> list[DeepSpeedEstimate]:
    """DeepSpeed 0.19's stage-3 estimator rows in its printing order, re-derived.

    Every row holds the largest layer gathered in fp32 on the GPU (``4 · largest``). Parameters and
    optimizer offloaded: nothing else on the GPU, ``18Ψ`` per node on the CPU (``zero_init``) or the
    load-time copies if larger. Optimizer only: ``2Ψ/N`` of fp16 parameter partition on the GPU,
    ``16Ψ`` per node on the CPU. Nothing offloaded: ``18Ψ/N`` on the GPU; the CPU needs the largest
    layer per local rank (``zero_init``) or the whole model per local rank.
    """
    n = gpus_per_node * nodes
    f = DEEPSPEED_BUFFER_FACTOR
    per_node = 1 / nodes
    layer = 4 * largest_layer
    rows = []
    for zero_init in (True, False):
        cpu = psi * 18 * per_node if zero_init else psi * max(4 * gpus_per_node, 18 * per_node)
        rows.append(DeepSpeedEstimate(True, True, zero_init, layer, int(cpu * f)))
    for zero_init in (True, False):
        cpu = psi * 16 * per_node if zero_init else psi * max(4 * gpus_per_node, 16 * per_node)
        rows.append(DeepSpeedEstimate(True, False, zero_init, layer + int(2 * psi / n), int(cpu * f)))
    for zero_init in (True, False):
        cpu = largest_layer * 4 * gpus_per_node if zero_init else psi * 4 * gpus_per_node
        rows.append(DeepSpeedEstimate(False, False, zero_init, layer + int(DEEPSPEED_PARTITIONED * psi / n),
                                      int(cpu * f)))
    return rows
