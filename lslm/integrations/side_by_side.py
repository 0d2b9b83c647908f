"""lslm DDP, Accelerate and Lightning trained on the same GPT and data in one launch; their losses compared.

All three start from the same seeded weights, read the same global batches (lslm's
epoch order) and use the same AdamW and clipping, so their per-step losses agree up to
fp32 rounding: the ranks' gradients are summed in a different order (torch's reducer vs
lslm's buckets; Accelerate also splits each global batch between the ranks differently),
which changes the last bits of the gradient, and AdamW carries that into the weights.
:data:`LOSS_ATOL` bounds the difference; any real mismatch (another data order, a missing
average, an extra step) moves the loss by 1e-3 or more within a few steps.

**One process group for the whole job.** Destroying the default group and creating it
again in the same processes reuses the same rendezvous keys in torchrun's store (torch
names the default group the same way every time), so the second gloo group can read the
first one's stale addresses and fail with "connection refused". So lslm joins once, and
Accelerate and Lightning, which join only when no group exists, find it joined.
"""

from __future__ import annotations

from typing import Any

from lslm.harness import train_loop
from lslm.recipes import ddp as lslm_ddp
from lslm.runtime.startup import init_distributed

__all__ = ["FRAMEWORKS", "LOSS_ATOL", "max_differences", "worker"]

FRAMEWORKS = ("lslm", "accelerate", "lightning")
LOSS_ATOL = 2e-5  # absolute, on losses near 7: ~40 fp32 ulps (4.8e-7 each there); measured: <= 2 ulps


def worker(frameworks: list[str] | tuple[str, ...] = FRAMEWORKS, script_order: bool = False, gbs: int = 0,
           **kwargs: Any) -> dict[str, Any]:
    """One rank: each framework in turn in this job's one process group; returns ``{name: losses}``.

    ``kwargs`` are :class:`~lslm.recipes.ddp.DDPConfig` fields (the same for all); lslm runs its
    ``bucketed`` DDP. ``script_order=True`` adds ``"lslm_torch_sampler"``: lslm with torch's
    ``DistributedSampler`` order, the order of :mod:`lslm.recipes.ddp_script`. ``gbs > 0`` adds
    ``"gbs"``: :func:`lslm.data_parallel.accumulation.gbs_check` rows for that global batch.
    """
    unknown = set(frameworks) - set(FRAMEWORKS)
    if unknown:
        raise ValueError(f"unknown frameworks {sorted(unknown)}; choose from {FRAMEWORKS}")
    common = {"variant": "bucketed", **kwargs, "device": "cpu", "out": None}
    cfg = lslm_ddp.DDPConfig(**common)
    out: dict[str, Any] = {}
    with init_distributed(device="cpu", seed=cfg.seed) as ctx:
        samplers = (["baseline"] if "lslm" in frameworks else []) + (["torch"] if script_order else [])
        for sampler in samplers:
            run = lslm_ddp.DDPConfig(**{**common, "sampler": sampler})
            ctx.comm.ledger.reset()
            out["lslm" if sampler == "baseline" else "lslm_torch_sampler"] = train_loop(
                run, lslm_ddp.RECIPE.build(run, ctx), ctx)["losses"]
        if "accelerate" in frameworks:
            from lslm.integrations.accelerate_ddp import train_accelerate

            out["accelerate"] = train_accelerate(cfg)
        if "lightning" in frameworks:
            from lslm.integrations.lightning_ddp import train_lightning

            out["lightning"] = train_lightning(cfg)
        if gbs:
            from lslm.data_parallel.accumulation import gbs_check

            out["gbs"] = gbs_check(gbs)
    return out


def max_differences(losses: dict[str, list[float]], reference: str = "lslm") -> dict[str, float]:
    """Largest |loss - reference loss| over the steps, for every other framework in ``losses``."""
    ref = losses[reference]
    return {name: max(abs(a - b) for a, b in zip(vals, ref, strict=True))
            for name, vals in losses.items() if name in FRAMEWORKS and name != reference}
