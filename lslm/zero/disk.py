"""ZeRO-Infinity-style disk offload: a rank's fp32 masters and optimizer states live in files between steps.

Rajbhandari et al. 2021 (ZeRO-Infinity, §5) move the optimizer's model states to NVMe and
stream them through memory during the step. Here a rank's pieces (:class:`~lslm.zero.layout.Piece`)
are grouped into *chunks* of at most ``chunk_bytes`` of states (fp32 master + the optimizer's
per-element tensors: 12 bytes per element with Adam), one raw file per chunk. The step walks the
chunks in order through three fixed buffers (*slots*), allocated once: a reader thread reads
chunk ``k + 1`` into its slot while chunk ``k`` is stepped in place in another (read ahead), and a
writer thread writes chunk ``k - 1`` from the third (write behind); a slot is read into only once
its last write is done, and every write is finished before the step returns. Each slot also holds
its chunk's fp32 gradients, copied in just before the chunk is stepped. So the states' resident
memory is three slots, whatever the rank's share of the model: no per-step allocation (the
allocator has nothing to keep), no whole-file deserialisation, no full-size gradient copy; the
price is reading and writing every state byte once per step (:attr:`DiskStates.bytes_moved`).
Files are read and written with plain ``readinto``/``write`` on the slot's memory (what the
kernel's page cache keeps of them is not the process's resident memory, but is memory).

Between steps a master is an empty tensor (its identity stays, the optimizer's key) and its
optimizer state holds only what is not per-element (Adam's ``step``). During a step the
optimizer sees views of the slot: it updates them in place (an optimizer that replaces a state
tensor instead is copied back, so any torch optimizer works).
"""

from __future__ import annotations

import os
import shutil
import uuid
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

import torch

__all__ = ["SLOTS", "DiskStates", "check_writable", "elementwise_state_keys"]

#: Chunk buffers: one being read ahead, one being stepped, one being written behind.
SLOTS = 3


def elementwise_state_keys(optimizer_class: type, settings: dict[str, Any],
                           defaults: dict[str, Any]) -> list[tuple[str, torch.dtype]]:
    """The per-element state tensors (name, dtype) an optimizer of this class and group ``settings`` keeps.

    Found by stepping a two-element probe parameter once with a zero gradient (no other state
    is touched), so any torch optimizer is supported without knowing its keys.
    """
    probe = torch.nn.Parameter(torch.zeros(2))  # lslm: cpu-ok (a probe of the optimizer's rules, no data)
    opt = optimizer_class([{**settings, "params": [probe]}], **defaults)
    probe.grad = torch.zeros_like(probe)
    opt.step()
    return sorted((k, v.dtype) for k, v in opt.state[probe].items()
                  if isinstance(v, torch.Tensor) and v.shape == probe.shape)


def check_writable(folder: str | Path) -> Path:
    """Create ``folder`` if needed and write a probe file there; ``ValueError`` naming it if that fails.

    The probe's name is this process's own (ranks often share one folder and check it at the same moment: with one
    name, a rank could delete the other's probe between its write and its unlink).
    """
    folder = Path(folder)
    try:
        folder.mkdir(parents=True, exist_ok=True)
        probe = folder / f".lslm-write-test-{os.getpid()}-{uuid.uuid4().hex[:8]}"
        probe.write_bytes(b"x")
        probe.unlink()
    except OSError as e:
        raise ValueError(f"the disk offload folder {folder} is not writable: {e}") from e
    return folder


