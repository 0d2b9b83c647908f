"""The GPU-calibrated time model: the calibration at its measured points, the validation rows, uneven stages."""

import dataclasses
import json
import shutil
from dataclasses import replace
from pathlib import Path

import pytest

from lslm.plan import estimate
from lslm.plan.gpu_calibration import H200_CALIBRATION
from lslm.plan.hardware import hardware_presets
from lslm.plan.layout import Layout, check_layout, layers_on_stage
from lslm.plan.memory import stage_params
from lslm.plan.model import ModelSpec
from lslm.plan.published import PUBLISHED_TOLERANCE, validate_published
from lslm.plan.validate_gpu import GPU_TIME_TOLERANCE, validate_gpu
from lslm.plan.validate_memory import (
    GPU_FILES,
    MEMORY_TOLERANCE,
    load_gpu_rows,
    recompute_file,
    recompute_rows,
    reserved_ratio_range,
)

GPU = Path(__file__).resolve().parents[1] / "bench" / "results" / "gpu"


def test_calibration_reproduces_the_measured_tables_at_their_points():
    data = json.loads((GPU / "h200_2026-11-28.json").read_text())
    peak = data["peak_bf16_dense"]
    assert H200_CALIBRATION.peak_flops == peak
    for r in data["gemm"]:
        got = H200_CALIBRATION.gemm_efficiency(r["gemm"], r["tokens"], r["n"], r["k"])
        assert got == pytest.approx(r["tflops"] * 1e12 / peak, abs=5e-5)
    for r in data["attention"]:
        got = H200_CALIBRATION.attention_efficiency(r["seq"], r["head_dim"])
        assert got == pytest.approx(r["tflops"] * 1e12 / peak, abs=5e-5)
    for r in data["adamw"]:
        assert H200_CALIBRATION.optimizer_Bps(r["params"]) == pytest.approx(r["gbytes_per_s"] * 1e9, rel=5e-5)
    # between points: inside the neighbours' range; outside the table: its edge
    mid = H200_CALIBRATION.gemm_efficiency("fc1", 4096, 4 * 1536, 1536)
    corners = [H200_CALIBRATION.gemm_efficiency("fc1", t, 4 * h, h) for t in (2048, 8192) for h in (1024, 2048)]
    assert min(corners) <= mid <= max(corners)
    assert H200_CALIBRATION.attention_efficiency(10**6, 128) == H200_CALIBRATION.attention_efficiency(32768, 128)


def test_single_gpu_step_times_and_peaks_are_what_the_module_reports():
    rows = validate_gpu(load_gpu_rows(GPU))
    assert len(rows) == 11
    for r in rows:
        assert r["error"] == pytest.approx(r["predicted_ms"] / r["measured_ms"] - 1)
        assert abs(r["peak_error"]) <= MEMORY_TOLERANCE
        if r["in_target"]:
            assert abs(r["error"]) <= GPU_TIME_TOLERANCE, r
            assert r["floor_ms"] is None
        else:  # full recomputation replayed (and differentiated) in fp32: above the fp32-peak floor, far above bf16
            assert r["config"].endswith("full") and r["error"] < -0.5
            assert r["predicted_ms"] < r["floor_ms"] < r["measured_ms"]
    assert sum(not r["in_target"] for r in rows) == 2


