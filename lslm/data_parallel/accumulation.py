"""Gradient accumulation from first principles, and the global batch identity ``gbs = mbs x k x dp``.

``loss.backward()`` *adds* into ``p.grad``; it never overwrites. So ``k`` backward
passes over ``k`` micro-batches leave the sum of their gradients, and dividing each
micro-batch loss by ``k`` turns that sum into the mean: the gradient of the whole
batch, computed with the memory of one micro-batch. ``zero_grad`` starts the next
step from zero. Data parallelism does the same across processes: ``dp`` ranks each
accumulate ``k`` micro-batches of ``mbs`` sequences, and the all-reduce averages the
ranks, so every ``(mbs, k, dp)`` with the same ``gbs = mbs * k * dp`` computes the same
gradient (up to fp32 rounding: sums are taken in another order).

One condition: every micro-batch must count the same number of tokens (true here: fixed-length
blocks). With padding or packed variable lengths, divide by the *global* token count
instead of by ``k`` (and by ``dp``), or short micro-batches get too much weight.
"""

from __future__ import annotations

import contextlib
from typing import Any

import torch
from torch import nn

from lslm.data.dataset import token_blocks
from lslm.models.gpt import GPT, GPTConfig

__all__ = ["accumulate", "check", "combinations", "flat_grad", "gbs_check", "reference_setup",
           "serial_identity"]

# fp32 gradients of the same mean taken in another summation order agree to a few ulps
# of the largest entries; 1e-5 of the largest gradient entry leaves a wide margin above
# that (measured: ~1e-7) while any real mistake (a missing / k, a rank's data twice) is O(1).
REL_TOL = 1e-5


def flat_grad(model: nn.Module) -> torch.Tensor:
    """All parameter gradients of ``model`` as one flat vector (a copy)."""
    return torch.cat([p.grad.reshape(-1) for p in model.parameters()]).clone()


def accumulate(model: nn.Module, x: torch.Tensor, y: torch.Tensor, mbs: int,
               no_sync: Any = None) -> torch.Tensor:
    """Gradient of the mean loss over ``(x, y)`` computed in micro-batches of ``mbs`` rows; returns the loss.

    ``model(x, y)`` returns ``(logits, loss)`` (the lslm GPT, or DDP around it). Each
    micro-batch loss is divided by ``k = len(x) / mbs`` before ``backward``, which adds
    into ``.grad``. ``no_sync``: DDP's ``model.no_sync`` to skip the all-reduce on all
    but the last micro-batch (the gradients stay local until then).
    """
    if mbs < 1 or len(x) % mbs:
        raise ValueError(f"micro-batch size {mbs} must be >= 1 and divide the batch of {len(x)} rows")
    k = len(x) // mbs
    for p in model.parameters():
        p.grad = None  # zero_grad(set_to_none=True): the sum below starts from nothing
    total = torch.zeros((), device=x.device)
    for j in range(k):
        last = j == k - 1
        with contextlib.nullcontext() if last or no_sync is None else no_sync():
            _, loss = model(x[j * mbs:(j + 1) * mbs], y[j * mbs:(j + 1) * mbs])
            (loss / k).backward()  # adds into p.grad
        total += loss.detach() / k
    return total


def combinations(gbs: int, dp: int = 1) -> list[tuple[int, int, int]]:
    """Every ``(mbs, k, dp)`` with ``mbs * k * dp == gbs``, largest micro-batch first."""
    if dp < 1 or gbs % dp:
        raise ValueError(f"the global batch {gbs} must be a positive multiple of dp={dp}")
    per_rank = gbs // dp
    return [(mbs, per_rank // mbs, dp) for mbs in range(per_rank, 0, -1) if per_rank % mbs == 0]


def reference_setup(gbs: int = 8, block_size: int = 32, seed: int = 0, n_layer: int = 2,
                    n_embd: int = 64) -> tuple[GPT, torch.Tensor, torch.Tensor]:
    """A small lslm GPT (from ``seed``) and one global batch of ``gbs`` corpus blocks ``(x, y)``."""
    torch.manual_seed(seed)
    model = GPT(GPTConfig(vocab_size=1024, block_size=block_size, n_layer=n_layer, n_head=4, n_embd=n_embd))
    blocks = token_blocks(block_size, 1024)[:gbs]["input_ids"]
    return model, blocks[:, :-1], blocks[:, 1:]


def _rel_diff(a: torch.Tensor, ref: torch.Tensor) -> float:
    return ((a - ref).abs().max() / ref.abs().max()).item()


def serial_identity(gbs: int = 8, **setup: Any) -> list[dict[str, Any]]:
    """In one process (dp = 1): the gradient for every ``(mbs, k)`` against the whole batch at once.

    Returns one row per combination: ``mbs``, ``k``, ``dp``, ``loss`` and ``rel_diff`` =
    max |g - g_ref| / max |g_ref|.
    """
    model, x, y = reference_setup(gbs, **setup)
    accumulate(model, x, y, gbs)
    ref = flat_grad(model)
    rows = []
    for mbs, k, dp in combinations(gbs):
        loss = accumulate(model, x, y, mbs)
        rows.append({"mbs": mbs, "k": k, "dp": dp, "loss": loss.item(), "rel_diff": _rel_diff(flat_grad(model), ref)})
    return rows


def gbs_check(gbs: int = 8, **setup: Any) -> list[dict[str, Any]]:
    """The identity across the processes of the joined group: torch DDP with ``no_sync`` for every ``(mbs, k, dp)``.

    Rank ``r`` takes rows ``[r * gbs/dp, (r+1) * gbs/dp)`` of the global batch and
    accumulates ``k`` micro-batches, all-reducing only on the last. Every rank also
    computes the whole-batch gradient alone (no communication) as the reference, and
    returns the rows of :func:`serial_identity`, plus whether the ranks ended identical.
    """
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    rank, world_size = dist.get_rank(), dist.get_world_size()
    model, x, y = reference_setup(gbs, **setup)
    accumulate(model, x, y, gbs)
    ref = flat_grad(model)
    ddp = DDP(model)
    per_rank = gbs // world_size
    xr, yr = (t[rank * per_rank:(rank + 1) * per_rank] for t in (x, y))
    rows = []
    for mbs, k, dp in combinations(gbs, world_size):
        loss = accumulate(ddp, xr, yr, mbs, no_sync=ddp.no_sync)
        dist.all_reduce(loss)  # the global loss, for the table: mean of the ranks' means
        g = flat_grad(model)
        gathered = [torch.empty_like(g) for _ in range(world_size)]
        dist.all_gather(gathered, g)
        rows.append({"mbs": mbs, "k": k, "dp": dp, "loss": loss.item() / world_size, "rel_diff": _rel_diff(g, ref),
                     "ranks_equal": all(torch.equal(gathered[0], o) for o in gathered[1:])})
    return rows


def check(rows: list[dict[str, Any]], tol: float = REL_TOL) -> None:
    """Raise ``AssertionError`` naming the first combination whose gradient is off by more than ``tol``."""
    for r in rows:
        if not r["rel_diff"] <= tol or not r.get("ranks_equal", True):
            raise AssertionError(f"(mbs={r['mbs']}, k={r['k']}, dp={r['dp']}): relative gradient difference "
                                 f"{r['rel_diff']:.2e} > {tol:g}, or ranks differ ({r.get('ranks_equal')})")
