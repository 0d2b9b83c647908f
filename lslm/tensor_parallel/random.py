"""Model-parallel random streams: which dropout masks must agree across tensor-parallel ranks, and which must not.

After :func:`~lslm.runtime.init_distributed` every rank holds the same random stream.
Tensor parallelism needs two streams instead (Megatron-LM, Shoeybi et al. 2019, sec. 3;
its ``tensor_parallel/random.py``):

* **Replicated regions** (the residual stream, LayerNorm outputs, the output of a
  row-parallel layer after its all-reduce): every tp rank holds the *same* tensor and
  must keep holding the same tensor, so dropout there must draw the same mask on every
  tp rank. That is the *default* generator, seeded identically on the tp ranks.
* **Sharded regions** (attention probabilities of the local heads, activations split
  along the sequence by sequence parallelism): each tp rank holds a different slice of
  one logical tensor. Drawing the same mask on every slice would repeat one mask
  pattern ``tp`` times, which a single process would never do. Dropout there draws from
  a *tensor-parallel* stream whose seed differs per tp rank.

:class:`RNGStatesTracker` keeps such named streams for the generator of one device and
swaps one in for a block (``with tracker.fork(name):``), continuing it where it stopped
the previous time. :func:`model_parallel_seed` sets up both streams on a
:class:`~lslm.runtime.ParallelContext`; :func:`fork_rng_in_forward` puts a module's
whole forward on a stream with hooks, so model code stays unaware of parallelism.

A block nested inside a fork can switch back to the default stream with
``fork(DEFAULT_RNG)``: lslm's GPT attention applies its residual dropout (replicated:
it follows the row-parallel ``c_proj``) inside the same ``forward`` as the attention
dropout (sharded), so the residual dropout module is hooked back onto the default stream.

Limitation: ``torch.utils.checkpoint`` restores only the default generators before it
recomputes a forward, not the tracker's streams, so a recomputed block that forks would
draw other masks than the first time (Megatron ships its own checkpoint for this). lslm's
recomputations (:mod:`lslm.tensor_parallel.recompute`, :mod:`lslm.zero.activations`, the pipeline's
``remat``) save and restore both, with the forward's autocast, through :mod:`lslm.runtime.replay`
(a tracker is its ``StreamTracker``: ``get_states`` / ``set_states``).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Mapping
from typing import Any

import torch
from torch import nn
from torch.utils.hooks import RemovableHandle

__all__ = ["DEFAULT_RNG", "PP_SEED_STRIDE", "TENSOR_PARALLEL_RNG", "TP_SEED_OFFSET", "RNGStatesTracker",
           "fork_rng_in_forward", "model_parallel_seed", "stream_seeds"]

TENSOR_PARALLEL_RNG = "tensor-parallel"
#: The device's default generator, as a name for :meth:`RNGStatesTracker.fork` (reserved: never ``add``-ed).
DEFAULT_RNG = "default"
#: Per pipeline stage: stages hold different layers, so their dropout streams should not repeat each other.
PP_SEED_STRIDE = 100
#: Moves the tensor-parallel seeds away from the default seeds (Megatron's value; any positive number works).
TP_SEED_OFFSET = 2718


class RNGStatesTracker:
    """Named random streams for the default generator of one device (CPU, or one CUDA device).

    A stream is a saved generator state. :meth:`fork` loads it into the device's
    generator for the duration of a block and saves it back advanced on exit, then
    restores the stream that was live before: the block's draws come from the named
    stream, and every other stream continues exactly as if the block had not run.
    """

    def __init__(self, device: torch.device | str = "cpu", *, default_seed: int | None = None) -> None:
        """Track streams on ``device``'s generator; ``default_seed`` (if known) is reserved like an added seed."""
        self.device = torch.device(device)
        self._default_seed = default_seed
        self.reset()

    # -- the device's generator --------------------------------------------------------
    def _get(self) -> torch.Tensor:
        if self.device.type == "cuda":
            return torch.cuda.get_rng_state(self.device)
        return torch.get_rng_state()

    def _set(self, state: torch.Tensor) -> None:
        if self.device.type == "cuda":
            torch.cuda.set_rng_state(state, self.device)
        else:
            torch.set_rng_state(state)

    # -- bookkeeping -------------------------------------------------------------------
    def reset(self) -> None:
        """Forget every stream and seed (the default seed given at construction stays reserved)."""
        self._states: dict[str, torch.Tensor] = {}
        self._seeds: dict[int, str] = {} if self._default_seed is None else {self._default_seed: DEFAULT_RNG}
        self._live = DEFAULT_RNG  # the stream whose state is in the generator right now
        self._parked_default: torch.Tensor | None = None  # the default stream while another one is live

    @property
    def names(self) -> list[str]:
        """The added streams, in order of addition."""
        return list(self._states)

    def add(self, name: str, seed: int) -> None:
        """Add stream ``name``, seeded with ``seed``; the device's generator is left untouched."""
        if not isinstance(name, str) or not name or name == DEFAULT_RNG:
            raise ValueError(f"stream name must be a non-empty string other than {DEFAULT_RNG!r}, got {name!r}")
        if name in self._states:
            raise ValueError(f"RNG stream {name!r} already exists; reset() the tracker or pick another name")
        if isinstance(seed, bool) or not isinstance(seed, int) or seed < 0:
            raise ValueError(f"seed must be an int >= 0, got {seed!r}")
        if seed in self._seeds:
            raise ValueError(f"seed {seed} is already used by stream {self._seeds[seed]!r}: two streams with one "
                             "seed would draw identical masks; pick another seed")
        self._seeds[seed] = name
        # A scratch generator of the same device type yields exactly the state manual_seed
        # would give the default one, without disturbing it.
        self._states[name] = torch.Generator(device=self.device).manual_seed(seed).get_state()

    def get_states(self) -> dict[str, torch.Tensor]:
        """Copies of every stream's current state, by name (for a checkpoint)."""
        if self._live != DEFAULT_RNG:  # the live stream's latest state is in the generator
            self._states[self._live] = self._get()
        return {name: state.clone() for name, state in self._states.items()}

    def set_states(self, states: Mapping[str, torch.Tensor]) -> None:
        """Replace every stream by ``states`` (as :meth:`get_states` returned them); seeds are not restored."""
        if self._live != DEFAULT_RNG:
            raise RuntimeError(f"set_states() inside fork({self._live!r}): call it outside any fork")
        checked: dict[str, torch.Tensor] = {}
        for name, state in states.items():
            if not isinstance(name, str) or name == DEFAULT_RNG:
                raise ValueError(f"bad stream name {name!r} in states")
            try:  # the generator of this device checks the state's size and format
                torch.Generator(device=self.device).set_state(state)
            except (RuntimeError, TypeError) as exc:
                raise ValueError(f"state of stream {name!r} is not a {self.device.type} generator state "
                                 f"({exc}); was it saved on another device type?") from exc
            checked[name] = state.clone()
        self._states = checked

    # -- forking -----------------------------------------------------------------------
    def _park(self, name: str, state: torch.Tensor) -> None:
        if name == DEFAULT_RNG:
            self._parked_default = state
        else:
            self._states[name] = state

    def _parked(self, name: str) -> torch.Tensor:
        if name != DEFAULT_RNG:
            return self._states[name]
        assert self._parked_default is not None  # parked whenever another stream went live
        return self._parked_default

    @contextlib.contextmanager
    def fork(self, name: str = TENSOR_PARALLEL_RNG) -> Iterator[None]:
        """Draw from stream ``name`` inside the block; every other stream continues as if it had not run.

        On entry the live stream (the default one at top level) is parked and ``name`` is
        loaded; on exit, exception or not, ``name`` is saved advanced and the parked stream
        is loaded back. Forks nest; ``fork(DEFAULT_RNG)`` switches back to the default stream.
        """
        if name != DEFAULT_RNG and name not in self._states:
            raise ValueError(f"unknown RNG stream {name!r}; known: {[DEFAULT_RNG, *self._states]} "
                             "(add it first, or call model_parallel_seed)")
        outer = self._live
        self._park(outer, self._get())
        self._set(self._parked(name))
        self._live = name
        try:
            yield
        finally:
            if self._live != name:
                raise RuntimeError(f"fork({name!r}) is closing while stream {self._live!r} is live: forks were "
                                   "exited out of order")
            self._park(name, self._get())
            self._set(self._parked(outer))
            self._live = outer


