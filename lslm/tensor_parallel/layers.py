"""Megatron's parallel layers: ColumnParallelLinear, RowParallelLinear, VocabParallelEmbedding.

Shoeybi et al. 2019, Section 3. A linear layer ``Y = X A + b`` (torch stores ``A^T`` as
``weight``, shape ``(out, in)``) can be split two ways over ``t`` ranks:

* **by columns of A** (rows of ``weight``): rank r computes ``Y_r = X A_r + b_r``, a slice of
  the output's last dimension. Every rank needs the whole input, so the input's gradient
  is a sum over ranks (``f``'s all-reduce). :class:`ColumnParallelLinear`.
* **by rows of A** (columns of ``weight``): rank r computes ``X_r A_r``, a partial sum of the
  whole output from its slice of the input; the partials are summed (``g``'s all-reduce)
  and the bias is added once, after the sum. :class:`RowParallelLinear`.

An MLP ``GeLU(X A) B`` runs column-then-row with no communication in between, because
GeLU acts element by element on the column slices; one all-reduce forward and one
backward per MLP.

Parameters carry Megatron's attributes so that code outside the layer (gradient
clipping, checkpoints, the sequence-parallel gradient sync) can tell them apart:
``tensor_model_parallel`` (True: sharded over TP; False: replicated), ``partition_dim``
(0 for column, 1 for row), and ``sequence_parallel`` (True: replicated, but its gradient
is a partial sum over this rank's part of the sequence, so it must be all-reduced over
the TP group; see :mod:`lslm.tensor_parallel.grads`).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from lslm.runtime.context import ParallelContext
from lslm.tensor_parallel.linear_comm import linear_with_tp_communication
from lslm.tensor_parallel.mappings import (
    SEQUENCE_DIM,
    gather_from_tensor_parallel_region,
    reduce_from_tensor_parallel_region,
    reduce_scatter_to_sequence_parallel_region,
    scatter_to_tensor_parallel_region,
)

__all__ = ["ColumnParallelLinear", "RowParallelLinear", "VocabParallelEmbedding", "mark", "shard_rows"]


def mark(param: nn.Parameter, *, sharded: bool, partition_dim: int = -1, sequence_parallel: bool = False) -> None:
    """Set Megatron's attributes on ``param``: ``tensor_model_parallel``, ``partition_dim``, ``sequence_parallel``."""
    param.tensor_model_parallel = sharded
    param.partition_dim = partition_dim
    param.sequence_parallel = sequence_parallel


def shard_rows(full: torch.Tensor, pctx: ParallelContext, rows: torch.Tensor | None = None) -> torch.Tensor:
    """This rank's rows of ``full``: ``rows`` (indices) if given, else block ``tp_rank`` of ``tp_size`` equal blocks.

    A view of ``full`` for a block (a gathered tensor for explicit ``rows``): copy it into the
    parameter that keeps it; no full-size or shard-size copy is made on the way.
    """
    if rows is not None:
        return full.index_select(0, rows.to(full.device))
    if full.shape[0] % pctx.tp_size:
        raise ValueError(f"{full.shape[0]} rows do not split over tp={pctx.tp_size} ranks")
    return full.chunk(pctx.tp_size, dim=0)[pctx.tp_rank]


def _load_padded_rows(local: torch.Tensor, full: torch.Tensor, start: int) -> None:
    # local = full[start : start + len(local)], rows past full's end zero: no padded copy of full is made.
    real = full[start:min(start + local.shape[0], full.shape[0])]
    local[: real.shape[0]].copy_(real)
    local[real.shape[0]:].zero_()


def _check_divides(what: str, size: int, tp: int) -> None:
    if size % tp:
        raise ValueError(f"{what}={size} is not divisible by tp={tp}; choose a tensor-parallel size that divides "
                         f"{size} (divisors: {[d for d in range(1, size + 1) if size % d == 0][:12]})")


