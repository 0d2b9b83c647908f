"""Cutting a GPT into pipeline stages: units, their costs, the best contiguous split, and stage modules.

A GPT is a chain of **units**: ``"embed"`` (``wte`` + ``wpe`` + ``drop``), ``"block.0"`` ..
``"block.{L-1}"``, and ``"head"`` (``ln_f`` + ``lm_head``). A pipeline stage is a contiguous
range ``[start, stop)`` of units. The pipeline runs at the pace of its slowest stage, so
the split should minimise the **largest** stage cost (the "linear partition" problem,
solved exactly here by dynamic programming; Narayanan et al. 2019, PipeDream section 3.1,
solves a richer version with communication costs).

What a unit costs depends on what we want to balance:

* ``"layers"`` - each block 1, embed and head 0: Megatron-LM's default (equal blocks per
  stage). The first and last stages then carry the embedding and the head on top of their
  blocks, which with a large vocabulary is a real imbalance (shown by ``"params"``);
* ``"params"`` - the number of parameters (memory balance);
* ``"time"`` - measured forward + backward seconds of each unit on a small batch (speed
  balance; noisy, so never used by tests that compare exact numbers).

:class:`GPTStage` is a view of some units of a GPT: it *shares* the GPT's modules (the same
``Parameter`` objects), so the model stays one plain ``GPT`` that any chapter can read, and
chaining all stages computes exactly what ``GPT.forward`` computes (same ops, same order).
"""

from __future__ import annotations

import time
from collections.abc import Iterator, Sequence

import torch
from torch import nn

from lslm.models.gpt import GPT

__all__ = ["METHODS", "GPTStage", "partition_units", "split_gpt", "stage_parameters", "unit_costs", "unit_names"]

METHODS = ("layers", "params", "time")


def unit_names(model: GPT) -> list[str]:
    """The units of ``model`` first to last: ``["embed", "block.0", ..., "block.{L-1}", "head"]``."""
    return ["embed", *(f"block.{i}" for i in range(len(model.blocks))), "head"]


def _unit_modules(model: GPT, unit: int) -> list[nn.Module]:
    n_blocks = len(model.blocks)
    if unit == 0:
        return [model.wte, model.wpe, model.drop]
    if unit == n_blocks + 1:
        return [model.ln_f, model.lm_head]
    return [model.blocks[unit - 1]]


def _unit_params(model: GPT, unit: int) -> int:
    # A tied lm_head.weight is wte.weight: count it once, with the embedding.
    seen: set[int] = set()
    if unit == len(model.blocks) + 1 and model.lm_head.weight is model.wte.weight:
        seen.add(id(model.wte.weight))
    total = 0
    for m in _unit_modules(model, unit):
        for p in m.parameters():
            if id(p) not in seen:
                seen.add(id(p))
                total += p.numel()
    return total


def _unit_forward(model: GPT, unit: int, x: torch.Tensor) -> torch.Tensor:
    """Unit ``unit`` of ``model`` applied to ``x`` (token ids for the embed, hidden states otherwise)."""
    n_blocks = len(model.blocks)
    if unit == 0:
        pos = torch.arange(x.shape[1], device=x.device)
        if model.sequence_first:
            return model.drop(model.wte(x.t().contiguous()) + model.wpe(pos).unsqueeze(1))
        return model.drop(model.wte(x) + model.wpe(pos))
    if unit == n_blocks + 1:
        out = model.lm_head(model.ln_f(x))
        return out.transpose(0, 1) if model.sequence_first else out
    return model.blocks[unit - 1](x)


