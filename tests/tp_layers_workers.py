"""Workers for tests/test_tp_layers.py: every tensor-parallel layer against its single-process torch reference.

One launch per world size runs every case; each rank returns the largest absolute
difference per (case, quantity) and the ledger counts, and the test asserts on them.
Every rank builds the full reference itself from one seed (no tensors shipped around).
Activations are sequence-first ``(T, B, C)``, the layers' default layout under sequence
parallelism; the ``*_batch_first`` cases run the ``(B, T, C)`` layout (``sequence_dim=1``,
as the Hugging Face plans do).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from lslm.runtime import init_distributed
from lslm.runtime.context import ParallelContext
from lslm.tensor_parallel.cross_entropy import gather_logits, vocab_parallel_cross_entropy
from lslm.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear, VocabParallelEmbedding
from lslm.tensor_parallel.mappings import all_gather_along, reduce_from_tensor_parallel_region, reduce_scatter_along
from lslm.tensor_parallel.vocab import pad_vocab_size

B, T, C, OUT = 2, 8, 12, 16  # T, OUT divide by 2 and 4; C=12 too


def _diff(a: torch.Tensor, b: torch.Tensor) -> float:
    assert a.shape == b.shape, (tuple(a.shape), tuple(b.shape))
    return (a.detach() - b.detach()).abs().max().item()


def _input(seed: int, *shape: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=g)


def _shape(seq_dim: int, *rest: int) -> tuple[int, ...]:
    """An activation's shape: sequence-first ``(T, B, ...)`` for ``seq_dim`` 0, batch-first ``(B, T, ...)`` for 1."""
    return (T, B, *rest) if seq_dim == 0 else (B, T, *rest)


def _seq_slice(x: torch.Tensor, pctx: ParallelContext, seq_dim: int = 0) -> torch.Tensor:
    return x.chunk(pctx.tp_size, dim=seq_dim)[pctx.tp_rank]


def _col_slice(x: torch.Tensor, pctx: ParallelContext) -> torch.Tensor:
    return x.chunk(pctx.tp_size, dim=-1)[pctx.tp_rank]


def _column(pctx: ParallelContext, *, gather: bool = False, sp: bool = False, async_ar: bool = False,
            regather: bool = True, seq_dim: int = 0) -> dict[str, float]:
    torch.manual_seed(1)
    ref = nn.Linear(C, OUT)
    x_full = _input(2, *_shape(seq_dim, C)).requires_grad_()
    y_ref = ref(x_full)
    g_out = _input(3, *_shape(seq_dim, OUT))
    y_ref.backward(g_out)
    layer = ColumnParallelLinear.from_linear(ref, pctx, gather_output=gather, sequence_parallel=sp,
                                             async_grad_allreduce=async_ar, regather_input=regather, label="col",
                                             sequence_dim=seq_dim)
    x = (_seq_slice(x_full, pctx, seq_dim) if sp else x_full).detach().clone().requires_grad_()
    y = layer(x)
    y.backward(g_out if gather else _col_slice(g_out, pctx))
    want_x = _seq_slice(x_full.grad, pctx, seq_dim) if sp else x_full.grad
    return {"out": _diff(y, y_ref if gather else _col_slice(y_ref, pctx)),
            "grad_x": _diff(x.grad, want_x),
            "grad_w": _diff(layer.weight.grad, ref.weight.grad.chunk(pctx.tp_size, 0)[pctx.tp_rank]),
            "grad_b": _diff(layer.bias.grad, ref.bias.grad.chunk(pctx.tp_size, 0)[pctx.tp_rank])}


def _row(pctx: ParallelContext, *, parallel_input: bool = True, sp: bool = False,
         seq_dim: int = 0) -> dict[str, float]:
    torch.manual_seed(4)
    ref = nn.Linear(OUT, C)
    x_full = _input(5, *_shape(seq_dim, OUT)).requires_grad_()
    y_ref = ref(x_full)
    g_out = _input(6, *_shape(seq_dim, C))
    y_ref.backward(g_out)
    layer = RowParallelLinear.from_linear(ref, pctx, input_is_parallel=parallel_input, sequence_parallel=sp,
                                          label="row", sequence_dim=seq_dim)
    x = (_col_slice(x_full, pctx) if parallel_input else x_full).detach().clone().requires_grad_()
    y = layer(x)
    y.backward(_seq_slice(g_out, pctx, seq_dim) if sp else g_out)
    grad_b = layer.bias.grad.clone()
    if sp:  # a partial sum over this rank's part of the sequence: the sync sums it
        pctx.comm.all_reduce(grad_b, group=pctx.tp_group, label="test")
    return {"out": _diff(y, _seq_slice(y_ref, pctx, seq_dim) if sp else y_ref),
            "grad_x": _diff(x.grad, _col_slice(x_full.grad, pctx) if parallel_input else x_full.grad),
            "grad_w": _diff(layer.weight.grad, ref.weight.grad.chunk(pctx.tp_size, 1)[pctx.tp_rank]),
            "grad_b": _diff(grad_b, ref.bias.grad)}


