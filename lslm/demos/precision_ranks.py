"""Ranks agree on overflow, as ShardedGradScaler's ranks do: the launch notebook 07 and the scaler tests run.

``lslm.launch("lslm.demos.precision_ranks:suite", nproc=2)`` runs three cases on every rank, each with a scripted
overflow pattern in which only rank 1 injects an inf or a NaN into its gradients:

* ``lslm``: :class:`DynamicLossScaler` with ``comm=ctx.comm`` (MAX over the world) driving
  an fp32 model and SGD, so its trajectory can be set beside torch's;
* ``torch``: ``ShardedGradScaler(device="cpu")`` (torch.distributed.fsdp), which
  all-reduces its found-inf flag (SUM) over the world, same model, same pattern;
* ``master``: :class:`MixedPrecisionOptimizer` (fp16, ``main_grad``) with the same kind of
  scaler, rank 1 injecting into one ``main_grad``.

Each rank returns whether it stepped, the scale after each update, a digest of its
parameters, and the overflow records of the ledger.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from lslm.models.gpt import GPT, GPTConfig
from lslm.precision import OVERFLOW_LABEL, DynamicLossScaler, MixedPrecisionOptimizer
from lslm.runtime import init_distributed

SEED = 7
STEPS = 8
INIT_SCALE = 2.0**10
INTERVAL = 2
# step -> what rank 1 injects; rank 0 never overflows.
INJECT = {1: float("inf"), 4: float("nan"), 5: float("-inf")}


def _model(device: torch.device) -> nn.Module:
    torch.manual_seed(SEED)
    return nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 4)).to(device)


def _batch(step: int, rank: int, device: torch.device) -> torch.Tensor:
    g = torch.Generator().manual_seed(1000 * rank + step)
    return torch.randn(4, 8, generator=g).to(device)  # lslm: cpu-ok (seeded CPU draw, then moved)


def _inject(grad: torch.Tensor, step: int, rank: int) -> None:
    if rank == 1 and step in INJECT:
        grad.view(-1)[0] = INJECT[step]


def _digest(params: list[torch.Tensor]) -> list[float]:
    return [float(p.detach().double().sum()) for p in params]


def _lslm_case(ctx: Any) -> dict[str, Any]:
    model = _model(ctx.device)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = DynamicLossScaler(INIT_SCALE, growth_interval=INTERVAL, hysteresis=1, min_scale=None, comm=ctx.comm)
    stepped, scales = [], []
    ctx.comm.ledger.reset()
    for step in range(STEPS):
        opt.zero_grad()
        scaler.backward(model(_batch(step, ctx.rank, ctx.device)).square().mean())
        _inject(model[0].weight.grad, step, ctx.rank)
        stepped.append(scaler.step(opt))
        scales.append(scaler.scale)
    records = [[r.op, r.nbytes, r.dtype, r.axis] for r in ctx.comm.ledger.records if r.label == OVERFLOW_LABEL]
    return {"stepped": stepped, "scales": scales, "digest": _digest(list(model.parameters())), "records": records}


def _torch_case(ctx: Any) -> dict[str, Any]:
    from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler

    model = _model(ctx.device)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = ShardedGradScaler(device=ctx.device.type, init_scale=INIT_SCALE, growth_interval=INTERVAL)
    stepped, scales = [], []
    for step in range(STEPS):
        opt.zero_grad()
        scaler.scale(model(_batch(step, ctx.rank, ctx.device)).square().mean()).backward()
        _inject(model[0].weight.grad, step, ctx.rank)
        before = [p.detach().clone() for p in model.parameters()]
        scaler.step(opt)
        scaler.update()
        stepped.append(any(not torch.equal(b, p) for b, p in zip(before, model.parameters())))
        scales.append(float(scaler.get_scale()))
    return {"stepped": stepped, "scales": scales, "digest": _digest(list(model.parameters()))}


def _master_case(ctx: Any) -> dict[str, Any]:
    torch.manual_seed(SEED)
    model = GPT(GPTConfig.tiny(vocab_size=64, block_size=8, n_layer=1, n_embd=32)).to(ctx.device)
    scaler = DynamicLossScaler(INIT_SCALE, growth_interval=INTERVAL, hysteresis=1, min_scale=None, comm=ctx.comm)
    mp = MixedPrecisionOptimizer(model, lambda ps: torch.optim.AdamW(ps, lr=1e-3), torch.float16, scaler=scaler)
    stepped, scales, identical_when_skipped = [], [], []
    for step in range(STEPS):
        g = torch.Generator().manual_seed(1000 * ctx.rank + step)
        tok = torch.randint(0, 64, (2, 9), generator=g).to(ctx.device)  # lslm: cpu-ok (seeded CPU draw, then moved)
        mp.zero_grad()
        mp.backward(model(tok[:, :-1], tok[:, 1:])[1])
        _inject(mp.params[0].main_grad, step, ctx.rank)
        before = [m.clone() for m in mp.masters] + [p.detach().clone() for p in mp.params]
        state_before = [v.clone() for s in mp.state.values() for v in s.values()]
        ok = mp.step()
        if not ok:
            after = list(mp.masters) + [p.detach() for p in mp.params]
            state_after = [v for s in mp.state.values() for v in s.values()]
            identical_when_skipped.append(len(state_after) == len(state_before) > 0
                                          and all(torch.equal(a, b) for a, b in zip(before, after))
                                          and all(torch.equal(a, b) for a, b in zip(state_before, state_after)))
        stepped.append(ok)
        scales.append(scaler.scale)
    finite = all(bool(torch.isfinite(t).all()) for t in list(mp.masters) + mp.params)
    return {"stepped": stepped, "scales": scales, "identical_when_skipped": identical_when_skipped,
            "finite": finite, "digest": _digest(mp.masters)}


def suite(**_: Any) -> dict[str, Any]:
    """Run the three cases on this rank (module doc); return their results."""
    ctx = init_distributed()
    with ctx:
        out = {"rank": ctx.rank, "lslm": _lslm_case(ctx), "torch": _torch_case(ctx), "master": _master_case(ctx)}
    return out
