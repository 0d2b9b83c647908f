"""Collectives a piece of code issues through ``torch.distributed``, counted where PyTorch's dispatcher sees them.

lslm's own collectives go through ``ctx.comm`` and its ledger; a peer's (FSDP2's, DeepSpeed's) call
``torch.distributed`` directly and bypass it. Every such call reaches a ``c10d`` operator through the dispatcher
(``c10d.allreduce_``, ``c10d._allgather_base_``, ``c10d._reduce_scatter_base_``, ...), where a
``TorchDispatchMode`` sees it with its tensors; torch's ``CommDebugMode`` counts calls that way.
:func:`count_collectives` also counts bytes, by the ledger's rule: a call's buffer, i.e. the largest of its
tensor arguments (an all-gather's output, a reduce-scatter's input, an all-reduce's tensors). Calls issued
from C++ without the dispatcher in this thread (torch DDP's reducer) are not seen.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

__all__ = ["KINDS", "CollectiveCount", "count_collectives"]

#: c10d operator -> the collective it is (other c10d operators, e.g. ``barrier``, are not counted).
KINDS = {
    "c10d.allreduce_": "all_reduce", "c10d.allreduce_coalesced_": "all_reduce",
    "c10d.allgather_": "all_gather", "c10d._allgather_base_": "all_gather",
    "c10d.allgather_into_tensor_coalesced_": "all_gather",
    "c10d.reduce_scatter_": "reduce_scatter", "c10d._reduce_scatter_base_": "reduce_scatter",
    "c10d.reduce_scatter_tensor_coalesced_": "reduce_scatter",
    "c10d.broadcast_": "broadcast", "c10d.reduce_": "reduce", "c10d.alltoall_": "all_to_all",
    "c10d.alltoall_base_": "all_to_all",
}


@dataclass
class CollectiveCount:
    """Calls and buffer bytes per collective (``"all_reduce"``, ``"all_gather"``, ``"reduce_scatter"``, ...)."""

    calls: Counter = field(default_factory=Counter)
    nbytes: Counter = field(default_factory=Counter)

    def as_dict(self) -> dict[str, list[int]]:
        """``{collective: [calls, bytes]}``, JSON-ready."""
        return {k: [self.calls[k], self.nbytes[k]] for k in sorted(self.calls)}


def _buffer_bytes(args: tuple[Any, ...]) -> int:
    sizes = []
    for arg in args:
        leaves, _ = tree_flatten(arg)
        sizes.append(sum(t.numel() * t.element_size() for t in leaves if isinstance(t, torch.Tensor)))
    return max(sizes, default=0)


class _Watch(TorchDispatchMode):
    def __init__(self, count: CollectiveCount) -> None:
        super().__init__()
        self.count = count

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: Any = None) -> Any:
        kind = KINDS.get(str(func.overloadpacket))
        if kind is not None:
            self.count.calls[kind] += 1
            self.count.nbytes[kind] += _buffer_bytes(tuple(args) + tuple((kwargs or {}).values()))
        return func(*args, **(kwargs or {}))


@contextmanager
def count_collectives() -> Iterator[CollectiveCount]:
    """Count the collectives issued inside the block (calls and buffer bytes per kind; see the module doc)."""
    count = CollectiveCount()
    with _Watch(count):
        yield count
