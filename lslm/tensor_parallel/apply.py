"""``apply_tensor_parallel(model, ctx, plan)``: make a plain model tensor-parallel from the outside.

The model is built the ordinary way on every rank from one seed (so every rank holds
the same full weights); this function then swaps the modules a :class:`~lslm.tensor_parallel.plan.TPPlan`
names for their parallel versions, each keeping this rank's slice of the original
weights. The model's ``forward`` is untouched: lslm's GPT reads its local head count from
``c_attn``'s output width, and Hugging Face attention infers it from the tensor shape
(the plans' fixups set the attributes it keeps). After the call:

* the model's logits are this rank's slice of the (padded) vocabulary: train with
  :func:`lslm.tensor_parallel.cross_entropy.vocab_parallel_cross_entropy`, inspect with
  :func:`~lslm.tensor_parallel.cross_entropy.gather_logits`;
* with ``sequence_parallel``, replicated parameters that see only a slice of the sequence
  have partial gradients: call :func:`lslm.tensor_parallel.grads.sync_sequence_parallel_grads`
  after backward (Korthikanti et al. 2022, Section 4.2.2); lslm's GPT then runs
  sequence-first (:attr:`~lslm.models.gpt.GPT.sequence_first`), so the sequence collectives
  copy nothing, and still returns ``(B, T, V/t)`` logits (a transposed view);
* ``model.tensor_parallel`` holds a :class:`TPInfo` (sizes, options) for the loss,
  checkpoints and clipping.

Plans for lslm's GPT come from :func:`gpt_plan`; Hugging Face GPT-2 and Llama plans from
:mod:`lslm.tensor_parallel.hf_plans` (which knows nothing of this module: :data:`PLAN_BUILDERS` lists them).
"""

from __future__ import annotations

import fnmatch
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from lslm.models.deferred_init import is_meta, place_leaf_, serial_leaves
from lslm.models.gpt import GPT
from lslm.runtime.context import ParallelContext
from lslm.tensor_parallel.hf_plans import gpt2_plan, is_hf_gpt2, is_hf_llama, llama_plan
from lslm.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear, VocabParallelEmbedding, mark
from lslm.tensor_parallel.mappings import split_along
from lslm.tensor_parallel.plan import (
    Colwise,
    Rowwise,
    SequenceSharded,
    Style,
    TPOptions,
    TPPlan,
    VocabEmbedding,
    VocabHead,
)
from lslm.tensor_parallel.qkv import qkv_rows
from lslm.tensor_parallel.random import DEFAULT_RNG, TENSOR_PARALLEL_RNG, fork_rng_in_forward, model_parallel_seed
from lslm.tensor_parallel.vocab import pad_vocab_size

__all__ = ["PLAN_BUILDERS", "TPInfo", "apply_tensor_parallel", "gpt_plan", "plan_for"]


@dataclass(frozen=True)
class TPInfo:
    """What ``apply_tensor_parallel`` did: sizes and options, kept on ``model.tensor_parallel``."""

    tp: int
    vocab_size: int
    padded_vocab_size: int
    options: TPOptions

    @property
    def sequence_parallel(self) -> bool:
        """True when the residual stream is split along the sequence."""
        return self.options.sequence_parallel


def _slice_positions(pctx: ParallelContext) -> Callable[..., torch.Tensor]:
    def hook(_module: nn.Module, _args: Any, out: torch.Tensor) -> torch.Tensor:
        # The (T, C) rows of positions 0..T-1 -> this rank's T/t: the residual stream holds only them. The
        # positions' layout is the table's whatever the stream's (GPT broadcasts them over the batch after).
        return split_along(out, pctx, dim=0) if out.dim() == 2 else split_along(out, pctx, dim=1)
    return hook


def _gpt_sequence_parallel(model: nn.Module, pctx: ParallelContext, opts: TPOptions) -> None:
    # Sequence-first (T, B, C) residual stream: every sequence gather and reduce-scatter (the
    # layers' default dim 0) is along the leading dimension, so none copies to lay out its data.
    if opts.sequence_parallel and pctx.tp_size > 1:
        model.sequence_first = True
        model.wpe.register_forward_hook(_slice_positions(pctx))
        mark(model.wpe.weight, sharded=False, sequence_parallel=True)


