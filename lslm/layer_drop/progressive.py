"""Progressive layer dropping (PLD; Zhang and He, "Accelerating Training of Transformer-Based Language Models
with Progressive Layer Dropping", NeurIPS 2020), applied to a pre-LN GPT from outside.

**The schedule** (their §4 and Algorithm 1). A global keep ratio falls from 1 towards ``theta_bar``
over training steps ``t``::

    theta(t) = (1 - theta_bar) * exp(-gamma * t) + theta_bar

and deeper blocks are dropped more often: block ``l = 1..L`` (1 the nearest the embedding) is kept with

    p_l(t) = 1 - l / L * (1 - theta(t))

so the first block is almost always kept and the last one with probability ``theta(t)``. The paper uses
``theta_bar = 0.5``; ``gamma`` sets how fast the decay happens (:meth:`PLDSchedule.spanning` picks it from the
run's length). In expectation ``sum_l p_l = L - (L + 1) / 2 * (1 - theta)`` blocks run per step.

**A skipped block does no compute**: its ``forward`` returns its input (the identity on the residual stream),
so neither its forward nor its backward runs and the step gets faster; its parameters get no gradient that
step (``.grad`` stays ``None`` after ``zero_grad()``, so torch's optimizers leave them and their moments alone).

**Kept blocks are rescaled.** The paper's Switchable-Transformer block (§4) gates each sub-layer with
``G_i ~ Bernoulli(p_i)`` and multiplies a kept sub-layer's output by ``1 / p_i`` in training, so that the
residual stream keeps the expectation of the full network's; at inference every block runs unscaled. We do
the same: with ``rescale=True`` (the default) a forward hook multiplies the outputs of a kept block's ``attn``
and ``mlp`` by ``1 / p_l`` (nothing is multiplied when ``p_l = 1``); ``rescale=False`` keeps kept blocks
unscaled (LayerDrop-style). In ``eval()`` mode every block runs, unscaled. (DeepSpeed's BERT example counts
layers from 0, so its first layer is never dropped; we follow the paper's formula, ``l`` from 1.)

**Randomness.** One keep/skip draw per block per training forward, from a CPU ``torch.Generator`` the caller
seeds (not the global RNG: dropout's draws are untouched, and the host decides the control flow without a
device synchronisation). Under data parallelism **every rank must seed it identically** so that all ranks
skip the same blocks: a block that one rank skipped has no gradient there, so on that rank the bucket that
holds it never becomes ready; the ranks that ran the block wait in an all-reduce it never launches (until the
collective timeout) and the wrappers raise (lslm's in ``finish_grad_sync``, torch's reducer at the next
forward). With ``find_unused_parameters=True`` it would run, but the block's gradient would be the sum over
only the ranks that ran it divided by all of them - a gradient of no model. Identical masks also
keep the ranks in step: the slowest rank sets the step time, so independent masks would lose the speed-up.
With identical masks a skipped block is unused on every rank, so DDP with ``find_unused_parameters=True``
leaves its ``.grad`` at ``None`` exactly as the serial run does.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

__all__ = ["PLDSchedule", "ProgressiveLayerDrop", "apply_progressive_layer_drop", "skippable_forward"]


def _real(name: str, value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise ValueError(f"{name} must be a finite number, got {value!r}")
    return float(value)


@dataclass(frozen=True)
class PLDSchedule:
    """The keep ratio ``theta(t)`` and the per-block keep probabilities ``p_l(t)`` (module doc; paper §4, Algorithm 1).

    ``theta_bar`` in ``(0, 1]`` is the limit of the keep ratio (1: nothing is ever dropped); ``gamma >= 0`` the
    decay rate per step (0: ``theta`` stays 1).
    """

    theta_bar: float = 0.5
    gamma: float = 0.001

    def __post_init__(self) -> None:
        theta_bar, gamma = _real("theta_bar", self.theta_bar), _real("gamma", self.gamma)
        if not 0.0 < theta_bar <= 1.0:
            raise ValueError(f"theta_bar must be in (0, 1] (the keep ratio's limit; the paper uses 0.5), got "
                             f"{self.theta_bar!r}: at 0 the last block would be kept with probability -> 0 and "
                             "its 1/p rescaling would blow up")
        if gamma < 0.0:
            raise ValueError(f"gamma must be >= 0 (the keep ratio decays from 1 to theta_bar), got {self.gamma!r}")

    @classmethod
    def spanning(cls, steps: int, theta_bar: float = 0.5, remaining: float = 0.05) -> PLDSchedule:
        """The schedule whose decay spans ``steps``: ``gamma = ln(1 / remaining) / steps``, so that at the last
        step ``theta - theta_bar`` is ``remaining`` of its start ``1 - theta_bar``."""
        if isinstance(steps, bool) or not isinstance(steps, int) or steps < 1:
            raise ValueError(f"steps must be a positive int, got {steps!r}")
        remaining = _real("remaining", remaining)
        if not 0.0 < remaining < 1.0:
            raise ValueError(f"remaining must be in (0, 1), got {remaining!r}")
        return cls(theta_bar=theta_bar, gamma=math.log(1.0 / remaining) / steps)

    def theta(self, t: float) -> float:
        """The global keep ratio at step ``t >= 0``: ``(1 - theta_bar) exp(-gamma t) + theta_bar``."""
        if _real("t", t) < 0:
            raise ValueError(f"the step t must be >= 0, got {t!r}")
        return (1.0 - self.theta_bar) * math.exp(-self.gamma * t) + self.theta_bar

    def keep_probs(self, t: float, n_layer: int) -> list[float]:
        """``[p_1(t), ..., p_L(t)]`` with ``p_l = 1 - l / L (1 - theta(t))`` for ``L = n_layer`` blocks."""
        if isinstance(n_layer, bool) or not isinstance(n_layer, int) or n_layer < 1:
            raise ValueError(f"n_layer must be a positive int, got {n_layer!r}")
        drop = 1.0 - self.theta(t)
        return [1.0 - layer / n_layer * drop for layer in range(1, n_layer + 1)]

    def expected_kept(self, t: float, n_layer: int) -> float:
        """Expected number of blocks that run at step ``t``: ``sum_l p_l(t)``."""
        return math.fsum(self.keep_probs(t, n_layer))


class ProgressiveLayerDrop:
    """The handle :func:`apply_progressive_layer_drop` returns: the step count, the draws, undo.

    Call :meth:`step` after each optimizer step (as with an LR scheduler): ``t`` is the number of optimizer
    steps taken, and every training forward draws its mask from ``p_l(t)``. :attr:`mask` is the last forward's
    keep/skip per block, :attr:`forwards` and :attr:`blocks_run` count training forwards and blocks run.
    """

    def __init__(self, model: nn.Module, blocks: nn.ModuleList, schedule: PLDSchedule,
                 generator: torch.Generator, rescale: bool) -> None:
        self.model, self.blocks, self.schedule = model, blocks, schedule
        self.generator, self.rescale = generator, bool(rescale)
        self.t = 0
        self.forwards = 0
        self.blocks_run = 0
        self.n_layer = len(blocks)
        self.mask: list[bool] = [True] * self.n_layer
        self._scale: list[float] = [1.0] * self.n_layer
        self._fixed: list[bool] | None = None
        self._originals: list[Callable[..., Any]] = []
        self._handles: list[Any] = []

    # -- the schedule's position ----------------------------------------------------------------
    def step(self) -> None:
        """Advance ``t`` by one (call once per optimizer step)."""
        self.t += 1

    def set_step(self, t: int) -> None:
        """Set ``t`` (e.g. when resuming a run)."""
        if isinstance(t, bool) or not isinstance(t, int) or t < 0:
            raise ValueError(f"t must be an int >= 0, got {t!r}")
        self.t = t

    @property
    def theta(self) -> float:
        """``theta(t)`` now."""
        return self.schedule.theta(self.t)

    @property
    def keep_probs(self) -> list[float]:
        """``[p_1(t), ..., p_L(t)]`` now."""
        return self.schedule.keep_probs(self.t, self.n_layer)

    # -- the draws ------------------------------------------------------------------------------
    def draw(self) -> list[bool]:
        """One keep/skip per block from ``p_l(t)``: keep block ``l`` iff ``u_l < p_l``, ``u ~ U[0, 1)^L``."""
        u = torch.rand(self.n_layer, generator=self.generator,  # lslm: cpu-ok (host draw: it steers control flow)
                       dtype=torch.float64).tolist()
        return [ul < pl for ul, pl in zip(u, self.keep_probs)]

    def fix_mask(self, mask: Sequence[bool] | None) -> None:
        """Use ``mask`` for every training forward instead of drawing (``None``: draw again). For tests and
        demonstrations; the generator is not advanced while a mask is fixed."""
        if mask is not None:
            mask = [bool(m) for m in mask]
            if len(mask) != self.n_layer:
                raise ValueError(f"the mask needs one entry per block ({self.n_layer}), got {len(mask)}")
        self._fixed = mask

    def _before_forward(self, module: nn.Module, args: Any) -> None:
        if not module.training:  # evaluation: the whole network, unscaled
            self.mask, self._scale = [True] * self.n_layer, [1.0] * self.n_layer
            return
        probs = self.keep_probs
        self.mask = list(self._fixed) if self._fixed is not None else self.draw()
        self._scale = [1.0 / p if (self.rescale and keep and p != 1.0) else 1.0 for keep, p in zip(self.mask, probs)]
        self.forwards += 1
        self.blocks_run += sum(self.mask)

    def _scale_output(self, index: int, module: nn.Module, args: Any, output: torch.Tensor) -> torch.Tensor | None:
        scale = self._scale[index]
        return None if scale == 1.0 else output * scale

    # -- undo -----------------------------------------------------------------------------------
    def remove(self) -> None:
        """Restore the blocks' ``forward`` and remove the hooks: the model is plain again."""
        for block, forward in zip(self.blocks, self._originals):
            if forward is None:
                del block.forward  # the instance attribute we set; the class's forward shows again
            else:
                block.forward = forward
        for h in self._handles:
            h.remove()
        self._originals, self._handles = [], []
        if getattr(self.model, "progressive_layer_drop", None) is self:
            del self.model.progressive_layer_drop


