"""lslm bench zero (quick): every entry trains the same run, and the model-state bytes fall stage by stage."""

from __future__ import annotations

import pytest

from lslm.bench import zero


@pytest.fixture(scope="module")
def result(tmp_path_factory: pytest.TempPathFactory) -> dict:
    out = tmp_path_factory.mktemp("bench-zero")
    res = zero.run((2,), quick=True, steps=1, out_dir=out)[2]
    assert {p.name for p in out.iterdir()} == {"zero.txt", "zero.json", "zero.png"}
    return res


def test_every_entry_trains_the_same_run_as_ddp(result: dict) -> None:
    assert [r["entry"] for r in result["rows"]] == list(zero.ENTRIES)
    for r in result["rows"]:  # fp32 at 2 ranks: one order for every sum, the same AdamW arithmetic
        assert r["max_loss_diff_vs_ddp"] == 0.0, r["entry"]


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
