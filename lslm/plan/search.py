"""Which layouts fit a device count and a device's memory, ranked by predicted step time.

:func:`search` enumerates ``tp`` (divisors of the heads, at most one node), ``cp`` (context parallelism, from
``context_parallel``: 1 by default, e.g. ``(1, 2, 4, 8)`` for long sequences; ring attention, or Ulysses where
``cp_methods`` includes it), ``pp`` (divisors of the device count that divide the layers,
or leave one or two layers short: then the first and last stages hold one fewer, :func:`uneven_stages`, without
interleaving), ``v`` (virtual stages, interleaved),
``dp = devices / (tp · cp · pp)``, the ZeRO stage, recomputation and the
micro-batch; sequence parallelism is on whenever ``tp > 1`` (it only saves memory at the same volume of
communication, Korthikanti et al. 2022 §4.2.2). Every candidate goes through :func:`lslm.plan.estimate`, so
each ranked answer carries the whole traced table; layouts that cannot run (a batch that does not split, an
interleaving that needs more micro-batches) are skipped, not reported, and so, unless asked for, are ZeRO-2/3
with pipeline parallelism (no framework runs them). :func:`sizing_answers` answers the course's questions
(:data:`SIZING_QUESTIONS`).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from lslm.plan.activations import core_keeps_scores
from lslm.plan.estimate import Estimate, estimate
from lslm.plan.hardware import Hardware
from lslm.plan.layout import Layout
from lslm.plan.model import ModelSpec, model_presets
from lslm.plan.terms import format_bytes_gb

__all__ = ["SIZING_QUESTIONS", "search", "sizing_answers", "uneven_stages", "why_none_fit"]

#: The course's sizing questions: a published model on a device count (our choice: GPT-3 on 1024 devices, the count
#: Narayanan et al. 2021 §5.1 size its training on; Llama-2 70B on 8 nodes; Llama-3 8B on one node of 8).
SIZING_QUESTIONS = {"gpt3-175b": 1024, "llama2-70b": 64, "llama3-8b": 8}


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def uneven_stages(n_layer: int, pp: int) -> tuple[int, ...] | None:
    """Layers per stage when ``n_layer`` does not divide over ``pp`` stages by one or two layers: ``ceil(L/p)``
    each, one fewer on the first stage and, if two short, on the last (as Llama 3 put 126 layers on 16 stages:
    the first holds the embedding and the most in-flight activations, the last the head and the loss); None when
    the layers divide evenly or more than two are missing."""
    per = -(-n_layer // pp)
    short = per * pp - n_layer
    if short == 0 or short > 2 or pp < short or per < 2:
        return None
    layers = [per] * pp
    layers[0] -= 1
    if short == 2:
        layers[-1] -= 1
    return tuple(layers)


def search(model: ModelSpec, hardware: Hardware, devices: int, *, precision: str = "bf16",
           zero_stages: Sequence[int] = (0, 1, 2, 3), recompute: Sequence[str] = ("none", "selective", "full"),
           micro_batches: Sequence[int] = (1, 2, 4, 8), virtual_stages: Sequence[int] = (1, 2, 4),
           max_tp: int | None = None, flash_attention: bool = False, zero_with_pp: bool = False, top: int = 10,
           fitting_only: bool = True, context_parallel: Sequence[int] = (1,),
           cp_methods: Sequence[str] = ("ring",), mixed: str = "masters") -> list[Estimate]:
    """The ``top`` layouts of ``model`` on ``devices`` devices of ``hardware``, fastest first (module doc).

    ``max_tp`` defaults to ``hardware.devices_per_node`` (tensor parallelism across nodes is rarely worth it,
    and the calculator would price it on the inter-node link). ``fitting_only=False`` also ranks layouts that
    do not fit (to see how far off they are). ``flash_attention``: every layout keeps no ``s^2`` tensors
    (what a fused attention kernel does; the paper's default, False, keeps them). ``zero_with_pp``: also try
    ZeRO-2/3 with pipeline parallelism, which DeepSpeed refuses and Megatron does not offer (their gradients,
    and stage 3's parameters, would cross the data-parallel group every micro-batch); off by default.
    ``context_parallel``: the ``cp`` sizes to try (each must divide the devices left after ``tp``);
    ``cp_methods``: ``"ring"`` and/or ``"ulysses"`` for ``cp > 1``; ``mixed``: ``Layout.mixed`` of every layout
    (``"autocast"``: torch.autocast over fp32 weights). Selective recomputation is not tried where
    the attention core keeps no ``s^2`` tensors (flash attention, ``cp > 1``): it would keep the bytes of
    none for more time (:mod:`lslm.plan.activations`).
    """
    if isinstance(devices, bool) or not isinstance(devices, int) or devices < 1:
        raise ValueError(f"devices must be an int >= 1, got {devices!r}")
    if top < 1:
        raise ValueError(f"top must be >= 1, got {top}")
    max_tp = hardware.devices_per_node if max_tp is None else max_tp
    cps = sorted(set(context_parallel))
    if not cps or any(isinstance(c, bool) or not isinstance(c, int) or c < 1 for c in cps):
        raise ValueError(f"context_parallel must list ints >= 1, got {tuple(context_parallel)!r}")
    found: list[Estimate] = []
    for tp in _divisors(devices):
        if tp > max_tp or model.n_head % tp:
            continue
        pairs = [(c, m) for c in cps if (devices // tp) % c == 0 for m in (cp_methods if c > 1 else ("ring",))]
        for cp, method in pairs:
            for pp in _divisors(devices // (tp * cp)):
                stages = uneven_stages(model.n_layer, pp)
                if model.n_layer % pp and stages is None:
                    continue
                dp = devices // (tp * cp * pp)
                for mb in micro_batches:
                    if model.global_batch % (dp * mb):
                        continue
                    spec = model.with_batch(micro_batch=mb)
                    for v in virtual_stages if pp > 1 and stages is None else (1,):
                        for zero in zero_stages:
                            if zero and dp * cp == 1:
                                continue  # ZeRO shards over data-parallel ranks: nothing to shard
                            if zero >= 2 and pp > 1 and not zero_with_pp:
                                continue
                            for rc in recompute:
                                layout = Layout(dp=dp, tp=tp, pp=pp, v=v, cp=cp, cp_method=method, zero=zero,
                                                sequence_parallel=tp > 1, recompute=rc, precision=precision,
                                                mixed=mixed, flash_attention=flash_attention,
                                                stage_layers=stages)
                                if rc == "selective" and not core_keeps_scores(layout, "none"):
                                    continue  # dominated by "none": the same bytes, more time
                                try:
                                    est = estimate(spec, layout, hardware, devices)
                                except ValueError:
                                    continue  # this combination cannot run (module doc)
                                if est.fits or not fitting_only:
                                    found.append(est)
    found.sort(key=lambda e: (e.step_s, e.peak_bytes))
    return found[:top]



def why_none_fit(model: ModelSpec, hardware: Hardware, devices: int, **options: Any) -> str:
    """Why :func:`search` with these arguments found no layout that fits: every candidate over memory (the one
    needing least memory named), or no candidate that can run at all, with the sizes that do not divide.

    ``options`` are :func:`search`'s keywords; this runs the search again, keeping layouts that do not fit.
    """
    options = {**options, "fitting_only": False, "top": 10**9}
    runnable = search(model, hardware, devices, **options)
    usable = format_bytes_gb(hardware.usable_bytes)
    if runnable:
        closest = min(runnable, key=lambda e: e.peak_bytes)
        return (f"every one of the {len(runnable)} layouts that run is over memory; the closest, "
                f"{closest.layout.describe()} with micro-batch {closest.model.micro_batch}, needs "
                f"{format_bytes_gb(closest.peak_bytes)} on its most loaded device, {usable} usable: give more "
                "devices, more memory, or a smaller model or batch")
    max_tp = options.get("max_tp") or hardware.devices_per_node
    tps = [t for t in _divisors(devices) if t <= max_tp and model.n_head % t == 0]
    cps = sorted(set(options.get("context_parallel", (1,))))
    dps = sorted({devices // (t * c * p) for t in tps for c in cps if (devices // t) % c == 0
                  for p in _divisors(devices // (t * c)) if model.n_layer % p == 0})
    mbs = tuple(options.get("micro_batches", (1, 2, 4, 8)))
    shown = ", ".join(map(str, dps[:8])) + (", ..." if len(dps) > 8 else "")
    return (f"none can run on {devices} devices: tp must divide the {model.n_head} heads (at most "
            f"{max_tp}, one node), pp the {model.n_layer} layers, leaving dp = devices / (tp x cp x pp) in "
            f"{{{shown}}}, and no dp x micro-batch (micro-batches {mbs}) divides the global batch of "
            f"{model.global_batch} sequences (or the sequence, {model.seq_len}, does not split). Use a device count "
            "that leaves a dp dividing the batch, or change the global batch")


def sizing_answers(hardware: Hardware, *, top: int = 3, flash_attention: bool | None = None,
                   **options: Any) -> dict[str, list[Estimate]]:
    """:data:`SIZING_QUESTIONS` answered on ``hardware``: each model's ``top`` layouts by :func:`search`
    (``options`` are its keywords). ``flash_attention=None``: Llama models with it (as they are trained), GPT
    models without (as Korthikanti et al. account them)."""
    presets = model_presets()
    answers = {}
    for name, devices in SIZING_QUESTIONS.items():
        model = presets[name]
        flash = model.arch == "llama" if flash_attention is None else flash_attention
        answers[name] = search(model, hardware, devices, flash_attention=flash, top=top, **options)
    return answers