def skippable_forward(handle: ProgressiveLayerDrop, index: int, inner: Callable[..., Any]) -> Callable[..., Any]:
    """Block ``index``'s ``forward`` under PLD: ``inner(x)`` if this forward keeps it, else ``x`` (no compute).

    A skipped block is the identity on the residual stream: no forward, hence no backward and no gradient.
    """
    @functools.wraps(inner)
    def forward(x: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        if not handle.mask[index]:
            return x  # skipped: the residual stream passes through, nothing is computed
        return inner(x, *args, **kwargs)
    return forward


def apply_progressive_layer_drop(model: nn.Module, schedule: PLDSchedule, *, generator: torch.Generator,
                                 rescale: bool = True) -> ProgressiveLayerDrop:
    """Make each of ``model.blocks`` skippable with PLD's schedule (module doc); return the handle.

    Every training-mode forward of ``model`` draws which blocks run from ``schedule.keep_probs(t, L)`` using
    ``generator`` (a CPU ``torch.Generator``; seed it the same on every data-parallel rank); the handle's
    :meth:`~ProgressiveLayerDrop.step` advances ``t``. ``rescale`` multiplies a kept block's ``attn`` and
    ``mlp`` outputs by ``1 / p_l`` in training, as the paper does. ``eval()`` runs every block. Apply it before
    wrapping for data parallelism (``find_unused_parameters=True``: skipped blocks have no gradient) and after
    any technique that replaces the blocks' ``forward`` (full activation recomputation composes: a skipped block
    is not recomputed either, and a kept one's recomputation reads the scale of the latest forward, right when
    each backward follows its own forward). The draw happens in ``model``'s forward pre-hook, so the model's
    own forward must run the blocks (not a pipeline stage cut from it). Applying twice raises;
    :meth:`~ProgressiveLayerDrop.remove` undoes it.
    """
    if not isinstance(schedule, PLDSchedule):
        raise ValueError(f"schedule must be a PLDSchedule, got {type(schedule).__name__}")
    if not isinstance(generator, torch.Generator) or generator.device.type != "cpu":
        raise ValueError("generator must be a CPU torch.Generator seeded by the caller, the same seed on every "
                         "data-parallel rank, e.g. torch.Generator().manual_seed(0)")
    blocks = getattr(model, "blocks", None)
    if not isinstance(blocks, nn.ModuleList) or len(blocks) == 0:
        raise ValueError(f"{type(model).__name__} has no `blocks` (a non-empty nn.ModuleList) to drop")
    if getattr(model, "progressive_layer_drop", None) is not None:
        raise ValueError("apply_progressive_layer_drop was already applied to this model")
    if rescale:
        for i, block in enumerate(blocks):
            if not all(isinstance(getattr(block, name, None), nn.Module) for name in ("attn", "mlp")):
                raise ValueError(f"block {i} ({type(block).__name__}) has no `attn` and `mlp` sub-layers whose "
                                 "outputs to rescale by 1/p; pass rescale=False to drop whole blocks unscaled")
    handle = ProgressiveLayerDrop(model, blocks, schedule, generator, rescale)
    handle._handles.append(model.register_forward_pre_hook(handle._before_forward))
    for i, block in enumerate(blocks):
        handle._originals.append(block.__dict__.get("forward"))  # an earlier wrapper (recompute) or None
        block.forward = skippable_forward(handle, i, block.forward)
        if rescale:
            for sub in (block.attn, block.mlp):
                handle._handles.append(sub.register_forward_hook(functools.partial(handle._scale_output, i)))
    model.progressive_layer_drop = handle
    return handle
