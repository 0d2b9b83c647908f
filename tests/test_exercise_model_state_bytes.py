"""Notebook 00's exercise: predictions of model-state bytes judged against measurement, in process."""

from __future__ import annotations

import pytest

from lslm.exercises.model_state_bytes import (
    check_predict_model_state_bytes,
    measured_cases,
    reference_predict_model_state_bytes,
)
from lslm.metrics import theory_model_state_bytes

PER_PARAM = {"sgd": 8, "sgd_momentum": 12, "adam": 16}


def predict_model_state_bytes(n_params, optimizer):
    return PER_PARAM[optimizer] * n_params


def predict_forgets_gradients(n_params, optimizer):
    return {"sgd": 4, "sgd_momentum": 8, "adam": 12}[optimizer] * n_params


def predict_adam_one_moment(n_params, optimizer):
    return {"sgd": 8, "sgd_momentum": 12, "adam": 12}[optimizer] * n_params


def predict_counts_elements(n_params, optimizer):
    return {"sgd": 2, "sgd_momentum": 3, "adam": 4}[optimizer] * n_params


def predict_no_optimizer_state(n_params, optimizer):
    return 8 * n_params


def predict_returns_text(n_params, optimizer):
    return f"{16 * n_params} bytes"


def predict_stub(n_params, optimizer):
    """Bytes of fp32 weights + gradients + optimizer state."""
    raise NotImplementedError


def test_measurement_is_what_theory_says() -> None:
    """The checker's ground truth: lslm.metrics' measurement equals the formula (Adam: + 4 B step per tensor)."""
    for _, optimizer, psi, total, steps in measured_cases():
        assert total - steps == theory_model_state_bytes(psi, optimizer=optimizer).total
        assert (steps > 0) == (optimizer == "adam")


def test_reference_and_a_plain_solution_pass(capsys) -> None:
    assert check_predict_model_state_bytes(reference_predict_model_state_bytes).passed
    assert check_predict_model_state_bytes(predict_model_state_bytes).passed
    assert capsys.readouterr().out.count("PASSED: your predictions match the measured bytes in all 9 cases") == 2


@pytest.mark.parametrize("candidate, kind, words", [
    (predict_forgets_gradients, "no_grads", "a .grad of its own"),
    (predict_adam_one_moment, "adam_one_moment", "two fp32 moments"),
    (predict_counts_elements, "numel_not_bytes", "counted elements"),
    (predict_no_optimizer_state, "no_optimizer_state", "state of its own"),
    (predict_returns_text, "type", "as an int"),
])
def test_each_mistake_gets_its_own_hint(candidate, kind, words) -> None:
    verdict = check_predict_model_state_bytes(candidate)
    assert verdict.state == "failed" and verdict.details["kind"] == kind, verdict
    assert words in verdict.hint


def test_the_message_shows_measured_and_predicted_bytes() -> None:
    verdict = check_predict_model_state_bytes(predict_adam_one_moment)
    assert verdict.message == ("nn.Linear(16, 8), Ψ = 136 parameters, 'adam': measured 2,176 bytes + 8 B of Adam "
                               "step counters left out; you predicted 1,632")


def test_a_stub_is_not_attempted(capsys) -> None:
    verdict = check_predict_model_state_bytes(predict_stub)
    assert verdict.state == "not attempted"
    assert 'hint("predict_model_state_bytes")' in capsys.readouterr().out
