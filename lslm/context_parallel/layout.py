"""How a sequence is split over the ``cp`` ranks, and how much attention work each rank gets.

Two layouts. ``contiguous``: the sequence is cut into ``cp`` equal chunks and rank ``i``
holds chunk ``i``. ``zigzag``: it is cut into ``2·cp`` chunks and rank ``i`` holds chunks
``i`` and ``2·cp − 1 − i`` (the load balancing of ring-flash-attention and Megatron-LM's
context parallelism). Under a causal mask the contiguous layout is unbalanced: the last
rank's queries see the whole sequence and the first rank's only their own chunk, so every
ring step waits for the slowest rank; zig-zag pairs an early chunk with a late one, so
every rank does the same number of score entries. :func:`attention_work` counts them.

Everything here is pure arithmetic on positions (no process group): the notebook prints
it and the ring schedule (:mod:`lslm.context_parallel.ring`) is built from :func:`chunk_ids`.
"""

from __future__ import annotations

import torch

__all__ = ["LAYOUTS", "attention_work", "check_sequence", "chunk_ids", "local_positions", "num_chunks",
           "shard_sequence"]

LAYOUTS = ("contiguous", "zigzag")


def _check_layout(layout: str) -> None:
    if layout not in LAYOUTS:
        raise ValueError(f"layout must be one of {LAYOUTS}, got {layout!r}")


def num_chunks(cp: int, layout: str) -> int:
    """How many equal chunks the sequence is cut into: ``cp`` (contiguous) or ``2·cp`` (zigzag)."""
    _check_layout(layout)
    return cp if layout == "contiguous" else 2 * cp


def chunk_ids(rank: int, cp: int, layout: str) -> list[int]:
    """The chunks rank ``rank`` of ``cp`` holds, in the order they sit in its local slice."""
    if not 0 <= rank < cp:
        raise ValueError(f"rank {rank} is outside [0, {cp})")
    return [rank] if num_chunks(cp, layout) == cp else [rank, 2 * cp - 1 - rank]


def check_sequence(seq_len: int, cp: int, layout: str) -> int:
    """Refuse a sequence the layout cannot split evenly; return the chunk length.

    No padding: a padded position would need its own mask and loss weight, and a silently
    padded sequence is how context-parallel gradients go wrong. Pad (or trim) the data instead.
    """
    if cp < 1:
        raise ValueError(f"cp must be >= 1, got {cp}")
    n = num_chunks(cp, layout)
    if seq_len < n or seq_len % n:
        rule = f"cp = {cp}" if layout == "contiguous" else f"2·cp = {2 * cp} (zig-zag cuts 2·cp chunks)"
        raise ValueError(f"sequence length {seq_len} is not divisible by {rule}: context parallelism gives every "
                         f"rank equal chunks and does not pad; use a length that is a multiple of {n} "
                         f"(e.g. {max(n, seq_len - seq_len % n)})")
    return seq_len // n


def local_positions(seq_len: int, cp: int, rank: int, layout: str,
                    device: torch.device | str | None = None) -> torch.Tensor:
    """The global positions of rank ``rank``'s tokens, in local order (an int64 tensor on ``device``)."""
    c = check_sequence(seq_len, cp, layout)
    return torch.cat([torch.arange(i * c, (i + 1) * c, device=device) for i in chunk_ids(rank, cp, layout)])


def shard_sequence(x: torch.Tensor, dim: int, cp: int, rank: int, layout: str) -> torch.Tensor:
    """Rank ``rank``'s slice of ``x`` along the sequence dimension ``dim`` (a copy for zig-zag)."""
    seq_len = x.shape[dim]
    c = check_sequence(seq_len, cp, layout)
    return torch.cat([x.narrow(dim, i * c, c) for i in chunk_ids(rank, cp, layout)], dim=dim)


def attention_work(seq_len: int, cp: int, layout: str, causal: bool = True) -> dict[str, list[int]]:
    """Attention work per rank: unmasked score entries and block pairs computed (per head, per sequence).

    A block pair is one (query chunk, key/value chunk) product the ring computes; under a
    causal mask, pairs whose keys all lie after the queries are skipped, and a diagonal pair
    counts only its lower triangle (``c·(c+1)/2`` entries of ``c²``). The total is the same
    in both layouts (``T·(T+1)/2`` causal, ``T²`` not); what changes is how evenly it is spread.
    """
    c = check_sequence(seq_len, cp, layout)
    entries, pairs = [], []
    everyone = [chunk_ids(r, cp, layout) for r in range(cp)]
    for mine in everyone:
        e = p = 0
        for qi in mine:
            for kvs in everyone:
                for kj in kvs:
                    if not causal or kj < qi:
                        e, p = e + c * c, p + 1
                    elif kj == qi:
                        e, p = e + c * (c + 1) // 2, p + 1
        entries.append(e)
        pairs.append(p)
    return {"entries": entries, "block_pairs": pairs}
