"""Workers for tests/test_ddp.py: every DDP variant against a single-process run and against torch's DDP.

One launch per world size (:func:`suite`) runs every case; each rank returns numbers (max
differences, ledger bytes, error messages) and the test process asserts on them.
Every rank also computes the single-process reference itself (the tiny GPT on the
whole global batch): cheaper than shipping tensors around.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from lslm.data_parallel.ddp import BROADCAST_LABEL, GRAD_LABEL, VARIANTS, first_mismatch, make_ddp
from lslm.metrics import memory_by_owner
from lslm.models.gpt import GPT, GPTConfig
from lslm.runtime import init_distributed

T = 16  # tokens per row
ROWS = 2  # rows per rank per micro-batch
SEED = 1234


def _gpt(seed: int) -> nn.Module:
    torch.manual_seed(seed)
    return GPT(GPTConfig.tiny())


def _batch(step: int, rows: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(10_000 + step)
    tokens = torch.randint(0, GPTConfig.tiny().vocab_size, (rows, T + 1), generator=g)
    return tokens[:, :-1], tokens[:, 1:]


def _optimizer(model: nn.Module) -> torch.optim.Optimizer:
    # Plain SGD with momentum: the update is linear in the gradient, so fp32 rounding
    # differences in the gradient stay rounding-sized (Adam's g/sqrt(v) can amplify them).
    return torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)


def _flat(model: nn.Module) -> torch.Tensor:
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()])


def reference_params(steps: int, world: int, accum: int, device: torch.device) -> torch.Tensor:
    """One process, the whole global batch each step (mean loss over all rows): the target."""
    model = _gpt(SEED).to(device)
    opt = _optimizer(model)
    for step in range(steps):
        x, y = (t.to(device) for t in _batch(step, world * accum * ROWS))
        opt.zero_grad(set_to_none=True)
        model(x, y)[1].backward()
        opt.step()
    return _flat(model)


def _grad_bytes(ledger: Any, start: int) -> tuple[int, int]:
    return (ledger.total_bytes("all_reduce", label=GRAD_LABEL, since=start),
            ledger.calls("all_reduce", label=GRAD_LABEL, since=start))


def train_ddp(ctx: Any, variant: str, steps: int, accum: int, cap_mb: float, ledger_hook: bool = False,
              record_timeline: bool = False) -> dict[str, Any]:
    """Train the tiny GPT with ``variant``; rank r reads rows [r*accum*ROWS, (r+1)*accum*ROWS) of each global batch."""
    n, r = ctx.dp_size, ctx.dp_rank
    # Ranks other than 0 start from other weights: the start-up broadcast must fix that.
    model = _gpt(SEED if r == 0 else SEED + 1 + r).to(ctx.device)
    ledger = ctx.comm.ledger
    start = len(ledger.records)
    ddp = make_ddp(model, ctx, variant=variant, bucket_cap_mb=cap_mb, record_timeline=record_timeline)
    bcast = ledger.total_bytes(label=BROADCAST_LABEL, since=start)
    if ledger_hook:
        ddp.use_ledger_comm_hook()
    opt = _optimizer(ddp.module)
    out: dict[str, Any] = {"grad_bytes": ddp.grad_bytes, "broadcast_bytes": bcast, "bytes_no_sync": [],
                           "bytes_sync": [], "calls_sync": [], "in_sync": [],
                           "timeline": [], "overlap": []}
    for step in range(steps):
        x, y = (t.to(ctx.device) for t in _batch(step, n * accum * ROWS))
        mine = slice(r * accum * ROWS, (r + 1) * accum * ROWS)
        xs, ys = x[mine].split(ROWS), y[mine].split(ROWS)
        ddp.reset_timeline()
        opt.zero_grad(set_to_none=True)
        mark = len(ledger.records)
        for k in range(accum - 1):  # accumulate locally: no communication
            with ddp.no_sync():
                (ddp(xs[k], ys[k])[1] / accum).backward()
            ddp.finish_grad_sync()  # a no-op after a no_sync() forward
        out["bytes_no_sync"].append(_grad_bytes(ledger, mark)[0])
        mark = len(ledger.records)
        (ddp(xs[-1], ys[-1])[1] / accum).backward()
        t_backward = time.perf_counter()
        ddp.finish_grad_sync()
        nbytes, calls = _grad_bytes(ledger, mark)
        out["bytes_sync"].append(nbytes)
        out["calls_sync"].append(calls)
        if record_timeline:
            events = list(ddp.timeline)
            out["timeline"].append(events)
            # Overlap: the first bucket's all-reduce was launched while backward was still running.
            starts = [e["t_start"] for e in events if e["event"] == "allreduce_done"]
            out["overlap"].append(bool(starts) and min(starts) < t_backward)
        opt.step()
        out["in_sync"].append(first_mismatch(ddp.module.named_parameters(), ctx.comm, ctx.dp_group, ctx.device))
    out["buckets"] = ddp.buckets  # after training: torch's are only seen by the ledger hook
    out["memory"] = memory_by_owner(ddp, opt).to_dict()  # the wrapper brings its registered buffers
    if variant == "torch":
        out["reducer_bucket_bytes"] = ddp.reducer_bucket_bytes()
    out["params"] = _flat(ddp.module)
    return out


def train_cases(ctx: Any, steps: int, cap_mb: float) -> dict[str, Any]:
    """Every variant, with and without accumulation; differences to the reference and to torch's DDP."""
    n = ctx.dp_size
    cases: dict[str, Any] = {}
    for accum in (1, 2):
        ref = reference_params(steps, n, accum, ctx.device)
        runs = {v: train_ddp(ctx, v, steps, accum, cap_mb, record_timeline=(v == "bucketed" and accum == 1))
                for v in VARIANTS}
        runs["torch+ledger"] = train_ddp(ctx, "torch", steps, accum, cap_mb, ledger_hook=True)
        params = {name: run.pop("params") for name, run in runs.items()}
        for name, run in runs.items():
            run["max_diff_ref"] = float((params[name] - ref).abs().max())
            run["max_diff_torch"] = float((params[name] - params["torch"]).abs().max())
            cases[f"{name}/accum{accum}"] = run
    return cases


