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

    # Collectives in one step (2 layers), as tests/test_tp_dtensor.py explains them one by one:
    # lslm  SP off: 4 per layer + embedding + head input grad + 2 for the loss;
    # DTensor SP off: the same with 3 for the loss; SP on, lslm: 10 per layer (2 re-gathers) + 2 + 3
    # + 2 + 1 flat gradient sync; DTensor: 8 per layer + 2 + wpe 1 + 2 + 3 + 10 LayerNorm all-reduces.
    assert {k: r["collectives_per_step"] for k, r in rows.items()} == {
        ("lslm", False): 12, ("dtensor", False): 13, ("lslm", True): 28, ("dtensor", True): 34}

    # Parameters: the same shards. Gradients and momentum: DTensor's wte gradient is the whole
    # (V, C) table on every rank, so it holds V*C*(t-1)/t more fp32 numbers in each.
    m = res["model"]
    extra = m["vocab_size"] * m["n_embd"] // 2 * 4
    for sp in (False, True):
        ours, theirs = rows[("lslm", sp)], rows[("dtensor", sp)]
        assert ours["params_bytes"] == theirs["params_bytes"] == ours["grads_bytes"]
        assert theirs["grads_bytes"] == ours["grads_bytes"] + extra
        assert theirs["optimizer_bytes"] == ours["optimizer_bytes"] + extra


def test_bench_tp_refuses_sizes_that_do_not_split_before_any_launch() -> None:
    with pytest.raises(ValueError, match="tensor parallelism needs peers"):
        tp.run((1, 2), quick=True, out_dir=None)
    with pytest.raises(ValueError, match="n_head=4 does not split over tp=3"):
        tp.run((3,), quick=True, out_dir=None)
    with pytest.raises(ValueError, match="steps must be an integer >= 1, got 0"):
        tp.run((2,), quick=True, steps=0, out_dir=None)
