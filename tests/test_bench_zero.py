"""lslm bench zero (quick): every entry trains the same run, and the model-state bytes fall stage by stage."""

from __future__ import annotations

import pytest

from lslm.bench import zero
from lslm.integrations.deepspeed_zero import deepspeed_available


@pytest.fixture(scope="module")
def result(tmp_path_factory: pytest.TempPathFactory) -> dict:
    out = tmp_path_factory.mktemp("bench-zero")
    res = zero.run((2,), quick=True, steps=1, out_dir=out)[2]
    assert {p.name for p in out.iterdir()} == {"zero.txt", "zero.json", "zero.png"}
    res["text"] = (out / "zero.txt").read_text()
    return res


def test_every_entry_trains_the_same_run_as_ddp(result: dict) -> None:
    ok, why = deepspeed_available()
    ran = [e for e in zero.ENTRIES if ok or e not in zero.DEEPSPEED_ENTRIES]
    assert [r["entry"] for r in result["rows"]] == ran
    assert result["skipped"] == ({} if ok else {e: why for e in zero.DEEPSPEED_ENTRIES})
    for r in result["rows"]:  # fp32 at 2 ranks: one order for every sum, the same AdamW arithmetic
        assert r["max_loss_diff_vs_ddp"] == 0.0, r["entry"]
        assert r["throughput"]["devices"] == 2 and r["throughput"]["mfu"] > 0, r["entry"]
    assert "\n  zero3: tokens/s " in result["text"]  # the harness's throughput line, one per entry


def test_model_states_per_rank_follow_the_stages(result: dict) -> None:
    rows = {r["entry"]: r for r in result["rows"]}
    psi = result["num_parameters"]

    def total(e: str) -> int:
        r = rows[e]
        return r["params_bytes"] + r["grads_bytes"] + r["masters_bytes"] + r["optimizer_bytes"]

    # fp32 AdamW at N = 2: DDP 16 bytes/param (4 + 4 + 8), stage 1 4 + 4 + 8/2, stage 2 4 + (4 + 8)/2, stage 3 16/2,
    # plus padding (under N elements per bucket) and Adam's 4-byte step per tensor or piece.
    for entry, per_param in (("ddp", 16), ("zero1", 12), ("zero2", 10), ("zero3", 8), ("fsdp2", 8)):
        assert per_param * psi <= total(entry) < per_param * psi + 4096, entry
    assert rows["zero3-offload"]["masters_bytes"] == rows["zero3"]["params_bytes"]  # fp32 host copies of the slice
    # lslm's traffic per step: the whole gradient reduce-scattered; stage 3 gathers blocks twice (forward, backward)
    assert rows["zero1"]["rs_bytes"] == rows["zero1"]["ag_bytes"] >= 4 * psi
    assert rows["zero3"]["ag_bytes"] > rows["zero3"]["rs_bytes"]
    assert rows["zero3-offload"]["offload_bytes"]["to_host"] == rows["zero3-offload"]["masters_bytes"]
    # torch's dispatcher sees the same reduce-scatters and all-gathers as lslm's ledger, and FSDP2 moves as much
    for entry in ("zero1", "zero2", "zero3"):
        seen = rows[entry]["collectives"]
        assert seen["reduce_scatter"][1] == rows[entry]["rs_bytes"] and seen["all_gather"][1] == rows[entry]["ag_bytes"]
    assert rows["fsdp2"]["collectives"]["all_gather"][1] == rows["zero3"]["ag_bytes"]


