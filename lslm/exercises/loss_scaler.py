"""Exercise of notebook 07: the update rule of a dynamic loss scaler, step by step.

The learner writes ``update_scale(state, overflow, cfg)``: apply one step's outcome
(``overflow``: the gradients held an inf/NaN, so the step was skipped) to ``state``, in
place. ``state`` is ``{"scale", "good_steps", "hysteresis_left"}``; ``cfg`` is
``{"growth_factor", "backoff_factor", "growth_interval", "hysteresis", "min_scale"}``
(``min_scale=None``: no floor). The rule is :meth:`lslm.precision.DynamicLossScaler.update`
(DeepSpeed's, with ``growth_rule="gradscaler"``, ``consecutive_hysteresis=False``,
``raise_error_at_min_scale=False``):

* overflow: if ``hysteresis_left <= 1`` the scale is multiplied by ``backoff_factor`` but
  kept at or above ``min_scale``, else ``hysteresis_left`` drops by one; either way
  ``good_steps`` restarts at 0;
* clean step: ``good_steps += 1``; on reaching ``growth_interval`` the scale is multiplied by
  ``growth_factor``, ``good_steps`` restarts at 0 and ``hysteresis_left`` is refilled to
  ``cfg["hysteresis"]``.

With ``hysteresis=1`` and ``min_scale=None`` this is ``torch.amp.GradScaler``'s rule. The
state maps 1:1 onto the class: ``scale``, ``cur_hysteresis``, and ``good_steps`` =
``(cur_iter - last_overflow_iter - 1) % growth_interval``. A plain dict and a function keep
the cell short; the class is the same rule with counters suited to checkpoints.

The checker needs no processes: it replays scripted overflow patterns (a GradScaler-like
run, a DeepSpeed-like run with hysteresis 2 and a floor, and one that hits the floor) and
compares scale and state after every step with the reference. A mistake is named by
replaying known wrong rules (:data:`MISTAKES`) and finding the one whose trajectory is the
learner's. ``hysteresis_left`` of 0 and 1 are taken as equal: both mean "the next overflow
backs off", so decrementing before testing is accepted.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from lslm.exercises.core import Verdict, report, run_local
from lslm.exercises.registry import Exercise, register

State = dict[str, Any]
Snapshot = tuple[float, int, int]  # (scale, good_steps, hysteresis_left) after one step
KEYS = ("scale", "good_steps", "hysteresis_left")


def reference_update_scale(state: dict, overflow: bool, cfg: dict) -> None:
    """Our solution: back off (after the hysteresis, above the floor) on overflow, grow after enough clean steps."""
    if overflow:
        if state["hysteresis_left"] <= 1:  # the last overflow tolerated: back off
            state["scale"] *= cfg["backoff_factor"]
            if cfg["min_scale"] is not None:
                state["scale"] = max(state["scale"], cfg["min_scale"])
        else:  # tolerated: spend one unit of hysteresis, keep the scale
            state["hysteresis_left"] -= 1
        state["good_steps"] = 0  # the clean run is broken
    else:
        state["good_steps"] += 1
        if state["good_steps"] >= cfg["growth_interval"]:
            state["scale"] *= cfg["growth_factor"]
            state["good_steps"] = 0
            state["hysteresis_left"] = cfg["hysteresis"]


def initial_state(init_scale: float, cfg: dict) -> State:
    """The state before the first step: ``init_scale``, no clean steps yet, the full hysteresis."""
    return {"scale": float(init_scale), "good_steps": 0, "hysteresis_left": cfg["hysteresis"]}


# Plausible wrong rules, each the reference with one mistake; the checker replays them to name the learner's.
MISTAKES = ("no_reset", "no_hysteresis", "no_floor", "no_refill", "refill_on_backoff", "refill_on_clean",
            "grows_late", "no_reset_on_growth")


def mistaken_update_scale(state: State, overflow: bool, cfg: dict, mistake: str) -> None:
    """The reference rule with one of :data:`MISTAKES` in it."""
    if overflow:
        if state["hysteresis_left"] <= 1 or mistake == "no_hysteresis":
            state["scale"] *= cfg["backoff_factor"]
            if cfg["min_scale"] is not None and mistake != "no_floor":
                state["scale"] = max(state["scale"], cfg["min_scale"])
            if mistake == "refill_on_backoff":
                state["hysteresis_left"] = cfg["hysteresis"]
        else:
            state["hysteresis_left"] -= 1
        if mistake != "no_reset":
            state["good_steps"] = 0
    else:
        state["good_steps"] += 1
        if mistake == "refill_on_clean":
            state["hysteresis_left"] = cfg["hysteresis"]
        if state["good_steps"] > cfg["growth_interval"] - (mistake != "grows_late"):
            state["scale"] *= cfg["growth_factor"]
            if mistake != "no_reset_on_growth":
                state["good_steps"] = 0
            if mistake != "no_refill":
                state["hysteresis_left"] = cfg["hysteresis"]


@dataclass(frozen=True)
class Case:
    """One scripted run: ``pattern`` has one character per step, ``X`` an overflow, ``.`` a clean step."""

    label: str
    init_scale: float
    cfg: dict
    pattern: str


def _cfg(growth_interval: int, hysteresis: int, min_scale: float | None, backoff_factor: float = 0.5) -> dict:
    return {"growth_factor": 2.0, "backoff_factor": backoff_factor, "growth_interval": growth_interval,
            "hysteresis": hysteresis, "min_scale": min_scale}


CASES = (
    Case("GradScaler-like run (hysteresis 1, no floor)", 1024.0, _cfg(3, 1, None),
         ".X...XX......X.X.......XXX...."),
    Case("DeepSpeed-like run (hysteresis 2, min_scale 1)", 65536.0, _cfg(4, 2, 1.0),
         ".X..XX....X.XX.....X........X"),
    Case("run down to the floor (hysteresis 2, min_scale 3)", 64.0, _cfg(3, 2, 3.0, backoff_factor=0.25),
         "XXXXX...XXX...."),
)

HINTS = {
    "no_reset": "an overflow breaks the run of clean steps: set good_steps back to 0 on every overflow, "
                "or the scale grows again too soon after one",
    "no_hysteresis": "with hysteresis h the scale backs off only once hysteresis_left is down to 1; the "
                     "overflows before that only take one off hysteresis_left and leave the scale alone",
    "no_floor": "the scale never goes below cfg['min_scale'] (None means no floor): after backing off, "
                "raise the scale back to min_scale if it went below",
    "no_refill": "when the scale grows, refill hysteresis_left to cfg['hysteresis']: at the new scale the "
                 "scaler again tolerates hysteresis - 1 overflows before backing off",
    "refill_on_backoff": "backing off does not refill the hysteresis: hysteresis_left stays at 1, so until the "
                         "scale grows again every overflow backs off",
    "refill_on_clean": "refill hysteresis_left only when the scale grows, not on every clean step (that is "
                       "DeepSpeed's consecutive_hysteresis=True option, not the rule here)",
    "grows_late": "the scale grows on the growth_interval-th clean step itself: count the step first, then "
                  "compare good_steps with growth_interval",
    "no_reset_on_growth": "after growing, set good_steps back to 0: the next growth needs another "
                          "growth_interval clean steps",
    "overflow": "on an overflow: if hysteresis_left <= 1 multiply the scale by backoff_factor (not below "
                "min_scale), otherwise take one off hysteresis_left; good_steps goes back to 0",
    "clean": "on a clean step: one more good step; at growth_interval of them multiply the scale by "
             "growth_factor, set good_steps to 0 and refill hysteresis_left",
    "not_in_place": "change the dict you were given (state['scale'] = ...) and return nothing: the caller "
                    "keeps using its own state dict",
    "type": "keep the three entries of state, with a number in each (a Python float for the scale)",
}


class _Bad(Exception):
    """The learner's function broke the state or raised: ends the replay with a verdict."""

    def __init__(self, kind: str, text: str) -> None:
        super().__init__(text)
        self.kind, self.text = kind, text


