"""The communication ledger: every collective and p2p call lslm makes, with its bytes.

All of lslm communicates through a :class:`Comm`, a thin wrapper over
``torch.distributed`` that appends one :class:`CommRecord` per call to a
:class:`CommLedger`. Tests then assert that the measured volume equals the
theory *exactly* (DDP all-reduces 2Ψ(n-1)/n bytes per rank, ZeRO-3 moves 3Ψ, ...),
and notebooks plot it. Counting is machine-independent, so it is the same on a
laptop with gloo and on a GPU cluster with NCCL.

Two sizes are recorded per call:

* ``nbytes`` - the size of the buffer the operation is defined on: the tensor
  for all-reduce/broadcast/reduce/send/recv, the *full* gathered output for
  all-gather and gather, the *full* input for reduce-scatter and scatter, the
  input for all-to-all.
* ``bus_bytes`` - what each rank must send with a bandwidth-optimal algorithm,
  ``nbytes`` times the nccl-tests "bus bandwidth" factor: 2(n-1)/n for
  all-reduce, (n-1)/n for all-gather, reduce-scatter, all-to-all, gather and
  scatter, 1 for broadcast, reduce, send and recv.

The wrapper also hides API drift: torch 2.13 deprecates
``all_gather_into_tensor``/``reduce_scatter_tensor`` (FutureWarning) in favour
of ``all_gather_single``/``reduce_scatter_single``, which older versions lack.
"""

from __future__ import annotations

import threading
from collections import defaultdict
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed import ReduceOp

_BUS_FACTOR_KIND = {
    "all_reduce": "2(n-1)/n",
    "all_gather": "(n-1)/n",
    "reduce_scatter": "(n-1)/n",
    "all_to_all": "(n-1)/n",
    "gather": "(n-1)/n",
    "scatter": "(n-1)/n",
    "broadcast": "1",
    "reduce": "1",
    "send": "1",
    "recv": "1",
    "barrier": "0",
}


def bus_factor(op: str, group_size: int) -> float:
    """The nccl-tests bus-bandwidth factor of ``op`` on ``group_size`` ranks (see module doc)."""
    kind = _BUS_FACTOR_KIND.get(op)
    if kind is None:
        raise ValueError(f"unknown op {op!r}; known: {sorted(_BUS_FACTOR_KIND)}")
    n = group_size
    return {"2(n-1)/n": 2 * (n - 1) / n, "(n-1)/n": (n - 1) / n, "1": 1.0, "0": 0.0}[kind]


@dataclass(frozen=True)
class CommRecord:
    """One communication call as seen by this rank."""

    op: str
    nbytes: int
    group_size: int
    dtype: str = ""
    peer: int | None = None  # global rank of the other side, for send/recv
    label: str = ""  # free text set by the caller (e.g. "bucket 3"), for plots

    @property
    def bus_bytes(self) -> float:
        """Bytes each rank sends under a bandwidth-optimal algorithm (see module doc)."""
        return self.nbytes * bus_factor(self.op, self.group_size)


@dataclass
class CommLedger:
    """An append-only list of :class:`CommRecord` for one rank, resettable and summarisable."""

    records: list[CommRecord] = field(default_factory=list)
    enabled: bool = True
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False, compare=False)

    def record(self, rec: CommRecord) -> None:
        """Append ``rec`` (a no-op while ``enabled`` is False)."""
        if self.enabled:
            # Gradient hooks may fire on autograd's worker thread.
            with self._lock:
                self.records.append(rec)

    def reset(self) -> None:
        """Forget every record."""
        with self._lock:
            self.records.clear()

    def select(self, op: str | None = None, label: str | None = None, since: int = 0) -> list[CommRecord]:
        """The records from index ``since`` on (``len(records)`` taken earlier), of one op and/or one label.

        ``None`` matches any op or label. Counting "what this step sent" is
        ``since=len(ledger.records)`` read before the step.
        """
        with self._lock:
            recs = self.records[since:]
        return [r for r in recs if (op is None or r.op == op) and (label is None or r.label == label)]

    def total_bytes(self, op: str | None = None, label: str | None = None, since: int = 0) -> int:
        """Sum of ``nbytes`` over the records :meth:`select` picks (default: all)."""
        return sum(r.nbytes for r in self.select(op, label, since))

    def total_bus_bytes(self, op: str | None = None, label: str | None = None, since: int = 0) -> float:
        """Sum of ``bus_bytes`` over the records :meth:`select` picks (default: all)."""
        return sum(r.bus_bytes for r in self.select(op, label, since))

    def calls(self, op: str | None = None, label: str | None = None, since: int = 0) -> int:
        """Number of calls among the records :meth:`select` picks (default: all)."""
        return len(self.select(op, label, since))

    def summary(self) -> dict[str, dict[str, float]]:
        """Per op: ``{"calls", "bytes", "bus_bytes"}`` - JSON-ready, one per rank."""
        out: dict[str, dict[str, float]] = defaultdict(lambda: {"calls": 0, "bytes": 0, "bus_bytes": 0.0})
        for r in self.records:
            row = out[r.op]
            row["calls"] += 1
            row["bytes"] += r.nbytes
            row["bus_bytes"] += r.bus_bytes
        return dict(out)

    def to_list(self) -> list[dict[str, Any]]:
        """Every record as a dict (with ``bus_bytes``), for JSON results."""
        return [{**asdict(r), "bus_bytes": r.bus_bytes} for r in self.records]


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def _dtype(t: torch.Tensor) -> str:
    return str(t.dtype).removeprefix("torch.")


