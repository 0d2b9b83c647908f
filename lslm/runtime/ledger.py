"""The communication ledger: every collective and p2p call lslm makes, with its bytes, axis and times.

All of lslm communicates through a :class:`Comm`, a thin wrapper over
``torch.distributed`` that appends one :class:`~lslm.runtime.records.CommRecord`
per call to a :class:`~lslm.runtime.records.CommLedger`. Tests then assert that the
measured volume equals the theory *exactly* (DDP all-reduces 2Ψ(n-1)/n bytes per
rank, ZeRO-3 moves 3Ψ, ...), and notebooks plot volumes and overlap from it.
Counting is machine-independent, so it is the same on a laptop with gloo and on a
GPU cluster with NCCL.

Each record carries:

* ``op``, ``dtype``, ``group_size``, ``peer`` (global rank, for send/recv);
* ``nbytes`` - the size of the buffer the operation is defined on: the tensor
  for all-reduce/broadcast/reduce/send/recv, the *full* gathered output for
  all-gather and gather, the *full* input for reduce-scatter and scatter, the
  input for all-to-all;
* ``bus_bytes`` - what each rank must send with a bandwidth-optimal algorithm,
  ``nbytes`` times the nccl-tests "bus bandwidth" factor: 2(n-1)/n for
  all-reduce, (n-1)/n for all-gather, reduce-scatter, all-to-all, gather and
  scatter, 1 for broadcast, reduce, send and recv;
* ``label`` - free text from the caller ("bucket 3"; not ``tag``: torch's ``tag``
  is the integer that matches sends to receives);
* ``axis`` - the name of the group: :class:`~lslm.runtime.context.ParallelContext`
  registers each of its groups with :meth:`Comm.name_group` under the grid axes
  it spans ("dp", "dp,cp"); the default group is "world" (also where a context's
  axes span every rank, e.g. "dp" in a pure data-parallel run); a group nobody
  named is "";
* ``issue_s`` / ``completion_s`` - ``time.perf_counter()`` when the call was made
  and when the operation finished (see :mod:`lslm.runtime.completion`: after the
  call for blocking CPU ops, from the work for asynchronous ones, from CUDA events
  on GPUs; ``None`` until known). Completion times are opt-in, for timelines: only
  calls issued while ``ledger.stamps_completion`` holds (``ledger.record_completion =
  True``, or inside ``with ledger.timed():``) get one; the others keep ``None``, and an
  asynchronous call then returns torch's own work, with no wrapper and no callback.

While a ``torch.profiler`` runs, every call is also a named ``record_function`` range
(op, axis, bytes, group size, label; an asynchronous call's ``wait()`` a second range):
see :mod:`lslm.runtime.comm_trace`.

A :class:`Comm` made outside a context (``Comm()``) records into its own new
ledger; nothing is dropped unless a caller pauses the ledger on purpose, and then
the ledger counts what it skipped (``ledger.dropped``).

The wrapper also hides API drift: torch 2.13 deprecates
``all_gather_into_tensor``/``reduce_scatter_tensor`` (FutureWarning) in favour
of ``all_gather_single``/``reduce_scatter_single``, which older versions lack.
"""

from __future__ import annotations

import pickle
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed import ReduceOp

from lslm.runtime.comm_trace import TracedWork, comm_ranges, profiling, range_name
from lslm.runtime.completion import TimedWork, prepare, stamp
from lslm.runtime.records import CommLedger, CommRecord, bus_factor

__all__ = ["Comm", "CommLedger", "CommRecord", "bus_factor"]

WORLD_NAME = "world"


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def _dtype(t: torch.Tensor) -> str:
    return str(t.dtype).removeprefix("torch.")


