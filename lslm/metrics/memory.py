"""Memory accounting: one API that reads the same on a laptop CPU and on a GPU.

Three questions, three tools:

* **Model states** (:func:`model_state_bytes`): exact bytes held by parameters,
  gradients and optimizer states, counted as *unique storages* so that tied
  weights and views of one flat buffer count once. Device independent, so it
  is the number to compare with the ZeRO formulas
  (:func:`theory_model_state_bytes`) on any machine.
* **Activations** (:class:`ActivationMemory`): bytes of tensors that autograd
  saves for backward during a forward pass, read through
  ``torch.autograd.graph.saved_tensors_hooks``.
* **The process** (:func:`memory_report`): ``torch.cuda`` allocator statistics
  on CUDA, resident set size (RSS) of the process everywhere.

Counting rule for storages (used by everything here): a tensor is charged the
full ``nbytes`` of the storage it views, because that whole block stays
allocated while the tensor lives; a storage is charged once, identified by its
device and data pointer. DTensors are charged for their local shard.
"""

from __future__ import annotations

import dataclasses
import sys
from collections.abc import Hashable, Iterable, Iterator
from dataclasses import dataclass
from types import TracebackType
from typing import Any

import psutil
import torch
from torch import nn

try:  # A weak reference to a storage tells a freed-and-reused address from a live one.
    from torch.multiprocessing.reductions import StorageWeakRef
except ImportError:  # pragma: no cover - present in every torch this package supports
    StorageWeakRef = None  # type: ignore[assignment,misc]

_MIB = 1024**2
_OPTIMIZERS = ("adam", "adamw", "sgd", "sgd_momentum")


def format_bytes(n: float) -> str:
    """Format a byte count with binary units, e.g. ``1536 -> '1.50 KiB'``.

    Negative values (differences between two measurements) keep their sign.
    """
    sign = "-" if n < 0 else ""
    value = float(abs(n))
    if value < 1024:
        return f"{sign}{int(value)} B"
    for unit in ("KiB", "MiB", "GiB", "TiB"):
        value /= 1024
        if value < 1024 or unit == "TiB":
            break
    return f"{sign}{value:.2f} {unit}"


def _storage_local(t: torch.Tensor) -> torch.Tensor:
    """The tensor this rank actually holds (local shard for a DTensor)."""
    local = getattr(t, "_local_tensor", None)
    if isinstance(local, torch.Tensor):
        # Read the shard directly: to_local() is an autograd op, unwelcome inside a pack hook.
        return local
    if hasattr(t, "to_local"):
        with torch.no_grad():
            return t.to_local()
    return t


def _storage_of(t: torch.Tensor) -> tuple[Hashable, int, Any]:
    """Return ``(key, nbytes, storage_or_None)`` for the storage behind ``t``.

    The key identifies the storage so that views and aliases deduplicate.
    """
    t = _storage_local(t)  # DTensor: the memory on this rank is the local shard
    try:
        storage = t.untyped_storage()
        ptr = storage.data_ptr()
        nbytes = storage.nbytes()
    except (RuntimeError, NotImplementedError, TypeError):
        # Wrapper subclasses without a real storage: best effort, no dedupe possible.
        return ("id", id(t)), t.numel() * t.element_size(), None
    if ptr == 0:
        # Meta tensors and freed (resize_(0)) storages share address 0; they cannot
        # be told apart by address, so key on the tensor object instead.
        return ("id", id(t)), nbytes, None
    return (t.device, ptr), nbytes, storage


def _tensors_in(obj: Any) -> Iterator[torch.Tensor]:
    """Yield every tensor inside nested dicts/lists/tuples (optimizer state layout)."""
    if isinstance(obj, torch.Tensor):
        yield obj
    elif isinstance(obj, dict):
        for value in obj.values():
            yield from _tensors_in(value)
    elif isinstance(obj, (list, tuple)):
        for value in obj:
            yield from _tensors_in(value)


