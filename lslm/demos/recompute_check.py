"""Activation recomputation measured: bytes one block keeps and matmul flops it adds, against Korthikanti et al. 2022.

For each mode of :func:`~lslm.tensor_parallel.recompute.apply_recompute` (``none``, ``selective``,
``full``) one GPT block runs forward and backward on a fixed input: the bytes it keeps for
backward are counted with :class:`~lslm.metrics.ActivationMemory` (fp32 CPU, float dropout noise),
its matmul flops with ``torch.utils.flop_counter.FlopCounterMode``; on CPU, glibc's allocator measures the
same bytes again (:func:`~lslm.metrics.malloc_delta.saved_by_allocator`: what the block's graph holds, nothing
registered), beside the random states each replayed region keeps (not a tensor autograd saves, so outside the
hooks' count and the formula). The formulas are
:func:`~lslm.metrics.activation_theory.recompute_layer_bytes` and
:func:`~lslm.metrics.activation_theory.recompute_extra_flops`. :func:`serial_rows` measures on one
process (:func:`allocator_rows`: the allocator's figure alone, at larger sizes), :func:`tp_worker` on each rank
of a tensor-parallel group (with or without sequence parallelism), :func:`table` prints the rows.
"""

from __future__ import annotations

import os
from typing import Any

import torch
from torch import nn
from torch.utils.flop_counter import FlopCounterMode

from lslm.metrics.activation_theory import recompute_extra_flops, recompute_layer_bytes
from lslm.metrics.activations import ActivationMemory
from lslm.metrics.malloc_delta import saved_by_allocator
from lslm.tensor_parallel.recompute import RECOMPUTE_MODES, apply_recompute, recompute

__all__ = ["AUTOCAST_DTYPES", "allocator_excess", "allocator_rows", "autocast_rows", "autocast_table", "measure_block",
           "serial_rows", "table", "tp_rows", "tp_worker"]


def measure_block(block: nn.Module, x: torch.Tensor, *, allocator: bool = True) -> dict[str, int | None]:
    """Bytes ``block(x)`` keeps for backward (its parameters left out) and matmul flops of forward + backward.

    ``allocator_bytes``: the same forward's graph measured by glibc's allocator (``None`` off glibc, off the
    CPU or with ``allocator=False``), run last so that first-call allocations are behind it; ``x`` is cloned
    inside the measured region, so an input the block keeps (full recomputation's) is counted as the hooks
    count it.
    """
    with ActivationMemory(block) as act:
        y = block(x)
    y.sum().backward()
    with FlopCounterMode(display=False) as flops:
        block(x).sum().backward()
    by_allocator = _allocator_bytes(block, x) if allocator and x.device.type == "cpu" else None
    return {"saved_bytes": act.bytes, "flops": flops.get_total_flops(), "allocator_bytes": by_allocator}


def _allocator_bytes(block: nn.Module, x: torch.Tensor) -> int | None:
    got, nodes = saved_by_allocator(lambda: block(x.clone()), repeats=3)
    del nodes
    return got


def _replay_state_bytes(mode: str, device: torch.device) -> int:
    # one ForwardState per replayed region (a block's attention core, or the block): the CPU generator's state,
    # and the device's on CUDA (a tensor-parallel tracker's streams add theirs: tp_rows measures no allocator figure)
    if mode == "none":
        return 0
    return torch.get_rng_state().nbytes + (torch.cuda.get_rng_state(device).nbytes if device.type == "cuda" else 0)


def _config(s: int, b: int, h: int, a: int, dropout: float) -> Any:
    from lslm.models.gpt import GPTConfig

    return GPTConfig(vocab_size=64, block_size=s, n_layer=1, n_head=a, n_embd=h, dropout=dropout)


def _rows(measured: dict[str, dict[str, Any]], s: int, b: int, h: int, a: int, t: int, sp: bool,
          options: dict[str, Any], device: torch.device) -> list[dict[str, Any]]:
    base = measured["none"]["flops"]
    return [{"mode": mode, "t": t, "sequence_parallel": sp, "s": s, "b": b, "h": h, "a": a,
             "saved_bytes": m["saved_bytes"], "allocator_bytes": m["allocator_bytes"],
             "replay_state_bytes": _replay_state_bytes(mode, device),
             "formula_bytes": recompute_layer_bytes(s, b, h, a, t, sp, mode=mode, **options),
             "extra_flops": m["flops"] - base, "formula_extra_flops": recompute_extra_flops(s, b, h, t, mode=mode)}
            for mode, m in measured.items()]


def serial_rows(s: int = 64, b: int = 2, h: int = 64, a: int = 4, *, dropout: float = 0.1,
                seed: int = 0) -> list[dict[str, Any]]:
    """One block of a serial GPT in each recompute mode: measured and formula bytes and extra flops, fp32 CPU."""
    from lslm.models.gpt import GPT

    measured = {}
    x = torch.randn(b, s, h, generator=torch.Generator().manual_seed(seed + 1))  # lslm: cpu-ok (serial, CPU demo)
    for mode in RECOMPUTE_MODES:
        torch.manual_seed(seed)
        model = apply_recompute(GPT(_config(s, b, h, a, dropout)).train(), mode)
        measured[mode] = measure_block(model.blocks[0], x.clone().requires_grad_())
    return _rows(measured, s, b, h, a, 1, False, dict(dropout=dropout > 0), x.device)


