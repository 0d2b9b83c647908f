"""Notebook 07's exercise: the dynamic loss scaler's update rule, judged in process against the reference."""

from __future__ import annotations

import itertools
import random

import pytest
import torch
from torch import nn

from lslm.exercises import hint, solution
from lslm.exercises.loss_scaler import (
    CASES,
    MISTAKES,
    check_update_scale,
    initial_state,
    mistaken_update_scale,
    reference_update_scale,
    replay,
)
from lslm.exercises.registry import exercises
from lslm.precision import DynamicLossScaler

# --- candidate solutions (module level: the checker reads their source to spot a stub) ---


def update_scale(state: dict, overflow: bool, cfg: dict) -> None:
    """Apply one step's outcome to the loss scale, in place (the stub the notebook shows)."""
    raise NotImplementedError


def update_scale_decrement_first(state, overflow, cfg):
    if overflow:
        state["hysteresis_left"] -= 1  # 0 and 1 both mean "the next overflow backs off": accepted
        if state["hysteresis_left"] <= 0:
            floor = cfg["min_scale"] if cfg["min_scale"] is not None else 0.0
            state["scale"] = max(state["scale"] * cfg["backoff_factor"], floor)
        state["good_steps"] = 0
        return
    state["good_steps"] += 1
    if state["good_steps"] == cfg["growth_interval"]:
        state.update(scale=state["scale"] * cfg["growth_factor"], good_steps=0, hysteresis_left=cfg["hysteresis"])


def update_scale_no_reset(state, overflow, cfg):
    if overflow:
        if state["hysteresis_left"] <= 1:
            state["scale"] = max(state["scale"] * cfg["backoff_factor"], cfg["min_scale"] or 0.0)
        else:
            state["hysteresis_left"] -= 1
    else:
        state["good_steps"] += 1
        if state["good_steps"] >= cfg["growth_interval"]:
            state.update(scale=state["scale"] * cfg["growth_factor"], good_steps=0, hysteresis_left=cfg["hysteresis"])


def update_scale_no_hysteresis(state, overflow, cfg):
    if overflow:
        state["scale"] = max(state["scale"] * cfg["backoff_factor"], cfg["min_scale"] or 0.0)
        state["good_steps"] = 0
    else:
        state["good_steps"] += 1
        if state["good_steps"] >= cfg["growth_interval"]:
            state.update(scale=state["scale"] * cfg["growth_factor"], good_steps=0, hysteresis_left=cfg["hysteresis"])


def update_scale_no_floor(state, overflow, cfg):
    if overflow:
        if state["hysteresis_left"] <= 1:
            state["scale"] *= cfg["backoff_factor"]
        else:
            state["hysteresis_left"] -= 1
        state["good_steps"] = 0
    else:
        state["good_steps"] += 1
        if state["good_steps"] >= cfg["growth_interval"]:
            state.update(scale=state["scale"] * cfg["growth_factor"], good_steps=0, hysteresis_left=cfg["hysteresis"])


def update_scale_no_refill(state, overflow, cfg):
    if overflow:
        if state["hysteresis_left"] <= 1:
            state["scale"] = max(state["scale"] * cfg["backoff_factor"], cfg["min_scale"] or 0.0)
        else:
            state["hysteresis_left"] -= 1
        state["good_steps"] = 0
    else:
        state["good_steps"] += 1
        if state["good_steps"] >= cfg["growth_interval"]:
            state.update(scale=state["scale"] * cfg["growth_factor"], good_steps=0)


def update_scale_grows_late(state, overflow, cfg):
    if overflow:
        if state["hysteresis_left"] <= 1:
            state["scale"] = max(state["scale"] * cfg["backoff_factor"], cfg["min_scale"] or 0.0)
        else:
            state["hysteresis_left"] -= 1
        state["good_steps"] = 0
    elif state["good_steps"] == cfg["growth_interval"]:  # compared before counting this step: one step late
        state.update(scale=state["scale"] * cfg["growth_factor"], good_steps=0, hysteresis_left=cfg["hysteresis"])
    else:
        state["good_steps"] += 1