def suite(steps: int = 3, cap_mb: float = 0.05) -> dict[str, Any]:
    """Everything test_ddp.py checks at one world size, in one launch."""
    with init_distributed(seed=0) as ctx:
        model = _gpt(0)
        return {"cases": train_cases(ctx, steps, cap_mb), "misuse": misuse_cases(ctx),
                "memory_adamw": memory_adamw_case(ctx, cap_mb),
                "param_names": [name for name, _ in model.named_parameters()],
                "param_numel": sum(p.numel() for p in model.parameters()),
                "param_numels": {name: p.numel() for name, p in model.named_parameters()}}


def memory_adamw_case(ctx: Any, cap_mb: float) -> dict[str, Any]:
    """Bucketed DDP + AdamW after one step: memory by owner (checked against hand counts in the test)."""
    ddp = make_ddp(_gpt(SEED).to(ctx.device), ctx, variant="bucketed", bucket_cap_mb=cap_mb)
    opt = torch.optim.AdamW(ddp.module.parameters(), lr=1e-3)
    x, y = (t.to(ctx.device) for t in _batch(0, ROWS))
    ddp(x, y)[1].backward()
    ddp.finish_grad_sync()
    opt.step()
    return {"memory": memory_by_owner(ddp.module, opt, owners=[ddp]).to_dict(), "buckets": ddp.buckets,
            "num_param_tensors": len(list(ddp.module.parameters()))}


