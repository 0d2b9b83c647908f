"""1-bit Adam (Tang et al. 2021): Adam's warm-up, then frozen variance and momentum all-reduced as 1-bit signs.

:class:`OneBitAdam` is an optimizer for a data-parallel model whose gradients sit in each
rank's ``.grad`` (a plain model, no DDP wrapper and no grad buffers): it does the
gradient communication itself, so the model must not also be wrapped in a DDP that
averages ``.grad``. Parameters whose gradients live in lslm's ``main_grad`` buffers
(``attach_grad_buffers``, bucketed DDP, ZeRO) are refused with a ValueError.

The two phases (the paper's Algorithm 1):

* **warm-up** (``step < warmup_steps``): the gradients are all-reduced in fp32 and averaged,
  then torch's Adam arithmetic runs on them (``torch.optim.Adam`` with ``foreach=False``,
  bit for bit, bias corrections included);
* **compression**: the preconditioner ``sqrt(v / (1 - beta2^T_w)) + eps`` is frozen at the one
  the last warm-up step used; each rank updates its momentum with its *local* gradient,
  ``m = beta1 m + (1 - beta1) g``, then ``m`` is replaced by the compressed all-reduce of
  it (:func:`~lslm.data_parallel.onebit_compress.compressed_all_reduce`, error feedback on
  worker and server), identical on every rank, and the step is the paper's
  ``x -= lr * m / (sqrt(v / (1 - beta2^T_w)) + eps)``.

Two choices, and why:

* **No bias correction of the momentum in the compression phase.** Algorithm 1 steps by
  ``lr * m`` (DeepSpeed's ``OnebitAdam`` too); torch's ``lr / (1 - beta1^t)`` would make every
  compressed step a little longer than the paper's while ``beta1^t`` is not negligible (14 % at
  the first compressed step after a 20-step warm-up at beta1 = 0.9, 1.5 % by step 40).
* **The frozen variance keeps the warm-up's bias correction.** The paper's Adam has none, but its
  warm-ups are thousands of steps, where ``1 - beta2^T_w`` is 1 to a few per cent. The warm-up
  here is torch's Adam, bias-corrected; after a 20-step warm-up at beta2 = 0.999 the raw ``v``
  is 2 % of the corrected one, so dropping the correction would make every compressed step
  7.1x longer than the warm-up's last. Freezing the preconditioner Adam last applied is what
  "the variance as a fixed preconditioner" means at any warm-up length.

**Elements the compression phase leaves alone.** A sign bit cannot encode 0: an element whose
momentum is exactly zero decodes to ``±scale`` (its chunk's mean magnitude), and one whose
momentum is tiny decodes to the same. The step divides that by the frozen preconditioner
``sqrt(v_hat) + eps``. Where ``sqrt(v_hat) <= eps``, every gradient the warm-up saw there was
below Adam's own resolution ``eps``: exactly zero (the embedding row of a token no rank fed) or
rounding noise (the attention's key bias, whose exact gradient is zero because softmax ignores a
constant added to a row of scores: ``sqrt(v_hat)`` <= 1.3e-10 on the course's GPT, while every
other element there is >= 4e-8). Adam moves such an element by a fraction of ``lr`` per step;
1-bit Adam would move it by about ``lr * scale / eps`` (thousands on the course's GPT; error
feedback cannot help, it bounds the running sum of a quantity that ``1 / eps`` then multiplies),
and it has no variance to precondition a later, genuine gradient either (a token first fed after
the warm-up would step by ``lr * m / eps`` even uncompressed). The rule: **at the freeze, the
elements with ``sqrt(v_hat) <= eps`` (``v == 0`` included) are taken out of the compressed tensor
and not updated again.** It is a function of ``v``, identical on every rank (built from all-reduced
gradients), so every rank compresses the same elements with no agreement step, and their zeros
neither dilute the chunk scales nor churn the error buffers. DeepSpeed multiplies the momentum by a
user-given ``exp_avg_mask`` for the same reason. The price: a parameter first reached after the
warm-up keeps its value; make the warm-up cover every parameter that must train.
:attr:`OneBitAdam.frozen_numel` says how many elements the rule froze. Elements whose
``sqrt(v_hat)`` is small but above ``eps`` are compressed and still take steps longer than Adam's
(the class doc's warning about short warm-ups).

All parameters are handled as one flat fp32 tensor: one collective (or one compressed
all-reduce) per step. :meth:`OneBitAdam.state_dict` saves the step, both moments and this
rank's error-feedback buffers; :meth:`OneBitAdam.load_state_dict` restores the buffers only
for the same rank of a group of the same size, and otherwise starts them from zero.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Iterable
from typing import Any

import torch

from lslm.data_parallel.grad_buffer import has_main_grad
from lslm.data_parallel.onebit_compress import OneBitState, compressed_all_reduce, padded_numel
from lslm.runtime.context import ParallelContext

__all__ = ["WARMUP_LABEL", "OneBitAdam"]

WARMUP_LABEL = "1-bit Adam warm-up all-reduce"


def _positive_finite(name: str, value: Any) -> float:
    """``value`` as a float if it is a finite real > 0 (bools refused); ValueError naming ``name`` otherwise."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real) or not math.isfinite(value) or value <= 0:
        raise ValueError(f"{name} must be a finite number > 0, got {value!r}")
    return float(value)


