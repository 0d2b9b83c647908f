"""1-bit Adam (lslm.data_parallel.onebit_*): sign packing, the compressed all-reduce's bytes and error feedback,
the warm-up against torch's Adam, the compressed step against Algorithm 1, the elements whose variance is zero at the
freeze (never-fed embedding rows), checkpoints and the error buffers, bad settings, and a short run on the course's
GPT. One launch per world size (1, 2 and 4)."""

from __future__ import annotations

import math
from typing import Any

import pytest
import torch

from lslm.data_parallel.onebit_adam import WARMUP_LABEL, OneBitAdam
from lslm.data_parallel.onebit_compress import (
    ALL_GATHER_LABEL,
    ALL_TO_ALL_LABEL,
    compressed_all_reduce_bus_bytes,
    pack_signs,
    padded_numel,
    sign_compress,
    unpack_signs,
)
from lslm.data_parallel.onebit_run import RUN_CONFIG
from lslm.models.gpt import GPT, GPTConfig
from tests.helpers import run_workers
from tests.onebit_workers import CONFIG, SEEN, UNSEEN_STEPS, UNSEEN_WARMUP

#: Adam's largest step per element, in units of lr, when 1 - beta1 > sqrt(1 - beta2) (a gradient that was zero until
#: now, the rows first fed late here): (1 - beta1) / sqrt(1 - beta2) at the default betas (Kingma and Ba 2015, §2.1).
ADAM_STEP_BOUND = 0.1 / 0.001**0.5


@pytest.fixture(scope="module")
def suites() -> dict[int, dict[str, Any]]:
    return {n: run_workers("tests.onebit_workers:suite", n, timeout=300)[0] for n in (1, 2, 4)}


def test_packing_signs_is_exact() -> None:
    g = torch.Generator().manual_seed(0)
    for numel in (8, 64, 8 * 1001):
        x = torch.randn(numel, generator=g)
        x[::7] = 0.0  # zero counts as +1
        packed = pack_signs(x)
        assert packed.dtype == torch.uint8 and packed.numel() == numel // 8
        assert torch.equal(unpack_signs(packed), torch.where(x >= 0, 1.0, -1.0))
    # Every byte value round-trips: unpack then pack is the identity on uint8.
    every = torch.arange(256, dtype=torch.uint8)
    assert torch.equal(pack_signs(unpack_signs(every)), every)
    assert pack_signs(torch.tensor([1.0, -1, -1, -1, -1, -1, -1, -2])).item() == 1
    with pytest.raises(ValueError, match="multiple of 8"):
        pack_signs(torch.ones(12))


def test_sign_compress_scales_are_mean_abs_per_chunk() -> None:
    x = torch.tensor([1.0, -3, 2, -2, 0, 0, 0, 0, 4, 4, -4, 4, 4, 4, 4, 4])
    packed, scales, dec = sign_compress(x, 2)
    assert scales.tolist() == [1.0, 4.0]
    assert dec.tolist() == [1.0, -1, 1, -1, 1, 1, 1, 1, 4, 4, -4, 4, 4, 4, 4, 4]
    assert padded_numel(1000, 4) == 1024 and padded_numel(1024, 4) == 1024


def test_refuses_main_grad_buffers_and_bad_settings() -> None:
    from lslm.data_parallel.grad_buffer import GradBuffer

    p = torch.nn.Parameter(torch.ones(3))
    p.grad_buffer = GradBuffer.__new__(GradBuffer)  # only its type is looked at
    with pytest.raises(ValueError, match="main_grad"):
        OneBitAdam([p], ctx=None)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="warmup_steps"):
        OneBitAdam([torch.nn.Parameter(torch.ones(3))], ctx=None, warmup_steps=0)  # type: ignore[arg-type]


@pytest.mark.parametrize(("name", "value"), [
    ("lr", math.nan), ("lr", math.inf), ("lr", 0.0), ("lr", -1e-3), ("lr", True), ("lr", "1e-3"),
    ("eps", math.nan), ("eps", math.inf), ("eps", 0.0), ("eps", -1e-8),
    ("betas", (math.nan, 0.999)), ("betas", (0.9, 1.0)), ("betas", (-0.1, 0.999)), ("betas", (0.9,)),
    ("betas", (0.9, 0.999, 0.5)), ("betas", (True, 0.999)), ("betas", 0.9),
    ("warmup_steps", True), ("warmup_steps", 0), ("warmup_steps", 2.5), ("warmup_steps", -3),
    ("error_feedback", 1), ("error_feedback", None),
])
def test_bad_settings_are_refused_naming_the_argument(name: str, value: Any) -> None:
    # Before: lr NaN / inf and eps NaN gave NaN or inf weights after one step, warmup_steps=True meant one step.
    with pytest.raises(ValueError, match=f"^{name} must"):
        OneBitAdam([torch.nn.Parameter(torch.ones(3))], ctx=None, **{name: value})  # type: ignore[arg-type]


