"""Pipeline schedules as pure instruction lists: orders, configuration errors, the comm plan (no processes)."""

from __future__ import annotations

import dataclasses

import pytest

from lslm.pipeline.actions import Action, format_actions
from lslm.pipeline.comm_plan import add_communication, comm_batches, ideal_times
from lslm.pipeline.schedules import (
    SCHEDULES,
    PipelineSchedule,
    build_schedule,
    check_schedule_config,
    schedule_from_lists,
    stage_to_rank_map,
)
from lslm.pipeline.simulator import simulate
from lslm.pipeline.validate import validate_schedule


def valid_configs(names=SCHEDULES, ps=range(1, 9), ms=range(1, 17), vs=range(1, 5)):
    for name in names:
        for p in ps:
            for m in ms:
                for v in vs:
                    try:
                        check_schedule_config(name, p, m, v)
                    except ValueError:
                        continue
                    yield name, p, m, v


def text(s: PipelineSchedule, rank: int) -> str:
    return format_actions(s.compute[rank])


def test_grid_every_schedule_validates_and_completes_under_both_stream_models():
    seen = {name: 0 for name in SCHEDULES}
    for name, p, m, v in valid_configs():
        s = build_schedule(name, p, m, v)
        assert (s.num_ranks, s.num_microbatches, s.stages_per_rank, s.num_stages) == (p, m, v, p * v)
        validate_schedule(s)  # counts, order, dependencies, NCCL deadlock freedom, 1F1B-family in-flight limits
        assert simulate(s, stream="rank").completed, (name, p, m, v)
        seen[name] += 1
    assert seen == {"naive": 128, "gpipe": 128, "1f1b": 128, "interleaved": 126, "zb-h1": 128, "dualpipev": 64}


def test_orders_by_hand():
    s = build_schedule("1f1b", 4, 8)
    assert text(s, 0) == "0F0 0F1 0F2 0F3 0B0 0F4 0B1 0F5 0B2 0F6 0B3 0F7 0B4 0B5 0B6 0B7"
    assert text(s, 3) == " ".join(f"3F{i} 3B{i}" for i in range(8))
    assert text(build_schedule("1f1b", 4, 2), 0) == "0F0 0F1 0B0 0B1"  # warm-up clipped to m (Megatron)
    assert text(build_schedule("gpipe", 2, 3), 1) == "1F0 1F1 1F2 1B0 1B1 1B2"
    assert text(build_schedule("naive", 2, 2), 0) == "0F0 0B0 0F1 0B1"
    zb = build_schedule("zb-h1", 4, 8)
    assert text(zb, 0).startswith("0F0 0F1 0F2 0F3 0I0 0W0 0F4 0I1 0W1")  # rank 0: W right after I
    assert text(zb, 3).startswith("3F0 3I0 3F1 3I1 3F2 3I2 3F3 3I3 3W0 3F4")  # last rank holds back 3 W
    il = build_schedule("interleaved", 4, 8, 2)
    assert s.stage_to_rank == (0, 1, 2, 3) and il.stage_to_rank == (0, 1, 2, 3, 0, 1, 2, 3)
    assert text(il, 0).startswith("0F0 0F1 0F2 0F3 4F0 4F1 4F2 4F3 0F4 0F5 0F6 4B0 0F7 4B1 4F4 4B2")
    dv = build_schedule("dualpipev", 4, 8, 2)
    assert dv.stage_to_rank == (0, 1, 2, 3, 3, 2, 1, 0) and dv.rank_stages(0) == [0, 7]
    assert text(dv, 0).startswith("0F0 0F1 0F2 0F3 0F4 0F5 0F6 7F0 7I0 7W0 7F1 7I1 7W1 7F2 7I2 7W2 7F3 0F7 7B3")
    assert text(dv, 0).endswith("7B7 0I4 0W4 0I5 0W5 0I6 0W6 0I7 0W7")


@pytest.mark.parametrize("args, fragment", [
    (("pipedream", 2, 4), "unknown schedule"),
    (("1f1b", 0, 4), "num_ranks"),
    (("1f1b", 2, -1), "num_microbatches"),
    (("1f1b", True, 4), "positive int"),
    (("1f1b", 2, 4.0), "positive int"),
    (("1f1b", 2, 4, 2), "virtual_stages=1"),
    (("gpipe", 2, 4, 3), "'interleaved'"),
    (("interleaved", 2, 4, 1), "use '1f1b'"),
    (("interleaved", 4, 6, 2), "multiple of num_ranks=4"),
    (("interleaved", 4, 2, 2), "use 4"),
    (("dualpipev", 2, 8, 1), "virtual_stages=2"),
    (("dualpipev", 4, 7, 2), "num_microbatches >= 2 * num_ranks = 8"),
])
def test_bad_configs_raise_actionable_value_errors(args, fragment):
    with pytest.raises(ValueError, match=fragment.replace("(", r"\(").replace("*", r"\*")):
        build_schedule(*args)


