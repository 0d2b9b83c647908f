"""Memory traffic of eager elementwise work: the bytes each aten op reads and writes, counted as it dispatches.

In eager PyTorch every elementwise op, reduction and copy is its own kernel: it reads its input tensors from memory
and writes its outputs back (tensors of training size, megabytes per layer, do not stay in a GPU's cache between
kernels). So the bytes an eager block moves outside its matmuls and attention are, op by op, the sizes of what each op
reads and writes. :class:`ElementwiseTraffic` adds them up under a ``TorchDispatchMode``, forward and backward alike
(autograd's backward ops dispatch the same way), on any device: the aten ops a block runs are the same on a CPU as on
a GPU, so a CPU count is the GPU's traffic.

What it counts and leaves out:

* per op, the bytes of every tensor argument and every tensor result, each tensor's *distinct* elements once (a
  broadcast dimension, stride 0, is read once: an ``expand`` copies from a smaller source);
* views (``view``, ``transpose``, ``expand``, ``view_as_complex``, ...) move nothing and count nothing;
* matrix products and attention (:data:`COMPUTE_OPS`): priced by their flops elsewhere
  (:mod:`lslm.plan.calibrated`), so excluded here.

It is the count :mod:`lslm.plan.calibrated` prices at HBM bandwidth for eager blocks; tests/test_plan_elementwise.py
checks that count against this one on a block written op for op as torchtitan's eager Llama block.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

__all__ = ["COMPUTE_OPS", "FREE_OPS", "ElementwiseTraffic", "distinct_bytes"]

#: aten ops whose cost is flops, not traffic (name prefixes): matrix products and fused attention kernels
COMPUTE_OPS = ("mm", "addmm", "bmm", "baddbmm", "matmul", "linear", "_scaled_dot_product", "_flash_attention",
               "_efficient_attention", "_cudnn_attention")

#: aten ops that return a view or an alias without being flagged ``is_view`` (``reshape`` of a contiguous tensor
#: dispatches ``_unsafe_view``): they move nothing
FREE_OPS = ("_unsafe_view", "_reshape_alias", "detach", "alias", "lift_fresh")


def distinct_bytes(t: torch.Tensor) -> int:
    """Bytes of ``t``'s distinct elements: a broadcast (stride-0) dimension counted once."""
    n = 1
    for size, stride in zip(t.shape, t.stride(), strict=True):
        if stride != 0:
            n *= size
    return n * t.element_size()


class ElementwiseTraffic(TorchDispatchMode):
    """``with ElementwiseTraffic() as t: ...``: ``t.total`` bytes read + written by the ops run inside, matmuls and
    attention aside (module doc); ``t.by_op`` the same by aten op name."""

    def __init__(self) -> None:
        super().__init__()
        self.total = 0
        self.by_op: dict[str, int] = {}

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        out = func(*args, **(kwargs or {}))
        name = func.overloadpacket.__name__
        if func.is_view or name.startswith(COMPUTE_OPS) or name in FREE_OPS:
            return out
        tensors = [a for a in tree_flatten((args, kwargs or {}))[0] if isinstance(a, torch.Tensor)]
        tensors += [a for a in tree_flatten(out)[0] if isinstance(a, torch.Tensor)]
        moved = sum(distinct_bytes(t) for t in tensors)
        self.by_op[name] = self.by_op.get(name, 0) + moved
        self.total += moved
        return out