def update_scale_tensor_scale(state, overflow, cfg):
    state["scale"] = torch.tensor(state["scale"] * (cfg["backoff_factor"] if overflow else 1.0))


def update_scale_key_error(state, overflow, cfg):
    state["good_step"] += 1


def update_scale_returns_new(state, overflow, cfg):
    new = dict(state)
    reference_update_scale(new, overflow, cfg)
    return new


WRONG = {  # candidate -> (kind, words of its hint)
    update_scale_no_reset: ("no_reset", "set good_steps back to 0 on every overflow"),
    update_scale_no_hysteresis: ("no_hysteresis", "only once hysteresis_left is down to 1"),
    update_scale_no_floor: ("no_floor", "never goes below cfg['min_scale']"),
    update_scale_no_refill: ("no_refill", "refill hysteresis_left to cfg['hysteresis']"),
    update_scale_grows_late: ("grows_late", "count the step first"),
    update_scale_tensor_scale: ("type", "a Python float for the scale"),
    update_scale_key_error: ("error", "run it by hand"),
    update_scale_returns_new: ("not_in_place", "return nothing"),
}


def test_reference_and_an_equivalent_solution_pass(capsys) -> None:
    assert check_update_scale(reference_update_scale).passed
    assert check_update_scale(update_scale_decrement_first).passed
    assert capsys.readouterr().out.count("PASSED: your rule matches the reference scaler after every one of the "
                                         "74 steps of 3 runs") == 2


@pytest.mark.parametrize("candidate", list(WRONG), ids=lambda f: f.__name__)
def test_each_mistake_gets_its_own_hint(candidate) -> None:
    kind, words = WRONG[candidate]
    verdict = check_update_scale(candidate)
    assert verdict.state == "failed" and verdict.details["kind"] == kind, verdict
    assert words in verdict.hint, verdict.hint


@pytest.mark.parametrize("mistake", MISTAKES)
def test_every_known_mistake_is_named(mistake) -> None:
    """The checker's own wrong rules are each caught and told apart from one another."""
    def wrong(state, overflow, cfg):
        mistaken_update_scale(state, overflow, cfg, mistake)
    wrong.__name__ = f"update_scale_{mistake}"
    verdict = check_update_scale(wrong)
    assert verdict.state == "failed" and verdict.details["kind"] == mistake, verdict


def test_the_message_names_the_first_differing_step() -> None:
    verdict = check_update_scale(update_scale_no_hysteresis)
    assert verdict.message == (
        "expected scale 65536, got 32768: DeepSpeed-like run (hysteresis 2, min_scale 1), step 2 of '.X' "
        "(X: overflow, .: clean); to replay it: state = {'scale': 65536.0, 'good_steps': 1, 'hysteresis_left': 2}, "
        "overflow = True, cfg = {'growth_factor': 2.0, 'backoff_factor': 0.5, 'growth_interval': 4, "
        "'hysteresis': 2, 'min_scale': 1.0}")
    assert verdict.details["step"] == 2 and str(verdict).startswith("NOT YET")
    state_only = check_update_scale(update_scale_no_reset)
    assert state_only.message.startswith("scale 512 as expected, but expected good_steps 0, got 1: "
                                         "GradScaler-like run (hysteresis 1, no floor), step 2 of '.X'")


def test_a_stub_is_not_attempted(capsys) -> None:
    verdict = check_update_scale(update_scale)
    assert verdict.state == "not attempted"
    assert capsys.readouterr().out == (
        'NOT ATTEMPTED YET: `update_scale` still raises NotImplementedError. Write it and run this cell again; '
        '`hint("update_scale")` for a hint, `solution("update_scale")` for ours.\n')