def _embedding(pctx: ParallelContext, *, sp: bool = False, seq_dim: int = 0) -> dict[str, float]:
    vocab = 37  # odd: padded
    torch.manual_seed(7)
    ref = nn.Embedding(vocab, C)
    idx = torch.randint(0, vocab, _shape(seq_dim), generator=torch.Generator().manual_seed(8))
    y_ref = ref(idx)
    g_out = _input(9, *_shape(seq_dim, C))
    y_ref.backward(g_out)
    layer = VocabParallelEmbedding.from_embedding(ref, pctx, num_embeddings=pad_vocab_size(vocab, pctx.tp_size),
                                                  sequence_parallel=sp, label="emb", sequence_dim=seq_dim)
    y = layer(idx)
    y.backward(_seq_slice(g_out, pctx, seq_dim) if sp else g_out)
    padded = torch.zeros(layer.num_embeddings, C)
    padded[:vocab] = ref.weight.grad
    return {"out": _diff(y, _seq_slice(y_ref, pctx, seq_dim) if sp else y_ref),
            "grad_w": _diff(layer.weight.grad, padded[layer.vocab_start:layer.vocab_end])}


def _cross_entropy(pctx: ParallelContext) -> dict[str, float]:
    vocab = 37
    padded = pad_vocab_size(vocab, pctx.tp_size)
    logits_full = _input(10, B, T, vocab) * 3
    targets = torch.randint(0, vocab, (B, T), generator=torch.Generator().manual_seed(11))
    targets[0, :3] = -100
    ref_logits = logits_full.clone().requires_grad_()
    ref = F.cross_entropy(ref_logits.flatten(0, 1), targets.flatten(), ignore_index=-100)
    ref.backward()
    pad = torch.zeros(B, T, padded)
    pad[..., :vocab] = logits_full
    pad[..., vocab:] = 100.0  # padding columns with huge logits: masking must ignore them
    local = _col_slice(pad, pctx).clone().requires_grad_()
    loss = vocab_parallel_cross_entropy(local, targets, pctx, vocab_size=vocab)
    loss.backward()
    grad_pad = torch.zeros(B, T, padded)
    grad_pad[..., :vocab] = ref_logits.grad
    return {"loss": abs(loss.item() - ref.item()), "grad": _diff(local.grad, _col_slice(grad_pad, pctx)),
            "gathered": _diff(gather_logits(local, pctx, vocab), logits_full)}


def _mappings(pctx: ParallelContext) -> dict[str, float]:
    """The collectives along any dimension against torch.cat / a sum of every rank's tensor; results contiguous;
    Megatron's g sums in place (the returned tensor is its input's storage)."""
    t, r = pctx.tp_size, pctx.tp_rank
    out: dict[str, float] = {}
    for dim in (0, 1, -1):
        pieces = [_input(50 + k, 2 * t, 3 * t, 4 * t) for k in range(t)]  # every rank's tensor, rebuilt here
        got = all_gather_along(pieces[r], pctx, dim, "test")[0]
        out[f"gather dim {dim}"] = _diff(got, torch.cat(pieces, dim=dim))
        out[f"gather dim {dim} not contiguous"] = float(not got.is_contiguous())
        got = reduce_scatter_along(pieces[r], pctx, dim, "test")[0]
        out[f"reduce-scatter dim {dim}"] = _diff(got, sum(pieces).chunk(t, dim=dim)[r])
        out[f"reduce-scatter dim {dim} not contiguous"] = float(not got.is_contiguous())
    x = _input(60 + r, B, T, C).requires_grad_()
    partial = x * 2.0  # a fresh tensor nothing else reads, as a row-parallel matmul's output
    summed = reduce_from_tensor_parallel_region(partial, pctx, "test")
    out["g sum"] = _diff(summed, sum(_input(60 + k, B, T, C) * 2.0 for k in range(t)))
    out["g copied"] = float(summed.data_ptr() != partial.data_ptr())
    summed.sum().backward()
    out["g grad"] = _diff(x.grad, torch.full_like(x, 2.0))  # identity backward
    return out


CASES: dict[str, Callable[[ParallelContext], dict[str, float]]] = {
    "column": _column,
    "column_gather": lambda p: _column(p, gather=True),
    "column_async": lambda p: _column(p, async_ar=True),
    "column_sp": lambda p: _column(p, sp=True),
    "column_sp_saved": lambda p: _column(p, sp=True, regather=False),
    "column_sp_batch_first": lambda p: _column(p, sp=True, seq_dim=1),
    "row": _row,
    "row_split_input": lambda p: _row(p, parallel_input=False),
    "row_sp": lambda p: _row(p, sp=True),
    "row_sp_batch_first": lambda p: _row(p, sp=True, seq_dim=1),
    "embedding": _embedding,
    "embedding_sp": lambda p: _embedding(p, sp=True),
    "embedding_sp_batch_first": lambda p: _embedding(p, sp=True, seq_dim=1),
    "cross_entropy": _cross_entropy,
    "mappings": _mappings,
}


