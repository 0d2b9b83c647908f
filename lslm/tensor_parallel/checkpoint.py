"""Checkpoints of a tensor-parallel model: one shard per TP rank that loads back *as* tensor-parallel, and the
unsharded state dict that loads into the serial model.

**Sharded save / load.** :func:`save_tensor_parallel` has each TP rank of data-parallel
replica 0 write its own ``state_dict`` (the replicas hold identical copies) plus what
is needed to refuse a wrong load: the TP size and rank, the true and padded
vocabulary, the options, the class of every parallel module and each tensor's layout
(local shape, ``tensor_model_parallel``, ``partition_dim``, fused-qkv heads, vocabulary
rows, transposition). The optimizer's state and the random streams can travel with it,
so a resumed run continues the loss curve exactly. Files are written atomically (a
temporary file renamed into place): a crash mid-save leaves the previous checkpoint whole.

:func:`load_tensor_parallel` loads into a model that
:func:`~lslm.tensor_parallel.apply.apply_tensor_parallel` has already converted, with
``load_state_dict``: values are copied *into* the existing parallel parameters, so the
parallel modules stay. (Replacing modules on load is how a parallel head silently becomes
a plain ``nn.Linear`` that computes something else; picotron's checkpoint loader did
that.) A checkpoint of another TP size, another vocabulary, other shapes or a model whose
modules are not the parallel classes raises ``ValueError`` naming the difference.

**Unsharded.** :func:`gather_full_state_dict` all-gathers every sharded tensor over the TP
group and undoes what sharding did: it concatenates along ``partition_dim``, puts the
fused ``[q|k|v]`` rows back in the serial order (the inverse of
:func:`~lslm.tensor_parallel.qkv.qkv_permutation`), drops the vocabulary padding and
transposes Hugging Face ``Conv1D`` weights back. :func:`consolidate_checkpoint` does the
same from the shard files, in one process, without any process group.
"""

from __future__ import annotations

import fnmatch
import io
import re
from collections.abc import Mapping
from dataclasses import asdict
from pathlib import Path
from typing import Any

import torch
from torch import nn

from lslm.runtime.context import ParallelContext
from lslm.runtime.files import atomic_write_bytes
from lslm.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear, VocabParallelEmbedding
from lslm.tensor_parallel.plan import Colwise, Rowwise, TPPlan, VocabEmbedding, VocabHead
from lslm.tensor_parallel.qkv import qkv_permutation

__all__ = ["FORMAT", "GATHER_LABEL", "consolidate_checkpoint", "gather_full_state_dict", "gather_full_tensors",
           "load_tensor_parallel", "save_tensor_parallel", "shard_file", "tensor_layouts"]

FORMAT = "lslm-tensor-parallel/1"
#: Ledger label of the all-gathers that rebuild full tensors (and of the save's barrier).
GATHER_LABEL = "checkpoint"
PARALLEL_CLASSES = (ColumnParallelLinear, RowParallelLinear, VocabParallelEmbedding)
_SHARD = re.compile(r"model_tp(\d+)-of-(\d+)\.pt")
# Layout fields that decide where a tensor's values belong (sequence_parallel does not: it is about gradients).
_LAYOUT_KEYS = ("shape", "sharded", "partition_dim", "qkv_heads", "vocab_rows", "transposed", "replicated_heads")


def shard_file(path: str | Path, tp_rank: int, tp: int) -> Path:
    """The file of TP rank ``tp_rank`` of ``tp`` inside checkpoint directory ``path``."""
    return Path(path) / f"model_tp{tp_rank:02d}-of-{tp:02d}.pt"


def _plan(model: nn.Module, plan: TPPlan | None) -> TPPlan:
    from lslm.tensor_parallel.apply import plan_for

    return plan if plan is not None else plan_for(model)


def _style(module_name: str, plan: TPPlan) -> Any:
    return next((s for pattern, s in plan.styles.items() if fnmatch.fnmatchcase(module_name, pattern)), None)


