"""``--precision`` in every recipe: the parallel recipes in fp16 / bf16 reproduce the serial recipe in the same mode.

Model and data: the recipes' small GPT (2 blocks, width 64, vocabulary 1024, 64 tokens,
235,264 parameters) on the shipped corpus, global batch 8, 8 AdamW steps, clipping at 1.

Tolerance, in units of the format's unit roundoff u (fp16: 2^-11, bf16: 2^-8): every
step's loss within ``TOL_U = 0.25`` u (relative) of the serial run in the same mode. A
parallel run rounds differently (partial products of split matmuls summed by an all-reduce
in half precision; per-rank gradients summed in fp32 in the gradient buffers, or in half
precision by the wrappers that reduce ``.grad``), each rounding at most u relative on values
that average out in the loss. Measured (``pytest -s`` prints them), 2 processes unless said:
at most 0.0142 u for DDP (every variant, both buffer dtypes), 0.0495 u for TP (tp=2, with
and without sequence parallelism; 0.0476 u at dp=2 x tp=2 with it, 4 processes) and 0.0097 u
for the pipeline (pp=2: every schedule; dp=2 x pp=2 ZB-H1, 4 processes, in
tests/test_recipe_pipeline.py: 0.0015 u and 0.0033 u on its model); the serial fp16
and bf16 runs themselves differ from fp32 by 0.034 u and 0.042 u. The silent failure these
checks guard against (syncs that reduced nothing while the gradients sat in ``main_grad``)
put dp=2 x tp=2 bf16 about 1 u away after 8 steps.
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
def _serial(mode: str, n_layer: int = SMALL["n_layer"]) -> dict:
    return train(TrainConfig(**{**SMALL, "n_layer": n_layer}, precision=mode))


def _close(losses: list[float], mode: str, n_layer: int = SMALL["n_layer"]) -> float:
    """The largest relative loss difference from the serial run in ``mode``, in units of u (asserted <= TOL_U)."""
    base = _serial(mode, n_layer)["losses"]
    worst = max(abs(a - b) / b for a, b in zip(losses, base, strict=True)) / U[mode]
    assert worst <= TOL_U, (mode, worst)
    return worst


def _same_steps(records: list[dict], mode: str, n_layer: int = SMALL["n_layer"]) -> None:
    """Every rank stepped (or skipped) the same steps with the same scale as the serial run, and reports one loss."""
    base = _serial(mode, n_layer)
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
    # bucketed reduces its fp32 gradient buffer by default; [param] keeps the buffer in the model's half dtype
    runs += [{"variant": "bucketed", "precision": m, "grad_reduce_dtype": "param"} for m in MODES]
    res = DDP.run(2, runs=runs, output="none", timeout=300, bucket_cap_mb=0.1, **SMALL)
    return {(r["precision"], r["variant"] + ("[param]" if "grad_reduce_dtype" in r else "")):
            [res[rank][i] for rank in range(2)] for i, r in enumerate(runs)}


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("variant", [*VARIANTS, "bucketed[param]"])
def test_ddp_in_half_precision_reproduces_the_serial_run(ddp_runs, mode: str, variant: str) -> None:
    records = ddp_runs[(mode, variant)]
    print(f"ddp {variant} {mode}: {_close(records[0]['losses'], mode):.4f} u")
    _same_steps(records, mode)
    n = records[0]["num_parameters"]
    # naive, fused and torch reduce the half .grad; bucketed its gradient buffer, fp32 unless asked otherwise
    width = 4 if variant == "bucketed" else 2
    assert records[0]["grad_bytes"] == width * n
    if variant != "torch":
        assert all(r["comm_bytes"] == [width * n] * STEPS for r in records)  # ... exactly, every step
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


#: pp=2, m=4: 1F1B and ZB-H1 in both half modes, every other schedule in bf16 (gradient buffers: the defaults).
PIPELINE_CASES = [(m, s) for m in MODES for s in ("1f1b", "zb-h1")] + [
    ("bf16", s) for s in ("naive", "gpipe", "interleaved", "dualpipev")]
V_SHAPED = ("interleaved", "dualpipev")  # two stages per rank


@pytest.fixture(scope="module")
def pipeline_runs() -> dict[tuple[str, str], list[dict]]:
    """Every case of :data:`PIPELINE_CASES` in one 2-process launch."""
    # interleaved and DualPipeV: 2 ranks x 2 stages each need 4 blocks (compared with a 4-block serial run)
    runs = [{"schedule": s, "precision": m, **({"virtual_stages": 2, "n_layer": 4} if s in V_SHAPED else {})}
            for m, s in PIPELINE_CASES]
    res = PP.run(2, runs=runs, output="none", timeout=300, pp=2, microbatches=4, **SMALL)
    return {(r["precision"], r["schedule"]): [res[rank][i] for rank in range(2)] for i, r in enumerate(runs)}


@pytest.mark.parametrize("mode, schedule", PIPELINE_CASES)
def test_pipeline_in_half_precision_reproduces_the_serial_run(pipeline_runs, mode: str, schedule: str) -> None:
    records = pipeline_runs[(mode, schedule)]
    n_layer = 4 if schedule in V_SHAPED else SMALL["n_layer"]
    print(f"pp=2 {schedule} {mode}: {_close(records[0]['losses'], mode, n_layer):.4f} u")
    _same_steps(records, mode, n_layer)
    m = 4  # m activations forward and m gradients backward, each (B/m) x T x C half-precision numbers,
    # over every stage boundary that crosses this rank: one (two stages), interleaved three (0|1|2|3 on ranks
    # 0, 1, 0, 1), DualPipeV two (0|1 and 2|3 cross; 1|2 is a hand-over on rank 1)
    k = {"interleaved": 3, "dualpipev": 2}.get(schedule, 1)
    assert all(r["pp_comm_bytes"] == [2 * k * m * (B // m) * T * C * 2] * STEPS for r in records)


@pytest.fixture(scope="module")
def four_process_runs() -> dict[tuple[str, str], list[dict]]:
    """dp=2 x tp=2 with sequence parallelism in fp16 and bf16 (dp=2 x pp=2 ZB-H1: tests/test_recipe_pipeline.py).

    The API defaults throughout: gradients in fp32 buffers, the SP and dp syncs reducing them
    in place. (With half ``.grad`` and a ``main_grad`` hook that freed it, these syncs once reduced
    nothing and the replicas drifted apart silently: issue 19.)
    """
    res = TP.run(4, runs=[{"precision": m} for m in MODES], output="none", timeout=300, tp=2, dp=2,
                 sequence_parallel=True, **SMALL)
    return {(m, "dp2-tp2-sp"): [res[rank][i] for rank in range(4)] for i, m in enumerate(MODES)}


@pytest.mark.parametrize("case", ["dp2-tp2-sp"])
@pytest.mark.parametrize("mode", MODES)
def test_data_parallel_over_tp_and_pp_in_half_precision_reproduces_the_serial_run(four_process_runs, mode: str,
                                                                                   case: str) -> None:
    records = four_process_runs[(mode, case)]
    print(f"{case} {mode}: {_close(records[0]['losses'], mode):.4f} u")
    _same_steps(records, mode)
    assert all(r["dp_size"] == 2 for r in records)
    # the dp average reduces the fp32 buffers: 4 bytes per parameter of this rank, every step
    assert all(r["dp_comm_bytes"] == [4 * r["num_parameters"]] * STEPS for r in records)
