"""Pipeline point-to-point: one batch of send/receive actions, posted together through the ledger.

The executor posts each maximal run of consecutive communication actions of its list as
ONE ``batch_isend_irecv`` (after a forward, ``SEND_F; RECV_B`` is Megatron's
``send_forward_recv_backward``). Posting both directions together is what keeps NCCL
from deadlocking when two neighbours send to each other at once (a lone blocking send
waits for its receive, which the peer posts only after its own send returned).

Peers: an action names a *virtual* stage; its peer is the stage before or after it,
on the rank ``stage_to_rank`` gives, turned into a global rank through the pipeline
group of this rank (``ctx.group_ranks("pp")``, ordered by pipeline rank).

Ledger labels name the action's own stage: ``"pp F s<stage> mb<mb>"`` for activations
(``SEND_F`` of stage ``s`` and the ``RECV_F`` of stage ``s + 1`` are one message, recorded
as ``s`` on the sender and ``s + 1`` on the receiver) and ``"pp B s<stage> mb<mb>"`` for
gradients; the record's op (send/recv) and label give back the action
(:func:`action_of_record`), which is how measured timelines get their communication bars.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist

from lslm.pipeline.actions import Action
from lslm.runtime.context import ParallelContext
from lslm.runtime.records import CommRecord

__all__ = ["InFlight", "action_of_record", "comm_label", "exchange", "is_p2p_label", "peer_stage", "post",
           "reap_completed"]

#: Sends still in flight: each work with the tensors it keeps alive until it is waited.
InFlight = list[tuple[Any, list[torch.Tensor]]]

_LABEL = re.compile(r"^pp ([FB]) s(\d+) mb(\d+)$")


def comm_label(action: Action) -> str:
    """The ledger label of a communication action: ``"pp F s2 mb5"`` / ``"pp B s2 mb5"``."""
    direction = action.kind[-1]  # SEND_F/RECV_F -> F, SEND_B/RECV_B -> B
    return f"pp {direction} s{action.stage} mb{action.mb}"


def is_p2p_label(label: str) -> bool:
    """True for a ledger label :func:`comm_label` makes: an activation or a gradient between stages."""
    return _LABEL.match(label) is not None


def action_of_record(record: CommRecord) -> Action | None:
    """The communication action a ledger record came from (None for records that are not pipeline p2p)."""
    hit = _LABEL.match(record.label)
    if hit is None or record.op not in ("send", "recv"):
        return None
    return Action(int(hit[2]), f"{record.op.upper()}_{hit[1]}", int(hit[3]))


def peer_stage(action: Action) -> int:
    """The virtual stage on the other side of a communication action."""
    return action.stage + (1 if action.kind in ("SEND_F", "RECV_B") else -1)


def post(ctx: ParallelContext, actions: Sequence[Action], tensors: Sequence[torch.Tensor],
         stage_to_rank: Sequence[int]) -> list[Any]:
    """Post ``actions`` (communication only) with their ``tensors`` (what to send / where to receive) as one
    ``batch_isend_irecv``; returns every work (the caller must wait on each)."""
    pp_ranks = ctx.group_ranks("pp")
    ops, labels = [], []
    for action, tensor in zip(actions, tensors, strict=True):
        if not action.is_comm:
            raise ValueError(f"{action} is not a communication action")
        peer = pp_ranks[stage_to_rank[peer_stage(action)]]
        if peer == ctx.rank:
            raise ValueError(f"{action}: stages {action.stage} and {peer_stage(action)} are both on this rank; "
                             f"adjacent stages on one rank hand tensors over without communication")
        op = dist.isend if action.kind.startswith("SEND") else dist.irecv
        ops.append(dist.P2POp(op, tensor, peer, group=ctx.pp_group))
        labels.append(comm_label(action))
    return ctx.comm.batch_isend_irecv(ops, label=labels)


def reap_completed(in_flight: InFlight) -> InFlight:
    """Wait the works that already completed (no blocking; frees what they kept alive); return the others."""
    left = []
    for w, keep in in_flight:
        if w.is_completed():
            w.wait()  # returns at once; waited all the same, so every Work is waited on (NCCL's rule)
        else:
            left.append((w, keep))
    return left


def exchange(ctx: ParallelContext, batch: Sequence[Action], tensors: Sequence[torch.Tensor],
             stage_to_rank: Sequence[int], in_flight: InFlight,
             posted: Callable[[], None] | None = None) -> InFlight:
    """One run of communication actions, the executors' one rule: post it as one batch (:func:`post`), call
    ``posted()`` (outputs may be deallocated now: the sends hold aliases), wait for every work if the run
    receives anything (the next compute needs the data), else keep its works in flight; return the sends
    still in flight after reaping those that completed. Every work is waited on, at the end at the latest.
    """
    works = post(ctx, batch, tensors, stage_to_rank)
    if posted is not None:
        posted()
    if any(c.kind.startswith("RECV") for c in batch):
        for w in works:
            w.wait()
    elif len(works) == len(tensors):  # gloo: one work per op, keeping its own tensor alive
        in_flight = in_flight + [(w, [keep]) for w, keep in zip(works, tensors)]
    else:  # NCCL may return one work for the whole batch
        in_flight = in_flight + [(w, list(tensors)) for w in works]
    return reap_completed(in_flight)
