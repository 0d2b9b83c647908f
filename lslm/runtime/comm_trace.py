"""The ledger's calls as named profiler ranges, so a ``torch.profiler`` trace shows them by name.

While a profiler runs (``torch.profiler.profile``, see :mod:`lslm.metrics.trace`), every call a
:class:`~lslm.runtime.ledger.Comm` makes is wrapped in a ``record_function`` range whose name
carries what the ledger records::

    lslm.comm:all_reduce axis=dp bytes=4096 n=2 label=ddp-grad #12
    lslm.wait:all_reduce axis=dp bytes=4096 n=2 label=ddp-grad #12

``lslm.comm:`` covers the *call* (for a blocking collective: the whole operation, as the calling
thread sees it; for an asynchronous one: only the issue). An asynchronous call's work is handed
back wrapped in a :class:`TracedWork`, whose ``wait()`` runs inside an ``lslm.wait:`` range with the
same name and sequence number ``#k``: we record *both* ranges rather than one range from issue to
wait, because a profiler range must nest on its thread (Perfetto flags overlapping slices) and
the caller computes between the two. The pair gives the collective's span, issue to wait
(:mod:`lslm.metrics.overlap` joins them by ``#k``). ``axis`` is the ledger's group name (``-`` for an
unnamed group), ``bytes`` the ledger's ``nbytes``, ``n`` the group size, ``peer`` the global peer
rank of a send/recv; ``label`` is last because it is free text (it may hold spaces).

Nothing changes when no profiler runs: one check of torch's profiler flag per call.
"""

from __future__ import annotations

import re
from collections.abc import Iterator, Sequence
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass
from typing import Any

import torch
from torch.autograd.profiler import record_function

from lslm.runtime.completion import WorkWrapper

__all__ = ["CALL_PREFIX", "WAIT_PREFIX", "CommRange", "TracedWork", "comm_ranges", "parse_range", "profiling",
           "range_name"]

CALL_PREFIX = "lslm.comm:"
WAIT_PREFIX = "lslm.wait:"

_NAME = re.compile(r"^(?P<prefix>lslm\.(?:comm|wait):)(?P<op>\w+) axis=(?P<axis>\S*) bytes=(?P<nbytes>\d+) "
                   r"n=(?P<n>\d+)(?: peer=(?P<peer>-?\d+))? label=(?P<label>.*) #(?P<seq>\d+)$")


def profiling() -> bool:
    """True while a torch profiler records on this thread (a C flag: ~0.1 us a call)."""
    return bool(torch._C._autograd._profiler_enabled())


@dataclass(frozen=True)
class CommRange:
    """One ledger call as its range name says it: op, axis, bytes, group size, peer, label, sequence number."""

    op: str
    axis: str
    nbytes: int
    group_size: int
    label: str
    seq: int
    peer: int | None = None
    wait: bool = False  # an ``lslm.wait:`` range (else the call itself)


def range_name(op: str, axis: str, nbytes: int, group_size: int, label: str, seq: int, peer: int | None = None,
               wait: bool = False) -> str:
    """The range name of a ledger call (see the module doc); :func:`parse_range` reads it back."""
    peer_part = f" peer={peer}" if peer is not None else ""
    label = label.replace("\n", " ")
    return (f"{WAIT_PREFIX if wait else CALL_PREFIX}{op} axis={axis or '-'} bytes={int(nbytes)} n={int(group_size)}"
            f"{peer_part} label={label} #{seq}")


def parse_range(name: str) -> CommRange | None:
    """The :class:`CommRange` a range name stands for, or None for any other name."""
    m = _NAME.match(name)
    if m is None:
        return None
    axis = m["axis"]
    return CommRange(op=m["op"], axis="" if axis == "-" else axis, nbytes=int(m["nbytes"]), group_size=int(m["n"]),
                     label=m["label"], seq=int(m["seq"]), peer=int(m["peer"]) if m["peer"] is not None else None,
                     wait=m["prefix"] == WAIT_PREFIX)


@contextmanager
def comm_ranges(names: Sequence[str]) -> Iterator[None]:
    """Enter one ``record_function`` range per name (nested, same extent: a batch of p2p calls)."""
    with ExitStack() as stack:
        for name in names:
            stack.enter_context(record_function(name))
        yield


class TracedWork(WorkWrapper):
    """A work handle whose ``wait()`` runs inside the ``lslm.wait:`` ranges of its calls.

    Everything else (``is_completed``, ``get_future``, any attribute) is forwarded to the wrapped
    work, which may itself be a :class:`~lslm.runtime.completion.TimedWork`.
    """

    def __init__(self, work: Any, wait_names: Sequence[str]) -> None:
        super().__init__(work)
        self._names = list(wait_names)

    def wait(self, *args: Any, **kwargs: Any) -> Any:
        """Wait for the operation (as ``Work.wait``) inside the wait ranges (while a profiler still runs)."""
        if not profiling():
            return self._work.wait(*args, **kwargs)
        with comm_ranges(self._names):
            return self._work.wait(*args, **kwargs)
