"""Model-state bytes per parameter in each precision mode: the conventions, and the real tensors counted.

Mixed precision does *not* shrink model states: half-precision weights and gradients
save 4 bytes per parameter, fp32 master weights cost 4 back, and Adam's two fp32 moments
stay. What it shrinks is activations (and what it speeds up is the matmuls). The numbers
quoted in the literature differ by what they keep:

==================  ===========================================================  ==========
convention          bytes per parameter (Adam)                                   total
==================  ===========================================================  ==========
``fp32``            4 weight + 4 gradient + 4 + 4 moments                        16
``zero``            2 fp16 weight + 2 fp16 gradient + 4 master + 4 + 4 moments   16
``main_grad``       2 half weight + 4 fp32 main grad + 4 master + 4 + 4          18
``playbook``        2 half weight + 2 half grad + 4 fp32 grad + 4 master + 8     20
``bf16_states``     2 bf16 weight + 2 bf16 gradient + 2 + 2 bf16 moments         8
==================  ===========================================================  ==========

Sources: ZeRO (Rajbhandari et al. 2020) §3.1, "2Ψ + 2Ψ + KΨ, K = 12"; Megatron-LM's
``main_grad`` (18: the fp32 gradient replaces the half one); the Ultra-Scale Playbook
(Hugging Face 2025), which adds the fp32 gradient copy some frameworks keep beside the
bf16 one (20); optimizer states in bf16, no masters (8).

:func:`bytes_per_param` counts the tensors a model and an optimizer (or
:class:`~lslm.precision.master.MixedPrecisionOptimizer`) hold, by
:mod:`lslm.metrics`'s rules (each storage once, in its first category), leaving out
Adam's 0-d ``step`` counters (4 bytes per parameter *tensor*, not per parameter), and
divides by the number of parameters. The tests check that every mode measures exactly
its convention. Measure after ``backward`` and ``step``, before ``zero_grad``: the
gradients are then alive, as they are at the step's peak.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from torch import nn

from lslm.metrics.breakdown import count_by_owner
from lslm.metrics.owners import collect_owned

__all__ = ["CONVENTIONS", "STATE_CATEGORIES", "BytesPerParam", "Convention", "bytes_per_param", "compare"]

#: The memory categories that make up model states, in lslm.metrics' order.
STATE_CATEGORIES = ("parameters", "gradients", "master_weights", "main_grads", "optimizer_states")


@dataclass(frozen=True)
class Convention:
    """A quoted bytes-per-parameter figure, split by memory category, with where it comes from."""

    name: str
    source: str
    parameters: int
    gradients: int
    master_weights: int
    main_grads: int
    optimizer_states: int

    @property
    def total(self) -> int:
        """Bytes per parameter of all model states."""
        return sum(self.by_category().values())

    def by_category(self) -> dict[str, int]:
        """``{category: bytes per parameter}`` over :data:`STATE_CATEGORIES`."""
        return {c: getattr(self, c) for c in STATE_CATEGORIES}


CONVENTIONS: dict[str, Convention] = {c.name: c for c in (
    Convention("fp32", "fp32 Adam: weight, gradient, two moments", 4, 4, 0, 0, 8),
    Convention("zero", "ZeRO §3.1: fp16 weight and gradient, K = 12 (fp32 master + 2 moments)", 2, 2, 4, 0, 8),
    Convention("main_grad", "Megatron-LM: half weight, fp32 main_grad instead of the half gradient, K = 12",
               2, 0, 4, 4, 8),
    Convention("playbook", "Ultra-Scale Playbook: half weight and gradient, an fp32 gradient copy, K = 12",
               2, 2, 4, 4, 8),
    Convention("bf16_states", "pure bf16: weight, gradient and both Adam moments in bf16, no master", 2, 2, 0, 0, 4),
)}


@dataclass(frozen=True)
class BytesPerParam:
    """Measured model-state bytes, per category, and per parameter.

    ``bytes`` maps each of :data:`STATE_CATEGORIES` to bytes (logical, all devices);
    ``num_params`` is Ψ; ``step_counter_bytes`` the 0-d optimizer tensors left out.
    """

    bytes: dict[str, int]
    num_params: int
    step_counter_bytes: int = 0
    extra: dict[str, Any] = field(default_factory=dict)

    def per_param(self) -> dict[str, float]:
        """``{category: bytes / Ψ}``."""
        return {c: b / self.num_params for c, b in self.bytes.items()}

    @property
    def total(self) -> float:
        """Bytes of all model states per parameter."""
        return sum(self.bytes.values()) / self.num_params


def bytes_per_param(model: nn.Module, optimizer: Any) -> BytesPerParam:
    """Count the model states ``model`` and ``optimizer`` hold now, per parameter, Adam's step counters aside.

    ``optimizer``: a torch optimizer, :class:`~lslm.precision.master.MixedPrecisionOptimizer`
    or :class:`~lslm.precision.modes.PlainOptimizer` (anything with ``param_groups`` and
    ``state``). Categories and deduplication are :func:`lslm.metrics.memory_by_owner`'s.
    """
    pairs = collect_owned(model, optimizer)
    kept = [(c, t) for c, t in pairs if not (c == "optimizer_states" and t.dim() == 0)]
    counters = count_by_owner([(c, t) for c, t in pairs if c == "optimizer_states" and t.dim() == 0])
    counted = count_by_owner(kept)
    num_params = sum(p.numel() for p in model.parameters())
    if num_params == 0:
        raise ValueError("the model has no parameters")
    return BytesPerParam(bytes={c: counted.get(c, kind="logical") for c in STATE_CATEGORIES}, num_params=num_params,
                         step_counter_bytes=counters.get("optimizer_states", kind="logical"))


def compare(measured: BytesPerParam, convention: str | Convention) -> list[dict[str, Any]]:
    """Rows ``{category, measured, convention}`` (bytes per parameter) and a ``total`` row, for tables."""
    conv = CONVENTIONS[convention] if isinstance(convention, str) else convention
    got = measured.per_param()
    rows = [{"category": c, "measured": got[c], "convention": conv.by_category()[c]} for c in STATE_CATEGORIES]
    rows.append({"category": "total", "measured": measured.total, "convention": conv.total})
    return rows
