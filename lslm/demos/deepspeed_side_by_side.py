"""DeepSpeed itself next to lslm's ZeRO stage 3 and FSDP2: the same GPT, data and AdamW, the same losses.

:func:`deepspeed_side_by_side` (what notebook 08 calls) launches one job through :func:`lslm.launch`: every rank
builds the course's GPT from one seed (:data:`lslm.demos.zero_demo.MODEL`) and trains it three times on the same
tokens, fp32 AdamW from one client ``torch.optim.AdamW``: lslm's :class:`~lslm.zero.optimizer.ZeroOptimizer` at
stage 3, FSDP2's ``fully_shard`` (per block, then the root) and DeepSpeed's ZeRO engine at stage 3
(:mod:`lslm.integrations.deepspeed_zero`). It returns the losses per step, how far each one's parameters end
from lslm's, and the model-state bytes per parameter each rank holds after the last step, by owner
(:func:`lslm.metrics.held.held_by_owner`). Where DeepSpeed cannot run here, it returns the reason instead.
"""

from __future__ import annotations

import copy
from typing import Any

import torch
from torch import nn

from lslm.demos.zero_demo import MODEL, ROWS
from lslm.integrations.deepspeed_zero import build_engine, deepspeed_available
from lslm.metrics.held import OWNERS, held_by_owner
from lslm.models.gpt import GPT, GPTConfig

__all__ = ["ENTRIES", "STEPS", "deepspeed_side_by_side", "format_table", "worker"]

ENTRIES = ("lslm zero3", "fsdp2", "deepspeed zero3")
STEPS = 5
LR = 1e-3


def _adamw(net: nn.Module) -> torch.optim.AdamW:
    params = [p for p in net.parameters() if p.requires_grad]
    return torch.optim.AdamW([{"params": [p for p in params if p.dim() >= 2], "weight_decay": 0.1},
                              {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0}],
                             lr=LR, betas=(0.9, 0.95), foreach=False)


def _train(kind: str, serial: GPT, ctx: Any, data: list[torch.Tensor]) -> tuple[list[float], dict[str, int],
                                                                                 dict[str, torch.Tensor], Any]:
    """One entry: its losses, its bytes by owner after the last step, its parameters whole (collective), and the
    DeepSpeed engine to destroy (else ``None``)."""
    net = copy.deepcopy(serial)
    losses: list[float] = []
    if kind == "lslm zero3":
        from lslm.zero import ZeroOptimizer

        zero = ZeroOptimizer(net, _adamw(net), ctx, stage=3)
        for batch in data:
            zero.zero_grad()
            loss = net(batch[:, :-1], batch[:, 1:])[1]
            zero.backward(loss)
            zero.step()
            losses.append(loss.item())
        return losses, held_by_owner(net, zero), zero.full_state_dict(), None
    if kind == "fsdp2":
        from torch.distributed.fsdp import fully_shard

        for block in net.blocks:
            fully_shard(block)
        module = fully_shard(net)
        opt = _adamw(net)
        for batch in data:
            opt.zero_grad(set_to_none=True)
            loss = module(batch[:, :-1], batch[:, 1:])[1]
            loss.backward()
            opt.step()
            losses.append(loss.item())
        full = {n: p.full_tensor().detach().clone() for n, p in net.named_parameters()}
        return losses, held_by_owner(net, opt), full, None
    import deepspeed

    engine = build_engine(net, _adamw(net), 3, data[0].shape[0])
    for batch in data:
        loss = engine(batch[:, :-1], batch[:, 1:])[1]
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    held = held_by_owner(engine.module, engine.optimizer)
    params = list(engine.module.named_parameters())
    with deepspeed.zero.GatheredParameters([p for _, p in params]):
        full = {n: p.detach().clone() for n, p in params}
    return losses, held, full, engine


def worker(steps: int = STEPS, rows: int = ROWS, model: dict[str, Any] | None = None) -> dict[str, Any]:
    """One rank of the job (see the module doc); rank 0 returns the table's numbers, the others ``{"rank"}``."""
    from lslm.runtime import init_distributed

    with init_distributed(seed=0) as ctx:
        world, rank = ctx.world_size, ctx.rank
        torch.manual_seed(0)
        serial = GPT(GPTConfig(**(model or MODEL)))
        g = torch.Generator().manual_seed(1)  # the same global batches for every entry; each rank its rows
        data = [torch.randint(0, serial.config.vocab_size, (rows * world, serial.config.block_size + 1),
                              generator=g)[rank * rows:(rank + 1) * rows].to(ctx.device)  # lslm: cpu-ok (moved)
                for _ in range(steps)]
        psi = sum(p.numel() for p in serial.parameters())
        losses, per_param, full, engines = {}, {}, {}, []
        for kind in ENTRIES:
            losses[kind], held, full[kind], engine = _train(kind, serial, ctx, data)
            per_param[kind] = {owner: held[owner] / psi for owner in OWNERS}
            engines.append(engine)
        for engine in engines:
            if engine is not None:
                engine.destroy()  # before the process group ends (a rare abort at exit otherwise)
        torch.distributed.barrier()  # DTensor users may abort at exit without one
    ours = full["lslm zero3"]
    diffs = {k: max((v[n].float() - ours[n].float()).abs().max().item() for n in ours) for k, v in full.items()}
    return {"rank": rank, **({"world": world, "psi": psi, "steps": steps, "losses": losses,
                              "bytes_per_param": per_param, "param_diff_vs_lslm": diffs} if rank == 0 else {})}


def format_table(result: dict[str, Any]) -> str:
    """The losses per step side by side, then bytes per parameter per rank by owner and the parameter gaps."""
    if "skipped" in result:
        return f"DeepSpeed side by side: skipped ({result['skipped']})"
    names = list(result["losses"])
    lines = [f"{result['psi']:,} parameters, {result['world']} ranks, fp32 AdamW; loss per step:",
             f"{'step':>4} " + " ".join(f"{n:>16}" for n in names)]
    for i in range(result["steps"]):
        lines.append(f"{i:>4} " + " ".join(f"{result['losses'][n][i]:>16.7f}" for n in names))
    lines.append(f"\n{'bytes/param per rank':<22}" + " ".join(f"{o:>17}" for o in OWNERS) + f"{'total':>7}")
    for n in names:
        b = result["bytes_per_param"][n]
        lines.append(f"{n:<22}" + " ".join(f"{b[o]:>17.2f}" for o in OWNERS) + f"{sum(b.values()):>7.2f}")
    lines.append("largest parameter difference from lslm after the last step: " + ", ".join(
        f"{n} {d:.1e}" for n, d in result["param_diff_vs_lslm"].items() if n != "lslm zero3"))
    return "\n".join(lines)


def deepspeed_side_by_side(nproc: int = 2, steps: int = STEPS, timeout: float = 300.0) -> dict[str, Any]:
    """Launch :func:`worker` on ``nproc`` processes; return rank 0's numbers (``result["table"]``: them printed),
    or ``{"skipped": reason, "table": ...}`` where DeepSpeed cannot run here. The first call in a fresh
    environment takes no longer: DeepSpeed compiles nothing for ZeRO here (lslm.integrations.deepspeed_zero)."""
    from lslm.launcher.launch import launch

    ok, why = deepspeed_available()
    if not ok:
        result: dict[str, Any] = {"skipped": why}
    else:
        result = launch("lslm.demos.deepspeed_side_by_side:worker", nproc=nproc, timeout=timeout, output="none",
                        steps=steps)[0]
    return {**result, "table": format_table(result)}