def gpt_plan(model: nn.Module) -> TPPlan:
    """The plan for :class:`lslm.models.GPT`: Megatron's layout (attention by heads, MLP column then row)."""
    cfg = model.config
    if cfg.kv_heads != cfg.n_head:
        raise ValueError(f"tensor parallelism of lslm's GPT shards c_attn as multi-head attention; this GPT has "
                         f"n_kv_head = {cfg.kv_heads} < n_head = {cfg.n_head} (grouped-query attention): build it "
                         "with n_kv_head = n_head")
    return TPPlan(
        styles={"wte": VocabEmbedding(), "blocks.*.attn.c_attn": Colwise(qkv_heads=cfg.n_head),
                "blocks.*.attn.c_proj": Rowwise(), "blocks.*.mlp.c_fc": Colwise(), "blocks.*.mlp.c_proj": Rowwise(),
                "blocks.*.ln_1": SequenceSharded(), "blocks.*.ln_2": SequenceSharded(), "ln_f": SequenceSharded(),
                "lm_head": VocabHead()},
        vocab_size=cfg.vocab_size,
        fixups=[_gpt_sequence_parallel],
        # Attention dropout acts on this rank's heads; the residual dropout right after the
        # row-parallel c_proj acts on the all-reduced (replicated) output.
        sharded_dropout=("blocks.*.attn",),
        replicated_dropout=("blocks.*.attn.resid_dropout",),
        tied=("lm_head", "wte") if cfg.tie_weights else None,
    )


#: ``(predicate, plan builder)`` pairs tried in order by :func:`plan_for`; append one to teach it another model.
PLAN_BUILDERS: list[tuple[Callable[[nn.Module], bool], Callable[[nn.Module], TPPlan]]] = [
    (lambda m: isinstance(m, GPT), gpt_plan),
    (is_hf_gpt2, gpt2_plan),
    (is_hf_llama, llama_plan),
]


def plan_for(model: nn.Module) -> TPPlan:
    """The plan :data:`PLAN_BUILDERS` gives for ``model``'s type (lslm GPT, Hugging Face GPT-2 and Llama)."""
    for matches, build in PLAN_BUILDERS:
        if matches(model):
            return build(model)
    raise ValueError(f"no tensor-parallel plan for {type(model).__name__}; pass plan=TPPlan(...) "
                     f"(known: lslm GPT, Hugging Face GPT2LMHeadModel and LlamaForCausalLM)")


def _style_of(name: str, styles: dict[str, Style]) -> Style | None:
    hits = [style for pattern, style in styles.items() if fnmatch.fnmatchcase(name, pattern)]
    if len(hits) > 1:
        raise ValueError(f"module {name!r} matches several plan entries: {hits}")
    return hits[0] if hits else None


def _linear_view(module: nn.Module, transposed: bool) -> nn.Linear:
    """An ``nn.Linear`` holding ``module``'s weights (Hugging Face ``Conv1D`` stores them (in, out))."""
    weight = module.weight.detach()
    if transposed:
        weight = weight.t()
    bias = getattr(module, "bias", None)
    view = nn.Linear(weight.shape[1], weight.shape[0], bias=bias is not None, device="meta")
    view.weight = nn.Parameter(weight.contiguous(), requires_grad=False)
    if bias is not None:
        view.bias = nn.Parameter(bias.detach(), requires_grad=False)
    return view


