"""Workers for tests/test_pipeline_executor.py: every schedule run for real against one serial GPT.

One launch runs many cases (processes start once: 2 CPU cores are shared). Every rank
computes the serial reference itself (same seed, same global batch) and reports, per case,
the loss error, the largest relative gradient error over its parameters, which parameters
it holds, the memory summary, and (where asked) how its gradients differ from another
case's (remat / deallocation must change nothing) and the gathered timeline's counts.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch

from lslm.models.gpt import GPT, GPTConfig
from lslm.pipeline.apply import PipelinePlan, apply_pipeline
from lslm.pipeline.memory import PipelineMemory
from lslm.pipeline.p2p import action_of_record
from lslm.pipeline.schedules import build_schedule, schedule_from_lists
from lslm.runtime import init_distributed
from lslm.runtime.context import ParallelContext

SEED, ROWS, T, VOCAB = 1234, 8, 16, 96


def config() -> GPTConfig:
    """The tiny GPT every case pipelines: 8 blocks (enough for interleaved / DualPipeV at p = 4)."""
    return GPTConfig.tiny(n_layer=8, block_size=T, vocab_size=VOCAB, n_embd=32, n_head=2)


def batch(rows: int = ROWS, seed: int = 7) -> tuple[torch.Tensor, torch.Tensor]:
    """A fixed global batch of token ids and next-token targets."""
    g = torch.Generator().manual_seed(seed)
    tok = torch.randint(0, VOCAB, (rows, T + 1), generator=g)
    return tok[:, :-1], tok[:, 1:]


def serial(x: torch.Tensor, y: torch.Tensor) -> tuple[float, dict[str, torch.Tensor]]:
    """Loss and gradients of the whole batch in one process."""
    torch.manual_seed(SEED)
    model = GPT(config())
    _, loss = model(x, y)
    loss.backward()
    return loss.item(), {n: p.grad.clone() for n, p in model.named_parameters()}


def _hand_schedule(p: int, m: int) -> Any:
    """A hand-written schedule: 1F1B whose backward is split into I, with each W right after its I."""
    base = build_schedule("1f1b", p, m)
    lists = []
    for acts in base.compute:
        out: list[str] = []
        for a in acts:
            out += [f"{a.stage}I{a.mb}", f"{a.stage}W{a.mb}"] if a.kind == "B" else [str(a)]
        lists.append(out)
    return schedule_from_lists(lists, m, name="1f1b-iw")


def _trace_memory(mem: PipelineMemory) -> dict[str, Any]:
    """Record what :class:`PipelineMemory` held at each of its boundaries, and what each ``I`` left for its ``W``.

    Fills (in place, during the step) ``"held"``: the held bytes at every ``observe`` in order (one before each
    compute action, one after the step, one after each rematerialised forward), and ``"w_bytes"``: per
    ``"stage,mb"``, the bytes the entry keeps after a split backward (the linear layers' inputs and output
    gradients the postponed ``W`` needs). Test-only instrumentation: wraps the instance's own methods.
    """
    out: dict[str, Any] = {"held": [], "w_bytes": {}}
    observe, release = mem.observe, mem.release

    def traced_observe() -> int:
        now = observe()
        out["held"].append(now)
        return now

    def traced_release(key: tuple[int, int], keep: Any = ()) -> None:
        release(key, keep)
        if key in mem.entries:  # kept for a W
            out["w_bytes"][f"{key[0]},{key[1]}"] = sum(mem.entries[key].values())

    mem.observe, mem.release = traced_observe, traced_release  # type: ignore[method-assign]
    return out


def _rel_err(grads: dict[str, torch.Tensor], ref: dict[str, torch.Tensor]) -> float:
    worst = 0.0
    for n, g in grads.items():
        r = ref[n].to(g.device)
        worst = max(worst, ((g - r).abs().max() / r.abs().max().clamp_min(1e-30)).item())
    return worst


def run_case(ctx: ParallelContext, x: torch.Tensor, y: torch.Tensor, *, schedule: str, m: int, v: int = 1,
             remat: bool = False, dealloc: bool = True, memory: bool = False, timeline: bool = False,
             custom: bool = False, accumulate: bool = False,
             partition: str = "layers") -> tuple[float, dict[str, torch.Tensor], dict[str, Any]]:
    """Pipeline this replica's share of ``x``/``y``; returns (global mean loss, this rank's grads, extras)."""
    torch.manual_seed(SEED)
    model = GPT(config())
    plan = PipelinePlan(schedule=schedule, microbatches=m, virtual_stages=v, partition=partition, remat=remat,
                        deallocate_outputs=dealloc, record_timeline=timeline, track_memory=memory)
    pipe = apply_pipeline(model, ctx, plan, schedule=_hand_schedule(ctx.pp_size, m) if custom else None)
    trace = _trace_memory(pipe.memory) if pipe.memory is not None else None
    rows = x.shape[0] // ctx.dp_size
    xr, yr = (t[ctx.dp_rank * rows:(ctx.dp_rank + 1) * rows] for t in (x, y))
    since = len(ctx.comm.ledger.records)
    if accumulate:  # two half batches, the gradient sync only after the second
        half = rows // 2
        l1 = pipe.step(xr[:half], yr[:half], loss_scale=0.5, sync_grads=False)
        l2 = pipe.step(xr[half:], yr[half:], loss_scale=0.5, sync_grads=True)
        loss = (l1 + l2) / 2
    else:
        loss = pipe.step(xr, yr)
    extras: dict[str, Any] = {}
    records = ctx.comm.ledger.snapshot()[since:]
    p2p = [r for r in records if action_of_record(r) is not None]
    extras["p2p"] = sorted(str(action_of_record(r)) for r in p2p)
    extras["p2p_bytes"] = sorted({r.nbytes for r in p2p})
    extras["comm_actions"] = sorted(str(a) for a in pipe.executor.actions if a.is_comm)
    extras["dp_sync"] = sorted(r.label for r in records if r.label.startswith("pp dp grads"))
    # Completion times are stamped only for a recorded timeline (the executor's ledger.timed()).
    extras["p2p_timed"] = sorted({r.completion_s is not None for r in p2p})
    if memory:
        extras["memory"] = {**pipe.last_memory, **(trace or {})}
    if timeline:
        tl = pipe.gather_timeline()
        extras["timeline"] = {"ranks": tl.num_ranks,
                              "compute": [len(tl.compute(r)) for r in range(tl.num_ranks)],
                              "comm": [sum(1 for e in tl.events if e.rank == r and not e.is_compute)
                                       for r in range(tl.num_ranks)],
                              "ordered": all(e.end >= e.start for e in tl.events)}
    total = loss.detach().reshape(1).clone()
    if ctx.dp_size > 1:
        ctx.comm.all_reduce(total, group=ctx.group("dp"), label="test loss")
        total /= ctx.dp_size
    grads = {n: p.grad.detach().clone() for n, p in pipe.named_parameters() if p.grad is not None}
    extras["names"] = sorted(n for n, _ in pipe.named_parameters())
    extras["missing_grads"] = sorted(n for n, p in pipe.named_parameters() if p.grad is None)
    extras["stages"] = sorted(pipe.stages)
    return total.item(), grads, extras


def suite(pp: int, dp: int = 1, cases: list[dict[str, Any]] | None = None, **_: Any) -> dict[str, Any]:
    """Run ``cases`` (keyword sets for :func:`run_case`, plus ``name`` and optional ``base``: the name of an
    earlier case whose gradients this one must reproduce) on a ``pp x dp`` grid."""
    ctx = init_distributed(pp=pp, dp=dp)
    out: dict[str, Any] = {}
    with ctx:
        x, y = batch()
        ref_loss, ref = serial(x, y)
        kept: dict[str, dict[str, torch.Tensor]] = {}
        for case in cases or []:
            case = dict(case)
            name, base = case.pop("name"), case.pop("base", None)
            loss, grads, extras = run_case(ctx, x, y, **case)
            extras["loss_err"] = abs(loss - ref_loss) / abs(ref_loss)
            extras["grad_err"] = _rel_err(grads, ref)
            if base is not None:
                extras["diff_vs_base"] = max((grads[n] - kept[base][n]).abs().max().item() for n in grads)
            kept[name] = grads
            out[name] = extras
        rank, pp_rank, device = ctx.rank, ctx.pp_rank, ctx.device.type
    return {"rank": rank, "pp_rank": pp_rank, "device": device, "cases": out, "all_names": sorted(ref)}


def tied_suite(pp: int, dp: int = 1, cases: list[dict[str, Any]] | None = None, **_: Any) -> dict[str, Any]:
    """Tied embedding/head weights across pipeline ranks against the serial tied GPT: per case, this rank's
    gradient errors (its copy of the tied weight compared with the serial ``wte.weight`` gradient, which sums the
    embedding's and the head's parts), the tied exchanges it made, and after one SGD step the largest difference
    of its weights from the serial step's."""
    ctx = init_distributed(pp=pp, dp=dp)
    out: dict[str, Any] = {}
    with ctx:
        x, y = batch()
        cfg = dataclasses.replace(config(), tie_weights=True)
        torch.manual_seed(SEED)
        ref_model = GPT(cfg)
        _, ref_loss_t = ref_model(x, y)
        ref_loss_t.backward()
        ref = {n: p.grad.clone() for n, p in ref_model.named_parameters()}
        with torch.no_grad():
            for p in ref_model.parameters():
                p -= 0.1 * p.grad
        ref_after = dict(ref_model.named_parameters())
        for case in cases or []:
            case = dict(case)
            name = case.pop("name")
            meta = case.pop("meta", False)
            plan = PipelinePlan(schedule=case["schedule"], microbatches=case["m"], virtual_stages=case.get("v", 1))
            if meta:
                with torch.device("meta"):
                    model = GPT(cfg)
                pipe = apply_pipeline(model, ctx, plan, init_seed=SEED)
            else:
                torch.manual_seed(SEED)
                pipe = apply_pipeline(GPT(cfg), ctx, plan)
            rows = x.shape[0] // ctx.dp_size
            xr, yr = (t[ctx.dp_rank * rows:(ctx.dp_rank + 1) * rows] for t in (x, y))
            since = len(ctx.comm.ledger.records)
            loss = pipe.step(xr, yr).detach().reshape(1).clone()
            if ctx.dp_size > 1:
                ctx.comm.all_reduce(loss, group=ctx.group("dp"), label="test loss")
                loss /= ctx.dp_size
            tied = [r for r in ctx.comm.ledger.snapshot()[since:] if r.label == "pp tied embedding grad"]
            named = dict(pipe.named_parameters())
            # The serial model names the tied tensor once, as wte.weight.
            grads = {n: p.grad for n, p in named.items()}
            err = _rel_err(grads, {n: ref["wte.weight" if n == "lm_head.weight" else n] for n in grads})
            with torch.no_grad():
                for p in pipe.parameters():
                    p -= 0.1 * p.grad
            serial_name = {n: "wte.weight" if n == "lm_head.weight" else n for n in named}
            step_diff = max((p - ref_after[serial_name[n]].to(p.device)).abs().max().item() for n, p in named.items())
            out[name] = {"loss_err": abs(loss.item() - ref_loss_t.item()) / abs(ref_loss_t.item()), "grad_err": err,
                         "names": sorted(named), "tied_ops": len(tied), "step_diff": step_diff,
                         "tied_param": None if pipe.tied_param is None else next(
                             n for n, p in named.items() if p is pipe.tied_param)}
        rank, pp_rank = ctx.rank, ctx.pp_rank
    return {"rank": rank, "pp_rank": pp_rank, "cases": out}
