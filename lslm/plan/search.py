"""Which layouts fit a device count and a device's memory, ranked by predicted step time.

:func:`search` enumerates ``tp`` (divisors of the heads, at most one node), ``pp`` (divisors of the layers),
``v`` (virtual stages, interleaved), ``dp = devices / (tp · pp)``, the ZeRO stage, recomputation and the
micro-batch; sequence parallelism is on whenever ``tp > 1`` (it only saves memory at the same volume of
communication, Korthikanti et al. 2022 §4.2.2). Every candidate goes through :func:`lslm.plan.estimate`, so
each ranked answer carries the whole traced table; layouts that cannot run (a batch that does not split, an
interleaving that needs more micro-batches) are skipped, not reported.
"""

from __future__ import annotations

from collections.abc import Sequence

from lslm.plan.estimate import Estimate, estimate
from lslm.plan.hardware import Hardware
from lslm.plan.layout import Layout
from lslm.plan.model import ModelSpec

__all__ = ["search"]


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def search(model: ModelSpec, hardware: Hardware, devices: int, *, precision: str = "bf16",
           zero_stages: Sequence[int] = (0, 1, 2, 3), recompute: Sequence[str] = ("none", "selective", "full"),
           micro_batches: Sequence[int] = (1, 2, 4, 8), virtual_stages: Sequence[int] = (1, 2, 4),
           max_tp: int | None = None, flash_attention: bool = False, top: int = 10,
           fitting_only: bool = True) -> list[Estimate]:
    """The ``top`` layouts of ``model`` on ``devices`` devices of ``hardware``, fastest first (module doc).

    ``max_tp`` defaults to ``hardware.devices_per_node`` (tensor parallelism across nodes is rarely worth it,
    and the calculator would price it on the inter-node link). ``fitting_only=False`` also ranks layouts that
    do not fit (to see how far off they are). ``flash_attention``: every layout keeps no ``s^2`` tensors
    (what a fused attention kernel does; the paper's default, False, keeps them).
    """
    if isinstance(devices, bool) or not isinstance(devices, int) or devices < 1:
        raise ValueError(f"devices must be an int >= 1, got {devices!r}")
    if top < 1:
        raise ValueError(f"top must be >= 1, got {top}")
    max_tp = hardware.devices_per_node if max_tp is None else max_tp
    found: list[Estimate] = []
    for tp in _divisors(devices):
        if tp > max_tp or model.n_head % tp:
            continue
        for pp in _divisors(devices // tp):
            if model.n_layer % pp:
                continue
            dp = devices // (tp * pp)
            for mb in micro_batches:
                if model.global_batch % (dp * mb):
                    continue
                spec = model.with_batch(micro_batch=mb)
                for v in virtual_stages if pp > 1 else (1,):
                    for zero in zero_stages:
                        if zero and dp == 1:
                            continue  # ZeRO shards over data-parallel ranks: nothing to shard
                        for rc in recompute:
                            layout = Layout(dp=dp, tp=tp, pp=pp, v=v, zero=zero, sequence_parallel=tp > 1,
                                            recompute=rc, precision=precision, flash_attention=flash_attention)
                            try:
                                est = estimate(spec, layout, hardware, devices)
                            except ValueError:
                                continue  # this combination cannot run (module doc)
                            if est.fits or not fitting_only:
                                found.append(est)
    found.sort(key=lambda e: (e.step_s, e.peak_bytes))
    return found[:top]
