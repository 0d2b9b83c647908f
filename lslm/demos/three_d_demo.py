"""Notebook 09's 3D run: TP (+SP) inside pipeline stages, DP or ZeRO-1 across, against one process.

:func:`suite` is a launch target (``lslm.launch("lslm.demos.three_d_demo:suite", nproc=8,
cases=[...])``); processes start once and run every case in turn (2 CPU cores are shared by 8
ranks). Every rank trains the serial GPT itself (same seed, same batches, fp32), then each case:
builds the GPT on the meta device, :func:`lslm.three_d.apply_3d` over the case's grid, trains
``STEPS`` steps of AdamW with global-norm clipping (plain data parallelism on per-stage gradient
buffers, or ZeRO-1), and reports its losses next to the serial run's, the largest parameter
difference (this rank's shards against the serial weights cut by ``apply_tensor_parallel`` on the
same tp rank, and the maximum over all ranks) and the bytes this rank sent per ledger axis.
With ``torch_native=[...]``, the same processes then train the same GPT on the same batches with
torch's own composition (DTensor TP, ``torch.distributed.pipelining``, FSDP2 on ``ctx.mesh``:
:mod:`lslm.demos.three_d_torch`), so the side-by-side costs no second start-up.
With ``traced={...}`` (the 3D recipe's settings and a ``trace`` folder), the same processes last train
:mod:`lslm.recipes.three_d` under ``torch.profiler`` (:func:`lslm.harness.entry.run_in_context`): the timeline of
one 3D step, each rank's compute and its dp, tp and pp collectives, again without a second start-up.
tests/three_d_workers.py runs the same code for tests/test_three_d.py.
"""

from __future__ import annotations

import time
from collections import Counter
from typing import Any

import torch
import torch.distributed as dist

from lslm.data_parallel.grad_sync import attach_grad_buffers
from lslm.demos.three_d_torch import serial_run, tied_refusals, torch_case
from lslm.harness.entry import run_in_context
from lslm.models.gpt import GPT, GPTConfig
from lslm.pipeline.apply import PipelinePlan
from lslm.recipes.three_d import RECIPE
from lslm.recipes.train import TrainConfig, adamw, prepare_training
from lslm.runtime import init_distributed
from lslm.runtime.context import ParallelContext
from lslm.tensor_parallel.apply import apply_tensor_parallel
from lslm.three_d import ThreeDPlan, apply_3d
from lslm.zero import ZeroOptimizer

__all__ = ["CLIP", "OPTIM", "ROWS", "SEED", "STEPS", "T", "VOCAB", "batches", "config", "reference_shards",
           "run_case", "run_suite", "serial", "suite", "torch_cases"]

SEED, ROWS, T, VOCAB, STEPS = 1234, 8, 16, 96, 3
#: A clip low enough that every step clips (the norm of these gradients is ~1-3), so a wrong norm shows.
CLIP = 0.5
#: lr 1e-3: Adam's near-sign first updates turn an fp32 rounding in a gradient into up to ~lr x that relative
#: error on a parameter whose gradient is near 0; a missing or doubled reduction moves parameters by ~lr.
OPTIM = TrainConfig(lr=1e-3, weight_decay=0.1, grad_clip=CLIP)


def config(tied: bool) -> GPTConfig:
    """The tiny GPT every case trains: 4 blocks (interleaved needs 2 x pp = 4 stages), 2 heads (tp = 2)."""
    return GPTConfig(n_layer=4, n_head=2, n_embd=32, block_size=T, vocab_size=VOCAB, dropout=0.0, tie_weights=tied)


def batches(steps: int = STEPS) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """``steps`` fixed global batches of token ids and next-token targets (seeded on the CPU)."""
    g = torch.Generator().manual_seed(7)
    tok = torch.randint(0, VOCAB, (steps, ROWS, T + 1), generator=g)  # lslm: cpu-ok (seeded, moved by the caller)
    return [(t[:, :-1], t[:, 1:]) for t in tok]


