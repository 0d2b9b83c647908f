"""Serial, lslm and DTensor tensor parallelism side by side on one tiny GPT: what notebook 05 launches.

:func:`compare_worker` is the launch target (``lslm.launch("lslm.demos.dtensor_compare:compare_worker", nproc=2)``,
tp = world size); :func:`compare_with_serial` does the work on a given :class:`~lslm.runtime.ParallelContext`, so
tests can call it inside their own workers. The DTensor side (``parallelize_gpt``, ``dtensor_loss``, the comm
counts) is the library's :mod:`lslm.tensor_parallel.dtensor_reference`.
"""

from __future__ import annotations

import os
from collections import Counter
from typing import Any

import torch

from lslm.models.gpt import GPT, GPTConfig
from lslm.runtime import init_distributed
from lslm.runtime.context import ParallelContext
from lslm.tensor_parallel.apply import apply_tensor_parallel
from lslm.tensor_parallel.cross_entropy import vocab_parallel_cross_entropy
from lslm.tensor_parallel.dtensor_reference import dtensor_comm_counts, dtensor_loss, full_parameters, parallelize_gpt
from lslm.tensor_parallel.grads import sync_tensor_parallel_grads

__all__ = ["compare_with_serial", "compare_worker"]


def compare_with_serial(ctx: ParallelContext, steps: int = 3, seed: int = 0) -> dict[str, Any]:
    """A tiny GPT trained serially, with lslm TP and with DTensor TP over ``ctx``'s TP group.

    ``steps`` SGD-momentum steps from one seed on the same batches, with sequence
    parallelism ``"off"`` and ``"on"``. For each: the largest loss difference of each
    parallel model from the serial one, DTensor's largest final weight difference, and one
    transformer layer's collectives in one step, by lslm's ledger and by ``CommDebugMode``
    (:func:`dtensor_comm_counts`), as ``{"op phase": calls}``. Empties ``ctx.comm.ledger``.
    """
    cfg = GPTConfig.tiny(vocab_size=256)
    g = torch.Generator().manual_seed(seed)
    data = [torch.randint(0, cfg.vocab_size, (4, 17),
                          generator=g).to(ctx.device)  # lslm: cpu-ok (seeded, then moved)
            for _ in range(steps)]

    def train(kind: str, sp: bool = False) -> tuple[GPT, list[float]]:
        torch.manual_seed(seed)
        model = GPT(cfg).to(ctx.device)
        if kind != "serial":
            model = (apply_tensor_parallel if kind == "lslm" else parallelize_gpt)(model, ctx, sequence_parallel=sp)
        opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9, foreach=False)
        losses = []
        for x, y in ((tok[:, :-1], tok[:, 1:]) for tok in data):
            opt.zero_grad()
            if kind == "dtensor":
                loss = dtensor_loss(model, x, y, backward=True)
            else:
                loss = (vocab_parallel_cross_entropy(model(x)[0], y, ctx, vocab_size=cfg.vocab_size)
                        if kind == "lslm" else model(x, y)[1])
                loss.backward()
                sync_tensor_parallel_grads(model, ctx)  # nothing to do for the serial model
            opt.step()
            losses.append(loss.item())
        return model, losses

    serial, want = train("serial")
    ref, out = dict(serial.named_parameters()), {"tp": ctx.tp_size}
    for sp in (False, True):
        ctx.comm.ledger.reset()
        _, ours = train("lslm", sp)
        first = ctx.comm.ledger.records[: len(ctx.comm.ledger.records) // steps]  # one step's records
        # "blocks.0.attn.c_attn regather bwd" -> "all_gather regather bwd"
        mine = Counter(f"{r.op} {r.label.split(' ', 1)[1]}" for r in first if r.label.startswith("blocks.0."))
        model, theirs = train("dtensor", sp)
        got = full_parameters(model)
        found = dtensor_comm_counts(model, data[0][:, :-1], data[0][:, 1:])
        out["on" if sp else "off"] = {
            "lslm_vs_serial": max(abs(a - b) for a, b in zip(ours, want)),
            "dtensor_vs_serial": max(abs(a - b) for a, b in zip(theirs, want)),
            "dtensor_weights_vs_serial": max((got[n] - p.detach()).abs().max().item() for n, p in ref.items()),
            "lslm_layer": dict(sorted(mine.items())),
            "dtensor_layer": dict(sorted((f"{op} {ph[0]}wd", n)  # forward -> fwd, backward -> bwd
                                         for ph, ops in found["per_layer"].items() for op, n in ops.items())),
        }
    return out


def compare_worker(steps: int = 3, seed: int = 0) -> dict[str, Any]:
    """Launch target (tp = world size) running :func:`compare_with_serial`; what notebook 05 launches."""
    with init_distributed(tp=int(os.environ.get("WORLD_SIZE", "1")), seed=seed) as ctx:
        return compare_with_serial(ctx, steps, seed)
