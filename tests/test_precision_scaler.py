"""lslm.precision.scaler: GradScaler's trajectory, DeepSpeed's hysteresis and floor, skipped steps, ranks agreeing.

The expected trajectories in the hysteresis tests were worked out by hand from the
rule in the module doc, and agree with DeepSpeed's own ``DynamicLossScaler`` (0.16.0
for ``growth_rule="gradscaler"``, 0.19.8 for ``"deepspeed"``), which was run once on
these sequences and on 3000 random ones outside this suite (DeepSpeed is not a
dependency).
"""

from __future__ import annotations

import copy
import functools
import math
from typing import Any

import pytest
import torch
from torch import nn

from lslm.precision import OVERFLOW_LABEL, DynamicLossScaler, LossScaleAtMinimumError, nonfinite_flag
from lslm.precision.modes import prepare_precision
from tests.helpers import backends, run_workers

X, C = True, False  # an overflowing step (X), a clean one (C)


def _trajectory(scaler: DynamicLossScaler, pattern: list[bool]) -> list[tuple[float, int]]:
    out = []
    for overflow in pattern:
        scaler.update(overflow)
        out.append((scaler.scale, scaler.cur_hysteresis))
    return out


def _backs_off_and_grows(scales: list[float]) -> bool:
    steps = list(zip(scales, scales[1:]))
    return any(b < a for a, b in steps) and any(b > a for a, b in steps)


# -- (a) equal to torch.amp.GradScaler with hysteresis 1 and no floor ------------------------------------

GRADSCALER_PATTERN = [C, X, C, C, C, X, X, C, C, C, C, C, C, X, C, X, C, C, C, C, C, C, C, X, X, X, C, C, C, C]
INJECTED = [float("inf"), float("nan"), float("-inf")]


def _tiny() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 3))


def _drive(step_fn, model: nn.Module, opt: torch.optim.Optimizer, scale_loss) -> list[torch.Tensor]:
    """Run GRADSCALER_PATTERN: backward of the scaled loss, inject on overflow steps, call step_fn."""
    params = []
    for i, overflow in enumerate(GRADSCALER_PATTERN):
        opt.zero_grad()
        x = torch.randn(5, 6, generator=torch.Generator().manual_seed(i))
        scale_loss(model(x).square().mean()).backward()
        if overflow:
            model[2].weight.grad[1, 2] = INJECTED[i % 3]
        params.append(step_fn(i))
    return params


@pytest.mark.parametrize("min_scale", [None, 0.0])
def test_trajectory_equals_gradscaler(min_scale: float | None) -> None:
    torch_model, our_model = _tiny(), _tiny()
    torch_opt = torch.optim.SGD(torch_model.parameters(), lr=0.05)
    our_opt = torch.optim.SGD(our_model.parameters(), lr=0.05)
    gs = torch.amp.GradScaler("cpu", init_scale=2.0**10, growth_factor=2.0, backoff_factor=0.5, growth_interval=3)
    ours = DynamicLossScaler(2.0**10, growth_factor=2.0, backoff_factor=0.5, growth_interval=3, hysteresis=1,
                             min_scale=min_scale)
    torch_scales: list[float] = []
    our_scales: list[float] = []

    def torch_step(_: int) -> list[torch.Tensor]:
        gs.step(torch_opt)
        gs.update()
        torch_scales.append(float(gs.get_scale()))
        return [p.detach().clone() for p in torch_model.parameters()]

    def our_step(_: int) -> list[torch.Tensor]:
        ours.step(our_opt)
        our_scales.append(ours.scale)
        return [p.detach().clone() for p in our_model.parameters()]

    torch_params = _drive(torch_step, torch_model, torch_opt, gs.scale)
    our_params = _drive(our_step, our_model, our_opt, ours.scale_loss)
    assert our_scales == torch_scales
    assert _backs_off_and_grows(our_scales)
    # Same skipped steps and the same updates (powers of two unscale exactly): parameters bit-identical.
    for step, (a, b) in enumerate(zip(torch_params, our_params)):
        assert all(torch.equal(x, y) for x, y in zip(a, b)), f"parameters differ after step {step}"


# -- (b) hysteresis delays the backoff, as DeepSpeed's rule ---------------------------------------------

HYST_PATTERN = [X, X, C, C, C, X, C, X, X, C, C, C]


