"""Dynamic loss scaling: keep fp16 gradients inside fp16's range, skip the steps where they leave it.

fp16 represents magnitudes from about 6e-8 (subnormal) to 65504. Many gradients of a
language model are smaller than the first and flush to zero. Multiplying the loss by a
scale ``S`` before backward multiplies every gradient by ``S`` (the chain rule is linear),
lifting them into range; the optimizer divides by ``S`` again in fp32 (Micikevicius et
al. 2018, "Mixed Precision Training", §3.2). Too large an ``S`` overflows: some gradient
becomes inf (or NaN), the step is skipped and ``S`` shrinks. A run of clean steps grows
``S`` again. The scaler "rides the edge" of the largest scale that does not overflow.

The rule, DeepSpeed's (``deepspeed/runtime/fp16/loss_scaler.py``, ``DynamicLossScaler``),
with the names of ``torch.amp.GradScaler`` where the two share a knob:

* **Overflow.** The step is skipped. With *hysteresis* ``h`` (DeepSpeed's ``delayed_shift``)
  the scale is only multiplied by ``backoff_factor`` on the ``h``-th overflow since the
  scale last grew; the earlier ones just use up one unit of hysteresis. The scale never
  goes below ``min_scale``; an overflow that would take it below while it already *is*
  ``min_scale`` raises :class:`LossScaleAtMinimumError` (DeepSpeed raises its "Current
  loss scale already at minimum" there), because every later step would be skipped too.
* **No overflow.** After ``growth_interval`` clean steps the scale is multiplied by
  ``growth_factor`` and the hysteresis refilled. With ``consecutive_hysteresis=True`` any
  clean step refills it (so only *consecutive* overflows lower the scale).

Counting the interval (``growth_rule``):

* ``"gradscaler"`` (default): the scale grows on the ``growth_interval``-th clean step
  after the last overflow (or the start), then every ``growth_interval`` steps: GradScaler,
  Megatron-LM's ``DynamicGradScaler`` and DeepSpeed up to 0.17. With ``hysteresis=1`` and
  ``min_scale=None`` the trajectory equals ``torch.amp.GradScaler``'s step for step.
* ``"deepspeed"``: DeepSpeed from 0.18 on (its "stable interval"): the first clean step
  after an overflow does not count, so the first growth comes one step later.

**Agreement across ranks.** Every rank that holds gradients (data-parallel replicas
after their all-reduce, tensor- and pipeline-parallel ranks that hold *different*
gradients) must skip the same steps, or the replicas diverge. :meth:`has_overflow`
therefore reduces the local flag with MAX over ``group`` through ``comm`` (label
``"precision overflow"``, 4 bytes): one rank's inf makes every rank skip, and since
every rank then applies the same update rule to the same flag, the scales stay equal.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Iterable
from typing import Any

import torch
from torch import nn
from torch.distributed import ReduceOp

__all__ = ["GROWTH_RULES", "OVERFLOW_LABEL", "DynamicLossScaler", "LossScaleAtMinimumError", "check_scaler_settings",
           "nonfinite_flag"]

OVERFLOW_LABEL = "precision overflow"
GROWTH_RULES = ("gradscaler", "deepspeed")


class LossScaleAtMinimumError(RuntimeError):
    """Gradients overflowed while the loss scale was already at ``min_scale``: training cannot go on."""


def _grad_or_self(t: torch.Tensor) -> torch.Tensor | None:
    # A parameter (or a leaf that requires grad) stands for its gradient: that is what overflows.
    # A frozen parameter has no gradient and is skipped, not checked itself.
    return t.grad if isinstance(t, nn.Parameter) or t.requires_grad else t


def nonfinite_flag(tensors: Iterable[torch.Tensor]) -> torch.Tensor | None:
    """A float32 0-d tensor, 1.0 if any of ``tensors`` holds an inf or NaN, else 0.0; ``None`` for no tensors.

    Parameters (``nn.Parameter``, or any tensor with ``requires_grad``) are checked through
    their ``.grad`` (skipped when it is ``None``); other tensors are checked themselves.
    One reduction for all: the inf-norm (largest magnitude) of each (device, dtype) group,
    computed by ``torch.nn.utils.get_total_norm`` (torch >= 2.6) with its multi-tensor
    kernels where the device has them. A max propagates NaN and keeps inf, so one
    ``isfinite`` on the result settles it, and the host waits once, not once per tensor
    (DeepSpeed's older serial check called ``float()`` on every gradient).
    """
    found = [g for g in (_grad_or_self(t) for t in tensors) if g is not None and g.numel() > 0]
    if not found:
        return None
    total_norm = getattr(torch.nn.utils, "get_total_norm", None)  # torch >= 2.6
    if total_norm is not None:
        norm = total_norm(found, norm_type=math.inf)
    else:  # same value, one kernel per tensor, still one host sync
        norm = torch.stack([torch.linalg.vector_norm(g, math.inf).float().to(found[0].device) for g in found]).max()
    return torch.isfinite(norm).logical_not().to(torch.float32)


def _is_int(value: Any) -> bool:
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def check_scaler_settings(scale: Any, *, growth_factor: Any, backoff_factor: Any, growth_interval: Any,
                          hysteresis: Any, min_scale: Any, growth_rule: Any, scale_name: str = "init_scale") -> None:
    """Raise ``ValueError`` naming the first bad setting of a :class:`DynamicLossScaler`.

    The one check for the constructor's arguments and for a state loaded from a checkpoint
    (``scale_name="scale"`` there), so neither can hold a value the other refuses: a NaN or
    negative scale would skip every step, or run gradient ascent, without a word.
    Written as ``not (... ok ...)`` so that NaN, which fails every comparison, is refused.
    """
    if not (isinstance(scale, numbers.Real) and math.isfinite(scale) and scale > 0):
        raise ValueError(f"{scale_name} must be a finite number > 0, got {scale!r}")
    if not (isinstance(growth_factor, numbers.Real) and growth_factor > 1):
        raise ValueError(f"growth_factor must be > 1 (the scale grows by it), got {growth_factor!r}")
    if not (isinstance(backoff_factor, numbers.Real) and 0 < backoff_factor < 1):
        raise ValueError(f"backoff_factor must be in (0, 1) (the scale shrinks by it), got {backoff_factor!r}")
    for name, value in (("growth_interval", growth_interval), ("hysteresis", hysteresis)):
        if not _is_int(value) or value < 1:
            raise ValueError(f"{name} must be an int >= 1, got {value!r}")
    if min_scale is not None and not (isinstance(min_scale, numbers.Real) and min_scale >= 0):
        raise ValueError(f"min_scale must be >= 0 or None (no floor), got {min_scale!r}")
    if min_scale is not None and scale < min_scale:
        raise ValueError(f"{scale_name}={scale} is below min_scale={min_scale}: raise {scale_name} or lower "
                         "min_scale")
    if growth_rule not in GROWTH_RULES:
        raise ValueError(f"growth_rule must be one of {GROWTH_RULES}, got {growth_rule!r}")


class DynamicLossScaler:
    """DeepSpeed's dynamic loss scaler (hysteresis, floor, error at the floor), agreed across ranks.

    Arguments (DeepSpeed's config key in brackets):

    * ``init_scale`` (``2 ** initial_scale_power``, default ``2**16``);
    * ``growth_factor`` (DeepSpeed's ``scale_factor``, 2) and ``backoff_factor`` (default
      ``1 / growth_factor``; GradScaler's 0.5);
    * ``growth_interval`` (``loss_scale_window``, 1000): clean steps before the scale grows;
    * ``hysteresis`` (``hysteresis``, 2): overflows tolerated before the scale backs off;
    * ``consecutive_hysteresis`` (``consecutive_hysteresis``, False): refill it on any clean step;
    * ``min_scale`` (``min_loss_scale``, 1): the floor; ``None`` (or 0) for none, as GradScaler;
    * ``raise_error_at_min_scale`` (always on in DeepSpeed): raise at the floor, or keep skipping;
    * ``growth_rule``: ``"gradscaler"`` or ``"deepspeed"``, how clean steps are counted (module doc);
    * ``comm`` / ``group``: reduce the overflow flag over ``group`` with ``comm`` (a
      :class:`~lslm.runtime.ledger.Comm`, e.g. ``ctx.comm``; ``group=None`` is the world).
      Without ``comm`` nothing is reduced: right for one process only.

    Use, one call of :meth:`step` per optimisation step::

        scaler.backward(loss)              # (loss * scale).backward()
        stepped = scaler.step(optimizer)   # unscale + step, or skip; then update the scale

    State: ``scale``, ``cur_iter`` (updates so far), ``last_overflow_iter``,
    ``cur_hysteresis``, ``num_overflows``; :meth:`state_dict` for checkpoints.
    """

    def __init__(self, init_scale: float = 2.0**16, *, growth_factor: float = 2.0, backoff_factor: float | None = None,
                 growth_interval: int = 1000, hysteresis: int = 2, min_scale: float | None = 1.0,
                 consecutive_hysteresis: bool = False, raise_error_at_min_scale: bool = True,
                 growth_rule: str = "gradscaler", comm: Any = None, group: Any = None) -> None:
        backoff = 1.0 / growth_factor if backoff_factor is None else backoff_factor
        check_scaler_settings(init_scale, growth_factor=growth_factor, backoff_factor=backoff,
                              growth_interval=growth_interval, hysteresis=hysteresis, min_scale=min_scale,
                              growth_rule=growth_rule)
        self.growth_factor = float(growth_factor)
        self.backoff_factor = float(backoff)
        self.growth_interval = growth_interval
        self.hysteresis = hysteresis
        self.min_scale = None if min_scale is None else float(min_scale)
        self.consecutive_hysteresis = bool(consecutive_hysteresis)
        self.raise_error_at_min_scale = bool(raise_error_at_min_scale)
        self.growth_rule = growth_rule
        self.comm = comm
        self.group = group
        self.scale = float(init_scale)
        self.cur_iter = 0
        self.last_overflow_iter = -1
        self.cur_hysteresis = hysteresis
        self.num_overflows = 0

    @classmethod
    def from_deepspeed_config(cls, fp16: dict[str, Any], **kwargs: Any) -> DynamicLossScaler:
        """The scaler a DeepSpeed ``"fp16"`` config section describes (its defaults for missing keys).

        Keys read: ``initial_scale_power`` (16), ``loss_scale_window`` (1000), ``hysteresis`` (2),
        ``consecutive_hysteresis`` (False), ``min_loss_scale`` (1); ``growth_rule`` is
        ``"deepspeed"`` unless ``kwargs`` say otherwise. A static ``loss_scale`` > 0 is refused.
        """
        if fp16.get("loss_scale", 0) != 0:
            raise ValueError("loss_scale != 0 asks DeepSpeed for a static scale; this class is the dynamic one "
                             "(set loss_scale to 0, or scale the loss by a constant yourself)")
        args: dict[str, Any] = dict(init_scale=2.0 ** fp16.get("initial_scale_power", 16),
                                    growth_interval=fp16.get("loss_scale_window", 1000),
                                    hysteresis=fp16.get("hysteresis", 2),
                                    consecutive_hysteresis=fp16.get("consecutive_hysteresis", False),
                                    min_scale=fp16.get("min_loss_scale", 1), growth_rule="deepspeed")
        args.update(kwargs)
        return cls(**args)

    @property
    def loss_scale(self) -> float:
        """The current scale (DeepSpeed's name; same as ``scale``)."""
        return self.scale

    # -- the loss side ----------------------------------------------------------------
    def scale_loss(self, loss: torch.Tensor) -> torch.Tensor:
        """``loss * scale``, computed in fp32 so the product itself cannot overflow fp16."""
        return loss.float() * self.scale

    def backward(self, loss: torch.Tensor, retain_graph: bool = False) -> None:
        """Backward of the scaled loss: every gradient arrives multiplied by ``scale``."""
        self.scale_loss(loss).backward(retain_graph=retain_graph)

    # -- overflow detection -------------------------------------------------------------
    def has_overflow(self, tensors: Iterable[torch.Tensor]) -> bool:
        """True if any rank of ``group`` found an inf or NaN in its ``tensors`` (parameters: their ``.grad``).

        Collective when ``comm`` is set: every rank of ``group`` must call it, with or without
        tensors of its own. The local flag (:func:`nonfinite_flag`) is all-reduced with MAX.
        """
        flag = nonfinite_flag(tensors)
        if self.comm is not None:
            if flag is None:  # a rank without gradients still takes part in the vote
                flag = torch.zeros((), dtype=torch.float32, device=self.comm.default_device(self.group))
            flag = flag.reshape(1)
            self.comm.all_reduce(flag, op=ReduceOp.MAX, group=self.group, label=OVERFLOW_LABEL)
        return flag is not None and bool(flag.item())

    def unscale_(self, tensors: Iterable[torch.Tensor]) -> None:
        """Divide ``tensors`` (parameters: their ``.grad``) by the scale, in place."""
        inv = 1.0 / self.scale
        for t in tensors:
            g = _grad_or_self(t)
            if g is not None:
                g.mul_(inv)

    # -- the update rule -----------------------------------------------------------------
    def _grows_now(self) -> bool:
        since = self.cur_iter - self.last_overflow_iter
        if self.growth_rule == "gradscaler":
            return since % self.growth_interval == 0
        stable = since - 1  # DeepSpeed >= 0.18: the step right after an overflow does not count
        return stable > 0 and stable % self.growth_interval == 0

    def update(self, overflow: bool) -> None:
        """Apply one step's outcome to the scale (DeepSpeed's ``update_scale``).

        Raises :class:`LossScaleAtMinimumError` (before changing any state) on an overflow
        that would lower the scale while it already equals ``min_scale``, if
        ``raise_error_at_min_scale``.
        """
        if overflow:
            if self.cur_hysteresis <= 1:
                if self.min_scale is not None and self.scale == self.min_scale and self.raise_error_at_min_scale:
                    raise LossScaleAtMinimumError(self._at_minimum_message())
                floor = self.min_scale if self.min_scale is not None else 0.0
                self.scale = max(self.scale * self.backoff_factor, floor)
            else:
                self.cur_hysteresis -= 1
            self.last_overflow_iter = self.cur_iter
            self.num_overflows += 1
        else:
            if self.consecutive_hysteresis:
                self.cur_hysteresis = self.hysteresis
            if self._grows_now():
                if not self.consecutive_hysteresis:
                    self.cur_hysteresis = self.hysteresis
                self.scale *= self.growth_factor
        self.cur_iter += 1

    def _at_minimum_message(self) -> str:
        return (f"loss scale already at its minimum ({self.scale:g} = min_scale) and the gradients still overflow "
                f"(inf/NaN) at update {self.cur_iter}: every step is being skipped, training cannot progress "
                "(DeepSpeed stops here with 'Current loss scale already at minimum'). fp16 tops out at 65504, so "
                "some activation or gradient exceeds fp16's range even unscaled. Fixes: train in bf16 (fp32's "
                "range, no loss scaling: lslm.precision.prepare_precision(model, 'bf16', ...)); lower the learning "
                "rate or clip gradients if the loss is diverging; look for the first layer whose output is "
                "inf/NaN. min_scale=None (or raise_error_at_min_scale=False) only hides the problem.")

    # -- one optimisation step ------------------------------------------------------------
    def step(self, optimizer: torch.optim.Optimizer, params: Iterable[torch.Tensor] | None = None) -> bool:
        """Check, then unscale the gradients and step, or skip the step; update the scale. True if it stepped.

        ``params`` defaults to every parameter of ``optimizer``. On an overflow
        ``optimizer.step()`` is not called at all, so parameters and optimizer state stay
        bit-identical (the gradients are left as they are, scaled; zero them as usual).
        Unlike GradScaler, the check runs on the *scaled* gradients, before unscaling (as
        DeepSpeed does): dividing by a finite scale cannot create or remove an inf/NaN,
        except when a scale below 1 pushes a large finite fp16 gradient over 65504.
        """
        params = list(params) if params is not None else [p for g in optimizer.param_groups for p in g["params"]]
        overflow = self.has_overflow(params)
        if not overflow:
            self.unscale_(params)
            optimizer.step()
        self.update(overflow)
        return not overflow

    # -- checkpoints ------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """Everything that evolves (scale, counters, hysteresis) and the settings, JSON-ready."""
        return {"scale": self.scale, "cur_iter": self.cur_iter, "last_overflow_iter": self.last_overflow_iter,
                "cur_hysteresis": self.cur_hysteresis, "num_overflows": self.num_overflows,
                "growth_factor": self.growth_factor, "backoff_factor": self.backoff_factor,
                "growth_interval": self.growth_interval, "hysteresis": self.hysteresis, "min_scale": self.min_scale,
                "consecutive_hysteresis": self.consecutive_hysteresis,
                "raise_error_at_min_scale": self.raise_error_at_min_scale, "growth_rule": self.growth_rule}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore :meth:`state_dict` output; a resumed run then scales exactly as the original would have.

        The state is checked as the constructor checks its arguments (:func:`check_scaler_settings`,
        settings missing from ``state`` keep their current values), and its counters for what
        :meth:`update` can produce; a bad state raises ``ValueError`` and changes nothing.
        """
        missing = {"scale", "cur_iter", "last_overflow_iter", "cur_hysteresis"} - set(state)
        if missing:
            raise ValueError(f"not a DynamicLossScaler state dict: missing {sorted(missing)}")
        settings = {key: state.get(key, getattr(self, key)) for key in (
            "growth_factor", "backoff_factor", "growth_interval", "hysteresis", "min_scale", "growth_rule")}
        check_scaler_settings(state["scale"], scale_name="scale", **settings)
        counters = {key: state.get(key, 0) for key in ("cur_iter", "last_overflow_iter", "cur_hysteresis",
                                                        "num_overflows")}
        lowest = {"cur_iter": 0, "last_overflow_iter": -1, "cur_hysteresis": 1, "num_overflows": 0}
        for key, value in counters.items():
            if not _is_int(value) or value < lowest[key]:
                raise ValueError(f"{key} must be an int >= {lowest[key]}, got {value!r}")
        if counters["cur_hysteresis"] > settings["hysteresis"]:
            raise ValueError(f"cur_hysteresis={counters['cur_hysteresis']} exceeds hysteresis="
                             f"{settings['hysteresis']}: the state's settings and counters do not belong together")
        if counters["last_overflow_iter"] >= counters["cur_iter"]:
            raise ValueError(f"last_overflow_iter={counters['last_overflow_iter']} must be below cur_iter="
                             f"{counters['cur_iter']} (an overflow is recorded at an update already counted)")
        self.growth_factor = float(settings["growth_factor"])
        self.backoff_factor = float(settings["backoff_factor"])
        self.growth_interval = int(settings["growth_interval"])
        self.hysteresis = int(settings["hysteresis"])
        self.min_scale = None if settings["min_scale"] is None else float(settings["min_scale"])
        self.growth_rule = settings["growth_rule"]
        for key in ("consecutive_hysteresis", "raise_error_at_min_scale"):
            if key in state:
                setattr(self, key, bool(state[key]))
        self.scale = float(state["scale"])
        self.cur_iter = int(counters["cur_iter"])
        self.last_overflow_iter = int(counters["last_overflow_iter"])
        self.cur_hysteresis = int(counters["cur_hysteresis"])
        self.num_overflows = int(counters["num_overflows"])

    def __repr__(self) -> str:
        return (f"DynamicLossScaler(scale={self.scale:g}, growth_interval={self.growth_interval}, "
                f"hysteresis={self.cur_hysteresis}/{self.hysteresis}, min_scale={self.min_scale}, "
                f"growth_rule={self.growth_rule!r})")
