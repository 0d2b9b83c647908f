"""``lslm bench tp`` smoke run: one tiny launch at tp = 2 (gloo), its files, exact counts and memory; no timings."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from lslm.bench import tp


def test_bench_tp_quick_writes_table_json_png_and_the_ratio_line(tmp_path: Path,
                                                                  capsys: pytest.CaptureFixture[str]) -> None:
    results = tp.run((2,), quick=True, steps=1, warmup=0, out_dir=tmp_path, timeout=240)
    lines = capsys.readouterr().out.strip().splitlines()
    assert re.fullmatch(r"lslm / DTensor TP step time: tp=2 \d+\.\d\dx", lines[-1]), lines[-1]
    for suffix in ("txt", "json", "png"):
        assert (tmp_path / f"tp.{suffix}").is_file()
    assert json.loads((tmp_path / "tp.json").read_text())["2"]["tp"] == 2

    res = results[2]
    rows = {(r["variant"], r["sequence_parallel"]): r for r in res["rows"]}
    assert sorted(rows) == [("dtensor", False), ("dtensor", True), ("lslm", False), ("lslm", True)]
    # Same weights, same batches: the two models' losses differ by rounding only (fp32, loss ~5.5).
    assert all(r["max_loss_diff_vs_other"] <= 1e-5 for r in rows.values())
    # Every row's tokens/s, TFLOP/s and MFU (lslm.harness.throughput), printed under its table.
    assert all(r["throughput"]["devices"] == 2 and r["throughput"]["mfu"] > 0 for r in rows.values())
    assert any(line.startswith("  lslm SP on: tokens/s ") and ", MFU " in line for line in lines)

    # Collectives in one step (2 layers), as tests/test_tp_dtensor.py explains them one by one:
    # lslm  SP off: 4 per layer + embedding + head input grad + 2 for the loss;
    # DTensor SP off: the same with 3 for the loss; SP on, lslm: 10 per layer (2 re-gathers) + 2 + 3
    # + 2 + 1 flat gradient sync; DTensor: 8 per layer + 2 + wpe 1 + 2 + 3 + 10 LayerNorm all-reduces.
    assert {k: r["collectives_per_step"] for k, r in rows.items()} == {
        ("lslm", False): 12, ("dtensor", False): 13, ("lslm", True): 28, ("dtensor", True): 34}

    # Bus bytes (what a rank sends), exactly. bsh: one (B, T, C) fp32 activation; at t = 2 an all-reduce sends
    # its whole buffer, an all-gather or a reduce-scatter half of it.
    L, C, T, B = m_layers(res), res["model"]["n_embd"], res["seq"], res["batch"]
    bsh, loss = B * T * C * 4, 3 * B * T * 4  # the loss: a max, then target logits and sums of exponentials
    plain = (4 * L + 2) * bsh + loss  # 4 all-reduces per layer, the embedding's and the head's input gradient
    assert rows[("lslm", False)]["comm_bus_bytes_per_step"] == plain == rows[("lslm", False)]["comm_bytes_per_step"]
    assert rows[("dtensor", False)]["comm_bus_bytes_per_step"] == plain  # the loss's 3 all-reduces: same bytes
    # SP: per layer 4 all-gathers + 4 reduce-scatters + 2 re-gathers, each bsh/2 on the wire (1.25x the 4
    # all-reduces); the embedding's reduce-scatter and all-gather, the head's all-gather, reduce-scatter and
    # re-gather; the loss; one flat all-reduce of the replicated gradients (LayerNorms 2C each, 2L + 1 of them,
    # the row-parallel biases 2L x C, the position table block_size x C).
    synced = 4 * (2 * (2 * L + 1) * C + 2 * L * C + res["model"]["block_size"] * C)
    assert rows[("lslm", True)]["comm_bus_bytes_per_step"] == (10 * L + 5) * bsh / 2 + loss + synced
    assert rows[("lslm", True)]["comm_bytes_per_step"] == (10 * L + 5) * bsh + loss + synced

    # Parameters: the same shards. Gradients and momentum: DTensor's wte gradient is the whole
    # (V, C) table on every rank, so it holds V*C*(t-1)/t more fp32 numbers in each.
    m = res["model"]
    extra = m["vocab_size"] * m["n_embd"] // 2 * 4
    for sp in (False, True):
        ours, theirs = rows[("lslm", sp)], rows[("dtensor", sp)]
        assert ours["params_bytes"] == theirs["params_bytes"] == ours["grads_bytes"]
        assert theirs["grads_bytes"] == ours["grads_bytes"] + extra
        assert theirs["optimizer_bytes"] == ours["optimizer_bytes"] + extra


def m_layers(res: dict) -> int:
    """The benchmarked GPT's number of layers."""
    return res["model"]["n_layer"]


def test_bench_tp_table_reads_a_result_without_bus_bytes(capsys: pytest.CaptureFixture[str]) -> None:
    # Results written before the bus-bytes field: the table prints n/a there instead of failing.
    row = {"variant": "lslm", "sequence_parallel": False, "step_ms": 2.0, "forward_ms": 1.0, "backward_ms": 1.0,
           "optimizer_ms": 0.0, "params_bytes": 0, "grads_bytes": 0, "optimizer_bytes": 0, "activation_bytes": 0,
           "collectives_per_step": 1, "comm_bytes_per_step": 1024 * 1024, "max_loss_diff_vs_other": 0.0}
    old = {"model": {"n_layer": 1, "n_embd": 8, "n_head": 2, "vocab_size": 16}, "backend": "gloo", "threads": 1,
           "num_parameters": 1, "batch": 1, "seq": 2, "steps": 1, "process_peak_rss_bytes": 0,
           "rows": [row, {**row, "variant": "dtensor"}]}
    tp.print_table({2: old})
    out = capsys.readouterr().out
    assert "    1.00     n/a" in out and "n/a: not in this older result" in out
    assert tp.bus_mib(row) is None and tp.bus_mib({**row, "comm_bus_bytes_per_step": 2 * 1024 * 1024}) == 2.0


def test_bench_tp_refuses_sizes_that_do_not_split_before_any_launch() -> None:
    with pytest.raises(ValueError, match="tensor parallelism needs peers"):
        tp.run((1, 2), quick=True, out_dir=None)
    with pytest.raises(ValueError, match="n_head=4 does not split over tp=3"):
        tp.run((3,), quick=True, out_dir=None)
    with pytest.raises(ValueError, match="steps must be an integer >= 1, got 0"):
        tp.run((2,), quick=True, steps=0, out_dir=None)
