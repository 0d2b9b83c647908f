"""ZeRO-Infinity-style disk offload: a rank's fp32 masters and optimizer states live in files between steps.

Rajbhandari et al. 2021 (ZeRO-Infinity, §5) move the optimizer's model states to NVMe and
stream them through memory during the step. Here a rank's pieces (:class:`~lslm.zero.layout.Piece`)
are grouped into *chunks* of at most ``chunk_bytes`` of states (fp32 master + the optimizer's
per-element tensors: 12 bytes per element with Adam), one file per chunk. The step walks the
chunks in order: a reader thread loads chunk ``k + 1`` while chunk ``k`` is stepped (read
ahead), and a writer thread saves chunk ``k`` while ``k + 1`` is stepped (write behind); all
writes are finished before the step returns. So at most about three chunks of states are in
memory at once instead of all of them: the rank's resident optimizer memory no longer grows
with its share of the model, only with the chunk size, at the price of reading and writing
every state byte once per step (:attr:`DiskStates.bytes_moved`).

Between steps a master is an empty tensor (its identity stays, the optimizer's key) and its
optimizer state holds only scalars (Adam's ``step``).
"""

from __future__ import annotations

import shutil
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

import torch

__all__ = ["DiskStates"]


def _is_elementwise(value: Any, numel: int) -> bool:
    return isinstance(value, torch.Tensor) and value.dim() == 1 and value.numel() == numel


class DiskStates:
    """The files of one rank's masters and optimizer states, and the chunked, overlapped walk over them."""

    def __init__(self, folder: str | Path, masters: Sequence[torch.Tensor], chunk_bytes: int) -> None:
        self.folder = Path(folder)
        try:
            self.folder.mkdir(parents=True, exist_ok=True)
            probe = self.folder / ".lslm-write-test"
            probe.write_bytes(b"x")
            probe.unlink()
        except OSError as e:
            raise ValueError(f"the disk offload folder {self.folder} is not writable: {e}") from e
        if chunk_bytes < 1:
            raise ValueError(f"chunk_bytes must be >= 1, got {chunk_bytes}")
        self.masters = list(masters)
        self.chunks: list[list[int]] = []
        size = 0
        for i, m in enumerate(self.masters):
            nbytes = 12 * m.numel()  # master + two Adam moments, what a chunk holds in memory
            if not self.chunks or size + nbytes > chunk_bytes:
                self.chunks.append([])
                size = 0
            self.chunks[-1].append(i)
            size += nbytes
        self.numels = [m.numel() for m in self.masters]
        self.empty = torch.empty(0, dtype=torch.float32, device=self.masters[0].device if self.masters else "cpu")
        #: Bytes read from and written to the files by the last step.
        self.bytes_moved = {"from_disk": 0, "to_disk": 0}
        self._reader = ThreadPoolExecutor(max_workers=1, thread_name_prefix="lslm-zero-read")
        self._writer = ThreadPoolExecutor(max_workers=1, thread_name_prefix="lslm-zero-write")
        for k in range(len(self.chunks)):  # the masters' first values go to disk at once; no state yet
            self._save(k, {i: (self.masters[i].detach().clone(), {}) for i in self.chunks[k]})
        for m in self.masters:
            m.data = self.empty

    def _path(self, k: int) -> Path:
        return self.folder / f"chunk{k:05d}.pt"

    def _save(self, k: int, values: dict[int, tuple[torch.Tensor, dict[str, Any]]]) -> int:
        payload = {str(i): {"master": m, "state": st} for i, (m, st) in values.items()}
        try:
            torch.save(payload, self._path(k))
        except OSError as e:  # a full disk: say which file, the step that wrote it fails loudly
            raise OSError(f"writing the offloaded optimizer states to {self._path(k)} failed: {e}") from e
        return self._path(k).stat().st_size

    def _load(self, k: int) -> tuple[dict[int, tuple[torch.Tensor, dict[str, Any]]], int]:
        payload = torch.load(self._path(k), weights_only=True)
        return {int(i): (v["master"], v["state"]) for i, v in payload.items()}, self._path(k).stat().st_size

    def walk(self, optimizer_state: dict[Any, dict[str, Any]],
             step_chunk: Callable[[list[int]], None]) -> None:
        """Bring each chunk in (masters and states installed), call ``step_chunk(indices)``, write it back.

        Reads run one chunk ahead and writes one chunk behind; everything is on disk again when
        this returns (each master empty, its state reduced to its scalars).
        """
        self.bytes_moved = {"from_disk": 0, "to_disk": 0}
        if not self.chunks:
            return
        ahead: Future[Any] = self._reader.submit(self._load, 0)
        writes: list[Future[int]] = []
        for k, chunk in enumerate(self.chunks):
            values, nbytes = ahead.result()
            self.bytes_moved["from_disk"] += nbytes
            if k + 1 < len(self.chunks):
                ahead = self._reader.submit(self._load, k + 1)
            for i in chunk:
                master, state = values[i]
                self.masters[i].data = master
                if state:
                    optimizer_state[self.masters[i]] = state
            step_chunk(chunk)
            out = {}
            for i in chunk:
                m = self.masters[i]
                state = optimizer_state.get(m, {})
                out[i] = (m.detach(), dict(state))
                # Keep only the scalars resident (Adam's step); the per-element tensors leave with the write.
                optimizer_state[m] = {key: v for key, v in state.items() if not _is_elementwise(v, self.numels[i])}
                m.data = self.empty
            writes.append(self._writer.submit(self._save, k, out))
        for w in writes:
            self.bytes_moved["to_disk"] += w.result()  # re-raises a failed write here, in the step

    def read_all(self) -> list[tuple[torch.Tensor, dict[str, Any]]]:
        """Every piece's master and full optimizer state, read from the files (for checkpoints)."""
        out: list[Any] = [None] * len(self.masters)
        for k in range(len(self.chunks)):
            values, _ = self._load(k)
            for i, v in values.items():
                out[i] = v
        return out

    def write_all(self, values: Sequence[tuple[torch.Tensor, dict[str, Any]]]) -> None:
        """Replace every piece's master and state on disk (a checkpoint loaded)."""
        for k, chunk in enumerate(self.chunks):
            self._save(k, {i: (values[i][0].detach().clone(), dict(values[i][1])) for i in chunk})

    def close(self, remove: bool = False) -> None:
        """Stop the I/O threads (and delete the files with ``remove``)."""
        self._reader.shutdown(wait=True)
        self._writer.shutdown(wait=True)
        if remove:
            shutil.rmtree(self.folder, ignore_errors=True)