class ColumnParallelLinear(nn.Module):
    """``Y = X A + b`` with A split by columns: this rank holds ``out_features / t`` output features.

    * ``gather_output``: all-gather the output slices so every rank returns the full ``Y``
      (off when a row-parallel layer follows: it wants the slices).
    * ``sequence_parallel``: the input arrives split along the sequence (dimension
      ``sequence_dim``: 0 by default, the sequence-first ``(T, B, C)`` layout in which the
      collectives copy nothing; 1 for a batch-first model); it is all-gathered before the
      matmul and the input gradient is reduce-scattered back.
      ``regather_input`` (the default, as Megatron) saves only the sequence slice for
      backward and gathers it again there: ``1/t`` of the activation memory for one more
      all-gather per layer in backward.
    * ``async_grad_allreduce`` (without sequence parallelism): the input-gradient
      all-reduce is started before the weight-gradient matmul and waited on after it,
      so the two overlap (Megatron's ``LinearWithGradAccumulationAndAsyncCommunication``).
    * ``input_comm=False``: no communication of the input at all, forward or backward: the
      input is already whole on every rank and whoever made it whole owns its gradient's
      reduction (a module-level sequence gather, as :mod:`lslm.tensor_parallel.hf_plans`
      puts in front of Hugging Face attention and MLP blocks).
    * ``label``: the ledger label of this layer's communication (``apply_tensor_parallel``
      uses the module's name); ``overlap_log``: a list that receives one record per
      backward with the weight-gradient matmul's start and end times (to measure overlap).
    """

    def __init__(self, in_features: int, out_features: int, pctx: ParallelContext, *, bias: bool = True,
                 gather_output: bool = False, sequence_parallel: bool = False, regather_input: bool = True,
                 async_grad_allreduce: bool = False, label: str = "column", init_seed: int | None = None,
                 device: torch.device | None = None, dtype: torch.dtype | None = None,
                 input_comm: bool = True, sequence_dim: int = SEQUENCE_DIM) -> None:
        super().__init__()
        _check_divides("out_features", out_features, pctx.tp_size)
        if gather_output and sequence_parallel:
            raise ValueError("gather_output=True and sequence_parallel=True do not combine: a sequence-parallel "
                             "column layer feeds a row-parallel one, which takes the output slices")
        if sequence_parallel and not input_comm:
            raise ValueError("sequence_parallel=True gathers the input inside the layer; input_comm=False means the "
                             "input arrives whole: choose one")
        self.input_comm = input_comm
        self.in_features, self.out_features, self.pctx = in_features, out_features, pctx
        self.gather_output, self.sequence_parallel = gather_output, sequence_parallel
        self.regather_input, self.async_grad_allreduce = regather_input, async_grad_allreduce
        self.label, self.sequence_dim = label, sequence_dim
        self.overlap_log: list[dict[str, Any]] | None = None
        self.out_per_rank = out_features // pctx.tp_size
        dev = device if device is not None else pctx.device
        self.weight = nn.Parameter(torch.empty(self.out_per_rank, in_features, device=dev, dtype=dtype))
        self.bias = nn.Parameter(torch.empty(self.out_per_rank, device=dev, dtype=dtype)) if bias else None
        mark(self.weight, sharded=True, partition_dim=0)
        if self.bias is not None:
            mark(self.bias, sharded=True, partition_dim=0)
        if init_seed is not None:
            self.load_full(*_seeded_linear(in_features, out_features, bias, init_seed))

    @classmethod
    def from_linear(cls, linear: nn.Linear, pctx: ParallelContext, *, rows: torch.Tensor | None = None,
                    **kwargs: Any) -> ColumnParallelLinear:
        """A column-parallel copy of ``linear`` holding this rank's output rows (``rows``: explicit indices)."""
        layer = cls(linear.in_features, linear.out_features, pctx, bias=linear.bias is not None,
                    device=linear.weight.device, dtype=linear.weight.dtype, **kwargs)
        layer.load_full(linear.weight.detach(), None if linear.bias is None else linear.bias.detach(), rows=rows)
        return layer

    @torch.no_grad()
    def load_full(self, weight: torch.Tensor, bias: torch.Tensor | None, rows: torch.Tensor | None = None) -> None:
        """Copy this rank's slice of a full ``(out, in)`` weight (and bias) into the layer (the same seed → same
        start as the serial layer).

        A weight with fewer rows than ``out_features`` (a vocabulary padded to a multiple of
        ``t``) fills the rows it has and the padding becomes zeros; only this rank's rows are
        read, no padded copy of the whole weight is made.
        """
        if rows is None and weight.shape[0] < self.out_features:
            _load_padded_rows(self.weight, weight, self.pctx.tp_rank * self.out_per_rank)
            if self.bias is not None and bias is not None:
                _load_padded_rows(self.bias, bias, self.pctx.tp_rank * self.out_per_rank)
            return
        self.weight.copy_(shard_rows(weight, self.pctx, rows))
        if self.bias is not None and bias is not None:
            self.bias.copy_(shard_rows(bias, self.pctx, rows))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``(..., in) -> (..., out/t)`` (or ``(..., out)`` with ``gather_output``)."""
        if not self.input_comm:  # the caller gathered the input and reduces its gradient
            y = F.linear(x, self.weight, self.bias)
        else:
            y = linear_with_tp_communication(x, self.weight, self.bias, self.pctx, label=self.label,
                                             sequence_parallel=self.sequence_parallel, regather=self.regather_input,
                                             async_allreduce=self.async_grad_allreduce, overlap_log=self.overlap_log,
                                             sequence_dim=self.sequence_dim)
        return gather_from_tensor_parallel_region(y, self.pctx, f"{self.label} gather") if self.gather_output else y

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features} ({self.out_per_rank} on this "
                f"rank), tp={self.pctx.tp_size}, sequence_parallel={self.sequence_parallel}")


class RowParallelLinear(nn.Module):
    """``Y = X A + b`` with A split by rows: this rank holds ``in_features / t`` input features.

    * ``input_is_parallel``: the input is already this rank's slice of the last dimension
      (what a column-parallel layer produces); otherwise it is split here.
    * ``sequence_parallel``: the partial outputs are reduce-scattered along the sequence
      (dimension ``sequence_dim``, as in :class:`ColumnParallelLinear`) instead of all-reduced,
      leaving each rank ``1/t`` of the sequence; the bias is then added to a sequence slice,
      so its gradient is partial (marked ``sequence_parallel``).
    The bias is added after the reduction: added before, it would be summed ``t`` times.
    """

    def __init__(self, in_features: int, out_features: int, pctx: ParallelContext, *, bias: bool = True,
                 input_is_parallel: bool = True, sequence_parallel: bool = False, label: str = "row",
                 init_seed: int | None = None, device: torch.device | None = None,
                 dtype: torch.dtype | None = None, sequence_dim: int = SEQUENCE_DIM) -> None:
        super().__init__()
        _check_divides("in_features", in_features, pctx.tp_size)
        if sequence_parallel and not input_is_parallel:
            raise ValueError("sequence_parallel=True needs input_is_parallel=True (Megatron's rule: the input "
                             "comes from a column-parallel layer)")
        self.in_features, self.out_features, self.pctx = in_features, out_features, pctx
        self.input_is_parallel, self.sequence_parallel, self.label = input_is_parallel, sequence_parallel, label
        self.sequence_dim = sequence_dim
        self.in_per_rank = in_features // pctx.tp_size
        dev = device if device is not None else pctx.device
        self.weight = nn.Parameter(torch.empty(out_features, self.in_per_rank, device=dev, dtype=dtype))
        self.bias = nn.Parameter(torch.empty(out_features, device=dev, dtype=dtype)) if bias else None
        mark(self.weight, sharded=True, partition_dim=1)
        if self.bias is not None:
            mark(self.bias, sharded=False, sequence_parallel=sequence_parallel)
        if init_seed is not None:
            self.load_full(*_seeded_linear(in_features, out_features, bias, init_seed))

    @classmethod
    def from_linear(cls, linear: nn.Linear, pctx: ParallelContext, **kwargs: Any) -> RowParallelLinear:
        """A row-parallel copy of ``linear`` holding this rank's input columns (the bias whole, on every rank)."""
        layer = cls(linear.in_features, linear.out_features, pctx, bias=linear.bias is not None,
                    device=linear.weight.device, dtype=linear.weight.dtype, **kwargs)
        layer.load_full(linear.weight.detach(), None if linear.bias is None else linear.bias.detach())
        return layer

    @torch.no_grad()
    def load_full(self, weight: torch.Tensor, bias: torch.Tensor | None) -> None:
        """Copy this rank's columns of a full ``(out, in)`` weight, and the whole bias."""
        self.weight.copy_(shard_rows(weight.t(), self.pctx).t())
        if self.bias is not None and bias is not None:
            self.bias.copy_(bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``(..., in/t) -> (..., out)`` (the sequence split over ranks with ``sequence_parallel``)."""
        if not self.input_is_parallel:
            x = scatter_to_tensor_parallel_region(x, self.pctx, f"{self.label} scatter")
        partial = F.linear(x, self.weight)
        if self.sequence_parallel:
            y = reduce_scatter_to_sequence_parallel_region(partial, self.pctx, self.label, self.sequence_dim)
        else:
            y = reduce_from_tensor_parallel_region(partial, self.pctx, self.label)
        return y + self.bias if self.bias is not None else y

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features} ({self.in_per_rank} on this rank), out_features="
                f"{self.out_features}, tp={self.pctx.tp_size}, sequence_parallel={self.sequence_parallel}")


class VocabParallelEmbedding(nn.Module):
    """An embedding table split by vocabulary rows: rank r holds tokens ``[r V/t, (r+1) V/t)``.

    Each rank looks up the tokens it owns, writes zeros for the others, and the ranks'
    outputs are summed (all-reduce; with ``sequence_parallel`` a reduce-scatter along the
    sequence, dimension ``sequence_dim`` of the output, leaving each rank its slice of the
    sequence: pass sequence-first ids ``(T, B)`` for the copy-free default, 0). ``num_embeddings`` must divide
    by ``t``: pad the vocabulary first (:func:`lslm.tensor_parallel.vocab.pad_vocab_size`);
    the padded rows are never looked up.
    """

    def __init__(self, num_embeddings: int, embedding_dim: int, pctx: ParallelContext, *,
                 sequence_parallel: bool = False, label: str = "embedding", init_seed: int | None = None,
                 device: torch.device | None = None, dtype: torch.dtype | None = None,
                 sequence_dim: int = SEQUENCE_DIM) -> None:
        super().__init__()
        _check_divides("num_embeddings (the padded vocabulary)", num_embeddings, pctx.tp_size)
        self.num_embeddings, self.embedding_dim, self.pctx = num_embeddings, embedding_dim, pctx
        self.sequence_parallel, self.label, self.sequence_dim = sequence_parallel, label, sequence_dim
        per_rank = num_embeddings // pctx.tp_size
        self.vocab_start, self.vocab_end = pctx.tp_rank * per_rank, (pctx.tp_rank + 1) * per_rank
        dev = device if device is not None else pctx.device
        self.weight = nn.Parameter(torch.empty(per_rank, embedding_dim, device=dev, dtype=dtype))
        mark(self.weight, sharded=True, partition_dim=0)
        if init_seed is not None:
            with torch.random.fork_rng(devices=[]):
                torch.manual_seed(init_seed)
                self.load_full(nn.Embedding(num_embeddings, embedding_dim).weight.detach())

    @classmethod
    def from_embedding(cls, embedding: nn.Embedding, pctx: ParallelContext, *, num_embeddings: int | None = None,
                       **kwargs: Any) -> VocabParallelEmbedding:
        """A vocab-parallel copy of ``embedding``, its table padded with zero rows to ``num_embeddings``."""
        padded = num_embeddings if num_embeddings is not None else embedding.num_embeddings
        if padded < embedding.num_embeddings:
            raise ValueError(f"num_embeddings={padded} is smaller than the table's {embedding.num_embeddings} rows")
        layer = cls(padded, embedding.embedding_dim, pctx, device=embedding.weight.device,
                    dtype=embedding.weight.dtype, **kwargs)
        layer.load_full(embedding.weight.detach())
        return layer

    @torch.no_grad()
    def load_full(self, weight: torch.Tensor) -> None:
        """Copy this rank's rows of a full table (rows past its end, the padding, become zeros)."""
        _load_padded_rows(self.weight, weight, self.vocab_start)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        """Token ids -> embeddings (their shape, then ``C``); with ``sequence_parallel`` dimension ``sequence_dim`` is
        split over the ranks: sequence-first ids ``(T, B)`` give ``(T/t, B, C)`` (the default, 0)."""
        foreign = (idx < self.vocab_start) | (idx >= self.vocab_end)
        local = (idx - self.vocab_start).masked_fill(foreign, 0)
        out = F.embedding(local, self.weight).masked_fill(foreign.unsqueeze(-1), 0.0)
        if self.sequence_parallel:
            return reduce_scatter_to_sequence_parallel_region(out, self.pctx, self.label, self.sequence_dim)
        return reduce_from_tensor_parallel_region(out, self.pctx, self.label)

    def extra_repr(self) -> str:
        return (f"{self.num_embeddings}, {self.embedding_dim}, rows [{self.vocab_start}, {self.vocab_end}) on this "
                f"rank, tp={self.pctx.tp_size}, sequence_parallel={self.sequence_parallel}")


def _seeded_linear(in_features: int, out_features: int, bias: bool,
                   seed: int) -> tuple[torch.Tensor, torch.Tensor | None]:
    # The full layer from one seed on every rank, then sliced: parallel and serial start identical.
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        full = nn.Linear(in_features, out_features, bias=bias)
    return full.weight.detach(), None if full.bias is None else full.bias.detach()