def test_recompute_runs_that_recorded_their_dtypes_are_judged_by_them(tmp_path):
    """A gpu-check record (lslm.bench.calibrate.gpt_recompute) carries the dtypes its replays ran in: a full run
    whose matmuls were all bf16 is in the target; one with fp32 flops is out, with the share it recorded."""
    shared = json.loads((GPU / "h200_recompute_2026-11-28.json").read_text())
    def record(dtypes):
        runs = [dict(r, matmul_flops_by_dtype=dtypes, attention_calls_by_dtype={"bfloat16": 1}) for r in shared["rows"]]
        return {"device": "NVIDIA H200", "recompute": runs + [{"name": "oom", "recompute": "full", "error": "OOM"}]}
    runs = [dict(r, source="recompute") for r in recompute_rows(record({"bfloat16": 3}))]
    assert len(runs) == 6  # the failed run is left out
    rows = validate_gpu(runs)
    assert all(r["in_target"] and r["floor_ms"] is None and r["outside"] is None for r in rows)
    fp32 = validate_gpu([dict(r, source="recompute") for r in recompute_rows(record({"bfloat16": 1, "float32": 3}))])
    assert [r["in_target"] for r in fp32] == [True, True, False] * 2  # only the full runs replay
    assert all("75% of its matmul flops ran in fp32" in r["outside"] for r in fp32 if not r["in_target"])
    old = validate_gpu(load_gpu_rows(GPU))  # the committed file recorded nothing: measured before the fix
    assert all("before replays re-entered autocast" in r["outside"] for r in old if not r["in_target"])
    # a newer gpu-check record of an H200 that measured every run replaces the 2026-11-28 file; dry runs and runs
    # with a failed size do not
    folder = tmp_path / "gpu"
    folder.mkdir()
    for name in GPU_FILES:
        shutil.copy(GPU / name, folder / name)
    assert recompute_file(folder).name == GPU_FILES[0]
    good = dict(record({"bfloat16": 3}), date="2026-12-01", dry_run=False)
    good["recompute"] = good["recompute"][:-1]  # no failed size
    (folder / "gpu-check_h200_2026-12-01_calibrate-recompute.json").write_text(json.dumps(good))
    (folder / "gpu-check_h200_2026-12-02.json").write_text(json.dumps(dict(good, date="2026-12-02", dry_run=True)))
    (folder / "gpu-check_h200_2026-12-03.json").write_text(json.dumps(dict(record({"bfloat16": 3}), date="2026-12-03",
                                                                          dry_run=False)))
    newest = "gpu-check_h200_2026-12-01_calibrate-recompute.json"
    assert recompute_file(folder).name == newest
    loaded = load_gpu_rows(folder)
    assert {r["file"] for r in loaded if r["source"] == "recompute"} == {newest}
    assert all(r["in_target"] for r in validate_gpu(loaded))
    with pytest.raises(ValueError, match="measured on 'NVIDIA A100"):
        recompute_rows({"device": "NVIDIA A100-SXM4-80GB", "rows": []})
    with pytest.raises(ValueError, match="no recomputation runs"):
        recompute_rows({"device": "NVIDIA H200", "gpt": []})


H100_8 = "torchtitan h100_202412 Table 1, 8B FSDP, 8 GPUs"
H100_128 = "torchtitan h100_202412 Table 3, 8B FSDP, 128 GPUs"
A100_70B_OP = "torchtitan performance.md, Llama 2 70B, 64 A100, op AC"


@pytest.fixture(scope="module")
def published():
    return validate_published()


def test_published_runs_errors_and_verdicts(published):
    assert len(published) >= 6 and len({r["source"].split(" Table")[0].split(" docs")[0] for r in published}) >= 4
    for r in published:
        assert r["error"] == pytest.approx(r["predicted_s"] / r["published_s"] - 1)
    target = [r for r in published if r["in_target"]]
    assert len(target) == len(published) == 18  # none marked outside
    assert all(r["fits"] for r in published)  # each was trained
    assert all(abs(r["error"]) <= PUBLISHED_TOLERANCE for r in published), [
        (r["source"], r["error"]) for r in published if abs(r["error"]) > PUBLISHED_TOLERANCE]
    rows = {r["source"]: r for r in published}
    # the file states no rate for its 500 W HBM2e H100s, only that it lies between the SXM's and the NVL's: priced at
    # both ends, the eager block counted op by op, each row is within the target either way
    for r in (rows[H100_8], rows[H100_128]):
        (nvl,) = r["what_if"]
        assert r["error"] < nvl["error"] and nvl["fits"] and nvl["predicted_s"] > r["predicted_s"]
        assert abs(nvl["error"]) <= PUBLISHED_TOLERANCE and "500 W" in r["assumptions"]
    # the Llama 2 70B run at local batch 1 gathers 70B parameters per micro-batch of 4,096 tokens: priced with one
    # adapter's 25 GB/s per ring it was the network's (+89.5 %); its rings use a node's eight adapters at once
    slow = rows[A100_70B_OP]
    one_adapter = dataclasses.replace(hardware_presets()["a100-80gb"], adapter_per_device=False)
    from lslm.plan.published import TORCHTITAN
    run = next(r for r in TORCHTITAN if r.source == A100_70B_OP)
    network_bound = estimate(run.model, run.layout, one_adapter, run.layout.world).step_s
    assert network_bound / run.published_step_s - 1 == pytest.approx(0.895, abs=5e-4)
    assert slow["predicted_s"] < network_bound / 2
    # every A100 row of torchtitan's table is also priced at 400 Gb/s; where compute hides the traffic at both
    # rates (full checkpointing of the 70Bs), the network changes nothing
    a100 = [r for r in published if "performance.md" in r["source"]]
    assert len(a100) == 6 and all(len(r["what_if"]) == 1 for r in a100)
    for r in a100:
        if "70B" in r["source"] and "full" in r["source"]:
            assert r["what_if"][0]["predicted_s"] == pytest.approx(r["predicted_s"])
    eight = rows[H100_8]
    assert eight["fits"] and eight["measured_peak_gib"] == pytest.approx(82.4)
    assert eight["peak_error"] == pytest.approx(eight["peak_gb"] * 1e9 / (82.4 * 2**30) - 1)
    big = rows[H100_128]
    assert (round(eight["peak_error"], 3), round(big["peak_error"], 3)) == (-0.092, -0.118)
    low, high = reserved_ratio_range(load_gpu_rows(GPU))
    for r in (eight, big):
        assert low * r["peak_gb"] * 1e9 <= r["measured_peak_gib"] * 2**30 <= high * r["peak_gb"] * 1e9
    assert all(r["measured_peak_gib"] is None for r in target if "Narayanan" in r["source"])


