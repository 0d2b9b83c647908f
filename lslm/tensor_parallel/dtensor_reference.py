"""The same lslm GPT made tensor-parallel by PyTorch's DTensor API: the production counterpart of our f/g layers.

:func:`lslm.tensor_parallel.apply.apply_tensor_parallel` swaps modules for layers that call
``ctx.comm`` explicitly. DTensor instead attaches a *placement* to every tensor on a
device mesh (``Shard(d)``: split along ``d``; ``Replicate()``: whole on every rank;
``Partial()``: every rank holds a summand) and derives the communication from the
placements an operator needs: ``Partial -> Replicate`` is an all-reduce (Megatron's ``g``),
``Shard -> Replicate`` an all-gather, ``Partial -> Shard`` a reduce-scatter, and the
backward of each is its transpose (so ``f``'s all-reduce of the input gradient appears
on its own). :func:`parallelize_gpt` hands our unchanged :class:`~lslm.models.GPT` to
``parallelize_module`` on ``ctx.mesh["tp"]`` with this plan:

=====================  ==========================================  =============================================
module                 without sequence parallelism                with sequence parallelism (Shard(1) = sequence)
=====================  ==========================================  =============================================
``wte``                ``RowwiseParallel(input=Replicate)``:       same, output ``Shard(1)`` (reduce-scatter)
                       rows = vocabulary, output all-reduced
``wpe``                untouched                                   output ``Replicate -> Shard(0)`` (slice; its
                                                                   backward all-gathers, so the gradient is whole)
``blocks.*.ln_1/2``    untouched                                   ``SequenceParallel`` (weights ``Replicate``)
``blocks.*.attn/mlp``  untouched                                   ``PrepareModuleInput(Shard(1) -> Replicate)``
``*.c_attn, c_fc``     ``ColwiseParallel``                         same (input arrives ``Replicate``)
``*.c_proj``           ``RowwiseParallel`` (output all-reduced)    output ``Shard(1)`` (reduce-scatter)
``ln_f``               untouched                                   ``SequenceParallel``
``lm_head``            ``ColwiseParallel``, output ``Shard(-1)``   same, input ``Shard(1)`` (all-gather)
                       kept a DTensor for ``loss_parallel``
=====================  ==========================================  =============================================

The model code is not edited, so some choices follow from it:

* **The fused ``[q|k|v]`` trap** (see :mod:`lslm.tensor_parallel.qkv`): ``ColwiseParallel``
  gives rank r the r-th *contiguous* block of ``c_attn``'s output rows, which at tp=2 is
  all of q and half of k; the model's ``chunk(3)`` would then treat q-rows as k. Permuting
  the rows by :func:`~lslm.tensor_parallel.qkv.qkv_permutation` *before*
  ``parallelize_module`` makes block r exactly ``[q_r | k_r | v_r]`` (whole heads of each),
  which is what ``chunk(3)`` needs. The serial model is the same function with permuted
  rows; :func:`full_parameters` undoes the permutation for comparisons.
* **``use_local_output``.** What the model's own code touches (``chunk``, ``view``, the
  residual ``x + ...``) is a plain local tensor: the linear styles return local outputs,
  so attention reads its local head count and (SP) sequence length from ``c_attn``'s
  output, as under lslm. Two outputs stay DTensors on purpose: the LayerNorms' under SP
  (the next ``PrepareModuleInput`` must know they are ``Shard(1)`` to all-gather them)
  and the head's (``loss_parallel`` needs logits that know they are ``Shard(-1)``).
  Torchtitan's Llama plan has this shape; its gather sits on the attention module because
  q, k, v are three linears there. For our fused ``c_attn``,
  ``ColwiseParallel(input_layouts=Shard(1))`` would move the same bytes.
* **Positions under sequence parallelism.** ``x = wte(idx) + wpe(pos)``: the embedding
  returns this rank's positions only, so ``wpe``'s ``(T, C)`` output is sliced along
  positions too. Declaring it ``Replicate`` and redistributing to ``Shard(0)`` slices for
  free; the backward all-gathers the slice gradients, so ``wpe.weight`` gets its whole
  gradient with no extra sync (lslm instead marks it and sums the partial gradients in
  :func:`~lslm.tensor_parallel.grads.sync_tensor_parallel_grads`).
* **The loss.** The head's output is a ``Shard(-1)`` DTensor, so the model's own
  ``F.cross_entropy`` computes the vocabulary-parallel loss when run inside
  ``torch.distributed.tensor.parallel.loss_parallel()`` (forward *and* backward): use
  :func:`dtensor_loss`.

``wte`` is sharded by vocabulary rows as torchtitan does (``RowwiseParallel``, replicated
token ids: each rank looks up the tokens it owns, the partial outputs are summed); it works
on gloo. ``shard_embedding=False`` keeps it replicated. The launchable side-by-side
(serial, lslm, DTensor) that notebook 05 runs is :mod:`lslm.demos.dtensor_compare`.
"""

