"""``lslm bench cp`` smoke run: one tiny launch at cp = 2 (gloo), its files, exact byte counts; no timings."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from lslm.bench import cp
from lslm.context_parallel import cp_traffic


def test_bench_cp_quick_bytes_equal_the_formula_and_activations_halve(tmp_path: Path,
                                                                      capsys: pytest.CaptureFixture[str]) -> None:
    results = cp.run((2,), quick=True, steps=1, warmup=0, out_dir=tmp_path, timeout=240)
    lines = capsys.readouterr().out.strip().splitlines()
    ratio = r"\d+\.\d\dx"
    assert re.fullmatch(f"step time / full attention: cp=2 ring contiguous {ratio}, ring zigzag {ratio}, "
                        f"ulysses {ratio}, block ring zigzag {ratio}, block ulysses {ratio}", lines[-1]), lines[-1]
    for suffix in ("txt", "json", "png"):
        assert (tmp_path / f"cp.{suffix}").is_file()
    assert json.loads((tmp_path / "cp.json").read_text())["2"]["cp"] == 2

    res = results[2]
    s = res["shape"]
    want = cp_traffic(s["batch"], s["n_head"], s["seq"], s["head_dim"], 2)
    assert res["traffic_formula"] == want
    rows = {r["variant"]: r for r in res["rows"]}
    assert list(rows) == [name for name, *_ in cp.VARIANTS]
    for name, r in rows.items():
        # the ledger's bytes, per rank, exactly: the ring's sends, Ulysses' all-to-all inputs
        if r["method"] == "ring":
            assert (r["forward_bytes"], r["backward_bytes"]) == (want["ring_forward"], want["ring_backward"]), name
            assert r["wire_bytes"] == want["ring_forward"] + want["ring_backward"]
        elif r["method"] == "ulysses":
            assert (r["forward_bytes"], r["backward_bytes"]) == (want["ulysses_forward_ledger"],
                                                                 want["ulysses_backward_ledger"]), name
            assert r["wire_bytes"] == want["ulysses_forward"] + want["ulysses_backward"]  # 1/cp stays home
        else:
            assert r["forward_bytes"] == r["backward_bytes"] == r["wire_bytes"] == 0
        assert r["formula_equal"] and r["max_diff_vs_full"] <= 1e-5, name  # fp32, the outputs of full attention
    # At cp = 2 the ring and Ulysses send the same bytes per rank (2(cp - 1)u = 4u(cp - 1)/cp forward).
    assert rows["ring zigzag"]["wire_bytes"] == 2 * rows["ulysses"]["wire_bytes"]  # the ring also sends dK/dV home
    # Every tensor the attention keeps (q, k, v, output, log-sum-exp) is per token: half of full attention's.
    for name in ("ring contiguous", "ring zigzag", "ulysses"):
        assert 2 * rows[name]["activation_bytes"] == rows["full"]["activation_bytes"], name
    assert 2 * rows["block ring zigzag"]["activation_bytes"] == rows["block full"]["activation_bytes"]
    assert rows["block ulysses"]["activation_bytes"] < rows["block full"]["activation_bytes"]


def test_bench_cp_refuses_shapes_that_do_not_split_before_any_launch() -> None:
    with pytest.raises(ValueError, match="context parallelism needs peers"):
        cp.run((1, 2), quick=True, out_dir=None)
    with pytest.raises(ValueError, match="not divisible by 2·cp = 6"):
        cp.run((3,), quick=True, out_dir=None)
    with pytest.raises(ValueError, match="n_head = 4 is not divisible by cp = 8"):
        cp.run((8,), quick=True, out_dir=None)