def _tp_info(model: nn.Module) -> Any:
    info = getattr(model, "tensor_parallel", None)
    if info is None:
        raise ValueError(f"{type(model).__name__} is not tensor-parallel: call apply_tensor_parallel(model, ctx, ...) "
                         "first, then load into it (loading must keep the parallel layers, not replace them)")
    return info


def tensor_layouts(model: nn.Module, plan: TPPlan | None = None) -> dict[str, dict[str, Any]]:
    """For every ``state_dict`` key of a tensor-parallel model: how its local tensor sits in the full one (JSON-ready).

    ``shape`` (local), ``sharded`` (``tensor_model_parallel``), ``partition_dim``,
    ``sequence_parallel``, ``qkv_heads`` (fused [q|k|v] rows permuted per head),
    ``vocab_rows`` (the true vocabulary: rows past it are padding), ``transposed``
    (stored ``(in, out)`` in the serial model) and ``replicated_heads`` (``[n_kv, t]``).
    """
    plan = _plan(model, plan)
    params = dict(model.named_parameters(remove_duplicate=False))
    layouts = {}
    for key, value in model.state_dict().items():
        p = params.get(key, value)  # a buffer is replicated
        style = _style(key.rpartition(".")[0], plan)
        sharded = bool(getattr(p, "tensor_model_parallel", False))
        heads = getattr(p, "replicated_heads", None)
        layouts[key] = {
            "shape": list(value.shape), "sharded": sharded,
            "partition_dim": int(getattr(p, "partition_dim", -1)) if sharded else -1,
            "sequence_parallel": bool(getattr(p, "sequence_parallel", False)),
            "qkv_heads": style.qkv_heads if isinstance(style, Colwise) and sharded else None,
            "vocab_rows": plan.vocab_size if isinstance(style, (VocabEmbedding, VocabHead)) and sharded else None,
            "transposed": bool(isinstance(style, (Colwise, Rowwise)) and style.transposed and value.dim() == 2),
            "replicated_heads": list(heads) if heads is not None else None,
        }
    return layouts