@pytest.mark.parametrize("nproc", [1, 2, 4])
def test_elements_whose_sqrt_v_hat_is_at_most_eps_move_no_more_than_under_adam(nproc: int, suites: dict) -> None:
    u = suites[nproc]["unseen"]
    assert u["warmup_ids_fed"] == SEEN  # every id below SEEN was fed in the warm-up, none above
    one_bit, adam = u["1-bit"], u["adam"]
    # Left out of the compressed tensor: exactly the rows no warm-up step fed, and the attention's key biases (their
    # gradient is rounding noise, sqrt(v_hat) <= 7e-12 here, every other element >= 1e-6: the eps = 1e-8 between
    # them has two orders of magnitude on either side).
    assert one_bit["frozen_numel"] == (CONFIG["vocab_size"] - SEEN) * CONFIG["n_embd"] + \
        CONFIG["n_layer"] * CONFIG["n_embd"]
    assert one_bit["compressed_numel"] + one_bit["frozen_numel"] == sum(
        p.numel() for p in GPT(GPTConfig(**CONFIG)).parameters())
    assert adam["frozen_numel"] is None  # it never left its warm-up
    # Rows never fed: Adam leaves them exactly where they started (m = 0), and so must 1-bit Adam. Before the mask
    # they decoded to +-scale and moved by lr * scale / eps.
    assert adam["never_fed"] == 0.0 and one_bit["never_fed"] == 0.0
    # Rows first fed after the warm-up: Adam moves them, by at most its bound per step; 1-bit Adam has no variance
    # for them and leaves them where they were (it moved them by ~lr * m / eps before).
    assert 0.0 < adam["fed_later"] <= ADAM_STEP_BOUND * 3e-3 * (UNSEEN_STEPS - UNSEEN_WARMUP)
    assert one_bit["fed_later"] == 0.0 <= adam["fed_later"]
    # The key biases after the freeze, which no gradient moves (softmax ignores a constant added to a row of scores):
    # Adam drifts them on rounding noise, by at most its bound per step; 1-bit Adam leaves them alone (it moved them
    # by ~100 before).
    assert one_bit["key_bias"] == 0.0 <= adam["key_bias"] <= ADAM_STEP_BOUND * 3e-3 * (UNSEEN_STEPS - UNSEEN_WARMUP)
    # The rows it does precondition still train, and nothing blew up.
    assert one_bit["seen"] > 0.0 and one_bit["finite"] and adam["finite"]


@pytest.mark.parametrize("nproc", [1, 2, 4])
def test_the_compressed_step_is_algorithm_1_without_bias_correction_of_m(nproc: int, suites: dict) -> None:
    r = suites[nproc]
    # The same per-parameter addcdiv on the same values as the optimizer: bit-equal on any machine.
    assert r["paper_step_diff"] == 0.0
    # and torch's lr / (1 - beta1^t) (2.9x larger at t = 4) is not what ran: the check tells them apart.
    assert r["bias_corrected_step_diff"] > 1e-4


@pytest.mark.parametrize("nproc", [2, 4])
def test_a_checkpoint_restores_the_error_buffers_or_resets_them(nproc: int, suites: dict) -> None:
    r = suites[nproc]
    assert r["saved_has_errors"]  # two compressed steps in, each rank's worker error is not zero
    # Restored on the same rank of a group of the same size: the run continues exactly (the same operations on the
    # same values, so bit-equal on any machine).
    assert r["restored: errors kept"] and r["restored: equal"]
    # reset_errors, or another rank's dict: the buffers restart from zero, and the run is no longer the same one.
    for case in ("reset", "other rank"):
        assert not r[f"{case}: errors kept"], case
        assert not r[f"{case}: equal"] and 0.0 < r[f"{case}: max diff"], case


@pytest.mark.parametrize("nproc", [2, 4])
def test_warmup_equals_adam_on_averaged_gradients(nproc: int, suites: dict) -> None:
    r = suites[nproc]
    assert r["warmup_diffs"] == [0.0] * 3  # bit for bit, every warm-up step
    assert r["replicas_equal"]  # the compressed phase leaves every rank with the same parameters
    assert r["moved_after_warmup"] > 0
    # Warm-up steps use one fp32 all-reduce; the compression steps only the 1-bit collectives.
    assert r["labels_per_step"][:3] == [[WARMUP_LABEL]] * 3
    assert r["labels_per_step"][3:] == [sorted([ALL_GATHER_LABEL, ALL_TO_ALL_LABEL])] * 3


