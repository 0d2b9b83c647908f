"""The calculator's time model against the committed TP, pipeline and ZeRO bench step times (issue 22, Validation).

Deterministic: everything is read from ``bench/results/*.json`` (quiet measurements committed with the command
that made them); no timing is taken here. The hand computations below rebuild three rows from the cpu-box's
numbers and the benches' own configurations, so a wrong term in the calculator shows as a mismatch.
"""

from __future__ import annotations

import dataclasses
import math

import matplotlib
import pytest

matplotlib.use("Agg")

from lslm.cli import main  # noqa: E402
from lslm.plan import Hardware, Layout, Link, ModelSpec, estimate, hardware_presets  # noqa: E402
from lslm.plan.memory import stage_params  # noqa: E402
from lslm.plan.timing import core_share  # noqa: E402
from lslm.plan.validate import TOLERANCE, calibrated_from, format_validation, load_results, validate  # noqa: E402

#: beyond 20 %, and why: none since the calculator times offload's host and disk copies (rates from
#: zero_offload.json) and prices gloo's collectives off collectives.json's measured table where it brackets the
#: size. A row that falls out again must be named here with its reason.
KNOWN_MISSES: set[tuple[str, str]] = set()


@pytest.fixture(scope="module")
def results() -> dict:
    return load_results()


@pytest.fixture(scope="module")
def rows(results: dict) -> list:
    return validate(results)


def _row(rows: list, bench: str, config: str) -> dict:
    return next(r for r in rows if r["bench"] == bench and r["config"] == config)


def test_cpu_box_preset_is_the_calibration_of_the_committed_results(results: dict) -> None:
    preset, fresh = hardware_presets()["cpu-box"], calibrated_from(results)
    assert preset.cores == fresh.cores == 2
    assert preset.peak_flops["fp32"] == pytest.approx(fresh.peak_flops["fp32"], rel=1e-3)
    assert preset.layer_overhead_s == pytest.approx(fresh.layer_overhead_s, rel=1e-3)
    assert preset.optimizer_Bps == pytest.approx(fresh.optimizer_Bps, rel=1e-3)
    for mine, theirs in ((preset.intra, fresh.intra), (preset.inter, fresh.inter)):
        assert (mine.alpha_s, mine.bandwidth_Bps) == pytest.approx((theirs.alpha_s, theirs.bandwidth_Bps), rel=1e-3)
        assert [n for n, *_ in mine.per_algorithm] == [n for n, *_ in theirs.per_algorithm]
        for (_, a, bw), (_, a2, bw2) in zip(mine.per_algorithm, theirs.per_algorithm):
            assert (a, bw) == pytest.approx((a2, bw2), rel=1e-3)
    assert preset.host_copy_Bps == pytest.approx(fresh.host_copy_Bps, rel=1e-3)
    assert preset.disk_Bps == pytest.approx(fresh.disk_Bps, rel=1e-3)
    for mine, theirs in ((preset.intra, fresh.intra), (preset.inter, fresh.inter)):
        assert [(a, n) for a, n, _ in mine.measured] == [(a, n) for a, n, _ in theirs.measured]
        for (*_, points), (*_, points2) in zip(mine.measured, theirs.measured):
            assert [x for pt in points for x in pt] == pytest.approx([x for pt in points2 for x in pt], rel=1e-3)
    assert {n for _, n, _ in preset.intra.measured} == {2} and {n for _, n, _ in preset.inter.measured} == {4}
    # the p2p link is the collectives bench's own stored fit, at 2 and 4 processes
    assert preset.intra.alpha_s == pytest.approx(results["collectives"]["2"]["fit"]["alpha_s"], rel=1e-3)
    assert preset.inter.alpha_s == pytest.approx(results["collectives"]["4"]["fit"]["alpha_s"], rel=1e-3)


