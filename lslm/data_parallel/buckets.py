"""Bucket planning: which gradients travel together in one all-reduce.

A pure function (no processes, no tensors) so it can be tested and plotted on its
own. :class:`~lslm.data_parallel.ddp.fused.FusedDDP`,
:class:`~lslm.data_parallel.ddp.bucketed.BucketedDDP` and the gradient buffers
(:class:`~lslm.data_parallel.grad_buffer.GradBuffer`) all use it.

Order: **reverse** ``module.parameters()`` order. Backward visits layers roughly in
reverse of forward, so the last layer's gradients are ready first; putting them in
the first bucket lets that bucket's all-reduce start while the earlier layers are
still being differentiated (Li et al. 2020, §3.2.3). Torch's DDP does the same
(and then re-plans from the order observed in the first iteration; we do not).
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence


def cap_bytes(bucket_cap_mb: float) -> int:
    """``bucket_cap_mb`` (MiB, as in torch DDP) in bytes; raises ``ValueError`` unless it is a number > 0."""
    if isinstance(bucket_cap_mb, bool) or not isinstance(bucket_cap_mb, (int, float)) or not bucket_cap_mb > 0:
        raise ValueError(f"bucket_cap_mb must be a number > 0 (MiB per bucket), got {bucket_cap_mb!r}")
    return max(1, int(bucket_cap_mb * 2**20))


def plan_buckets(nbytes: Sequence[int], cap: int, keys: Sequence[Hashable] | None = None) -> list[list[int]]:
    """Group tensors ``0 .. len(nbytes)-1`` into buckets of at most ``cap`` bytes, in reverse index order.

    * A bucket is closed when the next tensor would push it over ``cap``, so a tensor
      larger than ``cap`` sits alone in its own bucket (it cannot be split).
    * ``keys`` (e.g. ``(dtype, device)`` per tensor): tensors with different keys never
      share a bucket, since one flat buffer has one dtype and lives on one device.

    Returns lists of indices; bucket 0 holds the *last* tensors.
    """
    if cap < 1:
        raise ValueError(f"cap must be >= 1 byte, got {cap}")
    keys = list(keys) if keys is not None else [None] * len(nbytes)
    if len(keys) != len(nbytes):
        raise ValueError(f"{len(keys)} keys for {len(nbytes)} tensors")
    buckets: list[list[int]] = []
    current: list[int] = []
    size = 0
    for i in reversed(range(len(nbytes))):
        if current and (size + nbytes[i] > cap or keys[i] != keys[current[0]]):
            buckets.append(current)
            current, size = [], 0
        current.append(i)
        size += nbytes[i]
    if current:
        buckets.append(current)
    return buckets


def flat_layout(extents: Sequence[int], itemsize: int, cap: int | None,
                pad_to: int = 1) -> tuple[list[int], list[tuple[int, int, list[int], int]], int]:
    """Where each of ``extents`` (elements per tensor) sits in one flat buffer cut into padded buckets.

    Buckets by :func:`plan_buckets` (reverse order, at most ``cap`` bytes; ``None``: one
    bucket), laid out one after the other; each bucket's length is rounded up to a multiple of
    ``pad_to`` elements. Returns ``(offsets, buckets, numel)``: ``offsets[i]`` where tensor ``i``
    starts, ``buckets`` as ``(start, end, tensor indices, padding)``, ``numel`` the total
    (padding included). The gradient buffer and ZeRO's sharded buffers share this rule.
    """
    if not isinstance(pad_to, int) or isinstance(pad_to, bool) or pad_to < 1:
        raise ValueError(f"pad_to must be an int >= 1, got {pad_to!r}")
    sizes = [n * itemsize for n in extents]
    return layout_groups(plan_buckets(sizes, cap if cap is not None else max(1, sum(sizes))), extents, pad_to)


def layout_groups(groups: Sequence[Sequence[int]], extents: Sequence[int],
                  pad_to: int = 1) -> tuple[list[int], list[tuple[int, int, list[int], int]], int]:
    """Lay ``groups`` of tensor indices out one bucket after the other, each padded to a multiple of ``pad_to``.

    The result has :func:`flat_layout`'s form; ZeRO-3 uses it with one group per unit (a block).
    """
    offsets = [0] * len(extents)
    buckets = []
    position = 0
    for idx in groups:
        start = position
        for i in idx:
            offsets[i] = position
            position += extents[i]
        padded = -(-(position - start) // pad_to) * pad_to
        buckets.append((start, start + padded, list(idx), padded - (position - start)))
        position = start + padded
    return offsets, buckets, position
