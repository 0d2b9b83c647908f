"""Are the replicas really replicas? Bitwise fingerprints of tensors, compared across ranks.

Data parallelism is only correct while every rank holds *exactly* the same
parameters. :func:`fingerprints` hashes each tensor's bytes (a 64-bit BLAKE2b
digest: no tolerance, one flipped bit shows), and :func:`first_mismatch`
all-gathers those digests - ``8 x (number of tensors)`` bytes per rank, not the
tensors themselves - and names the first tensor on which two ranks disagree.
DDP uses it when ``broadcast_params=False``; tests call it after every step.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable
from typing import Any

import torch
import torch.distributed as dist

from lslm.runtime.ledger import Comm

CHECK_LABEL = "ddp-check"


def tensor_digest(t: torch.Tensor) -> int:
    """A signed 64-bit digest of ``t``'s dtype, shape and bytes (bitwise: ``-0.0`` and ``0.0`` differ)."""
    flat = t.detach().contiguous().reshape(-1)
    raw = flat.view(torch.uint8) if flat.numel() else flat.new_empty(0, dtype=torch.uint8)
    h = hashlib.blake2b(digest_size=8)
    h.update(f"{t.dtype}{tuple(t.shape)}".encode())
    h.update(raw.cpu().numpy().tobytes())
    return int.from_bytes(h.digest(), "little", signed=True)


def fingerprints(named: Iterable[tuple[str, torch.Tensor]]) -> tuple[list[str], list[int]]:
    """Names and digests of ``named`` tensors (e.g. ``module.named_parameters()``), in order."""
    names, digests = [], []
    for name, t in named:
        names.append(name)
        digests.append(tensor_digest(t))
    return names, digests


def first_mismatch(named: Iterable[tuple[str, torch.Tensor]], comm: Comm, group: Any = None,
                   device: torch.device | str | None = None) -> tuple[str, list[int]] | None:
    """All-gather the digests of ``named`` over ``group``; return ``(name, differing group ranks)`` or None.

    Collective: every rank of ``group`` must call it with the same tensors (names and
    order). ``device`` is where the small digest tensor lives (CUDA for NCCL; default
    ``comm.default_device(group)``). Every rank gets the same answer, so every rank
    can raise the same error.
    """
    names, digests = fingerprints(named)
    device = device if device is not None else comm.default_device(group)
    n = dist.get_world_size(group)
    count = torch.tensor([len(digests)], dtype=torch.int64, device=device)
    counts = [torch.empty_like(count) for _ in range(n)]
    comm.all_gather(counts, count, group=group, label=CHECK_LABEL)
    if len({int(c.item()) for c in counts}) != 1:
        return ("<number of tensors>", [int(c.item()) for c in counts])
    mine = torch.tensor(digests, dtype=torch.int64, device=device)
    everyone = [torch.empty_like(mine) for _ in range(n)]
    if digests:
        comm.all_gather(everyone, mine, group=group, label=CHECK_LABEL)
    if digests:
        table = torch.stack(everyone).cpu()
    else:
        table = torch.empty(n, 0, dtype=torch.int64)  # lslm: cpu-ok (host-side table, never sent)
    for j, name in enumerate(names):
        col = table[:, j]
        if not bool((col == col[0]).all()):
            return name, [r for r in range(n) if col[r] != col[0]]
    return None


def assert_same_across_ranks(module: torch.nn.Module, comm: Comm, group: Any = None, *,
                             buffers: bool = True, what: str = "parameters") -> None:
    """Raise ``AssertionError`` naming the first parameter (or buffer) that differs between ranks."""
    named = list(module.named_parameters())
    if buffers:
        named += list(module.named_buffers())
    device = named[0][1].device if named else None  # None: the comm's default device
    bad = first_mismatch(named, comm, group, device)
    if bad is not None:
        raise AssertionError(f"{what} differ across ranks: {bad[0]!r} differs on group ranks {bad[1]} from rank 0")
