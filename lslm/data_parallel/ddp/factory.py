"""``make_ddp``: one entry point for every DDP variant, with the arguments checked first."""

from __future__ import annotations

from typing import Any

from torch import nn

from lslm.data_parallel.buckets import cap_bytes
from lslm.data_parallel.ddp.base import DDPBase
from lslm.data_parallel.ddp.bucketed import BucketedDDP
from lslm.data_parallel.ddp.fused import FusedDDP
from lslm.data_parallel.ddp.naive import NaiveDDP
from lslm.data_parallel.ddp.torch_ddp import TorchDDP

VARIANTS = ("naive", "fused", "bucketed", "torch")
_CLASSES: dict[str, type[DDPBase]] = {"naive": NaiveDDP, "fused": FusedDDP, "bucketed": BucketedDDP,
                                      "torch": TorchDDP}


def make_ddp(model: nn.Module, ctx: Any, variant: str = "bucketed", bucket_cap_mb: float = 25.0,
             broadcast_params: bool = True, find_unused_parameters: bool = False,
             record_timeline: bool = False) -> DDPBase:
    """Wrap ``model`` (already on ``ctx.device``) in the DDP ``variant`` over ``ctx.dp_group``.

    ``variant``: one of :data:`VARIANTS`. ``bucket_cap_mb`` (MiB, > 0) sizes the buckets
    of ``fused``, ``bucketed`` and ``torch`` (``naive`` has none, but the value is still
    checked). The other arguments are described in :mod:`lslm.data_parallel.ddp.base`.
    Bad arguments raise ``ValueError`` before any communication.
    """
    if variant not in VARIANTS:
        raise ValueError(f"unknown DDP variant {variant!r}; expected one of {VARIANTS}")
    cap_bytes(bucket_cap_mb)
    kwargs: dict[str, Any] = dict(broadcast_params=broadcast_params, find_unused_parameters=find_unused_parameters,
                                  record_timeline=record_timeline)
    if variant != "naive":
        kwargs["bucket_cap_mb"] = bucket_cap_mb
    return _CLASSES[variant](model, ctx, **kwargs)
