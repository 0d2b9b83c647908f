"""One contiguous gradient storage per (kind, dtype): every parameter's ``main_grad`` is a view into it.

Megatron-LM keeps gradients in a ``ParamAndGradBuffer`` (``megatron/core/distributed/
param_and_grad_buffer.py``); this is our own version of the idea. Without it a gradient lives
in three places (autograd's ``.grad``, a per-parameter fp32 copy, a flat buffer built by
``torch.cat`` for each collective and copied back), and a sync that reads the wrong one
reduces nothing without a word. With it there is one place:

* **Storage.** ``buffer.data``: one 1-D tensor of ``dtype`` (fp32 by default, whatever the
  parameters' dtype) on the parameters' device. Parameter ``i``'s gradient is
  ``param.main_grad``, a view of ``data``; nothing else holds a gradient between backward
  and the optimizer step.
* **Accumulation.** A ``post_accumulate_grad`` hook on each parameter adds the ``.grad``
  autograd has just produced into ``main_grad`` (in ``dtype``: micro-batches of gradient
  accumulation sum in fp32) and frees ``.grad`` at once, so no half-precision gradient
  outlives its layer's backward. Code that computes a gradient outside autograd (zero
  bubble's deferred weight gradients) calls :meth:`GradBuffer.accumulate` instead.
* **Layout.** Parameters are placed in *reverse* of the order given (backward produces the
  last layers' gradients first) and cut into **buckets**: consecutive runs of at most
  ``bucket_cap_bytes`` (a larger parameter sits alone in its bucket). A bucket is the unit
  of communication: one all-reduce per bucket, in place, with no copy in or out.
* **Padding.** Each bucket's length is rounded up to a multiple of ``pad_to`` elements
  (zeros that are never a parameter's). ZeRO shards each bucket into ``dp`` equal pieces, so
  it asks for ``pad_to = dp`` (times a small alignment); bucket ``b`` then splits at
  ``bucket.start + k * bucket.numel // dp``. Bucket boundaries (``Bucket.start``/``end``, in
  elements of ``data``) and padding (``Bucket.padding``) are explicit for that reason.
* **Slots.** A parameter may own ``slots`` copies' worth of room and write its gradient into
  one slot (``slot``), the others staying zero: grouped-query attention's key/value heads,
  replicated on several tensor-parallel ranks, are summed among exactly the ranks that share
  a head by one all-reduce of the whole buffer over the TP group (each rank writes its
  head's slot; the others add zeros there).

What a buffer reduces over is its caller's business (:mod:`lslm.data_parallel.grad_sync`
groups a model's parameters into buffers by the reduction they need); the buffer only
knows its buckets. :func:`attach_grad_buffers` is the usual entry point.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from lslm.data_parallel.buckets import flat_layout

__all__ = ["BUFFER_ATTRS", "Bucket", "GradBuffer", "buffers_of", "has_main_grad", "main_grad_or_grad"]

#: Attributes a buffer sets on the parameters it holds (never copied onto master weights).
BUFFER_ATTRS = ("main_grad", "grad_buffer")


@dataclass
class Bucket:
    """A run of consecutive parameters of one buffer: elements ``[start, end)`` of ``buffer.data``.

    ``params``: indices into ``buffer.params`` (placed in this order). ``padding``: zeros at
    the end (``end - start`` is a multiple of the buffer's ``pad_to``).
    """

    index: int
    start: int
    end: int
    params: list[int] = field(default_factory=list)
    padding: int = 0

    @property
    def numel(self) -> int:
        """Elements of the bucket, padding included."""
        return self.end - self.start


class GradBuffer:
    """A contiguous gradient storage for ``params``; see the module doc.

    ``params``: the parameters (requires_grad, one device), in the order a forward uses
    them (they are laid out in reverse). ``dtype``: the gradient dtype (default fp32).
    ``bucket_cap_bytes``: ``None`` for one bucket. ``pad_to``: each bucket's element count
    is a multiple of it. ``slots``: ``{param index: (count, slot)}`` for parameters that
    own ``count`` slots and write slot ``slot``. ``kind``: a free label saying what the
    buffer is reduced over (``"dp"``, ``"sp"``, ...). ``names``: for messages.

    Hooks are registered by :meth:`attach` (not by the constructor), so a buffer can also
    serve as plain bucket storage.
    """

    def __init__(self, params: Sequence[nn.Parameter], *, dtype: torch.dtype = torch.float32,
                 bucket_cap_bytes: int | None = None, pad_to: int = 1,
                 slots: dict[int, tuple[int, int]] | None = None, kind: str = "local",
                 names: Sequence[str] | None = None) -> None:
        params = list(params)
        if not params:
            raise ValueError("a GradBuffer needs at least one parameter")
        if len({id(p) for p in params}) != len(params):
            raise ValueError("a parameter appears twice: pass shared (tied) parameters once")
        if not dtype.is_floating_point:
            raise ValueError(f"gradient dtype must be a floating dtype, got {dtype}")
        devices = {p.device for p in params}
        if len(devices) != 1:
            raise ValueError(f"parameters of one buffer must share a device, got {sorted(map(str, devices))}")
        if not isinstance(pad_to, int) or isinstance(pad_to, bool) or pad_to < 1:
            raise ValueError(f"pad_to must be an int >= 1, got {pad_to!r}")
        if bucket_cap_bytes is not None and bucket_cap_bytes < 1:
            raise ValueError(f"bucket_cap_bytes must be >= 1 (or None for one bucket), got {bucket_cap_bytes}")
        self.params = params
        self.names = list(names) if names is not None else [f"param {i}" for i in range(len(params))]
        self.dtype = dtype
        self.device = params[0].device
        self.kind = kind
        self.pad_to = pad_to
        self.slots = dict(slots or {})
        for i, (count, slot) in self.slots.items():
            if not 0 <= slot < count:
                raise ValueError(f"{self.names[i]}: slot {slot} is outside 0..{count - 1}")
        # DDP's planning rule (reverse order, a bucket closes before the cap would be passed), padded buckets.
        self.offsets, planned, position = flat_layout([self._extent(i) for i in range(len(params))],
                                                      dtype.itemsize, bucket_cap_bytes, pad_to)
        self.buckets: list[Bucket] = [Bucket(b, start, end, idx, padding)
                                      for b, (start, end, idx, padding) in enumerate(planned)]
        self.numel = position
        self.data = torch.zeros(position, dtype=dtype, device=self.device)
        self._hooks: list[Any] = []
        self._listeners: list[Callable[[int], None]] = []
        self._index = {id(p): i for i, p in enumerate(params)}

    def _extent(self, i: int) -> int:
        count = self.slots.get(i, (1, 0))[0]
        return count * self.params[i].numel()

    # -- views -------------------------------------------------------------------------------
    def view(self, i: int) -> torch.Tensor:
        """Parameter ``i``'s gradient: its slot of ``data``, shaped like the parameter (what ``main_grad`` is)."""
        p = self.params[i]
        start = self.offsets[i] + self.slots.get(i, (1, 0))[1] * p.numel()
        return self.data[start:start + p.numel()].view(p.shape)

    def bucket_view(self, b: int) -> torch.Tensor:
        """Bucket ``b``'s elements of ``data`` (padding included): what one collective sends."""
        bucket = self.buckets[b]
        return self.data[bucket.start:bucket.end]

    @property
    def nbytes(self) -> int:
        """Bytes of ``data`` (padding and empty slots included)."""
        return self.data.numel() * self.data.element_size()

    # -- accumulation ---------------------------------------------------------------------------
    def attach(self) -> GradBuffer:
        """Make ``main_grad`` of every parameter its view here and fold each new ``.grad`` into it.

        Refuses a parameter that already has a ``main_grad`` (one gradient, one place).
        """
        taken = [self.names[i] for i, p in enumerate(self.params) if getattr(p, "main_grad", None) is not None]
        if taken:
            raise ValueError(f"{taken[0]!r} already has a main_grad (another GradBuffer holds its gradient); "
                             "detach that buffer first")
        for i, p in enumerate(self.params):
            p.main_grad = self.view(i)
            p.grad_buffer = self
            self._hooks.append(p.register_post_accumulate_grad_hook(self._hook))
        return self

    def detach(self) -> None:
        """Undo :meth:`attach`: hooks removed, ``main_grad`` unset (``.grad`` then works as plain autograd's)."""
        for h in self._hooks:
            h.remove()
        self._hooks = []
        for p in self.params:
            for name in BUFFER_ATTRS:
                if name in p.__dict__:
                    delattr(p, name)

    def _hook(self, param: torch.Tensor) -> None:
        # Runs once autograd has summed this backward's gradient into .grad. A deferred weight gradient
        # (zero bubble's I pass) fires it with no .grad: that gradient arrives later through accumulate().
        if param.grad is None:
            return
        grad, param.grad = param.grad, None
        self.accumulate(param, grad)

    def accumulate(self, param: torch.Tensor, grad: torch.Tensor) -> None:
        """Add ``grad`` into ``param``'s ``main_grad`` (cast to the buffer's dtype); tell the listeners."""
        i = self._index[id(param)]
        with torch.no_grad():  # a deferred weight gradient may be computed with grad mode on: record nothing
            param.main_grad.add_(grad)
        for listener in self._listeners:
            listener(i)

    def add_listener(self, fn: Callable[[int], None]) -> Callable[[], None]:
        """Call ``fn(param_index)`` after each accumulation (a DDP wrapper counts ready buckets so); returns an
        un-register function."""
        self._listeners.append(fn)
        return lambda: self._listeners.remove(fn)

    def zero_(self) -> None:
        """Zero the whole storage (every gradient, slot and pad) in one fill."""
        self.data.zero_()

    def __repr__(self) -> str:
        return (f"GradBuffer(kind={self.kind!r}, dtype={self.dtype}, params={len(self.params)}, numel={self.numel}, "
                f"buckets={len(self.buckets)}, pad_to={self.pad_to})")


def has_main_grad(param: torch.Tensor) -> bool:
    """Whether ``param``'s gradient lives in a :class:`GradBuffer` (``main_grad``) rather than in ``.grad``."""
    return isinstance(getattr(param, "grad_buffer", None), GradBuffer)


def main_grad_or_grad(param: torch.Tensor) -> torch.Tensor | None:
    """The tensor holding ``param``'s gradient now: ``main_grad`` when a buffer holds it, else ``.grad``."""
    return param.main_grad if has_main_grad(param) else param.grad


def buffers_of(params: Iterable[torch.Tensor]) -> list[GradBuffer]:
    """The distinct buffers holding ``params``' gradients, in order of first appearance."""
    seen: dict[int, GradBuffer] = {}
    for p in params:
        buf = getattr(p, "grad_buffer", None)
        if isinstance(buf, GradBuffer) and id(buf) not in seen:
            seen[id(buf)] = buf
    return list(seen.values())
