"""Tensor-parallel plans for Hugging Face ``GPT2LMHeadModel`` and ``LlamaForCausalLM``, applied from outside.

:data:`lslm.tensor_parallel.apply.PLAN_BUILDERS` lists both, so ``apply_tensor_parallel(model, ctx)`` works on
the models :mod:`lslm.models.hf` builds.
The layout is Megatron's (Shoeybi et al. 2019, Section 3): attention split by heads,
the MLP column-then-row, the vocabulary split over ranks in the embedding and the head.

* **GPT-2** stores its linear layers as ``Conv1D`` with the weight ``(in, out)``
  (``transposed=True``); ``c_attn`` is a fused ``[q|k|v]`` projection, so each rank keeps
  the q, k and v rows of its own heads. ``GPT2Attention.forward`` splits ``c_attn``'s
  output with ``split(self.split_size)``: the fixup sets ``split_size`` (and
  ``num_heads``) to this rank's width. The head counts of the views it makes are
  inferred (``-1``), so nothing else changes.
* **Llama** has separate ``q/k/v_proj``. With grouped-query attention and fewer key/value
  heads than ranks, each rank keeps the one KV head its query heads use (replicated
  over ``t / n_kv`` ranks; their gradients are summed by
  :func:`lslm.tensor_parallel.grads.sync_tensor_parallel_grads`). The fixup sets
  ``num_key_value_groups`` to local query heads / local KV heads, which is what the
  eager and SDPA attention functions read to repeat the KV heads.

**Sequence parallelism** (Korthikanti et al. 2022, Section 4.2.2) cannot gather the
input inside the column layers for Hugging Face code: the attention module reads
``hidden_states.shape`` (its sequence length) and reshapes its output with it, so it must
see the whole sequence. The gather moves one level up, with the same communication:

* a forward pre-hook on every attention and MLP module all-gathers the sequence
  (:func:`~lslm.tensor_parallel.mappings.gather_from_sequence_parallel_region`: the
  backward reduce-scatters); the column layers inside do no input communication
  (``input_comm=False``); the row layers reduce-scatter their output back to slices;
* the model computes the causal mask, the positions (GPT-2's ``wpe``, Llama's rotary
  ``cos``/``sin``) from the length of the embedding's output, so the embedding stays
  whole (all-reduce) and the residual stream is split right after (a pre-hook on
  GPT-2's embedding dropout, on Llama's first layer): masks and positions cover the
  full sequence, which is what attention sees after its gather;
* the final norm's output is all-gathered (GPT-2 reshapes it to the input's length) and
  the head, also without input communication, returns this rank's vocabulary logits.

Hugging Face models stay **batch-first** ``(B, T, C)`` (their code reads and reshapes that
layout): every sequence collective here, the row layers' reduce-scatters included, is along
``dim=1`` (:data:`BATCH_FIRST_SEQUENCE_DIM`), one rearrangement copy each, where lslm's
GPT runs sequence-first under sequence parallelism and copies nothing
(:mod:`lslm.tensor_parallel.mappings`).
"""

from __future__ import annotations

import fnmatch
import sys
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from lslm.runtime.context import ParallelContext
from lslm.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear
from lslm.tensor_parallel.mappings import (
    copy_to_tensor_parallel_region,
    gather_from_sequence_parallel_region,
    scatter_to_sequence_parallel_region,
)
from lslm.tensor_parallel.plan import Colwise, Rowwise, SequenceSharded, TPOptions, TPPlan, VocabEmbedding, VocabHead

__all__ = ["BATCH_FIRST_SEQUENCE_DIM", "gpt2_plan", "is_hf_gpt2", "is_hf_llama", "llama_plan"]

#: Where the sequence is in Hugging Face hidden states, ``(B, T, C)``.
BATCH_FIRST_SEQUENCE_DIM = 1


def _is_transformers(model: nn.Module, name: str) -> bool:
    # Without importing transformers (slow): a model of its classes means it is imported already.
    module = sys.modules.get("transformers")
    return module is not None and isinstance(model, getattr(module, name))


def is_hf_gpt2(model: nn.Module) -> bool:
    """True for a Hugging Face ``GPT2LMHeadModel``."""
    return _is_transformers(model, "GPT2LMHeadModel")


def is_hf_llama(model: nn.Module) -> bool:
    """True for a Hugging Face ``LlamaForCausalLM``."""
    return _is_transformers(model, "LlamaForCausalLM")


