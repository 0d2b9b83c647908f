"""Exact bytes of model states (parameters, gradients, optimizer states) and the ZeRO formulas."""

from __future__ import annotations

import dataclasses
from collections.abc import Hashable, Iterable
from dataclasses import dataclass

import torch
from torch import nn

from lslm.metrics.storage import format_bytes, storage_local, storage_of, tensors_in

_OPTIMIZERS = ("adam", "adamw", "sgd", "sgd_momentum")


@dataclass(frozen=True)
class ModelStateBytes:
    """Bytes of model states, per category (measured or theoretical).

    ``total`` is params + grads + optimizer_states: the "model states" of the
    ZeRO paper. ``buffers`` (BatchNorm statistics, masks, rotary caches) is real
    memory but not part of that formula, so it is reported beside ``total``,
    not inside it. ``num_params`` counts elements, ``num_param_tensors`` counts
    parameter tensors (Adam keeps one ``step`` scalar per tensor).
    """

    params: int
    grads: int
    optimizer_states: int
    buffers: int = 0
    num_params: int = 0
    num_param_tensors: int = 0

    @property
    def total(self) -> int:
        """Params + grads + optimizer states (buffers excluded, see class doc)."""
        return self.params + self.grads + self.optimizer_states

    def to_dict(self) -> dict[str, int]:
        """Plain dict for JSON, ``total`` included."""
        return {**dataclasses.asdict(self), "total": self.total}

    def __str__(self) -> str:
        # Adaptive units: tiny course models would all read "0.00 MiB".
        return (
            f"params {format_bytes(self.params)}, grads {format_bytes(self.grads)}, "
            f"optimizer {format_bytes(self.optimizer_states)}, total {format_bytes(self.total)}"
        )


def model_state_bytes(
    model: nn.Module, optimizer: torch.optim.Optimizer | None = None
) -> ModelStateBytes:
    """Measure exact bytes of parameters, gradients and optimizer states.

    Rules:

    * Unique storages only: tied parameters and parameters that are views of
      one flat buffer count once, at the storage's full size.
    * Categories are filled in the order params, grads, optimizer_states,
      buffers; a storage shared between categories counts in the first one only.
    * Grads: ``p.grad`` of every parameter that has one, else its ``main_grad`` (a view of a
      gradient buffer: the buffer counts once, padding included).
    * Optimizer states: every tensor in ``optimizer.state`` — for Adam,
      ``exp_avg``, ``exp_avg_sq`` *and* the 0-d ``step`` tensor (float32, on the
      CPU unless ``capturable``/``fused``), because it is memory too. Parameters
      the optimizer owns that are not in ``model`` (fp32 master weights in mixed
      precision) count as optimizer states, as in ZeRO's accounting; their
      ``.grad`` counts as grads.
    * Buffers are reported in ``buffers`` and left out of ``total``.
    """
    seen: set[Hashable] = set()

    def count(tensors: Iterable[torch.Tensor]) -> int:
        total = 0
        for t in tensors:
            key, nbytes, _ = storage_of(t)
            if key not in seen:
                seen.add(key)
                total += nbytes
        return total

    params = list(model.parameters())  # already unique by identity (tied weights once)
    owned = {id(p) for p in params}
    masters: list[torch.Tensor] = []
    state_tensors: list[torch.Tensor] = []
    if optimizer is not None:
        for group in optimizer.param_groups:
            for p in group["params"]:
                if id(p) not in owned:
                    owned.add(id(p))
                    masters.append(p)
        state_tensors = list(tensors_in(list(optimizer.state.values())))

    param_bytes = count(params)
    # A gradient buffer (lslm.data_parallel.grad_buffer) holds the gradient in main_grad, .grad being None.
    grads = (p.grad if p.grad is not None else getattr(p, "main_grad", None) for p in params + masters)
    grad_bytes = count(g for g in grads if g is not None)
    state_bytes = count(masters) + count(state_tensors)
    buffer_bytes = count(model.buffers())
    return ModelStateBytes(
        params=param_bytes,
        grads=grad_bytes,
        optimizer_states=state_bytes,
        buffers=buffer_bytes,
        num_params=sum(storage_local(p).numel() for p in params),
        num_param_tensors=len(params),
    )


def theory_model_state_bytes(
    num_params: int,
    param_dtype: torch.dtype = torch.float32,
    optimizer: str | None = "adam",
    grads: bool = True,
    *,
    num_param_tensors: int = 0,
    master_weights: bool = False,
) -> ModelStateBytes:
    """Textbook model-state bytes for ``num_params`` (Ψ) parameters.

    With ``b`` the bytes per element of ``param_dtype`` and ``s`` the bytes per
    element the optimizer works in (``4`` with ``master_weights``, else ``b``)::

        params           = b·Ψ
        grads            = b·Ψ                      (0 if grads=False)
        optimizer_states = 0                        optimizer None or "sgd"
                         = s·Ψ                      "sgd_momentum" (momentum buffer)
                         = 2·s·Ψ + 4·T              "adam"/"adamw" (exp_avg, exp_avg_sq,
                                                     one float32 step scalar per tensor)
                         + 4·Ψ                      if master_weights (fp32 copy)

    ``T`` is ``num_param_tensors``; the step scalar is 8 bytes when the default
    dtype is float64, mirroring ``torch.optim``. Examples: fp32 Adam is
    4Ψ + 4Ψ + 8Ψ = 16Ψ; fp16 Adam with fp32 master weights is ZeRO's
    2Ψ + 2Ψ + 12Ψ = 16Ψ (K = 12). Master-weight gradients are assumed not kept.
    """
    if optimizer is not None and optimizer not in _OPTIMIZERS:
        raise ValueError(f"unknown optimizer {optimizer!r}; expected one of {_OPTIMIZERS} or None")
    if num_params < 0 or num_param_tensors < 0:
        raise ValueError("num_params and num_param_tensors must be >= 0")
    b = param_dtype.itemsize
    s = 4 if master_weights else b
    step_bytes = 8 if torch.get_default_dtype() == torch.float64 else 4
    states = 4 * num_params if master_weights else 0
    if optimizer == "sgd_momentum":
        states += s * num_params
    elif optimizer in ("adam", "adamw"):
        states += 2 * s * num_params + step_bytes * num_param_tensors
    return ModelStateBytes(
        params=b * num_params,
        grads=b * num_params if grads else 0,
        optimizer_states=states,
        num_params=num_params,
        num_param_tensors=num_param_tensors,
    )

