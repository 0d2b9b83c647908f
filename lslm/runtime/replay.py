"""The global state a forward ran under, captured so that its replay (recomputation) runs under the same state.

A recomputation runs part of a forward again in the backward pass and differentiates the *replay*, so the
replay must compute what the forward computed: the same values from the same inputs. Besides the inputs,
two pieces of thread-global state decide what a forward computes, and both may differ when the backward
runs (it is usually called outside ``torch.autocast``, and the generators have moved on):

* **autocast**: enabled or not, its dtype and whether it caches the weights' casts, for the CPU and for the
  forward's device. A replay outside the forward's autocast runs its matmuls in fp32: its activations are not
  the ones the forward used (the gradient is not that of the function evaluated) and, on a GPU, it costs an
  fp32 forward instead of a bf16 one. A replay inside an autocast the forward did not run under is as wrong.
* **random streams**: the CPU generator, the device's (CUDA) and the named streams of a tracker (lslm's
  tensor-parallel :class:`~lslm.tensor_parallel.random.RNGStatesTracker`), so dropout draws the forward's
  masks. The tracker's streams are generator states kept *outside* the generator; restoring the generator
  alone (all ``torch.utils.checkpoint`` does) lets a fork inside the replay start from the stream as the
  forward left it, advanced: other masks. Hence lslm's own mechanism, Megatron's ``CheckpointFunction``'s.
  After the replay the streams are put back as they were before it: nothing else sees that it ran.

``torch.utils.checkpoint`` (torch 2.x, ``use_reentrant=False``) restores the same autocast fields and the
default generators, runs the replay with gradients enabled (as :func:`replaying` does), and also re-enters a
``with torch.device(...)`` default-device mode found on the stack (through private APIs; lslm's models create
every tensor on their input's device, so that mode changes nothing they compute) and compile-time flags and a
``context_fn`` (selective-checkpoint policies, used under ``torch.compile``), which no lslm replay has.

:func:`capture_forward_state` in the forward, :func:`replaying` around the replay in the backward; a
hand-written backward that recomputes from saved tensors (ring attention's probabilities) re-enters only
the autocast, with :meth:`ForwardState.autocast` (``torch.amp.custom_bwd``'s behaviour).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any, Protocol

import torch

__all__ = ["AutocastState", "ForwardState", "StreamTracker", "capture_forward_state", "replaying"]


class StreamTracker(Protocol):
    """Named random streams saved outside the generator (:class:`lslm.tensor_parallel.random.RNGStatesTracker`)."""

    def get_states(self) -> Any:
        """Every stream's state."""

    def set_states(self, states: Any) -> None:
        """Put ``get_states()``'s result back."""


@dataclass(frozen=True)
class AutocastState:
    """``torch.autocast``'s settings for one device type, as :func:`capture_forward_state` found them."""

    device_type: str
    enabled: bool
    dtype: torch.dtype
    cache_enabled: bool

    @classmethod
    def now(cls, device_type: str) -> AutocastState:
        """The current thread's autocast settings for ``device_type``."""
        return cls(device_type, torch.is_autocast_enabled(device_type), torch.get_autocast_dtype(device_type),
                   torch.is_autocast_cache_enabled())

    def context(self) -> torch.autocast:
        """A ``torch.autocast`` that sets exactly these settings (``enabled=False`` included: it switches an
        outer autocast off)."""
        return torch.autocast(self.device_type, enabled=self.enabled, dtype=self.dtype,
                              cache_enabled=self.cache_enabled)


@dataclass(frozen=True)
class ForwardState:
    """What a forward on ``device`` ran under (module doc): autocast per device type, and the random streams."""

    device: torch.device
    autocasts: tuple[AutocastState, ...]
    rng: tuple[Any, Any, Any] | None  #: (CPU generator, device generator or None, tracker states or None)

    @contextlib.contextmanager
    def autocast(self) -> Iterator[None]:
        """Inside: the forward's autocast settings, for the CPU and for its device."""
        with contextlib.ExitStack() as stack:
            for state in self.autocasts:
                stack.enter_context(state.context())
            yield


def _device_types(device: torch.device) -> tuple[str, ...]:
    # The CPU always (a CUDA forward may run CPU ops too, as torch's checkpoint assumes), then the device's own.
    return ("cpu",) if device.type == "cpu" else ("cpu", device.type)


def _rng_now(device: torch.device, streams: StreamTracker | None) -> tuple[Any, Any, Any]:
    cuda = torch.cuda.get_rng_state(device) if device.type == "cuda" else None  # no torch.cuda on CPU paths
    return torch.get_rng_state(), cuda, streams.get_states() if streams is not None else None


def _set_rng(states: tuple[Any, Any, Any], device: torch.device, streams: StreamTracker | None) -> None:
    torch.set_rng_state(states[0])
    if device.type == "cuda":
        torch.cuda.set_rng_state(states[1], device)
    if states[2] is not None and streams is not None:
        streams.set_states(states[2])


def capture_forward_state(device: torch.device | str, streams: StreamTracker | None = None, *,
                          rng: bool = True) -> ForwardState:
    """The state a forward on ``device`` runs under now: autocast (CPU and ``device``) and, with ``rng``, the CPU
    generator, ``device``'s if CUDA, and every stream of ``streams``.

    Call it where the forward starts (called inside a fork of ``streams``, it captures the live stream as it is
    in the generator, which is what the replayed code continues from).
    """
    device = torch.device(device)
    autocasts = tuple(AutocastState.now(t) for t in _device_types(device))
    return ForwardState(device, autocasts, _rng_now(device, streams) if rng else None)


@contextlib.contextmanager
def replaying(state: ForwardState, streams: StreamTracker | None = None) -> Iterator[None]:
    """Inside: gradients on, the forward's autocast and its random streams (``streams``: the tracker whose states
    ``state`` holds); on exit the streams continue from where they were before (module doc)."""
    resume = _rng_now(state.device, streams) if state.rng is not None else None
    if state.rng is not None:
        _set_rng(state.rng, state.device, streams)
    try:
        with torch.enable_grad(), state.autocast():
            yield
    finally:
        if resume is not None:
            _set_rng(resume, state.device, streams)
