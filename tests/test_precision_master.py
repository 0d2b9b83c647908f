"""lslm.precision.master / modes / bytes: half-precision training with fp32 masters, against fp32.

Model: the lslm GPT, 2 blocks, width 64, vocabulary 256, 16 tokens (133,888 parameters),
AdamW. fp16 runs on CPU here (slow per flop, fine at this size).

Tolerances, in units of the format's unit roundoff u (fp16: 2^-11 = 4.9e-4, bf16: 2^-8 =
3.9e-3, the largest relative rounding error of one rounding):

* Losses over 12 steps: |loss_half - loss_fp32| <= 2 u · loss_fp32 at every step. A
  forward in half precision rounds weights and activations, each by <= u relative; the
  loss, an average of many such terms, moves by a fraction of u·loss, and with fp32
  masters the updates themselves carry only that perturbation forward, so it stays of
  that order over a few steps (measured: <= 0.33 u·loss for both formats). Without
  masters (pure bf16) the same measure grows past 1.6 u·loss by step 20: the rounding of
  every update accumulates in the weights.
* Gradients: ||g_half - g_fp32|| <= 4 u ||g_fp32|| over all parameters. Each gradient
  passes through ~10 rounded matmuls, norms and activations whose errors add roughly in
  quadrature (measured: 1.55 u, with or without accumulation).
"""

from __future__ import annotations

import functools

import pytest
import torch

from lslm.models.gpt import GPT, GPTConfig
from lslm.precision import (
    CONVENTIONS,
    PRECISION_MODES,
    DynamicLossScaler,
    MixedPrecisionOptimizer,
    PlainOptimizer,
    bytes_per_param,
    check_precision,
    compare,
    prepare_precision,
)

CFG = GPTConfig.tiny(vocab_size=256, block_size=16, n_layer=2)
U = {"fp16": 2.0**-11, "bf16": 2.0**-8}
STEPS = 12
_DATA = torch.randint(0, 256, (4, 8, 17), generator=torch.Generator().manual_seed(5))


def _batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    tokens = _DATA[step % len(_DATA)]  # 4 batches cycled: the loss falls, so the comparison means something
    return tokens[:, :-1], tokens[:, 1:]


def _gpt() -> GPT:
    torch.manual_seed(0)
    return GPT(CFG)


def _adamw(params: list[torch.Tensor]) -> torch.optim.Optimizer:
    return torch.optim.AdamW(params, lr=3e-3, weight_decay=0.1, foreach=False)


def _train(mode: str, steps: int = STEPS, **kw):
    model = _gpt()
    setup = prepare_precision(model, mode, _adamw, **kw)
    losses, stepped = [], []
    for step in range(steps):
        x, y = _batch(step)
        setup.optimizer.zero_grad()
        _, loss = model(x, y)
        setup.optimizer.backward(loss)
        stepped.append(setup.optimizer.step(max_grad_norm=1.0))
        losses.append(loss.item())
    return losses, stepped, setup


@functools.cache
def _fp32_losses() -> tuple[float, ...]:
    return tuple(_train("fp32")[0])


@pytest.mark.parametrize(("mode", "kw"), [("fp16", {"scaler": {"init_scale": 2.0**12}}), ("bf16", {})])
def test_half_precision_tracks_fp32(mode: str, kw: dict) -> None:
    ref = _fp32_losses()
    losses, stepped, setup = _train(mode, **kw)
    assert all(stepped)  # no overflow at this scale: the runs see the same updates, comparable step by step
    assert ref[-1] < ref[0] - 0.4  # it learns
    for step, (a, b) in enumerate(zip(losses, ref)):
        assert abs(a - b) <= 2 * U[mode] * b, f"{mode} step {step}: loss {a} vs fp32 {b}"
    assert {p.dtype for p in setup.model.parameters()} == {setup.param_dtype}
    assert {m.dtype for m in setup.optimizer.masters} == {torch.float32}


def test_overflows_never_reach_parameters() -> None:
    """fp16 from a scale far too large: the first steps overflow and are skipped, nothing non-finite is kept."""
    model = _gpt()
    scaler = DynamicLossScaler(2.0**22, growth_interval=4, hysteresis=2)  # this model's edge is near 2^18
    mp = MixedPrecisionOptimizer(model, _adamw, torch.float16, scaler=scaler)
    stepped = []
    for step in range(12):
        x, y = _batch(step)
        mp.zero_grad()
        mp.backward(model(x, y)[1])
        stepped.append(mp.step())
        tensors = mp.masters + mp.params + [v for s in mp.state.values() for v in s.values()]
        assert all(torch.isfinite(t).all() for t in tensors), f"non-finite value kept after step {step}"
    assert not stepped[0] and stepped[-1]  # skipped at first, training later
    assert scaler.num_overflows == stepped.count(False) >= 2
    assert scaler.scale < 2.0**22