class Comm:
    """``torch.distributed`` collectives and p2p, each call recorded in ``self.ledger``.

    Arguments mean what they mean in ``torch.distributed`` (``src``/``dst``/``peer``
    are global ranks; ``group=None`` is the default group). Each method returns what
    the torch call returns (a work handle when ``async_op=True``). Tensors must be
    contiguous: gloo and NCCL both require it, and we check early to give a clear error.
    """

    def __init__(self, ledger: CommLedger | None = None) -> None:
        self.ledger = ledger if ledger is not None else CommLedger()

    # -- helpers ---------------------------------------------------------------
    def _log(self, op: str, t: torch.Tensor, nbytes: int, group: Any, peer: int | None = None, label: str = "") -> None:
        size = dist.get_world_size(group) if op not in ("send", "recv") else 2
        self.ledger.record(CommRecord(op=op, nbytes=nbytes, group_size=size, dtype=_dtype(t), peer=peer, label=label))

    @staticmethod
    def _contig(*tensors: torch.Tensor) -> None:
        for t in tensors:
            if not t.is_contiguous():
                raise ValueError("collectives need contiguous tensors: call .contiguous() on the input/output first")

    # -- collectives -----------------------------------------------------------
    def all_reduce(self, tensor: torch.Tensor, op: ReduceOp.RedOpType = ReduceOp.SUM, group: Any = None,
                   async_op: bool = False, label: str = "") -> Any:
        """In-place all-reduce of ``tensor`` across ``group``."""
        self._contig(tensor)
        self._log("all_reduce", tensor, _nbytes(tensor), group, label=label)
        return dist.all_reduce(tensor, op=op, group=group, async_op=async_op)

    def broadcast(self, tensor: torch.Tensor, src: int, group: Any = None, async_op: bool = False,
                  label: str = "") -> Any:
        """In-place broadcast of ``tensor`` from global rank ``src``."""
        self._contig(tensor)
        self._log("broadcast", tensor, _nbytes(tensor), group, label=label)
        return dist.broadcast(tensor, src=src, group=group, async_op=async_op)

    def reduce(self, tensor: torch.Tensor, dst: int, op: ReduceOp.RedOpType = ReduceOp.SUM, group: Any = None,
               async_op: bool = False, label: str = "") -> Any:
        """Reduce ``tensor`` onto global rank ``dst`` (in place there)."""
        self._contig(tensor)
        self._log("reduce", tensor, _nbytes(tensor), group, label=label)
        return dist.reduce(tensor, dst=dst, op=op, group=group, async_op=async_op)

    def all_gather(self, tensor_list: list[torch.Tensor], tensor: torch.Tensor, group: Any = None,
                   async_op: bool = False, label: str = "") -> Any:
        """Gather every rank's ``tensor`` into ``tensor_list`` on every rank."""
        self._contig(tensor, *tensor_list)
        self._log("all_gather", tensor, sum(_nbytes(t) for t in tensor_list), group, label=label)
        return dist.all_gather(tensor_list, tensor, group=group, async_op=async_op)

    def all_gather_into_tensor(self, output: torch.Tensor, input: torch.Tensor, group: Any = None,
                               async_op: bool = False, label: str = "") -> Any:
        """Gather every rank's ``input`` into the flat ``output`` (rank order), without the 2.13 FutureWarning."""
        self._contig(output, input)
        if output.numel() != input.numel() * dist.get_world_size(group):
            raise ValueError(f"output has {output.numel()} elements, expected input.numel() x group size = "
                             f"{input.numel()} x {dist.get_world_size(group)}")
        self._log("all_gather", input, _nbytes(output), group, label=label)
        fn = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
        return fn(output, input, group=group, async_op=async_op)

    def reduce_scatter_tensor(self, output: torch.Tensor, input: torch.Tensor, op: ReduceOp.RedOpType = ReduceOp.SUM,
                              group: Any = None, async_op: bool = False, label: str = "") -> Any:
        """Reduce the flat ``input`` across ranks and leave chunk ``rank`` in ``output``, without the FutureWarning."""
        self._contig(output, input)
        if input.numel() != output.numel() * dist.get_world_size(group):
            raise ValueError(f"input has {input.numel()} elements, expected output.numel() x group size = "
                             f"{output.numel()} x {dist.get_world_size(group)}")
        self._log("reduce_scatter", input, _nbytes(input), group, label=label)
        fn = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
        return fn(output, input, op=op, group=group, async_op=async_op)

    def reduce_scatter(self, output: torch.Tensor, input_list: list[torch.Tensor],
                       op: ReduceOp.RedOpType = ReduceOp.SUM, group: Any = None, async_op: bool = False,
                       label: str = "") -> Any:
        """List form of reduce-scatter: ``output`` receives the reduction of everyone's ``input_list[rank]``."""
        self._contig(output, *input_list)
        self._log("reduce_scatter", output, sum(_nbytes(t) for t in input_list), group, label=label)
        return dist.reduce_scatter(output, input_list, op=op, group=group, async_op=async_op)

    def gather(self, tensor: torch.Tensor, gather_list: list[torch.Tensor] | None, dst: int, group: Any = None,
               async_op: bool = False, label: str = "") -> Any:
        """Gather every rank's ``tensor`` into ``gather_list`` on global rank ``dst``."""
        self._contig(tensor)
        self._log("gather", tensor, _nbytes(tensor) * dist.get_world_size(group), group, label=label)
        return dist.gather(tensor, gather_list, dst=dst, group=group, async_op=async_op)

    def scatter(self, tensor: torch.Tensor, scatter_list: list[torch.Tensor] | None, src: int, group: Any = None,
                async_op: bool = False, label: str = "") -> Any:
        """Scatter ``scatter_list`` from global rank ``src``: rank i receives item i into ``tensor``."""
        self._contig(tensor)
        self._log("scatter", tensor, _nbytes(tensor) * dist.get_world_size(group), group, label=label)
        return dist.scatter(tensor, scatter_list, src=src, group=group, async_op=async_op)

    def all_to_all_single(self, output: torch.Tensor, input: torch.Tensor, group: Any = None,
                          async_op: bool = False, label: str = "") -> Any:
        """Equal-split all-to-all: chunk j of ``input`` goes to rank j, which stores it as chunk ``rank``."""
        self._contig(output, input)
        self._log("all_to_all", input, _nbytes(input), group, label=label)
        return dist.all_to_all_single(output, input, group=group, async_op=async_op)

    def barrier(self, group: Any = None) -> None:
        """Block until every rank of ``group`` arrives (recorded with 0 bytes)."""
        self.ledger.record(CommRecord(op="barrier", nbytes=0, group_size=dist.get_world_size(group)))
        dist.barrier(group=group)

    # -- point to point --------------------------------------------------------
    def send(self, tensor: torch.Tensor, dst: int, group: Any = None, label: str = "") -> None:
        """Blocking send of ``tensor`` to global rank ``dst``."""
        self._contig(tensor)
        self._log("send", tensor, _nbytes(tensor), group, peer=dst, label=label)
        dist.send(tensor, dst=dst, group=group)

    def recv(self, tensor: torch.Tensor, src: int, group: Any = None, label: str = "") -> None:
        """Blocking receive into ``tensor`` from global rank ``src``."""
        self._contig(tensor)
        self._log("recv", tensor, _nbytes(tensor), group, peer=src, label=label)
        dist.recv(tensor, src=src, group=group)

    def isend(self, tensor: torch.Tensor, dst: int, group: Any = None, label: str = "") -> Any:
        """Non-blocking send; returns a work handle to ``wait()`` on."""
        self._contig(tensor)
        self._log("send", tensor, _nbytes(tensor), group, peer=dst, label=label)
        return dist.isend(tensor, dst=dst, group=group)

    def irecv(self, tensor: torch.Tensor, src: int, group: Any = None, label: str = "") -> Any:
        """Non-blocking receive; returns a work handle to ``wait()`` on."""
        self._contig(tensor)
        self._log("recv", tensor, _nbytes(tensor), group, peer=src, label=label)
        return dist.irecv(tensor, src=src, group=group)

    def batch_isend_irecv(self, ops: Sequence[dist.P2POp], label: str = "") -> list[Any]:
        """Post several sends/receives together; returns their work handles."""
        for p in ops:
            self._contig(p.tensor)
            kind = "send" if p.op in (dist.isend, getattr(dist, "send", None)) else "recv"
            self._log(kind, p.tensor, _nbytes(p.tensor), p.group, peer=p.peer, label=label)
        return dist.batch_isend_irecv(list(ops))