def stream_seeds(seed: int, tp_rank: int, pp_rank: int) -> dict[str, int]:
    """The seed of each stream on the rank at ``(tp_rank, pp_rank)``; see :func:`model_parallel_seed`."""
    base = seed + PP_SEED_STRIDE * pp_rank
    return {DEFAULT_RNG: base, TENSOR_PARALLEL_RNG: base + TP_SEED_OFFSET + tp_rank}


def model_parallel_seed(ctx: Any, seed: int, *, reseed_default: bool = True) -> RNGStatesTracker:
    """Seed the default and tensor-parallel streams of this rank; store the tracker on ``ctx.rng``, return it.

    * default stream: ``seed + 100 * pp_rank``, re-seeded now (``torch.manual_seed``).
      Identical on every tp rank of a stage, so replicated activations stay replicated;
      identical over dp ranks too (they see other data, so the masks need not differ);
      distinct per pipeline stage, whose layers are other layers.
    * tensor-parallel stream: ``seed + 100 * pp_rank + 2718 + tp_rank``: one per tp rank
      (sharded activations get independent masks), the same on dp replicas of a tp rank.

    These are Megatron-LM's offsets (``_set_random_seed``, ``model_parallel_cuda_manual_seed``).
    Call it after building (and slicing) the weights: they must come from the one seed
    every rank shares, and this re-seeds the default generator per stage.

    ``reseed_default=False`` adds the tensor-parallel stream only and leaves the default
    generator exactly as it is (what :func:`~lslm.tensor_parallel.apply.apply_tensor_parallel`
    does: a library call should not reset the caller's random stream). The default stream
    is then the caller's, which must be identical on the tp ranks of a stage (as
    :func:`~lslm.runtime.init_distributed` leaves it when every rank builds the same model).
    """
    if isinstance(seed, bool) or not isinstance(seed, int) or seed < 0:
        raise ValueError(f"seed must be an int >= 0, got {seed!r}")
    seeds = stream_seeds(seed, ctx.tp_rank, ctx.pp_rank)
    if reseed_default:
        torch.manual_seed(seeds[DEFAULT_RNG])
    # The default seed is reserved (no stream may repeat it) only when it is the one in use.
    tracker = RNGStatesTracker(ctx.device, default_seed=seeds[DEFAULT_RNG] if reseed_default else None)
    tracker.add(TENSOR_PARALLEL_RNG, seeds[TENSOR_PARALLEL_RNG])
    ctx.rng = tracker
    return tracker


