"""``--precision`` in every recipe: the parallel recipes in fp16 / bf16 reproduce the serial recipe in the same mode.

Model and data: the recipes' small GPT (2 blocks, width 64, vocabulary 1024, 64 tokens,
235,264 parameters) on the shipped corpus, global batch 8, 8 AdamW steps, clipping at 1.

Tolerance, in units of the format's unit roundoff u (fp16: 2^-11, bf16: 2^-8): every
step's loss within ``TOL_U = 0.25`` u (relative) of the serial run in the same mode. A
parallel run rounds differently (per-rank means summed in half precision, partial
products of split matmuls summed by an all-reduce in half precision), each rounding at most
u relative on values that average out in the loss. Measured at most 0.0086 u for DDP
(every variant), 0.016 u for TP (tp=2, with and without sequence parallelism) and 0.0099 u
for the pipeline (pp=2, 1F1B and ZB-H1), 2 processes, this model (``pytest -s`` prints
them); the serial fp16 and bf16 runs themselves differ from fp32 by 0.034 u and 0.042 u.
"""

from __future__ import annotations

import functools

import pytest

from lslm.data_parallel.ddp import VARIANTS
from lslm.recipes import ddp as DDP
from lslm.recipes import pipeline as PP
from lslm.recipes import tp as TP
from lslm.recipes.train import TrainConfig, train

U = {"fp16": 2.0**-11, "bf16": 2.0**-8}
TOL_U = 0.25
MODES = ("fp16", "bf16")
STEPS, B, T, C = 8, 8, 64, 64
SMALL = dict(n_layer=2, n_head=4, n_embd=C, vocab_size=1024, block_size=T, steps=STEPS, log_every=100, batch_size=B)


@functools.cache
def _serial(mode: str) -> dict:
    return train(TrainConfig(**SMALL, precision=mode))


def _close(losses: list[float], mode: str) -> float:
    """The largest relative loss difference from the serial run in ``mode``, in units of u (asserted <= TOL_U)."""
    base = _serial(mode)["losses"]
    worst = max(abs(a - b) / b for a, b in zip(losses, base, strict=True)) / U[mode]
    assert worst <= TOL_U, (mode, worst)
    return worst


def _same_steps(records: list[dict], mode: str) -> None:
    """Every rank stepped (or skipped) the same steps with the same scale as the serial run, and reports one loss."""
    base = _serial(mode)
    for r in records:
        assert r["precision"] == mode and r["losses"] == records[0]["losses"]
        assert r["stepped"] == base["stepped"] and r["loss_scale"] == base["loss_scale"]


def test_serial_half_modes_track_fp32_and_fp16_starts_at_the_given_scale() -> None:
    fp32 = train(TrainConfig(**SMALL))["losses"]
    for mode in MODES:
        run = _serial(mode)
        worst = max(abs(a - b) / b for a, b in zip(run["losses"], fp32)) / U[mode]
        assert worst <= 2, (mode, worst)  # tests/test_precision_master.py's bound (2 u), here on the recipe
        assert run["precision"] == mode and len(run["stepped"]) == STEPS
    assert _serial("fp16")["loss_scale"][0] in (2.0**16, 2.0**15)  # the default init scale (halved on an overflow)
    assert _serial("bf16")["loss_scale"] == [1.0] * STEPS  # no scaler in bf16
    # Model states: half weights (2 B) and fp32 masters (4 B) per parameter, by lslm.metrics' owners.
    mem = _serial("bf16")["memory"]["by_owner"]["resident"]
    n = _serial("bf16")["num_parameters"]
    assert mem["parameters"] == {"cpu": 2 * n} and mem["master_weights"] == {"cpu": 4 * n}


def test_bad_precision_is_refused_before_any_process_starts() -> None:
    with pytest.raises(ValueError, match="precision"):
        DDP.DDPConfig(precision="fp8")
    with pytest.raises(ValueError, match="init_scale"):
        TrainConfig(init_scale=0)
    with pytest.raises(SystemExit) as info:
        DDP.main(["--nproc", "2", "--precision", "half"])
    assert info.value.code == 2