@pytest.mark.parametrize(("rule", "consecutive", "expected_scales", "expected_hyst"), [
    # Overflow 1 only spends hysteresis (2 -> 1); overflow 2 halves. Growth after 3 clean steps refills it.
    ("gradscaler", False, [64, 32, 32, 32, 64, 64, 64, 32, 16, 16, 16, 32], [1, 1, 1, 1, 2, 1, 1, 1, 1, 1, 1, 2]),
    # consecutive_hysteresis: any clean step refills it, so the isolated overflows at 5 and 7 never halve.
    ("gradscaler", True, [64, 32, 32, 32, 64, 64, 64, 64, 32, 32, 32, 64], [1, 1, 2, 2, 2, 1, 2, 1, 1, 2, 2, 2]),
    # DeepSpeed >= 0.18: the clean step right after an overflow does not count, so step 4 does not grow the
    # scale, hysteresis is not refilled, and the overflow at step 5 halves at once.
    ("deepspeed", False, [64, 32, 32, 32, 32, 16, 16, 8, 4, 4, 4, 4], [1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1]),
])
def test_hysteresis_delays_backoff(rule: str, consecutive: bool, expected_scales: list[int],
                                   expected_hyst: list[int]) -> None:
    scaler = DynamicLossScaler(64.0, growth_interval=3, hysteresis=2, min_scale=1.0,
                               consecutive_hysteresis=consecutive, growth_rule=rule)
    got = _trajectory(scaler, HYST_PATTERN)
    assert [s for s, _ in got] == expected_scales
    assert [h for _, h in got] == expected_hyst
    assert scaler.num_overflows == sum(HYST_PATTERN)


def test_hysteresis_one_and_no_floor_is_plain_halving() -> None:
    scaler = DynamicLossScaler(8.0, growth_interval=1000, hysteresis=1, min_scale=None)
    assert [s for s, _ in _trajectory(scaler, [X] * 5)] == [4, 2, 1, 0.5, 0.25]


def test_deepspeed_config_and_defaults() -> None:
    default = DynamicLossScaler()
    assert (default.scale, default.growth_interval, default.hysteresis, default.min_scale) == (2.0**16, 1000, 2, 1.0)
    ds = DynamicLossScaler.from_deepspeed_config({"initial_scale_power": 12, "loss_scale_window": 50,
                                                  "hysteresis": 3, "min_loss_scale": 2})
    assert (ds.scale, ds.growth_interval, ds.hysteresis, ds.min_scale, ds.growth_rule) == (4096, 50, 3, 2, "deepspeed")
    with pytest.raises(ValueError, match="static"):
        DynamicLossScaler.from_deepspeed_config({"loss_scale": 128})
    for bad in ({"init_scale": 0.0}, {"growth_interval": 0}, {"hysteresis": 0}, {"backoff_factor": 1.5},
                {"growth_factor": 1.0}, {"init_scale": 0.5, "min_scale": 1.0}, {"growth_rule": "fast"}):
        with pytest.raises(ValueError):
            DynamicLossScaler(**bad)


def test_state_dict_resumes_exactly() -> None:
    pattern = [X, C, C, X, C, C, C, C, X, C, C, C, C, C]
    full = DynamicLossScaler(256.0, growth_interval=2, hysteresis=2)
    expected = _trajectory(full, pattern)
    first = DynamicLossScaler(256.0, growth_interval=2, hysteresis=2)
    head = _trajectory(first, pattern[:5])
    resumed = DynamicLossScaler()
    resumed.load_state_dict(first.state_dict())
    assert head + _trajectory(resumed, pattern[5:]) == expected
    with pytest.raises(ValueError, match="missing"):
        resumed.load_state_dict({"scale": 1.0})


NAN = float("nan")