@pytest.mark.parametrize("variant", ["main_grad", "zero", "playbook"])
@pytest.mark.parametrize("bad", [float("inf"), float("nan")])
def test_skipped_step_is_bit_identical(variant: str, bad: float) -> None:
    model = _gpt()
    scaler = DynamicLossScaler(2.0**8, hysteresis=1)
    mp = MixedPrecisionOptimizer(model, _adamw, torch.bfloat16, scaler=scaler, main_grad=variant == "main_grad",
                                 keep_fp32_grads=variant == "playbook")

    def step(inject: bool) -> bool:
        x, y = _batch(0)
        mp.zero_grad()
        mp.backward(model(x, y)[1])
        if inject:
            grad = mp.params[3].main_grad if variant == "main_grad" else mp.params[3].grad
            grad.view(-1)[5] = bad
        return mp.step()

    def snapshot() -> list[torch.Tensor]:
        states = [v.clone() for s in mp.state.values() for v in s.values()]
        return [m.clone() for m in mp.masters] + [p.detach().clone() for p in mp.params] + states

    assert step(False)
    before = snapshot()
    assert not step(True)
    after = snapshot()
    assert len(after) == len(before) and all(torch.equal(a, b) for a, b in zip(before, after))
    assert scaler.scale == 2.0**7
    assert step(False)  # and training goes on


@pytest.mark.parametrize("mode", ["fp16", "bf16"])
@pytest.mark.parametrize("main_grad", [True, False])
def test_accumulation_over_micro_batches_matches_fp32(mode: str, main_grad: bool) -> None:
    x, y = _batch(0)
    ref = _gpt()
    ref(x, y)[1].backward()
    model = _gpt()
    scaler = DynamicLossScaler(2.0**12) if mode == "fp16" else None
    mp = MixedPrecisionOptimizer(model, _adamw, {"fp16": torch.float16, "bf16": torch.bfloat16}[mode],
                                 scaler=scaler, main_grad=main_grad)
    mp.zero_grad()
    for half in (slice(0, 4), slice(4, 8)):  # two micro-batches, each half the rows: loss / 2 each
        mp.backward(model(x[half], y[half])[1] / 2)
    if main_grad:
        assert all(p.grad is None for p in mp.params)  # the hook folded them into main_grad and freed them
        got = torch.cat([p.main_grad.reshape(-1) for p in mp.params])
    else:
        got = torch.cat([p.grad.float().reshape(-1) for p in mp.params])
    got = got / mp.loss_scale
    want = torch.cat([p.grad.reshape(-1) for p in ref.parameters()])
    assert (got - want).norm() <= 4 * U[mode] * want.norm()


def test_bytes_per_parameter_equal_the_conventions() -> None:
    cases = [("fp32", {}, "fp32"), ("fp16", {}, "main_grad"), ("bf16", {}, "main_grad"),
             ("fp16", {"main_grad": False}, "zero"), ("bf16", {"main_grad": False, "keep_fp32_grads": True},
                                                      "playbook"), ("bf16", {"master_weights": False}, "bf16_states")]
    totals = {}
    for mode, kw, convention in cases:
        _, _, setup = _train(mode, steps=1, **kw)
        assert setup.convention == convention
        measured = bytes_per_param(setup.model, setup.optimizer)
        assert measured.num_params == 133_888
        assert measured.per_param() == CONVENTIONS[convention].by_category(), (mode, kw)
        # Adam's step counter: one 4-byte scalar per parameter tensor, left out of the per-parameter figure.
        assert measured.step_counter_bytes == 4 * len(list(setup.model.parameters()))
        rows = compare(measured, convention)
        assert rows[-1] == {"category": "total", "measured": measured.total, "convention": measured.total}
        totals[convention] = measured.total
    assert totals == {"fp32": 16, "main_grad": 18, "zero": 16, "playbook": 20, "bf16_states": 8}


def test_state_dict_resumes_exactly() -> None:
    def fresh() -> MixedPrecisionOptimizer:
        return MixedPrecisionOptimizer(_gpt(), _adamw, torch.bfloat16, scaler=None)

    def run(mp: MixedPrecisionOptimizer, steps: range) -> list[float]:
        losses = []
        for step in steps:
            x, y = _batch(step)
            mp.zero_grad()
            loss = mp.model(x, y)[1]
            mp.backward(loss)
            mp.step()
            losses.append(loss.item())
        return losses

    whole = run(fresh(), range(4))
    first = fresh()
    head = run(first, range(2))
    saved = first.state_dict()
    resumed = fresh()
    resumed.load_state_dict(saved)
    assert head + run(resumed, range(2, 4)) == whole


def test_bad_input_is_refused_clearly() -> None:
    assert PRECISION_MODES == ("fp32", "fp16", "bf16")
    with pytest.raises(ValueError, match="unknown precision"):
        check_precision("fp8")
    with pytest.raises(ValueError, match="float16 or torch.bfloat16"):
        MixedPrecisionOptimizer(_gpt(), _adamw, torch.float32)
    with pytest.raises(ValueError, match="master tensors"):
        model = _gpt()
        MixedPrecisionOptimizer(model, lambda _: _adamw(list(model.parameters())), torch.bfloat16)
    with pytest.raises(ValueError, match="keep_fp32_grads"):
        MixedPrecisionOptimizer(_gpt(), _adamw, torch.bfloat16, main_grad=True, keep_fp32_grads=True)
    with pytest.raises(ValueError, match="fp16 only"):
        prepare_precision(_gpt(), "bf16", _adamw, scaler={"init_scale": 8.0})
    with pytest.raises(ValueError, match="pure-bf16"):
        prepare_precision(_gpt(), "fp16", _adamw, master_weights=False)
    assert isinstance(prepare_precision(_gpt(), "fp32", _adamw).optimizer, PlainOptimizer)