def allocator_rows(s: int = 128, b: int = 2, h: int = 128, a: int = 4, *, dropout: float = 0.1,
                   seed: int = 0) -> list[dict[str, Any]]:
    """Glibc's figure for one block's graph in each mode against the formula, without the hooks and flop counts of
    :func:`serial_rows` (cheap at larger sizes, where autograd's per-node bookkeeping is a smaller share).

    Rows: ``mode``, ``s``, ``b``, ``h``, ``a``, ``formula_bytes``, ``allocator_bytes`` (``None`` off glibc),
    ``replay_state_bytes``; :func:`allocator_excess` reads them.
    """
    from lslm.models.gpt import GPT

    x = torch.randn(b, s, h, generator=torch.Generator().manual_seed(seed + 1))  # lslm: cpu-ok (glibc: CPU only)
    x.requires_grad_()
    rows = []
    for mode in RECOMPUTE_MODES:
        torch.manual_seed(seed)
        block = apply_recompute(GPT(_config(s, b, h, a, dropout)).train(), mode).blocks[0]
        block(x.clone()).sum().backward()  # first-call allocations out of the way
        rows.append({"mode": mode, "s": s, "b": b, "h": h, "a": a,
                     "formula_bytes": recompute_layer_bytes(s, b, h, a, mode=mode, dropout=dropout > 0),
                     "allocator_bytes": _allocator_bytes(block, x), "replay_state_bytes": _replay_state_bytes(
                         mode, x.device)})
    return rows


def tp_worker(s: int = 32, b: int = 2, h: int = 32, a: int = 4, dropout: float = 0.1,
              seed: int = 0) -> list[dict[str, Any]]:
    """Launched on each rank: ``init_distributed(tp=world size)``, then :func:`tp_rows`."""
    from lslm.runtime import init_distributed

    ctx = init_distributed(tp=int(os.environ.get("WORLD_SIZE", "1")))
    return tp_rows(ctx, s, b, h, a, dropout=dropout, seed=seed)


def tp_rows(ctx: Any, s: int = 32, b: int = 2, h: int = 32, a: int = 4, *, dropout: float = 0.1,
            seed: int = 0) -> list[dict[str, Any]]:
    """:func:`serial_rows`' rows on this rank of ``ctx``'s TP group, without then with sequence parallelism
    (``ctx.rng`` is set up afresh for each model)."""
    from lslm.models.gpt import GPT
    from lslm.tensor_parallel.apply import apply_tensor_parallel

    t = ctx.tp_size
    rows = []
    for sp in (False, True):
        measured = {}
        for mode in RECOMPUTE_MODES:
            torch.manual_seed(seed)
            ctx.rng = None
            model = GPT(_config(s, b, h, a, dropout)).to(ctx.device).train()
            apply_recompute(apply_tensor_parallel(model, ctx, sequence_parallel=sp, rng_seed=1), mode, ctx)
            x = torch.randn(b, s, h, generator=torch.Generator().manual_seed(seed + 1))  # lslm: cpu-ok (moved next)
            x = x.to(ctx.device)
            if sp:  # the GPT runs sequence-first under sequence parallelism: this rank's (s/t, b, h) slice
                x = x.transpose(0, 1).chunk(t, dim=0)[ctx.tp_rank]
            measured[mode] = measure_block(model.blocks[0], x.contiguous().requires_grad_(), allocator=False)
        options = dict(dropout=dropout > 0, mask_bytes=4 if ctx.device.type == "cpu" else 1)
        rows += _rows(measured, s, b, h, a, t, sp, options, ctx.device)
    return rows


def table(rows: list[dict[str, Any]]) -> str:
    """A fixed-width table of :func:`serial_rows` / :func:`tp_worker` rows: per block, measured vs formula.

    With allocator figures (CPU, glibc), three more columns: ``allocator`` (the graph's bytes by glibc),
    ``replay state`` (the random states each replayed region keeps) and ``vs formula``, the allocator's excess
    over the formula after the replay state, in percent: what is left is autograd's nodes and chunk headers.
    """
    alloc = all(r.get("allocator_bytes") is not None for r in rows)
    head = (f"{'mode':<10}{'t':>3}{'SP':>4}{'saved B/block':>15}{'formula':>12}"
            + (f"{'allocator':>12}{'replay state':>14}{'vs formula':>12}" if alloc else "")
            + f"{'extra flops':>14}{'formula':>14}")
    lines = [head, "-" * len(head)]
    for r in rows:
        line = (f"{r['mode']:<10}{r['t']:>3}{'yes' if r['sequence_parallel'] else 'no':>4}"
                f"{r['saved_bytes']:>15,}{r['formula_bytes']:>12,}")
        if alloc:
            line += (f"{r['allocator_bytes']:>12,}{r['replay_state_bytes']:>14,}"
                     f"{allocator_excess(r):>+11.1%} ")
        lines.append(line + f"{r['extra_flops']:>14,}{r['formula_extra_flops']:>14,}")
    return "\n".join(lines)