def _head_rows(style: Colwise, out_features: int, pctx: ParallelContext) -> torch.Tensor | None:
    if style.qkv_heads is not None:
        return qkv_rows(out_features // 3, style.qkv_heads, pctx.tp_size, pctx.tp_rank)
    if style.heads is None:
        return None
    t, heads = pctx.tp_size, style.heads
    head_dim = style.head_dim if style.head_dim is not None else out_features // heads
    if heads >= t:
        if heads % t:
            raise ValueError(f"{heads} heads cannot be split over tp={t} ranks; choose tp dividing {heads}")
        mine = range(pctx.tp_rank * heads // t, (pctx.tp_rank + 1) * heads // t)
    else:  # fewer (key/value) heads than ranks: each rank keeps the one head its query heads share
        if t % heads:
            raise ValueError(f"{heads} key/value heads cannot be replicated evenly over tp={t} ranks; "
                             f"tp must divide or be a multiple of {heads}")
        mine = range(pctx.tp_rank * heads // t, pctx.tp_rank * heads // t + 1)
    return torch.cat([torch.arange(h * head_dim, (h + 1) * head_dim)  # lslm: cpu-ok (row indices, moved where used)
                      for h in mine])


def _convert(name: str, module: nn.Module, style: Style, pctx: ParallelContext, opts: TPOptions,
             padded_vocab: int) -> nn.Module | None:
    sp = opts.sequence_parallel
    if isinstance(style, Colwise):
        lin = _linear_view(module, style.transposed)
        rows = _head_rows(style, lin.out_features, pctx)
        replicated = style.heads is not None and style.heads < pctx.tp_size
        layer = ColumnParallelLinear(lin.in_features, lin.out_features if rows is None or not replicated
                                     else len(rows) * pctx.tp_size, pctx, bias=lin.bias is not None,
                                     gather_output=style.gather_output, sequence_parallel=sp,
                                     regather_input=opts.regather_input, async_grad_allreduce=opts.async_grad_allreduce,
                                     label=name, device=lin.weight.device, dtype=lin.weight.dtype)
        layer.load_full(lin.weight, lin.bias, rows=rows)
        if replicated:  # the same head on several ranks: its gradient is summed over them (lslm.tensor_parallel.grads)
            for p in layer.parameters():
                p.replicated_heads = (style.heads, pctx.tp_size)
        return layer
    if isinstance(style, Rowwise):
        lin = _linear_view(module, style.transposed)
        layer = RowParallelLinear(lin.in_features, lin.out_features, pctx, bias=lin.bias is not None,
                                  sequence_parallel=sp, label=name, device=lin.weight.device, dtype=lin.weight.dtype)
        layer.load_full(lin.weight, lin.bias)
        return layer
    if isinstance(style, VocabEmbedding):
        return VocabParallelEmbedding.from_embedding(module, pctx, num_embeddings=padded_vocab, sequence_parallel=sp,
                                                     label=name)
    if isinstance(style, VocabHead):
        lin = _linear_view(module, False)
        layer = ColumnParallelLinear(lin.in_features, padded_vocab, pctx, bias=lin.bias is not None,
                                     sequence_parallel=sp, regather_input=opts.regather_input,
                                     async_grad_allreduce=opts.async_grad_allreduce, label=name,
                                     device=lin.weight.device, dtype=lin.weight.dtype)
        layer.load_full(lin.weight, lin.bias)  # the rows past the vocabulary (padding) become zeros
        return layer
    if isinstance(style, SequenceSharded):
        for p in module.parameters():
            mark(p, sharded=False, sequence_parallel=sp)
        return None
    raise TypeError(f"unknown style {style!r}")


def _set_submodule(model: nn.Module, name: str, new: nn.Module) -> None:
    parent, _, leaf = name.rpartition(".")
    setattr(model.get_submodule(parent) if parent else model, leaf, new)


def _has_dropout(model: nn.Module) -> bool:
    # Dropout modules and attention modules with a dropout rate (lslm GPT, HF attention) both count.
    def rate(m: nn.Module, attr: str) -> float:
        value = getattr(m, attr, 0)
        return float(value) if isinstance(value, (int, float)) else 0.0

    return any((isinstance(m, nn.Dropout) and m.p > 0) or rate(m, "dropout") > 0 or rate(m, "attention_dropout") > 0
               for m in model.modules())


def _convert_streamed(model: nn.Module, ctx: ParallelContext, opts: TPOptions, padded: int,
                      styles: dict[str, Style], init_seed: int, keep: Callable[[str], bool] | None = None) -> None:
    """The meta-device path: replay the serial build leaf by leaf and keep only this rank's part of each.

    A leaf the plan shards becomes its parallel module from the full-size leaf (which is then
    dropped); any other leaf gets its whole values on ``ctx.device``. Only one full-size leaf
    exists at a time, so a rank's memory at start is its shards plus about one layer. Leaves
    ``keep`` rejects (another pipeline stage's) are drawn, never held, and stay on the meta device.
    """
    replacing = (Colwise, Rowwise, VocabEmbedding, VocabHead)
    leaves = {name for name, m in model.named_modules() if next(m.parameters(recurse=False), None) is not None}
    inner = [name for name, style in styles.items() if isinstance(style, replacing) and name not in leaves]
    if inner:
        raise ValueError(f"plan entries {inner} are not modules that own parameters; a model on the meta device "
                         "is converted leaf by leaf: build it on a real device for this plan")
    for name, full in serial_leaves(model, init_seed, keep):
        style = styles.get(name)
        if isinstance(style, replacing):
            new = _convert(name, full, style, ctx, opts, padded)
            assert new is not None
            _set_submodule(model, name, new.to(ctx.device))
        else:
            place_leaf_(model, name, full, ctx.device)
            if style is not None:  # marks only (SequenceSharded)
                _convert(name, model.get_submodule(name), style, ctx, opts, padded)


def apply_tensor_parallel(model: nn.Module, ctx: ParallelContext, plan: TPPlan | None = None, *,
                          sequence_parallel: bool = False, async_grad_allreduce: bool = False,
                          regather_input: bool = True, vocab_multiple: int = 1, rng_seed: int = 0,
                          init_seed: int | None = None, keep: Callable[[str], bool] | None = None) -> nn.Module:
    """Swap ``model``'s modules for tensor-parallel ones over ``ctx``'s TP group, in place; return ``model``.

    ``plan`` defaults to :func:`plan_for` ``(model)``. Sizes that do not divide raise
    ``ValueError`` naming them, before any module is replaced.

    A model built on the meta device (``with torch.device("meta"): GPT(cfg)``) needs
    ``init_seed``, the seed the serial run builds it from: the serial build is replayed one
    layer at a time (:func:`lslm.models.deferred_init.serial_leaves`) and each rank keeps only
    its shards, on ``ctx.device``, bit-for-bit the slices of the serial weights; the full model
    never exists on any rank. The global generator is left where the serial build leaves it.
    ``keep(name)`` (meta only) selects the leaf modules this rank materialises at all (a pipeline
    rank's stages, :mod:`lslm.three_d`): the others stay on the meta device, unconverted.

    Dropout: if the model has
    any, ``ctx.rng`` is set up with :func:`~lslm.tensor_parallel.random.model_parallel_seed`
    ``(ctx, rng_seed, reseed_default=False)`` unless it already exists, and the plan's sharded
    dropout draws from the tensor-parallel stream. Under ``sequence_parallel`` every dropout in
    the model acts on a slice of the sequence and so draws from that stream too.

    The global (default) generator is not touched: replicated dropout keeps drawing from the
    caller's stream, identical on the tp ranks after ``init_distributed`` and the same model
    build. For a default stream of its own per pipeline stage, call ``model_parallel_seed(ctx,
    seed)`` first (it re-seeds the default generator, its documented purpose).
    """
    if getattr(model, "tensor_parallel", None) is not None:
        raise ValueError("this model is already tensor-parallel (apply_tensor_parallel was called on it)")
    if getattr(model, "context_parallel", None) is not None:
        raise ValueError("this model is already context-parallel: call apply_tensor_parallel first, then "
                         "apply_context_parallel (its attention core runs on each tp rank's heads)")
    meta = is_meta(model)
    if meta and init_seed is None:
        raise ValueError("the model is on the meta device (shapes only): pass init_seed=<the seed the serial run "
                         "builds it from> so that each rank materialises its shards of those weights")
    if not meta and init_seed is not None:
        raise ValueError("init_seed is for a model built on the meta device; this model already holds weights")
    if keep is not None and not meta:
        raise ValueError("keep selects which leaves of a meta-device model to materialise; this model holds weights")
    plan = plan if plan is not None else plan_for(model)
    opts = TPOptions(sequence_parallel=sequence_parallel, async_grad_allreduce=async_grad_allreduce,
                     regather_input=regather_input, vocab_multiple=vocab_multiple)
    padded = pad_vocab_size(plan.vocab_size, ctx.tp_size, vocab_multiple)
    for check in plan.checks:
        check(model, ctx)
    targets = [(name, module, style) for name, module in model.named_modules()
               if (style := _style_of(name, plan.styles)) is not None]
    if not targets:
        raise ValueError(f"the plan matched no module of {type(model).__name__}; patterns: {list(plan.styles)}")
    if meta:
        _convert_streamed(model, ctx, opts, padded, {name: style for name, _, style in targets}, init_seed, keep)
    else:
        converted = [(name, _convert(name, module, style, ctx, opts, padded)) for name, module, style in targets]
        for name, new in converted:
            if new is not None:
                _set_submodule(model, name, new)
    if plan.tied is not None:
        head_module, emb_module = (model.get_submodule(name) for name in plan.tied)
        if emb_module.weight.is_meta and not head_module.weight.is_meta:
            emb_module.weight = head_module.weight  # only the head was kept (a last pipeline stage): it holds the rows
        else:
            head_module.weight = emb_module.weight  # the same (V/t, C) rows on both
    for fix in plan.fixups:
        fix(model, ctx, opts)
    if ctx.tp_size > 1 and _has_dropout(model):
        tracker = ctx.rng if ctx.rng is not None else model_parallel_seed(ctx, rng_seed, reseed_default=False)
        names = dict(model.named_modules())
        if sequence_parallel:  # every activation is a slice (of heads or of the sequence): the whole forward
            sharded, replicated = [""], []
        else:
            sharded = [n for n in names if any(fnmatch.fnmatchcase(n, p) for p in plan.sharded_dropout)]
            replicated = [n for n in names if any(fnmatch.fnmatchcase(n, p) for p in plan.replicated_dropout)]
        for n in sharded:
            fork_rng_in_forward(names[n], tracker, TENSOR_PARALLEL_RNG)
        for n in replicated:
            fork_rng_in_forward(names[n], tracker, DEFAULT_RNG)
    model.tensor_parallel = TPInfo(tp=ctx.tp_size, vocab_size=plan.vocab_size, padded_vocab_size=padded,
                                   options=opts)
    return model
