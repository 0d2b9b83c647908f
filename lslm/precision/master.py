"""fp16 / bf16 training with fp32 master weights and an fp32 ``main_grad``.

The model computes in half precision (fp16 or bf16: half the bytes of every weight,
activation and matmul operand). The optimizer must not: an update ``lr * m / sqrt(v)``
of 1e-4 added to a weight of 1.0 is below bf16's spacing there (2^-7 = 0.0078) and fp16's
(2^-10), so it would vanish; Adam's ``eps = 1e-8`` underflows in fp16. Hence (Micikevicius
et al. 2018, §3.1) an fp32 **master copy** of every weight that the optimizer updates,
copied back (rounded) into the half-precision model after each step.

Gradients, two ways (``main_grad``):

* ``main_grad=True`` (Megatron-LM, picotron): each parameter's gradient lives in an fp32
  ``main_grad``, a view into one contiguous :class:`~lslm.data_parallel.grad_buffer.GradBuffer`.
  A hook that runs when backward has accumulated a parameter's half-precision ``.grad``
  adds it into ``main_grad`` in fp32 and frees ``.grad``. Micro-batches of gradient
  accumulation thus sum in fp32, and no half gradient outlives its layer's backward. The
  master weight's ``.grad`` *is* ``main_grad`` (same storage): 2 + 4 + 4 + 8 = 18 bytes per
  parameter with Adam. Buffers attached beforehand
  (:func:`~lslm.data_parallel.grad_sync.attach_grad_buffers`: per pipeline stage, split by
  the reduction tensor parallelism needs, bucketed for DDP, in the parameters' dtype) are
  used as they are; otherwise one fp32 buffer over the model is attached here.
* ``main_grad=False``: the half ``.grad`` stays (and accumulates in half precision); at the
  step it is converted to fp32 for the master. ``keep_fp32_grads=False``: the fp32 copy is
  made at the step and freed after it (the ZeRO paper's 2 + 2 + 12 = 16 bytes counts what
  persists; the copy is a transient of 4 bytes per parameter during the step).
  ``keep_fp32_grads=True``: a persistent fp32 gradient buffer per parameter (the
  Ultra-Scale Playbook's 20 bytes).

The step (:meth:`MixedPrecisionOptimizer.step`): fp32 gradients, unscaled by the loss
scale; the overflow check, reduced across ranks (:meth:`DynamicLossScaler.has_overflow`);
on an overflow nothing is stepped at all, otherwise optional clipping, the inner
optimizer's step on the masters, and the masters copied into the model. Without a scaler
(bf16: fp32's exponent range, no loss scaling needed) there is no check: a NaN then
reaches the weights exactly as it would in fp32 training.

Composition: with ``main_grad`` the gradient is in the buffer and ``.grad`` is None after
backward. Every lslm sync reduces the buffer (bucketed DDP, the TP and pipeline syncs, the
global-norm clip); the wrappers that can only reduce ``.grad`` (naive and fused DDP, torch's
DDP) refuse such a model instead of reducing nothing.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from lslm.data_parallel.grad_buffer import BUFFER_ATTRS, GradBuffer, buffers_of, has_main_grad
from lslm.data_parallel.grad_sync import attach_grad_buffers, zero_grad_buffers
from lslm.precision.scaler import DynamicLossScaler

__all__ = ["HALF_DTYPES", "ClipFn", "MixedPrecisionOptimizer", "layout_marks", "use_grad_buffers"]

HALF_DTYPES = (torch.float16, torch.bfloat16)

#: ``clip(params, max_norm)``: clip the gradients of ``params`` to a global norm (torch's, or a parallel one).
ClipFn = Callable[[list[torch.Tensor], float], Any]


def layout_marks(param: torch.Tensor) -> dict[str, Any]:
    """``param``'s layout attributes (``tensor_model_parallel``, ``partition_dim``, ``replicated_heads``, ...),
    without the gradient buffer's own (``main_grad``, ``grad_buffer``): what a master copy carries."""
    return {k: v for k, v in param.__dict__.items() if k not in BUFFER_ATTRS}


def use_grad_buffers(params: list[torch.Tensor], dtype: torch.dtype = torch.float32) -> list[GradBuffer]:
    """The buffers holding ``params``' gradients: those already attached, else one attached now in ``dtype``.

    Raises ``ValueError`` when only some of ``params`` have one (their gradients would live in
    two places), or when an attached buffer also holds parameters outside ``params``.
    """
    held = [has_main_grad(p) for p in params]
    if not any(held):
        return attach_grad_buffers(params, dtype=dtype)
    if not all(held):
        raise ValueError(f"{held.count(False)} of {len(params)} parameters have no gradient buffer while the others "
                         "do: attach buffers to the whole model (attach_grad_buffers) or to none of it")
    buffers = buffers_of(params)
    ids = {id(p) for p in params}
    for buf in buffers:
        if any(id(q) not in ids for q in buf.params):
            raise ValueError("a gradient buffer holds parameters this optimizer does not update: attach buffers to "
                             "the optimizer's parameters only")
    return buffers


