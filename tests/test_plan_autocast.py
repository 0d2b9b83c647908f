"""``lslm.plan`` under ``torch.autocast`` (``Layout.mixed="autocast"``): states, activations, and the H200 runs.

* The precision semantics: autocast keeps fp32 parameters, gradients and Adam (16 bytes per parameter, no
  masters); Megatron-style masters keep 18 (fp32 ``main_grad``) or 16 (half gradients); the default is unchanged.
* The activation count, checked on this CPU under bf16 autocast with saved-tensor hooks on lslm's GPT: what
  autograd saves equals the calculator's bytes plus at most what it leaves out by design (the O(s) statistics:
  LayerNorm means and reciprocal deviations, 8 bytes per token each; the attention's fp32 log-sum-exp, 4 bytes
  per token and head; the int64 token ids and targets).
* Against the H200 (``bench/results/gpu/``, nothing fitted to it): every run's peak within 10 % (the issue's
  target) and its states before the forward within 10 %; the activations (peak less states) within 1 %, since
  the count is tensor by tensor (measured: 0.12 % at worst); the Megatron-style count misses them by 30 % or more.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from lslm.metrics.activations import ActivationMemory
from lslm.models.gpt import GPT, GPTConfig
from lslm.plan import Layout, ModelSpec, estimate, hardware_presets
from lslm.plan.autocast import autocast_layer_bytes
from lslm.plan.memory import layer_linear_params, stage_memory
from lslm.plan.states import model_states
from lslm.plan.validate_memory import format_memory_validation, load_gpu_rows, validate_memory
from lslm.tensor_parallel.recompute import apply_recompute

GPU = Path(__file__).resolve().parents[1] / "bench" / "results" / "gpu"
L, H, A, S, B, V = 2, 64, 4, 64, 2, 1024


def _spec(global_batch: int = B) -> ModelSpec:
    return ModelSpec(L, H, A, V, S, micro_batch=B, global_batch=global_batch, dropout=False)


def test_states_per_parameter_by_semantics_and_the_default_unchanged() -> None:
    psi = 1000
    per = {name: model_states(psi, lay).device_bytes / psi for name, lay in {
        "autocast": Layout(mixed="autocast"), "masters": Layout(), "masters, half grads": Layout(grad_dtype="param"),
        "fp32": Layout(precision="fp32")}.items()}
    assert per == {"autocast": 16, "masters": 18, "masters, half grads": 16, "fp32": 16}
    assert model_states(psi, Layout(mixed="autocast")).device["master_weights"].value == 0
    assert Layout().mixed == "masters"


@pytest.mark.parametrize("bad, match", [({"mixed": "apex"}, "mixed must be one of"),
                                        ({"mixed": "autocast", "precision": "fp32"}, "needs precision")])
def test_bad_mixed_precision_is_refused(bad: dict[str, str], match: str) -> None:
    with pytest.raises(ValueError, match=match):
        Layout(**bad)  # type: ignore[arg-type]


def test_one_block_under_cpu_bf16_autocast_saves_the_calculator_s_bytes() -> None:
    torch.manual_seed(0)
    block = GPT(GPTConfig(vocab_size=V, block_size=S, n_layer=L, n_head=A, n_embd=H)).blocks[0]
    x = torch.randn(B, S, H, requires_grad=True)
    with ActivationMemory(block) as act, torch.autocast("cpu", dtype=torch.bfloat16):
        block(x)
    spec = _spec()
    predicted = autocast_layer_bytes(spec, Layout(flash_attention=True, mixed="autocast")) \
        + 2 * layer_linear_params(spec, 1)  # the half copies of its weights and biases
    assert predicted == 36 * B * S * H + 2 * (12 * H * H + 9 * H)  # 36 sbh of tensors; half weights and biases
    statistics = 2 * 8 * B * S + 4 * B * A * S  # two LayerNorms' mean and rstd; the log-sum-exp
    assert 0 <= act.bytes - predicted <= statistics


@pytest.mark.parametrize("recompute", ["none", "full"])
def test_the_whole_gpt_under_cpu_bf16_autocast_saves_the_calculator_s_bytes(recompute: str) -> None:
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=V, block_size=S, n_layer=L, n_head=A, n_embd=H))
    apply_recompute(model, recompute)
    idx = torch.randint(0, V, (B, S), generator=torch.Generator().manual_seed(1))
    with ActivationMemory(model) as act, torch.autocast("cpu", dtype=torch.bfloat16):
        model(idx, idx)
    spec = _spec()
    mem = stage_memory(spec, Layout(flash_attention=True, mixed="autocast", recompute=recompute), 1, 0)
    # What autograd saves at the forward's end: that moment's bytes less what no node saves (the caller's half
    # logits, 2 sbV; their fp32 copy, 4 sbV) and, with full recomputation, the cache's copies of the layers.
    cache = 2 * L * layer_linear_params(spec, 1) if recompute == "full" else 0
    saved = mem.moments["forward end"] - 6 * S * B * V - cache
    left_out = 2 * 8 * B * S + (L if recompute == "none" else 0) * (2 * 8 * B * S + 4 * B * A * S) + 8 * B * S
    assert 0 <= act.bytes - saved <= left_out  # ids and targets; final and layer LayerNorm statistics; lse


def test_every_h200_run_within_the_issue_s_bounds() -> None:
    rows = validate_memory(load_gpu_rows(GPU))
    assert len(rows) == 11  # 6 recompute runs + 5 eager gpt runs
    for r in rows:
        assert abs(r["peak_error"]) <= 0.10, r
        assert abs(r["states_error"]) <= 0.10, r
        assert abs(r["activations_error"]) <= 0.01, r
        assert r["before_activations_error"] <= -0.30, r  # the half-activation count, before autocast was modelled
    text = format_memory_validation(rows)
    assert text.splitlines()[-1].startswith("(* peak beyond 10%) 11 of 11 runs' peaks within 10%")


def test_gradients_are_resident_at_the_peak_unless_created_in_backward() -> None:
    spec = _spec(global_batch=2 * B)
    hw = hardware_presets()["h100-sxm"]
    one = estimate(_spec(), Layout(flash_attention=True, mixed="autocast"), hw).memory
    assert not one.grads_at_peak and one.states_before_forward == 12 * one.params
    accumulated = estimate(spec, Layout(flash_attention=True, mixed="autocast"), hw).memory  # 2 micro-batches
    assert accumulated.grads_at_peak and accumulated.total == sum(t.value for t in accumulated.owners.values())
    assert estimate(_spec(), Layout(flash_attention=True), hw).memory.grads_at_peak  # masters: main_grad kept


def test_lslm_plan_cli_takes_mixed_and_validate_prints_the_h200_rows(capsys: pytest.CaptureFixture[str]) -> None:
    from lslm.cli import main

    assert main(["plan", "--layers", "2", "--hidden", "64", "--heads", "4", "--vocab", "1024", "--seq", "64",
                 "--flash", "--mixed", "autocast"]) == 0
    out = capsys.readouterr().out
    assert "bf16 autocast" in out and "fp32 input 4sbh" in out and "(activations at loss backward)" in out
    assert main(["plan", "--validate"]) == 0
    out = capsys.readouterr().out
    assert "11 of 11 runs' peaks within 10%" in out