def test_one_row_per_lslm_configuration_with_the_measured_time(results: dict, rows: list) -> None:
    expected = []
    for t, res in results["tp"].items():
        expected += [("tp", f"tp={t} SP {'on' if r['sequence_parallel'] else 'off'}", r["step_ms"])
                     for r in res["rows"] if r["variant"] == "lslm"]
    for p, res in results["pipeline"].items():
        expected += [("pipeline", f"p={p} {r['pair']} m={r['m']}", r["lslm_ms"]) for r in res["rows"]]
    for n, res in results["zero"].items():
        expected += [("zero", f"dp={n} {r['entry']}", r["step_ms"]) for r in res["rows"]
                     if r["entry"] == "ddp" or r["entry"].startswith("zero")]
    assert sorted((r["bench"], r["config"], r["measured_ms"]) for r in rows) == sorted(expected)
    assert len(rows) == 35
    for r in rows:
        assert r["error"] == pytest.approx(r["predicted_ms"] / r["measured_ms"] - 1)
        assert r["predicted_ms"] == pytest.approx(r["terms_ms"]["step"])


def test_tp_row_by_hand(results: dict, rows: list) -> None:
    """tp=2, no SP: compute + 20 all-reduces + the SGD step, from the preset's numbers."""
    hw, res = hardware_presets()["cpu-box"], results["tp"]["2"]
    m, b, s, t = res["model"], res["batch"], res["seq"], 2
    h, L, V = m["n_embd"], m["n_layer"], m["vocab_size"]
    rate, (cf, cb) = hw.peak_flops["fp32"], hw.layer_overhead_s
    layer = 2 * b * s * 12 * h * h + 4 * b * s * s * h
    compute = L * (3 * layer / t / rate + cf + cb) + 3 * 2 * b * s * h * V / t / rate + cf + cb
    ring = hw.intra.for_algorithm("all_reduce_ring")  # 2 processes: the 2-process fit of gloo's all-reduce
    alpha, bw = ring.alpha_s, ring.bandwidth_Bps
    a = 4 * s * b * h
    assert a == 2 * 65536  # between collectives.json's 64 KiB and 1 MiB all-reduces at 2 processes: read off them
    measured = {r["bytes"]: r["time_s"] for r in results["collectives"]["2"]["rows"]
                if r["algorithm"] == "torch.all_reduce"}
    at_a = measured[65536] * (measured[2**20] / measured[65536]) ** 0.25  # log 2 / log 16 of the way up
    assert 4 * s * b < min(measured)  # the cross-entropy's small all-reduces are below the table: the fit
    comm = (4 * L + 2) * at_a + sum(2 * alpha + size / bw for size in [4 * s * b, 8 * s * b])
    lslm = next(r for r in res["rows"] if r["variant"] == "lslm" and not r["sequence_parallel"])
    assert lslm["collectives_per_step"] == 4 * L + 4  # what the bench's ledger counted
    spec = ModelSpec(L, h, m["n_head"], V, s, micro_batch=b, global_batch=b, max_positions=s, dropout=False)
    params = stage_params(spec, Layout(tp=t), 0)
    assert params * 4 == lslm["params_bytes"]  # the calculator's parameters per rank are the bench's
    optimizer = params * 32 / hw.optimizer_Bps
    # rel 1e-4: the preset holds the measured table rounded to 4 digits
    assert _row(rows, "tp", "tp=2 SP off")["predicted_ms"] == pytest.approx(1e3 * (compute + comm + optimizer),
                                                                            rel=1e-4)


def test_pipeline_row_by_hand_shares_the_cores(rows: list, results: dict) -> None:
    """p=4 1F1B, m=8 on 2 cores: the schedule's (m + p - 1) T_mb is below the total work world/cores · m T_mb."""
    hw, res = hardware_presets()["cpu-box"], results["pipeline"]["4"]
    m, mb = res["model"], 8
    seqs, s, h, V = res["batch"] // mb, m["block_size"], m["n_embd"], m["vocab_size"]
    rate, (cf, cb) = hw.peak_flops["fp32"], hw.layer_overhead_s
    layer = 2 * seqs * s * 12 * h * h + 4 * seqs * s * s * h
    t_mb = 2 * (3 * layer / rate + cf + cb) + 3 * 2 * seqs * s * h * V / rate + cf + cb
    sends = 8 * (hw.inter.alpha_s + 4 * s * seqs * h / hw.inter.bandwidth_Bps)  # (2v - 1) m from the last stage
    assert 2 * mb * t_mb > (mb + 3) * t_mb
    row = _row(rows, "pipeline", "p=4 1F1B m=8")
    assert row["terms_ms"]["cores"] == pytest.approx(1e3 * (2 * mb - mb - 3) * t_mb)
    assert row["predicted_ms"] == pytest.approx(1e3 * (2 * mb * t_mb + sends))
    assert "optimizer" not in row["terms_ms"]  # the pipeline bench times no optimizer step


