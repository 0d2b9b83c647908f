"""``lslm bench pipeline`` smoke run: one tiny launch at p = 2 (gloo), its files, the ratio line, exact counts; no
timings."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from lslm.bench import pipeline as P
from lslm.pipeline.timeline import Timeline

NAMES = [name for name, *_ in P.PAIRS]


def test_bench_pipeline_quick_writes_table_json_png_and_the_ratio_line(tmp_path: Path,
                                                                        capsys: pytest.CaptureFixture[str]) -> None:
    results = P.run((2,), (2, 4), quick=True, repeats=1, warmup=0, out_dir=tmp_path, timeout=240)
    lines = capsys.readouterr().out.strip().splitlines()
    # Every pair at the largest m it ran at (DualPipeV needs m >= 2p = 4: skipped at m=2).
    entry = r"p=2 m=4 \d+\.\d\dx"
    want = ("lslm / torch pipelining step time: " + "; ".join(f"{re.escape(n)} {entry}" for n in NAMES)
            + r" \| time model worst \|predicted - measured\| / measured at p=2: \d+\.\d% \(\S+ m=\d\) with in-step "
            r"message times, \d+\.\d% \(\S+ m=\d\) with the collectives' alpha-beta fit")
    assert re.fullmatch(want, lines[-1]), lines[-1]
    assert P.PAIR_NAMES == tuple(NAMES)  # the report's order is the bench's
    for suffix in ("txt", "json", "png"):
        assert (tmp_path / f"pipeline.{suffix}").is_file()
    saved = json.loads((tmp_path / "pipeline.json").read_text())["2"]
    assert saved["p"] == 2 and saved["microbatches"] == [2, 4]

    res = results[2]
    rows = {(r["pair"], r["m"]): r for r in res["rows"]}
    assert sorted(rows) == sorted([(n, 4) for n in NAMES] + [(n, 2) for n in NAMES if n != "DualPipeV"])
    assert list(res["skipped"]["2"]) == ["DualPipeV"] and res["skipped"]["4"] == {}
    assert all(r["throughput"]["devices"] == 2 and r["throughput"]["mfu"] > 0 for r in rows.values())
    assert any(x.startswith("  lslm 1F1B m=4: tokens/s ") and ", MFU " in x for x in lines)  # the harness's line
    mod, batch = res["model"], res["batch"]
    for (name, m), r in rows.items():
        # Same stages, same weights, same batches: lslm and torch compute the same loss (fp32 rounding at most).
        assert r["max_loss_diff"] <= 1e-5, name
        # Rank 0 per step: m activations out and m gradients in per stage boundary it sits on (DualPipeV's rank 0
        # holds the first and the last stage: two boundaries; interleaved v=2: stage 0 and stage 2, three).
        crossings = {"DualPipeV": 2, "Interleaved1F1B": 3}.get(name, 1)
        msg = batch // m * mod["block_size"] * mod["n_embd"] * 4
        assert r["pp_comm_calls_rank0"] == 2 * m * crossings, name
        assert r["pp_comm_bytes_rank0"] == 2 * m * crossings * msg, name
        # Bubble fractions: measured from lslm's timeline, simulated for the same (p, m, v).
        assert 0.0 <= r["bubble_measured"] < 1.0
        assert 0.0 <= r["bubble_simulated"] < 1.0 and 0.0 <= r["bubble_simulated_measured_costs"] < 1.0
        timeline = Timeline.from_dict(r["timeline"])
        assert timeline.num_ranks == 2 and timeline.bubble_fraction() == pytest.approx(r["bubble_measured"])
        assert len([e for e in timeline.compute() if e.kind == "F"]) == m * 2 * r["v"]  # every (stage, mb) once
        # The time model: the simulator with each stage's measured costs and priced messages, beside the measured.
        assert r["message_bytes"] == msg and r["model_ms"] > 0
        assert r["model_error"] == pytest.approx((r["model_ms"] - r["lslm_ms"]) / r["lslm_ms"])
        assert r["model_in_step_error"] == pytest.approx((r["model_in_step_ms"] - r["lslm_ms"]) / r["lslm_ms"])
        # Both models are a simulated span plus the same measured time outside the schedule.
        assert r["model_ms"] == pytest.approx(r["model_span_ms"] + r["outside_ms"])
        assert r["model_in_step_ms"] == pytest.approx(r["model_span_in_step_ms"] + r["outside_ms"])
        assert len(r["bubble_measured_all"]) == len(r["lslm_ms_all"])  # one recorded twin step per timed step
        assert sorted(map(int, r["stage_costs_ms"])) == list(range(2 * r["v"]))
        assert r["message_in_step_ms"] is not None and r["message_in_step_ms"] >= 0
        fit = res["p2p_fit"]
        assert fit is not None and r["model_message_ms"] == pytest.approx(
            1e3 * (fit["alpha_s"] + msg * fit["beta_s_per_byte"]))
    # With equal F, B costs GPipe and 1F1B have the textbook bubble (p - 1) / (m + p - 1).
    assert rows[("GPipe", 4)]["bubble_simulated"] == pytest.approx(1 / 5)
    assert rows[("1F1B", 2)]["bubble_simulated"] == pytest.approx(1 / 3)


def test_bench_pipeline_refuses_bad_settings_before_any_launch() -> None:
    with pytest.raises(ValueError, match="a pipeline needs at least two stages"):
        P.run((1, 2), quick=True, out_dir=None)
    with pytest.raises(ValueError, match="microbatches must be an integer >= 1, got 0"):
        P.run((2,), (0,), quick=True, out_dir=None)
    with pytest.raises(ValueError, match="no schedule pair runs at p=4"):  # 3 does not divide the batch of 8
        P.run((4,), (3,), quick=True, out_dir=None)
    with pytest.raises(ValueError, match="repeats must be an integer >= 1, got 0"):
        P.run((2,), quick=True, repeats=0, out_dir=None)


def test_time_model_is_the_simulated_makespan_plus_priced_messages() -> None:
    from lslm.pipeline.schedules import build_schedule

    s = build_schedule("1f1b", 2, 4)
    even = {0: {"F": 1.0, "B": 2.0}, 1: {"F": 1.0, "B": 2.0}}
    # Free messages: the closed form, (m + p - 1)(F + B).
    assert P.predict_step_s(s, even, 0.0) == pytest.approx(5 * 3.0)
    # Priced messages: each boundary crossing on the critical path (five here) adds one, plus the loss broadcast.
    assert P.predict_step_s(s, even, 0.1) == pytest.approx(15.0 + 5 * 0.1 + 0.1)
    assert P.p2p_seconds({"alpha_s": 1e-4, "beta_s_per_byte": 1e-9}, 1000) == pytest.approx(1e-4 + 1e-6)
    assert P.p2p_seconds(None, 1000) == 0.0


def test_message_time_inside_a_step_counts_from_both_ends_posted() -> None:
    from lslm.pipeline.timeline import Event

    events = [Event(0, "SEND_F", 0, 0, 1.0, 1.1), Event(1, "RECV_F", 1, 0, 0.5, 1.5),  # receive posted first: 0.5
              Event(1, "SEND_B", 1, 0, 2.0, 2.1), Event(0, "RECV_B", 0, 0, 3.0, 3.25),  # receive posted late: 0.25
              Event(0, "F", 0, 0, 0.0, 1.0)]
    assert P.measured_message_s(Timeline(2, events)) == pytest.approx((0.5 + 0.25) / 2)
    assert P.measured_message_s(Timeline(2, events[-1:])) is None
    assert P.in_step_messages_s([Timeline(2, events)] * 2) == pytest.approx([0.5, 0.25] * 2)


def test_compute_overhead_is_the_median_gap_after_an_action() -> None:
    from lslm.pipeline.timeline import Event

    events = [Event(0, "F", 0, 0, 0.0, 1.0), Event(0, "SEND_F", 0, 0, 1.2, 1.3),  # 0.2 after F
              Event(0, "F", 0, 1, 1.4, 2.0), Event(0, "B", 0, 1, 2.1, 3.0),  # 0.1 after F; B is rank 0's last
              Event(1, "RECV_F", 1, 0, 0.0, 1.3), Event(1, "F", 1, 0, 1.3, 2.0), Event(1, "B", 1, 0, 2.4, 3.0)]
    assert P.compute_overhead_s([Timeline(2, events)]) == pytest.approx(0.2)  # gaps 0.2, 0.1, 0.4
    assert P.compute_overhead_s([Timeline(2, events[:1])]) == 0.0
    from lslm.pipeline.schedules import build_schedule

    s = build_schedule("gpipe", 2, 4)
    even = {0: {"F": 1.0, "B": 2.0}, 1: {"F": 1.0, "B": 2.0}}
    assert P.predict_step_s(s, even, 0.0, compute_overhead_s=0.5) == pytest.approx(15.0 + 9 * 0.5)
