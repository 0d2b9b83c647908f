"""Workers for tests/test_tp_random.py: dropout masks on each stream, as every rank of a tp grid draws them.

One launch per world size (:func:`suite`); each rank returns its masks as ``"0"/"1"``
strings and the test process compares them across ranks.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from lslm.runtime import init_distributed
from lslm.tensor_parallel.random import DEFAULT_RNG, TENSOR_PARALLEL_RNG, fork_rng_in_forward, model_parallel_seed

N = 64  # mask length: two independent masks agree with probability 2**-64


def _mask(device: torch.device) -> str:
    kept = F.dropout(torch.ones(N, device=device), p=0.5).ne(0)
    return "".join("1" if v else "0" for v in kept.tolist())


class ToyAttention(nn.Module):
    """Like lslm's GPT attention: dropout on the (sharded) heads inline, then a (replicated) residual dropout."""

    def __init__(self) -> None:
        super().__init__()
        self.resid_dropout = nn.Dropout(0.5)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return F.dropout(x, p=0.5), self.resid_dropout(x)


def _bits(t: torch.Tensor) -> str:
    return "".join("1" if v else "0" for v in t.ne(0).tolist())


def suite(tp: int, dp: int, seed: int) -> dict[str, Any]:
    """This rank's masks: default and tp streams, a reseeded repeat, and a hooked attention-like module."""
    with init_distributed(tp=tp, dp=dp) as ctx:
        dev = ctx.device
        tracker = model_parallel_seed(ctx, seed)
        default = _mask(dev)
        with tracker.fork(TENSOR_PARALLEL_RNG):
            tp_first = _mask(dev)
        default_next = _mask(dev)

        again = model_parallel_seed(ctx, seed)  # a second run with the same seed
        repeat = {"default": _mask(dev)}
        with again.fork(TENSOR_PARALLEL_RNG):
            repeat["tp"] = _mask(dev)

        model_parallel_seed(ctx, seed)
        attn = ToyAttention()
        handles = [*fork_rng_in_forward(attn, ctx.rng), *fork_rng_in_forward(attn.resid_dropout, ctx.rng,
                                                                              DEFAULT_RNG)]
        core, resid = attn(torch.ones(N, device=dev))
        after = _mask(dev)  # the default stream's next draw: the residual dropout took its first
        for h in handles:
            h.remove()
        return {"rank": ctx.rank, "tp_rank": ctx.tp_rank, "dp_rank": ctx.dp_rank, "default": default,
                "tp": tp_first, "default_next": default_next, "repeat": repeat,
                "hooked": {"core": _bits(core), "resid": _bits(resid), "after": after}}
