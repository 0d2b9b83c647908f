"""Which device a bench runs on: a parameter, never a hard-coded backend.

Kept free of heavy imports (torch is imported only to check for a GPU when CUDA is
asked for), so that the ``lslm`` command line stays quick to start.
"""

from __future__ import annotations

__all__ = ["BENCH_DEVICES", "device_env"]

BENCH_DEVICES = ("cpu", "cuda", "auto")


def device_env(device: str) -> dict[str, str]:
    """Environment for a launched bench on ``device``: ``"cpu"`` (gloo), ``"cuda"`` (NCCL) or ``"auto"``.

    ``"auto"`` lets :func:`lslm.runtime.init_distributed` choose (one GPU per rank with NCCL,
    else CPU + gloo). Raises ``ValueError`` for another name, or ``"cuda"`` without a GPU.
    """
    if device not in BENCH_DEVICES:
        raise ValueError(f"bench device must be one of {BENCH_DEVICES}, got {device!r}")
    if device == "cpu":
        return {"LSLM_DEVICE": "cpu", "LSLM_BACKEND": "gloo"}
    if device == "cuda":
        import torch

        if not torch.cuda.is_available():  # asked only because the user chose CUDA
            raise ValueError("device='cuda' needs CUDA GPUs and none is available; use device='cpu'")
        return {"LSLM_DEVICE": "cuda", "LSLM_BACKEND": "nccl"}
    return {}