def _measure_times(model: GPT, batch_size: int, seq_len: int, repeats: int) -> list[float]:
    """Median forward + backward seconds of each unit (``torch.autograd.grad``: no ``.grad`` is touched)."""
    from lslm.runtime.startup import synchronize

    device = next(model.parameters()).device
    gen = torch.Generator(device="cpu").manual_seed(0)
    tokens = torch.randint(0, model.config.vocab_size, (batch_size, seq_len), generator=gen,
                           device="cpu").to(device)
    # Each unit's real input: run the model once to get them.
    inputs: list[torch.Tensor] = [tokens]
    with torch.no_grad():
        for u in range(len(model.blocks) + 1):
            inputs.append(_unit_forward(model, u, inputs[-1]))
    times = []
    for u in range(len(model.blocks) + 2):
        params = [p for m in _unit_modules(model, u) for p in m.parameters() if p.requires_grad]
        samples = []
        for rep in range(repeats + 1):  # the first run warms up (allocator, kernels): dropped
            x = inputs[u] if u == 0 else inputs[u].detach().requires_grad_(True)
            synchronize(device)
            t0 = time.perf_counter()
            out = _unit_forward(model, u, x)
            wrt = params + ([x] if u > 0 else [])
            torch.autograd.grad(out, wrt, grad_outputs=torch.ones_like(out))
            synchronize(device)
            if rep > 0:
                samples.append(time.perf_counter() - t0)
        samples.sort()
        times.append(samples[len(samples) // 2])
    return times


def unit_costs(model: GPT, method: str = "layers", *, batch_size: int = 2, seq_len: int | None = None,
               repeats: int = 3) -> list[float]:
    """The cost of each unit of :func:`unit_names` under ``method`` (see the module doc).

    ``"layers"``: 1 per block, 0 for embed and head; ``"params"``: parameter counts (a tied
    head weight counted with the embedding); ``"time"``: median measured forward + backward
    seconds over ``repeats`` runs on ``batch_size`` random sequences of ``seq_len`` tokens
    (default: the model's ``block_size``), without touching any ``.grad``.
    """
    if method not in METHODS:
        raise ValueError(f"unknown partition method {method!r}; choose one of {METHODS}")
    n_units = len(model.blocks) + 2
    if method == "layers":
        return [0.0] + [1.0] * (n_units - 2) + [0.0]
    if method == "params":
        return [float(_unit_params(model, u)) for u in range(n_units)]
    if batch_size < 1 or repeats < 1:
        raise ValueError(f"batch_size and repeats must be >= 1, got {batch_size} and {repeats}")
    seq_len = model.config.block_size if seq_len is None else seq_len
    if not 1 <= seq_len <= model.config.block_size:
        raise ValueError(f"seq_len must be in [1, block_size={model.config.block_size}], got {seq_len}")
    return _measure_times(model, batch_size, seq_len, repeats)


def _check_stages(n_units: int, num_stages: int) -> None:
    if isinstance(num_stages, bool) or not isinstance(num_stages, int) or num_stages < 1:
        raise ValueError(f"num_stages must be a positive int, got {num_stages!r}")
    if num_stages > n_units:
        raise ValueError(f"cannot cut {n_units} units into {num_stages} non-empty stages; use at most {n_units}")


def partition_units(costs: Sequence[float], num_stages: int) -> list[tuple[int, int]]:
    """Contiguous ranges ``[start, stop)`` covering ``costs`` in ``num_stages`` non-empty stages, minimising the
    largest stage cost (the linear-partition problem, solved exactly).

    Among the splits with the optimal largest cost it returns one with the smallest sum of
    squared stage costs (the most even spread below the bottleneck), ties broken
    deterministically. ``O(n^2 k)`` dynamic programming for ``n`` units and ``k`` stages.
    """
    costs = [float(c) for c in costs]
    n = len(costs)
    _check_stages(n, num_stages)
    if any(c < 0 for c in costs):
        raise ValueError(f"unit costs must be >= 0, got {costs}")
    prefix = [0.0]
    for c in costs:
        prefix.append(prefix[-1] + c)

    def seg(i: int, j: int) -> float:
        return prefix[j] - prefix[i]

    inf = float("inf")
    # best[k][j]: smallest possible largest cost when the first j units form k stages.
    best = [[inf] * (n + 1) for _ in range(num_stages + 1)]
    best[0][0] = 0.0
    for k in range(1, num_stages + 1):
        for j in range(k, n + 1):
            best[k][j] = min(max(best[k - 1][i], seg(i, j)) for i in range(k - 1, j))
    bound = best[num_stages][n]
    # Floating-point sums of the same units in another grouping may differ in the last bit.
    tol = 1e-9 * max(1.0, abs(bound))
    # Second pass: the smallest sum of squares among splits whose every stage is <= bound.
    sq = [[inf] * (n + 1) for _ in range(num_stages + 1)]
    arg = [[-1] * (n + 1) for _ in range(num_stages + 1)]
    sq[0][0] = 0.0
    for k in range(1, num_stages + 1):
        for j in range(k, n + 1):
            for i in range(k - 1, j):
                s = seg(i, j)
                if s <= bound + tol and sq[k - 1][i] < inf and sq[k - 1][i] + s * s < sq[k][j] - tol * tol:
                    sq[k][j], arg[k][j] = sq[k - 1][i] + s * s, i
    assert sq[num_stages][n] < inf, "a split within the optimal bound must exist"
    out, j = [], n
    for k in range(num_stages, 0, -1):
        i = arg[k][j]
        out.append((i, j))
        j = i
    return out[::-1]


class GPTStage(nn.Module):
    """Units ``[start, stop)`` of a :class:`~lslm.models.gpt.GPT` as one module, sharing the GPT's modules.

    ``is_first`` (holds the embedding): ``forward`` takes token ids ``(b, T)`` (int64);
    otherwise hidden states ``(b, T, C)``. ``is_last`` (holds the head): ``forward`` returns
    logits ``(b, T, V)``; otherwise hidden states ``(b, T, C)``. The ops are those of
    ``GPT.forward`` in the same order, so chaining every stage is bit-for-bit the GPT,
    its layout included: a stage cut from a GPT with ``sequence_first`` set keeps it, and its
    hidden states are ``(T, b, C)``; under sequence parallelism (a GPT made tensor-parallel with
    ``sequence_parallel``) they are this tensor-parallel rank's ``T / t`` positions,
    ``(T / t, b, C)``. :meth:`hidden_shape` gives the shape the executor's receive buffers need.
    """

    def __init__(self, model: GPT, index: int, num_stages: int, start: int, stop: int) -> None:
        super().__init__()
        n_units = len(model.blocks) + 2
        if not 0 <= start < stop <= n_units:
            raise ValueError(f"stage units [{start}, {stop}) are not a non-empty range of [0, {n_units})")
        self.index, self.num_stages, self.start, self.stop = index, num_stages, start, stop
        self.config = model.config
        self.is_first, self.is_last = start == 0, stop == n_units
        self.sequence_first = model.sequence_first
        tp_info = getattr(model, "tensor_parallel", None)  # lslm.tensor_parallel's TPInfo, read by duck typing
        #: Into how many slices the sequence of a hidden state is cut (the tensor-parallel size under SP, else 1).
        self.sequence_shards = tp_info.tp if tp_info is not None and tp_info.sequence_parallel else 1
        if self.is_first:
            self.wte, self.wpe, self.drop = model.wte, model.wpe, model.drop
        first_block, last_block = max(start, 1) - 1, min(stop, n_units - 1) - 1
        #: Global indices (in ``model.blocks``) of the blocks this stage holds.
        self.block_ids = list(range(first_block, last_block))
        self.blocks = nn.ModuleList(model.blocks[i] for i in self.block_ids)
        if self.is_last:
            self.ln_f, self.lm_head = model.ln_f, model.lm_head
        self.units = unit_names(model)[start:stop]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Token ids ``(b, T)`` on the first stage, hidden ``(b, T, C)`` elsewhere -> hidden, or logits on the last."""
        if self.is_first:
            if x.dim() != 2:
                raise ValueError(f"the first stage takes token ids (batch, time), got shape {tuple(x.shape)}")
            if x.shape[1] > self.config.block_size:
                raise ValueError(f"sequence length {x.shape[1]} exceeds block_size={self.config.block_size}")
            pos = torch.arange(x.shape[1], device=x.device)
            if self.sequence_first:
                x = self.drop(self.wte(x.t().contiguous()) + self.wpe(pos).unsqueeze(1))
            else:
                x = self.drop(self.wte(x) + self.wpe(pos))
        for block in self.blocks:
            x = block(x)
        if self.is_last:
            x = self.lm_head(self.ln_f(x))
            if self.sequence_first:
                x = x.transpose(0, 1)
        return x

    def hidden_shape(self, batch: int, seq: int) -> tuple[int, int, int]:
        """The shape of a hidden state crossing a stage boundary for a micro-batch of ``batch`` x ``seq`` tokens:
        ``(b, T, C)``, or ``(T / s, b, C)`` sequence-first with the sequence over ``s`` = :attr:`sequence_shards`."""
        if seq % self.sequence_shards:
            raise ValueError(f"sequence length {seq} does not split over {self.sequence_shards} sequence-parallel "
                             f"ranks; use a multiple of {self.sequence_shards}")
        if self.sequence_first:
            return (seq // self.sequence_shards, batch, self.config.n_embd)
        return (batch, seq, self.config.n_embd)

    def model_names(self) -> Iterator[tuple[str, nn.Parameter]]:
        """``(name in the GPT, parameter)`` for each parameter of this stage (``"blocks.5.attn.c_attn.weight"``)."""
        for name, p in self.named_parameters():
            if name.startswith("blocks."):
                _, local, rest = name.split(".", 2)
                name = f"blocks.{self.block_ids[int(local)]}.{rest}"
            yield name, p

    def extra_repr(self) -> str:
        return f"stage {self.index}/{self.num_stages}: {', '.join(self.units)}"


def _check_boundaries(boundaries: Sequence[tuple[int, int]], num_stages: int, n_units: int) -> list[tuple[int, int]]:
    try:
        ranges = [(int(a), int(b)) for a, b in boundaries]
    except (TypeError, ValueError):
        raise ValueError(f"boundaries must be a list of (start, stop) unit ranges, got {boundaries!r}") from None
    if len(ranges) != num_stages:
        raise ValueError(f"boundaries has {len(ranges)} ranges for {num_stages} stages")
    expected = 0
    for s, (a, b) in enumerate(ranges):
        if a != expected or b <= a:
            raise ValueError(f"boundaries must be contiguous non-empty ranges starting at 0: stage {s} is "
                             f"[{a}, {b}), expected to start at {expected} and be non-empty")
        expected = b
    if expected != n_units:
        raise ValueError(f"boundaries end at unit {expected}, but the model has {n_units} units "
                         f"(embed, {n_units - 2} blocks, head)")
    return ranges


def split_gpt(model: GPT, num_stages: int, method: str = "layers",
              boundaries: Sequence[tuple[int, int]] | None = None) -> list[GPTStage]:
    """Cut ``model`` into ``num_stages`` :class:`GPTStage` s sharing its modules.

    The split is ``boundaries`` (``[(start, stop), ...]`` over :func:`unit_names`) when
    given, else :func:`partition_units` of :func:`unit_costs` ``(model, method)``. Raises
    ``ValueError`` for more stages than blocks, an unknown method, or boundaries that are
    not contiguous non-empty ranges covering every unit.
    """
    n_blocks = len(model.blocks)
    if isinstance(num_stages, bool) or not isinstance(num_stages, int) or num_stages < 1:
        raise ValueError(f"num_stages must be a positive int, got {num_stages!r}")
    if num_stages > n_blocks:
        raise ValueError(f"{num_stages} pipeline stages but the model has only {n_blocks} blocks; use at most "
                         f"{n_blocks} stages (or a deeper model)")
    if boundaries is None:
        ranges = partition_units(unit_costs(model, method), num_stages)
    else:
        if method not in METHODS:
            raise ValueError(f"unknown partition method {method!r}; choose one of {METHODS}")
        ranges = _check_boundaries(boundaries, num_stages, n_blocks + 2)
    return [GPTStage(model, s, num_stages, a, b) for s, (a, b) in enumerate(ranges)]


def stage_parameters(stages: dict[int, GPTStage]) -> Iterator[tuple[str, nn.Parameter]]:
    """``(name in the GPT, parameter)`` of every stage in ``stages`` (by stage index), each parameter once."""
    seen: set[int] = set()
    for s in sorted(stages):
        for name, p in stages[s].model_names():
            if id(p) not in seen:
                seen.add(id(p))
                yield name, p
