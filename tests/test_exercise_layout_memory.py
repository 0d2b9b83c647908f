"""Notebook 09's exercise: one device's memory by owner, judged against lslm.plan, each wrong owner named."""

from __future__ import annotations

import pytest

from lslm.exercises import exercises
from lslm.exercises.layout_memory import (
    CASES,
    calculator_answer,
    cases,
    check_device_memory,
    reference_device_memory,
)
from lslm.plan import estimate, hardware_presets


def device_memory(psi, layout, layer_bytes, n_layer, m):
    n = layout.dp * layout.cp
    half = layout.precision != "fp32"
    host = layout.offload == "cpu"
    return {"parameters": (2 if half else 4) * psi / (n if layout.zero == 3 else 1),
            "gradients": 4 * psi / (n if layout.zero >= 2 else 1),
            "master_weights": 0 if host or not half else 4 * psi / (n if layout.zero else 1),
            "optimizer_states": 0 if host else 8 * psi / (n if layout.zero else 1),
            "activations": min(layout.pp, m) * n_layer // layout.pp * layer_bytes}


def _with(owner, value_fn):
    def fn(psi, layout, layer_bytes, n_layer, m):
        out = reference_device_memory(psi, layout, layer_bytes, n_layer, m)
        out[owner] = value_fn(psi, layout, layer_bytes, n_layer, m)
        return out
    return fn


def stub(psi, layout, layer_bytes, n_layer, m):
    """Bytes by owner on one device of stage 0."""
    raise NotImplementedError


def test_the_answer_is_the_calculators_own_table() -> None:
    """The checker's truth is what estimate() reports for the device: states equal, activations a part of it."""
    hw = hardware_presets()["h100-sxm"]
    for _, model, layout, args in cases():
        want = calculator_answer(model, layout, args)
        est = estimate(model, layout, hw)
        stage0 = est.stages[0]
        for owner in ("parameters", "gradients", "master_weights", "optimizer_states"):
            assert want[owner] == (stage0.owners[owner].value if owner in stage0.owners else 0.0), owner
        assert 0 < want["activations"] <= stage0.activations.value
    assert len(cases()) == len(CASES) >= 6


def test_reference_and_a_plain_solution_pass(capsys) -> None:
    assert check_device_memory(reference_device_memory).passed
    assert check_device_memory(device_memory).passed
    assert capsys.readouterr().out.count("PASSED: every owner matches the calculator in all 6 layouts") == 2


@pytest.mark.parametrize("candidate, owner, words", [
    (_with("gradients", lambda psi, lay, *_: 2 * psi / (lay.dp if lay.zero >= 2 else 1)), "gradients",
     "fp32 main_grad"),
    (_with("optimizer_states", lambda psi, *_: 8 * psi), "optimizer_states", "two fp32 moments"),
    (_with("master_weights", lambda psi, lay, *_: 4 * psi / (lay.dp if lay.zero else 1)), "master_weights",
     "only when training in bf16"),
    (_with("parameters", lambda psi, lay, *_: 2 * psi / lay.dp), "parameters", "only ZeRO stage 3"),
    (_with("activations", lambda psi, lay, lb, L, m: m * L / lay.pp * lb), "activations", "min(pp, m)"),
])
def test_each_wrong_owner_is_named(candidate, owner, words) -> None:
    verdict = check_device_memory(candidate)
    assert verdict.state == "failed" and verdict.details["kind"] == owner, verdict
    assert words in verdict.hint and f"{owner}: the calculator says" in verdict.message


def total_only(psi, layout, layer_bytes, n_layer, m):
    return 16 * psi


def test_a_wrong_type_and_a_stub() -> None:
    verdict = check_device_memory(total_only)
    assert verdict.state == "failed" and verdict.details["kind"] == "type"
    assert check_device_memory(stub).state == "not attempted"


def test_registered_for_notebook_09() -> None:
    ex = exercises()["device_memory"]
    assert ex.notebook == "09_3d_parallelism" and ex.check is check_device_memory and len(ex.hints) == 2
