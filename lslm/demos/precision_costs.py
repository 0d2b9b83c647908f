"""What each precision mode costs, measured in-process for notebook 07: model-state and activation bytes, step time.

* :func:`model_state_bytes_by_convention`: one real training step of the baseline GPT in
  each way of keeping model states (fp32; half weights with fp32 masters and ``main_grad``,
  ZeRO's half gradients, the Playbook's extra fp32 gradient copy; pure bf16), counted by
  :func:`lslm.precision.bytes.bytes_per_param` next to the convention it should equal, and what glibc's allocator
  says the same setup and step left behind (:class:`lslm.metrics.malloc_delta.MallocDelta`);
* :func:`activation_bytes_by_mode`: what autograd saves in one forward, per mode, counted and by the allocator;
* :func:`mode_step_time_ratios`: step time per mode, as ratios to fp32 (interleaved, medians).

The model, data and optimizer are :mod:`lslm.demos.precision_demo`'s (the serial recipe's).
"""

from __future__ import annotations

from contextlib import nullcontext
from typing import Any

import torch
from torch import nn

from lslm.demos.precision_demo import HALF_DTYPES, demo_batches, demo_config, optimizer_factory
from lslm.harness.bench_runner import Timing, Variant, run_variants
from lslm.harness.timer import StepTimer
from lslm.metrics.activations import ActivationMemory
from lslm.metrics.malloc_delta import MallocDelta, saved_by_allocator
from lslm.precision import CONVENTIONS, PRECISION_MODES, bytes_per_param, prepare_precision
from lslm.recipes.train import build_model

__all__ = ["CONVENTION_SETUPS", "activation_bytes_by_mode", "matmul_time_ratios", "mode_step_time_ratios",
           "model_state_bytes_by_convention"]

#: convention -> (precision mode, prepare_precision keywords) that keeps model states that way.
CONVENTION_SETUPS: dict[str, tuple[str, dict[str, Any]]] = {
    "fp32": ("fp32", {}),
    "zero": ("fp16", {"main_grad": False}),
    "main_grad": ("bf16", {}),
    "playbook": ("bf16", {"main_grad": False, "keep_fp32_grads": True}),
    "bf16_states": ("bf16", {"master_weights": False}),
}


def model_state_bytes_by_convention(batch_size: int = 8, seed: int = 0, **model: Any) -> list[dict[str, Any]]:
    """Model-state bytes per parameter after one real step in each way of :data:`CONVENTION_SETUPS`, vs the convention.

    Rows: ``convention``, ``mode``, ``source``, ``measured`` and ``expected`` (bytes per
    parameter by memory category, and ``total``), ``num_params``. Counted after backward and
    the step, before the next ``zero_grad`` (gradients alive, as at the step's peak); Adam's
    4-byte ``step`` counter per parameter tensor is left out (it does not scale with Ψ).

    ``allocator``: glibc's figure for the same thing, per parameter (``None`` off glibc): the bytes its
    allocator handed out for building the model and its optimizer and running that step, still held after it
    (:class:`~lslm.metrics.malloc_delta.MallocDelta`), everything included that the count leaves out (Python's
    module and optimizer objects, Adam's step counters, chunk headers). ``allocator_excess_bytes``: that figure
    minus the count, in bytes. Every setup runs once unmeasured first: the first step of a kind allocates for good
    (kernel and thread caches) what would otherwise land in its figure.
    """
    cfg = demo_config(batch_size, seed, model)
    x, y = demo_batches(cfg, 1)[0]

    def one_step(mode: str, kw: dict[str, Any]) -> Any:
        setup = prepare_precision(build_model(cfg), mode, optimizer_factory(cfg), **kw)
        setup.optimizer.zero_grad()
        setup.optimizer.backward(setup.model(x, y)[1])
        setup.optimizer.step(max_grad_norm=cfg.grad_clip)
        return setup

    for mode, kw in CONVENTION_SETUPS.values():
        one_step(mode, kw)
    rows = []
    for name, (mode, kw) in CONVENTION_SETUPS.items():
        with MallocDelta() as held:
            setup = one_step(mode, kw)
        measured = bytes_per_param(setup.model, setup.optimizer)
        conv = CONVENTIONS[name]
        counted = measured.total * measured.num_params
        rows.append({"convention": name, "mode": mode, "source": conv.source, "num_params": measured.num_params,
                     "measured": {**measured.per_param(), "total": measured.total},
                     "expected": {**conv.by_category(), "total": conv.total},
                     "allocator": None if held.bytes is None else held.bytes / measured.num_params,
                     "allocator_excess_bytes": None if held.bytes is None else held.bytes - counted})
        del setup
    return rows