def allocator_excess(row: dict[str, Any]) -> float:
    """(allocator bytes - replay state - formula) / formula for one row: the graph's own bookkeeping, relative."""
    return (row["allocator_bytes"] - row["replay_state_bytes"] - row["formula_bytes"]) / row["formula_bytes"]


#: The half-precision dtypes :func:`autocast_rows` runs under ``torch.autocast``.
AUTOCAST_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}


def _autocast_grads(model: nn.Module, x: torch.Tensor, dtype: torch.dtype | None, seed: int) -> dict[str, torch.Tensor]:
    torch.manual_seed(seed)  # the dropout masks' stream, the same for every variant
    with torch.autocast("cpu", dtype=dtype or torch.bfloat16, enabled=dtype is not None):
        _, loss = model(x[:, :-1], x[:, 1:])
    loss.backward()  # outside autocast, as torch's AMP recipe does: the replays run here
    return {n: p.grad.clone() for n, p in model.named_parameters()}


def _replayed_outside_autocast(inner: Any) -> Any:
    def run(*inputs: torch.Tensor) -> torch.Tensor:
        # recompute() runs the forward without gradients and the replay with them: switch autocast off there only
        with torch.autocast("cpu", enabled=torch.is_autocast_enabled("cpu") and not torch.is_grad_enabled()):
            return inner(*inputs)
    return run


def autocast_rows(precisions: tuple[str, ...] = ("bf16", "fp16"), *, batch: int = 2, dropout: float = 0.1,
                  seed: int = 0, **overrides: Any) -> list[dict[str, Any]]:
    """Gradients of the course GPT (``GPTConfig.tiny(**overrides)``) with each recompute mode (and with
    ``torch.utils.checkpoint`` on the blocks) against those without recomputation, forward under CPU
    ``torch.autocast`` of each precision (``"fp32"``: no autocast), backward outside it.

    One row per (precision, mode): ``max_abs_diff`` (the largest ``|g - g_none|`` over all parameters),
    ``max_rel_diff`` (the worst tensor's ``max |g - g_none| / max |g_none|``) and ``identical`` (every gradient
    equal bit for bit). The mode ``"full, fp32 replay"`` is the negative control: :func:`recompute` on the
    blocks with the replay forced out of autocast, what lslm's replays did before they re-entered the
    forward's autocast.
    """
    from functools import partial

    from torch.utils.checkpoint import checkpoint

    from lslm.models.gpt import GPT, GPTConfig

    config = GPTConfig.tiny(dropout=dropout, **overrides)
    x = torch.randint(0, config.vocab_size, (batch, config.block_size + 1),  # lslm: cpu-ok (CPU autocast only)
                      generator=torch.Generator().manual_seed(seed + 1))
    rows = []
    for precision in precisions:
        dtype = None if precision == "fp32" else AUTOCAST_DTYPES[precision]
        grads = {}
        for mode in (*RECOMPUTE_MODES, "torch checkpoint", "full, fp32 replay"):
            torch.manual_seed(seed)
            model = GPT(config).train()
            if mode == "torch checkpoint":  # torch's own, on the same blocks: records and re-enters autocast
                for block in model.blocks:
                    block.forward = partial(checkpoint, block.forward, use_reentrant=False)
            elif mode == "full, fp32 replay":
                for block in model.blocks:
                    block.forward = partial(recompute, _replayed_outside_autocast(block.forward))
            else:
                apply_recompute(model, mode)
            grads[mode] = _autocast_grads(model, x, dtype, seed + 2)
        base = grads["none"]
        for mode in ("selective", "full", "torch checkpoint", "full, fp32 replay"):
            diffs = {n: (grads[mode][n].float() - base[n].float()).abs().max().item() for n in base}
            rel = max(diffs[n] / base[n].abs().max().item() for n in base if base[n].abs().max() > 0)
            rows.append({"precision": precision, "mode": mode, "max_abs_diff": max(diffs.values()),
                         "max_rel_diff": rel,
                         "identical": all(torch.equal(grads[mode][n], base[n]) for n in base)})
    return rows


def autocast_table(rows: list[dict[str, Any]], *, digits: bool = True) -> str:
    """:func:`autocast_rows` as a table; ``digits=False`` prints only whether each gradient is bit-identical (the
    differences' digits depend on the CPU's kernels)."""
    head = f"{'precision':<10}{'mode':<18}" + (f"{'max |dg|':>12}{'worst rel':>12}" if digits else "") + \
        f"{'bit-identical':>15}"
    lines = [head, "-" * len(head)]
    for r in rows:
        nums = f"{r['max_abs_diff']:>12.2e}{r['max_rel_diff']:>12.2%}" if digits else ""
        lines.append(f"{r['precision']:<10}{r['mode']:<18}{nums}{'yes' if r['identical'] else 'no':>15}")
    return "\n".join(lines)
