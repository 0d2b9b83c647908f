"""1-bit Adam (Tang et al. 2021): Adam's warm-up, then frozen variance and momentum all-reduced as 1-bit signs.

:class:`OneBitAdam` is an optimizer for a data-parallel model whose gradients sit in each
rank's ``.grad`` (a plain model, no DDP wrapper and no grad buffers): it does the
gradient communication itself, so the model must not also be wrapped in a DDP that
averages ``.grad``. Parameters whose gradients live in lslm's ``main_grad`` buffers
(``attach_grad_buffers``, bucketed DDP, ZeRO) are refused with a ValueError.

The two phases (the paper's Algorithm 1):

* **warm-up** (``step < warmup_steps``): the gradients are all-reduced in fp32 and averaged,
  then torch's Adam arithmetic runs on them (``torch.optim.Adam`` with ``foreach=False``,
  bit for bit);
* **compression**: the variance ``v`` and its bias correction are frozen at their last
  warm-up value; each rank updates its momentum with its *local* gradient,
  ``m = beta1 m + (1 - beta1) g``, then ``m`` is replaced by the compressed all-reduce of
  it (:func:`~lslm.data_parallel.onebit_compress.compressed_all_reduce`, error feedback on
  worker and server), identical on every rank, and the step is
  ``x -= lr / (1 - beta1^t) * m / (sqrt(v) / sqrt(1 - beta2^T_w) + eps)``.

All parameters are handled as one flat fp32 tensor: one collective (or one compressed
all-reduce) per step.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch

from lslm.data_parallel.grad_buffer import has_main_grad
from lslm.data_parallel.onebit_compress import OneBitState, compressed_all_reduce
from lslm.runtime.context import ParallelContext

__all__ = ["WARMUP_LABEL", "OneBitAdam"]

WARMUP_LABEL = "1-bit Adam warm-up all-reduce"


class OneBitAdam:
    """1-bit Adam over ``params`` on the ranks of ``group`` (default: the world), through ``ctx.comm``.

    The warm-up must be long enough for the variance to settle before it freezes: after it, every element of a
    compressed chunk moves with its chunk's mean magnitude divided by its own frozen ``sqrt(v)``, so an element
    whose variance was still tiny takes a huge step. Measured on the tests' small GPT: a 3-step warm-up at
    lr 1e-2 moved some parameters by up to 904 within 3 compressed steps; 10 steps at lr 3e-3
    (:func:`lslm.data_parallel.onebit_run.onebit_loss_curves`) trains stably.
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
        if not isinstance(warmup_steps, int) or warmup_steps < 1:
            raise ValueError(f"warmup_steps must be an int >= 1 (the variance freezes after it), "
                             f"got {warmup_steps!r}")
        if lr <= 0 or eps <= 0 or not all(0.0 <= b < 1.0 for b in betas):
            raise ValueError(f"need lr > 0, eps > 0 and betas in [0, 1), got lr={lr}, eps={eps}, betas={betas}")
        self.ctx, self.group = ctx, group
        self.lr, self.betas, self.eps, self.warmup_steps = lr, betas, eps, warmup_steps
        numel = sum(p.numel() for p in self.params)
        device = self.params[0].device
        self.exp_avg = torch.zeros(numel, dtype=torch.float32, device=device)
        self.exp_avg_sq = torch.zeros(numel, dtype=torch.float32, device=device)
        self.state = OneBitState(error_feedback=error_feedback)
        self.step_count = 0

    @property
    def compressing(self) -> bool:
        """Whether the next step is in the compression phase (the variance is frozen)."""
        return self.step_count >= self.warmup_steps

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
        else:
            self.exp_avg.lerp_(grad, 1 - beta1)  # the local gradient: no gradient all-reduce in this phase
            self.exp_avg.copy_(compressed_all_reduce(self.exp_avg, comm, self.state, self.group))
            frozen_step = self.warmup_steps
        step_size = self.lr / (1 - beta1 ** self.step_count)
        # torch.optim.Adam's own expressions (``** 0.5``, addcdiv), so the warm-up is bit-equal to it.
        denom = (self.exp_avg_sq.sqrt() / (1 - beta2 ** frozen_step) ** 0.5).add_(self.eps)
        offset = 0
        for p in self.params:
            n = p.numel()
            p.addcdiv_(self.exp_avg[offset:offset + n].view_as(p), denom[offset:offset + n].view_as(p),
                       value=-step_size)
            offset += n