def serial(tied: bool, steps: int = STEPS) -> tuple[list[float], list[float], dict[str, torch.Tensor]]:
    """Losses, gradient norms and final parameters of the whole run in one process (fp32 AdamW, torch's clip)."""
    torch.manual_seed(SEED)
    model = GPT(config(tied))
    opt = prepare_training(model, OPTIM).optimizer
    losses, norms = [], []

    def clip(params: Any, max_norm: float) -> torch.Tensor:
        norms.append(torch.nn.utils.clip_grad_norm_(params, max_norm).item())
        return norms[-1]
    for x, y in batches(steps):
        opt.zero_grad()
        _, loss = model(x, y)
        loss.backward()
        opt.step(CLIP, clip=clip)
        losses.append(loss.item())
    return losses, norms, {k: v.detach().clone() for k, v in model.state_dict().items()}


def reference_shards(ctx: ParallelContext, state: dict[str, torch.Tensor], tied: bool,
                     sp: bool) -> dict[str, torch.Tensor]:
    """The serial parameters as this tp rank holds them: the serial GPT cut by ``apply_tensor_parallel``."""
    with torch.device("meta"):
        model = GPT(config(tied))
    model.to_empty(device=ctx.device)
    model.load_state_dict(state)
    if tied:
        model.lm_head.weight = model.wte.weight
    if ctx.tp_size > 1:
        apply_tensor_parallel(model, ctx, sequence_parallel=sp)
    return {n: p.detach() for n, p in model.named_parameters(remove_duplicate=False)}


def run_case(ctx: ParallelContext, case: dict[str, Any], refs: dict[bool, tuple[list[float], list[float], dict]],
             steps: int = STEPS) -> dict[str, Any]:
    """One configuration: train ``steps`` steps on the case's grid; its figures against the serial run.

    ``case``: ``dp``, ``tp``, ``pp``, ``schedule`` and optionally ``zero``, ``sp``, ``tied``, ``m``
    (micro-batches, default 2). Returns ``losses`` / ``ref_losses`` (the global mean per step),
    ``dloss``, ``dnorm`` (relative, the clip's global norm), ``dparam`` (this rank) and
    ``dparam_all`` (max over every rank), ``bytes`` (this rank's message bytes per ledger axis over
    the ``steps`` steps, the ledger's ``nbytes``) and ``bus_bytes`` (what a bandwidth-optimal algorithm
    sends of them: :attr:`~lslm.runtime.records.CommRecord.bus_bytes`), and the checks the tests make
    (shapes, names, storage outside the stages).
    """
    t0 = time.perf_counter()
    pctx = ctx.with_grid(tp=case["tp"], pp=case["pp"], dp=case["dp"])
    tied, sp, zero = case.get("tied", False), case.get("sp", False), case.get("zero", 0)
    v = 2 if case["schedule"] == "interleaved" else 1
    plan = ThreeDPlan(PipelinePlan(case["schedule"], microbatches=case.get("m", 2), virtual_stages=v),
                      sequence_parallel=sp, zero=zero)
    with torch.device("meta"):
        model = GPT(config(tied))
    tdp = apply_3d(model, pctx, plan, init_seed=SEED)
    norms: list[float] = []
    if zero:
        zopt = ZeroOptimizer(tdp.local, adamw(list(tdp.local.parameters()), OPTIM), pctx, stage=zero)

        def step() -> None:
            zopt.step(CLIP)
            norms.append(zopt.last_grad_norm)
        opt: Any = zopt
    else:
        for stage in tdp.local:
            attach_grad_buffers(stage, pctx)
        opt = prepare_training(tdp.local, OPTIM, ctx=pctx).optimizer

        def clip(params: Any, max_norm: float) -> torch.Tensor:
            norms.append(tdp.clip_grad_norm_(params, max_norm).item())
            return norms[-1]

        def step() -> None:
            opt.step(CLIP, clip=clip)
    rows = ROWS // pctx.dp_size
    losses = []
    ledger = pctx.comm.ledger
    since = len(ledger.records)
    sent: Counter[str] = Counter()
    bus: Counter[str] = Counter()
    for x, y in batches(steps):
        x, y = x.to(pctx.device), y.to(pctx.device)
        opt.zero_grad()
        mine = slice(pctx.dp_rank * rows, (pctx.dp_rank + 1) * rows)
        loss = tdp.step(x[mine], y[mine])
        step()
        for r in ledger.snapshot()[since:]:
            sent[r.axis or "other"] += r.nbytes
            bus[r.axis or "other"] += int(r.bus_bytes)
        # The replica's mean; the serial loss is the mean of the replicas' (equal rows). Not counted above.
        total = loss.detach().clone().reshape(1)
        pctx.comm.all_reduce(total, group=pctx.group("dp"), label="demo loss")
        losses.append(total.item() / pctx.dp_size)
        since = len(ledger.records)
    ref_losses, ref_norms, ref_state = refs[tied]
    ref = reference_shards(pctx, ref_state, tied, sp)
    dparam = max((p.detach() - ref[n]).abs().max().item() for n, p in tdp.named_parameters())
    worst = torch.tensor([dparam], device=pctx.device)
    pctx.comm.all_reduce(worst, op=dist.ReduceOp.MAX, label="demo check")  # after the counts: not the run's
    local = {id(p) for p in tdp.parameters()}
    # The meta-device build: no parameter outside this rank's stages was ever given storage here.
    outside = [n for n, p in tdp.pipe.model.named_parameters() if not p.is_meta and id(p) not in local]
    sharded = {n: (tuple(p.shape), tuple(ref[n].shape)) for n, p in tdp.named_parameters()}
    return {"case": case, "dloss": max(abs(a - b) for a, b in zip(losses, ref_losses)), "dparam": dparam,
            "dparam_all": worst.item(), "outside": outside, "coords": pctx.coords._asdict(), "shapes": sharded,
            "dnorm": max(abs(a - b) / b for a, b in zip(norms, ref_norms)),
            "bytes": dict(sent), "bus_bytes": dict(bus),
            "names": sorted(n for n, _ in tdp.named_parameters()), "losses": losses, "ref_losses": ref_losses,
            "s": time.perf_counter() - t0}


