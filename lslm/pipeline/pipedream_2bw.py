"""PipeDream-2BW: asynchronous 1F1B with no pipeline flush and two weight versions per stage.

Narayanan et al. 2021, "Memory-Efficient Pipeline-Parallel DNN Training" (ICML), section 3.
PipeDream-Flush (our ``"1f1b"`` schedule) drains the pipeline after every batch so that the
next batch sees the freshly updated weights: plain mini-batch SGD, ``W(t+1) = W(t) - lr *
grad f(W(t))``, paid for with a bubble of ``p - 1`` slots per batch. 2BW never drains. The
micro-batches of all batches form one stream and every rank runs plain 1F1B over it; a stage
makes a new weight version each time the backward of the last micro-batch of a batch (``m``
micro-batches) finished on it, from the gradients accumulated over that batch.

**Which weights a micro-batch uses** (section 3.1). Micro-batch ``j`` (0-indexed over the
stream; batch ``b = j // m``) runs its forward AND its backward on every stage with version

    v(j) = max(j // m - 1, 0)          (the paper, 1-indexed: max(floor((k - 1) / m) - 1, 0))

so batch ``b`` uses ``W(b-1)``: batches 0 and 1 use ``W(0)``, batch 2 ``W(1)``, ... Why not
the newest? On stage ``r`` the first ``p - 1 - r`` forwards of batch ``b`` run (1F1B warm-up
offset) before the backward of batch ``b - 1`` ends, i.e. before ``W(b)`` exists; using
``W(b-1)`` for the whole batch, on every stage, keeps each micro-batch's forward and backward
on one version (weight stashing) and every batch's gradient at ONE model. The update after
batch ``b`` is applied to the newest version:

    W(b+1) = W(b) - lr * grad f_b(W(b-1))      (section 3.1: "gradient delay of 1"; W(-1) := W(0))

i.e. ``W(t+1) = W(t) - lr * grad f(W(t-1))``. When ``W(b+1)`` is made, ``W(b-1)`` has no user
left (batch ``b`` finished its backwards here, batch ``b + 1`` uses ``W(b)``): it is overwritten.
Two buffers per stage suffice, for any ``p`` (PipeDream's original weight stashing keeps one
version per in-flight micro-batch: up to ``p - r`` on stage ``r``, ``p`` on the first).
The paper asks ``m >= p`` (``m >= d``); :func:`version_plan` checks any ``(p, m)`` and shows
that with the forward-first 1F1B order ``m = p - 1`` would still fit in two versions.

**Steady state on rank r** (``w = p - 1 - r`` warm-up forwards): ``F(j + w)``, then ``B(j)``, then,
if ``j`` is the last micro-batch of its batch, the update; communication by the just-in-time
rule of :mod:`lslm.pipeline.comm_plan`: after ``F`` one batch ``SEND_F(j + w); RECV_B(j)`` to the
next rank, after ``B`` one batch ``SEND_B(j); RECV_F(j + w + 1)`` to the previous (Megatron's
``send_forward_recv_backward`` / ``send_backward_recv_forward``). It is exactly the
``"1f1b"`` schedule over the ``N * m`` micro-batches of ``N`` batches, flushed once at the end.

Example, ``p = 2``, ``m = 2``, 3 batches (``F4@1``: forward of micro-batch 4 on ``W(1)``; ``U2``: update
making ``W(2)``). On rank 0, ``F4@1`` runs before ``B3@0``: two versions in use at once::

    rank 0: F0@0 F1@0 B0@0 F2@0 B1@0 U1 F3@0 B2@0 F4@1 B3@0 U2 F5@1 B4@1 B5@1 U3
    rank 1: F0@0 B0@0 F1@0 B1@0 U1 F2@0 B2@0 F3@0 B3@0 U2 F4@1 B4@1 F5@1 B5@1 U3

(The last rank could already use ``W(b)`` for batch ``b + 1``; it keeps ``W(b-1)`` so that every
micro-batch sees one model version on all stages.)

**Two buffers, as two module copies.** Slot 0 is the stage cut from the caller's GPT, slot 1
a deep copy; version ``v`` lives in slot ``v % 2``. A micro-batch's forward builds its graph
on its version's module, so its backward uses those same weights with no bookkeeping, and
batch ``b``'s gradients accumulate into that module's ``.grad``: exactly the gradient the
update needs; the new version is written over the slot of the one it retires. (PipeDream's
Megatron fork keeps one model and copies the right version into it before every F and B: one
copy per action. Pointing ``param.data`` at the other buffer instead avoids the copy, but a
weight that autograd saved as a view keeps the forward's storage while the parameter follows
the swap, so the swap must be undone before every backward: easy to get subtly wrong.)
"""

