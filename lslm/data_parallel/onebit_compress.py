"""1-bit compression and the compressed all-reduce of 1-bit Adam (Tang et al. 2021, §3 and Algorithm 1).

A tensor travels as its signs, packed 8 to a byte (torch has no bit dtype), plus one fp32
scale per chunk. The scale is ``mean |x|`` over the chunk: for fixed signs it is the scale
that minimises the squared error ``||x - s * sign(x)||^2`` (DeepSpeed's implementation uses
``||x||_2 / sqrt(n)``, the paper's §3 only asks for a 1-bit compressor with bounded error;
either fits its analysis). Sign of zero is taken as +1.

The all-reduce (the paper's "compressed all-reduce" with error feedback on both sides):

1. each rank (worker) adds its error ``e_w`` to its tensor, compresses each of the ``n``
   chunks with its own scale, keeps ``e_w = y - C(y)``;
2. all-to-all: rank ``j`` (the "server" of chunk ``j``) receives every worker's chunk ``j``
   (packed bits) and their scales;
3. the server averages the decompressed chunks, adds its error ``e_s``, compresses again
   (one scale), keeps ``e_s = z - C(z)``;
4. all-gather of the servers' packed chunks and scales: every rank decodes the same tensor.

With error feedback the running sums satisfy, exactly up to rounding,
``sum_t out_t = sum_t mean_i x_t^i - mean_i e_w^i - e_s`` (telescoping), which is what keeps
the compressed momentum on track (tests/test_onebit_adam.py checks it).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from lslm.runtime.ledger import Comm

__all__ = ["ALL_TO_ALL_LABEL", "ALL_GATHER_LABEL", "OneBitState", "compressed_all_reduce",
           "compressed_all_reduce_bus_bytes", "padded_numel", "pack_signs", "sign_compress", "unpack_signs"]

ALL_TO_ALL_LABEL = "1-bit all-to-all"
ALL_GATHER_LABEL = "1-bit all-gather"

_BIT_WEIGHTS = (1, 2, 4, 8, 16, 32, 64, 128)


def pack_signs(x: torch.Tensor) -> torch.Tensor:
    """Pack the signs of the flat ``x`` (numel a multiple of 8) into uint8; bit k of byte i: ``x[8i+k] >= 0``."""
    if x.dim() != 1 or x.numel() % 8:
        raise ValueError(f"pack_signs needs a flat tensor whose numel is a multiple of 8, got shape {tuple(x.shape)}")
    bits = (x >= 0).to(torch.uint8).view(-1, 8)
    weights = torch.tensor(_BIT_WEIGHTS, dtype=torch.uint8, device=x.device)
    return (bits * weights).sum(dim=1, dtype=torch.uint8)


def unpack_signs(packed: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """The ±1 tensor (``8 * packed.numel()`` elements) that :func:`pack_signs` packed."""
    weights = torch.tensor(_BIT_WEIGHTS, dtype=torch.uint8, device=packed.device)
    bits = (packed.view(-1, 1) & weights).ne(0)
    return (bits.to(dtype) * 2 - 1).view(-1)


def sign_compress(x: torch.Tensor, chunks: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Compress the flat ``x`` to signs with one scale (mean |x|) per each of ``chunks`` equal chunks.

    Returns ``(packed, scales, decompressed)``: the uint8 bits, the ``chunks`` fp32 scales and
    ``C(x)`` (what the receiver decodes), so the caller can keep the error ``x - C(x)``.
    """
    if x.numel() % (8 * chunks):
        raise ValueError(f"numel {x.numel()} must be a multiple of 8 x chunks = {8 * chunks}")
    scales = x.view(chunks, -1).abs().mean(dim=1)
    packed = pack_signs(x)
    decompressed = (unpack_signs(packed, x.dtype).view(chunks, -1) * scales.view(-1, 1)).view(-1)
    return packed, scales, decompressed


