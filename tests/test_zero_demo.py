"""Notebook 08's in-process counts: lslm.demos.zero_demo.state_bytes_at_scale on the fake process group."""

from __future__ import annotations

import pytest

from lslm.demos.zero_demo import fake_world, state_bytes_at_scale


def test_bytes_at_eight_fake_ranks_are_the_formula_with_padding() -> None:
    for row in state_bytes_at_scale(worlds=(8,), stages=(1, 2, 3)):
        n, stage, numel, owned = row["world"], row["stage"], row["numel"], row["owned"]
        assert 0 < numel - row["psi"] < n * row["buckets"]  # width 60: the buckets need padding at 8 ranks
        assert row["bytes"] == {"parameters": 2 * (numel if stage < 3 else numel // n),
                                "gradients": 2 * (numel if stage == 1 else numel // n),
                                "master_weights": 4 * owned, "optimizer_states": 8 * owned + 4 * row["pieces"]}


def test_fake_world_refuses_a_second_process_group() -> None:
    with fake_world(0, 4), pytest.raises(RuntimeError, match="already initialised"), fake_world(1, 4):
        pass


def test_the_whole_picture_counts_gathers_staging_and_states_exactly() -> None:
    """Rank by rank at 2: stage 3's gathered buffers peak at the root plus two units (the one computing and the one
    prefetched), all of them when kept gathered; staging at most two buckets in flight (max_inflight); the states are
    ZeRO's (parameters whole at stage 2, a slice at stage 3)."""
    from lslm.plot.zero import plot_whole_picture
    from tests.helpers import run_workers

    res = run_workers("lslm.demos.zero_demo:whole_picture", 2, timeout=180)
    for r in res:
        root, unit, psi = r["root_numel"], r["unit_numel"], r["psi"]
        z2, z3, keep, own = (r["entries"][k] for k in ("zero2", "zero3", "zero3-keep", "zero3-units"))
        assert z2["gathered"] == 0
        assert z3["gathered"] == 4 * (root + 2 * unit)
        # The embedding and the head as units: the root is what is left, the head and the last block whole at once
        *_, head, small_root = own["buckets"]
        assert own["buckets"][0] == head and own["gathered"] == 4 * (small_root + head + unit) < z3["gathered"]
        assert own["losses"] == z3["losses"] == z2["losses"]
        assert keep["gathered"] == 4 * sum(keep["buckets"]) >= 4 * psi
        for e in (z2, z3):
            two_largest = sorted(e["buckets"])[-2:]
            assert 0 < e["staging"] <= 4 * sum(two_largest)
        assert z2["held"]["parameters"] == 4 * sum(z2["buckets"])  # whole, padded
        assert z3["held"]["parameters"] == 4 * sum(z3["buckets"]) // 2  # this rank's slice
        assert r["activations"] > 0 and z3["step_peak"] >= z3["gathered"]
    fig = plot_whole_picture([res[0]], title="t")
    assert fig.axes[0].get_title() == "t" and "MB" in fig.axes[0].get_ylabel()


def test_block_spans_follow_forward_then_backward_in_reverse() -> None:
    """One process, no ZeRO: every block's forward span, then every backward span from the last block to the
    first, none overlapping the next; the timeline figure draws them in a compute row of their own."""
    import torch

    from lslm.demos.zero_demo import BlockSpans
    from lslm.models.gpt import GPT, GPTConfig
    from lslm.plot.zero import plot_timeline

    torch.manual_seed(0)
    net = GPT(GPTConfig.tiny(n_layer=3))
    spans = BlockSpans(net.blocks)
    x = torch.randint(0, 1024, (1, 8))  # lslm: cpu-ok (a plain model on the CPU)
    spans.on = True
    net(x, x)[1].backward()
    spans.remove()
    got = [(s["phase"], s["block"]) for s in spans.spans]
    assert got == [("forward", 0), ("forward", 1), ("forward", 2), ("backward", 2), ("backward", 1), ("backward", 0)]
    ends = [(s["start_s"], s["end_s"]) for s in spans.spans]
    assert all(a <= b for a, b in ends) and all(b <= c for (_, b), (c, _) in zip(ends, ends[1:]))
    fig = plot_timeline([{"op": "all_gather", "nbytes": 1024, "issue_s": 0.0, "done_s": 1e-3}], title="t",
                        compute=spans.spans)
    assert any("compute" in t.get_text() for t in fig.axes[0].get_yticklabels())
