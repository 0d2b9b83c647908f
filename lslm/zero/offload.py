"""ZeRO-Offload's traffic between the device and the host: where the host buffers live, and when copies land.

A copy from a GPU into page-locked host memory with ``non_blocking=True`` only *enqueues* the transfer
on the device's stream and returns at once; the host can read the destination before the bytes arrive.
So the step on the host must wait for the copies first. :class:`HostCopies` issues them asynchronously
on an accelerator, records an event on the device's current stream after the last one, and
:meth:`HostCopies.wait` blocks the host on that event: the one synchronisation the step needs, not one per
copy. On a CPU-only machine host and device are one memory: the copies are ordinary synchronous copies,
there is no event, and ``wait`` has nothing to wait for; no ``torch.cuda`` call is made on that path
(``torch.Event`` is the device-generic event).
"""

from __future__ import annotations

import torch

__all__ = ["HostCopies", "on_host"]

HOST = torch.device("cpu")


def on_host(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """``t`` in host memory, page-locked when ``device`` is an accelerator (so copies to and from it can run
    asynchronously); on a CPU-only machine host and device are the same memory and ``t`` moves nowhere."""
    t = t.to(HOST)
    return t.pin_memory() if device.type != "cpu" else t


class HostCopies:
    """Device-to-host copies that may still be on their way, and the wait before the host reads them."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.asynchronous = device.type != "cpu"
        #: True from the first copy until :meth:`wait`: the host must not read the destinations yet.
        self.pending = False
        self._event: torch.Event | None = None

    def copy(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        """Issue ``dst.copy_(src)``, asynchronous on an accelerator (``dst`` page-locked)."""
        dst.copy_(src, non_blocking=self.asynchronous)
        self.pending = True

    def issued(self) -> None:
        """Every copy of this batch is issued: mark the point the host will wait for."""
        if self.asynchronous and self.pending:
            self._event = torch.Event(device=self.device)
            self._event.record()

    def wait(self) -> None:
        """Return once every copy issued so far has landed in host memory."""
        if self._event is not None:
            self._event.synchronize()
            self._event = None
        self.pending = False