def test_a_row_set_aside_is_still_printed_and_counted():
    """PublishedRun.outside keeps a row out of the target with its reason printed, and the last line still counts
    it among the rows (none is set aside now; a row whose source cannot settle it would be)."""
    from lslm.plan.published import PUBLISHED, format_published

    aside = dataclasses.replace(PUBLISHED[0], outside="the reason")
    rows = validate_published((aside, PUBLISHED[1]))
    assert [r["in_target"] for r in rows] == [False, True]
    text = format_published(rows)
    assert "    - outside the target: the reason" in text
    assert text.splitlines()[-1].startswith("(* beyond 25%) 2 of 2 published runs within 25%, 1 outside the target")


def test_published_rows_model_what_was_run():
    from lslm.plan.published import PUBLISHED, published_hardware

    rows = {r.source: r for r in PUBLISHED}
    hw = {**hardware_presets(), **published_hardware()}
    # Megatron-LM 2021: the data-parallel all-reduce follows the backward, exposed whole (one micro-batch per step)
    nar = rows["Narayanan 2021 Table 1, 1.7B"]
    assert not nar.layout.dp_overlap
    with pytest.raises(ValueError, match="dp_overlap"):
        Layout(dp_overlap="no")
    est = estimate(nar.model, nar.layout, hw["a100-80gb"])
    overlapped = estimate(nar.model, replace(nar.layout, dp_overlap=True), hw["a100-80gb"])
    assert overlapped.times["dp"].value == 0.0
    assert est.times["dp"].value == pytest.approx(est.comm["dp"].time_s) and est.comm["dp"].time_s > 0
    # Llama 3: one-layer chunks (v = 8), bubble (PP - 1)/(V M) of compute
    llama = rows["Llama 3 Table 4, 16,384 GPUs, TP 8 CP 1 PP 16 DP 128"]
    assert llama.layout.v == 8
    est = estimate(llama.model, llama.layout, hw["h100-sxm"])
    assert est.times["bubble"].value / est.times["compute"].value == pytest.approx(15 / (8 * 16))
    assert hw["h100-96gb-hbm2e"].hbm_bytes == 96 * 2**30
    # Megatron-LM's loss in place on the fp32 logits (6 bytes per logit at its peak), for its papers' rows
    assert {r.model.loss for r in PUBLISHED if "Narayanan" in r.source or "Korthikanti" in r.source} == {"megatron"}
    # the torchtitan models are the released checkpoints' shapes: Hugging Face's parameter counts
    from lslm.plan.params import param_parts

    counts = {r.model.name: param_parts(r.model).total for r in PUBLISHED if "performance.md" in r.source}
    assert counts == {"Llama-3 8B": 8_030_261_248, "Llama 3 70B": 70_553_706_496, "Llama 2 13B": 13_015_864_320,
                      "Llama-2 70B": 68_976_648_192}
    assert {r.layout.recompute for r in PUBLISHED if "performance.md" in r.source} == {"op", "full", "none"}

def test_uneven_pipeline_stages():
    model = ModelSpec(126, 1024, 16, 32000, 1024, micro_batch=1, global_batch=32)
    uneven = Layout(pp=16, stage_layers=(7,) + (8,) * 14 + (7,))
    check_layout(model, uneven)
    assert [layers_on_stage(model, uneven, s) for s in (0, 1, 15)] == [7, 8, 7]
    assert stage_params(model, uneven, 1) < stage_params(model, uneven, 0)  # stage 0 also holds the embedding
    with pytest.raises(ValueError, match="n_layer=126"):
        check_layout(model, Layout(pp=16, stage_layers=(8,) * 16))
    with pytest.raises(ValueError, match="16 ints"):
        Layout(pp=16, stage_layers=(7, 8))
    with pytest.raises(ValueError, match="divisible"):
        check_layout(model, Layout(pp=16))
    est = estimate(model, uneven, hardware_presets()["h100-sxm"])
    assert len(est.stages) == 16 and est.memory.stage == 1  # 15 micro-batches of 8 layers beat 16 of 7