def test_deepspeed_rows_count_its_partitions(result: dict) -> None:
    """DeepSpeed's rows by the same owners (lslm.integrations.deepspeed_zero's doc explains each term), and the
    last line's stage 3 / DeepSpeed ratio."""
    if result["skipped"]:
        pytest.skip(next(iter(result["skipped"].values())))
    rows = {r["entry"]: r for r in result["rows"]}
    psi = result["num_parameters"]
    pad = 4 * 2 * 2  # two parameter groups, each flat partition padded to a multiple of N = 2 elements
    for entry in ("deepspeed1", "deepspeed2"):  # whole fp32 weights + an fp32 copy of the partition + Adam's 1/2
        r = rows[entry]
        assert r["params_bytes"] == 4 * psi and r["grads_bytes"] == 0
        assert 2 * psi <= r["masters_bytes"] <= 2 * psi + pad and 4 * psi <= r["optimizer_bytes"] <= 4 * psi + 2 * pad
    for entry, grads in (("deepspeed3", 2), ("deepspeed3-offload", 4)):  # offload: a host copy of the gradients too
        r = rows[entry]
        for owner, per in (("params_bytes", 2), ("grads_bytes", grads), ("masters_bytes", 2), ("optimizer_bytes", 4)):
            assert per * psi <= r[owner] <= per * psi + 2 * pad, (entry, owner)
    for entry in zero.DEEPSPEED_ENTRIES:  # its collectives bypass lslm's ledger: no ledger bytes claimed
        assert rows[entry]["rs_bytes"] is None and rows[entry]["ag_bytes"] is None
    # ... but torch's dispatcher sees them. Stages 1-2: gradients all-reduced (+ 8 bytes of flags), then the whole
    # flat fp32 buffer all-gathered, one call per parameter group. Stage 3: the whole padded buffer reduce-scattered
    # once; gathered once here, since DeepSpeed keeps gathered parameters until the step while they fit its
    # stage3_max_live_parameters (1e9 by default): 2Ψ of traffic for this model, not 3Ψ.
    for entry in ("deepspeed1", "deepspeed2"):
        seen, r = rows[entry]["collectives"], rows[entry]
        assert seen["all_gather"] == [2, r["params_bytes"]] and 0 <= seen["all_reduce"][1] - r["params_bytes"] <= 16
    for entry in ("deepspeed3", "deepspeed3-offload"):
        seen, r = rows[entry]["collectives"], rows[entry]
        assert seen["reduce_scatter"][1] == seen["all_gather"][1] == 2 * r["params_bytes"]
    last = result["text"].strip().splitlines()[-1]
    assert "zero3/deepspeed3 p=2" in last and "zero3-offload/deepspeed3-offload p=2" in last


def test_deepspeed_entries_skip_with_the_reason(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture,
                                                tmp_path) -> None:
    from lslm.integrations import deepspeed_zero

    monkeypatch.setattr(deepspeed_zero, "deepspeed_available", lambda: (False, "deepspeed is not importable"))
    res = zero.run((2,), quick=True, steps=1, warmup=0, entries=("zero1", "deepspeed3"), out_dir=tmp_path)[2]
    assert [r["entry"] for r in res["rows"]] == ["zero1"]
    assert res["skipped"] == {"deepspeed3": "deepspeed is not importable"}
    assert "deepspeed3: skipped (deepspeed is not importable)" in (tmp_path / "zero.txt").read_text()
    with pytest.raises(RuntimeError, match="deepspeed is not importable"):
        zero.run((2,), quick=True, entries=("deepspeed1",), out_dir=None)


def test_the_offload_table_reads_its_rows() -> None:
    from lslm.bench.zero_offload import table

    row = {"num_parameters": 10, "peak_rss_bytes": [2e8, 3e8], "step_ms": [10.0, 12.0], "to_host_bytes": 0,
           "to_device_bytes": 0, "disk_read_bytes": 0, "disk_write_bytes": 0, "losses": [1.0]}
    rows = [dict(row, offload="none"), dict(row, offload="disk", peak_rss_bytes=[1.5e8, 1.5e8], step_ms=[24.0, 18.0],
                                            disk_read_bytes=6e6, disk_write_bytes=6e6)]
    text = table(rows)
    assert "none" in text and "0.50x" in text and "2.00x" in text and "12.0" in text
    # Each allocator setting's rows are compared with its own run without offload.
    other = [dict(r, allocator="mmap threshold 1 MiB", peak_rss_bytes=[1e8, 1e8]) for r in rows]
    text = table([dict(r, allocator="glibc default") for r in rows] + other)
    # the second setting's disk row: 1e8 against its own none (1.00x), not against the first setting's 3e8 (0.33x)
    assert text.count(" 1.00x") == 5 and "0.33x" not in text and "0.50x" in text
