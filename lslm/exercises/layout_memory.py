"""Exercise of notebook 09: one device's memory by owner for a given layout, judged against the calculator.

The learner writes ``device_memory(psi, layout, layer_bytes, n_layer, m)``: the bytes that one device of
pipeline stage 0 holds, as a dict with the owners ``parameters``, ``gradients``, ``master_weights``,
``optimizer_states`` (on the device; what ZeRO-Offload moves to the host counts 0) and ``activations``. Given:

* ``psi``: the parameters this device holds before ZeRO shards anything (its stage, its tensor-parallel shard);
* ``layout``: a :class:`lslm.plan.Layout` (``dp``, ``tp``, ``pp``, ``cp``, ``zero``, ``offload``,
  ``precision``, ``grad_dtype``; always ``v = 1``, the 1F1B schedule);
* ``layer_bytes``: the activations one layer keeps for one micro-batch on this device (Korthikanti et al. 2022,
  with the layout's recomputation, sequence parallelism and tensor parallelism already applied);
* ``n_layer``: the model's layers; ``m``: micro-batches per step.

The reference is the calculator's own arithmetic: :func:`lslm.plan.states.model_states` (the ZeRO table of
:mod:`lslm.plan.states`, padding nil here: every case's ``psi`` divides by ``dp · cp``) and
:func:`lslm.plan.activations.in_flight_layers` times ``layer_bytes`` (stage 0 of 1F1B holds ``min(pp, m)``
micro-batches of ``L/pp`` layers). The stage's ends (embedding masks, the head's logits) are left out. The
checker runs six layouts of published models and names the first owner that differs, with a hint aimed at the
usual mistake for that owner.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

from lslm.exercises.core import Verdict, report, run_local
from lslm.exercises.registry import Exercise, register
from lslm.plan import Layout, ModelSpec, model_presets
from lslm.plan.activations import in_flight_layers, layer_activation_bytes
from lslm.plan.layout import microbatches
from lslm.plan.memory import stage_params
from lslm.plan.states import model_states

__all__ = ["CASES", "OWNERS", "calculator_answer", "cases", "check_device_memory", "reference_device_memory"]

OWNERS = ("parameters", "gradients", "master_weights", "optimizer_states", "activations")

#: (model preset, layout): the layouts the checker asks about (v = 1; psi divisible by dp · cp in each).
CASES: tuple[tuple[str, Layout], ...] = (
    ("llama3-8b", Layout(dp=8, zero=1, recompute="full")),
    ("llama3-8b", Layout(dp=2, tp=2, pp=2, zero=1, sequence_parallel=True, recompute="selective")),
    ("llama2-70b", Layout(dp=8, tp=8, pp=4, zero=1, sequence_parallel=True, recompute="selective")),
    ("gpt2-small", Layout(dp=4, zero=3, precision="fp32")),
    ("gpt2-small", Layout(dp=4, zero=2, offload="cpu")),
    ("llama3-8b", Layout(dp=4, pp=2, precision="fp16")),
)


def reference_device_memory(psi: int, layout: Layout, layer_bytes: float, n_layer: int, m: int) -> dict[str, float]:
    """Our solution: the ZeRO table (bytes per element p, g, k, Adam's 8; sharded over N = dp · cp from the
    stage that partitions the owner) and 1F1B's ``min(pp, m)`` micro-batches of ``L/pp`` layers on stage 0."""
    n = layout.dp * layout.cp
    p = 4 if layout.precision == "fp32" else 2
    g = 4 if layout.grad_dtype == "fp32" else p  # lslm and Megatron accumulate into an fp32 main_grad
    k = 0 if layout.precision == "fp32" else 4  # fp32 training: the parameters are the masters
    if layout.offload == "cpu":  # masters and Adam's moments live on the host
        k = adam = 0
    else:
        adam = 8
    z = layout.zero
    return {"parameters": p * psi / (n if z >= 3 else 1),
            "gradients": g * psi / (n if z >= 2 else 1),
            "master_weights": k * psi / (n if z >= 1 else 1),
            "optimizer_states": adam * psi / (n if z >= 1 else 1),
            "activations": min(layout.pp, m) * (n_layer / layout.pp) * layer_bytes}