# -- bad input and unused parameters ------------------------------------------------------------
class Branchy(nn.Module):
    """``a -> c``, plus a branch ``b`` used only when asked to."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b, self.c = nn.Linear(4, 8), nn.Linear(8, 8), nn.Linear(8, 1)

    def forward(self, x: torch.Tensor, use_b: bool = False) -> torch.Tensor:
        h = torch.tanh(self.a(x))
        if use_b:
            h = h + self.b(h)
        return self.c(h).pow(2).mean()


def _branchy(seed: int = 7, device: torch.device | str = "cpu") -> Branchy:
    torch.manual_seed(seed)
    return Branchy().to(device)


def _randn(seed: int, device: torch.device) -> torch.Tensor:
    return torch.randn(3, 4, generator=torch.Generator().manual_seed(seed)).to(device)


def _error(fn: Callable[[], Any]) -> str:
    try:
        fn()
    except (RuntimeError, ValueError) as exc:
        return f"{type(exc).__name__}: {exc}"
    return ""


def _unused_run(ctx: Any, variant: str, uses: list[bool], steps: int = 2) -> tuple[torch.Tensor, list[bool]]:
    """find_unused_parameters=True; rank r uses branch b iff uses[r]. Returns params and 'b.grad is None' per step."""
    ddp = make_ddp(_branchy(device=ctx.device), ctx, variant=variant, find_unused_parameters=True,
                   bucket_cap_mb=0.0001)
    opt = torch.optim.SGD(ddp.module.parameters(), lr=0.1)
    b_none = []
    for step in range(steps):
        x = _randn(100 * step + ctx.dp_rank, ctx.device)
        opt.zero_grad(set_to_none=True)
        ddp(x, use_b=uses[ctx.dp_rank]).backward()
        ddp.finish_grad_sync()
        b_none.append(ddp.module.b.weight.grad is None)
        opt.step()
    return _flat(ddp.module), b_none


def _unused_reference(n: int, uses: list[bool], device: torch.device, steps: int = 2) -> torch.Tensor:
    model = _branchy(device=device)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for step in range(steps):
        opt.zero_grad(set_to_none=True)
        loss = sum(model(_randn(100 * step + r, device), use_b=uses[r]) for r in range(n)) / n
        loss.backward()
        opt.step()
    return _flat(model)


def misuse_cases(ctx: Any) -> dict[str, Any]:
    """Clear errors for bad input, and the two unused-parameter behaviours."""
    n, r = ctx.dp_size, ctx.dp_rank
    out: dict[str, Any] = {}
    # Replicas that differ, with the broadcast switched off.
    dev = ctx.device
    out["differ"] = _error(lambda: make_ddp(_gpt(SEED + r).to(dev), ctx, variant="naive", broadcast_params=False))
    out["same"] = _error(lambda: make_ddp(_gpt(SEED).to(dev), ctx, variant="bucketed", broadcast_params=False))
    # A branch no rank uses, default settings: an error naming it.
    out["unused_default"] = {}
    for v in ("naive", "fused", "bucketed"):
        ddp = make_ddp(_branchy(device=dev), ctx, variant=v, bucket_cap_mb=0.0001)
        ddp(_randn(0, dev)).backward()
        out["unused_default"][v] = _error(ddp.finish_grad_sync)
    # With the option: no rank uses b; then only rank 0 does. Compare with one process.
    out["unused_option"] = {}
    for uses in ([False] * n, [i == 0 for i in range(n)]):
        ref = _unused_reference(n, uses, dev)
        for v in VARIANTS:
            params, b_none = _unused_run(ctx, v, uses)
            out["unused_option"][f"{v}/{sum(uses)}"] = {"max_diff": float((params - ref).abs().max()),
                                                        "b_grad_none": b_none}
    # Forgetting finish_grad_sync, calling it twice.
    ddp = make_ddp(_branchy(device=dev), ctx, variant="bucketed")
    x = _randn(1, dev)
    ddp(x, use_b=True).backward()
    out["forgot_finish"] = _error(lambda: ddp(x, use_b=True))
    ddp.finish_grad_sync()
    out["finish_twice"] = _error(ddp.finish_grad_sync)
    return out
