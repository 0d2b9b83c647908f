"""bench/results/onebit_adam (read by notebook 10): what its command writes, and the committed run's consistency.

The committed artifact is checked without running anything (its bytes against the formulas, its warm-up against
Adam); the command line is run once at a tiny size into a temporary folder.
"""

from __future__ import annotations

import json
from pathlib import Path

from lslm.data_parallel.onebit_compress import compressed_all_reduce_bus_bytes
from lslm.demos.onebit_demo import main

ROOT = Path(__file__).resolve().parents[1]
ARTIFACT = ROOT / "bench" / "results" / "onebit_adam"


def test_the_committed_run_matches_its_command_and_the_formulas() -> None:
    data = json.loads(ARTIFACT.with_suffix(".json").read_text())
    first = ARTIFACT.with_suffix(".txt").read_text().splitlines()[0]
    assert first == f"command: {data['command']}"
    assert f"--steps {data['steps']} --warmup-steps {data['warmup_steps']}" in data["command"]
    steps, warmup, n, numel = data["steps"], data["warmup_steps"], data["world"], data["numel"]
    fp32 = 2 * (n - 1) * 4 * numel // n  # a ring all-reduce of the fp32 gradients, per rank
    sent = data["bus_bytes"]
    assert sent["adam"] == [fp32] * steps
    dim = data["model"]["n_embd"]
    for name in ("1-bit adam", "1-bit adam, no error feedback"):
        # Compressed: every element whose sqrt(v_hat) is above eps at the freeze, i.e. all but the embedding rows of
        # the token ids no rank fed during the warm-up and the attention's key biases; no compressed step moves those.
        compressed = data["compressed_numel"][name]
        frozen_rows = data["unseen_rows"] + data["model"]["n_layer"]  # a key bias has n_embd elements, like a row
        assert data["frozen_numel"][name] == numel - compressed == frozen_rows * dim
        assert data["unseen_rows_moved"][name] == 0.0
        assert sent[name] == [fp32] * warmup + [compressed_all_reduce_bus_bytes(compressed, n)] * (steps - warmup)
        # Adam's arithmetic through the warm-up: the losses are Adam's until the first compressed step lands
        assert data["losses"][name][:warmup + 1] == data["losses"]["adam"][:warmup + 1]
    assert data["compressed_formula"] == compressed_all_reduce_bus_bytes(data["compressed_numel"]["1-bit adam"], n)
    tail = {name: sum(curve[-10:]) / 10 for name, curve in data["losses"].items()}
    assert tail["1-bit adam"] < tail["1-bit adam, no error feedback"]  # what notebook 10 says error feedback buys


def test_the_command_writes_txt_json_and_png(tmp_path: Path, capsys) -> None:
    main(["--nproc", "2", "--steps", "3", "--warmup-steps", "1", "--out", str(tmp_path)])
    out = capsys.readouterr().out
    assert out.splitlines()[0] == f"command: python -m lslm.demos.onebit_demo --nproc 2 --steps 3 --warmup-steps 1 " \
                                  f"--out {tmp_path}"
    txt = (tmp_path / "onebit_adam.txt").read_text()
    assert txt.splitlines() == out.splitlines()  # the .txt is exactly what it printed
    data = json.loads((tmp_path / "onebit_adam.json").read_text())
    assert (data["steps"], data["warmup_steps"], data["world"]) == (3, 1, 2)
    assert all(len(curve) == 3 for curve in data["losses"].values())
    assert (tmp_path / "onebit_adam.png").stat().st_size > 0