class _SavedByKind(ActivationMemory):
    """:class:`ActivationMemory` that also splits the counted bytes by dtype and marks casts of weights."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__(model)
        self.by_dtype: dict[str, int] = {}
        self.weight_copy_bytes = 0
        self._weights = [p.detach() for p in model.parameters() if p.dim() == 2]

    def _pack(self, t: torch.Tensor) -> torch.Tensor:
        before = self.bytes
        out = super()._pack(t)
        new = self.bytes - before
        if new:
            name = str(t.dtype).removeprefix("torch.")
            self.by_dtype[name] = self.by_dtype.get(name, 0) + new
            # autocast saves the half copy of each weight it cast (a new storage, so it counts here);
            # recognise it by value: equal to a weight, or its transpose, rounded to t's dtype.
            if t.dim() == 2 and t.dtype != torch.float32 and any(
                    s.shape == w.shape and torch.equal(s, w.to(t.dtype)) for w in self._weights for s in (t, t.t())):
                self.weight_copy_bytes += new
        return out


def activation_bytes_by_mode(batch_size: int = 8, seed: int = 0, with_loss: bool = True,
                             **model: Any) -> list[dict[str, Any]]:
    """Bytes autograd saves in one forward (:class:`ActivationMemory`) of fp32, fp16 and bf16 models and autocast bf16.

    Rows: ``mode``, ``bytes``, ``ratio_to_fp32``, ``by_dtype`` (bytes per saved dtype),
    ``weight_copy_bytes`` (saved half copies of weights: autocast's casts, 0 otherwise) and
    ``allocator_bytes``: a second forward's graph measured by glibc's allocator instead
    (:func:`~lslm.metrics.malloc_delta.saved_by_allocator`; its nodes and chunk headers included, ``None`` off glibc).
    ``with_loss``: include the loss (the model's fp32 logits and cross-entropy's fp32
    log-softmax) or stop at the logits.
    """
    cfg = demo_config(batch_size, seed, model)
    x, y = demo_batches(cfg, 1)[0]
    rows = []
    for mode in ("fp32", "fp16", "bf16", "autocast bf16"):
        gpt = build_model(cfg).to(HALF_DTYPES.get(mode, torch.float32))
        cast = torch.autocast("cpu", dtype=torch.bfloat16) if mode.startswith("autocast") else nullcontext()
        with _SavedByKind(gpt) as act, cast:
            gpt(x, y if with_loss else None)

        def forward(gpt: nn.Module = gpt, cast: Any = cast) -> Any:
            with cast:
                return gpt(x, y if with_loss else None)

        allocator, nodes = saved_by_allocator(forward)
        del nodes
        rows.append({"mode": mode, "bytes": act.bytes, "by_dtype": act.by_dtype,
                     "weight_copy_bytes": act.weight_copy_bytes, "allocator_bytes": allocator})
    for r in rows:
        r["ratio_to_fp32"] = r["bytes"] / rows[0]["bytes"]
    return rows


def _ratios(times: dict[str, Timing], reference: str) -> tuple[dict[str, float], dict[str, float], dict[str, float]]:
    """(median ratio to ``reference``, ratio of the fastest rounds, median seconds), per variant."""
    med = {k: t.median() for k, t in times.items()}
    ratio = {k: med[k] / med[reference] for k in times}
    minima = {k: min(t.total_s) / min(times[reference].total_s) for k, t in times.items()}
    return ratio, minima, med


def mode_step_time_ratios(repeats: int = 7, warmup: int = 2, modes: tuple[str, ...] = ("fp32", "fp16", "bf16"),
                          batch_size: int = 8, seed: int = 0, **model: Any) -> dict[str, Any]:
    """Median training-step time of each lslm mode (forward, backward, clip, AdamW), as ratios to fp32.

    Timed by the bench runner (:func:`lslm.harness.bench_runner.run_variants`, in this one
    process): modes interleaved in rotating order, ``warmup`` rounds untimed, then ``repeats``,
    so a slow spell of a shared machine hits them alike. Returns ``ratio_to_fp32`` (of the
    medians) per mode, ``ratio_of_minima`` (the least disturbed steps: a check on the medians
    when other jobs share the cores), ``median_s`` and ``repeats``.
    """
    if "fp32" not in modes or not set(modes) <= set(PRECISION_MODES):
        raise ValueError(f"modes must be among {PRECISION_MODES} and include 'fp32' (the reference), got {modes}")
    cfg = demo_config(batch_size, seed, model, minimum=0, warmup=warmup)
    demo_config(batch_size, seed, {}, repeats=repeats)  # >= 1: a median needs a timed step
    x, y = demo_batches(cfg, 1)[0]

    def variant(mode: str) -> Variant:
        s = prepare_precision(build_model(cfg), mode, optimizer_factory(cfg))

        def one_step(timer: StepTimer, _: int) -> None:
            s.optimizer.zero_grad()
            s.optimizer.backward(s.model(x, y)[1])
            s.optimizer.step(max_grad_norm=cfg.grad_clip)
        return Variant(mode, one_step)

    times = run_variants([variant(m) for m in modes], steps=repeats, warmup=warmup)
    ratio, minima, med = _ratios(times, "fp32")
    return {"ratio_to_fp32": ratio, "ratio_of_minima": minima, "median_s": med, "repeats": repeats}


def matmul_time_ratios(n: int = 256, repeats: int = 9, dtypes: tuple[str, ...] = ("fp32", "fp16", "bf16"),
                       seed: int = 0) -> dict[str, Any]:
    """Median time of one ``n x n`` matmul on the CPU in each dtype, as ratios to fp32 (interleaved, after a warm-up).

    The matmul alone, without the rest of a training step: how fast this CPU's kernels for each
    format are. Timed by the bench runner as :func:`mode_step_time_ratios` is. Returns
    ``ratio_to_fp32`` per dtype, ``median_s`` and ``n``.
    """
    if not isinstance(n, int) or n < 1 or not isinstance(repeats, int) or repeats < 1:
        raise ValueError(f"n and repeats must be ints >= 1, got n={n!r}, repeats={repeats!r}")
    if "fp32" not in dtypes or not set(dtypes) <= set(PRECISION_MODES):
        raise ValueError(f"dtypes must be among {PRECISION_MODES} and include 'fp32' (the reference), got {dtypes}")
    g = torch.Generator().manual_seed(seed)
    a32 = torch.randn(n, n, generator=g)  # lslm: cpu-ok (measures this CPU's matmul kernels)
    b32 = torch.randn(n, n, generator=g)  # lslm: cpu-ok (measures this CPU's matmul kernels)

    def variant(d: str) -> Variant:
        a, b = (t.to(HALF_DTYPES.get(d, torch.float32)) for t in (a32, b32))
        return Variant(d, lambda timer, _: a @ b)

    times = run_variants([variant(d) for d in dtypes], steps=repeats, warmup=1)
    ratio, _, med = _ratios(times, "fp32")
    return {"ratio_to_fp32": ratio, "median_s": med, "n": n}
