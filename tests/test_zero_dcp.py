"""lslm's ZeRO checkpoint, exported with ``export_dcp``, is a real torch.distributed.checkpoint: FSDP2 loads it at
another world size (2 ranks save, 3 load) and PyTorch's ``dcp_to_torch_save`` consolidates it to the same tensors."""

from __future__ import annotations

from pathlib import Path

import torch

from lslm.zero.checkpoint import consolidate, export_dcp
from tests.helpers import run_workers


def test_fsdp2_loads_an_exported_zero_checkpoint_at_another_world_size(tmp_path: Path) -> None:
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    assert run_workers("tests.zero_dcp_workers:zero_save", 2, timeout=120, folder=str(tmp_path))[0]["world"] == 2
    export_dcp(tmp_path / "zero", tmp_path / "dcp")  # one process, no process group
    params, state = consolidate(tmp_path / "zero", with_state=True)

    # PyTorch's own reader turns the DCP folder back into one state dict: the same tensors, bit for bit.
    dcp_to_torch_save(str(tmp_path / "dcp"), str(tmp_path / "back.pt"))
    back = torch.load(tmp_path / "back.pt", weights_only=True)
    assert back["model"].keys() == params.keys()
    assert all(torch.equal(back["model"][n], params[n]) for n in params)
    assert all(torch.equal(back["optim"][n][k], state[n][k]) for n in params for k in ("exp_avg", "exp_avg_sq"))

    for r in run_workers("tests.zero_dcp_workers:fsdp2_load", 3, timeout=120, folder=str(tmp_path)):
        assert r["world"] == 3 and r["sharded"]  # FSDP2's DTensors really are 1/3 shards here
        assert r["names_equal"] and r["moved_from_init"]
        assert r["params_equal"] and r["moments_equal"]  # dcp.load resharded 2 -> 3 into DTensors exactly
        assert r["steps"] == [2.0]
