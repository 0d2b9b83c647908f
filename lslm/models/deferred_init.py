"""Build a model on the meta device, then give a rank only what it keeps, with the serial run's exact values.

``torch.manual_seed(seed); GPT(cfg)`` allocates and initialises the whole model. A rank of a
tensor-parallel group keeps ``1/t`` of most matrices and a pipeline rank a few blocks, so
building the whole model first costs every rank a whole model of memory at start (and on a
GPU, a model that does not fit one device cannot be built at all). Instead::

    with torch.device("meta"):
        model = GPT(cfg)                      # shapes only: no storage, no random draws
    for name, leaf in serial_leaves(model, seed):
        ...                                   # leaf: one full-size module on the CPU, serial values

or :func:`materialize_` for the leaves a rank keeps whole (a pipeline stage), which
``apply_tensor_parallel(..., init_seed=seed)`` and ``apply_pipeline(..., init_seed=seed)`` use.

**Why the values are the serial ones.** The serial build draws from the global generator
twice per parameter: once in PyTorch's constructors (``reset_parameters``: Kaiming-uniform
for a linear, a normal for an embedding) and once more in the model's own initialisation
(``GPT.init_steps``; residual projections a third time). :func:`serial_leaves` replays
exactly those draws, in the same order, on tensors of the same shape, dtype and device (the
CPU, as :func:`lslm.recipes.train.build_model` builds): first every leaf's
``reset_parameters`` on a full-size scratch copy, in construction order, then every init
step. Each step overwrites its whole tensor, so only a parameter's last step matters: that
one is drawn into the tensor that is kept, every earlier one into a scratch tensor freed at
once. A leaf is handed out as soon as all its parameters are final, and dropped by the
caller after it took its shard. At any moment the full-size tensors alive are one scratch
and the final values of the leaves not yet complete (for GPT: the small ``c_proj`` biases,
whose weight is drawn a third time at the very end), so the peak at start is the kept
shards plus about one leaf, not the model. The generator is left where the serial build
leaves it, so dropout afterwards draws the same numbers too.

Assumptions, checked where they can be: leaves are constructed in their registration order
(true for GPT; ``tests/test_deferred_init.py`` compares the replay with the serial build
bit for bit), every leaf that owns parameters has ``reset_parameters`` and no buffers, and
the model lists its later initialisation in ``init_steps()``.
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Iterator

import torch
from torch import nn

__all__ = ["is_meta", "materialize_", "place_leaf_", "serial_leaves"]


def is_meta(model: nn.Module) -> bool:
    """True when any of ``model``'s parameters or buffers lives on the meta device (shapes only, no data)."""
    return any(t.is_meta for t in (*model.parameters(), *model.buffers()))


