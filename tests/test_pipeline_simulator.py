"""The schedule simulator, the validator and the theory: bubbles, memory, deadlocks (pure Python, no processes)."""

from __future__ import annotations

import dataclasses

import matplotlib

matplotlib.use("Agg")

import matplotlib.pyplot as plt  # noqa: E402
import pytest  # noqa: E402

from lslm.pipeline.schedules import build_schedule, check_schedule_config, schedule_from_lists  # noqa: E402
from lslm.pipeline.simulator import format_grid, ideal_timeline, simulate, time_grid  # noqa: E402
from lslm.pipeline.theory import (  # noqa: E402
    activation_memory_theory,
    activation_units_theory,
    bubble_fraction_theory,
    bubble_time_theory,
    busy_time,
    dualpipev_bubble_time_observed,
)
from lslm.pipeline.timeline import Timeline  # noqa: E402
from lslm.pipeline.validate import ScheduleError, validate_schedule  # noqa: E402
from lslm.plot.pipeline import gantt, plot_side_by_side  # noqa: E402


def configs(name, ps=range(1, 9), ms=range(1, 17), vs=range(1, 5)):
    for p in ps:
        for m in ms:
            for v in vs:
                try:
                    check_schedule_config(name, p, m, v)
                except ValueError:
                    continue
                yield p, m, v


def idle_per_rank(tl: Timeline) -> list[float]:
    return [tl.makespan() - tl.busy(r) for r in range(tl.num_ranks)]


COSTS = [None, {"F": 1, "B": 3}, {"F": 2, "B": 3}]


def test_gpipe_and_1f1b_bubble_is_exactly_p_minus_1_over_m_plus_p_minus_1():
    for name in ("gpipe", "1f1b"):
        for p, m, _ in configs(name):
            for costs in COSTS:
                tl = simulate(build_schedule(name, p, m), costs).timeline
                assert tl.bubble_fraction() == pytest.approx((p - 1) / (m + p - 1), abs=1e-12), (name, p, m, costs)
                assert bubble_fraction_theory(name, p, m, 1, costs) == pytest.approx((p - 1) / (m + p - 1))
    assert simulate(build_schedule("naive", 4, 3)).timeline.bubble_fraction() == pytest.approx(3 / 4)
    assert bubble_fraction_theory("naive", 4, 3) == pytest.approx(3 / 4)


def test_interleaved_bubble_is_p_minus_1_over_vm_plus_p_minus_1():
    # Narayanan et al. 2021 sec. 2.2.2. Strict NCCL matching reaches it with the plan's costs (F=1, B=2); other
    # ratios reach it with free messages (the theory's assumption; the comm plan was placed for F=1, B=2).
    for p, m, v in configs("interleaved"):
        want = (p - 1) / (v * m + p - 1)
        assert bubble_fraction_theory("interleaved", p, m, v) == pytest.approx(want)
        assert simulate(build_schedule("interleaved", p, m, v)).timeline.bubble_fraction() == pytest.approx(want)
    for p, m, v in configs("interleaved", ps=(2, 4), ms=(4, 8)):
        for costs in COSTS[1:]:
            tl = ideal_timeline(build_schedule("interleaved", p, m, v), costs)
            assert idle_per_rank(tl) == pytest.approx([bubble_time_theory("interleaved", p, m, v, costs)] * p)