def _betas(betas: Any) -> tuple[float, float]:
    """``betas`` as two floats in [0, 1); ValueError naming ``betas`` otherwise (NaN fails the range check)."""
    if not isinstance(betas, tuple | list) or len(betas) != 2 or any(
            isinstance(b, bool) or not isinstance(b, numbers.Real) or not 0.0 <= b < 1.0 for b in betas):
        raise ValueError(f"betas must be two numbers in [0, 1), got {betas!r}")
    return float(betas[0]), float(betas[1])


class OneBitAdam:
    """1-bit Adam over ``params`` on the ranks of ``group`` (default: the world), through ``ctx.comm``.

    The warm-up must be long enough for the variance to settle before it freezes: after it, every element of a
    compressed chunk moves with its chunk's mean magnitude divided by its own frozen ``sqrt(v)``, so an element
    whose variance was still tiny takes a large step. Elements whose ``sqrt(v_hat)`` is at most ``eps`` at the freeze
    are not updated at all in the compression phase (module doc); this warning is about the small ones above it.
    Measured on the tests' small GPT at 2 ranks, a 3-step warm-up at lr 1e-2 then 3 compressed steps: some
    attention weights moved by up to 11.7 (904 while the key biases were compressed and the step still carried
    torch's ``1 / (1 - beta1^t)``); 10 steps at lr 3e-3 (:func:`lslm.data_parallel.onebit_run.onebit_loss_curves`)
    train stably.
    """

    def __init__(self, params: Iterable[torch.Tensor], ctx: ParallelContext, *, lr: float = 1e-3,
                 betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8, warmup_steps: int = 10,
                 error_feedback: bool = True, group: Any = None) -> None:
        self.params = [p for p in params if p.requires_grad]
        if not self.params:
            raise ValueError("OneBitAdam got no parameters that require grad")
        if any(has_main_grad(p) for p in self.params):
            raise ValueError("OneBitAdam reads each parameter's .grad and does its own communication: build it on "
                             "a plain model, not one whose gradients live in main_grad buffers (attach_grad_buffers, "
                             "bucketed DDP, ZeRO)")
        if any(p.dtype != torch.float32 for p in self.params):
            raise ValueError("OneBitAdam keeps fp32 parameters only")
        # A bool is an int to Python; warmup_steps=True would silently mean one step.
        if isinstance(warmup_steps, bool) or not isinstance(warmup_steps, numbers.Integral) or warmup_steps < 1:
            raise ValueError(f"warmup_steps must be an int >= 1 (the variance freezes after it), "
                             f"got {warmup_steps!r}")
        if not isinstance(error_feedback, bool):
            raise ValueError(f"error_feedback must be a bool, got {error_feedback!r}")
        self.ctx, self.group = ctx, group
        # NaN or inf would reach every weight in the first step with no error: refuse them here.
        self.lr, self.eps = _positive_finite("lr", lr), _positive_finite("eps", eps)
        self.betas, self.warmup_steps = _betas(betas), int(warmup_steps)
        numel = sum(p.numel() for p in self.params)
        device = self.params[0].device
        self.exp_avg = torch.zeros(numel, dtype=torch.float32, device=device)
        self.exp_avg_sq = torch.zeros(numel, dtype=torch.float32, device=device)
        self.state = OneBitState(error_feedback=error_feedback)
        self.step_count = 0
        # Flat indices of the compressed elements, fixed at the freeze (module doc). Indices rather than a bool mask:
        # boolean indexing sizes its result on the host (one device sync per step on a GPU), index_select does not.
        self._active: torch.Tensor | None = None

    @property
    def compressing(self) -> bool:
        """Whether the next step is in the compression phase (the variance is frozen)."""
        return self.step_count >= self.warmup_steps

    @property
    def active(self) -> torch.Tensor | None:
        """Flat indices (ascending) of the elements the compression phase updates: frozen ``sqrt(v_hat) > eps``.

        None until the variance is frozen (computed once, at the first compressed step or the first call after it).
        """
        if self._active is None and self.step_count >= self.warmup_steps:
            self._active = self._compressed(self.exp_avg_sq).nonzero().flatten()
        return self._active

    def _compressed(self, exp_avg_sq: torch.Tensor) -> torch.Tensor:
        """Bool mask of the elements the compression phase updates: frozen ``sqrt(v_hat) > eps`` (module doc)."""
        return exp_avg_sq.sqrt() / (1 - self.betas[1] ** self.warmup_steps) ** 0.5 > self.eps

    @property
    def compressed_numel(self) -> int | None:
        """Elements each compressed all-reduce carries (before padding); None before the freeze."""
        active = self.active
        return None if active is None else active.numel()

    @property
    def frozen_numel(self) -> int | None:
        """Elements the compression phase leaves at their value (frozen ``sqrt(v_hat) <= eps``); None before it."""
        n = self.compressed_numel
        return None if n is None else self.exp_avg.numel() - n

    def zero_grad(self) -> None:
        """Drop every parameter's ``.grad``."""
        for p in self.params:
            p.grad = None

    def _flat_grad(self) -> torch.Tensor:
        grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in self.params]
        return torch.cat([g.reshape(-1) for g in grads])

    @torch.no_grad()
    def step(self) -> None:
        """One step: the warm-up's averaged-gradient Adam, or the compression phase's 1-bit momentum (Algorithm 1)."""
        beta1, beta2 = self.betas
        grad = self._flat_grad()
        comm, world = self.ctx.comm, torch.distributed.get_world_size(self.group)
        compressing = self.compressing
        self.step_count += 1
        if not compressing:
            comm.all_reduce(grad, group=self.group, label=WARMUP_LABEL)
            grad /= world
            self.exp_avg.lerp_(grad, 1 - beta1)
            self.exp_avg_sq.mul_(beta2).addcmul_(grad, grad, value=1 - beta2)
            frozen_step = self.step_count
            step_size = self.lr / (1 - beta1 ** self.step_count)  # torch's Adam
        else:
            active = self.active
            assert active is not None
            self.exp_avg.lerp_(grad, 1 - beta1)  # the local gradient: no gradient all-reduce in this phase
            m = self.exp_avg.index_select(0, active)  # a copy of the elements with a preconditioner, in flat order
            self.exp_avg.zero_()  # the others get no step, and every rank holds the same momentum
            if m.numel():
                self.exp_avg.index_copy_(0, active, compressed_all_reduce(m, comm, self.state, self.group))
            frozen_step = self.warmup_steps
            step_size = self.lr  # Algorithm 1: no bias correction of m (module doc)
        # torch.optim.Adam's own expressions (``** 0.5``, addcdiv), so the warm-up is bit-equal to it.
        denom = (self.exp_avg_sq.sqrt() / (1 - beta2 ** frozen_step) ** 0.5).add_(self.eps)
        offset = 0
        for p in self.params:
            n = p.numel()
            p.addcdiv_(self.exp_avg[offset:offset + n].view_as(p), denom[offset:offset + n].view_as(p),
                       value=-step_size)
            offset += n

    def state_dict(self) -> dict[str, Any]:
        """The optimizer's state on this rank: step, both moments (copies) and its error-feedback buffers.

        The moments are the same on every rank; the error buffers are this rank's own (each rank compressed its own
        momentum and serves its own chunk), so every rank saves its own dict, tagged with its rank and world size.
        """
        def copy(t: torch.Tensor | None) -> torch.Tensor | None:
            return None if t is None else t.detach().clone()

        return {"step": self.step_count, "exp_avg": copy(self.exp_avg), "exp_avg_sq": copy(self.exp_avg_sq),
                "worker_error": copy(self.state.worker_error), "server_error": copy(self.state.server_error),
                "rank": torch.distributed.get_rank(self.group),
                "world_size": torch.distributed.get_world_size(self.group)}

    def load_state_dict(self, state: dict[str, Any], *, reset_errors: bool = False) -> None:
        """Restore :meth:`state_dict`'s ``state``. The error buffers come back only when it was saved by this rank
        of a group of this size and ``reset_errors`` is False; otherwise they restart from zero.

        Restarting them is always safe (the first compressed step after it carries one step's compression error,
        as the very first one did) but the run then differs from an uninterrupted one; restoring them on the same
        ranks continues it exactly. ValueError if ``state`` does not fit these parameters.
        """
        numel = self.exp_avg.numel()
        missing = {"step", "exp_avg", "exp_avg_sq", "worker_error", "server_error", "rank", "world_size"} - set(state)
        if missing:
            raise ValueError(f"state lacks {sorted(missing)}: pass what OneBitAdam.state_dict() returned")
        if state["exp_avg"].numel() != numel or state["exp_avg_sq"].numel() != numel:
            raise ValueError(f"state holds moments of {state['exp_avg'].numel():,} elements, these parameters have "
                             f"{numel:,}")
        step = state["step"]
        if isinstance(step, bool) or not isinstance(step, numbers.Integral) or step < 0:
            raise ValueError(f"state['step'] must be an int >= 0, got {step!r}")
        world = torch.distributed.get_world_size(self.group)
        same_place = state["rank"] == torch.distributed.get_rank(self.group) and state["world_size"] == world
        keep_errors = not reset_errors and same_place and state["worker_error"] is not None
        if keep_errors:  # checked before anything changes, so a refused state leaves the optimizer as it was
            p = padded_numel(int(self._compressed(state["exp_avg_sq"]).sum()), world)  # (module doc)
            if step < self.warmup_steps or state["worker_error"].numel() != p or \
                    state["server_error"].numel() != p // world:
                raise ValueError("state's error buffers do not fit its step and variance: it was not written by "
                                 "OneBitAdam.state_dict() with this warmup_steps")
        self.step_count = int(step)
        self.exp_avg.copy_(state["exp_avg"])
        self.exp_avg_sq.copy_(state["exp_avg_sq"])
        self._active = None  # recomputed from the restored variance at the next compressed step
        self.state.worker_error = self.state.server_error = None
        if keep_errors:
            self.state.worker_error = state["worker_error"].to(self.exp_avg.device, copy=True)
            self.state.server_error = state["server_error"].to(self.exp_avg.device, copy=True)
