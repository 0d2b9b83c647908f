"""Bad input to ``lslm plan`` refused before any work, each error naming the flag or field to change.

Three checks, in the order the command line runs them:

* :func:`check_arguments`: every number on the command line in its range and finite. Sizes (``--devices``,
  ``--tp``, ``--layers``, ...) are ints >= 1; rates and capacities (``--peak-tflops``, ``--hbm-gb``,
  ``--intra-gbps``, ``--inter-gbps``) finite and > 0; latencies (``--intra-alpha-us``, ``--inter-alpha-us``)
  finite and >= 0; ``--efficiency`` in (0, 1]. Without it ``--tp 0`` divides by zero, ``--devices -8`` is
  blamed on ``Layout.dp``, an infinite peak makes every step free of compute (MFU 0) and infinite memory lets
  GPT-3 fit on one device. The dataclasses refuse the same values (``Hardware``, ``Link``, ``Layout``), naming
  their fields, for callers of the Python API.
* :func:`check_weights_fit`: a model whose parameters alone, in the precision they are kept in and spread over
  every device, exceed one device's usable memory fits in no layout: no split shards a parameter over more than
  all the devices, and gradients, optimizer states and activations only add to it (a 100,000-layer model on
  one GPU is refused here, instead of a table that says "MFU 100 %" for a step that cannot run).
* :func:`lslm.plan.search.why_none_fit` says why a search found nothing: the batch, the heads or the layers do
  not divide over the device count, or every candidate is over memory (naming the closest).
"""

from __future__ import annotations

import argparse
import math
from typing import Any

from lslm.plan.hardware import Hardware
from lslm.plan.model import ModelSpec
from lslm.plan.params import param_parts
from lslm.plan.terms import format_bytes_gb

__all__ = ["FLOAT_FLAGS", "INT_FLAGS", "check_arguments", "check_weights_fit", "describe_flags",
           "weight_bytes_per_param"]

#: integer options (argparse ``dest``) that must be >= 1 when given
INT_FLAGS = ("devices", "dp", "tp", "pp", "v", "cp", "dp_shard", "layers", "hidden", "heads", "kv_heads", "ffn",
             "vocab", "seq", "micro_batch", "global_batch", "devices_per_node", "top")
#: float options and their open lower bound: rates and capacities > 0, latencies >= 0 (all finite)
FLOAT_FLAGS = {"peak_tflops": "> 0", "hbm_gb": "> 0", "intra_gbps": "> 0", "inter_gbps": "> 0",
               "intra_alpha_us": ">= 0", "inter_alpha_us": ">= 0"}


def _flag(dest: str) -> str:
    return "--" + dest.replace("_", "-")


def check_arguments(ns: argparse.Namespace) -> None:
    """Raise ``ValueError`` naming the first flag of ``ns`` (``lslm plan``'s options) out of range (module doc)."""
    for dest in INT_FLAGS:
        value = getattr(ns, dest, None)
        if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
            raise ValueError(f"{_flag(dest)} must be an int >= 1, got {value!r}")
    for dest, bound in FLOAT_FLAGS.items():
        value = getattr(ns, dest, None)
        if value is None:
            continue
        ok = math.isfinite(value) and (value > 0 if bound == "> 0" else value >= 0)
        if not ok:
            raise ValueError(f"{_flag(dest)} must be a finite number {bound}, got {value!r}")
    eff = getattr(ns, "efficiency", None)
    if eff is not None and not 0 < eff <= 1:
        raise ValueError(f"--efficiency is the fraction of peak reached: it must be in (0, 1], got {eff!r}")
    for cp in getattr(ns, "search_cp", None) or ():
        if cp < 1:
            raise ValueError(f"--search-cp sizes must be ints >= 1, got {cp!r}")


def weight_bytes_per_param(precision: str, mixed: str = "masters") -> int:
    """Bytes of one parameter as the step's weights keep it: 2 for half weights (``mixed="masters"``), 4 for
    fp32 or for fp32 weights under autocast (the least any layout keeps on the device, offload included)."""
    return 2 if precision in ("bf16", "fp16") and mixed == "masters" else 4


def check_weights_fit(model: ModelSpec, hardware: Hardware, devices: int, precision: str = "bf16",
                      mixed: str = "masters", flags: str = "--model or --layers/--hidden") -> None:
    """Raise ``ValueError`` when ``model``'s weights alone, sharded over all ``devices``, exceed one device's usable
    memory: then no layout fits (module doc). ``flags`` names what sets the model in the message."""
    n = param_parts(model).total
    width = weight_bytes_per_param(precision, mixed)
    per_device = n * width / devices
    if per_device > hardware.usable_bytes:
        name = "the model" if model.name == "custom" else model.name
        raise ValueError(
            f"{name}'s {n:,} parameters ({flags}) take {format_bytes_gb(n * width)} as {precision} weights "
            f"alone; even sharded over all {devices} devices (--devices) that is {format_bytes_gb(per_device)} "
            f"each, over the {format_bytes_gb(hardware.usable_bytes)} usable on a {hardware.name} (--hardware, "
            f"--hbm-gb), before any gradient, optimizer state or activation: no layout fits. Give at least "
            f"{math.ceil(n * width / hardware.usable_bytes):,} devices or a smaller model")


def describe_flags(ns: Any) -> str:
    """The flags that set the model in ``ns``, for messages (``--model llama3-8b`` or ``--layers 4 ...``)."""
    if getattr(ns, "model", None):
        parts = [f"--model {ns.model}"]
    else:
        parts = []
    for dest in ("layers", "hidden", "heads", "vocab", "ffn"):
        value = getattr(ns, dest, None)
        if value is not None:
            parts.append(f"{_flag(dest)} {value}")
    return " ".join(parts) or "the model"