def test_zb_h1_bubble_matches_qi_et_al():
    # Qi et al. 2023 sec. 2.1: with T_F = T_B = T_W, ZB-H1's bubble is a third of 1F1B's; bubble rate (p-1)/(3m).
    unit = {"F": 1, "B": 2, "I": 1, "W": 1}
    for p, m, _ in configs("zb-h1"):
        zb = simulate(build_schedule("zb-h1", p, m), unit).timeline
        if m >= p:
            assert idle_per_rank(zb) == pytest.approx([p - 1] * p)
            one = simulate(build_schedule("1f1b", p, m), unit).timeline
            assert idle_per_rank(one) == pytest.approx([3 * (p - 1)] * p)
            assert zb.bubble_fraction() == pytest.approx((p - 1) / (3 * m + p - 1))
            assert bubble_fraction_theory("zb-h1", p, m, 1, unit) == pytest.approx(zb.bubble_fraction())
        else:
            assert zb.bubble_fraction() <= bubble_fraction_theory("1f1b", p, m) + 1e-12
    # (p-1)(F + I - W) holds for W <= min(F, I) (the case the paper's figure draws)
    for costs in ({"F": 1, "I": 2, "W": 0.5}, {"F": 2, "I": 1, "W": 1}):
        for p, m in ((3, 5), (4, 8), (6, 9)):
            tl = simulate(build_schedule("zb-h1", p, m), costs).timeline
            assert idle_per_rank(tl) == pytest.approx([bubble_time_theory("zb-h1", p, m, 1, costs)] * p)
            assert busy_time("zb-h1", p, m, 1, costs) == pytest.approx(tl.busy(0))


def test_dualpipev_bubble_against_deepseek():
    for p, m, _ in configs("dualpipev", ps=range(1, 7)):
        for costs in ({"F": 1, "B": 2, "I": 1, "W": 1}, {"F": 1, "B": 1.5, "I": 0.75, "W": 0.75}):
            s = build_schedule("dualpipev", p, m, 2)
            tl = ideal_timeline(s, costs)
            assert idle_per_rank(tl) == pytest.approx([dualpipev_bubble_time_observed(p, costs)] * p)
            assert idle_per_rank(tl)[0] <= bubble_time_theory("dualpipev", p, m, 2, costs) + 1e-9
            assert idle_per_rank(tl)[0] < bubble_time_theory("1f1b", p, m, 1, {"F": 2, "B": 4}) or p == 1
            assert simulate(s, costs).completed  # and with NCCL rendezvous, slower but deadlock free
    assert bubble_time_theory("dualpipev", 4, 8, 2, {"F": 1, "B": 2, "W": 1, "F&B": 2.5}) == pytest.approx(3 * 1.5)


def test_peak_in_flight_matches_theory_on_every_rank():
    for name in ("naive", "gpipe", "1f1b", "interleaved", "zb-h1", "dualpipev"):
        for p, m, v in configs(name, ps=range(1, 7), ms=(1, 2, 3, 4, 6, 8, 12, 16)):
            sim = simulate(build_schedule(name, p, m, v))
            want = [activation_memory_theory(name, p, m, v, r) for r in range(p)]
            assert sim.peak_in_flight == want, (name, p, m, v)
            assert sim.peak_activation_units == pytest.approx([activation_units_theory(name, p, m, v, r)
                                                               for r in range(p)])
    for p, v in ((4, 2), (4, 4), (8, 2)):
        units = simulate(build_schedule("interleaved", p, 4 * p, v)).peak_activation_units[0]
        assert units == pytest.approx(p * (1 + (p - 1) / (p * v)))  # Narayanan et al. 2021 sec. 2.2.2
    assert simulate(build_schedule("dualpipev", 4, 8, 2)).peak_in_flight == [9] * 4  # DeepSeek-V3: PP + 1, PP = 8
    assert simulate(build_schedule("zb-h1", 4, 8)).peak_pending_w == [1, 2, 3, 4]


def test_deadlock_detector_names_blocked_ranks():
    # stage 0 and 2 on rank 0, stages 1 and 3 on rank 1: each rank starts with a stage that needs the other's output
    s = schedule_from_lists([["2F0", "0F0", "2B0", "0B0"], ["1F0", "3F0", "3B0", "1B0"]], 1, stage_to_rank=[0, 1, 0, 1])
    sim = simulate(s)
    assert not sim.completed and sim.error is None
    assert sim.deadlock.startswith("deadlock: rank 0 waits at batch [2RECV_F0]")
    assert "rank 1 waits at batch [1RECV_F0]" in sim.deadlock and set(sim.blocked) == {0, 1}
    with pytest.raises(ScheduleError, match=r"\[dependencies\].*rank 0 waits at 2F0 for 1F0"):
        validate_schedule(s)
    # a compute order that is fine with free messages but deadlocks with the just-in-time plan under NCCL rules
    jit = dataclasses.replace(build_schedule("interleaved", 2, 4, 2), comm_plan="jit")
    with pytest.raises(ScheduleError, match=r"\[deadlock\] with the 'jit' comm plan"):
        validate_schedule(jit)
    # sends and receives of one run split in two batches: 1F1B deadlocks on stream order
    split = simulate(build_schedule("1f1b", 2, 4), split_sends=True)
    assert not split.completed and "NCCL stream order" in split.deadlock