def _where(case: Case, step: int, before: State) -> str:
    return (f"{case.label}, step {step + 1} of '{case.pattern[:step + 1]}' (X: overflow, .: clean); "
            f"to replay it: state = {before}, overflow = {case.pattern[step] == 'X'}, cfg = {case.cfg}")


def replay(fn: Callable[..., Any], case: Case) -> list[Snapshot]:
    """``fn`` applied to ``case``'s pattern from the initial state: the (scale, good_steps, hysteresis_left)
    after each step. Raises ``_Bad`` on an exception of ``fn`` or a broken state."""
    state = initial_state(case.init_scale, case.cfg)
    out = []
    for step, mark in enumerate(case.pattern):
        before = dict(state)
        try:
            returned = fn(state, mark == "X", dict(case.cfg))
        except NotImplementedError:
            raise
        except Exception as exc:  # noqa: BLE001 - the learner's error becomes the verdict
            raise _Bad("error", f"your function raised {type(exc).__name__}: {exc} ({_where(case, step, before)})") \
                from exc
        for key in KEYS:
            value = state.get(key)
            if isinstance(value, bool) or not isinstance(value, numbers.Real) or not math.isfinite(value):
                raise _Bad("type", f"state[{key!r}] is {value!r} after the step, not a finite number "
                                   f"({_where(case, step, before)})")
        if isinstance(returned, dict) and returned is not state and state == before:
            raise _Bad("not_in_place", f"your function returned a new dict and left state unchanged "
                                       f"({_where(case, step, before)})")
        out.append((float(state["scale"]), int(state["good_steps"]), max(int(state["hysteresis_left"]), 1)))
    return out


