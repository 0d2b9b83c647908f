"""Who owns which tensor: the memory categories, the ``memory_owners()`` protocol and a registry.

Categories, in the order of the ZeRO paper (Rajbhandari et al. 2020, §3.1 "model
states": parameters, gradients, optimizer states; §3.2 "residual states":
activations, temporary buffers) with the two mixed-precision extras in between:

==================  ===============================================================
``parameters``      the model's parameters (fp16/bf16 in mixed precision)
``gradients``       their ``.grad``, or a gradient buffer in their own dtype (``main_grad``)
``master_weights``  fp32 copies the optimizer updates (parameters it holds that the
                    model does not); ZeRO counts them in its K = 12 "optimizer states"
``main_grads``      fp32 gradients of those copies (``master.grad``) or a Megatron-style
                    fp32 ``param.main_grad`` buffer of half-precision parameters
``optimizer_states`` what ``optimizer.state`` holds: Adam's ``exp_avg``, ``exp_avg_sq``
                    and ``step``, SGD's momentum buffer
``module_buffers``  ``model.buffers()`` (BatchNorm statistics, masks): not model states
``comm_buffers``    flat buffers a wrapper keeps for communication (DDP buckets, fusion
                    buffers, ZeRO gather buffers)
``activations``     what autograd saves for backward
``other``           anything else an owner wants counted
==================  ===============================================================

So mixed-precision Adam reads 2 + 2 + 4 + (4 + 4) = 16 bytes per parameter
(parameters, gradients, master_weights, optimizer_states), ZeRO's 2Ψ + 2Ψ + KΨ.

**Precedence.** A storage is counted once, in full, in the *first* category of
:data:`CATEGORIES` under which any tensor viewing it is registered: a gradient that is
a view of a DDP bucket (torch's ``gradient_as_bucket_view``) counts as a gradient, the
bucket then costs nothing extra, which is the truth about memory.

**Protocol.** An object that keeps tensors alive reports them through
``memory_owners() -> {category: [tensors]}`` (the DDP wrappers do); the report
(:func:`lslm.metrics.memory_by_owner`) collects it from the model, the optimizer and
any number of owners. :class:`MemoryRegistry` is a ready-made holder for it: no
module-level state, each owner keeps its own.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

import torch
from torch import nn

from lslm.metrics.storage import tensors_in

CATEGORIES = ("parameters", "gradients", "master_weights", "main_grads", "optimizer_states", "module_buffers",
              "comm_buffers", "activations", "other")


@runtime_checkable
class MemoryOwner(Protocol):
    """Anything that reports the tensors it keeps alive, by category (see :data:`CATEGORIES`)."""

    def memory_owners(self) -> Mapping[str, Iterable[torch.Tensor]]:
        """``{category: tensors}``: the tensors this object owns, views included (they dedupe)."""
        ...


def check_category(category: str) -> str:
    """Return ``category`` if it is one of :data:`CATEGORIES`, else raise ``ValueError`` listing them."""
    if category not in CATEGORIES:
        raise ValueError(f"unknown memory category {category!r}; expected one of {CATEGORIES}")
    return category


@dataclass(frozen=True)
class MemoryEntry:
    """One registration: ``category``, the ``tensor`` and a free-text ``label`` (e.g. ``"bucket 3"``)."""

    category: str
    tensor: torch.Tensor
    label: str = ""


class MemoryRegistry:
    """Tensors an owner registers by category; it implements :class:`MemoryOwner`.

    Held by the object that owns the memory (a DDP wrapper keeps one as
    ``self.memory_registry``), never a global. It holds references, so register what the
    owner keeps alive anyway and :meth:`remove` what it drops. A storage freed in place
    (``t.untyped_storage().resize_(0)``, ZeRO-3) needs no update: it then reads 0 bytes
    resident and its full logical size.
    """

    def __init__(self) -> None:
        """An empty registry."""
        self._entries: list[MemoryEntry] = []

    def register(self, category: str, tensor: torch.Tensor, label: str = "") -> torch.Tensor:
        """Record ``tensor`` under ``category``; returns the tensor, so ``buf = reg.register(..., zeros(n))`` reads."""
        if not isinstance(tensor, torch.Tensor):
            raise TypeError(f"register() takes a tensor, got {type(tensor).__name__}")
        self._entries.append(MemoryEntry(check_category(category), tensor, label))
        return tensor

    def register_all(self, category: str, tensors: Iterable[torch.Tensor], label: str = "") -> None:
        """Record every tensor of ``tensors`` under ``category`` with one ``label``."""
        for t in tensors:
            self.register(category, t, label)

    def remove(self, label: str) -> int:
        """Forget every entry with ``label``; returns how many were removed."""
        before = len(self._entries)
        self._entries = [e for e in self._entries if e.label != label]
        return before - len(self._entries)

    def clear(self) -> None:
        """Forget every entry."""
        self._entries.clear()

    @property
    def entries(self) -> list[MemoryEntry]:
        """A copy of the registrations, in order."""
        return list(self._entries)

    def memory_owners(self) -> dict[str, list[torch.Tensor]]:
        """``{category: [tensors]}`` of everything registered (categories without tensors left out)."""
        out: dict[str, list[torch.Tensor]] = {}
        for e in self._entries:
            out.setdefault(e.category, []).append(e.tensor)
        return out

    def __len__(self) -> int:
        return len(self._entries)

    def __repr__(self) -> str:
        counts = {c: len(ts) for c, ts in self.memory_owners().items()}
        return f"MemoryRegistry({counts})"


def _owned(obj: Any, who: str) -> Iterator[tuple[str, torch.Tensor]]:
    """The ``(category, tensor)`` pairs ``obj.memory_owners()`` reports, checked."""
    report = obj.memory_owners()
    if not isinstance(report, Mapping):
        raise TypeError(f"{who}.memory_owners() must return a mapping {{category: [tensors]}}, "
                        f"got {type(report).__name__}")
    for category, tensors in report.items():
        if category not in CATEGORIES:
            raise ValueError(f"{who}.memory_owners() reported unknown category {category!r}; "
                             f"expected one of {CATEGORIES}")
        for t in tensors_in(list(tensors) if not isinstance(tensors, torch.Tensor) else tensors):
            yield category, t


def collect_owned(model: nn.Module | None = None, optimizer: Any = None,
                  owners: Iterable[Any] = ()) -> list[tuple[str, torch.Tensor]]:
    """Every ``(category, tensor)`` the model, the optimizer and the owners hold (duplicates kept).

    * ``model``: ``parameters()``, their ``.grad`` (gradients) and ``.main_grad`` if set
      (main_grads), ``buffers()`` (module_buffers), and ``model.memory_owners()`` if it has
      one (a DDP wrapper passed as the model thus brings its buckets).
    * ``optimizer`` (a ``torch.optim.Optimizer``): parameters it updates that ``model``
      does not hold are master weights, their ``.grad`` main grads (with no ``model``
      they are plain parameters and gradients); every tensor in ``optimizer.state`` is
      an optimizer state (the 0-d ``step`` tensors included); plus its
      ``memory_owners()`` if it has one.
    * ``owners``: anything with ``memory_owners()`` (:class:`MemoryOwner`).
    """
    pairs: list[tuple[str, torch.Tensor]] = []
    model_params: set[int] = set()
    if model is not None:
        for p in model.parameters():
            model_params.add(id(p))
            pairs.append(("parameters", p))
            if p.grad is not None:
                pairs.append(("gradients", p.grad))
            main_grad = getattr(p, "main_grad", None)
            if isinstance(main_grad, torch.Tensor):
                # A buffer in the parameter's own dtype holds the gradient itself (fp32 training); a wider one is
                # Megatron's fp32 main_grad. Views of one buffer share its storage: counted once, padding included.
                pairs.append(("gradients" if main_grad.dtype == p.dtype else "main_grads", main_grad))
        pairs.extend(("module_buffers", b) for b in model.buffers())
        if isinstance(model, MemoryOwner):
            pairs.extend(_owned(model, type(model).__name__))
    if optimizer is not None:
        for group in getattr(optimizer, "param_groups", []):
            for p in group["params"]:
                if id(p) in model_params:
                    continue
                master = model is not None
                pairs.append(("master_weights" if master else "parameters", p))
                if p.grad is not None:
                    pairs.append(("main_grads" if master else "gradients", p.grad))
        state = getattr(optimizer, "state", None)
        if isinstance(state, Mapping):
            pairs.extend(("optimizer_states", t) for t in tensors_in(list(state.values())))
        if isinstance(optimizer, MemoryOwner):
            pairs.extend(_owned(optimizer, type(optimizer).__name__))
    for i, owner in enumerate(owners):
        if not isinstance(owner, MemoryOwner):
            raise TypeError(f"owners[{i}] ({type(owner).__name__}) has no memory_owners() method: pass objects "
                            "that report {category: [tensors]}, e.g. a DDP wrapper or a MemoryRegistry")
        pairs.extend(_owned(owner, type(owner).__name__))
    return pairs