from __future__ import annotations

import warnings
from contextlib import nullcontext
from typing import Any

import torch
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor.debug import CommDebugMode
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    ParallelStyle,
    PrepareModuleInput,
    PrepareModuleOutput,
    RowwiseParallel,
    SequenceParallel,
    loss_parallel,
    parallelize_module,
)

from lslm.models.gpt import GPT
from lslm.runtime.context import ParallelContext
from lslm.tensor_parallel.qkv import qkv_permutation

__all__ = ["COLLECTIVE_NAMES", "dtensor_comm_counts", "dtensor_loss",
           "dtensor_plan", "full_parameters", "parallelize_gpt", "permute_fused_qkv"]


def dtensor_plan(sequence_parallel: bool = False, shard_embedding: bool = True) -> dict[str, ParallelStyle]:
    """``parallelize_module``'s plan for :class:`lslm.models.GPT` (the table in the module doc)."""
    seq = Shard(1)  # activations are (B, T, C): the sequence is dim 1
    act = seq if sequence_parallel else Replicate()  # the residual stream's layout between blocks
    plan: dict[str, ParallelStyle] = {
        "blocks.*.attn.c_attn": ColwiseParallel(),
        "blocks.*.attn.c_proj": RowwiseParallel(output_layouts=act),
        "blocks.*.mlp.c_fc": ColwiseParallel(),
        "blocks.*.mlp.c_proj": RowwiseParallel(output_layouts=act),
        # Logits stay a DTensor sharded by vocabulary: loss_parallel reads the placement.
        "lm_head": ColwiseParallel(input_layouts=act, output_layouts=Shard(-1), use_local_output=False),
    }
    if shard_embedding:
        plan["wte"] = RowwiseParallel(input_layouts=Replicate(), output_layouts=act)
    elif sequence_parallel:  # a replicated table: its full output, sliced to this rank's positions
        plan["wte"] = PrepareModuleOutput(output_layouts=Replicate(), desired_output_layouts=seq)
    if sequence_parallel:
        plan["wpe"] = PrepareModuleOutput(output_layouts=Replicate(), desired_output_layouts=Shard(0))
        for norm in ("blocks.*.ln_1", "blocks.*.ln_2", "ln_f"):
            plan[norm] = SequenceParallel()  # output stays a Shard(1) DTensor for the gather below
        for sub in ("blocks.*.attn", "blocks.*.mlp"):
            plan[sub] = PrepareModuleInput(input_layouts=(seq,), desired_input_layouts=(Replicate(),))
    return plan


def permute_fused_qkv(model: GPT, tp: int) -> None:
    """Reorder every block's ``c_attn`` rows (weight and bias) in place so a contiguous split gives whole heads.

    After it, block r of ``tp`` equal blocks of rows is ``[q_r | k_r | v_r]`` (see the module
    doc); :func:`full_parameters` undoes it on gathered copies.
    """
    cfg = model.config
    perm = qkv_permutation(cfg.n_embd, cfg.n_head, tp)
    with torch.no_grad():
        for block in model.blocks:
            lin = block.attn.c_attn
            lin.weight.copy_(lin.weight[perm])
            if lin.bias is not None:
                lin.bias.copy_(lin.bias[perm])