def padded_numel(numel: int, world: int) -> int:
    """``numel`` rounded up so that each of ``world`` chunks holds whole bytes of signs (a multiple of 8)."""
    step = 8 * world
    return -(-numel // step) * step


def compressed_all_reduce_bus_bytes(numel: int, world: int) -> int:
    """Bytes each rank sends in :func:`compressed_all_reduce` (the ledger's ``bus_bytes``).

    With ``P = padded_numel(numel, world)``: the all-to-all of ``P/8`` bytes of signs and of
    ``world`` fp32 scales, and the all-gather of ``P/8`` bytes and ``world`` scales, each
    sending a share ``(world-1)/world``: ``(world-1)/world * (2 P/8 + 2 * 4 world)``.
    An fp32 ring all-reduce of the same tensor sends ``2 (world-1)/world * 4 numel``: ~32x more.
    """
    p = padded_numel(numel, world)
    return (world - 1) * (2 * (p // 8) + 8 * world) // world


@dataclass
class OneBitState:
    """The error-feedback buffers of one tensor: the worker's (whole padded tensor) and the server's (its chunk)."""

    worker_error: torch.Tensor | None = None
    server_error: torch.Tensor | None = None
    error_feedback: bool = True


def compressed_all_reduce(x: torch.Tensor, comm: Comm, state: OneBitState, group: Any = None) -> torch.Tensor:
    """The mean over ``group`` of the flat fp32 ``x``, exchanged as 1-bit signs with error feedback (Algorithm 1).

    Returns a new tensor (same numel as ``x``), identical on every rank. ``state`` carries the
    error buffers between calls (created on first use; left at zero when
    ``state.error_feedback`` is False, for the comparison without it). Four recorded collectives:
    an all-to-all of packed signs and one of scales, an all-gather of each.
    """
    if x.dim() != 1 or x.dtype != torch.float32:
        raise ValueError(f"compressed_all_reduce takes a flat fp32 tensor, got {x.dtype} of shape {tuple(x.shape)}")
    world = torch.distributed.get_world_size(group)
    numel, p = x.numel(), padded_numel(x.numel(), world)
    chunk = p // world
    if state.worker_error is None:
        state.worker_error = torch.zeros(p, dtype=x.dtype, device=x.device)
        state.server_error = torch.zeros(chunk, dtype=x.dtype, device=x.device)
    assert state.worker_error.numel() == p and state.server_error is not None

    y = torch.zeros(p, dtype=x.dtype, device=x.device)
    y[:numel] = x
    y += state.worker_error
    packed, scales, decompressed = sign_compress(y, world)
    if state.error_feedback:
        torch.sub(y, decompressed, out=state.worker_error)

    # Worker -> servers: chunk j of my bits and my scale for it go to rank j.
    recv_bits = torch.empty_like(packed)
    recv_scales = torch.empty_like(scales)
    comm.all_to_all_single(recv_bits, packed, group=group, label=ALL_TO_ALL_LABEL)
    comm.all_to_all_single(recv_scales, scales, group=group, label=ALL_TO_ALL_LABEL)

    # Server: average the workers' decoded chunks (rank order), add its error, compress again.
    received = unpack_signs(recv_bits, x.dtype).view(world, chunk) * recv_scales.view(-1, 1)
    z = received.sum(dim=0) / world + state.server_error
    s_packed, s_scale, s_decompressed = sign_compress(z, 1)
    if state.error_feedback:
        torch.sub(z, s_decompressed, out=state.server_error)

    all_bits = torch.empty_like(packed)
    all_scales = torch.empty(world, dtype=x.dtype, device=x.device)
    comm.all_gather_into_tensor(all_bits, s_packed, group=group, label=ALL_GATHER_LABEL)
    comm.all_gather_into_tensor(all_scales, s_scale, group=group, label=ALL_GATHER_LABEL)
    out = (unpack_signs(all_bits, x.dtype).view(world, chunk) * all_scales.view(-1, 1)).view(-1)
    return out[:numel].clone()
