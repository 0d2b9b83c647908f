"""All-to-all from send/recv: the pairwise-exchange schedule."""

from __future__ import annotations

from typing import Any

import torch

from lslm.collectives.barrier import agree
from lslm.collectives.p2p import as_flat, exchange, group_view, resolve, write_back
from lslm.runtime.ledger import Comm


def all_to_all_pairwise(output: torch.Tensor, input: torch.Tensor, comm: Comm | None = None, group: Any = None, *,
                        check: bool = True) -> torch.Tensor:
    """Equal-split all-to-all: block j of ``input`` goes to rank j, stored there as block ``rank``; returns ``output``.

    ``input`` and ``output`` both hold n blocks of M = numel / n elements (numel must
    divide by n); ``output`` is written in place, ``input`` only read, and they must not
    share memory. Rank r copies its own block, then in step s = 1..n-1 sends block
    r+s to rank r+s while receiving block r-s from rank r-s. Each step is a
    permutation - the rank r sends to, r+s, receives from r in that same step - and
    the receive and send are posted together, so no rank ever waits on a rank that
    waits on it. Cost: (n-1)(alpha + M beta). Bytes: every rank sends and receives
    (n-1)·M.
    """
    comm, gv = resolve(comm), group_view(group)
    n, r = gv.size, gv.rank
    if input.numel() % n:
        raise ValueError(f"all_to_all_pairwise: input has {input.numel()} elements, not divisible by the group "
                         f"size {n} (equal splits only)")
    if output.numel() != input.numel() or output.dtype != input.dtype or output.device != input.device:
        raise ValueError(f"all_to_all_pairwise: output ({output.numel()} {output.dtype} on {output.device}) must "
                         f"match input ({input.numel()} {input.dtype} on {input.device})")
    if output.numel() and output.untyped_storage().data_ptr() == input.untyped_storage().data_ptr():
        raise ValueError("all_to_all_pairwise: output and input must not share memory (blocks are overwritten "
                         "while other blocks of the input are still to be sent)")
    m = input.numel() // n
    if check:
        agree(comm, gv, "all_to_all_pairwise", input.numel(), input.dtype, device=input.device)
    src, out = as_flat(input), as_flat(output)
    out[r * m:(r + 1) * m].copy_(src[r * m:(r + 1) * m])
    for s in range(1, n):
        to, frm = (r + s) % n, (r - s) % n
        exchange(comm, gv, src[to * m:(to + 1) * m], to, out[frm * m:(frm + 1) * m], frm, "all_to_all_pairwise")
    write_back(output, out)
    return output