def test_zero_row_by_hand_exposes_all_communication(rows: list, results: dict) -> None:
    """dp=4 ZeRO-1 on 2 cores: every core computes, so the reduce-scatter and all-gather are exposed whole."""
    hw, res = hardware_presets()["cpu-box"], results["zero"]["4"]
    psi = res["num_parameters"]
    # 4 processes (more than the cores): one call each of 4Ψ bytes (one 25 MB bucket), between the 1 MiB and
    # 16 MiB rows of collectives.json at 4 processes, read off them in log time against log size
    assert 2**20 < 4 * psi < 16 * 2**20 < 25 * 2**20
    comm = 0.0
    for kind in ("reduce_scatter", "all_gather"):
        t = {r["bytes"]: r["time_s"] for r in results["collectives"]["4"]["rows"] if r["algorithm"] == f"torch.{kind}"}
        comm += t[2**20] * (t[2**24] / t[2**20]) ** (math.log(4 * psi / 2**20) / math.log(16))
    row = _row(rows, "zero", "dp=4 zero1")
    assert row["terms_ms"]["dp"] == pytest.approx(1e3 * comm, rel=1e-3)  # the preset's table: 4 digits
    assert row["terms_ms"]["optimizer"] == pytest.approx(1e3 * 2 * psi / 4 * 80 / hw.optimizer_Bps)
    assert row["terms_ms"]["cores"] == pytest.approx(row["terms_ms"]["compute"])  # share 2: twice the compute


def test_offload_row_by_hand_moves_the_benchs_bytes(rows: list, results: dict) -> None:
    """dp=2 and dp=4 ZeRO-3 offload to the host and to disk: the calculator's bytes per step are the bench's exact
    ones, timed at the rates zero_offload.json measured on another model (out of sample), times the core share."""
    hw = hardware_presets()["cpu-box"]
    for n, share in (("2", 1), ("4", 2)):
        for entry in ("zero3-offload", "zero3-disk"):
            bench = next(r for r in results["zero"][n]["rows"] if r["entry"] == entry)
            host = bench["offload_bytes"]["to_host"] + bench["offload_bytes"]["to_device"]
            disk = sum(bench["disk_bytes"].values()) if bench["disk_bytes"] else 0
            assert (entry == "zero3-disk") == (disk > 0)
            row = _row(rows, "zero", f"dp={n} {entry}")
            assert row["terms_ms"]["offload"] == pytest.approx(
                1e3 * share * (host / hw.host_copy_Bps + disk / hw.disk_Bps))
            plain = _row(rows, "zero", f"dp={n} zero3")
            assert "offload" not in plain["terms_ms"]
            assert row["predicted_ms"] == pytest.approx(plain["predicted_ms"] + row["terms_ms"]["offload"])
    glibc = {r["offload"]: r for r in results["zero_offload"]["rows"] if r["allocator"] == "glibc default"}
    step = {k: sum(r["step_ms"]) / len(r["step_ms"]) for k, r in glibc.items()}
    moved = glibc["cpu"]["to_host_bytes"] + glibc["cpu"]["to_device_bytes"]
    assert hw.host_copy_Bps == pytest.approx(moved / (step["cpu"] - step["none"]) * 1e3, rel=1e-3)


def test_within_20_percent_but_the_known_misses(rows: list) -> None:
    misses = {(r["bench"], r["config"]) for r in rows if abs(r["error"]) > TOLERANCE}
    assert misses <= KNOWN_MISSES, sorted(misses - KNOWN_MISSES)
    assert not KNOWN_MISSES  # every committed configuration within 20 %
    table = format_validation(rows)
    worst = max(rows, key=lambda r: abs(r["error"]))
    assert table.splitlines()[-1].endswith(f"worst error {worst['error']:+.1%} ({worst['bench']} {worst['config']})")
    assert f"{len(rows) - len(misses)} of {len(rows)} configurations within 20%" in table
    for r in rows:  # each printed row carries its measured and predicted time
        assert f"{r['measured_ms']:>12.1f}{r['predicted_ms']:>13.1f}" in table