def test_p2p_order_mismatch_and_local_order_errors():
    sim = simulate(schedule_from_lists([["0F0", "0F1", "0B0", "0B1"], ["1F1", "1F0", "1B0", "1B1"]], 2))
    assert not sim.completed and "p2p mismatch: send #0 from rank 0 to rank 1 is 0SEND_F0" in sim.error
    sim = simulate(schedule_from_lists([["0F0", "0B0"], ["1B0", "1F0"]], 1))
    assert "rank 1 runs 1B0 before 1F0" in sim.error
    eager = simulate(build_schedule("dualpipev", 3, 6, 2), sends="eager").timeline
    assert eager.makespan() == ideal_timeline(build_schedule("dualpipev", 3, 6, 2)).makespan()


@pytest.mark.parametrize("lists, m, kwargs, rule, fragment", [
    ([["1F0", "1B0"], ["0F0", "0B0"]], 1, {}, "placement", "rank 0 runs 1F0, but stage 1 lives on rank 1"),
    ([["0F0", "0B0"], ["1F0", "1B0"]], 2, {}, "counts", "stage 0, micro-batch 1 has 0 forwards"),
    ([["0F0", "0I0"], ["1F0", "1B0"]], 1, {}, "counts", "B x0, I x1, W x0"),
    ([["0F0", "0B0"], ["1B0", "1F0"]], 1, {}, "order", "rank 1 runs 1B0 before 1F0"),
    ([["0F0", "0W0", "0I0"], ["1F0", "1B0"]], 1, {}, "order", "0W0 before 0I0"),
    ([["0F0", "0F1", "0F2", "0B0", "0B1", "0B2"], ["1F0", "1F1", "1F2", "1B0", "1B1", "1B2"]], 3,
     {"name": "1f1b"}, "in_flight", "rank 0 has 3 micro-batches in flight at once; at most 2"),
    ([["0F0", "0F1", "0B0", "0B1"], ["1F0", "1B0", "1F1", "1B1"]], 2, {"max_in_flight": [1, 1]}, "in_flight",
     "rank 0 has 2"),
    ([["0F5"], []], 1, {}, "placement", "micro-batches 0..0"),
])
def test_validate_names_the_broken_rule(lists, m, kwargs, rule, fragment):
    with pytest.raises(ScheduleError, match=fragment) as info:
        validate_schedule(lists, m, **kwargs)
    assert info.value.rule == rule and str(info.value).startswith(f"[{rule}]")
    assert isinstance(info.value, ValueError)


def test_validate_accepts_learner_lists():
    p, m = 3, 5
    lists = [[str(a) for a in acts] for acts in build_schedule("1f1b", p, m).compute]
    validate_schedule(lists, m, name="1f1b")
    validate_schedule(build_schedule("gpipe", p, m).compute, m)  # GPipe is valid, without the 1F1B limit
    with pytest.raises(ValueError, match="num_microbatches"):
        validate_schedule(lists)