def fork_rng_in_forward(module: nn.Module, tracker: RNGStatesTracker,
                        name: str = TENSOR_PARALLEL_RNG) -> tuple[RemovableHandle, RemovableHandle]:
    """Make every call of ``module`` (its forward and its submodules) draw from stream ``name``.

    A forward pre-hook enters ``tracker.fork(name)``, a forward hook leaves it; the hook
    is registered with ``always_call=True`` so an exception in forward (or in another
    hook) still restores the previous stream. Neither hook needs the call's kwargs.
    Returns both handles: ``h.remove()`` for each undoes it.
    """
    if name != DEFAULT_RNG and name not in tracker.names:
        raise ValueError(f"unknown RNG stream {name!r}; known: {[DEFAULT_RNG, *tracker.names]}")
    open_forks: list[contextlib.ExitStack] = []  # one per call in progress (a module may re-enter itself)

    def enter(_module: nn.Module, _args: Any) -> None:
        stack = contextlib.ExitStack()
        stack.enter_context(tracker.fork(name))
        open_forks.append(stack)  # only once entered: a failed entry leaves nothing to close

    def leave(_module: nn.Module, _args: Any, _output: Any) -> None:
        if open_forks:
            open_forks.pop().close()

    # prepend: other pre-hooks (and their draws) run inside the stream too.
    pre = module.register_forward_pre_hook(enter, prepend=True)
    post = module.register_forward_hook(leave, always_call=True)
    return pre, post