@pytest.mark.parametrize(("change", "message"), [
    # The constructor's checks and messages (one shared function), the scale named as the state names it.
    ({"scale": NAN}, r"scale must be a finite number > 0, got nan"),
    ({"scale": -4.0}, r"scale must be a finite number > 0, got -4.0"),
    ({"scale": math.inf}, r"scale must be a finite number > 0"),
    ({"min_scale": NAN}, r"min_scale must be >= 0 or None \(no floor\), got nan"),
    ({"min_scale": -1.0}, r"min_scale must be >= 0 or None"),
    ({"scale": 0.5, "min_scale": 1.0}, r"scale=0.5 is below min_scale=1.0"),
    ({"growth_factor": NAN}, r"growth_factor must be > 1"),
    ({"backoff_factor": 1.5}, r"backoff_factor must be in \(0, 1\)"),
    ({"growth_interval": 0}, r"growth_interval must be an int >= 1"),
    ({"hysteresis": 2.5}, r"hysteresis must be an int >= 1"),
    ({"growth_rule": "fast"}, r"growth_rule must be one of"),
    # ... and counters that update() can never produce.
    ({"cur_iter": -1}, r"cur_iter must be an int >= 0"),
    ({"cur_hysteresis": 0}, r"cur_hysteresis must be an int >= 1"),
    ({"cur_hysteresis": 3}, r"cur_hysteresis=3 exceeds hysteresis=2"),
    ({"last_overflow_iter": 5}, r"last_overflow_iter=5 must be below cur_iter=5"),
    ({"num_overflows": NAN}, r"num_overflows must be an int >= 0"),
])
def test_a_loaded_state_is_checked_like_constructor_arguments(change: dict[str, Any], message: str) -> None:
    source = DynamicLossScaler(256.0, growth_interval=2, hysteresis=2)
    _trajectory(source, [X, C, C, C, C])
    state = source.state_dict()
    target = DynamicLossScaler(64.0, growth_interval=7, hysteresis=3, min_scale=None)
    before = target.state_dict()
    with pytest.raises(ValueError, match=message):
        target.load_state_dict({**state, **change})
    assert target.state_dict() == before  # refused before changing anything
    target.load_state_dict(state)  # the unchanged state loads
    assert target.state_dict() == state


def test_constructor_and_loaded_state_refuse_with_the_same_message() -> None:
    for change, ctor in (({"min_scale": NAN}, {"min_scale": NAN}), ({"growth_factor": 0.5}, {"growth_factor": 0.5}),
                         ({"scale": NAN}, {"init_scale": NAN})):
        with pytest.raises(ValueError) as loaded:
            DynamicLossScaler().load_state_dict({**DynamicLossScaler().state_dict(), **change})
        with pytest.raises(ValueError) as built:
            DynamicLossScaler(**ctor)
        assert str(loaded.value) == str(built.value).replace("init_scale", "scale")


# -- (c) an injected inf/NaN skips the step and leaves everything bit-identical ---------------------------

def _snapshot(model: nn.Module, opt: torch.optim.Optimizer) -> tuple[list[torch.Tensor], dict]:
    return [p.detach().clone() for p in model.parameters()], copy.deepcopy(opt.state_dict())


def _same(a: tuple[list[torch.Tensor], dict], b: tuple[list[torch.Tensor], dict]) -> bool:
    params_equal = all(torch.equal(x, y) for x, y in zip(a[0], b[0]))
    sa, sb = a[1]["state"], b[1]["state"]
    states_equal = sa.keys() == sb.keys() and all(
        sa[k].keys() == sb[k].keys() and all(torch.equal(sa[k][n], sb[k][n]) for n in sa[k]) for k in sa)
    return params_equal and states_equal


@pytest.mark.parametrize("bad", [float("inf"), float("nan")])
def test_injected_overflow_skips_bit_identically(bad: float) -> None:
    model = _tiny()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    scaler = DynamicLossScaler(2.0**8, growth_interval=2, hysteresis=1)
    x = torch.randn(5, 6, generator=torch.Generator().manual_seed(0))

    def step(inject: bool) -> bool:
        opt.zero_grad()
        scaler.backward(model(x).square().mean())
        if inject:
            model[0].bias.grad[3] = bad
        return scaler.step(opt)

    assert step(False)  # Adam's state exists now
    before = _snapshot(model, opt)
    assert not step(True)
    assert _same(before, _snapshot(model, opt)), "a skipped step changed parameters or optimizer state"
    assert scaler.scale == 2.0**7  # halved
    assert step(False) and scaler.scale == 2.0**7  # one clean step: not yet
    assert step(False) and scaler.scale == 2.0**8  # growth_interval=2 clean steps: grows again
    assert not _same(before, _snapshot(model, opt))


def test_nonfinite_flag_checks_grads_of_parameters_and_tensors() -> None:
    p = nn.Parameter(torch.ones(3, dtype=torch.float16))
    assert nonfinite_flag([p]) is None  # no gradient yet: nothing to check
    p.grad = torch.tensor([1.0, 65504.0, -65504.0], dtype=torch.float16)
    assert nonfinite_flag([p]).item() == 0.0
    p.grad[1] = float("inf")
    assert nonfinite_flag([p]).item() == 1.0
    mixed = [torch.ones(4), torch.tensor([float("nan")], dtype=torch.bfloat16), torch.ones(2, dtype=torch.float16)]
    assert nonfinite_flag(mixed).item() == 1.0
    assert nonfinite_flag([torch.full((5,), -math.inf)]).item() == 1.0
    assert nonfinite_flag([torch.zeros(0), torch.full((2,), 3.0e38)]).item() == 0.0  # large but finite