def _mistake_of(trajectories: list[list[Snapshot]]) -> str | None:
    """The mistake of :data:`MISTAKES` whose replay gives exactly ``trajectories``, if any."""
    for mistake in MISTAKES:
        def wrong(state: State, overflow: bool, cfg: dict, _m: str = mistake) -> None:
            mistaken_update_scale(state, overflow, cfg, _m)
        if [replay(wrong, c) for c in CASES] == trajectories:
            return mistake
    return None


def _judge(fn: Callable[..., Any]) -> dict[str, Any]:
    try:
        got = [replay(fn, c) for c in CASES]
    except _Bad as bad:
        return {"passed": False, "message": bad.text, "hint": HINTS[bad.kind], "details": {"kind": bad.kind}}
    for case, mine, ours in zip(CASES, got, [replay(reference_update_scale, c) for c in CASES]):
        for step, (g, w) in enumerate(zip(mine, ours)):
            if math.isclose(g[0], w[0], rel_tol=1e-9) and g[1:] == w[1:]:
                continue
            kind = _mistake_of(got) or ("overflow" if case.pattern[step] == "X" else "clean")
            before = dict(zip(KEYS, ours[step - 1])) if step else initial_state(case.init_scale, case.cfg)
            if not math.isclose(g[0], w[0], rel_tol=1e-9):
                diff = f"expected scale {w[0]:g}, got {g[0]:g}"
            else:
                key = "good_steps" if g[1] != w[1] else "hysteresis_left"
                i = KEYS.index(key)
                diff = f"scale {g[0]:g} as expected, but expected {key} {w[i]}, got {g[i]}"
            return {"passed": False, "message": f"{diff}: {_where(case, step, before)}", "hint": HINTS[kind],
                    "details": {"kind": kind, "case": case.label, "step": step + 1, "expected": w, "got": g}}
    steps = sum(len(c.pattern) for c in CASES)
    return {"passed": True, "message": f"your rule matches the reference scaler after every one of the {steps} "
                                       f"steps of {len(CASES)} runs (GradScaler-like, DeepSpeed-like, floor)"}


def check_update_scale(fn: Callable[[dict, bool, dict], None]) -> Verdict:
    """Check the learner's ``update_scale(state, overflow, cfg)`` against the reference rule; print the verdict.

    ``fn`` may be a tuple ``(update_scale, helper, ...)``; nothing is launched.
    """
    return report(run_local(fn, _judge, exercise="update_scale"))


register(Exercise(
    name="update_scale", notebook="07_mixed_precision", reference=reference_update_scale,
    check=check_update_scale,
    hints=("two branches: an overflow (maybe back off, and the run of clean steps is broken) and a clean step "
           "(count it, maybe grow); each touches the scale and the two counters",
           "hysteresis_left counts the overflows still tolerated at this scale: the scale backs off only when "
           "it is down to 1, and only a growth refills it; min_scale (unless None) is a floor for the back-off",
           "good_steps restarts at 0 on every overflow and on every growth; the scale grows on the clean step "
           "that brings good_steps to growth_interval")))