def test_lslm_plan_validate_prints_the_table(capsys: pytest.CaptureFixture[str], rows: list) -> None:
    assert main(["plan", "--validate"]) == 0
    out = capsys.readouterr().out
    assert format_validation(rows).splitlines()[-1] in out.splitlines()  # the memory rows follow (test_plan_autocast)
    assert "p=4 Interleaved1F1B m=8" in out and "dp=2 zero3" in out and "tp=4 SP on" in out


def test_gpu_presets_keep_the_cpu_terms_off() -> None:
    hw = hardware_presets()["h100-sxm"]
    est = estimate(ModelSpec(8, 256, 8, 1000, 128, global_batch=8), Layout(dp=4, pp=2), hw)
    # no CPU terms; the optimizer step is timed at the calibration's measured fused-AdamW rate (lslm.plan.calibrated)
    assert set(est.times) == {"compute", "bubble", "pp", "dp", "optimizer", "step"}
    assert core_share(Layout(dp=4, pp=2), hw) == 1.0


def test_cpu_terms_check_their_input() -> None:
    link = Link(1e-4, 1e9, (("all_gather_ring", 2e-4, 5e8),))
    assert link.for_algorithm("all_gather_ring") == Link(2e-4, 5e8)
    assert link.for_algorithm("p2p") is link
    table = Link(1e-4, 1e9, measured=(("all_gather_ring", 4, ((1e3, 1e-3), (1e5, 4e-3))),))
    assert table.measured_time("all_gather_ring", 4, 1e4) == pytest.approx(2e-3)  # halfway in log size
    assert table.measured_time("all_gather_ring", 4, 1e5) == pytest.approx(4e-3)
    for outside in (("all_gather_ring", 4, 1e6), ("all_gather_ring", 2, 1e4), ("all_reduce_ring", 4, 1e4)):
        assert table.measured_time(*outside) is None  # beyond the sizes, another group or algorithm: the fit
    with pytest.raises(ValueError, match="increasing payload"):
        Link(1e-4, 1e9, measured=(("all_gather_ring", 4, ((1e5, 1e-3), (1e3, 4e-3))),))
    with pytest.raises(ValueError, match="disk_Bps"):
        Hardware("x", disk_Bps=-1.0)
    with pytest.raises(ValueError, match="needs zero >= 1"):
        Layout(offload="disk")
    with pytest.raises(ValueError, match="layer_overhead_s"):
        Hardware("x", layer_overhead_s=(-1.0, 0.0))
    with pytest.raises(ValueError, match="optimizer_Bps"):
        Hardware("x", optimizer_Bps=0.0)
    with pytest.raises(ValueError, match="cores"):
        Hardware("x", cores=0)
    with pytest.raises(ValueError, match="Layout.optimizer"):
        Layout(optimizer="lion")
    sgd = dataclasses.replace(hardware_presets()["cpu-box"])
    spec = ModelSpec(2, 64, 4, 100, 16)
    adam = estimate(spec, Layout(precision="fp32"), sgd).times["optimizer"].value
    assert estimate(spec, Layout(precision="fp32", optimizer="sgd-momentum"), sgd).times["optimizer"].value == \
        pytest.approx(adam * 32 / 80)
    assert math.isfinite(adam)


def test_plot_validation_has_titles_and_units(rows: list) -> None:
    import matplotlib.pyplot as plt

    from lslm.plot.plan import plot_validation

    fig = plot_validation(rows)
    assert "worst error" in fig._suptitle.get_text()
    assert fig.axes[0].get_ylabel() == "step time (ms)" and fig.axes[3].get_ylabel() == "error (%)"
    assert [ax.get_title() for ax in fig.axes[:3]] == ["tp", "pipeline", "zero"]
    with pytest.raises(ValueError, match="no rows"):
        plot_validation([])
    plt.close("all")