def _divides(tp: int, **sizes: int) -> None:
    for what, size in sizes.items():
        if size % tp:
            raise ValueError(f"{what}={size} is not divisible by tp={tp}; choose a tensor-parallel size dividing "
                             f"{size}")


# -- sequence parallelism with module-level gathers ---------------------------------------------------------
def _first_input(fn: Callable[[torch.Tensor], torch.Tensor]) -> Callable[..., Any]:
    """A forward pre-hook (``with_kwargs``) applying ``fn`` to the hidden states, positional or keyword."""
    def hook(_module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[Any, dict[str, Any]]:
        if args:
            return (fn(args[0]), *args[1:]), kwargs
        return args, {**kwargs, "hidden_states": fn(kwargs["hidden_states"])}
    return hook


def _matching(model: nn.Module, patterns: tuple[str, ...]) -> list[tuple[str, nn.Module]]:
    return [(n, m) for n, m in model.named_modules() if any(fnmatch.fnmatchcase(n, p) for p in patterns)]


def _no_input_comm(module: nn.Module) -> None:
    for layer in module.modules():
        if isinstance(layer, ColumnParallelLinear):
            layer.sequence_parallel, layer.input_comm = False, False


def _sequence_parallel_fixup(embedding: str, entry: str, gathered: tuple[str, ...], final_norm: str,
                             head: str) -> Callable[[nn.Module, ParallelContext, TPOptions], None]:
    """The fixup that moves the sequence gather from the column layers to whole modules (module doc)."""
    def fix(model: nn.Module, ctx: ParallelContext, opts: TPOptions) -> None:
        if not opts.sequence_parallel:
            return
        model.get_submodule(embedding).sequence_parallel = False  # whole output: masks and positions need T
        dim = BATCH_FIRST_SEQUENCE_DIM
        for layer in model.modules():  # the row layers' reduce-scatters
            if isinstance(layer, RowParallelLinear):
                layer.sequence_dim = dim
        model.get_submodule(entry).register_forward_pre_hook(
            _first_input(lambda x: scatter_to_sequence_parallel_region(x, ctx, f"{entry} sp-scatter", dim)),
            with_kwargs=True)
        for name, module in _matching(model, gathered):
            module.register_forward_pre_hook(
                _first_input(lambda x, label=f"{name} sp-gather": gather_from_sequence_parallel_region(x, ctx, label,
                                                                                                     dim)),
                with_kwargs=True)
            _no_input_comm(module)
        model.get_submodule(final_norm).register_forward_hook(
            lambda _m, _a, out: gather_from_sequence_parallel_region(out, ctx, f"{final_norm} sp-gather", dim))
        _no_input_comm(model.get_submodule(head))
    return fix


def _module_level_f(modules: tuple[str, ...]) -> Callable[[nn.Module, ParallelContext, TPOptions], None]:
    """Without sequence parallelism: one ``f`` per attention / MLP module instead of one per column layer.

    Llama's q, k and v (and gate and up) are separate column-parallel layers reading the same
    input; each would all-reduce its own input gradient in backward (5 all-reduces per layer).
    Applying ``f`` once at the module's input sums the three (two) gradients locally first,
    then all-reduces once: 2 per layer, as with a fused projection (Megatron fuses them).
    """
    def fix(model: nn.Module, ctx: ParallelContext, opts: TPOptions) -> None:
        if opts.sequence_parallel or ctx.tp_size == 1:
            return
        for name, module in _matching(model, modules):
            module.register_forward_pre_hook(
                _first_input(lambda x, label=name: copy_to_tensor_parallel_region(x, ctx, label)), with_kwargs=True)
            _no_input_comm(module)
    return fix


# -- GPT-2 ----------------------------------------------------------------------------------------------------
def _gpt2_check(model: nn.Module, ctx: ParallelContext) -> None:
    cfg = model.config
    if getattr(cfg, "add_cross_attention", False):
        raise ValueError("GPT-2 with cross-attention (add_cross_attention=True) has no tensor-parallel plan here")
    inner = cfg.n_inner if cfg.n_inner is not None else 4 * cfg.n_embd
    _divides(ctx.tp_size, n_head=cfg.n_head, n_inner=inner)


def _gpt2_local_heads(model: nn.Module, ctx: ParallelContext, _opts: TPOptions) -> None:
    for block in model.transformer.h:
        attn = block.attn
        # forward splits c_attn's output into q, k, v with split(self.split_size): this rank's width.
        attn.num_heads = model.config.n_head // ctx.tp_size
        attn.split_size = attn.num_heads * attn.head_dim


def gpt2_plan(model: nn.Module) -> TPPlan:
    """The plan for Hugging Face ``GPT2LMHeadModel`` (``Conv1D`` weights, fused qkv; tied head supported)."""
    n_head = model.config.n_head
    tied = model.lm_head.weight is model.transformer.wte.weight
    return TPPlan(
        styles={"transformer.wte": VocabEmbedding(),
                "transformer.h.*.attn.c_attn": Colwise(qkv_heads=n_head, transposed=True),
                "transformer.h.*.attn.c_proj": Rowwise(transposed=True),
                "transformer.h.*.mlp.c_fc": Colwise(transposed=True),
                "transformer.h.*.mlp.c_proj": Rowwise(transposed=True),
                "transformer.h.*.ln_1": SequenceSharded(), "transformer.h.*.ln_2": SequenceSharded(),
                "transformer.ln_f": SequenceSharded(), "lm_head": VocabHead()},
        vocab_size=model.config.vocab_size,
        fixups=[_gpt2_local_heads,
                _sequence_parallel_fixup("transformer.wte", "transformer.drop",
                                         ("transformer.h.*.attn", "transformer.h.*.mlp"), "transformer.ln_f",
                                         "lm_head")],
        sharded_dropout=("transformer.h.*.attn",),
        replicated_dropout=("transformer.h.*.attn.resid_dropout",),
        tied=("lm_head", "transformer.wte") if tied else None,
        checks=[_gpt2_check],
    )


# -- Llama ----------------------------------------------------------------------------------------------------
def _llama_check(model: nn.Module, ctx: ParallelContext) -> None:
    cfg, t = model.config, ctx.tp_size
    q, kv = cfg.num_attention_heads, cfg.num_key_value_heads
    if q % t:
        raise ValueError(f"num_attention_heads={q} query heads cannot be split over tp={t} ranks (each rank needs "
                         f"whole heads); choose tp dividing {q}")
    if kv % t and t % kv:
        raise ValueError(f"num_key_value_heads={kv} key/value heads neither split over tp={t} ranks nor replicate "
                         f"evenly on them; choose tp dividing {kv} or a multiple of {kv} dividing {q}")
    _divides(t, intermediate_size=cfg.intermediate_size)


def _llama_local_heads(model: nn.Module, ctx: ParallelContext, _opts: TPOptions) -> None:
    cfg, t = model.config, ctx.tp_size
    local_q, local_kv = cfg.num_attention_heads // t, max(cfg.num_key_value_heads // t, 1)
    for layer in model.model.layers:
        # eager and SDPA attention repeat each KV head num_key_value_groups times to meet the query heads.
        layer.self_attn.num_key_value_groups = local_q // local_kv


def llama_plan(model: nn.Module) -> TPPlan:
    """The plan for Hugging Face ``LlamaForCausalLM`` (grouped-query KV heads replicated when fewer than tp)."""
    cfg = model.config
    head_dim = model.model.layers[0].self_attn.head_dim
    return TPPlan(
        styles={"model.embed_tokens": VocabEmbedding(),
                "model.layers.*.self_attn.q_proj": Colwise(heads=cfg.num_attention_heads, head_dim=head_dim),
                "model.layers.*.self_attn.k_proj": Colwise(heads=cfg.num_key_value_heads, head_dim=head_dim),
                "model.layers.*.self_attn.v_proj": Colwise(heads=cfg.num_key_value_heads, head_dim=head_dim),
                "model.layers.*.self_attn.o_proj": Rowwise(),
                "model.layers.*.mlp.gate_proj": Colwise(), "model.layers.*.mlp.up_proj": Colwise(),
                "model.layers.*.mlp.down_proj": Rowwise(),
                "model.layers.*.input_layernorm": SequenceSharded(),
                "model.layers.*.post_attention_layernorm": SequenceSharded(),
                "model.norm": SequenceSharded(), "lm_head": VocabHead()},
        vocab_size=cfg.vocab_size,
        fixups=[_llama_local_heads, _module_level_f(("model.layers.*.self_attn", "model.layers.*.mlp")),
                _sequence_parallel_fixup("model.embed_tokens", "model.layers.0",
                                         ("model.layers.*.self_attn", "model.layers.*.mlp"), "model.norm", "lm_head")],
        sharded_dropout=("model.layers.*.self_attn",),
        tied=("lm_head", "model.embed_tokens") if model.lm_head.weight is model.model.embed_tokens.weight else None,
        checks=[_llama_check],
    )
