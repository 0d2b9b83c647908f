"""HSDP measured: ZeRO with the data axis split into ``dp_replicate x dp_shard``, one row per split.

:func:`hsdp_table` launches :func:`worker` (``lslm.launch``, ``nproc`` ranks) once: for each ``dp_shard`` it
trains the same GPT from one seed on the same tokens with lslm's
:class:`~lslm.zero.optimizer.ZeroOptimizer` over a grid ``RankGrid(nproc, dp_shard=k)``
(:meth:`~lslm.runtime.context.ParallelContext.with_grid`: several splits in one process group) and returns,
from rank 0, the layout (the shard and replicate groups), the model-state bytes a rank holds per parameter,
and one step's bytes over each group from the ledger, next to what the calculator (:mod:`lslm.plan`) predicts
for the same layout. ``dp_shard = nproc`` is plain ZeRO; ``dp_shard = 1`` keeps whole states on every rank
(DDP's memory) and all-reduces whole gradients across the replicas (DDP's traffic); in between, memory
follows ``dp_shard`` and the replicas exchange ``1/dp_shard`` of DDP's gradient bytes.

The model's sizes are multiples of the rank counts used (1, 2, 4), so no bucket is padded and the
calculator's bytes equal the ledger's exactly.
"""

from __future__ import annotations

from typing import Any

import torch

from lslm.launcher.launch import launch
from lslm.metrics.held import held_by_owner
from lslm.models.gpt import GPT, GPTConfig
from lslm.plan import Layout, ModelSpec, estimate, hardware_presets
from lslm.plan.states import model_states
from lslm.runtime.startup import init_distributed
from lslm.zero.optimizer import GATHER_LABEL, REDUCE_SCATTER_LABEL, REPLICATE_LABEL, ZeroOptimizer

__all__ = ["MODEL", "ROWS", "format_hsdp_table", "hsdp_table", "worker"]

#: The serial recipe's GPT (1024-token vocabulary, 64-token blocks, 2 blocks of width 64).
MODEL = dict(vocab_size=1024, block_size=64, n_layer=2, n_head=4, n_embd=64)
ROWS = 2  # rows per rank per step
BUCKET_MB = 0.25