def torch_cases(ctx: ParallelContext, cases: list[dict[str, Any]], steps: int = STEPS) -> dict[str, Any]:
    """The same GPT and batches through torch's own 3D composition (:mod:`lslm.demos.three_d_torch`), one result
    per case of ``cases``, against its serial run (untied, no clip: that module's doc says why); and the messages
    with which torch's side refuses a tied embedding."""
    cfg, data = config(False), batches(steps)
    opts = dict(seed=SEED, lr=OPTIM.lr, weight_decay=OPTIM.weight_decay)
    ref = serial_run(cfg, data, **opts)
    return {"cases": [torch_case(ctx, case, cfg, data, ref, **opts) for case in cases],
            "tied_refusals": tied_refusals(cfg, ctx)}


def suite(cases: list[dict[str, Any]], steps: int = STEPS, torch_native: list[dict[str, Any]] | None = None,
          traced: dict[str, Any] | None = None, **_: Any) -> dict[str, Any]:
    """Launch target: every case of ``cases`` on this rank (a world of any size; each case picks its grid), then,
    in the same processes, every case of ``torch_native`` with torch's pieces (:func:`torch_cases`), then the
    3D recipe traced with ``traced``'s settings (module doc)."""
    return run_suite(init_distributed(), cases, steps, torch_native, traced)


def run_suite(ctx: ParallelContext, cases: list[dict[str, Any]], steps: int = STEPS,
              torch_native: list[dict[str, Any]] | None = None,
              traced: dict[str, Any] | None = None) -> dict[str, Any]:
    """:func:`suite` in a process group that is already up (``ctx``): ``{"rank", "cases"[, "torch"][, "traced"]}``
    (``traced``: the steps the recipe run traced)."""
    refs = {tied: serial(tied, steps) for tied in sorted({c.get("tied", False) for c in cases})}
    out: dict[str, Any] = {"rank": ctx.rank, "cases": [run_case(ctx, case, refs, steps) for case in cases]}
    if torch_native:
        out["torch"] = torch_cases(ctx, torch_native, steps)
    if traced:
        settings = dict(traced)
        folder = settings.pop("trace")
        out["traced"] = run_in_context(RECIPE, ctx, [{}], trace=folder, **settings)[0]["trace"]["steps"]
    return out