class Comm:
    """``torch.distributed`` collectives and p2p, each call recorded in ``self.ledger``.

    Arguments mean what they mean in ``torch.distributed`` (``src``/``dst``/``peer``
    are global ranks; ``group=None`` is the default group). Each method returns what
    the torch call returns: an asynchronous call returns torch's own work, unless the
    ledger stamps completion times (:attr:`CommLedger.stamps_completion`); then the work
    comes wrapped in a :class:`~lslm.runtime.completion.TimedWork` (same
    ``wait``/``is_completed``/``get_future``), which stamps the record's completion time.
    Tensors must be contiguous: gloo and NCCL both require it, and we check early to give
    a clear error.

    ``device`` is where lslm allocates communication tensors that have no data
    tensor to follow (barriers, control flags); see :meth:`default_device`.
    """

    def __init__(self, ledger: CommLedger | None = None, device: torch.device | str | None = None) -> None:
        self.ledger = ledger if ledger is not None else CommLedger()
        self.device = torch.device(device) if device is not None else None
        self._names: dict[int, tuple[Any, str]] = {}
        self._scratch: dict[tuple[int, int, torch.dtype, torch.device], torch.Tensor] = {}
        self._trace_seq = 0  # numbers the profiler ranges of this Comm's calls (joins a call to its wait)

    # -- groups and devices ------------------------------------------------------
    def name_group(self, group: Any, name: str) -> None:
        """Record calls on ``group`` under the axis ``name`` (ParallelContext names all of its groups)."""
        self._names[id(group)] = (group, name)  # keep the group: its id cannot be reused while we hold it

    def forget_group(self, group: Any) -> None:
        """Drop ``group``'s name (it was destroyed): the Comm no longer keeps it alive."""
        self._names.pop(id(group), None)

    def group_name(self, group: Any) -> str:
        """The ledger axis of ``group``: "world" for the default group (``None`` or the object), else its name or ""."""
        if group is None or (dist.is_initialized() and group is dist.group.WORLD):
            # Always "world", even where a ParallelContext's axes span the world: torch turns
            # group=None into the world object in places (P2POp), so the name cannot depend on which.
            return WORLD_NAME
        hit = self._names.get(id(group))
        return hit[1] if hit is not None and hit[0] is group else ""

    def scratch(self, numel: int, dtype: torch.dtype, device: torch.device | str, slot: int = 0) -> torch.Tensor:
        """A receive buffer of ``numel`` elements that this Comm keeps for the next call (contents undefined).

        Algorithms built from send/recv (the rings) need a place for incoming partials.
        A fresh buffer per call costs page faults and the kernel's zeroing of every page
        on the CPU: measured ~1-3 % of a 16 MiB ring all-reduce on 4 gloo processes.
        Buffers are per thread, ``slot`` (two in flight need two slots), dtype and device,
        and grow to the largest request; :meth:`scratch_bytes` says what they hold and
        :meth:`free_scratch` gives it back. Only for use inside one call: every operation
        on it must be waited for before the call returns.
        """
        key = (threading.get_ident(), slot, dtype, torch.device(device))
        buf = self._scratch.get(key)
        if buf is None or buf.numel() < numel:
            buf = self._scratch[key] = torch.empty(numel, dtype=dtype, device=device)
        return buf[:numel]

    def scratch_bytes(self) -> int:
        """Bytes held by :meth:`scratch` buffers (every thread, slot, dtype and device)."""
        return sum(t.numel() * t.element_size() for t in self._scratch.values())

    def free_scratch(self) -> None:
        """Drop every :meth:`scratch` buffer (the next call allocates again)."""
        self._scratch.clear()

    def default_device(self, group: Any = None) -> torch.device:
        """Where to put a communication tensor that has no data tensor to follow.

        ``self.device`` when set (a ParallelContext sets it to ``ctx.device``); else the
        current CUDA device for a group whose backend is NCCL, the CPU otherwise.
        """
        if self.device is not None:
            return self.device
        if dist.is_initialized() and "nccl" in str(dist.get_backend(group)):
            return torch.device("cuda", torch.cuda.current_device())
        return torch.device("cpu")

    # -- helpers ---------------------------------------------------------------
    def _traced(self, calls: Sequence[tuple[str, int, Any, str, int | None]], run: Callable[[], Any],
                async_op: bool) -> Any:
        """Run ``run()`` inside one profiler range per ``(op, nbytes, group, label, peer)``; wrap async works.

        Only called while a profiler runs. A list of works (a p2p batch) gets one wait range per
        call when the counts match, else every wait range around each work.
        """
        names, waits = [], []
        for op, nbytes, group, label, peer in calls:
            self._trace_seq = getattr(self, "_trace_seq", 0) + 1
            size = 2 if op in ("send", "recv") else dist.get_world_size(group)
            args = (op, self.group_name(group), nbytes, size, label, self._trace_seq, peer)
            names.append(range_name(*args))
            waits.append(range_name(*args, wait=True))
        with comm_ranges(names):
            out = run()
        if not async_op or out is None:
            return out
        if isinstance(out, list):
            if len(out) == len(waits):
                return [TracedWork(w, [n]) for w, n in zip(out, waits)]
            return [TracedWork(w, waits) for w in out]
        return TracedWork(out, waits)

    def _issue(self, op: str, t: torch.Tensor | None, nbytes: int, group: Any, peer: int | None = None,
               label: str = "", timed: bool = False) -> CommRecord:
        size = 2 if op in ("send", "recv") else dist.get_world_size(group)
        if timed and t is not None:
            prepare(t.device)  # the CUDA clock's anchor: only a timed call needs it (one device sync)
        rec = CommRecord(op=op, nbytes=nbytes, group_size=size, dtype=_dtype(t) if t is not None else "", peer=peer,
                         label=label, axis=self.group_name(group), issue_s=time.perf_counter())
        self.ledger.record(rec)
        return rec

    def _collective(self, kind: str, t: torch.Tensor, nbytes: int, group: Any, label: str, fn: Callable[..., Any],
                    /, *args: Any, **kwargs: Any) -> Any:
        """Record and run the collective ``fn``; while the ledger is disabled, only count it and run it.

        Three paths, cheapest first (``python -m lslm.bench.ledger`` measures each against a bare
        ``torch.distributed`` call): disabled, torch's call plus one counter (no record, no clock);
        enabled, a record with its issue time, and torch's own work back; enabled with completion
        times (:attr:`CommLedger.stamps_completion`), also a stamp when a blocking call returns, or
        a work wrapper and a callback on the work's future for an asynchronous one.
        """
        if profiling():
            return self._traced([(kind, nbytes, group, label, None)],
                                lambda: self._record_and_run(kind, t, nbytes, group, label, fn, *args, **kwargs),
                                bool(kwargs.get("async_op", False)))
        return self._record_and_run(kind, t, nbytes, group, label, fn, *args, **kwargs)

    def _record_and_run(self, kind: str, t: torch.Tensor, nbytes: int, group: Any, label: str,
                        fn: Callable[..., Any], /, *args: Any, **kwargs: Any) -> Any:
        ledger = self.ledger
        if not ledger.enabled:
            ledger.drop(1)
            return fn(*args, **kwargs)
        # Positional-only: ``group`` and ``op`` also travel in kwargs, to torch's call.
        if not ledger.stamps_completion:
            self._issue(kind, t, nbytes, group, label=label)
            return fn(*args, **kwargs)
        rec = self._issue(kind, t, nbytes, group, label=label, timed=True)
        return self._call(rec, t.device, fn, *args, **kwargs)

    def _call(self, rec: CommRecord, device: torch.device, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        """Run ``fn`` for a timed record; stamp ``rec`` when it returns (blocking) or wrap its work (asynchronous)."""
        work = fn(*args, **kwargs)
        if work is None or not kwargs.get("async_op", True):
            stamp([rec.done], device)
            return work
        return TimedWork(work, [rec.done], device)

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
        return self._collective("all_reduce", tensor, _nbytes(tensor), group, label, dist.all_reduce, tensor, op=op,
                                group=group, async_op=async_op)

    def broadcast(self, tensor: torch.Tensor, src: int, group: Any = None, async_op: bool = False,
                  label: str = "") -> Any:
        """In-place broadcast of ``tensor`` from global rank ``src``."""
        self._contig(tensor)
        return self._collective("broadcast", tensor, _nbytes(tensor), group, label, dist.broadcast, tensor, src=src,
                                group=group, async_op=async_op)

    def reduce(self, tensor: torch.Tensor, dst: int, op: ReduceOp.RedOpType = ReduceOp.SUM, group: Any = None,
               async_op: bool = False, label: str = "") -> Any:
        """Reduce ``tensor`` onto global rank ``dst`` (in place there)."""
        self._contig(tensor)
        return self._collective("reduce", tensor, _nbytes(tensor), group, label, dist.reduce, tensor, dst=dst, op=op,
                                group=group, async_op=async_op)

    def all_gather(self, tensor_list: list[torch.Tensor], tensor: torch.Tensor, group: Any = None,
                   async_op: bool = False, label: str = "") -> Any:
        """Gather every rank's ``tensor`` into ``tensor_list`` on every rank."""
        self._contig(tensor, *tensor_list)
        return self._collective("all_gather", tensor, sum(_nbytes(t) for t in tensor_list), group, label,
                                dist.all_gather, tensor_list, tensor, group=group, async_op=async_op)

    def all_gather_into_tensor(self, output: torch.Tensor, input: torch.Tensor, group: Any = None,
                               async_op: bool = False, label: str = "") -> Any:
        """Gather every rank's ``input`` into the flat ``output`` (rank order), without the 2.13 FutureWarning."""
        self._contig(output, input)
        if output.numel() != input.numel() * dist.get_world_size(group):
            raise ValueError(f"output has {output.numel()} elements, expected input.numel() x group size = "
                             f"{input.numel()} x {dist.get_world_size(group)}")
        fn = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
        return self._collective("all_gather", input, _nbytes(output), group, label, fn, output, input, group=group,
                                async_op=async_op)

    def all_gather_object(self, obj: Any, group: Any = None, label: str = "") -> list[Any]:
        """Every rank's picklable ``obj``, in rank order, on every rank (``dist.all_gather_object``'s job).

        Done the way torch does it, with two recorded all-gathers, so the ledger sees the bytes:
        each rank's pickled size (one int64), then the pickles padded to the longest. The tensors
        live on :meth:`default_device` (NCCL gathers on the GPU). Only for trusted peers: the
        bytes are unpickled.
        """
        device = self.default_device(group)
        world = dist.get_world_size(group)
        data = pickle.dumps(obj)
        size = torch.tensor([len(data)], dtype=torch.int64, device=device)
        sizes = torch.empty(world, dtype=torch.int64, device=device)
        self.all_gather_into_tensor(sizes, size, group=group, label=label)
        longest = int(sizes.max())
        mine = torch.zeros(longest, dtype=torch.uint8, device=device)
        mine[:len(data)] = torch.frombuffer(bytearray(data), dtype=torch.uint8).to(device)
        everyone = torch.empty(world * longest, dtype=torch.uint8, device=device)
        self.all_gather_into_tensor(everyone, mine, group=group, label=label)
        raw = everyone.cpu().numpy().tobytes()
        return [pickle.loads(raw[r * longest:r * longest + int(n)]) for r, n in enumerate(sizes.tolist())]

    def reduce_scatter_tensor(self, output: torch.Tensor, input: torch.Tensor, op: ReduceOp.RedOpType = ReduceOp.SUM,
                              group: Any = None, async_op: bool = False, label: str = "") -> Any:
        """Reduce the flat ``input`` across ranks and leave chunk ``rank`` in ``output``, without the FutureWarning."""
        self._contig(output, input)
        if input.numel() != output.numel() * dist.get_world_size(group):
            raise ValueError(f"input has {input.numel()} elements, expected output.numel() x group size = "
                             f"{output.numel()} x {dist.get_world_size(group)}")
        fn = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
        return self._collective("reduce_scatter", input, _nbytes(input), group, label, fn, output, input, op=op,
                                group=group, async_op=async_op)

    def reduce_scatter(self, output: torch.Tensor, input_list: list[torch.Tensor],
                       op: ReduceOp.RedOpType = ReduceOp.SUM, group: Any = None, async_op: bool = False,
                       label: str = "") -> Any:
        """List form of reduce-scatter: ``output`` receives the reduction of everyone's ``input_list[rank]``."""
        self._contig(output, *input_list)
        return self._collective("reduce_scatter", output, sum(_nbytes(t) for t in input_list), group, label,
                                dist.reduce_scatter, output, input_list, op=op, group=group, async_op=async_op)

    def gather(self, tensor: torch.Tensor, gather_list: list[torch.Tensor] | None, dst: int, group: Any = None,
               async_op: bool = False, label: str = "") -> Any:
        """Gather every rank's ``tensor`` into ``gather_list`` on global rank ``dst``."""
        self._contig(tensor)
        return self._collective("gather", tensor, _nbytes(tensor) * dist.get_world_size(group), group, label,
                                dist.gather, tensor, gather_list, dst=dst, group=group, async_op=async_op)

    def scatter(self, tensor: torch.Tensor, scatter_list: list[torch.Tensor] | None, src: int, group: Any = None,
                async_op: bool = False, label: str = "") -> Any:
        """Scatter ``scatter_list`` from global rank ``src``: rank i receives item i into ``tensor``."""
        self._contig(tensor)
        return self._collective("scatter", tensor, _nbytes(tensor) * dist.get_world_size(group), group, label,
                                dist.scatter, tensor, scatter_list, src=src, group=group, async_op=async_op)

    def all_to_all_single(self, output: torch.Tensor, input: torch.Tensor, output_split_sizes: list[int] | None = None,
                          input_split_sizes: list[int] | None = None, group: Any = None, async_op: bool = False,
                          label: str = "") -> Any:
        """All-to-all: chunk j of ``input`` goes to rank j, which stores it as chunk ``rank``.

        Equal chunks by default; uneven ones with ``input_split_sizes`` / ``output_split_sizes``
        (rows of dim 0 per rank, as in torch). Recorded bytes: the whole ``input`` this rank hands
        over (the chunk it keeps included), as for the equal split.
        """
        self._contig(output, input)
        return self._collective("all_to_all", input, _nbytes(input), group, label, dist.all_to_all_single, output,
                                input, output_split_sizes, input_split_sizes, group=group, async_op=async_op)

    def barrier(self, group: Any = None, label: str = "") -> None:
        """Block until every rank of ``group`` arrives (recorded with 0 bytes; completion on the host clock)."""
        if profiling():
            return self._traced([("barrier", 0, group, label, None)],
                                lambda: self._barrier(group=group, label=label), False)
        return self._barrier(group=group, label=label)

    def _barrier(self, group: Any = None, label: str = "") -> None:
        if not self.ledger.enabled:
            self.ledger.drop(1)
            dist.barrier(group=group)
            return
        timed = self.ledger.stamps_completion
        rec = self._issue("barrier", None, 0, group, label=label, timed=timed)
        dist.barrier(group=group)
        if timed:
            rec.complete()  # a blocking barrier returns once every rank arrived, on every backend

    # -- point to point --------------------------------------------------------
    def send(self, tensor: torch.Tensor, dst: int, group: Any = None, label: str = "") -> None:
        """Blocking send of ``tensor`` to global rank ``dst``."""
        if profiling():
            return self._traced([("send", _nbytes(tensor), group, label, dst)],
                                lambda: self._send(tensor, dst, group=group, label=label), False)
        return self._send(tensor, dst, group=group, label=label)

    def _send(self, tensor: torch.Tensor, dst: int, group: Any = None, label: str = "") -> None:
        self._contig(tensor)
        if not self.ledger.enabled:
            self.ledger.drop(1)
            dist.send(tensor, dst=dst, group=group)
            return
        timed = self.ledger.stamps_completion
        rec = self._issue("send", tensor, _nbytes(tensor), group, peer=dst, label=label, timed=timed)
        dist.send(tensor, dst=dst, group=group)
        if timed:
            stamp([rec.done], tensor.device)

    def recv(self, tensor: torch.Tensor, src: int, group: Any = None, label: str = "") -> None:
        """Blocking receive into ``tensor`` from global rank ``src``."""
        if profiling():
            return self._traced([("recv", _nbytes(tensor), group, label, src)],
                                lambda: self._recv(tensor, src, group=group, label=label), False)
        return self._recv(tensor, src, group=group, label=label)

    def _recv(self, tensor: torch.Tensor, src: int, group: Any = None, label: str = "") -> None:
        self._contig(tensor)
        if not self.ledger.enabled:
            self.ledger.drop(1)
            dist.recv(tensor, src=src, group=group)
            return
        timed = self.ledger.stamps_completion
        rec = self._issue("recv", tensor, _nbytes(tensor), group, peer=src, label=label, timed=timed)
        dist.recv(tensor, src=src, group=group)
        if timed:
            stamp([rec.done], tensor.device)

    def isend(self, tensor: torch.Tensor, dst: int, group: Any = None, label: str = "") -> Any:
        """Non-blocking send; returns a work handle to ``wait()`` on."""
        if profiling():
            return self._traced([("send", _nbytes(tensor), group, label, dst)],
                                lambda: self._isend(tensor, dst, group=group, label=label), True)
        return self._isend(tensor, dst, group=group, label=label)

    def _isend(self, tensor: torch.Tensor, dst: int, group: Any = None, label: str = "") -> Any:
        self._contig(tensor)
        if not self.ledger.enabled:
            self.ledger.drop(1)
            return dist.isend(tensor, dst=dst, group=group)
        timed = self.ledger.stamps_completion
        rec = self._issue("send", tensor, _nbytes(tensor), group, peer=dst, label=label, timed=timed)
        work = dist.isend(tensor, dst=dst, group=group)
        return TimedWork(work, [rec.done], tensor.device, p2p=True) if timed else work

    def irecv(self, tensor: torch.Tensor, src: int, group: Any = None, label: str = "") -> Any:
        """Non-blocking receive; returns a work handle to ``wait()`` on."""
        if profiling():
            return self._traced([("recv", _nbytes(tensor), group, label, src)],
                                lambda: self._irecv(tensor, src, group=group, label=label), True)
        return self._irecv(tensor, src, group=group, label=label)

    def _irecv(self, tensor: torch.Tensor, src: int, group: Any = None, label: str = "") -> Any:
        self._contig(tensor)
        if not self.ledger.enabled:
            self.ledger.drop(1)
            return dist.irecv(tensor, src=src, group=group)
        timed = self.ledger.stamps_completion
        rec = self._issue("recv", tensor, _nbytes(tensor), group, peer=src, label=label, timed=timed)
        work = dist.irecv(tensor, src=src, group=group)
        return TimedWork(work, [rec.done], tensor.device, p2p=True) if timed else work

    def batch_isend_irecv(self, ops: Sequence[dist.P2POp], label: str | Sequence[str] = "") -> list[Any]:
        """Post several sends/receives together (one NCCL group); returns their work handles, wait on every one.

        ``label`` is one label for every operation, or one per operation (a pipeline batch
        mixes one micro-batch's activation with another's gradient). gloo returns one work
        per operation; NCCL may return a single work for the whole batch, in which case
        every record completes with it.
        """
        labels = [label] * len(ops) if isinstance(label, str) else list(label)
        if len(labels) != len(ops):
            raise ValueError(f"{len(labels)} labels for {len(ops)} operations: give one label, or one per operation")
        if profiling():
            calls = [("send" if p.op in (dist.isend, getattr(dist, "send", None)) else "recv", _nbytes(p.tensor),
                      p.group, lab, p.peer) for p, lab in zip(ops, labels)]
            return self._traced(calls, lambda: self._batch_isend_irecv(ops, labels), True)
        return self._batch_isend_irecv(ops, labels)

    def _batch_isend_irecv(self, ops: Sequence[dist.P2POp], labels: list[str]) -> list[Any]:
        if not self.ledger.enabled:
            # Nothing to stamp: hand back torch's works (the ring's hot path in benchmarks,
            # where a record and a wrapper per message cost ~3 % of a 16 MiB all-reduce).
            self._contig(*(p.tensor for p in ops))
            self.ledger.drop(len(ops))
            return list(dist.batch_isend_irecv(list(ops)))
        recs = []
        timed = self.ledger.stamps_completion
        for p, lab in zip(ops, labels):
            self._contig(p.tensor)
            kind = "send" if p.op in (dist.isend, getattr(dist, "send", None)) else "recv"
            recs.append(self._issue(kind, p.tensor, _nbytes(p.tensor), p.group, peer=p.peer, label=lab, timed=timed))
        works = dist.batch_isend_irecv(list(ops))
        if not timed:
            return list(works)
        device = ops[0].tensor.device if ops else None
        if len(works) == len(recs):
            return [TimedWork(w, [r.done], device, p2p=True) for w, r in zip(works, recs)]
        return [TimedWork(w, [r.done for r in recs], device, p2p=True) for w in works]