def test_comm_latency_events_and_grid():
    p, m, lat = 3, 4, 0.25
    sim = simulate(build_schedule("1f1b", p, m), comm=lat)
    comm = [e for e in sim.timeline.events if not e.is_compute]
    assert len(comm) == 4 * (p - 1) * m and all(e.duration == pytest.approx(lat) for e in comm)
    assert sim.timeline.makespan() > simulate(build_schedule("1f1b", p, m)).timeline.makespan()
    assert sim.timeline.source == "simulated" and sim.timeline.meta["comm"] == lat
    rows = time_grid(simulate(build_schedule("1f1b", 2, 2), {"F": 1, "B": 1}).timeline)
    assert rows == [["0F0", "0F1", "-", "0B0", "-", "0B1"], ["-", "1F0", "1B0", "1F1", "1B1", "-"]]
    assert format_grid(rows).splitlines()[1] == "rank 1:   - 1F0 1B0 1F1 1B1   -"
    with pytest.raises(ValueError, match="unknown cost kind"):
        simulate(build_schedule("1f1b", 2, 2), {"X": 1})
    with pytest.raises(ValueError, match="comm latency"):
        simulate(build_schedule("1f1b", 2, 2), comm=-1)


def test_gantt_and_side_by_side_figures_are_labelled():
    sim = simulate(build_schedule("zb-h1", 3, 4), comm=0.1).timeline
    fig, ax = plt.subplots()
    gantt(ax, sim, title="ZB-H1")
    assert ax.get_xlabel() == "time (cost units)" and ax.get_ylabel() == "pipeline rank"
    assert ax.get_title().startswith("ZB-H1: bubble ")
    assert [t.get_text() for t in ax.get_legend().get_texts()] == ["F forward", "I input grad", "W weight grad"]
    assert sum(1 for t in ax.texts) == len(sim.compute())
    plt.close(fig)
    measured = Timeline.from_dict({**simulate(build_schedule("1f1b", 3, 4)).timeline.to_dict(), "source": "measured",
                                   "meta": {}})
    fig = plot_side_by_side(measured, sim, title="1F1B vs ZB-H1")
    axes = fig.get_axes()
    assert len(axes) == 2 and axes[0].get_xlabel() == "time (s)" and axes[1].get_xlabel() == "time (cost units)"
    plt.close(fig)


def test_theory_rejects_bad_input():
    with pytest.raises(ValueError, match="unknown schedule"):
        bubble_fraction_theory("pipedream", 2, 4)
    with pytest.raises(ValueError, match="rank 4 is outside"):
        activation_memory_theory("1f1b", 4, 8, 1, 4)
    with pytest.raises(ValueError, match="multiple of num_ranks"):
        bubble_fraction_theory("interleaved", 4, 6, 2)


def test_stage_costs_make_the_slowest_stage_set_the_pace() -> None:
    """With stage 1 slower, GPipe at p=2 takes F0 + m(F1 + B1) + B0: the slow stage runs back to back."""
    from lslm.pipeline.schedules import build_schedule
    from lslm.pipeline.simulator import simulate

    m, f0, b0, f1, b1 = 8, 1.0, 2.0, 1.5, 3.0
    sched = build_schedule("gpipe", 2, m)
    same = simulate(sched, stage_costs={0: {"F": 1.0, "B": 2.0}, 1: {"F": 1.0, "B": 2.0}})
    assert same.timeline.makespan() == simulate(sched).timeline.makespan()
    slow = simulate(sched, costs={"F": f0, "B": b0}, stage_costs={1: {"F": f1, "B": b1}})
    assert slow.timeline.makespan() == f0 + m * (f1 + b1) + b0
    assert slow.timeline.busy(1) == m * (f1 + b1) and slow.timeline.busy(0) == m * (f0 + b0)


def test_compute_overhead_is_a_ranks_own_time_after_each_action() -> None:
    """``compute_overhead`` adds a rank's own time after each compute action (an executor's bookkeeping)."""
    sched = build_schedule("gpipe", 2, 4)
    base = simulate(sched).timeline.makespan()  # (m + p - 1)(F + B) = 15
    assert base == 15.0
    # GPipe's critical path: rank 0's F0, rank 1's four F and four B, rank 0's last B; an overhead follows each
    # but the last (it ends the step): 9 of them.
    assert simulate(sched, compute_overhead=0.5).timeline.makespan() == base + 9 * 0.5
    with pytest.raises(ValueError, match="compute_overhead must be a number >= 0"):
        simulate(sched, compute_overhead=-1.0)
