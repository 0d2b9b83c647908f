"""Which elements of a flat, padded buffer a data-parallel rank owns, and which parameter each belongs to.

ZeRO (Rajbhandari et al. 2020, §5) partitions the optimizer states, gradients and parameters
of a data-parallel group into ``N_d`` equal parts. lslm partitions the gradient buffer
(:class:`~lslm.data_parallel.grad_buffer.GradBuffer`) bucket by bucket, as Megatron-LM's
distributed optimizer does: every bucket's length is a multiple of ``N_d`` (its padding says
by how much it was rounded up), and rank ``r`` owns the ``r``-th of ``N_d`` equal, contiguous
slices of each bucket. A slice is what one ``reduce_scatter`` hands a rank and what one
``all_gather`` collects from it, so both run in place on the bucket with no copy.

A slice cuts through parameters: a rank owns *pieces* of some of them (a whole small one,
the middle of a big one, nothing of another). A :class:`Piece` says which parameter, which
elements of it and where they sit in the buffer; the optimizer steps the pieces, so its
per-parameter choices (weight decay on matrices only) still follow the parameter.
PyTorch's FSDP2 shards otherwise, each parameter along its dim 0 into ``N_d`` chunks
(:func:`fsdp_padding` counts what that costs in padding).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from lslm.data_parallel.buckets import layout_groups

__all__ = ["Piece", "ShardLayout", "fsdp_padding", "shard_layout", "unit_layout"]


@dataclass(frozen=True)
class Piece:
    """Elements ``[start, stop)`` (flattened) of parameter ``param``, at ``[offset, offset + numel)`` of the buffer."""

    param: int
    bucket: int
    start: int
    stop: int
    offset: int

    @property
    def numel(self) -> int:
        """Elements in the piece."""
        return self.stop - self.start


@dataclass(frozen=True)
class ShardLayout:
    """Rank ``rank``'s slices of a buffer over ``world`` ranks: ``shards[b] = (start, end)`` for bucket ``b``
    and the :class:`Piece` s of parameters inside them (padding belongs to no piece)."""

    rank: int
    world: int
    shards: tuple[tuple[int, int], ...]
    pieces: tuple[Piece, ...]

    @property
    def numel(self) -> int:
        """Elements this rank owns, padding included (every rank owns the same number)."""
        return sum(end - start for start, end in self.shards)

    @property
    def param_numel(self) -> int:
        """Elements of parameters this rank owns (its slices without their padding)."""
        return sum(p.numel for p in self.pieces)


def shard_layout(buckets: Sequence[tuple[int, int, Sequence[int]]], offsets: Sequence[int], numels: Sequence[int],
                 rank: int, world: int) -> ShardLayout:
    """Rank ``rank``'s slices and pieces for ``buckets`` (``(start, end, parameter indices)`` each).

    ``offsets[i]`` / ``numels[i]``: where parameter ``i`` starts in the buffer and its size.
    Raises ``ValueError`` if a bucket's length is not a multiple of ``world`` (pad the buffer
    to it: ``GradBuffer(pad_to=world)``) or ``rank`` is outside ``[0, world)``.
    """
    if not 0 <= rank < world:
        raise ValueError(f"rank {rank} is outside a data-parallel group of {world}")
    shards, pieces = [], []
    for b, (start, end, params) in enumerate(buckets):
        if (end - start) % world:
            raise ValueError(f"bucket {b} has {end - start} elements, not a multiple of the {world} ranks that share "
                             f"it: build the gradient buffer with pad_to={world}")
        size = (end - start) // world
        lo, hi = start + rank * size, start + (rank + 1) * size
        shards.append((lo, hi))
        for i in params:
            a, z = max(lo, offsets[i]), min(hi, offsets[i] + numels[i])
            if a < z:
                pieces.append(Piece(i, b, a - offsets[i], z - offsets[i], a))
    return ShardLayout(rank, world, tuple(shards), tuple(pieces))


def unit_layout(groups: Sequence[Sequence[int]], numels: Sequence[int],
                world: int) -> tuple[list[int], list[tuple[int, int, list[int], int]], int]:
    """A flat layout with one bucket per group of parameters (ZeRO-3's units: a block, the rest of the model).

    ``groups[b]``: the parameter indices of bucket ``b``, laid out in that order; each bucket is
    padded to a multiple of ``world``. Returns ``(offsets, buckets, numel)`` in the form of
    :func:`lslm.data_parallel.buckets.flat_layout`.
    """
    return layout_groups(groups, numels, world)


def fsdp_padding(shapes: Sequence[Sequence[int]], world: int) -> int:
    """Elements FSDP2 adds when it chunks each parameter along dim 0 into ``world`` equal shards.

    A parameter with ``d0`` rows of ``r`` elements is stored as ``world`` shards of
    ``ceil(d0 / world)`` rows each, so it is padded by ``(world * ceil(d0 / world) - d0) * r``
    elements; a 0-d parameter counts as one row of one element.
    """
    total = 0
    for shape in shapes:
        rows = shape[0] if len(shape) else 1
        row = 1
        for d in shape[1:]:
            row *= d
        total += (world * -(-rows // world) - rows) * row
    return total
