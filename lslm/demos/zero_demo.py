"""ZeRO measured: what notebook 08 launches (one job for every entry) and what it runs in one process.

``lslm.launch("lslm.demos.zero_demo:suite", nproc=2)`` trains the same GPT from one seed, on the
same tokens (each rank its share of every batch), fp32 AdamW, once per *entry*: torch DDP, lslm's
:class:`~lslm.zero.optimizer.ZeroOptimizer` at stages 1, 2, 3 (and 3 with CPU offload, and 3 with
each block kept gathered from its forward to its backward), torch's ``ZeroRedundancyOptimizer``
and FSDP2's ``fully_shard`` (per block, then the root: the same units as lslm's stage 3). Every
rank returns, per entry: the losses, the model-state bytes it holds after a step by owner, the
bytes its lslm collectives moved in one step (from the ledger), offload bytes, stage 3's
``max_buckets_gathered``, and for stage 3 one step's gathers and reduce-scatters with issue and
completion times (``ledger.timed()``) beside each block's forward and backward span on the same clock (module and
tensor hooks, :class:`BlockSpans`). Rank 0 adds how far every entry's parameters are from
DDP's and stage 3's from FSDP2's. With ``trace=DIR`` the stage-3 step before that one also runs under
``torch.profiler`` on every rank (:class:`~lslm.metrics.trace.StepTracer`: ``DIR/zero3-rank<r>.json``, the
ledger's collectives named in it), for :mod:`lslm.metrics.overlap` and :func:`lslm.plot.trace.plot_trace`.

:func:`fake_world` and :func:`state_bytes_at_scale` count the same bytes for one rank of 8, 16
or 64 in this process, with PyTorch's fake process group (collectives return without moving
data; partitioning is real); :func:`zero3_memory_timeline` records one stage-3 step of rank 0 of 2 there
under PyTorch's memory profiler (the bytes by category over the step's time: allocations are real too). That
backend lives in ``torch.testing._internal``, an internal API that may change between PyTorch releases: this
module is lslm's one wrapper of it outside the tests.
"""

from __future__ import annotations

import contextlib
import copy
import os
import time
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from lslm.metrics.held import held_by_owner
from lslm.models.gpt import GPT, GPTConfig
from lslm.runtime.fake_world import fake_world

__all__ = ["ENTRIES", "MODEL", "PICTURE_ENTRIES", "BlockSpans", "fake_world", "state_bytes_at_scale", "suite",
           "whole_picture", "zero3_memory_timeline"]

#: The course's GPT (the serial recipe's 1024-token vocabulary, 64-token blocks) with 4 blocks instead of 2, so that
#: stage 3 has more units than it keeps gathered at once, and width 60 instead of 64, so that parameter sizes are
#: not all multiples of the rank counts and padding shows.
MODEL = dict(vocab_size=1024, block_size=64, n_layer=4, n_head=4, n_embd=60)
ROWS = 2  # rows per rank per step
STEPS = 4
ENTRIES = ("ddp", "zero1", "zero2", "zero3", "zero3-keep", "zero3-offload", "torch-zero1", "fsdp2")
LR = 1e-3


def _groups(net: nn.Module) -> list[dict[str, Any]]:
    params = [p for p in net.parameters() if p.requires_grad]
    return [{"params": [p for p in params if p.dim() >= 2], "weight_decay": 0.1},
            {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0}]


def _adamw(net: nn.Module) -> torch.optim.AdamW:
    return torch.optim.AdamW(_groups(net), lr=LR, betas=(0.9, 0.95), foreach=False)