# -- (d) two ranks, only rank 1 overflows: both skip, scales equal, as ShardedGradScaler --------------------

@functools.cache
def _suite(backend: str) -> tuple:
    return tuple(run_workers("lslm.demos.precision_ranks:suite", 2, backend=backend, timeout=180))


@pytest.mark.parametrize("backend", backends(2))
def test_ranks_skip_together_like_sharded_grad_scaler(backend: str) -> None:
    from lslm.demos.precision_ranks import INIT_SCALE, INJECT, STEPS

    results = _suite(backend)
    expected_stepped = [step not in INJECT for step in range(STEPS)]
    for r in results:
        for case in ("lslm", "torch", "master"):
            assert r[case]["stepped"] == expected_stepped, (r["rank"], case)
        # Same flag -> same rule -> same scale on every rank, and the same as torch's ShardedGradScaler.
        assert r["lslm"]["scales"] == r["torch"]["scales"] == r["master"]["scales"] == results[0]["lslm"]["scales"]
        assert _backs_off_and_grows([INIT_SCALE] + r["lslm"]["scales"])
        # Same model, data and skipped steps as torch: the same parameters, bit for bit.
        assert r["lslm"]["digest"] == r["torch"]["digest"]
        # One 4-byte fp32 MAX all-reduce over the world per step, labelled.
        assert r["lslm"]["records"] == [["all_reduce", 4, "float32", "world"]] * STEPS
        assert r["master"]["identical_when_skipped"] == [True] * len(INJECT)
        assert r["master"]["finite"]
    assert OVERFLOW_LABEL == "precision overflow"


# -- (e) "loss scale already at minimum", reproduced, and fixed by bf16 -------------------------------------

def test_raises_at_minimum_exactly_when_deepspeed_does() -> None:
    # hysteresis 2, floor 1: overflow 1 spends hysteresis, 2 halves 2 -> 1, 3 finds the scale at the floor.
    scaler = DynamicLossScaler(2.0, hysteresis=2, min_scale=1.0)
    assert _trajectory(scaler, [X, X]) == [(2.0, 1), (1.0, 1)]
    state = scaler.state_dict()
    with pytest.raises(LossScaleAtMinimumError, match="bf16"):
        scaler.update(True)
    assert scaler.state_dict() == state  # raised before changing anything
    # A scale that reaches the floor by clamping (3 -> max(1.5, 2) = 2) raises on the next overflow only.
    clamped = DynamicLossScaler(3.0, hysteresis=1, min_scale=2.0)
    clamped.update(True)
    assert clamped.scale == 2.0
    with pytest.raises(LossScaleAtMinimumError):
        clamped.update(True)
    # Without the error it keeps skipping at the floor; without a floor it never raises.
    quiet = DynamicLossScaler(2.0, hysteresis=1, min_scale=1.0, raise_error_at_min_scale=False)
    assert [s for s, _ in _trajectory(quiet, [X] * 4)] == [1.0, 1.0, 1.0, 1.0]


class _Blowup(nn.Module):
    """A model whose gradients exceed fp16's range at any scale >= 1: activations x 1e5."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return (self.lin(x) * 1e5).float().square().mean() / 1e10


def test_min_scale_failure_on_a_tiny_model_and_the_bf16_fix() -> None:
    x = torch.randn(8, 4, generator=torch.Generator().manual_seed(0))

    def run(mode: str, steps: int = 10) -> tuple[list[bool], object]:
        torch.manual_seed(0)
        model = _Blowup()
        kw = {"scaler": {"init_scale": 4.0, "hysteresis": 1, "min_scale": 1.0}} if mode == "fp16" else {}
        setup = prepare_precision(model, mode, lambda ps: torch.optim.AdamW(ps, lr=1e-3), **kw)
        stepped = []
        for _ in range(steps):
            setup.optimizer.zero_grad()
            setup.optimizer.backward(model(x.to(setup.param_dtype)))
            stepped.append(setup.optimizer.step())
        return stepped, setup

    with pytest.raises(LossScaleAtMinimumError) as info:
        run("fp16")  # 4 -> 2 -> 1 skipping every step, then the floor
    message = str(info.value)
    assert "already at its minimum" in message and "bf16" in message and "65504" in message
    stepped, setup = run("bf16")
    assert all(stepped)
    assert all(torch.isfinite(p).all() for p in setup.model.parameters())