def test_search_tries_uneven_stages_and_zero_with_pp():
    from lslm.plan.search import search, uneven_stages

    assert uneven_stages(126, 16) == (7,) + (8,) * 14 + (7,)
    assert uneven_stages(127, 16) == (7,) + (8,) * 15
    assert uneven_stages(128, 16) is None and uneven_stages(120, 16) is None
    model = ModelSpec(14, 256, 8, 1000, 128, micro_batch=1, global_batch=8)
    hw = hardware_presets()["h100-sxm"]
    found = search(model, hw, 8, micro_batches=(1,), recompute=("none",), virtual_stages=(1,), top=1000,
                   zero_with_pp=True, max_tp=1)
    assert any(e.layout.pp == 4 and e.layout.stage_layers == (3, 4, 4, 3) for e in found)
    assert any(e.layout.pp > 1 and e.layout.zero >= 2 for e in found)


def test_breakdown_reads_the_profiled_steps():
    from lslm.plan.validate_gpu import BREAKDOWN_FILE, breakdown

    data = json.loads((GPU / BREAKDOWN_FILE).read_text())
    rows = breakdown(GPU)
    assert [r["config"] for r in rows] == ["24 x 1024, b=8", "24 x 2048, b=8"]
    assert rows[1]["step"][0] == data["gpt_24x2048_b8"]["step_s"]
    assert rows[0]["gemm"][0] == data["gpt_24x1024_b8"]["kernel_s"]["gemm"]


def test_precision_semantics_are_explicit():
    from lslm.plan.calibrated import elementwise_bytes, optimizer_bytes

    model = ModelSpec(4, 1024, 16, 50304, 2048)
    autocast, masters = Layout(mixed="autocast"), Layout(mixed="masters")
    assert (optimizer_bytes(autocast), optimizer_bytes(masters)) == (28, 30)  # + the half copy of the masters
    h, f = 1024, 4096  # autocast: fp32 residual (2 norms 16h, 2 adds 24h), 2 casts 12h; masters: all half
    assert elementwise_bytes(model, autocast)[0] == 16 * h + 24 * h + 12 * h + 2 * 2 * f + 4 * h
    assert elementwise_bytes(model, masters)[0] == 8 * h + 12 * h + 2 * 2 * f + 4 * h


def test_unfused_attention_is_its_matmuls_and_its_passes_over_the_scores():
    """Without flash attention the core is priced as Megatron-LM ran it: the whole s x s square's two matmuls, and the
    scale-mask-softmax and dropout passes over every score at the streaming rate, counted by hand here."""
    from lslm.plan.calibrated import microbatch_times, unfused_attention_seconds

    spec = ModelSpec(2, 1024, 16, 50304, 2048, micro_batch=4, global_batch=4, dropout=True)
    cal, peak = H200_CALIBRATION, H200_CALIBRATION.peak_flops
    rate = cal.attention_efficiency(2048, 64) * peak
    for layout, e in ((Layout(tp=2, precision="bf16"), 2), (Layout(tp=2, mixed="autocast"), 4)):
        scores = 4 * (16 / 2) * 2048 * 2048
        matmul = 4 * 4 * 2048**2 * 1024 / 2 / rate
        fwd, bwd = unfused_attention_seconds(spec, layout, rate, cal.hbm_Bps)
        assert fwd == pytest.approx(matmul + scores * (4 * e + 1) / cal.hbm_Bps)
        assert bwd == pytest.approx(2 * matmul + scores * (5 * e + 1) / cal.hbm_Bps)
    no_dropout = replace(spec, dropout=False)
    fwd, bwd = unfused_attention_seconds(no_dropout, Layout(precision="bf16"), rate, cal.hbm_Bps)
    assert fwd == pytest.approx(4 * 4 * 2048**2 * 1024 / rate + 4 * 16 * 2048**2 * 4 / cal.hbm_Bps)
    # selective recomputation replays the forward of the core; flash attention costs less than the unfused core
    for recompute, replays in (("none", 0), ("selective", 1)):
        t = microbatch_times(spec, Layout(precision="bf16", recompute=recompute), cal, 2, head=False)
        f, b = unfused_attention_seconds(spec, Layout(precision="bf16"), rate, cal.hbm_Bps)
        assert t.attention == pytest.approx(2 * (f + b + replays * f))
    flash = microbatch_times(spec, Layout(precision="bf16", flash_attention=True), cal, 2, head=False)
    assert flash.attention < microbatch_times(spec, Layout(precision="bf16"), cal, 2, head=False).attention