def _build(kind: str, serial: GPT, ctx: Any) -> tuple[nn.Module, Any, Any]:
    """(model, optimizer, step(x, y) -> loss) of one entry."""
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.optim import ZeroRedundancyOptimizer
    from torch.nn.parallel import DistributedDataParallel

    from lslm.zero import ZeroOptimizer

    net = copy.deepcopy(serial)
    if kind.startswith("zero"):
        zero = ZeroOptimizer(net, _adamw(net), ctx, stage=int(kind[4]), offload="cpu" if "offload" in kind else None,
                             reshard_after_forward="keep" not in kind)

        def step(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
            zero.zero_grad()
            _, loss = net(x, y)
            zero.backward(loss)
            zero.step()
            return loss.detach()
        return net, zero, step
    if kind in ("ddp", "torch-zero1"):
        module: nn.Module = DistributedDataParallel(net)
        opt: Any = (_adamw(net) if kind == "ddp" else
                    ZeroRedundancyOptimizer(_groups(net), optimizer_class=torch.optim.AdamW, lr=LR,
                                            betas=(0.9, 0.95), foreach=False))
    else:
        for block in net.blocks:
            fully_shard(block)
        module = fully_shard(net)
        opt = _adamw(net)

    def torch_step(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        opt.zero_grad(set_to_none=True)
        _, loss = module(x, y)
        loss.backward()
        opt.step()
        return loss.detach()
    return net, opt, torch_step


class BlockSpans:
    """Each block's forward and backward span (seconds since ``t0``, :func:`time.perf_counter`'s clock, the ledger's),
    recorded by hooks while ``on``, around a ZeRO-3 wrapper's own hooks so that the spans are compute: a forward span
    starts after the block's gather was waited for and ends before the block is freed; a backward span starts at the
    gradient of the block's output once its re-gather was waited for, and ends at the gradient of its input, before
    the wait for the previous block's gather. Register after the wrapper."""

    def __init__(self, blocks: nn.ModuleList) -> None:
        self.t0 = 0.0
        self.on = False
        self.spans: list[dict[str, Any]] = []
        self.handles = []
        n = len(blocks)
        for i, block in enumerate(blocks):
            self.handles.append(block.register_forward_pre_hook(self._pre(i)))
            # before the wrapper's post-forward hook: the next block's backward ends before this block's re-gather
            self.handles.append(block.register_forward_hook(self._post(i, n), prepend=True))
            # after it: this block's backward begins after its re-gather
            self.handles.append(block.register_forward_hook(self._arm_backward(i)))

    def _now(self) -> float:
        return time.perf_counter() - self.t0

    def _begin(self, i: int, phase: str) -> None:
        self.spans.append({"block": i, "phase": phase, "start_s": self._now(), "end_s": None})

    def _end(self, i: int, phase: str) -> None:
        span = next(s for s in reversed(self.spans) if s["block"] == i and s["phase"] == phase)
        span["end_s"] = self._now()

    def _pre(self, i: int) -> Any:
        def hook(_m: nn.Module, args: tuple[Any, ...]) -> None:
            if self.on:
                self._begin(i, "forward")
                x = args[0]
                if i == 0 and isinstance(x, torch.Tensor) and x.requires_grad:
                    x.register_hook(lambda _g: self._end(0, "backward"))
        return hook

    def _post(self, i: int, n: int) -> Any:
        def hook(_m: nn.Module, _args: Any, out: Any) -> None:
            if self.on:
                self._end(i, "forward")
                if i + 1 < n and isinstance(out, torch.Tensor) and out.requires_grad:
                    out.register_hook(lambda _g: self._end(i + 1, "backward"))  # the next block's input
        return hook

    def _arm_backward(self, i: int) -> Any:
        def hook(_m: nn.Module, _args: Any, out: Any) -> None:
            if self.on and isinstance(out, torch.Tensor) and out.requires_grad:
                out.register_hook(lambda _g: self._begin(i, "backward"))
        return hook

    def remove(self) -> None:
        """Remove the module hooks."""
        for h in self.handles:
            h.remove()


def _full_params(net: nn.Module, opt: Any) -> dict[str, torch.Tensor]:
    """Every parameter whole (stage 3 gathers them: collective; FSDP2's DTensors: full_tensor, collective)."""
    from lslm.zero import ZeroOptimizer

    if isinstance(opt, ZeroOptimizer) and opt.stage == 3:
        return opt.full_state_dict()
    return {n: (p.full_tensor() if hasattr(p, "full_tensor") else p).detach().clone()
            for n, p in net.named_parameters()}


def _serial_and_data(ctx: Any, model: dict[str, Any] | None, rows: int, steps: int) -> tuple[GPT, list[torch.Tensor]]:
    """The serial GPT (seed 0, the same on every rank) and this rank's ``rows`` of ``steps`` global batches
    (seed 1: every entry and every rank draws the same global batches)."""
    torch.manual_seed(0)
    serial = GPT(GPTConfig(**(model or MODEL)))
    cfg, world, rank = serial.config, ctx.world_size, ctx.rank
    g = torch.Generator().manual_seed(1)
    data = [torch.randint(0, cfg.vocab_size, (rows * world, cfg.block_size + 1),
                          generator=g)[rank * rows:(rank + 1) * rows].to(ctx.device)  # lslm: cpu-ok (moved)
            for _ in range(steps)]
    return serial, data


def suite(entries: list[str] | None = None, steps: int = STEPS, rows: int = ROWS,
          model: dict[str, Any] | None = None, trace: str | None = None) -> dict[str, Any]:
    """Every entry on this rank (see the module doc); every rank returns its bytes, rank 0 also the comparisons.
    ``trace``: a folder for the profiler trace of stage 3's next-to-last step (``steps >= 2``)."""
    from lslm.metrics.trace import StepTracer
    from lslm.runtime import init_distributed
    from lslm.zero.optimizer import GATHER_LABEL, REDUCE_SCATTER_LABEL

    if trace is not None and steps < 2:
        raise ValueError(f"trace needs steps >= 2 (the traced step comes before the timed last one), got {steps}")

    entries = list(entries or ENTRIES)
    with init_distributed(seed=0) as ctx:
        world, rank, ledger = ctx.world_size, ctx.rank, ctx.comm.ledger
        serial, data = _serial_and_data(ctx, model, rows, steps)
        out: dict[str, Any] = {"rank": rank, "world": world, "psi": sum(p.numel() for p in serial.parameters()),
                               "shapes": [list(p.shape) for p in serial.parameters()], "entries": {}}
        full: dict[str, dict[str, torch.Tensor]] = {}
        for kind in entries:
            net, opt, step = _build(kind, serial, ctx)
            spans = BlockSpans(net.blocks) if kind == "zero3" else None
            # Not the timed step: the profiler's own cost would stretch the spans the ledger times.
            tracer = (StepTracer(trace, kind, rank, ctx.device, [len(data) - 2])
                      if trace is not None and kind == "zero3" else None)
            losses = []
            for i, batch in enumerate(data):
                since = len(ledger.records)
                timed = kind == "zero3" and i == len(data) - 1
                with ledger.timed(timed), tracer.step(i) if tracer is not None else contextlib.nullcontext():
                    t0 = time.perf_counter()  # the ledger's clock
                    if spans is not None:
                        spans.t0, spans.on = t0, timed
                    losses.append(float(step(batch[:, :-1], batch[:, 1:])))
                recs = ledger.snapshot()[since:]
            if spans is not None:
                spans.remove()
            row: dict[str, Any] = {"losses": losses, "bytes": held_by_owner(net, opt)}
            if kind.startswith("zero"):
                row.update(rs_bytes=sum(r.nbytes for r in recs if r.label == REDUCE_SCATTER_LABEL),
                           ag_bytes=sum(r.nbytes for r in recs if r.label == GATHER_LABEL),
                           other_bytes=sum(r.nbytes for r in recs if r.label not in (REDUCE_SCATTER_LABEL,
                                                                                     GATHER_LABEL)),
                           padded_numel=opt.numel, owned=opt.layout.param_numel,
                           bucket_numels=[z - a for a, z, _, _ in opt.buckets],
                           offload_bytes=dict(opt.offload_bytes))
                if opt.stage == 3:
                    row["max_buckets_gathered"] = opt.max_buckets_gathered
                    row["units"] = len(opt.unit_modules)
                if timed:
                    row["timeline"] = [{"op": r.op, "label": r.label, "nbytes": r.nbytes, "issue_s": r.issue_s - t0,
                                        "done_s": (r.completion_s - t0) if r.completion_s is not None else None}
                                       for r in recs if r.label in (REDUCE_SCATTER_LABEL, GATHER_LABEL)]
                    row["compute"] = spans.spans if spans is not None else []
            full[kind] = _full_params(net, opt)
            out["entries"][kind] = row
            ledger.reset()
        if "ddp" in full:
            for kind in entries:
                out["entries"][kind]["max_param_diff_vs_ddp"] = max(
                    float((full[kind][n] - full["ddp"][n]).abs().max()) for n in full["ddp"])
        if "zero3" in full and "fsdp2" in full:
            out["zero3_vs_fsdp2"] = max(float((full["zero3"][n] - full["fsdp2"][n]).abs().max()) for n in full["zero3"])
        dist.barrier()  # DTensor users may abort at exit without one (DESIGN §10)
    return out


#: The whole-picture entries: stage 2, stage 3 freeing each block after its forward, stage 3 keeping it gathered,
#: and stage 3 with the token embedding and the head as units of their own (torchtitan's choice), the root then only
#: the position embedding and the final LayerNorm.
PICTURE_ENTRIES = ("zero2", "zero3", "zero3-keep", "zero3-units")


def _picture_units(kind: str, net: GPT) -> list[nn.Module] | None:
    """Stage 3's units of a whole-picture entry (``None``: the default, the blocks)."""
    return [net.wte, *net.blocks, net.lm_head] if kind == "zero3-units" else None


class _MallocSampler:
    """The most bytes glibc's allocator had handed out at any sampled point of a step (:mod:`lslm.metrics.malloc`):
    sampled after every module's forward and at every parameter's gradient, i.e. through forward and backward. A
    sampled maximum can only miss a peak between two samples: it is a lower bound of the true one."""

    def __init__(self, net: nn.Module) -> None:
        from lslm.metrics.malloc import malloc_in_use_bytes

        self.read = malloc_in_use_bytes
        self.peak = 0
        self.on = False
        self.handles = [m.register_forward_hook(self._hook) for m in net.modules()]
        self.handles += [p.register_post_accumulate_grad_hook(self._hook) for p in net.parameters()]

    def _hook(self, *_: Any) -> None:  # None: a forward hook's return value would replace the module's output
        self.sample()

    def sample(self) -> int:
        now = self.read() or 0
        if self.on:
            self.peak = max(self.peak, now)
        return now

    def remove(self) -> None:
        for h in self.handles:
            h.remove()


def whole_picture(rows: int = ROWS, bucket_cap_mb: float = 0.1, model: dict[str, Any] | None = None,
                  entries: tuple[str, ...] = PICTURE_ENTRIES) -> dict[str, Any]:
    """Everything one training step holds on this rank, not only the model states, for ``entries`` (a subset of
    :data:`PICTURE_ENTRIES`).

    Per entry, measured on its second step (Adam's states exist): the model states held after it
    (:func:`~lslm.metrics.held.held_by_owner`), the most bytes of gathered or prefetching parameter
    buckets and of reduce-scatter staging buffers at once (``ZeroOptimizer.peak_gathered_bytes`` and
    ``peak_staging_bytes``), and the peak of everything the step allocated on top of what it found
    (:func:`~lslm.metrics.track_live_bytes`: gathers, staging, gradients before staging, activations,
    temporaries). The activations (what autograd saves for backward; the same for every entry: same
    model, same rows) are counted once on a plain copy of the model with
    :class:`~lslm.metrics.ActivationMemory`. ``bucket_cap_mb``: stage 2's buckets (stage 3's are its units).

    The same step measured by glibc's allocator (:func:`~lslm.metrics.malloc.malloc_in_use_bytes`, which needs
    nothing registered and so also sees a storage that only a tensor autograd saved keeps alive), ``None`` off glibc:
    ``forward_malloc`` (the bytes the forward added: activations, and the units still held after it), ``peak_malloc``
    (the sampled peak of the step over what it found) and ``total_malloc`` (that peak over what the process held before
    this entry's model and optimizer were built: states, step and all). Every entry reports its ``losses`` (the same
    training whatever the units). Stage 3 also reports ``unit_bytes_after_forward``, the bytes the unit buffers'
    storages (the root's aside) hold right after the forward.
    """
    import gc

    from lslm.metrics import ActivationMemory, track_live_bytes
    from lslm.metrics.malloc import malloc_in_use_bytes
    from lslm.runtime import init_distributed
    from lslm.zero import ZeroOptimizer

    with init_distributed(seed=0) as ctx:
        world, rank = ctx.world_size, ctx.rank
        serial, data = _serial_and_data(ctx, model, rows, 2)
        plain = copy.deepcopy(serial).to(ctx.device)
        with ActivationMemory(plain) as act:
            _, loss = plain(data[0][:, :-1], data[0][:, 1:])
        loss.backward()
        del plain, loss
        units = [sum(p.numel() for p in b.parameters()) for b in serial.blocks]
        out: dict[str, Any] = {"rank": rank, "world": world, "psi": sum(p.numel() for p in serial.parameters()),
                               "unit_numel": max(units), "root_numel": sum(p.numel() for p in serial.parameters())
                               - sum(units), "activations": act.bytes, "bucket_cap_mb": bucket_cap_mb, "entries": {}}
        measured = malloc_in_use_bytes() is not None
        # A throwaway step first: the first collectives and optimizer steps of a process allocate for good (gloo's
        # transport buffers, kernels' caches), which the first entry's allocator figures would otherwise carry.
        net = copy.deepcopy(serial).to(ctx.device)
        zero = ZeroOptimizer(net, _adamw(net), ctx, stage=3, bucket_cap_mb=bucket_cap_mb)
        zero.backward(net(data[0][:, :-1], data[0][:, 1:])[1])
        zero.step()
        del net, zero
        if not set(entries) <= set(PICTURE_ENTRIES):
            raise ValueError(f"entries must be among {PICTURE_ENTRIES}, got {entries!r}")
        for kind in entries:
            gc.collect()
            before_build = malloc_in_use_bytes()
            net = copy.deepcopy(serial).to(ctx.device)
            zero = ZeroOptimizer(net, _adamw(net), ctx, stage=int(kind[4]), bucket_cap_mb=bucket_cap_mb,
                                 reshard_after_forward="keep" not in kind, units=_picture_units(kind, net))
            sampler = _MallocSampler(net)
            losses = []
            for i, batch in enumerate(data):
                if i == 1:  # measure the second step: Adam's states exist, nothing is allocated for the first time
                    zero.peak_gathered_bytes = zero.peak_staging_bytes = 0
                    gc.collect()
                    sampler.on = True
                start = sampler.sample()
                with track_live_bytes() as live:
                    zero.zero_grad()
                    _, loss = net(batch[:, :-1], batch[:, 1:])
                    after_forward = sampler.sample()
                    unit_bytes = zero.gather.storage_bytes(units_only=True) if zero.gather is not None else 0
                    zero.backward(loss)
                    zero.step()
                losses.append(float(loss))
                del loss
                sampler.sample()
            sampler.remove()
            out["entries"][kind] = {"held": held_by_owner(net, zero), "gathered": zero.peak_gathered_bytes,
                                    "staging": zero.peak_staging_bytes, "step_peak": int(live.peak[ctx.device.type]),
                                    "buckets": [z - a for a, z, _, _ in zero.buckets], "losses": losses,
                                    "unit_bytes_after_forward": unit_bytes,
                                    "forward_malloc": after_forward - start if measured else None,
                                    "peak_malloc": sampler.peak - start if measured else None,
                                    "total_malloc": sampler.peak - before_build if measured else None}
            del net, zero, sampler
    return out


def state_bytes_at_scale(worlds: tuple[int, ...] = (8, 16, 64), stages: tuple[int, ...] = (1, 2, 3),
                         model: dict[str, Any] | None = None, dtype: torch.dtype = torch.float16,
                         bucket_cap_mb: float = 0.1) -> list[dict[str, Any]]:
    """Model-state bytes of rank 0 and rank N-1 of ``N`` in ``worlds``, per stage, after one step, in this process.

    fp16 parameters and gradients (ZeRO's mixed-precision accounting: ``2 + 2 + 12`` bytes per
    parameter), AdamW. Each row: ``world``, ``stage``, ``rank``, ``psi`` (parameters), ``numel``
    (the padded flat layout), ``owned`` (parameter elements of this rank's slices), ``pieces``,
    ``bytes`` by owner.
    """
    from lslm.metrics import memory_by_owner
    from lslm.runtime.context import ParallelContext
    from lslm.runtime.grid import RankGrid
    from lslm.zero import ZeroOptimizer

    cfg = GPTConfig(**(model or MODEL))
    rows = []
    for world in worlds:
        for stage in stages:
            for rank in (0, world - 1):
                with fake_world(rank, world):
                    ctx = ParallelContext.create(RankGrid.build(world, dp=world), rank=rank, local_rank=rank,
                                                 node_rank=0, device=torch.device("cpu"), backend="fake", timeout_s=5)
                    torch.manual_seed(0)
                    net = GPT(cfg)
                    zero = ZeroOptimizer(net, _adamw(net), ctx, stage=stage, dtype=dtype, grad_dtype=dtype,
                                         bucket_cap_mb=bucket_cap_mb)
                    x = torch.randint(0, cfg.vocab_size, (1, 8))  # lslm: cpu-ok (the fake group is CPU-only)
                    zero.zero_grad()
                    zero.backward(net(x, x)[1])
                    zero.step()  # nothing moves, but the optimizer's states now exist
                    resident = memory_by_owner(net, zero).resident
                    held = {cat: sum(resident.get(cat, {}).values()) for cat in resident}
                    rows.append({"world": world, "stage": stage, "rank": rank,
                                 "psi": sum(int(torch.Size(s).numel()) for s in zero.shapes), "numel": zero.numel,
                                 "owned": zero.layout.param_numel, "pieces": len(zero.layout.pieces),
                                 "buckets": len(zero.buckets),
                                 "bytes": {"parameters": held.get("parameters", 0),
                                           "gradients": held.get("gradients", 0) + held.get("main_grads", 0),
                                           "master_weights": held.get("master_weights", 0),
                                           "optimizer_states": held.get("optimizer_states", 0)}})
    return rows


def zero3_memory_timeline(reshard_after_forward: bool = True, prefetch: int = 1, world: int = 2, rows: int = ROWS,
                          model: dict[str, Any] | None = None) -> Any:
    """One stage-3 step of rank 0 of ``world`` (fake process group, in this process) under PyTorch's memory
    profiler: its :class:`~lslm.metrics.memory_timeline.MemoryTimeline` (bytes by category over time), with the
    ledger's all-gathers and reduce-scatters as ranges. The second step is recorded (Adam's states exist); the
    collectives move no data here, but every buffer is allocated and freed as with real ranks."""
    from lslm.metrics.memory_timeline import record_memory_timeline
    from lslm.runtime.comm_trace import CALL_PREFIX
    from lslm.runtime.context import ParallelContext
    from lslm.runtime.grid import RankGrid
    from lslm.zero import ZeroOptimizer

    cfg = GPTConfig(**(model or MODEL))
    with fake_world(0, world):
        ctx = ParallelContext.create(RankGrid.build(world, dp=world), rank=0, local_rank=0, node_rank=0,
                                     device=torch.device("cpu"), backend="fake", timeout_s=5)
        torch.manual_seed(0)
        net = GPT(cfg)
        zero = ZeroOptimizer(net, _adamw(net), ctx, stage=3, reshard_after_forward=reshard_after_forward,
                             prefetch=prefetch)
        g = torch.Generator().manual_seed(1)
        batch = torch.randint(0, cfg.vocab_size, (rows, cfg.block_size + 1), generator=g)  # lslm: cpu-ok (fake: CPU)

        def step() -> None:
            zero.zero_grad()
            _, loss = net(batch[:, :-1], batch[:, 1:])
            zero.backward(loss)
            zero.step()

        step()
        # Kineto (the profiler's backend) prints a line to stderr at each start and stop unless told otherwise: in a
        # notebook that lands in the cell's output. Read when a profiler first starts in the process.
        os.environ.setdefault("KINETO_LOG_LEVEL", "6")
        timeline, _ = record_memory_timeline(step, ctx.device, range_prefixes=(CALL_PREFIX,))
    return timeline