@functools.lru_cache(maxsize=1)
def cases() -> tuple[tuple[str, ModelSpec, Layout, dict[str, Any]], ...]:
    """``(label, model, layout, arguments of device_memory)`` for every case of :data:`CASES`."""
    presets = model_presets()
    out = []
    for name, layout in CASES:
        model = presets[name]
        args = {"psi": stage_params(model, layout, 0), "layout": layout,
                "layer_bytes": layer_activation_bytes(model, layout, mask_bytes=1), "n_layer": model.n_layer,
                "m": microbatches(model, layout)}
        out.append((f"{model.name}, {layout.describe()}", model, layout, args))
    return tuple(out)


def calculator_answer(model: ModelSpec, layout: Layout, args: dict[str, Any]) -> dict[str, float]:
    """What :mod:`lslm.plan` says for one case: its model states on the device and stage 0's layer activations."""
    states = model_states(args["psi"], layout)
    answer = {owner: states.device[owner].value if owner in states.device else 0.0 for owner in OWNERS[:4]}
    answer["activations"] = in_flight_layers(model, layout, args["m"], 0) * args["layer_bytes"]
    return answer


HINTS = {
    "type": "return a dict with the five owners as keys and bytes (numbers) as values",
    "parameters": "parameters are 2 bytes each in bf16/fp16 and 4 in fp32, and only ZeRO stage 3 divides them "
                  "over the N = dp · cp ranks",
    "gradients": "lslm and Megatron accumulate gradients in an fp32 main_grad (4 bytes, grad_dtype='fp32') "
                 "whatever the parameters' precision; ZeRO stages 2 and 3 divide them over N = dp · cp",
    "master_weights": "fp32 master weights exist only when training in bf16/fp16 (4 bytes each); ZeRO stage 1 "
                      "and up divide them over N = dp · cp; with offload='cpu' they live on the host (0 on the "
                      "device)",
    "optimizer_states": "Adam keeps two fp32 moments: 8 bytes per parameter, divided over N = dp · cp from ZeRO "
                        "stage 1; with offload='cpu' they live on the host (0 on the device)",
    "activations": "in 1F1B the first stage holds min(pp, m) micro-batches in flight, each of L/pp layers, each "
                   "layer layer_bytes: min(pp, m) · (L/pp) · layer_bytes",
}


def _judge(fn: Callable[..., Any]) -> dict[str, Any]:
    for i, (label, model, layout, args) in enumerate(cases()):
        got = fn(**args)
        if not isinstance(got, dict) or set(got) != set(OWNERS) or not all(
                isinstance(v, int | float) and not isinstance(v, bool) for v in got.values()):
            return {"passed": False, "hint": HINTS["type"], "details": {"kind": "type", "case": i},
                    "message": f"case {i + 1} ({label}): got {got!r}, not a dict of the owners {OWNERS} to bytes"}
        want = calculator_answer(model, layout, args)
        for owner in OWNERS:
            if abs(got[owner] - want[owner]) > 0.5:
                return {"passed": False, "hint": HINTS[owner],
                        "details": {"kind": owner, "case": i, "expected": want[owner], "got": got[owner]},
                        "message": f"case {i + 1} ({label}): {owner}: the calculator says {want[owner]:,.0f} B, "
                                   f"you said {got[owner]:,.0f} B"}
    return {"passed": True, "message": f"every owner matches the calculator in all {len(cases())} layouts"}


def check_device_memory(fn: Callable[..., dict[str, float]]) -> Verdict:
    """Check the learner's ``device_memory(psi, layout, layer_bytes, n_layer, m)`` against :mod:`lslm.plan`;
    print the verdict (nothing is launched)."""
    return report(run_local(fn, _judge, exercise="device_memory"))


register(Exercise(
    name="device_memory", notebook="09_3d_parallelism", reference=reference_device_memory,
    check=check_device_memory,
    hints=("go owner by owner: bytes per element (parameters 2 or 4, gradients 4, masters 4 or 0, Adam 8), times "
           "psi, divided by N = dp · cp where the ZeRO stage partitions that owner (1: masters and optimizer, 2: "
           "also gradients, 3: also parameters); activations: how many layer-micro-batches stage 0 holds",
           "activations = min(pp, m) · (n_layer / pp) · layer_bytes; offload='cpu' leaves the masters and "
           "optimizer states at 0 on the device")))