@dataclass(frozen=True)
class ModelStateBytes:
    """Bytes of model states, per category (measured or theoretical).

    ``total`` is params + grads + optimizer_states: the "model states" of the
    ZeRO paper. ``buffers`` (BatchNorm statistics, masks, rotary caches) is real
    memory but not part of that formula, so it is reported beside ``total``,
    not inside it. ``num_params`` counts elements, ``num_param_tensors`` counts
    parameter tensors (Adam keeps one ``step`` scalar per tensor).
    """

    params: int
    grads: int
    optimizer_states: int
    buffers: int = 0
    num_params: int = 0
    num_param_tensors: int = 0

    @property
    def total(self) -> int:
        """Params + grads + optimizer states (buffers excluded, see class doc)."""
        return self.params + self.grads + self.optimizer_states

    def to_dict(self) -> dict[str, int]:
        """Plain dict for JSON, ``total`` included."""
        return {**dataclasses.asdict(self), "total": self.total}

    def __str__(self) -> str:
        # Adaptive units: tiny course models would all read "0.00 MiB".
        return (
            f"params {format_bytes(self.params)}, grads {format_bytes(self.grads)}, "
            f"optimizer {format_bytes(self.optimizer_states)}, total {format_bytes(self.total)}"
        )


def model_state_bytes(
    model: nn.Module, optimizer: torch.optim.Optimizer | None = None
) -> ModelStateBytes:
    """Measure exact bytes of parameters, gradients and optimizer states.

    Rules:

    * Unique storages only: tied parameters and parameters that are views of
      one flat buffer count once, at the storage's full size.
    * Categories are filled in the order params, grads, optimizer_states,
      buffers; a storage shared between categories counts in the first one only.
    * Grads: ``p.grad`` of every parameter that has one.
    * Optimizer states: every tensor in ``optimizer.state`` — for Adam,
      ``exp_avg``, ``exp_avg_sq`` *and* the 0-d ``step`` tensor (float32, on the
      CPU unless ``capturable``/``fused``), because it is memory too. Parameters
      the optimizer owns that are not in ``model`` (fp32 master weights in mixed
      precision) count as optimizer states, as in ZeRO's accounting; their
      ``.grad`` counts as grads.
    * Buffers are reported in ``buffers`` and left out of ``total``.
    """
    seen: set[Hashable] = set()

    def count(tensors: Iterable[torch.Tensor]) -> int:
        total = 0
        for t in tensors:
            key, nbytes, _ = _storage_of(t)
            if key not in seen:
                seen.add(key)
                total += nbytes
        return total

    params = list(model.parameters())  # already unique by identity (tied weights once)
    owned = {id(p) for p in params}
    masters: list[torch.Tensor] = []
    state_tensors: list[torch.Tensor] = []
    if optimizer is not None:
        for group in optimizer.param_groups:
            for p in group["params"]:
                if id(p) not in owned:
                    owned.add(id(p))
                    masters.append(p)
        state_tensors = list(_tensors_in(list(optimizer.state.values())))

    param_bytes = count(params)
    grad_bytes = count(p.grad for p in params + masters if p.grad is not None)
    state_bytes = count(masters) + count(state_tensors)
    buffer_bytes = count(model.buffers())
    return ModelStateBytes(
        params=param_bytes,
        grads=grad_bytes,
        optimizer_states=state_bytes,
        buffers=buffer_bytes,
        num_params=sum(_storage_local(p).numel() for p in params),
        num_param_tensors=len(params),
    )