def _assemble(shards: list[torch.Tensor], layout: Mapping[str, Any]) -> torch.Tensor:
    """The serial model's tensor from every TP rank's piece (in TP rank order)."""
    if not layout["sharded"]:
        return shards[0].clone()
    tp = len(shards)
    if layout["replicated_heads"] is not None:  # t // n_kv ranks hold each head: take its first holder's copy
        n_kv, t = layout["replicated_heads"]
        shards = shards[:: t // n_kv]
    full = torch.cat(shards, dim=layout["partition_dim"])
    if layout["qkv_heads"] is not None:  # the gathered rows are in qkv_permutation order; put them back
        perm = qkv_permutation(full.shape[0] // 3, layout["qkv_heads"], tp).to(full.device)
        ordered = torch.empty_like(full)
        ordered[perm] = full
        full = ordered
    if layout["vocab_rows"] is not None:
        full = full[: layout["vocab_rows"]]
    if layout["transposed"]:
        full = full.t()
    return full.contiguous()


def gather_full_tensors(model: nn.Module, ctx: ParallelContext, tensors: Mapping[str, torch.Tensor], *,
                        plan: TPPlan | None = None, label: str = GATHER_LABEL) -> dict[str, torch.Tensor]:
    """Full (serial-layout) versions of ``tensors`` (keys of ``model``'s state dict: weights, or gradients), on
    every rank.

    One all-gather over the TP group per sharded tensor; replicated ones are copied.
    """
    layouts = tensor_layouts(model, plan)
    out = {}
    for key, t in tensors.items():
        if key not in layouts:
            raise ValueError(f"{key!r} is not a state_dict key of {type(model).__name__}")
        layout = layouts[key]
        if layout["sharded"] and ctx.tp_size > 1:
            t = t.detach().contiguous()
            pieces = [torch.empty_like(t) for _ in range(ctx.tp_size)]
            ctx.comm.all_gather(pieces, t, group=ctx.tp_group, label=label)
        else:
            pieces = [t.detach()] * max(ctx.tp_size, 1)
        out[key] = _assemble(pieces, layout)
    return out


def gather_full_state_dict(model: nn.Module, ctx: ParallelContext, *,
                           plan: TPPlan | None = None) -> dict[str, torch.Tensor]:
    """The unsharded state dict of a tensor-parallel model, equal to the serial model's (loads into it, strict)."""
    _tp_info(model)
    return gather_full_tensors(model, ctx, model.state_dict(), plan=plan)


def _modules(model: nn.Module) -> dict[str, str]:
    return {name: type(m).__name__ for name, m in model.named_modules() if isinstance(m, PARALLEL_CLASSES)}


def save_tensor_parallel(model: nn.Module, ctx: ParallelContext, path: str | Path, *,
                         optimizer: torch.optim.Optimizer | None = None, extra: dict[str, Any] | None = None,
                         plan: TPPlan | None = None) -> Path:
    """Write this TP rank's shard into directory ``path`` (data-parallel rank 0 writes; every rank waits).

    ``optimizer``: its state (this rank's shard of it) is saved too; ``extra``: anything
    ``torch.load(weights_only=True)`` accepts (the step number, ...). The random streams
    (the default generator and ``ctx.rng``'s) are saved for an exact resume. Returns the
    file this rank's TP shard lives in.
    """
    info = _tp_info(model)
    if ctx.pp_size > 1 or ctx.cp_size > 1:
        raise ValueError("save_tensor_parallel handles tp (x dp) only; pipeline / context parallel checkpoints "
                         "need their own stage-aware layout")
    file = shard_file(path, ctx.tp_rank, ctx.tp_size)
    if ctx.dp_rank == 0:
        rng: dict[str, Any] = {"cpu": torch.get_rng_state()}
        if ctx.device.type == "cuda":
            rng["cuda"] = torch.cuda.get_rng_state(ctx.device)
        if ctx.rng is not None:
            rng["tracker"] = ctx.rng.get_states()
        meta = {"tp": ctx.tp_size, "tp_rank": ctx.tp_rank, "vocab_size": info.vocab_size,
                "padded_vocab_size": info.padded_vocab_size, "options": asdict(info.options),
                "modules": _modules(model), "layouts": tensor_layouts(model, plan), "torch": str(torch.__version__)}
        payload = {"format": FORMAT, "meta": meta,
                   "model": {k: v.detach().cpu() for k, v in model.state_dict().items()},
                   "optimizer": optimizer.state_dict() if optimizer is not None else None,
                   "rng": rng, "extra": extra or {}}
        buf = io.BytesIO()
        torch.save(payload, buf)
        atomic_write_bytes(file, buf.getvalue())
    ctx.comm.barrier(label=GATHER_LABEL)  # every shard is on disk before any rank goes on (and maybe reads)
    return file


def _read(file: Path) -> dict[str, Any]:
    payload = torch.load(file, map_location="cpu", weights_only=True)
    if not isinstance(payload, dict) or payload.get("format") != FORMAT:
        raise ValueError(f"{file} is not an lslm tensor-parallel checkpoint (format {FORMAT!r})")
    return payload


def _saved_tp(path: Path) -> list[int]:
    return sorted({int(m.group(2)) for f in path.glob("model_tp*-of-*.pt") if (m := _SHARD.fullmatch(f.name))})


def _check_layout(model: nn.Module, meta: Mapping[str, Any], plan: TPPlan | None) -> None:
    mine, saved = _modules(model), meta["modules"]
    for name in sorted(set(mine) | set(saved)):
        if mine.get(name) != saved.get(name):
            have = mine.get(name) or (type(model.get_submodule(name)).__name__ if _has(model, name) else "missing")
            raise ValueError(f"module {name!r} is {have} in the model but {saved.get(name, 'not parallel')} in the "
                             "checkpoint: apply_tensor_parallel with the same plan before loading")
    layouts, want = tensor_layouts(model, plan), meta["layouts"]
    if set(layouts) != set(want):
        diff = sorted(set(layouts) ^ set(want))
        raise ValueError(f"the model and the checkpoint have different tensors, e.g. {diff[:4]}")
    for key, lay in layouts.items():
        for field in _LAYOUT_KEYS:
            if lay[field] != want[key][field]:
                raise ValueError(f"{key}: {field} is {lay[field]} in the model but {want[key][field]} in the "
                                 "checkpoint (another model size or plan)")


def _has(model: nn.Module, name: str) -> bool:
    try:
        model.get_submodule(name)
    except AttributeError:
        return False
    return True


def load_tensor_parallel(model: nn.Module, ctx: ParallelContext, path: str | Path, *,
                         optimizer: torch.optim.Optimizer | None = None, restore_rng: bool = True,
                         plan: TPPlan | None = None) -> dict[str, Any]:
    """Load this TP rank's shard from ``path`` into the already tensor-parallel ``model`` (and ``optimizer``).

    Raises ``ValueError`` when the checkpoint's TP size, vocabulary, parallel modules or
    tensor layouts differ from the model's. Returns the ``extra`` dict given to
    :func:`save_tensor_parallel`.
    """
    info = _tp_info(model)
    path = Path(path)
    file = shard_file(path, ctx.tp_rank, ctx.tp_size)
    if not file.exists():
        saved = _saved_tp(path)
        raise ValueError(f"no shard for tp rank {ctx.tp_rank} of tp={ctx.tp_size} in {path}: " +
                         (f"it was saved with tp={saved}; load it with that tensor-parallel size, or "
                          "consolidate_checkpoint() it and re-shard" if saved else "no checkpoint there"))
    payload = _read(file)
    meta = payload["meta"]
    for key, have in (("tp", ctx.tp_size), ("tp_rank", ctx.tp_rank), ("vocab_size", info.vocab_size),
                      ("padded_vocab_size", info.padded_vocab_size)):
        if meta[key] != have:
            raise ValueError(f"checkpoint {file} has {key}={meta[key]}, the model {key}={have}")
    _check_layout(model, meta, plan)
    model.load_state_dict(payload["model"], strict=True)  # copies into the parallel parameters: modules stay
    if optimizer is not None:
        if payload["optimizer"] is None:
            raise ValueError(f"checkpoint {file} holds no optimizer state; pass optimizer=None")
        optimizer.load_state_dict(payload["optimizer"])
    if restore_rng:
        rng = payload["rng"]
        torch.set_rng_state(rng["cpu"])
        if "cuda" in rng and ctx.device.type == "cuda":
            torch.cuda.set_rng_state(rng["cuda"], ctx.device)
        if "tracker" in rng and ctx.rng is not None:
            ctx.rng.set_states(rng["tracker"])
    return payload["extra"]


def consolidate_checkpoint(path: str | Path) -> dict[str, torch.Tensor]:
    """The unsharded state dict from a checkpoint directory's shard files, in this process (no process group)."""
    path = Path(path)
    saved = _saved_tp(path)
    if len(saved) != 1:
        raise ValueError(f"{path} holds {'no' if not saved else 'several'} tensor-parallel checkpoints "
                         f"(tp sizes found: {saved})")
    tp = saved[0]
    missing = [str(shard_file(path, r, tp)) for r in range(tp) if not shard_file(path, r, tp).exists()]
    if missing:
        raise ValueError(f"checkpoint {path} is incomplete: missing {missing}")
    payloads = [_read(shard_file(path, r, tp)) for r in range(tp)]
    layouts = payloads[0]["meta"]["layouts"]
    return {key: _assemble([p["model"][key] for p in payloads], layouts[key]) for key in layouts}