@pytest.mark.parametrize("nproc", [2, 4])
def test_compressed_bytes_equal_the_formula_and_are_32x_fewer(nproc: int, suites: dict) -> None:
    r = suites[nproc]
    numel, p = r["bytes_numel"], padded_numel(r["bytes_numel"], nproc)
    assert r["compressed_bus"] == r["formula_bus"]
    # Signs travel as uint8, 8 per byte, plus one fp32 scale per chunk: the ledger's own sizes.
    assert sorted(map(tuple, r["compressed_ops"])) == sorted([("all_to_all", "uint8", p // 8, ALL_TO_ALL_LABEL),
                                                  ("all_to_all", "float32", 4 * nproc, ALL_TO_ALL_LABEL),
                                                  ("all_gather", "uint8", p // 8, ALL_GATHER_LABEL),
                                                  ("all_gather", "float32", 4 * nproc, ALL_GATHER_LABEL)])
    assert r["fp32_nbytes"] == 4 * numel
    ratio = r["fp32_bus"] / r["compressed_bus"]
    assert 31.0 < ratio <= 32.0


@pytest.mark.parametrize("nproc", [2, 4])
def test_error_feedback_keeps_the_running_sum_on_track(nproc: int, suites: dict) -> None:
    r = suites[nproc]
    ef, no_ef = r["errors_efTrue"], r["errors_efFalse"]
    # Equal, bit for bit, to the algorithm run in one process on every rank's input (errors included).
    assert r["reference_diff_efTrue"] == r["reference_diff_efFalse"] == 0.0
    assert r["identity_gap"] <= 1e-5 * r["identity_scale"]  # sum(out) = sum(mean x) - errors, to rounding
    # With feedback the relative error of the running sum falls as the sum grows; without it, it does not.
    assert ef[-1] < ef[0] / 5
    assert no_ef[-1] > 5 * ef[-1]


def test_loss_curves_on_the_course_gpt(suites: dict) -> None:
    c = suites[2]["curves"]
    losses, sent = c["losses"], c["bus_bytes"]
    assert set(losses) == {"adam", "1-bit adam", "1-bit adam, no error feedback"}
    for name in ("adam", "1-bit adam"):
        assert losses[name][-1] < losses[name][0], name  # both learn
    # Without error feedback the run may diverge (NaN on an AVX2 EPYC, finite here): its fate is shown in notebook 10,
    # not required here. A non-finite tail counts as worse than any finite one.
    # "adam" is OneBitAdam that never leaves its warm-up: the same code on the same values, so the same losses bit
    # for bit on any machine until the first compressed step lands.
    assert losses["1-bit adam"][:11] == losses["adam"][:11]
    # What error feedback buys here: a lower loss over the last 10 steps than without it.
    tail = {name: sum(curve[-10:]) / 10 for name, curve in losses.items()}
    tail = {name: t if math.isfinite(t) else math.inf for name, t in tail.items()}
    assert math.isfinite(tail["1-bit adam"]) and tail["1-bit adam"] < tail["1-bit adam, no error feedback"]
    assert len(set(sent["adam"])) == 1 and sent["adam"][0] == 4 * c["numel"]  # 2 (n-1)/n x 4 bytes at n = 2
    assert sent["1-bit adam"][:10] == sent["adam"][:10]
    # Compressed: every element but those whose frozen sqrt(v_hat) is at most eps: the embedding rows of the tokens
    # unseen in the warm-up and the key biases (sqrt(v_hat) <= 1.3e-10 here, every other element >= 4e-8).
    compressed = c["compressed_numel"]["1-bit adam"]
    assert c["compressed_numel"]["1-bit adam, no error feedback"] == compressed
    assert c["unseen_rows"] > 0
    assert c["frozen_numel"]["1-bit adam"] == c["numel"] - compressed == \
        (c["unseen_rows"] + RUN_CONFIG["n_layer"]) * RUN_CONFIG["n_embd"]
    assert set(sent["1-bit adam"][10:]) == {compressed_all_reduce_bus_bytes(compressed, 2)}
    assert max(sent["1-bit adam"][10:]) < sent["adam"][0] / 31
    # The whole run, warm-up included: 10 fp32 steps and 30 compressed ones.
    assert sum(sent["1-bit adam"]) == 10 * 4 * c["numel"] + 30 * compressed_all_reduce_bus_bytes(compressed, 2)
    # The embedding rows of tokens no rank fed in the warm-up: Adam leaves the never-fed ones alone and moves the
    # later-fed ones by at most lr a step; 1-bit Adam does not touch any of them.
    assert c["unseen_rows_moved"]["1-bit adam"] == 0.0 <= c["unseen_rows_moved"]["adam"] <= ADAM_STEP_BOUND * 3e-3 * 40
