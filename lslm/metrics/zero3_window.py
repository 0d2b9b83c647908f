"""ZeRO-3's gathered parameters at the step's peak, from the units' sizes: what freeing after forward saves.

Stage 3 (:mod:`lslm.zero.gather`) gathers the root (the parameters outside every unit) for the whole
step and each unit just before its forward, starting the next unit's gather at the same time (a
*prefetch window* of one unit ahead); with ``reshard_after_forward`` it frees the unit right after its
forward. A step's memory peaks where the activations are all alive and the first gradients arrive: at
the start of backward. There stage 3 holds the root, the unit whose backward runs first (the forward's
last) and the unit(s) prefetched behind it; ``reshard_after_forward=False`` ("keep") still holds every
unit gathered in the forward; stage 2 holds the whole parameters all the time but only a ``1/N`` slice
of them persists at stage 3. Everything else at that moment (activations, the first units' gradients
and staging buffers, optimizer states) is the same for the three, so the differences of their peaks
are differences of parameter bytes, predicted here:

* :func:`zero3_window_bytes` - ``root + current + prefetch``, the gathered bytes stage 3 holds at the peak
  (and the most it holds after any unit's forward);
* :func:`zero3_freed_bytes` - keep's peak minus stage 3's: every unit except the window;
* :func:`zero3_saving_vs_stage2` - stage 2's peak minus stage 3's: the whole parameters minus the slice
  stage 3 keeps and its window.

Bytes are of the padded unit buffers (each padded to a multiple of the rank count), as
``ZeroOptimizer.buckets`` lays them out. ``gather_copy``: whether the backend keeps a second copy of a
unit while its all-gather is in flight. gloo does (``ProcessGroupGloo``'s all-gather fills a new flat
tensor and copies it into the output; the work object holds that tensor until it is waited for, which
for a prefetched unit is its own forward or backward); NCCL writes into the output in place.
"""

from __future__ import annotations

from collections.abc import Sequence

__all__ = ["zero3_freed_bytes", "zero3_saving_vs_stage2", "zero3_window_bytes"]


def _check(unit_bytes: Sequence[int], prefetch: int) -> None:
    if isinstance(prefetch, bool) or not isinstance(prefetch, int) or prefetch < 0:
        raise ValueError(f"prefetch must be an int >= 0 (units gathered ahead of the current one), got {prefetch!r}")
    if not unit_bytes:
        raise ValueError("unit_bytes is empty: stage 3 needs at least one unit (e.g. the model's blocks)")


def zero3_window_bytes(unit_bytes: Sequence[int], root_bytes: int, prefetch: int = 1,
                       gather_copy: bool = False) -> int:
    """Gathered bytes stage 3 holds at the start of backward: the root, the forward's last unit (``unit_bytes``
    in forward order) and the ``prefetch`` units before it, whose gathers that unit's backward starts;
    ``gather_copy``: plus the copy the backend keeps of each prefetched unit until its gather is waited for."""
    _check(unit_bytes, prefetch)
    ahead = sum(unit_bytes[-1 - prefetch:-1]) if prefetch else 0
    return root_bytes + unit_bytes[-1] + ahead + (ahead if gather_copy else 0)


def zero3_freed_bytes(unit_bytes: Sequence[int], prefetch: int = 1, gather_copy: bool = False) -> int:
    """How far stage 3's step peak lies below ``reshard_after_forward=False``'s: the units it freed after their
    forward and has not gathered again when backward starts (every unit but the window; the root is in both),
    less, with ``gather_copy``, the backend's copies of the prefetched units (keep gathers nothing in backward)."""
    return sum(unit_bytes) - zero3_window_bytes(unit_bytes, 0, prefetch, gather_copy)


def zero3_saving_vs_stage2(stage2_param_bytes: int, stage3_param_bytes: int, world: int,
                           unit_bytes: Sequence[int], root_bytes: int, prefetch: int = 1,
                           gather_copy: bool = False) -> int:
    """How far stage 3's step peak lies below stage 2's: stage 2's whole (padded) parameter buffer against stage
    3's ``1/world`` slice of its own padded layout (``stage3_param_bytes``: units and root) and its window
    (:func:`zero3_window_bytes`). Assumes the gradients in flight at the peak cost both stages alike."""
    if isinstance(world, bool) or not isinstance(world, int) or world < 1:
        raise ValueError(f"world must be an int >= 1, got {world!r}")
    return (stage2_param_bytes - stage3_param_bytes // world
            - zero3_window_bytes(unit_bytes, root_bytes, prefetch, gather_copy))
