"""Single-process DataParallel: the ``torch.nn.DataParallel`` algorithm, written out.

One process drives ``n`` devices. Every forward call

1. **scatters** the batch: rows are split along dim 0, chunk ``i`` copied to device ``i``;
2. **replicates** the module: every parameter is broadcast from device 0 to every device;
3. **applies** replica ``i`` to chunk ``i``, one Python thread per replica;
4. **gathers** the outputs: concatenated along dim 0 on the output device (device 0 by default).

Backward is the same path in reverse, by autograd: the output gradient is
scattered back to the replicas, each replica back-propagates, and the
replicas' parameter gradients are reduce-added onto device 0, into the original
parameters' ``.grad``. Nothing persists between steps: the replicas are rebuilt
every call.

Its two classic problems, measured in :mod:`lslm.data_parallel.single_process.measure`:
threads share one GIL, and the output device holds every replica's outputs (for
a language model, ``B x T x V`` logits). The fix for the second is to compute
the loss inside each replica and gather only ``n`` scalars: pass
``parallel_criterion``.

The building blocks live beside this module: ``comm`` (the autograd Functions),
``replicate``, ``apply`` and ``ledger`` (byte counting); this module wires them up.
Reference: PyTorch docs, ``torch.nn.DataParallel`` and ``torch/nn/parallel/``
(``scatter_gather.py``, ``replicate.py``, ``parallel_apply.py``, ``_functions.py``).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from lslm.data_parallel.single_process.apply import ReplicaError, parallel_apply
from lslm.data_parallel.single_process.comm import Gather, Route, Scatter, chunk_sizes
from lslm.data_parallel.single_process.ledger import Place, TransferLedger
from lslm.data_parallel.single_process.replicate import replicate

__all__ = ["DataParallel", "ReplicaError", "TransferLedger", "chunk_sizes", "gather", "gpt_token_loss",
           "parallel_apply", "place_of", "replicate", "scatter", "to_devices"]


def to_devices(devices: Sequence[torch.device | str | int]) -> list[torch.device]:
    """Normalise a device list (``"cpu"``, ``"cuda:1"``, ``1``, ``torch.device``); raises on an empty list."""
    if isinstance(devices, (str, torch.device, int)) or not devices:
        raise ValueError(f"device_ids must be a non-empty list of devices, e.g. ['cpu', 'cpu'] or "
                         f"['cuda:0', 'cuda:1'], got {devices!r}")
    out = []
    for d in devices:
        d = torch.device(f"cuda:{d}") if isinstance(d, int) else torch.device(d)
        if d.type == "cuda" and d.index is None:  # only reached with CUDA devices
            d = torch.device("cuda", torch.cuda.current_device())
        out.append(d)
    return out


def place_of(device: torch.device, devices: Sequence[torch.device], default: Place) -> Place:
    """The first replica index whose device is ``device``, else ``default`` (``"host"``, ``"out"``)."""
    for i, d in enumerate(devices):
        if d == device:
            return i
    return default


def _tensors(obj: Any) -> list[torch.Tensor]:
    if isinstance(obj, torch.Tensor):
        return [obj]
    if isinstance(obj, (list, tuple)):
        return [t for o in obj for t in _tensors(o)]
    if isinstance(obj, dict):
        return [t for o in obj.values() for t in _tensors(o)]
    return []


def scatter(obj: Any, devices: Sequence[torch.device], sizes: Sequence[int], *,
            ledger: TransferLedger | None = None) -> list[Any]:
    """Split every tensor inside ``obj`` (nested tuples/lists/dicts) along dim 0 into ``sizes``; one copy of
    the structure per device. Non-tensor leaves are shared by reference. Autograd-aware (:class:`Scatter`)."""
    if isinstance(obj, torch.Tensor):
        if obj.dim() == 0 or obj.shape[0] != sum(sizes):
            raise ValueError(f"scatter: every tensor argument needs the batch size {sum(sizes)} as its first "
                             f"dimension, got shape {tuple(obj.shape)}")
        route = Route(tuple(devices), place_of(obj.device, devices, "host"), obj.device, ledger)
        return list(Scatter.apply(route, tuple(sizes), obj))
    if isinstance(obj, (list, tuple)):
        per_item = [scatter(o, devices, sizes, ledger=ledger) for o in obj]
        return [type(obj)(item[i] for item in per_item) for i in range(len(devices))]
    if isinstance(obj, dict):
        per_key = {k: scatter(v, devices, sizes, ledger=ledger) for k, v in obj.items()}
        return [{k: v[i] for k, v in per_key.items()} for i in range(len(devices))]
    return [obj for _ in devices]


def gather(outputs: Sequence[Any], output_device: torch.device, devices: Sequence[torch.device], *,
           ledger: TransferLedger | None = None) -> Any:
    """Concatenate the replicas' outputs along dim 0 onto ``output_device`` (autograd-aware, :class:`Gather`).

    ``outputs[i]`` is replica ``i``'s result: a tensor, ``None``, or a tuple/list/dict of
    those (all replicas the same structure). 0-dim tensors become a length-``n`` vector.
    """
    first = outputs[0]
    if isinstance(first, torch.Tensor):
        route = Route(tuple(devices), place_of(output_device, devices, "out"), output_device, ledger)
        return Gather.apply(route, *outputs)
    if first is None:
        return None
    if isinstance(first, (list, tuple)):
        return type(first)(gather([o[k] for o in outputs], output_device, devices, ledger=ledger)
                           for k in range(len(first)))
    if isinstance(first, dict):
        return {k: gather([o[k] for o in outputs], output_device, devices, ledger=ledger) for k in first}
    return first


def gpt_token_loss(output: Any, target: torch.Tensor) -> torch.Tensor:
    """Mean next-token cross-entropy of one replica, exactly as :class:`lslm.models.gpt.GPT` computes it.

    ``output`` is the model's ``(logits, loss)`` tuple or the logits ``(b, T, V)``; ``target`` is ``(b, T)``.
    """
    logits = output[0] if isinstance(output, (tuple, list)) else output
    return F.cross_entropy(logits.float().flatten(0, 1), target.flatten(), ignore_index=-100)


class DataParallel(nn.Module):
    """Run ``module`` on ``device_ids`` by splitting each batch along dim 0 (the nn.DataParallel algorithm).

    ``DataParallel(model, ["cpu", "cpu"])`` or ``(model, ["cuda:0", "cuda:1"])``; the module
    must live on ``device_ids[0]``. ``output_device`` (default ``device_ids[0]``) receives
    the gathered outputs. Every copy is recorded in ``self.ledger`` (it accumulates over
    calls: ``dp.ledger.clear()`` before a step to count that step alone).

    ``parallel_criterion``: a function ``(replica_output, target_chunk) -> scalar loss``.
    When given, call ``dp(*inputs, target=y)``: each replica computes its own loss, only the
    ``n`` scalars are gathered, and the result is combined on the output device —
    ``combine="mean"`` weights replica ``i`` by its share of rows ``b_i / B`` (equal to the
    full-batch mean when every row contributes equally many loss terms, true for
    fixed-length token blocks without ignored targets), ``combine="sum"`` adds them.

    ``threads=False`` runs the replicas one after the other (same numbers, no threads).
    """

    def __init__(self, module: nn.Module, device_ids: Sequence[torch.device | str | int],
                 output_device: torch.device | str | int | None = None, *,
                 parallel_criterion: Callable[[Any, Any], torch.Tensor] | None = None, combine: str = "mean",
                 threads: bool = True, ledger: TransferLedger | None = None) -> None:
        super().__init__()
        self.devices = to_devices(device_ids)
        self.output_device = self.devices[0] if output_device is None else to_devices([output_device])[0]
        if combine not in ("mean", "sum"):
            raise ValueError(f"combine must be 'mean' or 'sum', got {combine!r}")
        self.module = module
        self.parallel_criterion, self.combine, self.threads = parallel_criterion, combine, threads
        self.ledger = ledger if ledger is not None else TransferLedger()

    def forward(self, *inputs: Any, **kwargs: Any) -> Any:
        """Scatter, replicate, parallel-apply, gather. With ``parallel_criterion``, ``target=`` is required
        and the combined scalar loss is returned instead of the outputs."""
        target = kwargs.pop("target", None) if self.parallel_criterion is not None else None
        if self.parallel_criterion is not None and target is None:
            raise ValueError("DataParallel with parallel_criterion: call dp(*inputs, target=targets)")
        found = _tensors((inputs, kwargs))
        if not found:
            raise ValueError("DataParallel: no tensor among the inputs to split along dim 0")
        if found[0].dim() == 0:
            raise ValueError("DataParallel: the first tensor input is 0-dim; it needs a batch dimension")
        sizes = chunk_sizes(found[0].shape[0], len(self.devices))
        # One (args, kwargs, target) triple per replica; the targets travel with the inputs.
        args, kws, tgts = zip(*scatter((inputs, kwargs, target), self.devices, sizes, ledger=self.ledger))
        replicas = replicate(self.module, self.devices, ledger=self.ledger, detach=not torch.is_grad_enabled())
        if self.parallel_criterion is None:
            outputs = parallel_apply(replicas, list(args), list(kws), self.devices, threads=self.threads)
            return gather(outputs, self.output_device, self.devices, ledger=self.ledger)
        criterion = self.parallel_criterion

        def with_loss(replica: nn.Module, t: Any) -> Callable[..., torch.Tensor]:
            return lambda *a, **k: criterion(replica(*a, **k), t)

        losses = parallel_apply([with_loss(r, t) for r, t in zip(replicas, tgts)], list(args), list(kws),
                                self.devices, threads=self.threads)
        gathered = gather([loss.float() for loss in losses], self.output_device, self.devices,
                          ledger=self.ledger)
        if self.combine == "sum":
            return gathered.sum()
        weights = torch.tensor(sizes, dtype=gathered.dtype, device=gathered.device) / sum(sizes)
        return (gathered * weights).sum()