def _block_copies(pctx: ParallelContext) -> dict[str, int]:
    """Copies (lslm.metrics.allocations) of one GPT block's forward + backward at this tp, with and without SP.

    Per block: GPT models of 1 and 2 blocks, the difference (embedding, head and loss cancel).
    """
    from lslm.metrics.allocations import count_allocations
    from lslm.models.gpt import GPT, GPTConfig
    from lslm.tensor_parallel.apply import apply_tensor_parallel

    out: dict[str, int] = {}
    for sp in (False, True):
        counts = {}
        for layers in (1, 2):
            torch.manual_seed(0)
            model = apply_tensor_parallel(GPT(GPTConfig(vocab_size=64, block_size=T, n_layer=layers, n_head=4,
                                                        n_embd=C * 2)), pctx, sequence_parallel=sp)
            x = torch.randint(0, 64, (B, T), generator=torch.Generator().manual_seed(1))
            for _ in range(2):  # count the second pass: first-call caches out of the way
                with count_allocations() as c:
                    loss = vocab_parallel_cross_entropy(model(x)[0], x, pctx, vocab_size=64)
                    loss.backward()
            counts[layers] = (c.copies, c.copy_bytes, c.total)
        key = "sp" if sp else "tp"
        out[f"{key} copies"] = counts[2][0] - counts[1][0]
        out[f"{key} copy bytes"] = counts[2][1] - counts[1][1]
        out[f"{key} bytes"] = counts[2][2] - counts[1][2]  # everything the block allocates (for the record)
    return out


def _layer_copies(pctx: ParallelContext) -> dict[str, int]:
    """Copies (lslm.metrics.allocations) of each sequence-parallel layer's forward + backward, sequence-first
    (``"<layer> seq0"``) and batch-first (``"<layer> seq1"``); inputs and gradients are made outside the count."""
    from lslm.metrics.allocations import count_allocations

    out: dict[str, int] = {}
    for seq_dim in (0, 1):
        torch.manual_seed(0)
        layers = {
            "column": (ColumnParallelLinear(C, OUT, pctx, sequence_parallel=True, sequence_dim=seq_dim), C, OUT),
            "column saved": (ColumnParallelLinear(C, OUT, pctx, sequence_parallel=True, regather_input=False,
                                                  sequence_dim=seq_dim), C, OUT),
            "row": (RowParallelLinear(OUT, C, pctx, sequence_parallel=True, sequence_dim=seq_dim),
                    OUT // pctx.tp_size, C),
        }
        for name, (layer, width_in, width_out) in layers.items():
            for p in layer.parameters():  # torch.empty until now
                nn.init.normal_(p)
            shape_in = list(_shape(seq_dim, width_in))
            if name != "row":  # column layers take this rank's slice of the sequence, row layers all of it
                shape_in[seq_dim] //= pctx.tp_size
            shape_out = list(_shape(seq_dim, width_out // pctx.tp_size if name != "row" else width_out))
            if name == "row":
                shape_out[seq_dim] //= pctx.tp_size
            x, g = _input(1, *shape_in).requires_grad_(), _input(2, *shape_out)
            with count_allocations() as c:
                layer(x).backward(g)
            out[f"{name} seq{seq_dim}"] = c.copies
        emb = VocabParallelEmbedding(4 * pctx.tp_size, C, pctx, sequence_parallel=True, sequence_dim=seq_dim)
        nn.init.normal_(emb.weight)
        idx = torch.randint(0, 4 * pctx.tp_size, _shape(seq_dim), generator=torch.Generator().manual_seed(3))
        g_shape = list(_shape(seq_dim, C))
        g_shape[seq_dim] //= pctx.tp_size
        g = _input(4, *g_shape)
        with count_allocations() as c:
            emb(idx).backward(g)
        out[f"embedding seq{seq_dim}"] = c.copies
    return out


def suite(**_: Any) -> dict[str, Any]:
    """Run every case at tp = world size; return the differences and each case's ledger (op, label, count)."""
    ctx = init_distributed(tp=int(__import__("os").environ["WORLD_SIZE"]))
    out: dict[str, Any] = {"diffs": {}, "ledger": {}}
    with ctx:
        for name, case in CASES.items():
            ctx.comm.ledger.reset()
            out["diffs"][name] = case(ctx)
            counts: dict[str, int] = {}
            for r in ctx.comm.ledger.records:
                if r.label != "test":
                    key = f"{r.op}|{r.label}"
                    counts[key] = counts.get(key, 0) + 1
            out["ledger"][name] = counts
        out["copies"] = _block_copies(ctx)
        out["layer copies"] = _layer_copies(ctx)
    return out
