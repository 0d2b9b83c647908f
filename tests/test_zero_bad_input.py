"""ZeRO refuses bad input with errors that say what to do: a stage that does not exist, an offload folder that is
not writable, a disk that fills up (for a checkpoint and for the offloaded states), a checkpoint of another model."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from lslm.models.gpt import GPT, GPTConfig
from lslm.recipes import zero as recipe
from lslm.runtime.context import ParallelContext
from lslm.runtime.grid import RankGrid
from lslm.zero import ZeroOptimizer
from tests.helpers import fake_world, run_workers


def _fake_ctx(world: int, rank: int) -> ParallelContext:
    return ParallelContext.create(RankGrid.build(world, dp=world), rank=rank, local_rank=rank, node_rank=0,
                                  device=torch.device("cpu"), backend="fake", timeout_s=5)


@pytest.mark.parametrize("stage", [0, 4, -1, True, 2.0, "3"])
def test_a_stage_outside_1_to_3_is_refused(stage: object) -> None:
    with fake_world(0, 2):
        model = GPT(GPTConfig.tiny())
        with pytest.raises(ValueError, match=f"ZeRO stage {stage!r} is not implemented here; choose one of"):
            ZeroOptimizer(model, torch.optim.AdamW(model.parameters()), _fake_ctx(2, 0),
                          stage=stage)  # type: ignore[arg-type]
        assert not any(hasattr(p, "main_grad") for p in model.parameters())  # refused before anything changed
    for bad in (0, 4):  # the recipe refuses it before any process starts
        with pytest.raises(ValueError, match="stage"):
            recipe.ZeroConfig(stage=bad)


@pytest.mark.parametrize("prefetch", [-1, True, 1.0, "1", None])
def test_a_prefetch_that_is_not_a_count_of_units_is_refused(prefetch: object) -> None:
    with fake_world(0, 2):
        model = GPT(GPTConfig.tiny())
        with pytest.raises(ValueError, match=f"prefetch must be an int >= 0 .*got {prefetch!r}"):
            ZeroOptimizer(model, torch.optim.AdamW(model.parameters()), _fake_ctx(2, 0), stage=3,
                          prefetch=prefetch)  # type: ignore[arg-type]
        assert not any(p.numel() == 0 for p in model.parameters())  # refused before anything changed


def test_disk_offload_needs_a_writable_folder(tmp_path: Path) -> None:
    with fake_world(0, 2):
        ctx = _fake_ctx(2, 0)
        for folder, match in ((None, "offload='disk' needs offload_dir"),
                              ("/proc/lslm-cannot-write-here", "/proc/lslm-cannot-write-here is not writable"),
                              (tmp_path / "a-file", "a-file is not writable")):
            (tmp_path / "a-file").write_text("a file, not a folder")
            model = GPT(GPTConfig.tiny())
            with pytest.raises(ValueError, match=match):
                ZeroOptimizer(model, torch.optim.AdamW(model.parameters()), ctx, offload="disk", offload_dir=folder)
            assert not any(hasattr(p, "main_grad") for p in model.parameters())  # refused before anything changed
    with pytest.raises(ValueError, match="--offload disk needs --offload-dir"):
        recipe.ZeroConfig(offload="disk")


def test_a_disk_that_fills_up_fails_loudly_and_keeps_the_previous_checkpoint(tmp_path: Path) -> None:
    """RLIMIT_FSIZE makes writes past a size fail (EFBIG), as a full disk makes them fail (ENOSPC)."""
    res = run_workers("tests.zero_bad_input_workers:full_disk", 2, timeout=120, folder=str(tmp_path))
    full, other = res[1], res[0]  # the last rank's checkpoint shard did not fit
    assert full["chunk_bytes"] < full["shard_bytes"]
    assert "rank00001-of-00002.pt" in full["save_error"] and str(tmp_path / "ckpt" / "step2") in full["save_error"]
    assert "File too large" in full["save_error"]
    assert "another rank could not write its shard" in other["save_error"]
    for r in res:
        assert r["latest"] == str(tmp_path / "ckpt" / "step1")  # the failed save left no manifest: not "complete"
        assert r["previous_intact"] and not r["failed_has_manifest"]
        assert r["reloaded_step"] == 1
        # the offloaded states' folder fills up mid-step: the file and the folder named, the next step refused
        assert str(tmp_path / "offload" / f"rank{r['rank']:05d}-of-00002") in r["step_error"]
        assert "writing the offloaded optimizer states" in r["step_error"] and "File too large" in r["step_error"]
        assert "do not hold one consistent step" in r["next_step_error"]


def test_a_checkpoint_of_another_model_is_refused_naming_its_file(tmp_path: Path) -> None:
    res = run_workers("tests.zero_bad_input_workers:other_model", 2, timeout=120, folder=str(tmp_path))
    for r in res:
        assert f"the checkpoint {tmp_path / 'ckpt' / 'manifest.json'} holds another model" in r["error"]
        assert "first difference" in r["error"]
