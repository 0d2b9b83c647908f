"""lslm.plan: how many devices, which layout, will it fit, how fast: a calculator traced to its formulas.

``estimate(model, layout, hardware) -> Estimate`` gives per-device memory by owner (parameters, gradients,
fp32 master weights, optimizer states, activations with and without recomputation, communication buffers;
the most loaded pipeline stage, embedding and head included), communication per step per axis (dp / ZeRO over
dp x cp, tp, pp, cp: ring attention or Ulysses), and a time per step with a roofline verdict per axis (the ring's:
does its key/value transfer hide under the block's attention) and the pipeline bubble.
``search(model, hardware, devices)`` ranks the layouts that fit by predicted step time.
``Estimate.table()`` gives printable rows, each with its formula and source. ``validate()`` puts the time model
next to the step times the TP, pipeline and ZeRO benches measured (``cpu-box`` hardware, :mod:`.calibrate`).

Modules, one job each: :mod:`.model` (the model and its batch), :mod:`.params` (parameter counts),
:mod:`.hardware` (devices and links, presets), :mod:`.layout` (parallel sizes and options, checked),
:mod:`.states` (model-state bytes, ZeRO), :mod:`.activations` (Korthikanti et al. 2022), :mod:`.autocast` (what
``torch.autocast`` keeps: ``Layout.mixed="autocast"``), :mod:`.memory` (a stage's peak), :mod:`.comm`
(collectives per axis), :mod:`.timing` (flops, step, rooflines), :mod:`.estimate`, :mod:`.search`, :mod:`.terms`
(a number with its formula), :mod:`.calibrate` (the cpu-box from committed measurements), :mod:`.validate`
(against the benches), :mod:`.validate_memory` (memory against the H200 runs), :mod:`.inputs` (bad
input refused before any work, naming the flag), :mod:`.long_context` (activations per
device against sequence length, TP+SP alone and with cp). Pure arithmetic: no processes,
no tensors; it reuses :mod:`lslm.metrics`' formulas (Korthikanti's layer bytes, the collectives' cost model).
"""

from lslm.plan.estimate import Estimate, estimate
from lslm.plan.hardware import Hardware, Link, hardware_presets
from lslm.plan.layout import Layout, check_layout
from lslm.plan.model import ModelSpec, model_presets
from lslm.plan.search import search, sizing_answers
from lslm.plan.validate import format_validation, validate

__all__ = ["Estimate", "Hardware", "Layout", "Link", "ModelSpec", "check_layout", "estimate", "format_validation",
           "hardware_presets", "model_presets", "search", "sizing_answers", "validate"]