@pytest.fixture(scope="module")
def ddp_runs() -> dict[tuple[str, str], list[dict]]:
    """Every DDP variant in fp16 and bf16, in one 2-process launch."""
    runs = [{"variant": v, "precision": m} for m in MODES for v in VARIANTS]
    res = DDP.run(2, runs=runs, output="none", timeout=300, bucket_cap_mb=0.1, **SMALL)
    return {(r["precision"], r["variant"]): [res[rank][i] for rank in range(2)] for i, r in enumerate(runs)}


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("variant", VARIANTS)
def test_ddp_in_half_precision_reproduces_the_serial_run(ddp_runs, mode: str, variant: str) -> None:
    records = ddp_runs[(mode, variant)]
    print(f"ddp {variant} {mode}: {_close(records[0]['losses'], mode):.4f} u")
    _same_steps(records, mode)
    n = records[0]["num_parameters"]
    assert records[0]["grad_bytes"] == 2 * n  # half-precision gradients are what DDP reduces
    if variant != "torch":
        assert all(r["comm_bytes"] == [2 * n] * STEPS for r in records)  # ... exactly, every step
    for r in records:
        mem = r["memory"]["by_owner"]["resident"]
        assert mem["parameters"] == {"cpu": 2 * n} and mem["master_weights"] == {"cpu": 4 * n}


@pytest.fixture(scope="module")
def tp_runs() -> dict[tuple[str, bool], list[dict]]:
    """tp=2 in fp32, fp16 and bf16 (half modes with and without sequence parallelism), in one 2-process launch."""
    runs = [{"precision": "fp32"}] + [{"precision": m, "sequence_parallel": sp} for m in MODES for sp in (False, True)]
    res = TP.run(2, runs=runs, output="none", timeout=300, tp=2, **SMALL)
    return {(r["precision"], r.get("sequence_parallel", False)): [res[rank][i] for rank in range(2)]
            for i, r in enumerate(runs)}


@pytest.mark.parametrize("sequence_parallel", [False, True])
@pytest.mark.parametrize("mode", MODES)
def test_tp_in_half_precision_reproduces_the_serial_run(tp_runs, mode: str, sequence_parallel: bool) -> None:
    records = tp_runs[(mode, sequence_parallel)]
    print(f"tp=2 {mode} sp={sequence_parallel}: {_close(records[0]['losses'], mode):.4f} u")
    _same_steps(records, mode)
    if not sequence_parallel:  # every TP message is an activation or its gradient: half the bytes of fp32's ...
        fp32 = tp_runs[("fp32", False)][0]["tp_comm_bytes"][-1]
        # ... but the vocabulary-parallel loss reduces fp32 statistics whatever the logits' dtype (its softmax is
        # in fp32): the max (B*T floats), then target logit and sum-exp (2*B*T floats), forward; those do not halve.
        # (fp16's 4-byte overflow vote is not TP traffic: the recipe leaves it out.)
        loss_bytes = 3 * B * T * 4
        assert records[0]["tp_comm_bytes"][-1] * 2 == fp32 + loss_bytes


@pytest.fixture(scope="module")
def pipeline_runs() -> dict[tuple[str, str], list[dict]]:
    """pp=2, m=4, 1F1B and ZB-H1 in fp16 and bf16, in one 2-process launch."""
    runs = [{"schedule": s, "precision": m} for m in MODES for s in ("1f1b", "zb-h1")]
    res = PP.run(2, runs=runs, output="none", timeout=300, pp=2, microbatches=4, **SMALL)
    return {(r["precision"], r["schedule"]): [res[rank][i] for rank in range(2)] for i, r in enumerate(runs)}


@pytest.mark.parametrize("schedule", ["1f1b", "zb-h1"])
@pytest.mark.parametrize("mode", MODES)
def test_pipeline_in_half_precision_reproduces_the_serial_run(pipeline_runs, mode: str, schedule: str) -> None:
    records = pipeline_runs[(mode, schedule)]
    print(f"pp=2 {schedule} {mode}: {_close(records[0]['losses'], mode):.4f} u")
    _same_steps(records, mode)
    m = 4  # m activations forward and m gradients backward, each (B/m) x T x C half-precision numbers
    assert all(r["pp_comm_bytes"] == [2 * m * (B // m) * T * C * 2] * STEPS for r in records)