from __future__ import annotations

import copy
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from lslm.models.gpt import GPT
from lslm.pipeline.actions import Action
from lslm.pipeline.p2p import InFlight, exchange
from lslm.pipeline.partition import GPTStage, split_gpt
from lslm.pipeline.schedules import PipelineSchedule, build_schedule
from lslm.pipeline.stage import StageRuntime
from lslm.runtime.context import ParallelContext

__all__ = ["DelayedSGDTrajectory", "TwoBWResult", "VersionStep", "run_2bw", "simulate_delayed_sgd",
           "stash_versions", "two_bw_schedule", "version_of", "version_plan"]

LOSS_LABEL = "pp 2bw losses"


def version_of(mb: int, microbatches: int) -> int:
    """The weight version global micro-batch ``mb`` (0-indexed) uses for its forward and backward on every stage:
    ``max(mb // m - 1, 0)`` (section 3.1; the paper's 1-indexed ``max(floor((k-1)/m) - 1, 0)``)."""
    return max(mb // microbatches - 1, 0)


def two_bw_schedule(num_ranks: int, microbatches: int, num_batches: int) -> PipelineSchedule:
    """The compute (and, through ``.actions(rank)``, communication) order of 2BW: 1F1B over all
    ``num_batches * microbatches`` micro-batches of the stream, with no flush between batches."""
    for what, value in (("num_ranks", num_ranks), ("microbatches", microbatches), ("num_batches", num_batches)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{what} must be a positive int, got {value!r}")
    return build_schedule("1f1b", num_ranks, microbatches * num_batches)


@dataclass(frozen=True)
class VersionStep:
    """One compute action of a rank's 2BW list: the version it uses, the versions the stage holds while it runs,
    and (after the backward of a batch's last micro-batch) the version the update right after it creates."""

    action: Action
    version: int
    held: tuple[int, ...]
    creates: int | None = None


def version_plan(num_ranks: int, microbatches: int, num_batches: int, rank: int) -> list[VersionStep]:
    """Rank ``rank``'s 2BW compute list with the weight version of every action (:func:`version_of`).

    A version is held from its creation while some action still to run uses it, and the newest always (the
    next update starts from it). Raises ValueError when an action would need a version its stage has not
    made yet (too few micro-batches per batch for this pipeline depth).
    """
    m = microbatches
    compute = two_bw_schedule(num_ranks, m, num_batches).compute[rank]
    uses = [version_of(a.mb, m) for a in compute]
    last_use: dict[int, int] = {}
    for i, v in enumerate(uses):
        last_use[v] = i
    newest, out = 0, []
    for i, (a, v) in enumerate(zip(compute, uses)):
        if v > newest:
            raise ValueError(f"rank {rank}: {a} needs W({v}) but only W(0..{newest}) exist: with p={num_ranks} "
                             f"stages 2BW needs more micro-batches per batch than m={m} (the paper asks m >= p)")
        held = tuple(u for u in range(newest + 1) if u == newest or last_use.get(u, -1) >= i)
        creates = None
        if a.kind == "B" and (a.mb + 1) % m == 0:
            newest = creates = a.mb // m + 1
        out.append(VersionStep(a, v, held, creates))
    return out


def stash_versions(num_ranks: int, rank: int, method: str = "2bw") -> int:
    """Weight versions stage ``rank`` keeps at most: 2 under 2BW; under PipeDream's weight stashing (an update
    after every micro-batch, Narayanan et al. 2019) one per micro-batch in flight in 1F1B, ``p - rank``."""
    if method == "2bw":
        return 2
    if method == "pipedream":
        return num_ranks - rank
    raise ValueError(f"method must be '2bw' or 'pipedream', got {method!r}")


# ---------------------------------------------------------------------------------------- serial simulation


@dataclass
class DelayedSGDTrajectory:
    """Parameters (GPT names -> tensors) after each batch, and each batch's mean loss at the weights it used."""

    states: list[dict[str, torch.Tensor]]
    losses: list[float]


def _micro(x: torch.Tensor, m: int) -> list[torch.Tensor]:
    if x.shape[0] % m:
        raise ValueError(f"batch of {x.shape[0]} rows does not split into {m} equal micro-batches")
    return list(x.chunk(m, dim=0))


def simulate_delayed_sgd(model: nn.Module, batches: Sequence[tuple[torch.Tensor, torch.Tensor]], *, lr: float,
                         microbatches: int, delay: int = 1) -> DelayedSGDTrajectory:
    """One process, no pipeline: ``W(t+1) = W(t) - lr * g_t(W(max(t - delay, 0)))`` over ``batches``.

    ``delay=1`` is PipeDream-2BW's update (section 3.1), ``delay=0`` plain mini-batch SGD, i.e. PipeDream-Flush.
    ``g_t`` is the gradient of batch ``t``'s mean loss, accumulated over ``microbatches`` equal micro-batches,
    each loss weighted by ``1/m`` as the pipeline does (so the two sum in the same order). ``model`` is a GPT
    (``model(x, y)`` returns ``(logits, loss)``); it ends holding the last state. Plain SGD: exact to compare.
    """
    if delay < 0:
        raise ValueError(f"delay must be >= 0, got {delay}")
    m = microbatches
    window: deque[nn.Module] = deque([copy.deepcopy(model)], maxlen=delay + 1)
    states, losses = [], []
    for x, y in batches:
        # Until the window is full its oldest entry is W(0) = W(max(t - delay, 0)); afterwards it is W(t - delay).
        src = window[0]
        src.zero_grad(set_to_none=True)
        total = 0.0
        for xm, ym in zip(_micro(x, m), _micro(y, m)):
            _, loss = src(xm, ym)
            (loss * (1.0 / m)).backward()
            total += loss.item()
        new = copy.deepcopy(window[-1])
        with torch.no_grad():
            for (name, p_new), p_src in zip(new.named_parameters(), src.parameters()):
                if p_src.grad is not None:
                    torch.add(window[-1].get_parameter(name), p_src.grad, alpha=-lr, out=p_new)
        window.append(new)
        states.append({k: v.detach().clone() for k, v in new.named_parameters()})
        losses.append(total / m)
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(window[-1].get_parameter(name))
    return DelayedSGDTrajectory(states, losses)


# ---------------------------------------------------------------------------------------- on processes


@dataclass
class TwoBWResult:
    """What :func:`run_2bw` leaves on one rank.

    ``losses``: each batch's mean loss (every rank); ``trace``: this rank's ``(kind, mb, version)`` per compute
    action; ``updates``: ``(after micro-batch, new version)``; bytes of this stage: ``version_bytes`` (both
    weight buffers, counted over unique storages), ``stage_bytes`` (one version), ``grad_bytes`` (the one
    gradient buffer alive at a time), ``pipedream_stash_bytes`` (what PipeDream's ``p - r`` versions would take).
    """

    stage: int
    losses: list[float]
    trace: list[tuple[str, int, int]] = field(default_factory=list)
    updates: list[tuple[int, int]] = field(default_factory=list)
    version_bytes: int = 0
    stage_bytes: int = 0
    grad_bytes: int = 0
    pipedream_stash_bytes: int = 0


def _unique_bytes(tensors: Sequence[torch.Tensor]) -> int:
    seen: dict[Any, int] = {}
    for t in tensors:
        s = t.untyped_storage()
        seen[(s.data_ptr(), t.device)] = s.nbytes()
    return sum(seen.values())


def _check_run(model: GPT, ctx: ParallelContext, batches: Sequence[tuple[torch.Tensor, torch.Tensor]], m: int,
               lr: float) -> None:
    if (ctx.tp_size, ctx.cp_size, ctx.dp_size) != (1, 1, 1):
        raise ValueError("run_2bw runs pipeline parallelism alone: use a grid with tp = cp = dp = 1")
    p = ctx.pp_size
    if isinstance(m, bool) or not isinstance(m, int) or m < p:
        raise ValueError(f"2BW needs microbatches >= pipeline size (section 3.1, m >= d): got m={m!r}, p={p}")
    if not batches:
        raise ValueError("give at least one batch")
    if model.config.tie_weights and p > 1:
        raise ValueError("tied embeddings would live on two stages: build the GPT with tie_weights=False")
    if not lr > 0:
        raise ValueError(f"lr must be > 0, got {lr}")
    shapes = {tuple(x.shape) for x, _ in batches} | {tuple(y.shape) for _, y in batches}
    if len(shapes) != 1 or next(iter(shapes))[0] % m:
        raise ValueError(f"every x and y must have one shape (B, T) with B divisible by m={m}; got {sorted(shapes)}")


def run_2bw(model: GPT, ctx: ParallelContext, batches: Sequence[tuple[torch.Tensor, torch.Tensor]], *,
            microbatches: int, lr: float) -> TwoBWResult:
    """Train ``model`` with PipeDream-2BW over ``batches`` on the pipeline ranks of ``ctx`` (module doc).

    Every rank passes the same GPT (same seed) and the same ``batches`` ``[(x, y), ...]`` (token ids and targets,
    ``(B, T)``); rank ``r`` keeps stage ``r`` of ``split_gpt(model, p)``. Each batch is ``microbatches`` micro-
    batches, each micro-batch loss weighted ``1/m``; the update is plain SGD with ``lr`` (section 3.1's rule).
    On return this rank's stage of ``model`` holds the newest version ``W(N)``; other stages are untouched.
    """
    m, p, r = microbatches, ctx.pp_size, ctx.pp_rank
    _check_run(model, ctx, batches, m, lr)
    sched = two_bw_schedule(p, m, len(batches))
    plan = version_plan(p, m, len(batches), r)
    stage: GPTStage = split_gpt(model, p)[r].to(ctx.device)
    slots = [stage, copy.deepcopy(stage)]
    runtimes = [StageRuntime(s, ctx.device) for s in slots]
    # The stream of micro-batches: token ids feed the first stage, targets the last.
    xs = [t.to(ctx.device) for x, _ in batches for t in _micro(x, m)] if stage.is_first else []
    ys = [t.to(ctx.device) for _, y in batches for t in _micro(y, m)] if stage.is_last else []
    hidden = (batches[0][0].shape[0] // m, batches[0][0].shape[1], model.config.n_embd)
    dtype = runtimes[0].dtype
    result = TwoBWResult(stage=r, losses=[])
    params = [list(s.parameters()) for s in slots]
    result.stage_bytes = _unique_bytes(params[0])
    result.version_bytes = _unique_bytes(params[0] + params[1])
    result.pipedream_stash_bytes = stash_versions(p, r, "pipedream") * result.stage_bytes
    mb_loss: dict[int, torch.Tensor] = {}
    recv: dict[tuple[str, int], torch.Tensor] = {}
    to_send: dict[Action, torch.Tensor] = {}
    pending: InFlight = []
    steps = iter(plan)

    def update(batch: int) -> None:
        # W(b+1) = W(b) - lr * g_b(W(b-1)), written over W(b-1)'s slot (for b = 0 the empty second slot).
        newer, used, new = params[batch % 2], params[version_of(batch * m, m) % 2], params[(batch + 1) % 2]
        result.grad_bytes = max(result.grad_bytes, _unique_bytes([q.grad for q in used if q.grad is not None]))
        with torch.no_grad():
            for q_newer, q_used, q_new in zip(newer, used, new):
                if q_used.grad is None:
                    q_new.copy_(q_newer)
                else:
                    torch.add(q_newer, q_used.grad, alpha=-lr, out=q_new)
                q_used.grad = None

    actions = sched.actions(r)
    i = 0
    while i < len(actions):
        if actions[i].is_comm:
            j = i
            while j < len(actions) and actions[j].is_comm:
                j += 1
            run, tensors = actions[i:j], []
            for c in run:
                if c.kind.startswith("SEND"):
                    tensors.append(to_send.pop(c).detach())  # an alias keeps the storage alive for the send
                else:
                    recv[(c.kind, c.mb)] = torch.empty(hidden, device=ctx.device, dtype=dtype)
                    tensors.append(recv[(c.kind, c.mb)])
            def posted(run: Sequence[Action] = run) -> None:
                for c in run:
                    if c.kind == "SEND_F":
                        runtimes[version_of(c.mb, m) % 2].deallocate_output(c.mb)

            # the executor's rule (lslm.pipeline.p2p.exchange): one batch, waited if it receives, sends reaped
            pending = exchange(ctx, run, tensors, sched.stage_to_rank, pending, posted)
            i = j
            continue
        a, step = actions[i], next(steps)
        assert step.action == a, f"plan and schedule disagree at {a}"
        rt = runtimes[step.version % 2]
        if a.kind == "F":
            x = xs[a.mb] if stage.is_first else recv.pop(("RECV_F", a.mb))
            out = rt.forward(a.mb, x, ys[a.mb] if stage.is_last else None, 1.0 / m)
            if stage.is_last:
                mb_loss[a.mb] = out
            else:
                to_send[Action(r, "SEND_F", a.mb)] = out
        else:
            gin = rt.backward(a.mb, None if stage.is_last else recv.pop(("RECV_B", a.mb)))
            if not stage.is_first:
                assert gin is not None
                to_send[Action(r, "SEND_B", a.mb)] = gin
            if step.creates is not None:
                update(step.creates - 1)
                result.updates.append((a.mb, step.creates))
        result.trace.append((a.kind, a.mb, step.version))
        i += 1
    for w, _ in pending:
        w.wait()
    for rt in runtimes:
        rt.finish()
    assert not (recv or to_send), f"rank {r}: tensors never consumed: {sorted(recv)} {sorted(map(str, to_send))}"
    newest = params[len(batches) % 2]
    if newest is not params[0]:
        with torch.no_grad():
            for q, q_newest in zip(params[0], newest):
                q.copy_(q_newest)
    result.losses = _batch_losses(ctx, mb_loss, len(batches), m)
    return result


def _batch_losses(ctx: ParallelContext, mb_loss: dict[int, torch.Tensor], n: int, m: int) -> list[float]:
    """Each batch's mean micro-batch loss, computed on the last stage and broadcast to every pipeline rank."""
    losses = torch.zeros(n, device=ctx.device, dtype=torch.float64)
    if ctx.is_last_stage:
        for j, loss in mb_loss.items():
            losses[j // m] += loss.double() / m
    if ctx.pp_size > 1:
        ctx.comm.broadcast(losses, src=ctx.group_ranks("pp")[-1], group=ctx.pp_group, label=LOSS_LABEL)
    return losses.tolist()