def theory_model_state_bytes(
    num_params: int,
    param_dtype: torch.dtype = torch.float32,
    optimizer: str | None = "adam",
    grads: bool = True,
    *,
    num_param_tensors: int = 0,
    master_weights: bool = False,
) -> ModelStateBytes:
    """Textbook model-state bytes for ``num_params`` (Ψ) parameters.

    With ``b`` the bytes per element of ``param_dtype`` and ``s`` the bytes per
    element the optimizer works in (``4`` with ``master_weights``, else ``b``)::

        params           = b·Ψ
        grads            = b·Ψ                      (0 if grads=False)
        optimizer_states = 0                        optimizer None or "sgd"
                         = s·Ψ                      "sgd_momentum" (momentum buffer)
                         = 2·s·Ψ + 4·T              "adam"/"adamw" (exp_avg, exp_avg_sq,
                                                     one float32 step scalar per tensor)
                         + 4·Ψ                      if master_weights (fp32 copy)

    ``T`` is ``num_param_tensors``; the step scalar is 8 bytes when the default
    dtype is float64, mirroring ``torch.optim``. Examples: fp32 Adam is
    4Ψ + 4Ψ + 8Ψ = 16Ψ; fp16 Adam with fp32 master weights is ZeRO's
    2Ψ + 2Ψ + 12Ψ = 16Ψ (K = 12). Master-weight gradients are assumed not kept.
    """
    if optimizer is not None and optimizer not in _OPTIMIZERS:
        raise ValueError(f"unknown optimizer {optimizer!r}; expected one of {_OPTIMIZERS} or None")
    if num_params < 0 or num_param_tensors < 0:
        raise ValueError("num_params and num_param_tensors must be >= 0")
    b = param_dtype.itemsize
    s = 4 if master_weights else b
    step_bytes = 8 if torch.get_default_dtype() == torch.float64 else 4
    states = 4 * num_params if master_weights else 0
    if optimizer == "sgd_momentum":
        states += s * num_params
    elif optimizer in ("adam", "adamw"):
        states += 2 * s * num_params + step_bytes * num_param_tensors
    return ModelStateBytes(
        params=b * num_params,
        grads=b * num_params if grads else 0,
        optimizer_states=states,
        num_params=num_params,
        num_param_tensors=num_param_tensors,
    )


class ActivationMemory:
    """Context manager counting bytes that autograd saves for backward.

    Usage::

        with ActivationMemory(model) as act:
            loss = model(x).sum()
        loss.backward()
        act.bytes, act.num_tensors

    Attributes: ``bytes`` (sum of unique saved storages, full storage size),
    ``num_tensors`` (saved tensors counted, including repeats of one storage),
    ``num_storages`` (unique storages). When ``model`` is given, storages of
    its parameters and buffers are excluded: they are model states, not
    activations (``nn.Linear`` saves its weight). They are snapshotted on
    entry, so parameters re-materialised during the forward (ZeRO-3 gathers)
    would count as activations.

    The pack hook returns the tensor unchanged, so backward and gradients are
    exactly as without the hook. ``checkpoint(use_reentrant=False)`` installs
    its own inner hooks: only what it keeps (each region's inputs) reaches this
    counter. Everything saved inside the block is summed, so two
    forward/backward passes give twice the bytes of one; a storage freed and its
    address reused counts again.
    """

    def __init__(self, model: nn.Module | None = None) -> None:
        """Prepare a counter; ``model``'s parameters and buffers are not counted."""
        self.model = model
        self.bytes = 0
        self.num_tensors = 0
        self.num_storages = 0
        self._seen: dict[Hashable, Any] = {}
        self._excluded: set[Hashable] = set()
        self._hooks: torch.autograd.graph.saved_tensors_hooks | None = None

    def __enter__(self) -> ActivationMemory:
        if self._hooks is not None:
            raise RuntimeError("ActivationMemory is already active; use a new instance to nest")
        self.bytes = self.num_tensors = self.num_storages = 0
        self._seen = {}
        self._excluded = set()
        if self.model is not None:
            for t in (*self.model.parameters(), *self.model.buffers()):
                self._excluded.add(_storage_of(t)[0])
        self._hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, _unpack)
        self._hooks.__enter__()
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        assert self._hooks is not None
        self._hooks.__exit__(exc_type, exc, tb)
        self._hooks = None

    def _pack(self, t: torch.Tensor) -> torch.Tensor:
        key, nbytes, storage = _storage_of(t)
        if key in self._excluded:
            return t
        self.num_tensors += 1
        if key in self._seen:
            ref = self._seen[key]
            # Same address and the earlier storage still alive: the same memory.
            if ref is None or not ref.expired():
                return t
        self._seen[key] = (
            StorageWeakRef(storage) if storage is not None and StorageWeakRef is not None else None
        )
        self.bytes += nbytes
        self.num_storages += 1
        return t  # returned as is, so autograd gets the very tensor it saved

    def __repr__(self) -> str:
        return (
            f"ActivationMemory(bytes={self.bytes} ({format_bytes(self.bytes)}), "
            f"num_tensors={self.num_tensors}, num_storages={self.num_storages})"
        )