def _leaves(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """Modules that own parameters directly, in registration order (= construction order for GPT)."""
    out = []
    for name, module in model.named_modules():
        own = list(module.parameters(recurse=False))
        if not own:
            continue
        if not callable(getattr(module, "reset_parameters", None)):
            raise ValueError(f"cannot replay the construction of {name!r} ({type(module).__name__}): it owns "
                             "parameters but has no reset_parameters(); build this model on a real device")
        if any(True for _ in module.buffers(recurse=False)):
            raise ValueError(f"{name!r} ({type(module).__name__}) has buffers, which the replay does not "
                             "initialise; build this model on a real device")
        out.append((name, module))
    return out


def _scratch_like(param: torch.Tensor) -> torch.Tensor:
    # CPU, contiguous, the parameter's dtype: the serial build's tensors, so each draw consumes the same numbers.
    return torch.empty(param.shape, dtype=param.dtype, device="cpu")  # lslm: cpu-ok (the serial build is on CPU)


def serial_leaves(model: nn.Module, seed: int,
                  keep: Callable[[str], bool] | None = None) -> Iterator[tuple[str, nn.Module]]:
    """Replay ``torch.manual_seed(seed)`` + the serial CPU build of the meta-device ``model``, one leaf at a time.

    Yields ``(name, leaf)`` for every leaf module (one that owns parameters) for which
    ``keep(name)`` is true (default: all), in the order they become final: ``leaf`` is a
    full-size copy on the CPU whose parameters hold exactly the values the serial build
    gives them (tied parameters: the same tensor in every leaf that holds it). Leaves not kept
    are still drawn (the generator must advance the same way) but never held. ``model``
    itself is not modified; it must be on the meta device and provide ``init_steps()``
    (:meth:`lslm.models.gpt.GPT.init_steps`). Seeds the global generator and leaves it where
    the serial build leaves it.
    """
    if not is_meta(model):
        raise ValueError("serial_leaves replays the build of a model on the meta device; this one holds data "
                         "(build it inside `with torch.device('meta'):`)")
    init_steps = getattr(model, "init_steps", None)
    if not callable(init_steps):
        raise ValueError(f"{type(model).__name__} has no init_steps(): the replay needs the model's own "
                         "initialisation as (parameter, in-place init) steps")
    keep = keep if keep is not None else (lambda _name: True)
    leaves = _leaves(model)
    kept = [keep(name) for name, _ in leaves]
    # Taken now: the caller may replace a leaf's parameters as soon as it is handed out (materialize_ does).
    templates = [copy.deepcopy(leaf) for _, leaf in leaves]  # meta copies: cost nothing
    ids = [[id(p) for p in leaf.parameters(recurse=False)] for _, leaf in leaves]
    owners: dict[int, list[int]] = {}  # parameter id -> indices of the leaves holding it
    for i, leaf_ids in enumerate(ids):
        for pid in leaf_ids:
            owners.setdefault(pid, []).append(i)
    steps = list(init_steps())
    last_step = {id(p): i for i, (p, _) in enumerate(steps)}
    missing = [len(leaf_ids) for leaf_ids in ids]  # parameters not final yet
    waiting = {pid: sum(kept[i] for i in idx) for pid, idx in owners.items()}  # kept leaves not yet handed out
    final: dict[int, torch.Tensor] = {}  # parameter id -> final full value, while a kept leaf still needs it

    def settle(param_id: int, value: torch.Tensor) -> Iterator[tuple[str, nn.Module]]:
        # One parameter is final: hand out every kept leaf it completes; drop values no kept leaf still needs.
        if waiting[param_id]:
            final[param_id] = value
        for i in owners[param_id]:
            missing[i] -= 1
            if missing[i] or not kept[i]:
                continue
            yield leaves[i][0], _full_copy(templates[i], ids[i], final)
            for pid in ids[i]:
                waiting[pid] -= 1
                if not waiting[pid]:
                    final.pop(pid, None)

    torch.manual_seed(seed)
    # 1. Construction: PyTorch's reset_parameters of every leaf, on a full-size scratch copy.
    settled: set[int] = set()
    for template, leaf_ids in zip(templates, ids, strict=True):
        # A parameter with an init step is decided later; a tied one by the first leaf that built it
        # (the serial build ties after constructing, keeping that first leaf's tensor).
        decided = [(j, pid) for j, pid in enumerate(leaf_ids) if pid not in last_step and pid not in settled]
        for pid, value in _constructed(template, decided):
            settled.add(pid)
            yield from settle(pid, value)
    # 2. The model's own init steps; only a parameter's last step lands in a tensor that is kept.
    for i, (p, init) in enumerate(steps):
        target = _scratch_like(p)
        with torch.no_grad():
            init(target)
        if last_step[id(p)] == i:
            yield from settle(id(p), target)
        del target


def _constructed(template: nn.Module, decided: list[tuple[int, int]]) -> list[tuple[int, torch.Tensor]]:
    """Run ``template``'s ``reset_parameters`` on a full-size CPU copy; return the parameters ``decided`` by it
    (``(position, id)`` pairs) as ``(id, value)``. The rest of the copy is freed on return."""
    scratch = copy.deepcopy(template).to_empty(device="cpu", recurse=False)  # lslm: cpu-ok (serial build on CPU)
    scratch.reset_parameters()
    values = [p.detach() for p in scratch.parameters(recurse=False)]
    return [(pid, values[j]) for j, pid in decided]


def _full_copy(template: nn.Module, ids: list[int], final: dict[int, torch.Tensor]) -> nn.Module:
    """A CPU copy of the meta ``template`` whose parameters hold their final values (shared storage, no copy)."""
    full = copy.deepcopy(template)  # meta: costs nothing
    for (attr, p), pid in zip(list(full.named_parameters(recurse=False)), ids, strict=True):
        setattr(full, attr, nn.Parameter(final[pid], requires_grad=p.requires_grad))
    return full


def materialize_(model: nn.Module, device: torch.device | str, *, seed: int,
                 keep: Callable[[str], bool] | None = None) -> nn.Module:
    """Give the leaves of the meta-device ``model`` that ``keep(name)`` selects (default: all) real storage on
    ``device``, holding the serial build's values (:func:`serial_leaves`); return ``model``.

    Other leaves stay on the meta device (no memory). Parameters are replaced by new
    ``nn.Parameter`` s that keep the old ones' attributes (tensor-parallel marks) and
    ``requires_grad``, in every module that holds them, so ties survive. Seeds the global
    generator and leaves it where the serial build leaves it.
    """
    holders: dict[int, list[tuple[nn.Module, str]]] = {}
    for module in model.modules():
        for attr, p in module._parameters.items():
            if p is not None:
                holders.setdefault(id(p), []).append((module, attr))
    for name, full in serial_leaves(model, seed, keep):
        place_leaf_(model, name, full, device, holders=holders)
    return model


def place_leaf_(model: nn.Module, name: str, full: nn.Module, device: torch.device | str, *,
                holders: dict[int, list[tuple[nn.Module, str]]] | None = None) -> None:
    """Put the values of ``full`` (a leaf from :func:`serial_leaves`) into ``model``'s meta leaf ``name`` on
    ``device``: new parameters carrying the old ones' attributes, set wherever the old ones were held."""
    leaf = model.get_submodule(name)
    if holders is None:
        holders = {}
        for module in model.modules():
            for attr, p in module._parameters.items():
                if p is not None:
                    holders.setdefault(id(p), []).append((module, attr))
    for (attr, old), (_, value) in zip(list(leaf.named_parameters(recurse=False)),
                                       full.named_parameters(recurse=False), strict=True):
        if not old.is_meta:
            continue  # a tied parameter already placed through another leaf
        new = nn.Parameter(value.detach().to(device), requires_grad=old.requires_grad)
        new.__dict__.update(old.__dict__)  # Megatron-style marks (tensor_model_parallel, sequence_parallel, ...)
        for module, held_as in holders.get(id(old), [(leaf, attr)]):
            module._parameters[held_as] = new
        holders[id(new)] = holders.pop(id(old), [(leaf, attr)])
