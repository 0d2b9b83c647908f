"""Workers for tests/test_zero_bad_input.py: a disk that fills up, made real with RLIMIT_FSIZE (no root needed).

``setrlimit(RLIMIT_FSIZE, n)`` caps the size of any file this process writes: a write past ``n`` bytes
fails with ``EFBIG`` (once ``SIGXFSZ``, which would kill the process, is ignored), exactly as a full
disk fails a write part-way, with ``ENOSPC``. Each check raises the limit again before it goes on.
"""

from __future__ import annotations

import copy
import resource
import signal
from pathlib import Path
from typing import Any

import torch

from lslm.models.gpt import GPT, GPTConfig
from lslm.runtime import init_distributed
from lslm.zero import ZeroOptimizer
from lslm.zero.checkpoint import MANIFEST, latest_checkpoint, load_zero, save_zero
from tests.zero_workers import CONFIG, _adamw, _batches, _train

__all__ = ["full_disk", "other_model"]


def _files(folder: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(folder.iterdir())}


def _limit(nbytes: int | None) -> None:
    soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
    resource.setrlimit(resource.RLIMIT_FSIZE, (hard if nbytes is None else nbytes, hard))


def full_disk(folder: str) -> dict[str, Any]:
    """A checkpoint save and an offloaded step on a disk that fills up; what each rank saw (its messages)."""
    ctx = init_distributed()
    world, rank = ctx.world_size, ctx.rank
    root = Path(folder)
    torch.manual_seed(0)
    serial = GPT(GPTConfig(**CONFIG))
    batches = _batches(world)
    model = copy.deepcopy(serial)
    kw = dict(stage=2, bucket_cap_mb=0.02, offload="disk", disk_chunk_mb=0.02)
    zero = ZeroOptimizer(model, _adamw(model), ctx, offload_dir=str(root / "offload"), **kw)
    _train(zero, model, batches[:1], world, rank)
    good = save_zero(zero, root / "ckpt" / "step1", step=1)
    before = _files(good)
    out: dict[str, Any] = {"rank": rank}
    shard = max(len(v) for k, v in before.items() if k != MANIFEST)
    chunk = max(zero.disk.file_bytes)
    out["chunk_bytes"], out["shard_bytes"] = chunk, shard
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # a write past the limit fails with EFBIG instead of killing us

    # 1. The checkpoint folder fills up on the last rank: its shard does not fit (the offload chunks still do).
    _train(zero, model, batches[1:2], world, rank)
    if rank == world - 1:
        _limit((chunk + shard) // 2)
    try:
        save_zero(zero, root / "ckpt" / "step2", step=2)
        out["save_error"] = ""
    except OSError as e:
        out["save_error"] = str(e)
    finally:
        _limit(None)
    ctx.comm.barrier(label="test")
    out["latest"] = str(latest_checkpoint(root / "ckpt"))
    out["previous_intact"] = _files(good) == before
    out["failed_has_manifest"] = (root / "ckpt" / "step2" / MANIFEST).exists()
    model_b = copy.deepcopy(serial)
    zero_b = ZeroOptimizer(model_b, _adamw(model_b), ctx, offload_dir=str(root / "offload-b"), **kw)
    out["reloaded_step"] = load_zero(zero_b, latest_checkpoint(root / "ckpt"))["step"]
    zero_b.disk.close(remove=True)

    # 2. The offload folder fills up during a step (on every rank: the step has no collective after the files).
    _limit(chunk // 2)
    try:
        _train(zero, model, batches[2:3], world, rank)
        out["step_error"] = ""
    except OSError as e:
        out["step_error"] = str(e)
    finally:
        _limit(None)
    try:  # the files now mix two steps: the next step refuses instead of training on them
        _train(zero, model, batches[2:3], world, rank)
        out["next_step_error"] = ""
    except RuntimeError as e:
        out["next_step_error"] = str(e)
    zero.disk.close()
    return out


def other_model(folder: str) -> dict[str, Any]:
    """A checkpoint of the 3-layer model loaded into a 2-layer one: the error each rank raises."""
    ctx = init_distributed()
    root = Path(folder)
    torch.manual_seed(0)
    model = GPT(GPTConfig(**CONFIG))
    zero = ZeroOptimizer(model, _adamw(model), ctx, stage=1, bucket_cap_mb=0.02)
    _train(zero, model, _batches(ctx.world_size)[:1], ctx.world_size, ctx.rank)
    save_zero(zero, root / "ckpt", step=1)
    small = GPT(GPTConfig(**{**CONFIG, "n_layer": 2}))
    try:
        load_zero(ZeroOptimizer(small, _adamw(small), ctx, stage=1, bucket_cap_mb=0.02), root / "ckpt")
        return {"error": ""}
    except ValueError as e:
        return {"error": str(e)}