def parallelize_gpt(model: GPT, ctx: ParallelContext, *, sequence_parallel: bool = False,
                    shard_embedding: bool = True) -> GPT:
    """Make ``model`` (full, identical weights on every rank) tensor-parallel with DTensor on ``ctx.mesh["tp"]``.

    In place; returns ``model``. Its ``forward(idx)`` then returns logits as a ``Shard(-1)``
    DTensor: compute the loss with :func:`dtensor_loss`. No gradient fix-up is called after
    backward, but two gradients keep unusual placements: under sequence parallelism the
    LayerNorm parameters' gradients are ``Partial`` (per-rank sums over the rank's positions),
    summed by an all-reduce per parameter when the optimizer first needs them whole; and
    ``wte``'s gradient is a *full* ``(V, C)`` ``Replicate`` tensor on every rank (the
    embedding backward does not know only this rank's rows are needed), sliced to
    ``Shard(0)`` in the update.
    """
    if not isinstance(model, GPT):
        raise ValueError(f"parallelize_gpt takes an lslm GPT, got {type(model).__name__}")
    cfg, tp = model.config, ctx.tp_size
    if cfg.tie_weights:
        raise ValueError("tied wte/lm_head weights are not supported by this reference; build GPTConfig("
                         "tie_weights=False)")
    if cfg.dropout:
        raise ValueError(f"dropout={cfg.dropout}: the DTensor reference is for exact comparisons; use dropout=0.0")
    for name, size in (("n_head", cfg.n_head), ("vocab_size", cfg.vocab_size)):  # whole heads, equal vocab shards
        if size % tp:
            raise ValueError(f"{name}={size} does not split over tp={tp} ranks; choose tp dividing it")
    if getattr(model, "dtensor_tp", None) is not None or getattr(model, "tensor_parallel", None) is not None:
        raise ValueError("this model is already tensor-parallel (parallelize_gpt or apply_tensor_parallel); "
                         "pass a freshly built GPT")
    permute_fused_qkv(model, tp)
    # src_data_rank=None: every rank built the same weights from one seed, so each slices its own
    # copy (no scatter from rank 0 at set-up).
    parallelize_module(model, ctx.mesh["tp"], dtensor_plan(sequence_parallel, shard_embedding), src_data_rank=None)
    model.dtensor_tp = {"tp": tp, "sequence_parallel": sequence_parallel, "shard_embedding": shard_embedding}
    return model


def dtensor_loss(model: GPT, idx: torch.Tensor, targets: torch.Tensor, backward: bool = False) -> torch.Tensor:
    """Mean cross-entropy of a :func:`parallelize_gpt` model, with vocabulary-parallel logits (``loss_parallel``).

    The model's own ``F.cross_entropy`` runs on the ``Shard(-1)`` logits inside
    ``loss_parallel()``, which computes it from the shards (no full logits anywhere).
    ``backward=True`` also runs ``loss.backward()`` inside the context, as it must be.
    Returns the loss as a plain tensor (this rank's replica of a replicated scalar) when
    ``backward`` is done, else the DTensor for the caller to backward within ``loss_parallel()``.
    """
    sharded = getattr(model, "dtensor_tp", None) is not None
    with loss_parallel() if sharded else nullcontext():
        _, loss = model(idx, targets)
        if backward:
            loss.backward()
    if backward and isinstance(loss, DTensor):
        return loss.detach().to_local()
    return loss


def full_parameters(model: GPT) -> dict[str, torch.Tensor]:
    """Every parameter as one whole tensor in the serial layout (``c_attn`` rows un-permuted), by name.

    Collective over the TP group (``full_tensor`` all-gathers the shards): call it on every rank.
    """
    info = getattr(model, "dtensor_tp", None)
    out = {}
    for name, p in model.named_parameters():
        full = p.detach().full_tensor() if isinstance(p, DTensor) else p.detach().clone()
        if info is not None and name.rsplit(".", 1)[0].endswith("attn.c_attn"):
            cfg = model.config
            full = full[torch.argsort(qkv_permutation(cfg.n_embd, cfg.n_head, info["tp"]))]
        out[name] = full
    return out