class MixedPrecisionOptimizer:
    """Half-precision model, fp32 master weights stepped by an inner optimizer, optional loss scaling.

    ``model``: cast in place to ``dtype`` (parameters and floating buffers); the fp32
    masters are cloned from its parameters *before* the cast, so an fp32 model's weights
    are kept exactly. ``optimizer_factory``: called once with the list of fp32 masters
    (in ``model.parameters()`` order, shapes equal) and returns the inner optimizer, e.g.
    ``lambda ps: torch.optim.AdamW(ps, lr=1e-3)``; split the list into groups there (by
    ``p.dim()``, say) for per-group settings. ``scaler``: a :class:`DynamicLossScaler` (fp16),
    or ``None`` (bf16). ``main_grad`` / ``keep_fp32_grads``: see the module doc.

    Loop::

        mp.zero_grad()
        for x, y in micro_batches:
            mp.backward(model(x, y)[1] / len(micro_batches))
        stepped = mp.step(max_grad_norm=1.0)   # False: skipped on overflow

    ``param_groups`` and ``state`` are the inner optimizer's (on the masters), so
    :func:`lslm.metrics.memory_by_owner` ``(model, mp)`` counts masters as ``master_weights``,
    their gradients as ``main_grads`` and ``state`` as ``optimizer_states``.
    """

    def __init__(self, model: nn.Module, optimizer_factory: Callable[[list[torch.Tensor]], Any],
                 dtype: torch.dtype = torch.float16, scaler: DynamicLossScaler | None = None, main_grad: bool = True,
                 *, keep_fp32_grads: bool = False) -> None:
        if dtype not in HALF_DTYPES:
            raise ValueError(f"dtype must be torch.float16 or torch.bfloat16, got {dtype}; for fp32 training use the "
                             "optimizer directly (lslm.precision.prepare_precision(model, 'fp32', ...))")
        if main_grad and keep_fp32_grads:
            raise ValueError("keep_fp32_grads=True is the main_grad=False variant (a persistent fp32 copy of the "
                             "half .grad); with main_grad=True the fp32 gradient is main_grad itself")
        if scaler is not None and not isinstance(scaler, DynamicLossScaler):
            raise TypeError(f"scaler must be a DynamicLossScaler or None, got {type(scaler).__name__}")
        self.model = model
        self.dtype = dtype
        self.scaler = scaler
        self.main_grad = bool(main_grad)
        self.keep_fp32_grads = bool(keep_fp32_grads)
        self.params = [p for p in model.parameters() if p.requires_grad]  # shared (tied) parameters once
        if not self.params:
            raise ValueError("the model has no parameter that requires grad: nothing to optimise")
        # detach().clone().float(): an exact copy of fp32 weights, an exact upcast of half ones.
        self.masters = [p.detach().clone().float() for p in self.params]
        for p, m in zip(self.params, self.masters):
            # A master stands for its parameter: it carries the parameter's layout marks (tensor_model_parallel,
            # partition_dim, replicated_heads, ...), so a global norm over masters counts shards as over params.
            m.__dict__.update(layout_marks(p))
        self.optimizer = optimizer_factory(list(self.masters))
        owned = {id(m) for g in self.optimizer.param_groups for m in g["params"]}
        if owned != {id(m) for m in self.masters}:
            raise ValueError("optimizer_factory must build its optimizer over exactly the master tensors it is given "
                             "(it received the fp32 masters; did it read model.parameters() instead?)")
        model.to(dtype)  # only now: a refused factory leaves the model as it was
        self._fp32_grads: list[torch.Tensor] = []
        self.grad_buffers: list[GradBuffer] = []
        if self.main_grad:
            self.grad_buffers = use_grad_buffers(self.params)
            self._master_grads()  # the master's gradient is main_grad: one fp32 buffer, no copy
        elif any(has_main_grad(p) for p in self.params):
            raise ValueError("main_grad=False, but gradient buffers are attached to this model: pass main_grad=True "
                             "(or detach them: lslm.data_parallel.grad_sync.detach_grad_buffers)")
        elif self.keep_fp32_grads:
            self._fp32_grads = [torch.zeros_like(m) for m in self.masters]

    # -- the optimizer-facing attributes -------------------------------------------------
    @property
    def param_groups(self) -> list[dict[str, Any]]:
        """The inner optimizer's parameter groups (over the fp32 masters): set ``lr`` here."""
        return self.optimizer.param_groups

    @property
    def state(self) -> Any:
        """The inner optimizer's state (Adam's moments, fp32)."""
        return self.optimizer.state

    @property
    def loss_scale(self) -> float:
        """The scaler's current scale (1.0 without a scaler)."""
        return self.scaler.scale if self.scaler is not None else 1.0

    def memory_owners(self) -> dict[str, list[torch.Tensor]]:
        """Persistent fp32 gradient buffers (``keep_fp32_grads=True``) as ``main_grads``; see lslm.metrics."""
        return {"main_grads": list(self._fp32_grads)} if self._fp32_grads else {}

    # -- backward --------------------------------------------------------------------------
    def scale_loss(self, loss: torch.Tensor) -> torch.Tensor:
        """The loss times the loss scale (in fp32), or the loss itself without a scaler."""
        return self.scaler.scale_loss(loss) if self.scaler is not None else loss

    def backward(self, loss: torch.Tensor) -> None:
        """Backward of the scaled loss; call once per micro-batch (gradients accumulate)."""
        self.scale_loss(loss).backward()

    def zero_grad(self) -> None:
        """Clear every gradient: the buffers zeroed in place (kept, one fill each), half ``.grad`` freed."""
        if self.main_grad:
            zero_grad_buffers(self.params)
        for p in self.params:
            p.grad = None
        if not self.main_grad:
            for m in self.masters:
                m.grad = None

    # -- the step ----------------------------------------------------------------------------
    def _master_grads(self) -> list[torch.Tensor]:
        """Point every master's ``.grad`` at this step's fp32 gradient; return those gradients."""
        if self.main_grad:
            for p, m in zip(self.params, self.masters):
                # Again at every step: an inner optimizer's own zero_grad() may have unset it. A buffer kept in
                # the parameters' half dtype (reduced in half precision) is upcast here, a transient copy.
                m.grad = p.main_grad if p.main_grad.dtype == torch.float32 else p.main_grad.float()
            return [m.grad for m in self.masters]
        grads = []
        for i, (p, m) in enumerate(zip(self.params, self.masters)):
            if p.grad is None:  # unused this step: torch optimizers then skip the parameter
                m.grad = None
                continue
            if self._fp32_grads:
                m.grad = self._fp32_grads[i].copy_(p.grad)
            else:
                m.grad = p.grad.float()
            grads.append(m.grad)
        return grads

    def step(self, max_grad_norm: float | None = None, *, clip: ClipFn | None = None) -> bool:
        """Unscale, check, clip, step the masters and copy them into the model; False if skipped.

        On an overflow (any rank of the scaler's group found inf/NaN) the inner optimizer
        is not called: masters, model parameters and optimizer state stay bit-identical,
        and the scale is lowered. ``max_grad_norm`` clips the unscaled fp32 gradients
        (norm over this rank's masters only). May raise
        :class:`~lslm.precision.scaler.LossScaleAtMinimumError`. ``clip(masters, max_grad_norm)``
        replaces ``torch.nn.utils.clip_grad_norm_`` where the norm spans ranks (tensor or
        pipeline parallelism: the masters carry their parameters' layout attributes).
        """
        grads = self._master_grads()
        stepped = True
        if self.scaler is not None:
            # Megatron's order: unscale in fp32 first (1/scale is exact for a power of two), then
            # check; dividing by a finite scale neither creates nor removes an inf or a NaN.
            inv = 1.0 / self.scaler.scale
            for g in grads:
                g.mul_(inv)
            stepped = not self.scaler.has_overflow(grads)
        if stepped:
            if max_grad_norm is not None and max_grad_norm > 0:
                (clip or torch.nn.utils.clip_grad_norm_)([m for m in self.masters if m.grad is not None],
                                                         max_grad_norm)
            self.optimizer.step()
            self._copy_masters_to_model()
        if not self.main_grad and not self._fp32_grads:
            for m in self.masters:  # the transient fp32 copies: freed, as the ZeRO accounting assumes
                m.grad = None
        elif self.main_grad:
            for p, m in zip(self.params, self.masters):
                if p.main_grad.dtype != torch.float32:  # the upcast of a half buffer: transient too
                    m.grad = None
        if self.scaler is not None:
            self.scaler.update(not stepped)
        return stepped

    @torch.no_grad()
    def _copy_masters_to_model(self) -> None:
        for p, m in zip(self.params, self.masters):
            p.copy_(m)  # rounds to nearest in the model's dtype

    # -- checkpoints ----------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """Inner optimizer state, fp32 masters and scaler state (the half weights follow from the masters)."""
        return {"optimizer": self.optimizer.state_dict(), "masters": [m.detach().clone() for m in self.masters],
                "scaler": self.scaler.state_dict() if self.scaler is not None else None}

    @torch.no_grad()
    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore :meth:`state_dict` output: masters, the model's weights from them, optimizer and scaler."""
        if len(state["masters"]) != len(self.masters):
            raise ValueError(f"checkpoint has {len(state['masters'])} master tensors, this model {len(self.masters)}")
        for m, saved in zip(self.masters, state["masters"]):
            m.copy_(saved)
        self._copy_masters_to_model()
        self.optimizer.load_state_dict(state["optimizer"])
        if self.scaler is not None and state.get("scaler") is not None:
            self.scaler.load_state_dict(state["scaler"])

    def remove_hooks(self) -> None:
        """Detach the gradient buffers (the model's ``.grad`` then stays, unaccumulated)."""
        for buf in self.grad_buffers:
            buf.detach()
        self.grad_buffers = []

    def __repr__(self) -> str:
        return (f"MixedPrecisionOptimizer(dtype={self.dtype}, main_grad={self.main_grad}, "
                f"keep_fp32_grads={self.keep_fp32_grads}, scaler={self.scaler!r}, "
                f"inner={type(self.optimizer).__name__})")
