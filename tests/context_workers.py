"""Workers for tests/test_context.py: groups, mesh and ledger of a real ParallelContext, in one launch.

One launch checks several grid shapes: after ``init_distributed()`` (the default
grid, dp = world) the worker builds one more ParallelContext per shape on the same
world (``ParallelContext.create`` only creates groups) and all-gathers the global
ranks inside every axis combination, so membership is what the processes *see*,
not what the grid says.
"""

from __future__ import annotations

import itertools
from typing import Any

import torch
import torch.distributed as dist

from lslm.runtime import AXES, ParallelContext, RankGrid, init_distributed

COMBOS = [c for k in range(1, len(AXES) + 1) for c in itertools.combinations(AXES, k)]


def _members(ctx: ParallelContext, group: Any) -> list[int]:
    n = dist.get_world_size(group)
    mine = torch.tensor([ctx.rank], device=ctx.device)
    gathered = [torch.zeros(1, dtype=torch.long, device=ctx.device) for _ in range(n)]
    ctx.comm.all_gather(gathered, mine, group=group, label="members")
    return [int(t.item()) for t in gathered]


def _shape_report(ctx: ParallelContext) -> dict[str, Any]:
    mesh = ctx.mesh
    return {**ctx.describe(), "pp_prev": ctx.pp_prev_rank, "pp_next": ctx.pp_next_rank,
            "members": {",".join(c): _members(ctx, ctx.group(*c)) for c in COMBOS},
            "names": {",".join(c): ctx.comm.group_name(ctx.group(*c)) for c in COMBOS},
            "mesh_coords": list(mesh.get_coordinate()), "mesh_shape": list(mesh.shape),
            "mesh_dims": list(mesh.mesh_dim_names),
            "mesh_groups": {a: dist.get_process_group_ranks(mesh.get_group(a)) for a in AXES}}


def _ledger_volumes(ctx: ParallelContext, numel: int) -> dict[str, bool]:
    """Every wrapped collective and p2p op once, on ctx.device, with completion times; a correctness flag per op."""
    n, r, comm, dev = ctx.world_size, ctx.rank, ctx.comm, ctx.device
    comm.ledger.record_completion = True  # the test checks every record's completion time
    ok: dict[str, bool] = {}
    x = torch.full((numel,), float(r + 1), device=dev)
    comm.all_reduce(x)
    ok["all_reduce"] = bool(torch.all(x == n * (n + 1) / 2))
    b = torch.full((numel,), float(r), device=dev)
    comm.broadcast(b, src=0)
    ok["broadcast"] = bool(torch.all(b == 0))
    ramp = torch.arange(n, device=dev).repeat_interleave(numel).float()
    out = torch.empty(numel * n, device=dev)
    comm.all_gather_into_tensor(out, torch.full((numel,), float(r), device=dev))
    ok["all_gather"] = bool(torch.equal(out, ramp))
    rs_out = torch.empty(numel, device=dev)
    comm.reduce_scatter_tensor(rs_out, ramp)
    ok["reduce_scatter"] = bool(torch.all(rs_out == r * n))
    a2a_out = torch.empty(numel * n, device=dev)
    comm.all_to_all_single(a2a_out, torch.full((numel * n,), float(r), device=dev))
    ok["all_to_all"] = bool(torch.equal(a2a_out, ramp))
    # p2p around the ring, paired in one batch (a 2-rank ring sends to and receives from one peer).
    send_buf, recv_buf = torch.full((numel,), float(r), device=dev), torch.empty(numel, device=dev)
    nxt, prv = (r + 1) % n, (r - 1) % n
    works = comm.batch_isend_irecv([dist.P2POp(dist.irecv, recv_buf, prv), dist.P2POp(dist.isend, send_buf, nxt)],
                                   label="ring")
    for w in works:
        w.wait()
    ok["send_recv"] = bool(torch.all(recv_buf == prv))
    # An asynchronous all-reduce on the data-parallel group: completion comes from the work.
    y = torch.ones(numel, device=dev)
    comm.all_reduce(y, group=ctx.dp_group, async_op=True, label="async").wait()
    ok["async"] = bool(torch.all(y == ctx.dp_size))
    return ok


def context_checks(numel: int = 1000, shapes: list[dict[str, int]] | None = None) -> dict[str, Any]:
    """Ledger volumes and times on the default grid, then groups and mesh for each of ``shapes``."""
    with init_distributed() as ctx:
        ok = _ledger_volumes(ctx, numel)
        out: dict[str, Any] = {"ok": ok, "summary": ctx.comm.ledger.summary(), "records": ctx.comm.ledger.to_list(),
                               "shapes": []}
        for shape in shapes or []:
            grid = RankGrid.build(ctx.world_size, **shape)
            other = ParallelContext.create(grid, rank=ctx.rank, local_rank=ctx.local_rank, node_rank=ctx.node_rank,
                                           device=ctx.device, backend=ctx.backend, timeout_s=ctx.timeout_s)
            out["shapes"].append(_shape_report(other))
        return out


def with_grid_cycle(grids: list[dict[str, int]]) -> dict[str, Any]:
    """``with_grid`` through ``grids`` in turn (each replacing the last, grids repeating), with every
    axis combination's members seen by an all-gather in each: groups destroyed and made again must work."""
    with init_distributed() as ctx:
        seen = []
        for sizes in grids:
            sub = ctx.with_grid(**sizes)
            seen.append({",".join(c): _members(sub, sub.group(*c)) for c in COMBOS})
        return {"rank": ctx.rank, "members": seen}