def test_registered_with_hints_and_solution(capsys) -> None:
    ex = exercises()["update_scale"]
    assert ex.notebook == "07_mixed_precision" and ex.check is check_update_scale and len(ex.hints) == 3
    hint("update_scale")
    solution("update_scale")
    out = capsys.readouterr().out
    assert out.startswith("hint 1: ") and "def reference_update_scale" in out


def test_the_cases_cover_hysteresis_floor_and_growth() -> None:
    for case in CASES:
        scales = [s for s, _, _ in replay(reference_update_scale, case)]
        steps = list(zip([case.init_scale, *scales], scales))
        assert any(b < a for a, b in steps) and any(b > a for a, b in steps), case.label
    floor = CASES[2]
    assert min(s for s, _, _ in replay(reference_update_scale, floor)) == floor.cfg["min_scale"]


# --- the reference is DynamicLossScaler's rule, and GradScaler's for hysteresis 1 without a floor ---

CONFIGS = [  # (growth_factor, backoff_factor, growth_interval, hysteresis, min_scale)
    (2.0, 0.5, 3, 1, None), (2.0, 0.5, 4, 2, 1.0), (2.0, 0.25, 2, 3, 3.0), (1.5, 0.5, 1, 2, 0.0),
    (2.0, 0.5, 5, 1, 2.0), (4.0, 0.125, 3, 4, None),
]


@pytest.mark.parametrize("config", CONFIGS, ids=str)
def test_reference_equals_dynamic_loss_scaler(config) -> None:
    growth, backoff, interval, hysteresis, min_scale = config
    cfg = {"growth_factor": growth, "backoff_factor": backoff, "growth_interval": interval,
           "hysteresis": hysteresis, "min_scale": min_scale}
    rng = random.Random(hash(config) % 2**32)
    for _ in range(300):
        init, p = 2.0 ** rng.randint(2, 16), rng.choice([0.05, 0.2, 0.5, 0.8])
        ours = initial_state(init, cfg)
        theirs = DynamicLossScaler(init, growth_factor=growth, backoff_factor=backoff, growth_interval=interval,
                                   hysteresis=hysteresis, min_scale=min_scale, raise_error_at_min_scale=False)
        for _ in range(rng.randint(1, 60)):
            overflow = rng.random() < p
            reference_update_scale(ours, overflow, cfg)
            theirs.update(overflow)
            good = (theirs.cur_iter - theirs.last_overflow_iter - 1) % interval
            assert (ours["scale"], ours["good_steps"], ours["hysteresis_left"]) == (
                theirs.scale, good, theirs.cur_hysteresis)


def test_reference_equals_torch_gradscaler() -> None:
    """GradScaler driven by real gradients, an inf injected on the overflow steps of the first case."""
    case = CASES[0]
    model = nn.Linear(3, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    gs = torch.amp.GradScaler("cpu", init_scale=case.init_scale, growth_factor=case.cfg["growth_factor"],
                              backoff_factor=case.cfg["backoff_factor"], growth_interval=case.cfg["growth_interval"])
    theirs = []
    for i, mark in enumerate(case.pattern):
        opt.zero_grad()
        gs.scale(model(torch.full((2, 3), float(i))).square().mean()).backward()
        if mark == "X":
            model.weight.grad[0, 1] = float("inf")
        gs.step(opt)
        gs.update()
        theirs.append(float(gs.get_scale()))
    assert [s for s, _, _ in replay(reference_update_scale, case)] == theirs
    assert len(set(theirs)) > 2


def test_known_mistakes_are_told_apart() -> None:
    """Each wrong rule leaves its own trace on the scripted runs, so classifying by replay is unambiguous."""
    traces = {"reference": [replay(reference_update_scale, c) for c in CASES]}
    for m in MISTAKES:
        traces[m] = [replay(lambda s, o, c, m=m: mistaken_update_scale(s, o, c, m), c) for c in CASES]
    assert all(traces[a] != traces[b] for a, b in itertools.combinations(traces, 2))