def test_more_stages_than_layers():
    check_schedule_config("interleaved", 2, 4, 2, num_layers=4)
    with pytest.raises(ValueError, match="needs 8 stages but the model has 6 layers"):
        check_schedule_config("interleaved", 4, 4, 2, num_layers=6)
    with pytest.raises(ValueError, match="num_layers"):
        check_schedule_config("1f1b", 2, 4, num_layers=0)


def test_stage_maps():
    assert stage_to_rank_map("interleaved", 3, 2) == (0, 1, 2, 0, 1, 2)
    assert stage_to_rank_map("dualpipev", 3, 2) == (0, 1, 2, 2, 1, 0)
    assert build_schedule("interleaved", 3, 6, 2).rank_stages(1) == [1, 4]


def test_jit_comm_rule_for_1f1b_is_megatrons_pairing():
    s = build_schedule("1f1b", 2, 2)
    assert s.comm_plan == "jit"
    assert format_actions(s.actions(0)) == "0F0 0SEND_F0 0F1 0SEND_F1 0RECV_B0 0B0 0RECV_B1 0B1"
    assert format_actions(s.actions(1)) == "1RECV_F0 1F0 1B0 1SEND_B0 1RECV_F1 1F1 1B1 1SEND_B1"
    # steady state of 1F1B: after F, SEND_F + RECV_B is one batch (send_forward_recv_backward)
    batches = comm_batches(build_schedule("1f1b", 4, 8).actions(1))
    assert [str(a) for a in batches[batches.index(Action(1, "F", 2)) + 1]] == ["1SEND_F2", "1RECV_B0"]
    with pytest.raises(ValueError, match="outside"):
        add_communication(s, 2)


def test_jit_rule_deadlocks_for_looped_and_v_placements_so_they_use_the_timed_plan():
    il = build_schedule("interleaved", 4, 8, 2)
    dv = build_schedule("dualpipev", 4, 8, 2)
    assert (il.comm_plan, dv.comm_plan) == ("timed", "timed")
    jit_il = simulate(dataclasses.replace(il, comm_plan="jit"))
    assert not jit_il.completed and jit_il.deadlock and len(jit_il.blocked) == 4
    jit_dv = simulate(dataclasses.replace(dv, comm_plan="jit"))
    assert not jit_dv.completed and "p2p mismatch" in jit_dv.error  # F and B messages cross between ranks 1, 2
    for s in (il, dv):
        assert simulate(s).completed


def test_timed_plan_places_sends_after_producers_and_receives_before_consumers():
    for name, p, m, v in valid_configs(("interleaved", "dualpipev", "1f1b"), ps=(2, 3, 4), ms=(4, 6, 8, 12)):
        s = dataclasses.replace(build_schedule(name, p, m, v), comm_plan="timed")
        for r in range(p):
            acts = s.actions(r)
            assert [a for a in acts if a.is_compute] == list(s.compute[r])
            pos = {a: i for i, a in enumerate(acts)}
            for a in acts:
                if a.kind == "SEND_F":
                    assert pos[Action(a.stage, "F", a.mb)] < pos[a]
                elif a.kind == "SEND_B":
                    assert min(pos.get(Action(a.stage, k, a.mb), 10**9) for k in "BI") < pos[a]
                elif a.kind == "RECV_F":
                    assert pos[a] < pos[Action(a.stage, "F", a.mb)]
                elif a.kind == "RECV_B":
                    assert pos[a] < min(pos.get(Action(a.stage, k, a.mb), 10**9) for k in "BI")
        assert simulate(s).completed


def test_schedule_from_lists_reads_strings_and_drops_comm():
    s = schedule_from_lists([["0F0", "0SEND_F0", "0B0"], ["1RECV_F0", "1F0", "1B0", "1SEND_B0"]], 1)
    assert s.compute == ((Action(0, "F", 0), Action(0, "B", 0)), (Action(1, "F", 0), Action(1, "B", 0)))
    assert s.stage_to_rank == (0, 1) and s.comm_plan == "jit" and s.name == "custom"
    with pytest.raises(ValueError, match="same number of stages"):
        schedule_from_lists([[], []], 1, stage_to_rank=[0, 0, 1])
    assert ideal_times(s) == [[(0.0, 1.0), (4.0, 6.0)], [(1.0, 2.0), (2.0, 4.0)]]
    assert "rank 1: 1F0 1B0" in str(s)
