"""Workers for tests/test_pipeline_torch_reference.py: torch's pipelining schedules on lslm's GPT stages vs serial.

One launch loops over cases (processes start once: the machine's 2 cores are shared).
Each case is ``(pp, schedule, microbatches, virtual_stages)``; a case whose ``pp`` is
smaller than the world runs ``dp = world / pp`` replicas, each on its half of the batch,
and :meth:`TorchPipeline.step` averages gradients over them. Every rank computes the serial
loss and gradients itself (same seed, same global batch) and reports, per case, the loss
error, the largest relative gradient error over its parameters and their names.
:func:`side_by_side` runs lslm's executor next to torch's twin schedule instead.
"""

from __future__ import annotations

import traceback
from typing import Any

import torch

from lslm.models.gpt import GPT
from lslm.pipeline.apply import PipelinePlan, apply_pipeline
from lslm.pipeline.torch_reference import TorchPipeline
from lslm.runtime import init_distributed
from lslm.runtime.context import ParallelContext
from lslm.runtime.grid import RankGrid
from tests.pipeline_workers import SEED, config, serial
from tests.pipeline_workers import batch as shared_batch

ROWS = 16  # 16 rows: m = 8 micro-batches of 2


def batch() -> tuple[torch.Tensor, torch.Tensor]:
    """A fixed global batch of token ids and next-token targets (16 rows)."""
    return shared_batch(ROWS)


def _context(ctx: ParallelContext, pp: int, cache: dict[int, ParallelContext]) -> ParallelContext:
    """A ``pp x dp`` context over ``ctx``'s processes (groups made once per grid, collectively)."""
    if pp not in cache:
        grid = RankGrid.build(ctx.world_size, pp=pp)
        cache[pp] = ctx if grid.sizes == ctx.grid.sizes else ParallelContext.create(
            grid, rank=ctx.rank, local_rank=ctx.local_rank, node_rank=ctx.node_rank, device=ctx.device,
            backend=ctx.backend, timeout_s=ctx.timeout_s, comm=ctx.comm)
    return cache[pp]


def run_case(ctx: ParallelContext, x: torch.Tensor, y: torch.Tensor, schedule: str, m: int, v: int | None,
             scale_grads: bool = True, stale: dict[str, torch.Tensor] | None = None,
             ) -> tuple[float, dict[str, torch.Tensor], dict[str, Any]]:
    """One torch step of this replica's rows; (global mean loss, this rank's grads by GPT name, description).

    ``stale``: gradients left in ``.grad`` before the step (by GPT name) instead of zeros.
    """
    torch.manual_seed(SEED)
    pipe = TorchPipeline(GPT(config()), ctx, schedule, m, v, scale_grads=scale_grads)
    rows = x.shape[0] // ctx.dp_size
    xr, yr = (t[ctx.dp_rank * rows:(ctx.dp_rank + 1) * rows] for t in (x, y))
    for n, p in pipe.named_parameters():
        p.grad = stale[n].to(p.device, copy=True) if stale is not None else None
    loss = pipe.step(xr, yr).detach().reshape(1).clone()
    if ctx.dp_size > 1:  # the replicas' losses: the global mean is their mean (equal rows)
        ctx.comm.all_reduce(loss, group=ctx.group("dp"), label="test loss")
        loss /= ctx.dp_size
    # On the CPU, where the serial reference is.
    grads = {n: p.grad.detach().to("cpu", copy=True) for n, p in pipe.named_parameters() if p.grad is not None}
    names = [n for n, _ in pipe.named_parameters()]
    return loss.item(), grads, {**pipe.describe(), "names": names}


def check(cases: list[list[Any]]) -> dict[str, Any]:
    """Run every ``[pp, schedule, m, v]`` or ``[pp, schedule, m, v, option]`` case; per case the errors against the
    serial step (or the error text).

    ``option`` ``"sum"``: ``scale_grads=False``, the gradients compared after dividing by ``m``;
    ``"stale"``: ``.grad`` holds the serial gradient before the step (not zeroed), compared
    with ``(1 + 1/m)`` times it (torch divides what was there too).
    """
    x, y = batch()
    want_loss, want = serial(x, y)
    out: dict[str, Any] = {}
    with init_distributed() as world:
        torch.set_num_threads(1)
        cache: dict[int, ParallelContext] = {}
        for pp, schedule, m, v, *option in cases:
            opt = option[0] if option else ""
            key = f"p{pp}-{schedule}-m{m}-v{v}" + (f"-{opt}" if opt else "")
            ctx = _context(world, pp, cache)
            try:
                loss, grads, info = run_case(ctx, x, y, schedule, m, v, scale_grads=opt != "sum",
                                             stale=want if opt == "stale" else None)
                factor = {"sum": 1.0 / m, "stale": m / (m + 1.0)}.get(opt, 1.0)
                grads = {n: g * factor for n, g in grads.items()}
            except Exception as exc:  # a schedule that fails on this backend: report it, run the others
                out[key] = {"error": f"{type(exc).__name__}: {exc}", "trace": traceback.format_exc()[-2000:]}
                world.comm.barrier(label="test resync")
                continue
            worst = 0.0
            for n, g in grads.items():
                r = want[n]
                worst = max(worst, ((g - r).abs().max() / r.abs().max().clamp_min(1e-30)).item())
            out[key] = {"loss": loss, "want_loss": want_loss, "grad_rel_err": worst,
                        "missing_grads": sorted(set(info["names"]) - set(grads)), **info,
                        "pp_rank": ctx.pp_rank, "dp_rank": ctx.dp_rank}
            world.comm.barrier(label="test case end")
    return out


def side_by_side(pp: int, cases: list[list[Any]]) -> dict[str, Any]:
    """lslm's executor and torch's twin schedule on the same stages and batch, for each ``[schedule, m]`` case.

    The world is one pipeline of ``pp`` ranks. Per case (key ``"{schedule}-m{m}"``): both losses, the
    serial loss, the largest ``|lslm - torch|`` over this rank's gradients, and the largest serial gradient
    entry over them (the scale of the tolerance), as ``lslm.demos.pipeline_demo.torch_side_by_side_worker``
    reports for one ``m``; here several ``m`` share one launch.
    """
    x, y = batch()
    serial_loss, serial_grads = serial(x, y)
    out: dict[str, Any] = {}
    with init_distributed(pp=pp) as ctx:
        torch.set_num_threads(1)
        for schedule, m in cases:
            torch.manual_seed(SEED)
            ours = apply_pipeline(GPT(config()), ctx, PipelinePlan(schedule=schedule, microbatches=m))
            lslm_loss = ours.step(x, y).item()
            torch.manual_seed(SEED)
            theirs = TorchPipeline(GPT(config()), ctx, schedule, m, 1)
            torch_loss = theirs.step(x, y).item()
            a, b = dict(ours.named_parameters()), dict(theirs.named_parameters())
            assert a.keys() == b.keys()
            out[f"{schedule}-m{m}"] = {
                "lslm_loss": lslm_loss, "torch_loss": torch_loss, "serial_loss": serial_loss,
                "max_grad_diff_torch": max((a[n].grad - b[n].grad).abs().max().item() for n in a),
                "max_grad": max(serial_grads[n].abs().max().item() for n in a), "names": sorted(a)}
    return out
