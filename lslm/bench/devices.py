"""Which device a bench runs on: a parameter, never a hard-coded backend.

Kept free of heavy imports (the runtime's device check imports torch only when CUDA or
NCCL is asked for), so that the ``lslm`` command line stays quick to start.
"""

from __future__ import annotations

__all__ = ["BENCH_DEVICES", "device_env"]

BENCH_DEVICES = ("cpu", "cuda", "auto")


def device_env(device: str, nproc: int = 1) -> dict[str, str]:
    """Environment for a launched bench on ``device``: ``"cpu"`` (gloo), ``"cuda"`` (NCCL) or ``"auto"``.

    ``"auto"`` lets :func:`lslm.runtime.init_distributed` choose (one GPU per rank with NCCL,
    else CPU + gloo). Raises ``ValueError`` for another name, or when this machine cannot
    run ``nproc`` ranks on it (the launcher's own check, run once for the largest world size
    so that no launch starts before the error).
    """
    if device not in BENCH_DEVICES:
        raise ValueError(f"bench device must be one of {BENCH_DEVICES}, got {device!r}")
    env = {"cpu": {"LSLM_DEVICE": "cpu", "LSLM_BACKEND": "gloo"},
           "cuda": {"LSLM_DEVICE": "cuda", "LSLM_BACKEND": "nccl"}}.get(device, {})
    from lslm.launcher.launch_checks import check_device_request

    check_device_request(env, nproc)
    return env
