"""DeepSpeed's ZeRO engine (stages 1-3, optional CPU offload), set up for side-by-side runs with lslm's ZeRO.

DeepSpeed is part of the course's environment (``pyproject.toml``'s ``[test]`` extra, installed by the Makefile
after torch with ``DS_BUILD_OPS=0`` and ``--no-build-isolation``), so its C++ ops would be compiled on first use
(JIT) by torch's extension builder. ZeRO training here needs none of them: :func:`ds_config` keeps the client torch
optimizer (``zero_force_ds_cpu_optimizer: false``; otherwise DeepSpeed swaps in its CPU Adam op, ~110 s to
compile, and the arithmetic would no longer be lslm's), and the CPU accelerator's shared-memory collective op
(``deepspeed_shm_comm``, ~75 s to compile on 2 cores), which DeepSpeed's communication backend builds when it
starts, serves only ``inference_all_reduce`` (tensor-parallel inference), never a ZeRO step: :func:`build_engine`
marks it unavailable before :func:`deepspeed.initialize`, so no process compiles or loads anything and every
collective of the engine goes through ``torch.distributed`` (where lslm's dispatcher counts see it).
:func:`prepare_environment` still points ``TORCH_EXTENSIONS_DIR`` inside the environment, for anyone who enables
an op by hand.

On a machine where DeepSpeed is not importable, :func:`deepspeed_available` says why, and the tests, bench rows
and demo that need it skip with that reason.

**What DeepSpeed keeps per rank, fp32 AdamW** (counted by :func:`lslm.metrics.held.held_by_owner` after a step;
``Ψ`` parameters, ``N`` ranks; measured with DeepSpeed 0.19.8, tests/test_zero_deepspeed.py). Stages 1 and 2
flatten the module's parameters into one fp32 buffer per parameter group that every rank keeps *whole*
(``bit16_groups_flat``: the module's weights are views into it), and build a *separate* fp32 copy of this rank's
partition for the optimizer (``single_partition_of_fp32_groups``), even when the model is already fp32. The
gradient of that partition exists during the step only (DeepSpeed sets it to ``None`` after), so none is held
between steps: ``4Ψ + 4Ψ/N + 8Ψ/N`` bytes, **10 bytes/param at N = 2** (7 at N = 4). lslm's stage 1 steps views
of the fp32 parameters themselves (no copy) but keeps the whole fp32 gradient buffer: ``4Ψ + 4Ψ + 8Ψ/N``, 12 at
N = 2; its stage 2 keeps the gradient slice: ``4Ψ + 4Ψ/N + 8Ψ/N``, the same 10. Stage 3 partitions everything,
and in fp32 still keeps the fp32 partition as a copy of the parameter partition, plus a persistent gradient
partition buffer: ``(4 + 4 + 4 + 8)Ψ/N``, 10 bytes/param at N = 2, against lslm's and FSDP2's ``16Ψ/N`` (8).
Staging buffers (stage 3's reduce bucket, offload's temporary gradient buffers) are communication buffers, not
model states, and are not in these counts (nor are torch DDP's buckets). DeepSpeed's stage-2 estimator
(``estimate_zero2_model_states_mem_needs``) counts the mixed-precision case instead: 2Ψ of 16-bit weights plus
``18Ψ/N``, its comment's 2 (16-bit gradients) + 4 (fp32 gradients) + 4 (fp32 masters) + 8 (Adam's moments).
"""

from __future__ import annotations

import functools
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import torch
from torch import nn

__all__ = ["BUCKET_NUMEL", "OFFLOADS", "SHM_OP", "STAGES", "build_engine", "deepspeed_available", "ds_config",
           "extensions_dir", "prepare_environment", "skip_inference_ops"]

STAGES = (1, 2, 3)
#: Where DeepSpeed may keep the optimizer (and at stage 3 the parameters): on the device, or on the host.
OFFLOADS = (None, "cpu")
#: DeepSpeed's bucket sizes (elements) in :func:`ds_config`: lslm's default bucket, 25 MiB of fp32.
BUCKET_NUMEL = 25 * 2**20 // 4


def extensions_dir() -> Path:
    """Where torch's extension builder caches DeepSpeed's compiled ops: ``$TORCH_EXTENSIONS_DIR`` if set, else
    ``torch_extensions`` inside this environment (``sys.prefix``: the virtualenv or conda env)."""
    return Path(os.environ.get("TORCH_EXTENSIONS_DIR") or Path(sys.prefix) / "torch_extensions")


def prepare_environment() -> Path:
    """Set ``TORCH_EXTENSIONS_DIR`` (if unset) to :func:`extensions_dir`, before DeepSpeed is imported, so its ops
    compile once per environment and every later process loads them from there. Returns the folder."""
    folder = extensions_dir()
    os.environ.setdefault("TORCH_EXTENSIONS_DIR", str(folder))
    return folder


