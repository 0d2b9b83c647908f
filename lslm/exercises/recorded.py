"""Count what the learner's code communicates, in the package's ledger, without asking it to use a Comm.

A learner calls ``torch.distributed`` directly (``dist`` comes from the exercise header), so a checker
cannot hand it a :class:`~lslm.runtime.ledger.Comm`. :func:`collectives_recorded` swaps the module's
collectives and point-to-point calls for wrappers that append one
:class:`~lslm.runtime.records.CommRecord` per call to a
:class:`~lslm.runtime.records.CommLedger`, then call torch's own function. The byte counts follow
the ledger's conventions (:mod:`lslm.runtime.ledger`): ``nbytes`` is the buffer the operation is
defined on (the full gathered output, the full reduce-scatter input), and ``bus_bytes`` what each
rank sends with a bandwidth-optimal algorithm, so a checker can compare a learner's step with the
theory in the same units as the rest of the course.
"""

from __future__ import annotations

import contextlib
import pickle
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.distributed as dist

from lslm.runtime.records import CommLedger, CommRecord

__all__ = ["collectives_recorded"]


def _nb(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def _arg(args: tuple[Any, ...], kwargs: dict[str, Any], i: int, key: str) -> Any:
    return args[i] if len(args) > i else kwargs[key]


def _pickled(obj: Any) -> int:
    try:
        return len(pickle.dumps(obj))
    except Exception:  # noqa: BLE001 - torch will raise its own error on an unpicklable object
        return 0


# torch.distributed name -> (ledger op, bytes of the call given (args, kwargs, group size)).
_Size = Callable[[tuple[Any, ...], dict[str, Any], int], int]
_SPECS: dict[str, tuple[str, _Size]] = {
    "all_reduce": ("all_reduce", lambda a, k, w: _nb(_arg(a, k, 0, "tensor"))),
    "broadcast": ("broadcast", lambda a, k, w: _nb(_arg(a, k, 0, "tensor"))),
    "reduce": ("reduce", lambda a, k, w: _nb(_arg(a, k, 0, "tensor"))),
    "all_gather": ("all_gather", lambda a, k, w: sum(_nb(t) for t in _arg(a, k, 0, "tensor_list"))),
    "all_gather_into_tensor": ("all_gather", lambda a, k, w: _nb(_arg(a, k, 0, "output_tensor"))),
    "all_gather_single": ("all_gather", lambda a, k, w: _nb(_arg(a, k, 0, "output_tensor"))),
    "_all_gather_base": ("all_gather", lambda a, k, w: _nb(_arg(a, k, 0, "output_tensor"))),
    "reduce_scatter_tensor": ("reduce_scatter", lambda a, k, w: _nb(_arg(a, k, 1, "input"))),
    "reduce_scatter_single": ("reduce_scatter", lambda a, k, w: _nb(_arg(a, k, 1, "input"))),
    "_reduce_scatter_base": ("reduce_scatter", lambda a, k, w: _nb(_arg(a, k, 1, "input"))),
    "reduce_scatter": ("reduce_scatter", lambda a, k, w: sum(_nb(t) for t in _arg(a, k, 1, "input_list"))),
    "all_to_all_single": ("all_to_all", lambda a, k, w: _nb(_arg(a, k, 1, "input"))),
    "all_to_all": ("all_to_all", lambda a, k, w: sum(_nb(t) for t in _arg(a, k, 1, "input_tensor_list"))),
    "gather": ("gather", lambda a, k, w: _nb(_arg(a, k, 0, "tensor")) * w),
    "scatter": ("scatter", lambda a, k, w: _nb(_arg(a, k, 0, "tensor")) * w),
    # Object collectives pickle and send through torch's internal calls, which these wrappers do not
    # see: count the pickles here (every rank's, as an all-gather of the longest would).
    "all_gather_object": ("all_gather", lambda a, k, w: _pickled(_arg(a, k, 1, "obj")) * w),
    "broadcast_object_list": ("broadcast", lambda a, k, w: sum(_pickled(o) for o in _arg(a, k, 0, "object_list"))),
    "send": ("send", lambda a, k, w: _nb(_arg(a, k, 0, "tensor"))),
    "isend": ("send", lambda a, k, w: _nb(_arg(a, k, 0, "tensor"))),
    "recv": ("recv", lambda a, k, w: _nb(_arg(a, k, 0, "tensor"))),
    "irecv": ("recv", lambda a, k, w: _nb(_arg(a, k, 0, "tensor"))),
}
_P2P = ("send", "isend", "recv", "irecv")


def _peer(args: tuple[Any, ...], kwargs: dict[str, Any], key: str) -> Any:
    """The peer of a send (``key="dst"``) or receive (``"src"``) call, global rank or group rank."""
    if len(args) > 1:
        return args[1]
    return kwargs.get(key, kwargs.get(f"group_{key}"))


def _group(args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """The call's process group: the keyword, else a positional ProcessGroup, else None (the world)."""
    if kwargs.get("group") is not None:
        return kwargs["group"]
    return next((a for a in args if isinstance(a, dist.ProcessGroup)), None)


def _dtype(args: tuple[Any, ...], kwargs: dict[str, Any]) -> str:
    first = args[0] if args else next(iter(kwargs.values()), None)
    if isinstance(first, (list, tuple)) and first:
        first = first[0]
    return str(first.dtype).removeprefix("torch.") if isinstance(first, torch.Tensor) else ""


@contextlib.contextmanager
def collectives_recorded(ledger: CommLedger) -> Iterator[CommLedger]:
    """Inside the block, every ``torch.distributed`` collective and p2p call appends a record to ``ledger``.

    Records are made when a call is issued (an asynchronous one too) and carry no times. ``dist.P2POp``
    builds torch's own op around the original function (torch checks the function by identity), and
    ``dist.batch_isend_irecv`` records each op it posts. Everything is restored on exit, even after an
    exception, so the checker's own collectives afterwards are neither recorded nor disturbed.
    """
    saved = {name: getattr(dist, name) for name in (*_SPECS, "P2POp", "batch_isend_irecv") if hasattr(dist, name)}

    def wrap(name: str, op: str, size: _Size) -> Callable[..., Any]:
        original = saved[name]

        def recorded(*args: Any, **kwargs: Any) -> Any:
            group = _group(args, kwargs)
            world = 2 if op in ("send", "recv") else dist.get_world_size(group)
            try:
                nbytes = size(args, kwargs, world)
            except (IndexError, KeyError, TypeError, AttributeError):
                nbytes = 0  # a malformed call: torch's own error below says what is wrong with it
            peer = _peer(args, kwargs, "dst" if op == "send" else "src") if op in ("send", "recv") else None
            ledger.record(CommRecord(op=op, nbytes=nbytes, group_size=world, dtype=_dtype(args, kwargs), peer=peer))
            return original(*args, **kwargs)
        recorded.__name__ = name
        return recorded

    wrappers = {name: wrap(name, op, size) for name, (op, size) in _SPECS.items() if name in saved}
    unwrap = {w: saved[name] for name, w in wrappers.items() if name in _P2P}

    def p2p_op(op: Any, *args: Any, **kwargs: Any) -> Any:
        return saved["P2POp"](unwrap.get(op, op), *args, **kwargs)

    def batch(ops: list[Any]) -> Any:
        for p in ops:
            kind = "send" if p.op in (saved["isend"], saved["send"]) else "recv"
            ledger.record(CommRecord(op=kind, nbytes=_nb(p.tensor), group_size=2,
                                     dtype=str(p.tensor.dtype).removeprefix("torch."), peer=p.peer))
        return saved["batch_isend_irecv"](ops)

    try:
        for name, fn in wrappers.items():
            setattr(dist, name, fn)
        dist.P2POp = p2p_op
        dist.batch_isend_irecv = batch
        yield ledger
    finally:
        for name, fn in saved.items():
            setattr(dist, name, fn)