#: torch's functional-collective ops -> the names lslm's ledger uses.
COLLECTIVE_NAMES = {"all_reduce": "all_reduce", "all_gather_into_tensor": "all_gather",
                    "reduce_scatter_tensor": "reduce_scatter", "all_to_all_single": "all_to_all"}


class _SizedCommDebugMode(CommDebugMode):
    """``CommDebugMode`` that also keeps, per collective, its module, phase and size (elements)."""

    def __init__(self) -> None:
        super().__init__()
        self.records: list[tuple[str, str, str, int]] = []
        self.phase = "forward"

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = super().__torch_dispatch__(func, types, args, kwargs)
        name = getattr(getattr(func, "_overloadpacket", None), "__name__", "")
        if out is not NotImplemented and name in COLLECTIVE_NAMES:
            numel = args[0].numel()
            if name == "all_gather_into_tensor":  # counted like lslm's ledger: the whole gathered tensor
                numel *= args[1]
            tracker = self.advanced_module_tracker
            phase = self.phase if self.phase != "forward" else ("backward" if tracker.is_bw else "forward")
            self.records.append((tracker.name, phase, COLLECTIVE_NAMES[name], numel))
        return out


def _owner(module_name: str, root: str) -> str:
    """``"GPT.blocks.0.attn.c_proj"`` -> ``"blocks.0"``; ``"GPT.wte"`` -> ``"wte"``; the root itself -> ``"model"``."""
    parts = module_name.split(".")
    if parts[0] == root:
        parts = parts[1:]
    if not parts or module_name == "Global":
        return "model"
    return ".".join(parts[:2]) if parts[0] == "blocks" else parts[0]


def dtensor_comm_counts(model: GPT, idx: torch.Tensor, targets: torch.Tensor,
                        optimizer: torch.optim.Optimizer | None = None) -> dict[str, Any]:
    """One forward + backward (and ``optimizer.step()`` if given) under ``CommDebugMode``: its collectives by owner.

    Returns ``{"total": {op: calls}, "by_owner": {owner: {phase: {op: calls}}},
    "elements": {owner: {phase: {op: [elements per call]}}}, "per_layer": {phase: {op: calls}}}``.
    Owners are ``"blocks.i"`` (a transformer layer, its submodules included), the
    top-level modules (``"wte"``, ``"wpe"``, ``"lm_head"``), ``"model"`` (code in
    ``GPT.forward`` itself: the loss) and ``"optimizer"``. Phases: ``"forward"``,
    ``"backward"`` (attributed to the module whose backward was running, as torch's
    tracker sees it) and ``"optimizer"``. ``per_layer`` is the counts of ``blocks.0``, checked equal for every
    layer (``ValueError`` if they differ). Element counts follow lslm's ledger: an
    all-reduce's tensor, an all-gather's whole output, a reduce-scatter's whole input.
    """
    mode = _SizedCommDebugMode()
    root = type(model).__name__
    with warnings.catch_warnings():
        # The tracker's full backward hooks warn on modules whose inputs need no gradient (wte's token ids).
        warnings.simplefilter("ignore", UserWarning)
        with mode:
            dtensor_loss(model, idx, targets, backward=True)
            if optimizer is not None:
                mode.phase = "optimizer"
                optimizer.step()
    by_owner: dict[str, dict[str, dict[str, int]]] = {}
    elements: dict[str, dict[str, dict[str, list[int]]]] = {}
    for module_name, phase, op, numel in mode.records:
        owner = "optimizer" if phase == "optimizer" else _owner(module_name, root)
        counts = by_owner.setdefault(owner, {}).setdefault(phase, {})
        counts[op] = counts.get(op, 0) + 1
        elements.setdefault(owner, {}).setdefault(phase, {}).setdefault(op, []).append(numel)
    layers = [by_owner.get(f"blocks.{i}", {}) for i in range(len(model.blocks))]
    if any(layer != layers[0] for layer in layers):
        raise ValueError(f"transformer layers communicate differently: {layers}")
    total: dict[str, int] = {}
    for _, _, op, _ in mode.records:
        total[op] = total.get(op, 0) + 1
    return {"total": total, "by_owner": by_owner, "elements": elements, "per_layer": layers[0]}