#: Run in a child process by :func:`deepspeed_available`: import DeepSpeed and name its accelerator; print
#: ``[ok, message]`` as JSON.
_CHECK = """
import json
try:
    import deepspeed
    from deepspeed.accelerator import get_accelerator
except Exception as exc:
    print(json.dumps([False, f"deepspeed is not importable: {type(exc).__name__}: {exc}"]))
else:
    print(json.dumps([True, f"deepspeed {deepspeed.__version__} ({get_accelerator().device_name()} accelerator)"]))
"""

#: The op DeepSpeed's communication backend builds at start-up on a CPU accelerator, for inference only.
SHM_OP = "deepspeed_shm_comm"


@functools.cache
def deepspeed_available(timeout: float = 300.0) -> tuple[bool, str]:
    """``(True, what was found)`` if DeepSpeed can run here, else ``(False, why not)``.

    Checks, in a child process (so that neither a test session nor a notebook kernel imports DeepSpeed), that
    ``deepspeed`` imports and which accelerator it picks. Nothing is compiled (see the module doc). The answer is
    cached for the life of this process.
    """
    prepare_environment()
    try:
        done = subprocess.run([sys.executable, "-c", _CHECK], capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return False, f"importing DeepSpeed took more than {timeout:.0f} s"
    lines = done.stdout.strip().splitlines()
    if done.returncode != 0 or not lines:
        tail = (done.stderr.strip().splitlines() or ["no output"])[-1]
        return False, f"the DeepSpeed check failed (exit code {done.returncode}): {tail}"
    ok, message = json.loads(lines[-1])
    return bool(ok), str(message)


def skip_inference_ops() -> None:
    """Mark DeepSpeed's shared-memory inference all-reduce op unavailable in this process, so its communication
    backend starts without compiling or loading it (ZeRO never calls it; see the module doc). DeepSpeed probes
    which ops are compatible once per process and keeps the answer in ``deepspeed.ops.__compatible_ops__``: this
    edits that answer, before :func:`deepspeed.initialize` creates the backend."""
    import deepspeed.ops

    deepspeed.ops.__compatible_ops__[SHM_OP] = False


def ds_config(stage: int, micro_batch: int, world_size: int, *, offload: str | None = None,
              precision: str = "fp32") -> dict[str, Any]:
    """DeepSpeed's config for one ZeRO run with a client torch optimizer and no clipping (lslm's side-by-side
    setting): ``stage`` 1-3; ``offload="cpu"`` puts the optimizer (and at stage 3 the parameters) on the host;
    ``precision`` ``"fp32"`` or ``"bf16"``."""
    if stage not in STAGES:
        raise ValueError(f"DeepSpeed ZeRO stage must be one of {STAGES}, got {stage!r}")
    if offload not in OFFLOADS:
        raise ValueError(f"offload must be one of {OFFLOADS}, got {offload!r}")
    if precision not in ("fp32", "bf16"):
        raise ValueError(f"precision must be 'fp32' or 'bf16', got {precision!r}")
    # Buckets of lslm's default size (25 MiB of fp32), not DeepSpeed's 5e8 elements: its stage 3 allocates a reduce
    # bucket of that many elements up front (2 GB in fp32). Every parameter partitioned at stage 3: by default
    # DeepSpeed keeps any parameter under 1e5 elements whole on every rank, which is all of a small GPT's.
    bucket = BUCKET_NUMEL
    zero: dict[str, Any] = {"stage": stage, "reduce_bucket_size": bucket, "allgather_bucket_size": bucket}
    if stage == 3:
        zero.update(stage3_param_persistence_threshold=0, stage3_prefetch_bucket_size=bucket)
    if offload == "cpu":
        zero["offload_optimizer"] = {"device": "cpu", "pin_memory": False}
        if stage == 3:
            zero["offload_param"] = {"device": "cpu", "pin_memory": False}
    return {
        "train_micro_batch_size_per_gpu": micro_batch,
        "gradient_accumulation_steps": 1,
        "train_batch_size": micro_batch * world_size,
        "gradient_clipping": 0.0,
        "zero_optimization": zero,
        "bf16": {"enabled": precision == "bf16"},
        "zero_allow_untested_optimizer": True,
        # keep the client torch.optim.AdamW under offload too (else DeepSpeed swaps in its compiled CPU Adam)
        "zero_force_ds_cpu_optimizer": False,
        "steps_per_print": 1 << 30,
        "wall_clock_breakdown": False,
    }


def build_engine(model: nn.Module, optimizer: torch.optim.Optimizer, stage: int, micro_batch: int, *,
                 offload: str | None = None, precision: str = "fp32") -> Any:
    """``deepspeed.initialize`` on ``model`` and the client ``optimizer`` (built over ``model``'s parameters) in
    the process group that is already joined; returns the engine (``engine(x, y)``, ``engine.backward(loss)``,
    ``engine.step()``; call ``engine.destroy()`` before the group ends: without it a rare abort at exit)."""
    prepare_environment()  # before the import: where an op enabled by hand would be cached
    import deepspeed

    skip_inference_ops()

    world = torch.distributed.get_world_size()
    engine, *_ = deepspeed.initialize(model=model, optimizer=optimizer, dist_init_required=False,
                                      config=ds_config(stage, micro_batch, world, offload=offload,
                                                       precision=precision))
    return engine
