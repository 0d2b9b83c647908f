"""Tensor-parallel plans: which module of a model becomes which parallel layer (torchtitan's model/plan split).

A plan maps module names (``fnmatch`` patterns such as ``"blocks.*.attn.c_attn"``) to a
*style*; :func:`lslm.tensor_parallel.apply.apply_tensor_parallel` walks the model and
replaces each matched module by its parallel version, slicing the module's own (full,
seeded) weights so the parallel model starts exactly where the serial one does. The
model's code is never edited. Styles:

* :class:`Colwise` - an ``nn.Linear`` (or Hugging Face ``Conv1D``, ``transposed=True``)
  becomes a :class:`~lslm.tensor_parallel.layers.ColumnParallelLinear`; ``qkv_heads`` set
  for a fused ``[q|k|v]`` projection, whose rows are then permuted per head
  (:mod:`lslm.tensor_parallel.qkv`); ``heads`` (with ``head_dim``) for a projection whose
  output is a list of heads that may be fewer than ``t`` (grouped-query KV heads are then
  replicated, each rank holding the head its query heads use).
* :class:`Rowwise` - becomes a :class:`~lslm.tensor_parallel.layers.RowParallelLinear`.
* :class:`VocabEmbedding` - a token embedding becomes a
  :class:`~lslm.tensor_parallel.layers.VocabParallelEmbedding` (vocabulary padded).
* :class:`VocabHead` - the output head becomes a column-parallel layer producing this
  rank's slice of the (padded) vocabulary's logits, for the vocab-parallel loss.
* :class:`SequenceSharded` - a module with replicated parameters that runs on sequence
  slices under sequence parallelism (LayerNorm, RMSNorm): its parameters' gradients are
  partial sums, marked for the all-reduce over the TP group.

A :class:`TPPlan` also carries model-specific ``fixups`` (functions called after the
swap: reseating a tied head, telling a Hugging Face attention module its local head
count, slicing positional embeddings under sequence parallelism) and the dropout
modules whose activations are sharded (``sharded_dropout``: they draw from the
tensor-parallel RNG stream) or replicated inside a sharded region (``replicated_dropout``).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from torch import nn

__all__ = ["Colwise", "Rowwise", "SequenceSharded", "Style", "TPOptions", "TPPlan", "VocabEmbedding", "VocabHead"]


@dataclass(frozen=True)
class Colwise:
    """Split by output features. ``qkv_heads``: heads of a fused [q|k|v] weight; ``heads``/``head_dim``: a
    projection to ``heads`` heads (replicated when fewer than tp); ``transposed``: weight stored (in, out)."""

    qkv_heads: int | None = None
    heads: int | None = None
    head_dim: int | None = None
    transposed: bool = False
    gather_output: bool = False


@dataclass(frozen=True)
class Rowwise:
    """Split by input features; ``transposed``: weight stored (in, out) as in Hugging Face ``Conv1D``."""

    transposed: bool = False


@dataclass(frozen=True)
class VocabEmbedding:
    """A token embedding split by vocabulary rows."""


@dataclass(frozen=True)
class VocabHead:
    """The output head, split by vocabulary rows; its output is this rank's logits slice."""


@dataclass(frozen=True)
class SequenceSharded:
    """Replicated parameters whose module runs on sequence slices under sequence parallelism."""


Style = Colwise | Rowwise | VocabEmbedding | VocabHead | SequenceSharded


@dataclass(frozen=True)
class TPOptions:
    """How to apply a plan: sequence parallelism, overlapped input-gradient all-reduce, vocabulary padding."""

    sequence_parallel: bool = False
    async_grad_allreduce: bool = False
    regather_input: bool = True
    vocab_multiple: int = 1


@dataclass
class TPPlan:
    """Module-name patterns to styles, plus model-specific fixups and dropout placement (see the module doc).

    ``vocab_size`` is the true vocabulary (before padding); ``tied`` names the (head,
    embedding) pair to re-tie after the swap; ``checks`` are called with ``(model, ctx)``
    before any module is replaced, to raise ``ValueError`` for sizes the styles alone
    cannot see (query heads fewer than ``tp``).
    """

    styles: dict[str, Style]
    vocab_size: int
    fixups: list[Callable[[nn.Module, Any, TPOptions], None]] = field(default_factory=list)
    sharded_dropout: tuple[str, ...] = ()
    replicated_dropout: tuple[str, ...] = ()
    tied: tuple[str, str] | None = None
    checks: list[Callable[[nn.Module, Any], None]] = field(default_factory=list)
