"""Workers for tests/test_pipeline_2bw.py: PipeDream-2BW on p processes against the serial delayed-update rule.

One launch per pipeline size: every rank trains the same tiny GPT with :func:`run_2bw`, then
simulates both update rules serially itself from the same seed and data (delay 1 = 2BW,
delay 0 = PipeDream-Flush / mini-batch SGD), and returns the largest difference of its stage's
parameters from each, the losses, the version trace, the weight-buffer bytes and the ledger's
pipeline p2p records.
"""

from __future__ import annotations

import copy
import os
from typing import Any

import torch

from lslm.models.gpt import GPT, GPTConfig
from lslm.pipeline.partition import split_gpt
from lslm.pipeline.pipedream_2bw import run_2bw, simulate_delayed_sgd
from lslm.runtime import init_distributed

SEED, VOCAB, T, N_LAYER, LR = 1234, 256, 16, 4, 0.5


def config() -> GPTConfig:
    """The tiny GPT every rank builds (4 blocks: up to 4 stages)."""
    return GPTConfig.tiny(n_layer=N_LAYER, block_size=T, vocab_size=VOCAB)


def batches(num_batches: int, rows: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """``num_batches`` batches of ``rows`` random token sequences (next-token targets), the same on every rank."""
    g = torch.Generator().manual_seed(99)
    out = []
    for _ in range(num_batches):
        tok = torch.randint(0, VOCAB, (rows, T + 1), generator=g)
        out.append((tok[:, :-1], tok[:, 1:]))
    return out


def suite(microbatches: int, num_batches: int, rows: int, **_: Any) -> dict[str, Any]:
    """Run 2BW on a pure pipeline grid (pp = world size) and compare with the serial simulations."""
    ctx = init_distributed(pp=int(os.environ.get("WORLD_SIZE", "1")))
    with ctx:
        torch.manual_seed(SEED)
        model = GPT(config())
        start = copy.deepcopy(model)
        data = batches(num_batches, rows)
        ctx.comm.ledger.reset()
        res = run_2bw(model, ctx, data, microbatches=microbatches, lr=LR)
        p2p = [[r.op, r.label, r.nbytes, r.peer] for r in ctx.comm.ledger.records if r.label.startswith("pp ")]
        sims = {d: simulate_delayed_sgd(copy.deepcopy(start), data, lr=LR, microbatches=microbatches, delay=d)
                for d in (0, 1)}
        stage = split_gpt(model, ctx.pp_size)[ctx.pp_rank]
        diffs = {d: max((p.detach().cpu() - sims[d].states[-1][name]).abs().max().item()
                        for name, p in stage.model_names()) for d in sims}
        # The 2BW trajectory also really moved (its final state is not the start).
        moved = max((p.detach().cpu() - start.get_parameter(name)).abs().max().item()
                    for name, p in stage.model_names())
        out = {"rank": ctx.rank, "stage": res.stage, "losses": res.losses, "sim_losses": sims[1].losses,
               "flush_losses": sims[0].losses, "diff_2bw": diffs[1], "diff_flush": diffs[0], "moved": moved,
               "trace": res.trace, "updates": res.updates, "version_bytes": res.version_bytes,
               "stage_bytes": res.stage_bytes, "grad_bytes": res.grad_bytes,
               "pipedream_stash_bytes": res.pipedream_stash_bytes,
               "stage_numel": sum(p.numel() for p in stage.parameters()), "p2p": p2p}
    return out