def _align(offset: int, itemsize: int) -> int:
    return -(-offset // itemsize) * itemsize


class DiskStates:
    """The files of one rank's masters and optimizer states, and the chunked, overlapped walk over them.

    ``masters``: the optimizer's parameters (their identity is kept; their data becomes empty).
    ``values``: their initial fp32 values (default: the masters' own), written to the files here.
    ``keys[i]``: the per-element state tensors of master ``i`` (:func:`elementwise_state_keys`).
    ``pin``: page-locked slots (the device is a GPU, so copies to and from it can be asynchronous).
    """

    def __init__(self, folder: str | Path, masters: Sequence[torch.Tensor], chunk_bytes: int, *,
                 keys: Sequence[Sequence[tuple[str, torch.dtype]]], values: Sequence[torch.Tensor] | None = None,
                 pin: bool = False) -> None:
        self.folder = check_writable(folder)
        if chunk_bytes < 1:
            raise ValueError(f"chunk_bytes must be >= 1, got {chunk_bytes}")
        values = list(values) if values is not None else [m.detach() for m in masters]
        self.masters = list(masters)
        self.numels = [v.numel() for v in values]
        self.keys = [list(k) for k in keys]
        assert len(self.keys) == len(self.masters) == len(values)
        self.chunks: list[list[int]] = []
        size = 0
        for i, n in enumerate(self.numels):
            nbytes = n * (4 + sum(dt.itemsize for _, dt in self.keys[i]))  # what the chunk's file holds
            if not self.chunks or size + nbytes > chunk_bytes:
                self.chunks.append([])
                size = 0
            self.chunks[-1].append(i)
            size += nbytes
        # Where each piece's master, states and gradient sit in its chunk's slot (byte offsets); the file is the
        # slot's first file_bytes[k] bytes (masters and states; the gradients are never written).
        self.where: list[dict[str, tuple[int, torch.dtype]]] = [{} for _ in self.masters]
        self.file_bytes: list[int] = []
        slot_bytes = 0
        for chunk in self.chunks:
            offset = 0
            for i in chunk:
                for key, dt in [("master", torch.float32), *self.keys[i]]:
                    offset = _align(offset, dt.itemsize)
                    self.where[i][key] = (offset, dt)
                    offset += self.numels[i] * dt.itemsize
            self.file_bytes.append(offset)
            for i in chunk:
                offset = _align(offset, 4)
                self.where[i]["grad"] = (offset, torch.float32)
                offset += 4 * self.numels[i]
            slot_bytes = max(slot_bytes, offset)
        device = self.masters[0].device if self.masters else torch.device("cpu")
        #: The only memory the states occupy: SLOTS buffers of the largest chunk, allocated once.
        self.slots = [torch.zeros(slot_bytes, dtype=torch.uint8, device=device) for _ in range(SLOTS)]
        if pin:
            self.slots = [s.pin_memory() for s in self.slots]
        self._slot_writes: list[Future[int] | None] = [None] * SLOTS
        #: Pieces whose per-element states are in the files (after their first step, or a loaded checkpoint).
        self.has_state = [False] * len(self.masters)
        #: Bytes read from and written to the files by the last step.
        self.bytes_moved = {"from_disk": 0, "to_disk": 0}
        #: Set when a write failed: the files no longer hold one consistent step, and every later walk refuses.
        self.broken: str | None = None
        self.empty = torch.empty(0, dtype=torch.float32, device=device)
        self._reader = ThreadPoolExecutor(max_workers=1, thread_name_prefix="lslm-zero-read")
        self._writer = ThreadPoolExecutor(max_workers=1, thread_name_prefix="lslm-zero-write")
        for k, chunk in enumerate(self.chunks):  # the masters' first values go to disk at once; states zero
            slot = self.slots[0]
            slot[:self.file_bytes[k]].zero_()
            for i in chunk:
                self.view(slot, i, "master").copy_(values[i].reshape(-1))
            self._write(k, slot)
        for m in self.masters:
            m.data = self.empty

    # -- files and slots ----------------------------------------------------------------------------------
    def path(self, k: int) -> Path:
        """The file of chunk ``k``."""
        return self.folder / f"chunk{k:05d}.bin"

    def view(self, slot: torch.Tensor, i: int, key: str) -> torch.Tensor:
        """Piece ``i``'s ``key`` (``master``, ``grad`` or a state name) inside ``slot``: a 1-D typed view."""
        offset, dt = self.where[i][key]
        return slot[offset:offset + self.numels[i] * dt.itemsize].view(dt)

    def _write(self, k: int, slot: torch.Tensor) -> int:
        data = memoryview(slot[:self.file_bytes[k]].numpy())
        try:
            with open(self.path(k), "wb") as f:
                f.write(data)
        except OSError as e:  # a full disk: name the file and the folder; the step that wrote it fails loudly
            self.broken = str(self.path(k))
            raise OSError(e.errno, f"writing the offloaded optimizer states to {self.path(k)} failed "
                                   f"({e.strerror}); the offload folder {self.folder} no longer holds one "
                                   "consistent step: free space there and resume from the last checkpoint") from e
        return len(data)

    def _read(self, k: int, s: int) -> int:
        prior = self._slot_writes[s]
        if prior is not None:  # the slot's previous chunk must be on disk before it is overwritten
            prior.result()
        data = memoryview(self.slots[s][:self.file_bytes[k]].numpy())
        with open(self.path(k), "rb", buffering=0) as f:
            got = 0
            while got < len(data):
                n = f.readinto(data[got:])
                if not n:
                    raise OSError(f"{self.path(k)} ends after {got} of {len(data)} bytes: truncated")
                got += n
        return got

    def walk(self, optimizer_state: dict[Any, dict[str, Any]],
             step_chunk: Callable[[list[int]], None]) -> None:
        """Bring each chunk in, install its masters, states and gradient buffers, ``step_chunk(indices)``, write it.

        During ``step_chunk`` each master of the chunk holds its values, its ``.grad`` is the slot's
        fp32 buffer for it (``step_chunk`` fills it) and, from its second step on, its per-element
        states are views of the slot. Reads run one chunk ahead and writes one behind; everything
        is on disk again when this returns (each master empty, its state reduced to what is not
        per-element).
        """
        if self.broken is not None:
            raise RuntimeError(f"a write of the offloaded states failed earlier ({self.broken}): the files in "
                               f"{self.folder} do not hold one consistent step; load a checkpoint into a new optimizer")
        self.bytes_moved = {"from_disk": 0, "to_disk": 0}
        if not self.chunks:
            return
        writes: list[Future[int]] = []
        ahead: Future[int] = self._reader.submit(self._read, 0, 0)
        try:
            for k, chunk in enumerate(self.chunks):
                s = k % SLOTS
                self.bytes_moved["from_disk"] += ahead.result()
                if k + 1 < len(self.chunks):
                    ahead = self._reader.submit(self._read, k + 1, (k + 1) % SLOTS)
                slot = self.slots[s]
                for i in chunk:
                    m = self.masters[i]
                    m.data = self.view(slot, i, "master")
                    m.grad = self.view(slot, i, "grad")
                    if self.has_state[i]:
                        state = optimizer_state.setdefault(m, {})
                        for key, _ in self.keys[i]:
                            state[key] = self.view(slot, i, key)
                step_chunk(chunk)
                for i in chunk:
                    m = self.masters[i]
                    state = optimizer_state.get(m, {})
                    if all(state.get(key) is not None for key, _ in self.keys[i]):
                        self.has_state[i] = True
                    for key, _ in self.keys[i]:
                        value, home = state.pop(key, None), self.view(slot, i, key)
                        if value is not None and value.data_ptr() != home.data_ptr():
                            home.copy_(value)  # created by this first step (or replaced): into the slot
                    m.grad = None
                    m.data = self.empty
                write = self._writer.submit(self._write, k, slot)
                self._slot_writes[s] = write
                writes.append(write)
        finally:
            for w in writes:
                self.bytes_moved["to_disk"] += w.result()  # re-raises a failed write here, in the step
            ahead.result()

    # -- checkpoints -------------------------------------------------------------------------------------
    def read_all(self, optimizer_state: dict[Any, dict[str, Any]]) -> list[tuple[torch.Tensor, dict[str, Any]]]:
        """Every piece's master and full optimizer state (the files' per-element tensors, cloned, plus the
        resident scalars of ``optimizer_state``): what a checkpoint saves."""
        out: list[Any] = [None] * len(self.masters)
        for k, chunk in enumerate(self.chunks):
            self._read(k, 0)
            for i in chunk:
                state = dict(optimizer_state.get(self.masters[i], {}))
                if self.has_state[i]:
                    state.update({key: self.view(self.slots[0], i, key).clone() for key, _ in self.keys[i]})
                out[i] = (self.view(self.slots[0], i, "master").clone(), state)
        return out

    def write_all(self, values: Sequence[tuple[torch.Tensor, dict[str, Any]]]) -> None:
        """Replace every piece's master and per-element states in the files (a checkpoint loaded)."""
        for k, chunk in enumerate(self.chunks):
            slot = self.slots[0]
            slot[:self.file_bytes[k]].zero_()
            for i in chunk:
                master, state = values[i]
                self.view(slot, i, "master").copy_(master.reshape(-1))
                present = [key for key, _ in self.keys[i] if key in state]
                for key in present:
                    self.view(slot, i, key).copy_(state[key].reshape(-1))
                self.has_state[i] = bool(present) and len(present) == len(self.keys[i])
            self._slot_writes[0] = None
            self._write(k, slot)
        self.broken = None

    def close(self, remove: bool = False) -> None:
        """Stop the I/O threads (and delete the files with ``remove``)."""
        self._reader.shutdown(wait=True)
        self._writer.shutdown(wait=True)
        if remove:
            shutil.rmtree(self.folder, ignore_errors=True)
