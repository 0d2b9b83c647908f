"""A small, readable GPT-2-style decoder (pre-LayerNorm), the model every chapter parallelises.

Module and parameter names are part of the course's contract: later chapters
shard ``c_attn``/``c_fc`` by columns and ``c_proj`` by rows (Megatron), split
``blocks`` into pipeline stages, and partition all parameters (ZeRO). Keep them.

Shapes: ``B`` batch, ``T`` sequence length, ``C = n_embd``, ``V = vocab_size``. The hidden
states are batch-first, ``(B, T, C)``, unless :attr:`GPT.sequence_first` is set: then the
blocks run on ``(T, B, C)`` (Megatron's layout, which tensor parallelism's sequence-parallel
mode switches on so that its collectives along the sequence copy nothing); token ids,
targets and logits are batch-first either way.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from functools import partial
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

__all__ = ["GPTConfig", "CausalSelfAttention", "MLP", "Block", "GPT", "split_qkv"]


@dataclass
class GPTConfig:
    """Hyper-parameters of :class:`GPT`; checked on construction.

    ``tie_weights`` shares ``lm_head.weight`` with ``wte.weight`` (GPT-2 does); it is off
    by default because tied weights complicate sharding and partitioning lessons.

    ``n_kv_head`` (``None``: ``n_head``) gives grouped-query attention (Ainslie et al. 2023) when below
    ``n_head``: ``n_kv_head`` key/value heads, each read by ``n_head / n_kv_head`` consecutive query heads
    (Llama's ``repeat_interleave`` convention). ``c_attn`` then projects to ``n_embd + 2 · n_kv_head · head_dim``
    (``[q | k | v]``); with ``n_kv_head == n_head`` the model, its parameters and its ``state_dict`` are
    exactly the multi-head GPT's.
    """

    vocab_size: int
    block_size: int
    n_layer: int
    n_head: int
    n_embd: int
    dropout: float = 0.0
    bias: bool = True
    tie_weights: bool = False
    n_kv_head: int | None = None

    def __post_init__(self) -> None:
        for name in ("vocab_size", "block_size", "n_layer", "n_head", "n_embd"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"GPTConfig.{name} must be a positive int, got {value!r}")
        if self.n_embd % self.n_head != 0:
            raise ValueError(
                f"GPTConfig: n_embd={self.n_embd} must be divisible by n_head={self.n_head} "
                f"(each head gets n_embd // n_head dimensions); e.g. n_head="
                f"{max(d for d in range(1, self.n_head + 1) if self.n_embd % d == 0)}"
            )
        kv = self.kv_heads
        if not isinstance(kv, int) or isinstance(kv, bool) or kv < 1 or self.n_head % kv:
            divisors = [d for d in range(1, self.n_head + 1) if self.n_head % d == 0]
            raise ValueError(
                f"GPTConfig.n_kv_head must be a positive int dividing n_head={self.n_head} (each key/value head "
                f"serves n_head // n_kv_head query heads), got {kv!r}; choose one of {divisors}"
            )
        if not 0.0 <= float(self.dropout) < 1.0:
            raise ValueError(f"GPTConfig.dropout must be in [0, 1), got {self.dropout!r}")

    @property
    def head_dim(self) -> int:
        """Width of one attention head, ``n_embd // n_head``."""
        return self.n_embd // self.n_head

    @property
    def kv_heads(self) -> int:
        """Key/value heads: ``n_kv_head`` (``n_head`` without grouped-query attention)."""
        return self.n_head if self.n_kv_head is None else self.n_kv_head

    @classmethod
    def tiny(cls, **overrides: Any) -> GPTConfig:
        """2 layers, 4 heads, width 64, context 64, vocabulary 1024 (235,264 parameters).

        Trains for a few steps in about a second on a laptop CPU: tests and notebooks.
        Any field can be overridden, e.g. ``GPTConfig.tiny(n_layer=4)``.
        """
        fields: dict[str, Any] = dict(vocab_size=1024, block_size=64, n_layer=2, n_head=4, n_embd=64)
        fields.update(overrides)
        return cls(**fields)

    @classmethod
    def small(cls, **overrides: Any) -> GPTConfig:
        """8 layers, 4 heads, width 128, context 128, vocabulary 1024 (1,864,960 parameters)."""
        fields: dict[str, Any] = dict(vocab_size=1024, block_size=128, n_layer=8, n_head=4, n_embd=128)
        fields.update(overrides)
        return cls(**fields)


class CausalSelfAttention(nn.Module):
    """Multi-head causal self-attention: one fused ``c_attn`` projection to q, k, v, then ``c_proj``.

    The number of heads and the sequence length are read from ``c_attn``'s output at run
    time, so the same code runs on a tensor-parallel rank that holds only some of the heads
    (and, with sequence parallelism, receives only a slice of the sequence). With grouped-query
    attention (``n_kv_head < n_head``) k and v have ``n_head / n_kv_head`` times fewer heads than q.
    """

    #: The layout of ``x``: ``(B, T, C)``, or ``(T, B, C)`` when True (set through :attr:`GPT.sequence_first`).
    sequence_first = False

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.head_dim = config.head_dim
        self.dropout = config.dropout
        #: Query heads per key/value head (1: multi-head attention).
        self.group_size = config.n_head // config.kv_heads
        # Output layout [q | k | v]: n_embd, then n_kv_head·head_dim twice (heads contiguous inside each).
        self.c_attn = nn.Linear(config.n_embd, config.n_embd + 2 * config.kv_heads * config.head_dim, bias=config.bias)
        self.c_proj = nn.Linear(config.n_embd, config.n_embd, bias=config.bias)
        self.resid_dropout = nn.Dropout(config.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``(B, T, C) -> (B, T, C)`` (``(T, B, C)`` sequence-first); position ``t`` attends to positions ``<= t``."""
        q, k, v = split_qkv(self.c_attn(x), self.group_size)
        # Shapes come from the projection's output, not from x: under sequence parallelism
        # x holds a slice of the sequence and c_attn returns the whole of it.
        if self.sequence_first:
            T, B, width = q.shape
        else:
            B, T, width = q.shape
        n_head = width // self.head_dim  # local heads (all of them without TP)
        # (B, T, h*d) or (T, B, h*d) -> (B, h, T, d), views: attention runs per head (h_kv heads for k, v).
        if self.sequence_first:
            q, k, v = (t.view(T, B, -1, self.head_dim).permute(1, 2, 0, 3) for t in (q, k, v))
        else:
            q, k, v = (t.view(B, T, -1, self.head_dim).transpose(1, 2) for t in (q, k, v))
        y = self.core_attention(q, k, v)
        # (B, h, T, d) -> (B, T, h*d) or (T, B, h*d). A view after the fused CPU kernel, which writes its
        # output in the query's memory order; a copy after the math path (dropout), in either layout.
        if self.sequence_first:
            y = y.permute(2, 0, 1, 3).reshape(T, B, n_head * self.head_dim)
        else:
            y = y.transpose(1, 2).reshape(B, T, n_head * self.head_dim)
        return self.resid_dropout(self.c_proj(y))

    def core_attention(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """Causal softmax(q k^T / sqrt(d)) v with attention dropout, ``(B, h, T, d)`` each: no parameters.

        A method of its own so that it can be recomputed alone (selective activation recomputation,
        Korthikanti et al. 2022 §5: :func:`lslm.tensor_parallel.recompute.apply_recompute`).
        """
        return F.scaled_dot_product_attention(q, k, v, dropout_p=self.dropout if self.training else 0.0,
                                              is_causal=True, enable_gqa=k.shape[1] != q.shape[1])


def split_qkv(qkv: torch.Tensor, group_size: int = 1) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``c_attn``'s output ``[q | k | v]`` (last dimension) -> q, k, v (views); ``group_size``: query heads per
    key/value head, so q is ``group_size`` times as wide as k and v (1: three equal thirds)."""
    width = qkv.shape[-1]
    if width % (group_size + 2):
        raise ValueError(f"c_attn's output width {width} does not split as [q | k | v] with q {group_size}x as wide "
                         "as k and v")
    kv = width // (group_size + 2)
    q, k, v = qkv.split([group_size * kv, kv, kv], dim=-1)
    return q, k, v


class MLP(nn.Module):
    """Position-wise feed-forward: ``c_fc`` (C -> 4C), GELU, ``c_proj`` (4C -> C)."""

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.c_fc = nn.Linear(config.n_embd, 4 * config.n_embd, bias=config.bias)
        # The tanh approximation is what GPT-2 (and Hugging Face's "gelu_new") uses.
        self.gelu = nn.GELU(approximate="tanh")
        self.c_proj = nn.Linear(4 * config.n_embd, config.n_embd, bias=config.bias)
        self.dropout = nn.Dropout(config.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``(B, T, C) -> (B, T, C)``."""
        return self.dropout(self.c_proj(self.gelu(self.c_fc(x))))


class Block(nn.Module):
    """One pre-LayerNorm transformer block: ``x + attn(ln_1(x))``, then ``x + mlp(ln_2(x))``."""

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.ln_1 = nn.LayerNorm(config.n_embd, bias=config.bias)
        self.attn = CausalSelfAttention(config)
        self.ln_2 = nn.LayerNorm(config.n_embd, bias=config.bias)
        self.mlp = MLP(config)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``(B, T, C) -> (B, T, C)``."""
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class GPT(nn.Module):
    """Token + position embeddings, ``n_layer`` blocks, final LayerNorm, linear head to logits.

    Initialisation follows GPT-2: weights ~ N(0, 0.02), biases 0, and the projections
    that write into the residual stream (``*.c_proj.weight``) scaled by
    ``1/sqrt(2 * n_layer)`` so the residual's variance does not grow with depth. It
    draws from the global torch RNG: ``torch.manual_seed(s)`` then ``GPT(cfg)`` always
    gives the same weights.
    """

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.config = config
        self.wte = nn.Embedding(config.vocab_size, config.n_embd)
        self.wpe = nn.Embedding(config.block_size, config.n_embd)
        self.drop = nn.Dropout(config.dropout)
        self.blocks = nn.ModuleList(Block(config) for _ in range(config.n_layer))
        self.ln_f = nn.LayerNorm(config.n_embd, bias=config.bias)
        self.lm_head = nn.Linear(config.n_embd, config.vocab_size, bias=False)
        if config.tie_weights:
            self.lm_head.weight = self.wte.weight
        for param, init in self.init_steps():
            init(param)

    def init_steps(self) -> list[tuple[nn.Parameter, Callable[[torch.Tensor], Any]]]:
        """GPT-2's initialisation as ``(parameter, in-place init)`` steps, run in this order after construction.

        Every step overwrites its whole tensor (``normal_``, ``zeros_``), so only a parameter's last
        step decides its value; the earlier ones only advance the generator. That is what lets
        :mod:`lslm.models.deferred_init` replay the same draws for a model built on the meta device
        and keep only the parameters (or shards) a rank holds.
        """
        steps: list[tuple[nn.Parameter, Callable[[torch.Tensor], Any]]] = []
        normal = partial(nn.init.normal_, mean=0.0, std=0.02)
        # Module.apply's order: children before their parent, each child's subtree in registration order.
        for module in _post_order(self):
            if isinstance(module, nn.Linear):
                steps.append((module.weight, normal))
                if module.bias is not None:
                    steps.append((module.bias, nn.init.zeros_))
            elif isinstance(module, nn.Embedding):
                steps.append((module.weight, normal))
            # LayerNorm keeps PyTorch's default: weight 1, bias 0.
        residual = partial(nn.init.normal_, mean=0.0, std=0.02 / math.sqrt(2 * self.config.n_layer))
        steps += [(p, residual) for name, p in self.named_parameters() if name.endswith("c_proj.weight")]
        return steps

    def forward(
        self, idx: torch.Tensor, targets: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Logits ``(B, T, V)`` for token ids ``idx`` ``(B, T)``, and the mean cross-entropy
        against ``targets`` ``(B, T)`` if given (entries equal to -100 are ignored)."""
        if idx.dim() != 2:
            raise ValueError(f"idx must have shape (batch, time), got {tuple(idx.shape)}")
        T = idx.shape[1]
        if T > self.config.block_size:
            raise ValueError(f"sequence length {T} exceeds block_size={self.config.block_size}")
        # Positions are created on the input's device: the model never assumes CUDA.
        pos = torch.arange(T, device=idx.device)
        if self.sequence_first:  # (T, B) ids: the embedding writes (T, B, C); positions broadcast over B
            x = self.drop(self.wte(idx.t().contiguous()) + self.wpe(pos).unsqueeze(1))
        else:
            x = self.drop(self.wte(idx) + self.wpe(pos))
        for block in self.blocks:
            x = block(x)
        logits = self.lm_head(self.ln_f(x))
        if self.sequence_first:
            logits = logits.transpose(0, 1)  # (B, T, V): a view of the (T, B, V) logits
        loss = None
        if targets is not None:
            if targets.shape != idx.shape:
                raise ValueError(f"targets shape {tuple(targets.shape)} must equal idx shape {tuple(idx.shape)}")
            # Checked from shapes, before cross_entropy: a head that gives only a slice of the
            # vocabulary (a vocabulary-sharded, tensor-parallel head) would make target ids index
            # past the logits, which on CUDA is a device-side assert instead of a message. The
            # shape is known without reading the targets, so this costs no device synchronisation.
            if logits.shape[-1] != self.config.vocab_size:
                raise ValueError(
                    f"the head gives {logits.shape[-1]} logits per position but the vocabulary has "
                    f"{self.config.vocab_size} tokens: the logits are a slice of the vocabulary (a tensor-parallel "
                    "head?); call the model without targets and compute the loss on the sharded logits (for "
                    "apply_tensor_parallel: lslm.tensor_parallel.cross_entropy.vocab_parallel_cross_entropy)")
            # float(): under bf16/fp16 autocast the softmax is still taken in fp32.
            loss = F.cross_entropy(logits.float().flatten(0, 1), targets.flatten(), ignore_index=-100)
        return logits, loss

    _sequence_first = False

    @property
    def sequence_first(self) -> bool:
        """The hidden states' layout: ``(B, T, C)`` (False, the default) or ``(T, B, C)`` (True).

        Sequence-first is Megatron's layout. Tensor parallelism turns it on with sequence
        parallelism (``apply_tensor_parallel``): a rank's slice of the sequence is then one
        contiguous block, so the all-gathers and reduce-scatters along it need no copies.
        The embedding transposes the token ids (``B·T`` integers, not ``B·T·C`` activations)
        and the logits come back batch-first ``(B, T, V)`` as a transposed view (not a copy).
        Setting it sets every block's attention too.
        """
        return self._sequence_first

    @sequence_first.setter
    def sequence_first(self, value: bool) -> None:
        self._sequence_first = bool(value)
        for block in self.blocks:
            block.attn.sequence_first = self._sequence_first

    def num_parameters(self, non_embedding: bool = False) -> int:
        """Number of parameters (shared tensors counted once); ``non_embedding`` leaves out ``wpe``
        and ``wte`` (the head too when tied), the convention of scaling-law papers."""
        total = sum(p.numel() for p in self.parameters())
        if non_embedding:
            total -= self.wpe.weight.numel()
            total -= self.wte.weight.numel()
        return total


def _post_order(module: nn.Module) -> Iterator[nn.Module]:
    for child in module.children():
        yield from _post_order(child)
    yield module
