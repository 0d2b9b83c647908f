"""One ``--precision`` option for every recipe: ``fp32``, ``fp16`` or ``bf16``.

:func:`prepare_precision` turns a freshly built fp32 model and an optimizer factory into
what the mode needs, behind one interface (``backward(loss)``, ``step() -> bool``,
``zero_grad()``, ``state_dict()``), so a training loop is written once:

==========  ===============================================================  ================
mode        what it builds                                                   bytes/param
==========  ===============================================================  ================
``fp32``    the model as is, the optimizer on its parameters                 4+4+8 = 16
``fp16``    fp16 model, fp32 masters + ``main_grad``, a dynamic loss scaler  2+4+4+8 = 18
``bf16``    bf16 model, fp32 masters + ``main_grad``, no scaler              2+4+4+8 = 18
==========  ===============================================================  ================

With ``main_grad`` (the default, in every mode) the gradients live in gradient buffers
(:mod:`lslm.data_parallel.grad_buffer`: those attached to the model beforehand, else one fp32
buffer attached here); fp32's optimizer sees them as ``.grad`` during ``step()`` only.

Variants by keyword: ``main_grad=False`` keeps half ``.grad`` (16, ZeRO's count; with
``keep_fp32_grads=True`` 20, the Playbook's); ``bf16`` with ``master_weights=False``
steps the optimizer on the bf16 weights themselves, so its states are bf16 too
(2+2+4 = 8: the "bf16 optimizer states" variant; updates smaller than half a bf16
spacing of a weight are lost, which is why masters exist). :mod:`lslm.precision.bytes`
measures all of them.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from lslm.data_parallel.grad_buffer import buffers_of, has_main_grad
from lslm.data_parallel.grad_sync import zero_grad_buffers
from lslm.precision.master import ClipFn, MixedPrecisionOptimizer, use_grad_buffers
from lslm.precision.scaler import DynamicLossScaler

__all__ = ["PARAM_DTYPES", "PRECISION_MODES", "PlainOptimizer", "PrecisionSetup", "check_precision",
           "prepare_precision"]

PRECISION_MODES = ("fp32", "fp16", "bf16")
PARAM_DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}


def check_precision(mode: str) -> str:
    """Return ``mode`` if it is one of :data:`PRECISION_MODES`, else raise ``ValueError`` listing them."""
    if mode not in PRECISION_MODES:
        raise ValueError(f"unknown precision {mode!r}; expected one of {PRECISION_MODES}")
    return mode


class PlainOptimizer:
    """A torch optimizer behind the :class:`MixedPrecisionOptimizer` interface (fp32, or pure bf16).

    ``step()`` returns True (it always steps), ``backward(loss)`` is ``loss.backward()``;
    ``max_grad_norm`` clips the model's gradients first.
    """

    scaler = None
    loss_scale = 1.0

    def __init__(self, model: nn.Module, optimizer: torch.optim.Optimizer) -> None:
        self.model = model
        self.optimizer = optimizer
        self.params = [p for g in optimizer.param_groups for p in g["params"]]
        # Gradients in buffers (main_grad) when the model has them: the optimizer sees them as .grad only
        # inside step(), so a backward never finds a .grad to accumulate into besides the buffer's hook.
        self.grad_buffers = buffers_of(self.params)

    @property
    def param_groups(self) -> list[dict[str, Any]]:
        """The optimizer's parameter groups."""
        return self.optimizer.param_groups

    @property
    def state(self) -> Any:
        """The optimizer's state."""
        return self.optimizer.state

    def scale_loss(self, loss: torch.Tensor) -> torch.Tensor:
        """The loss itself (no loss scaling in fp32 or bf16)."""
        return loss

    def backward(self, loss: torch.Tensor) -> None:
        """``loss.backward()``."""
        loss.backward()

    def zero_grad(self) -> None:
        """Free every gradient (``set_to_none``); zero the gradient buffers in place."""
        self.optimizer.zero_grad(set_to_none=True)
        if self.grad_buffers:
            zero_grad_buffers(self.params)

    def step(self, max_grad_norm: float | None = None, *, clip: ClipFn | None = None) -> bool:
        """Clip (if asked) and step; always True.

        ``clip(params, max_grad_norm)`` replaces ``torch.nn.utils.clip_grad_norm_`` where the
        norm spans ranks (tensor or pipeline parallelism: :func:`lslm.tensor_parallel.clip.clip_grad_norm_`).
        With gradient buffers, each ``.grad`` is its ``main_grad`` (a view, or a cast copy when the
        buffer's dtype differs) during the step only.
        """
        if self.grad_buffers:
            for p in self.params:
                if has_main_grad(p):
                    p.grad = p.main_grad if p.main_grad.dtype == p.dtype else p.main_grad.to(p.dtype)
        try:
            if max_grad_norm is not None and max_grad_norm > 0:
                (clip or torch.nn.utils.clip_grad_norm_)([p for p in self.params if p.grad is not None],
                                                         max_grad_norm)
            self.optimizer.step()
        finally:
            if self.grad_buffers:
                for p in self.params:
                    if has_main_grad(p):
                        p.grad = None
        return True

    def state_dict(self) -> dict[str, Any]:
        """The optimizer's state dict."""
        return {"optimizer": self.optimizer.state_dict()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore :meth:`state_dict` output."""
        self.optimizer.load_state_dict(state["optimizer"])


@dataclass
class PrecisionSetup:
    """What :func:`prepare_precision` built: the (cast) ``model``, the ``optimizer`` wrapper, the ``scaler``.

    ``convention``: the key of :data:`lslm.precision.bytes.CONVENTIONS` whose bytes per
    parameter this setup holds (measured equal by the tests).
    """

    mode: str
    model: nn.Module
    optimizer: MixedPrecisionOptimizer | PlainOptimizer
    scaler: DynamicLossScaler | None
    param_dtype: torch.dtype
    convention: str


def prepare_precision(model: nn.Module, mode: str, optimizer_factory: Callable[[list[torch.Tensor]], Any], *,
                      main_grad: bool = True, keep_fp32_grads: bool = False, master_weights: bool = True,
                      scaler: DynamicLossScaler | dict[str, Any] | None = None, comm: Any = None,
                      group: Any = None) -> PrecisionSetup:
    """Prepare ``model`` (fp32, as built) and an optimizer for ``mode``; see the module doc's table.

    ``optimizer_factory(params)`` builds the optimizer over the list it is given (the
    model's parameters for fp32 and pure bf16, the fp32 masters otherwise). fp16 gets a
    :class:`DynamicLossScaler`: ``scaler`` may be one, or a dict of its keyword arguments;
    ``comm``/``group`` (e.g. ``ctx.comm`` and ``None`` for the world) are given to a scaler
    built here, so every rank skips the same steps (a scaler passed in keeps its own).
    ``main_grad``, ``keep_fp32_grads``: :class:`MixedPrecisionOptimizer`. ``master_weights=False``
    is accepted for bf16 only.
    """
    check_precision(mode)
    dtype = PARAM_DTYPES[mode]
    if mode != "fp16" and scaler is not None:
        raise ValueError(f"a loss scaler is for fp16 only; {mode} has fp32's exponent range and needs none")
    if not master_weights and mode != "bf16":
        raise ValueError("master_weights=False is the pure-bf16 variant: fp16 without fp32 masters loses Adam's "
                         "eps (1e-8 underflows in fp16) and small updates; fp32 has no separate masters anyway")
    if mode == "fp32" or not master_weights:
        if mode == "bf16":
            model.to(dtype)
        params = [p for p in model.parameters() if p.requires_grad]
        if mode == "fp32" and main_grad:
            use_grad_buffers(params)  # the gradients in one fp32 buffer, as in every mode
        elif not main_grad and any(has_main_grad(p) for p in params):
            raise ValueError("main_grad=False, but gradient buffers are attached to this model: pass main_grad=True "
                             "(or detach them: lslm.data_parallel.grad_sync.detach_grad_buffers)")
        optimizer = PlainOptimizer(model, optimizer_factory(params))
        convention = "fp32" if mode == "fp32" else "bf16_states"
        return PrecisionSetup(mode, model, optimizer, None, dtype, convention)
    if mode == "fp16":
        if scaler is None or isinstance(scaler, dict):
            scaler = DynamicLossScaler(**{"comm": comm, "group": group, **(scaler or {})})
    mp = MixedPrecisionOptimizer(model, optimizer_factory, dtype, scaler=scaler, main_grad=main_grad,
                                 keep_fp32_grads=keep_fp32_grads)
    convention = "main_grad" if main_grad else ("playbook" if keep_fp32_grads else "zero")
    return PrecisionSetup(mode, model, mp, scaler, dtype, convention)
