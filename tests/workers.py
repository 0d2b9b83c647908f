"""Worker functions used only by the tests (launched through tests.helpers.run_workers)."""

from __future__ import annotations

import os
import signal
import time
from typing import Any

import torch
import torch.distributed as dist

from lslm.runtime import init_distributed


def group_members(tp: int = 1, pp: int = 1) -> dict[str, Any]:
    """All-gather global ranks inside each of this rank's groups; report what each group holds."""
    with init_distributed(tp=tp, pp=pp) as ctx:
        out: dict[str, Any] = {**ctx.describe(), "pp_prev": ctx.pp_prev_rank, "pp_next": ctx.pp_next_rank}
        for kind in ("tp", "dp", "pp"):
            group = getattr(ctx, f"{kind}_group")
            n = dist.get_world_size(group)
            mine = torch.tensor([ctx.rank])
            gathered = [torch.zeros(1, dtype=torch.long) for _ in range(n)]
            ctx.comm.all_gather(gathered, mine, group=group)
            out[f"{kind}_members"] = [int(t.item()) for t in gathered]
        return out


def ledger_volumes(numel: int = 1000) -> dict[str, Any]:
    """Call every wrapped collective and p2p op once; return the ledger and a correctness flag per op."""
    with init_distributed() as ctx:
        n, r, comm = ctx.world_size, ctx.rank, ctx.comm
        ok: dict[str, bool] = {}
        x = torch.full((numel,), float(r + 1))
        comm.all_reduce(x)
        ok["all_reduce"] = bool(torch.all(x == n * (n + 1) / 2))
        b = torch.full((numel,), float(r))
        comm.broadcast(b, src=0)
        ok["broadcast"] = bool(torch.all(b == 0))
        out = torch.empty(numel * n)
        comm.all_gather_into_tensor(out, torch.full((numel,), float(r)))
        ok["all_gather"] = bool(torch.equal(out, torch.arange(n).repeat_interleave(numel).float()))
        rs_out = torch.empty(numel)
        comm.reduce_scatter_tensor(rs_out, torch.arange(n).repeat_interleave(numel).float())
        ok["reduce_scatter"] = bool(torch.all(rs_out == r * n))
        a2a_out = torch.empty(numel * n)
        comm.all_to_all_single(a2a_out, torch.full((numel * n,), float(r)))
        ok["all_to_all"] = bool(torch.equal(a2a_out, torch.arange(n).repeat_interleave(numel).float()))
        # p2p in a ring, ordered so it cannot deadlock: even ranks send first, odd ranks receive first.
        send_buf, recv_buf = torch.full((numel,), float(r)), torch.empty(numel)
        nxt, prv = (r + 1) % n, (r - 1) % n
        if r % 2 == 0:
            comm.send(send_buf, nxt)
            comm.recv(recv_buf, prv)
        else:
            comm.recv(recv_buf, prv)
            comm.send(send_buf, nxt)
        ok["send_recv"] = bool(torch.all(recv_buf == prv))
        return {"ok": ok, "summary": ctx.comm.ledger.summary(), "records": ctx.comm.ledger.to_list()}


def kill_rank(rank: int = 1, sig: int = int(signal.SIGKILL)) -> None:
    """Rank ``rank`` sends itself ``sig`` (as the out-of-memory killer would) while its peers wait in a
    barrier; the peers then fail with "connection closed by peer", a consequence, not the cause."""
    with init_distributed() as ctx:
        if ctx.rank == rank:
            print("about to die", flush=True)
            time.sleep(0.2)  # let the peers reach the barrier
            os.kill(os.getpid(), sig)
            time.sleep(60)  # a signal that does not kill: the launcher's timeout ends it
        ctx.barrier()


def needs_steps(steps: int, lr: float = 0.1) -> int:
    """A worker with a required argument (only its signature matters: the launch is refused before starting)."""
    return steps
