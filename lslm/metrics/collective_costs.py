"""The alpha-beta-gamma cost model of lslm's collective algorithms: coefficients, fit and prediction.

A collective algorithm's time on ``n`` ranks for a message of ``S`` bytes is modelled along its critical path
(the slowest rank) as ``t = a*alpha + b*S*beta + c*S*gamma``: alpha is the per-message latency, beta the seconds
per byte on the wire, gamma the seconds per byte reduced. :func:`cost_coefficients` gives ``(a, b, c)`` per
algorithm (names as in :mod:`lslm.collectives`), :func:`fit_alpha_beta` fits alpha, beta and gamma to measured
rows, and :func:`model_time` predicts from a fit.

Pure maths on plain rows (no processes): ``lslm bench collectives`` (:mod:`lslm.bench.collectives`) measures and
fits, :mod:`lslm.plot.collectives` draws measurement against the model, and
:class:`lslm.metrics.step_time.LinkCost` reads a fit.
"""

from __future__ import annotations

import math
from typing import Any

__all__ = ["cost_coefficients", "fit_alpha_beta", "model_time"]


def cost_coefficients(name: str, n: int) -> tuple[float, float, float]:
    """(alpha, beta, gamma) multipliers of algorithm ``name`` on ``n`` ranks for a message of S bytes.

    ``t = a*alpha + b*S*beta + c*S*gamma`` along the critical path (the slowest rank).
    """
    L = math.ceil(math.log2(n)) if n > 1 else 0
    k = n.bit_length() - 1
    rd = k + (2 if n != 1 << k else 0)  # recursive doubling: 2 extra rounds fold/unfold the remainder
    f = (n - 1) / n
    table = {
        "broadcast_flat": (n - 1, n - 1, 0),
        "broadcast_tree": (L, L, 0),
        "reduce_tree": (L, L, L),
        "scatter": (n - 1, f, 0),
        "gather": (n - 1, f, 0),
        "all_gather_ring": (n - 1, f, 0),
        "reduce_scatter_ring": (n - 1, f, f),
        "all_to_all_pairwise": (n - 1, f, 0),
        "all_reduce_reduce_broadcast": (2 * L, 2 * L, L),
        "all_reduce_tree": (rd, rd, k),
        "all_reduce_ring": (2 * (n - 1), 2 * f, f),
    }
    return table[name.split("[")[0]]  # a variant ("name[...]") has its algorithm's critical path


def fit_alpha_beta(rows: list[dict[str, Any]]) -> dict[str, float]:
    """Least-squares (relative error) fit of alpha, beta, gamma to the lslm rows of one world size."""
    import numpy as np

    lslm_rows = [r for r in rows if not r["algorithm"].startswith("torch.")]
    A = np.array([[a, b * r["bytes"], c * r["bytes"]] for r in lslm_rows
                  for a, b, c in [cost_coefficients(r["algorithm"], r["world_size"])]], dtype=float)
    t = np.array([r["time_s"] for r in lslm_rows])
    cols = [0, 1, 2]
    while True:  # drop any coefficient that comes out negative (non-physical) and refit
        coef, *_ = np.linalg.lstsq(A[:, cols] / t[:, None], np.ones_like(t), rcond=None)
        if (coef >= 0).all() or len(cols) == 1:
            break
        cols = [c for c, v in zip(cols, coef) if v >= 0]
    full = dict.fromkeys(range(3), 0.0)
    full.update({c: float(v) for c, v in zip(cols, coef)})
    alpha, beta, gamma = full[0], full[1], full[2]
    pred = A @ np.array([alpha, beta, gamma])
    rel = np.abs(pred - t) / t
    return {"alpha_s": alpha, "beta_s_per_byte": beta, "gamma_s_per_byte": gamma,
            "bandwidth_GBps": (1 / beta / 1e9) if beta > 0 else float("inf"),
            "median_rel_error": float(np.median(rel)), "max_rel_error": float(rel.max())}


def model_time(fit: dict[str, float], name: str, n: int, size: int) -> float:
    """Time the fitted model predicts for ``name`` on ``n`` ranks and ``size`` bytes."""
    a, b, c = cost_coefficients(name, n)
    return a * fit["alpha_s"] + b * size * fit["beta_s_per_byte"] + c * size * fit["gamma_s_per_byte"]