def _unpack(t: torch.Tensor) -> torch.Tensor:
    """Unpack hook: the pack hook stored the tensor itself."""
    return t


def process_rss_bytes() -> int:
    """Current resident set size of this process, in bytes (psutil)."""
    return int(psutil.Process().memory_info().rss)


def peak_rss_bytes() -> int | None:
    """Peak resident set size of this process in bytes, or None where unknown.

    Reads ``getrusage(RUSAGE_SELF).ru_maxrss``: KiB on Linux, bytes on macOS;
    the ``resource`` module does not exist on Windows. It cannot be reset.
    The result is at least the current RSS.
    """
    try:
        import resource
    except ImportError:
        return None
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    peak = int(peak) if sys.platform == "darwin" else int(peak) * 1024
    # Linux keeps RSS in lazily synchronised per-thread counters, so ru_maxrss can
    # trail psutil's current RSS by a few hundred KiB; a peak below "now" is never right.
    return max(peak, process_rss_bytes())


@dataclass(frozen=True)
class MemoryReport:
    """A snapshot of memory, same fields on every device; inapplicable ones are None.

    ``allocated``/``peak_allocated``/``reserved`` come from the CUDA caching
    allocator and are None off CUDA. ``rss``/``peak_rss`` describe the host
    process on every device. ``model_state`` is None when no model was given.
    """

    device: str
    allocated: int | None = None
    peak_allocated: int | None = None
    reserved: int | None = None
    rss: int | None = None
    peak_rss: int | None = None
    model_state: ModelStateBytes | None = None

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready dict; ``model_state`` becomes a nested dict (or None)."""
        d = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        d["model_state"] = self.model_state.to_dict() if self.model_state is not None else None
        return d

    def __str__(self) -> str:
        def mib(n: int | None) -> str:
            return "n/a" if n is None else f"{n / _MIB:.1f} MiB"

        parts = [self.device]
        if self.allocated is not None:
            parts.append(
                f"allocated {mib(self.allocated)} (peak {mib(self.peak_allocated)}), "
                f"reserved {mib(self.reserved)}"
            )
        if self.model_state is not None:
            parts.append(f"model states: {self.model_state}")
        parts.append(f"RSS {mib(self.rss)} (peak {mib(self.peak_rss)})")
        return " | ".join(parts)


def memory_report(
    device: torch.device | str,
    model: nn.Module | None = None,
    optimizer: torch.optim.Optimizer | None = None,
) -> MemoryReport:
    """Snapshot memory on ``device``: CUDA allocator stats on CUDA, host RSS always.

    ``torch.cuda`` is called only when ``device.type == "cuda"``, so this runs on
    machines without CUDA. With ``model`` (and ``optimizer``), exact model-state
    bytes from :func:`model_state_bytes` are included on every device.
    """
    device = torch.device(device)
    allocated = peak_allocated = reserved = None
    if device.type == "cuda":
        allocated = torch.cuda.memory_allocated(device)
        peak_allocated = torch.cuda.max_memory_allocated(device)
        reserved = torch.cuda.memory_reserved(device)
    rss = process_rss_bytes()
    peak_rss = peak_rss_bytes()  # read after rss, and clamped to it, so peak >= rss
    return MemoryReport(
        device=str(device),
        allocated=allocated,
        peak_allocated=peak_allocated,
        reserved=reserved,
        rss=rss,
        peak_rss=None if peak_rss is None else max(peak_rss, rss),
        model_state=model_state_bytes(model, optimizer) if model is not None else None,
    )


def reset_peak_memory(device: torch.device | str) -> None:
    """Reset the peak counter where one can be reset (CUDA); a no-op elsewhere.

    The host's peak RSS (``ru_maxrss``) cannot be reset from inside a process.
    """
    device = torch.device(device)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
