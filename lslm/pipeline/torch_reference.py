"""The same GPT pipelined by PyTorch's own ``torch.distributed.pipelining``: the production counterpart of our executor.

:func:`~lslm.pipeline.apply.apply_pipeline` runs lslm's schedules (instruction lists,
:mod:`lslm.pipeline.schedules`) with lslm's executor. :class:`TorchPipeline` hands the
*same* stages, the :class:`~lslm.pipeline.partition.GPTStage` modules of
:func:`~lslm.pipeline.partition.split_gpt` (same cut, same ``Parameter`` objects, so the
same parameter sets per rank and the same loss), to torch's ``PipelineStage`` and one of
torch's schedule classes:

=======================  ====================================  ==================  =================================
lslm name                torch class                           stages per rank     stage ``s`` on rank
=======================  ====================================  ==================  =================================
``gpipe``                ``ScheduleGPipe``                     1                   ``s``
``1f1b``                 ``Schedule1F1B``                      1                   ``s``
``interleaved``          ``ScheduleInterleaved1F1B``           ``v`` (loop)        ``s % p``
``looped-bfs``           ``ScheduleLoopedBFS``                 ``v`` (loop)        ``s % p``
``zb``                   ``ScheduleInterleavedZeroBubble``     ``v`` (loop)        ``s % p``
``zbv``                  ``ScheduleZBVZeroBubble``             2 (V)               ``s`` if ``s < p`` else ``2p-1-s``
``dualpipev``            ``ScheduleDualPipeV``                 2 (V)               ``s`` if ``s < p`` else ``2p-1-s``
=======================  ====================================  ==================  =================================

(lslm's ``zb-h1`` has no torch twin of one stage per rank; ``ScheduleInterleavedZeroBubble``
is torch's zero-bubble schedule, ZB-H1-like at ``v = 1``: :data:`LSLM_TO_TORCH` maps to it.)

**How torch averages over micro-batches** (read from ``torch/distributed/pipelining``,
2.13): the schedule calls ``loss_fn(output, target)`` on the last stage once per
micro-batch (here: the mean cross-entropy of that micro-batch's tokens) and runs each
micro-batch's backward on that loss *unscaled*. With ``scale_grads=True`` (the default),
after a stage's last backward (its last ``B`` or ``W``) it divides **every** ``.grad`` of
the stage's module by ``m`` (``PipelineStage.scale_grads``). The gradient is then the mean
over micro-batches of per-micro-batch means, which with equal micro-batches is the mean
over the whole batch: what the serial GPT and lslm's executor (each micro-batch's loss
weighted ``1/m`` before its backward) compute. Two consequences: gradients must be zeroed
before a step (torch also divides whatever ``.grad`` held before it), and since ``m`` is a
power of two in every test, dividing at the end or scaling each loss gives bit-identical
gradients. The per-micro-batch losses come back in ``step(..., losses=[...])`` on the rank
of the last stage; :meth:`TorchPipeline.step` returns their mean, broadcast to every
pipeline rank (one ``ctx.comm`` broadcast, as lslm's ``PipelineModel.step`` does).

torch's point-to-point traffic does not go through ``ctx.comm``, so the ledger does not
see it (only the loss broadcast and, with ``dp > 1``, the gradient average are lslm's).
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass, replace
from typing import Any

import torch
from torch import nn

from lslm.models.gpt import GPT
from lslm.pipeline.partition import METHODS, GPTStage, partition_units, split_gpt, stage_parameters, unit_costs
from lslm.runtime.context import ParallelContext

__all__ = ["LSLM_TO_TORCH", "TORCH_SCHEDULES", "TorchPipeline", "TorchScheduleSpec", "check_torch_config",
           "loss_fn", "torch_spec"]

#: Label of the loss broadcast in the ledger (the only traffic of a step lslm sees with dp = 1).
LOSS_LABEL = "torch pp loss"


@dataclass(frozen=True)
class TorchScheduleSpec:
    """One torch schedule class: its name in ``torch.distributed.pipelining``, the placement of stages, the default
    stages per rank, and whether that number is fixed."""

    cls_name: str
    style: str  # "single" (one stage per rank), "loop" (stage s on rank s % p) or "v"
    default_v: int
    fixed_v: bool


#: torch's schedule classes lslm can drive, by their short name (``get_schedule_class`` spelling).
TORCH_SCHEDULES: dict[str, TorchScheduleSpec] = {
    "GPipe": TorchScheduleSpec("ScheduleGPipe", "single", 1, True),
    "1F1B": TorchScheduleSpec("Schedule1F1B", "single", 1, True),
    "Interleaved1F1B": TorchScheduleSpec("ScheduleInterleaved1F1B", "loop", 2, False),
    "LoopedBFS": TorchScheduleSpec("ScheduleLoopedBFS", "loop", 2, False),
    "InterleavedZeroBubble": TorchScheduleSpec("ScheduleInterleavedZeroBubble", "loop", 2, False),
    "ZBVZeroBubble": TorchScheduleSpec("ScheduleZBVZeroBubble", "v", 2, True),
    "DualPipeV": TorchScheduleSpec("ScheduleDualPipeV", "v", 2, True),
}

#: lslm schedule names (:data:`lslm.pipeline.schedules.SCHEDULES`) -> the torch schedule that does the same thing.
LSLM_TO_TORCH = {"gpipe": "GPipe", "1f1b": "1F1B", "interleaved": "Interleaved1F1B", "zb-h1": "InterleavedZeroBubble",
                 "dualpipev": "DualPipeV", "looped-bfs": "LoopedBFS", "zb": "InterleavedZeroBubble",
                 "zbv": "ZBVZeroBubble"}


def torch_spec(schedule: str) -> tuple[str, TorchScheduleSpec]:
    """``(torch short name, spec)`` of ``schedule``: a torch name (``"1F1B"``, ``"ScheduleDualPipeV"``, any case) or
    an lslm name (``"1f1b"``, ``"interleaved"``, ...; ``"zb-h1"`` defaults to one stage per rank). ``ValueError``
    for anything else."""
    key = schedule.removeprefix("Schedule") if isinstance(schedule, str) else schedule
    if key in LSLM_TO_TORCH:
        key = LSLM_TO_TORCH[key]
    for name, spec in TORCH_SCHEDULES.items():
        if isinstance(key, str) and key.lower() == name.lower():
            # lslm's zb-h1 holds one stage per rank: so does its torch twin unless told otherwise.
            return name, replace(spec, default_v=1) if schedule == "zb-h1" else spec
    raise ValueError(f"unknown torch pipeline schedule {schedule!r}; choose one of {list(TORCH_SCHEDULES)} "
                     f"(torch names) or {list(LSLM_TO_TORCH)} (lslm names)")


def _stages_per_rank(spec: TorchScheduleSpec, name: str, virtual_stages: int | None) -> int:
    v = spec.default_v if virtual_stages is None else virtual_stages
    if isinstance(v, bool) or not isinstance(v, int) or v < 1:
        raise ValueError(f"virtual_stages must be a positive int, got {virtual_stages!r}")
    if spec.fixed_v and v != spec.default_v:
        raise ValueError(f"torch's {spec.cls_name} runs exactly {spec.default_v} stage(s) per rank, got "
                         f"virtual_stages={v}")
    return v


def check_torch_config(schedule: str, pp: int, microbatches: int, virtual_stages: int | None = None,
                       n_layer: int | None = None, batch_size: int | None = None) -> int:
    """Raise ``ValueError`` (before any process starts) where torch's ``schedule`` cannot run ``microbatches``
    micro-batches on ``pp`` ranks; return the stages per rank.

    The rules are torch 2.13's own checks, raised here with lslm's wording: ``Schedule1F1B``
    needs ``m >= p``; ``ScheduleInterleaved1F1B`` and ``ScheduleInterleavedZeroBubble`` need ``m``
    to be a multiple of ``max(1, m // p)`` (their number of rounds); ``ScheduleDualPipeV`` needs
    ``m >= 2p``. (``tests/test_pipeline_torch_reference.py`` checks that these are exactly the
    configurations torch's constructors refuse.) Every stage needs one block; ``batch_size``
    must split into ``m`` equal micro-batches.
    """
    name, spec = torch_spec(schedule)
    v = _stages_per_rank(spec, name, virtual_stages)
    for what, value in (("pp", pp), ("microbatches", microbatches)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{what} must be a positive int, got {value!r}")
    stages = pp * v
    if name == "1F1B" and microbatches < pp:
        raise ValueError(f"torch's Schedule1F1B needs at least as many micro-batches as stages: m={microbatches} "
                         f"< p={pp}")
    if name in ("Interleaved1F1B", "InterleavedZeroBubble"):
        rounds = max(1, microbatches // pp)
        if microbatches % rounds:
            raise ValueError(f"torch's {spec.cls_name} needs m to be a multiple of max(1, m // p) = {rounds}, got "
                             f"m={microbatches} with p={pp}")
    if name == "DualPipeV" and microbatches < stages:
        raise ValueError(f"torch's {spec.cls_name} needs m >= 2p = {stages} micro-batches, got m={microbatches}")
    if n_layer is not None and stages > n_layer:
        raise ValueError(f"{pp} ranks x {v} stages = {stages} stages but the model has {n_layer} blocks")
    if batch_size is not None and batch_size % microbatches:
        raise ValueError(f"a batch of {batch_size} rows does not split into {microbatches} equal micro-batches")
    return v


def stage_to_rank(style: str, pp: int, v: int) -> tuple[int, ...]:
    """Which pipeline rank holds each of the ``pp * v`` stages under torch's placement ``style``."""
    if style == "v":
        return tuple(s if s < pp else 2 * pp - 1 - s for s in range(2 * pp))
    return tuple(s % pp for s in range(pp * v))


def loss_fn(logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """Mean cross-entropy of one micro-batch's logits ``(b, T, V)`` against ``target`` ``(b, T)``, exactly as
    ``GPT.forward`` computes its loss (fp32 softmax, ``-100`` ignored)."""
    return torch.nn.functional.cross_entropy(logits.float().flatten(0, 1), target.flatten(), ignore_index=-100)


def _boundaries(model: GPT, ctx: ParallelContext, method: str, num_stages: int) -> list[tuple[int, int]]:
    costs = unit_costs(model, method)
    if method == "time":  # measured costs differ by rank: average them so all ranks cut alike (as apply_pipeline)
        t = torch.tensor(costs, dtype=torch.float64, device=ctx.device)
        ctx.comm.all_reduce(t, label="torch pp partition costs")
        costs = (t / ctx.world_size).tolist()
    return partition_units(costs, num_stages)


def _local(t: torch.Tensor) -> torch.Tensor:
    to_local = getattr(t, "to_local", None)  # a DTensor (duck-typed: this module needs no DTensor import)
    return to_local() if callable(to_local) else t


class TorchPipeline:
    """This rank's stages of ``model`` under torch's schedule ``schedule`` over ``ctx``'s pipeline group.

    ``schedule``: a name :func:`torch_spec` accepts; ``microbatches``: m; ``virtual_stages``:
    stages per rank (default: 1 for GPipe / 1F1B, 2 for the others; fixed at 2 for the V
    schedules). The cut is ``boundaries`` (unit ranges, see
    :func:`~lslm.pipeline.partition.split_gpt`) or ``partition``'s (``"layers"`` by default:
    the cut ``apply_pipeline`` makes). Every rank must build ``model`` from the same seed.
    """

    def __init__(self, model: GPT, ctx: ParallelContext, schedule: str, microbatches: int,
                 virtual_stages: int | None = None, *, partition: str = "layers",
                 boundaries: Sequence[tuple[int, int]] | None = None, scale_grads: bool = True) -> None:
        from torch.distributed import pipelining

        if partition not in METHODS:
            raise ValueError(f"unknown partition method {partition!r}; choose one of {METHODS}")
        if model.lm_head.weight is model.wte.weight:
            raise ValueError("tied embedding/head weights are not supported: build the GPT with tie_weights=False")
        self.name, self.spec = torch_spec(schedule)
        pp = ctx.pp_size
        self.v = check_torch_config(self.name, pp, microbatches, virtual_stages, n_layer=len(model.blocks))
        self.ctx, self.model, self.microbatches = ctx, model, microbatches
        self.stage_to_rank = stage_to_rank(self.spec.style, pp, self.v)
        num_stages = len(self.stage_to_rank)
        cut = list(boundaries) if boundaries is not None else _boundaries(model, ctx, partition, num_stages)
        all_stages = split_gpt(model, num_stages, boundaries=cut)
        #: this rank's stages by virtual stage index (ascending)
        self.stages: dict[int, GPTStage] = {s: st.to(ctx.device) for s, st in enumerate(all_stages)
                                            if self.stage_to_rank[s] == ctx.pp_rank}
        group = ctx.group("pp")
        self.torch_stages = [pipelining.PipelineStage(st, s, num_stages, ctx.device, group=group)
                             for s, st in self.stages.items()]
        cls = getattr(pipelining, self.spec.cls_name)
        if self.spec.style == "single":
            self.schedule = cls(self.torch_stages[0], microbatches, loss_fn=loss_fn, scale_grads=scale_grads)
        else:
            self.schedule = cls(self.torch_stages, microbatches, loss_fn=loss_fn, scale_grads=scale_grads)
        self.has_first = 0 in self.stages
        self.has_last = num_stages - 1 in self.stages

    def parameters(self) -> Iterator[nn.Parameter]:
        """This rank's parameters (every stage it holds), each once."""
        return (p for _, p in stage_parameters(self.stages))

    def named_parameters(self) -> Iterator[tuple[str, nn.Parameter]]:
        """``(name in the GPT, parameter)`` for :meth:`parameters`."""
        return stage_parameters(self.stages)

    def step(self, x: torch.Tensor, y: torch.Tensor, *, sync_grads: bool = True) -> torch.Tensor:
        """Forward and backward of this replica's batch ``x`` -> ``y`` (token ids ``(B, T)``) by torch's schedule.

        Gradients of the batch mean loss land in this rank's parameters: zero them first (torch
        divides every ``.grad`` by ``m`` at the end of the step, see the module doc). With
        ``dp > 1`` and ``sync_grads`` they are then averaged over ``ctx.group("dp")`` (one flat
        all-reduce: torch's pipelining leaves data parallelism to DDP / FSDP). Returns the
        batch's mean loss, the same on every pipeline rank.
        """
        ctx, m = self.ctx, self.microbatches
        if x.dim() != 2 or x.shape != y.shape:
            raise ValueError(f"x and y must be token ids of one shape (batch, time), got {tuple(x.shape)} and "
                             f"{tuple(y.shape)}")
        if x.shape[0] % m:
            raise ValueError(f"a batch of {x.shape[0]} rows does not split into {m} micro-batches")
        args = (x.to(ctx.device),) if self.has_first else ()
        losses: list[torch.Tensor] = []
        target = y.to(ctx.device) if self.has_last else None
        self.schedule.step(*args, target=target, losses=losses if self.has_last else None, return_outputs=False)
        loss = torch.zeros(1, dtype=torch.float32, device=ctx.device)
        if self.has_last:
            # A tensor-parallel head under loss_parallel gives replicated DTensor losses: their local value.
            loss += torch.stack([_local(t).detach().float() for t in losses]).sum() / m
        if ctx.pp_size > 1:
            last = ctx.group_ranks("pp")[self.stage_to_rank[-1]]
            ctx.comm.broadcast(loss, src=last, group=ctx.group("pp"), label=LOSS_LABEL)
        if sync_grads and ctx.dp_size > 1:
            from lslm.tensor_parallel.clip import average_data_parallel_grads

            average_data_parallel_grads(list(self.parameters()), ctx, label="torch pp dp grads")
        return loss[0]

    def describe(self) -> dict[str, Any]:
        """Schedule, placement and this rank's stages, for reports."""
        return {"schedule": self.spec.cls_name, "pp": self.ctx.pp_size, "microbatches": self.microbatches,
                "stages_per_rank": self.v, "stage_to_rank": list(self.stage_to_rank),
                "rank_stages": sorted(self.stages)}