def _tokens(step: int, world: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(1000 + step)
    shape = (ROWS * world, MODEL["block_size"] + 1)
    return torch.randint(0, MODEL["vocab_size"], shape, generator=g)  # lslm: cpu-ok (host RNG, then moved)


def worker(dp_shards: list[int], stage: int = 3, steps: int = 2) -> list[dict[str, Any]]:
    """One rank: for each ``dp_shard``, ``steps`` fp32 AdamW steps of ZeRO ``stage`` on that HSDP grid; per split
    this rank's layout, model-state bytes after the last step and that step's ledger bytes by group."""
    rows = []
    with init_distributed() as base:
        world = base.world_size
        for k in dp_shards:
            ctx = base.with_grid(dp_shard=k)
            torch.manual_seed(0)
            model = GPT(GPTConfig(**MODEL)).to(ctx.device)
            zero = ZeroOptimizer(model, torch.optim.AdamW(model.parameters(), lr=1e-3), ctx, stage=stage,
                                 bucket_cap_mb=BUCKET_MB)
            ledger = ctx.comm.ledger
            losses = []
            for step in range(steps):
                since = len(ledger.records)
                share = _tokens(step, world).to(ctx.device).chunk(world)[ctx.rank]
                zero.zero_grad()
                loss = model(share[:, :-1], share[:, 1:])[1]
                zero.backward(loss)
                zero.step()
                losses.append(loss.item())
            records = ledger.records[since:]
            shard = [r for r in records if r.label in (REDUCE_SCATTER_LABEL, GATHER_LABEL)]
            across = [r for r in records if r.label == REPLICATE_LABEL]
            held = held_by_owner(model, zero)
            rows.append({
                "dp_shard": k, "dp_replicate": ctx.dp_replicate_size, "shard_group": ctx.group_ranks("dp_shard"),
                "replicate_group": ctx.group_ranks("dp_replicate"), "shard_rank": ctx.dp_shard_rank,
                "num_params": sum(int(torch.Size(s).numel()) for s in zero.shapes), "held": held,
                "pieces": len(zero.layout.pieces), "bucket_params": [z - a - pad for a, z, _, pad in zero.buckets],
                "shard_bytes": sum(r.nbytes for r in shard), "shard_sent": sum(r.bus_bytes for r in shard),
                "replicate_bytes": sum(r.nbytes for r in across), "replicate_sent": sum(r.bus_bytes for r in across),
                "losses": losses})
    return rows


def hsdp_table(nproc: int = 4, dp_shards: tuple[int, ...] | None = None, *, stage: int = 3, steps: int = 2,
               timeout: float = 300.0) -> list[dict[str, Any]]:
    """Launch :func:`worker` on ``nproc`` ranks; one row per ``dp_shard`` (default: every divisor of ``nproc``,
    largest first), rank 0's numbers and the calculator's beside them.

    Columns: ``layout`` ("2 x 2": dp_replicate x dp_shard), ``shard group`` / ``replicate group`` (rank 0's),
    ``bytes/param`` (model states rank 0 holds after a step, Adam's 4-byte step per piece aside) and
    ``plan bytes/param`` (:func:`lslm.plan.states.model_states`); per step, the bytes rank 0 *sends* over each
    group (the ledger's payloads times the ring factor: ``(n-1)/n`` for reduce-scatter and all-gather,
    ``2(n-1)/n`` for all-reduce; nothing on a one-rank group): ``sent in shard group`` and ``sent across
    replicas``, each beside the calculator's (``plan ...``, :attr:`lslm.plan.comm.Collective.wire_bytes`), and
    ``DDP sends`` (``2(N-1)/N · 4Ψ``: the all-reduce of every fp32 gradient) for scale; ``loss``: rank 0's last
    loss, the same for every split (same seed, same tokens).
    """
    if isinstance(nproc, bool) or not isinstance(nproc, int) or nproc < 1:
        raise ValueError(f"nproc must be a positive int, got {nproc!r}")
    shards = tuple(k for k in range(nproc, 0, -1) if nproc % k == 0) if dp_shards is None else tuple(dp_shards)
    bad = [k for k in shards if isinstance(k, bool) or not isinstance(k, int) or k < 1 or nproc % k]
    if bad:
        raise ValueError(f"dp_shard={bad[0]!r} does not divide nproc={nproc}; choose among "
                         f"{[k for k in range(1, nproc + 1) if nproc % k == 0]}")
    rows = launch("lslm.demos.hsdp_demo:worker", nproc=nproc, timeout=timeout, output="none",
                  dp_shards=list(shards), stage=stage, steps=steps)[0]
    spec = ModelSpec.from_gpt_config(GPTConfig(**MODEL), micro_batch=ROWS, global_batch=ROWS * nproc)
    hw = hardware_presets()["h100-sxm"]
    table = []
    for row in rows:
        k, psi = row["dp_shard"], row["num_params"]
        layout = Layout(dp=nproc, dp_shard=k, zero=stage, precision="fp32", bucket_mb=BUCKET_MB)
        states = model_states(psi, layout, buckets=row["bucket_params"], rank=row["shard_rank"]).device_bytes
        comm = estimate(spec, layout, hw).comm["dp"].collectives
        held = sum(row["held"].values()) - 4 * row["pieces"]
        table.append({
            "layout": f"{row['dp_replicate']} x {k}", "shard group": row["shard_group"],
            "replicate group": row["replicate_group"], "bytes/param": held / psi, "plan bytes/param": states / psi,
            "sent in shard group": row["shard_sent"],
            "plan shard": sum(c.wire_bytes for c in comm if c.axis != "dp_replicate"),
            "sent across replicas": row["replicate_sent"],
            "plan replicas": sum(c.wire_bytes for c in comm if c.axis == "dp_replicate"),
            "DDP sends": 2 * (nproc - 1) / nproc * 4 * psi, "loss": row["losses"][-1]})
    return table


def format_hsdp_table(rows: list[dict[str, Any]]) -> str:
    """:func:`hsdp_table`'s rows as fixed-width text (bytes as integers, bytes/param with one decimal)."""
    def cell(v: Any) -> str:
        if isinstance(v, list):
            return "{" + ", ".join(map(str, v)) + "}"
        if isinstance(v, float) and v == 0:
            return "0"
        if isinstance(v, float):
            return f"{v:.4f}" if v < 100 and v != int(v) else f"{v:,.0f}" if v >= 100 else f"{v:.1f}"
        return str(v)

    columns = list(rows[0])
    cells = [[cell(row[c]) for c in columns] for row in rows]
    widths = [max(len(c), *(len(r[i]) for r in cells)) for i, c in enumerate(columns)]
    lines = ["  ".join(c.rjust(w) for c, w in zip(columns, widths))]
    lines += ["  ".join(v.rjust(w) for v, w in zip(r, widths)) for r in cells]
    return "\n".join(lines)
