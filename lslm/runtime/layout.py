"""The rank layout of a 3D grid, taught: each rank's coordinates and the ranks it shares a group with per axis.

:class:`~lslm.runtime.grid.RankGrid` numbers ranks with ``tp`` innermost::

    rank = ((pp_rank * dp + dp_rank) * cp + cp_rank) * tp + tp_rank

so a tensor-parallel group is ``tp`` *consecutive* ranks. Why that order (Megatron-LM's
default "tp-cp-ep-dp-pp"; torchtitan's mesh ``["pp", "dp", "cp", "tp"]`` is the same):

* **tp innermost.** Tensor parallelism communicates inside every layer, forward and backward
  (two all-reduces per block, or an all-gather and a reduce-scatter each under sequence
  parallelism), with the activations' full size, on the critical path: nothing else can run
  while a layer waits for them. Consecutive ranks are the GPUs of one node (a launcher gives
  node ``n`` the ranks ``n x gpus_per_node ...``), joined by the fastest links (NVLink), so TP
  is kept inside a node: ``tp <= gpus per node``.
* **cp next**: ring attention passes key/value blocks every layer too, but can overlap them
  with the attention of the block it holds.
* **dp outside them**: the gradient all-reduce (or ZeRO's reduce-scatter and all-gather) is
  once per step and overlaps the backward, so it tolerates the slower inter-node network.
* **pp outermost**: a pipeline sends only one activation (and its gradient) per micro-batch
  across each stage boundary, point to point: the least traffic, happy on any link.

:func:`rank_layout` gives the table (one row per rank: its coordinates and, per axis, the group
it belongs to); :func:`format_layout` prints it. ``rank_layout(RankGrid.build(8, tp=2, pp=2))``
shows ranks 0 and 1 as one tp group, ``{0, 2}`` a dp group and ``{0, 4}`` a pp group.

**HSDP** (``RankGrid(..., dp_shard=k)``, dp split into ``dp_replicate x dp_shard``, shard innermost): the rows
also give the two sub-coordinates and the ``dp_shard`` / ``dp_replicate`` groups. A shard group is ``k``
consecutive dp ranks (inside a node when ``k · cp · tp`` fits one), so the model states' frequent
reduce-scatter and all-gather stay on the fast links and only a ``1/k`` share of the gradients crosses nodes.
"""

from __future__ import annotations

from typing import Any

from lslm.runtime.grid import AXES, RankGrid

__all__ = ["format_layout", "rank_layout"]


def rank_layout(grid: RankGrid, axes: tuple[str, ...] | None = None) -> list[dict[str, Any]]:
    """One row per global rank: ``{"rank", "pp", "dp", "cp", "tp", "<axis> group": [ranks], ...}``.

    ``axes``: the axes whose groups to list (default: those of size > 1, innermost first, and all
    four coordinates are always given). A group is the ranks that differ from this one only along
    that axis (:meth:`RankGrid.group_of`), ascending.
    """
    shown = tuple(a for a in reversed(AXES) if grid.sizes[a] > 1) if axes is None else axes
    unknown = [a for a in shown if a not in AXES]
    if unknown:
        raise ValueError(f"unknown axis {unknown[0]!r}; the grid's axes are {AXES}")
    subs = ("dp_shard", "dp_replicate") if grid.hsdp and (axes is None or "dp" in shown) else ()
    return [{"rank": r, **grid.coords_of(r)._asdict(), **(grid.dp_coords(r) if subs else {}),
             **{f"{a} group": grid.group_of(r, a) for a in (*shown, *subs)}}
            for r in range(grid.world_size)]


def format_layout(grid: RankGrid, axes: tuple[str, ...] | None = None) -> str:
    """:func:`rank_layout` as a fixed-width text table, with a header naming the sizes (innermost last)."""
    rows = rank_layout(grid, axes)
    columns = list(rows[0])
    cells = [[", ".join(map(str, v)) if isinstance(v, list) else str(v) for v in row.values()] for row in rows]
    widths = [max(len(c), *(len(cell[i]) for cell in cells)) for i, c in enumerate(columns)]
    sizes = " x ".join(f"{a}={grid.sizes[a]}" for a in AXES)
    if grid.hsdp:
        sizes += f" (dp = dp_replicate={grid.dp_replicate} x dp_shard={grid.dp_shard})"
    lines = [f"{grid.world_size} ranks: {sizes} (tp innermost: consecutive ranks)",
             "  ".join(c.rjust(w) for c, w in zip(columns, widths))]
    lines += ["  ".join(cell.rjust(w) for cell, w in zip(row, widths)) for row in cells]
    return "\n".join(lines)
