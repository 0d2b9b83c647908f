"""In which dtype a step's matmuls and attention actually ran: flops and calls counted by dtype as they dispatch.

Autocast decides each op's dtype at dispatch time, so a region that runs outside the forward's autocast (a
recomputation's replay that forgot to re-enter it, a custom backward) silently computes in fp32 at a fraction of the
tensor cores' rate, and nothing in the loss shows it. :class:`ComputeDtypes` records, under a ``TorchDispatchMode``
(below autocast: it sees the ops after autocast's casts, forward and backward alike, on any device), the flops of
every matrix product (``mm``, ``addmm``, ``bmm``, ``baddbmm``: ``2 m n k`` each, batched ``2 b m n k``) by its
inputs' dtype, and the calls of every fused attention kernel (the ops of :data:`ATTENTION_OPS`) by the dtype of its
query. ``lslm.bench.calibrate.gpt_recompute`` records it beside each timed recomputation run, so a measured step
says which precision it timed.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

__all__ = ["ATTENTION_OPS", "MATMUL_OPS", "ComputeDtypes"]

#: aten matrix products whose flops are counted (``addmm``/``baddbmm``: the product's, the add is elementwise)
MATMUL_OPS = ("mm", "addmm", "bmm", "baddbmm")
#: name prefixes of fused attention ops (forward and backward), counted by call
ATTENTION_OPS = ("_scaled_dot_product", "_flash_attention", "_efficient_attention", "_cudnn_attention")


def _matmul_flops(name: str, args: tuple) -> tuple[int, torch.dtype]:
    a, b = (args[1], args[2]) if name in ("addmm", "baddbmm") else (args[0], args[1])
    if name in ("mm", "addmm"):
        return 2 * a.shape[0] * a.shape[1] * b.shape[1], a.dtype
    return 2 * a.shape[0] * a.shape[1] * a.shape[2] * b.shape[2], a.dtype


class ComputeDtypes(TorchDispatchMode):
    """``with ComputeDtypes() as c: ...``: ``c.matmul_flops`` (dtype name -> flops of the matrix products run
    inside) and ``c.attention_calls`` (dtype name -> fused attention calls, forward and backward); module doc."""

    def __init__(self) -> None:
        super().__init__()
        self.matmul_flops: dict[str, int] = {}
        self.attention_calls: dict[str, int] = {}

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        name = func.overloadpacket.__name__
        if name in MATMUL_OPS:
            flops, dtype = _matmul_flops(name, args)
            key = str(dtype).removeprefix("torch.")
            self.matmul_flops[key] = self.matmul_flops.get(key, 0) + flops
        elif name.startswith(ATTENTION_OPS):
            query = next((a for a in args if isinstance(a, torch.Tensor) and a.is_floating_point()), None)
            key = "unknown" if query is None else str(query.dtype).removeprefix("torch.")
            self.attention_calls[key] = self.attention_calls.get(key, 0) + 1
        return func(*args, **(kwargs or {}))

    def fp32_share(self) -> float:
        """Fraction of the counted matmul flops that ran in fp32 (0.0 when none was counted)."""
        total = sum(self.matmul_flops.values())
        return self.matmul_flops.get("float32", 0) / total if total else 0.0
