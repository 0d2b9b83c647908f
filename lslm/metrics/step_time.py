"""A step-time model for bucketed DDP: alpha-beta(-gamma) all-reduce costs plus overlap with backward.

Pure functions (no processes, no tensors); :mod:`lslm.bench.step_time_check` measures the
same quantities on real processes and compares.

**All-reduce of one bucket** of ``S`` bytes on ``n`` ranks, ring algorithm (notebook 02)::

    t(S) = 2(n-1) alpha + 2(n-1)/n S beta + (n-1)/n S gamma

(alpha: seconds per message, beta: seconds per byte on the wire, gamma: seconds per byte
reduced). ``n = 1`` gives ``t = 0``: nothing to exchange.

**Overlap with backward.** The model's assumptions, exactly:

1. gradient bytes become ready at a constant rate during backward (``G`` bytes in
   ``T_b`` seconds), in bucket order: bucket ``k`` is ready at ``r_k = T_b C_k / G``,
   ``C_k`` the bytes of buckets ``0..k`` (so the last bucket is ready when backward ends);
2. one communication channel: all-reduces run one after another in bucket order (as
   :class:`~lslm.data_parallel.ddp.BucketedDDP` launches them, on one process group),
   bucket ``k`` from ``s_k = max(r_k, e_{k-1})`` to ``e_k = s_k + t(S_k)``;
3. communication and computation do not slow each other down (no shared cores,
   memory bandwidth or launch overhead), and every rank runs at the same speed.

Then the exposed communication (the time ``finish_grad_sync`` waits) and the step are::

    E = e_last - T_b  >=  t(S_last)          (the last bucket is ready only when backward ends)
    step = T_f + T_b + E + T_opt

**Communication-bound.** The channel cannot start before the first bucket is ready and is
busy ``W = sum_k t(S_k)`` in all, so ``e_last >= r_0 + W`` and ``E >= W - T_b + r_0``. We call a
step *communication-bound* when ``W > T_b``: communication per step exceeds backward, no
overlap can hide it, and every further second of communication lengthens the step.
Below that, how much shows depends on the bucket sizes: ``E = t(S_last)`` exactly (only the
last bucket exposed) iff every earlier bucket has finished when backward ends, i.e. iff
``T_b >= T_b* = max_k G R_k / (G - C_k)`` over ``k < last``, ``R_k`` the all-reduce time of
buckets ``k..last-1`` (:func:`only_last_exposed_backward_s`); with equal buckets ``T_b* = W``,
and the two thresholds coincide. ``W`` and ``T_b`` both grow linearly with ``G`` (at a fixed
bucket size and tokens per rank), so the crossover is in backward seconds *per gradient
byte*: ``kappa* = 2(n-1) alpha / S + (n-1)/n (2 beta + gamma)`` (:func:`critical_backward_per_byte`),
whatever the model size.

Li et al. 2020, "PyTorch Distributed" (VLDB), §3.2.3; Thakur, Rabenseifner & Gropp 2005
(ring all-reduce cost); Hockney 1994 (the alpha-beta model).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

__all__ = ["LinkCost", "StepPrediction", "critical_backward_per_byte", "critical_world_size", "exposed_comm_s",
           "fit_ring", "fit_ring_totals", "only_last_exposed_backward_s", "predict_step", "ring_all_reduce_s",
           "split_buckets"]


@dataclass(frozen=True)
class LinkCost:
    """alpha (s per message), beta (s per byte sent), gamma (s per byte reduced); all >= 0."""

    alpha_s: float
    beta_s_per_byte: float
    gamma_s_per_byte: float = 0.0

    def __post_init__(self) -> None:
        for name in ("alpha_s", "beta_s_per_byte", "gamma_s_per_byte"):
            v = getattr(self, name)
            if not (isinstance(v, (int, float)) and v >= 0 and not math.isnan(v)):
                raise ValueError(f"{name} must be a number >= 0, got {v!r}")

    @classmethod
    def from_fit(cls, fit: dict[str, Any]) -> LinkCost:
        """From a fit dict of :func:`lslm.metrics.collective_costs.fit_alpha_beta` (as in
        ``bench/results/collectives.json``)."""
        return cls(float(fit["alpha_s"]), float(fit["beta_s_per_byte"]), float(fit.get("gamma_s_per_byte", 0.0)))


def _check_n(n: int) -> None:
    if isinstance(n, bool) or not isinstance(n, int) or n < 1:
        raise ValueError(f"world size n must be an int >= 1, got {n!r}")


def ring_all_reduce_s(nbytes: float, n: int, link: LinkCost) -> float:
    """Ring all-reduce time of ``nbytes`` on ``n`` ranks: ``2(n-1) alpha + (n-1)/n S (2 beta + gamma)``."""
    _check_n(n)
    if nbytes < 0:
        raise ValueError(f"nbytes must be >= 0, got {nbytes}")
    if n == 1:
        return 0.0
    return 2 * (n - 1) * link.alpha_s + (n - 1) / n * nbytes * (2 * link.beta_s_per_byte + link.gamma_s_per_byte)


def split_buckets(grad_bytes: int, bucket_bytes: int) -> list[int]:
    """``grad_bytes`` cut into buckets of ``bucket_bytes`` in readiness order; the remainder is the last bucket.

    Gradients are treated as divisible (the real plan, :func:`~lslm.data_parallel.ddp.plan_buckets`,
    keeps each tensor whole, so its sizes differ a little; pass those to :func:`predict_step` instead).
    """
    if grad_bytes < 1 or bucket_bytes < 1:
        raise ValueError(f"need grad_bytes >= 1 and bucket_bytes >= 1, got {grad_bytes}, {bucket_bytes}")
    full, rest = divmod(int(grad_bytes), int(bucket_bytes))
    return [int(bucket_bytes)] * full + ([rest] if rest else [])


def _check_buckets(buckets: Sequence[float]) -> None:
    if not buckets or any(b <= 0 for b in buckets):
        raise ValueError(f"buckets must be a non-empty list of sizes > 0 bytes, got {list(buckets)!r}")


def exposed_comm_s(buckets: Sequence[float], n: int, link: LinkCost, backward_s: float) -> float:
    """Exposed communication ``E = e_last - T_b`` under the module's assumptions 1-3 (seconds)."""
    _check_buckets(buckets)
    if backward_s < 0:
        raise ValueError(f"backward_s must be >= 0, got {backward_s}")
    total, done, end = float(sum(buckets)), 0.0, 0.0
    for size in buckets[:-1]:
        done += size
        ready = backward_s * done / total
        end = max(ready, end) + ring_all_reduce_s(size, n, link)
    # The last bucket is ready when backward ends (r_last = T_b), so E = max(0, e_{last-1} - T_b) + t(S_last):
    # written this way the last bucket's term is exact, not the difference of two large times.
    return max(0.0, end - backward_s) + ring_all_reduce_s(buckets[-1], n, link)


def only_last_exposed_backward_s(buckets: Sequence[float], n: int, link: LinkCost) -> float:
    """``T_b*``: the shortest backward for which only the last bucket is exposed (``E = t(S_last)``).

    Below it earlier buckets are still on the wire when backward ends.
    ``T_b* = max_k G R_k / (G - C_k)`` over every bucket but the last (0 for one bucket); with
    equal buckets it equals their total all-reduce time. A small bucket just before the last
    (ready just before backward ends) makes it large: it has no time to hide in.
    """
    _check_buckets(buckets)
    total = float(sum(buckets))
    times = [ring_all_reduce_s(b, n, link) for b in buckets]
    best, done = 0.0, 0.0
    for k in range(len(buckets) - 1):
        done += buckets[k]
        best = max(best, total * sum(times[k:-1]) / (total - done))
    return best


def critical_backward_per_byte(n: int, link: LinkCost, bucket_bytes: float) -> float:
    """Backward seconds per gradient byte below which buckets of ``bucket_bytes`` are communication-bound.

    All-reduce time per gradient byte, ``2(n-1) alpha / S + (n-1)/n (2 beta + gamma)`` (``W / G``
    for equal buckets); independent of the model size.
    """
    if bucket_bytes <= 0:
        raise ValueError(f"bucket_bytes must be > 0, got {bucket_bytes}")
    return ring_all_reduce_s(bucket_bytes, n, link) / bucket_bytes


def critical_world_size(buckets: Sequence[float], link: LinkCost, backward_s: float, n_max: int = 4096) -> int | None:
    """The smallest ``n`` (2..``n_max``) at which this backward is communication-bound (``W > T_b``); else ``None``.

    ``W`` grows with ``n`` (every all-reduce does), so the first ``n`` with ``W(n) > backward_s`` is it.
    """
    _check_n(n_max)
    _check_buckets(buckets)

    def comm(n: int) -> float:
        return sum(ring_all_reduce_s(b, n, link) for b in buckets)

    lo, hi = 2, n_max
    if hi < lo or comm(hi) <= backward_s:
        return None
    while lo < hi:  # binary search on a non-decreasing function of n
        mid = (lo + hi) // 2
        if comm(mid) > backward_s:
            hi = mid
        else:
            lo = mid + 1
    return lo


@dataclass(frozen=True)
class StepPrediction:
    """What the model predicts for one DDP step (seconds; ``per_bucket_s`` in bucket order)."""

    per_bucket_s: list[float]
    comm_s: float  # W: all buckets' all-reduce time, back to back: what would be exposed without overlap
    exposed_s: float
    step_s: float
    compute_s: float
    backward_s: float
    only_last_exposed_backward_s: float
    comm_bound: bool  # W > T_b

    @property
    def hidden_fraction(self) -> float:
        """``1 - E / comm``: the share of communication hidden behind backward (1 with no communication)."""
        return 1.0 - self.exposed_s / self.comm_s if self.comm_s > 0 else 1.0


def predict_step(buckets: Sequence[float], n: int, link: LinkCost, compute_s: float, *,
                 backward_fraction: float = 2 / 3, optimizer_s: float = 0.0) -> StepPrediction:
    """Step time of bucketed DDP: ``compute + E + optimizer`` (module doc; assumptions 1-3).

    ``compute_s`` is forward + backward *without* communication (measured by the caller, e.g.
    one process alone), ``backward_fraction`` the share of it that is backward (default 2/3:
    backward costs about twice the forward's FLOPs). ``buckets`` are bytes in readiness order.
    """
    _check_n(n)
    if compute_s < 0 or optimizer_s < 0:
        raise ValueError(f"compute_s and optimizer_s must be >= 0, got {compute_s}, {optimizer_s}")
    if not 0 <= backward_fraction <= 1:
        raise ValueError(f"backward_fraction must be in [0, 1], got {backward_fraction}")
    backward = compute_s * backward_fraction
    per_bucket = [ring_all_reduce_s(b, n, link) for b in buckets]
    exposed = exposed_comm_s(buckets, n, link, backward)
    comm = sum(per_bucket)
    return StepPrediction(per_bucket, comm, exposed, compute_s + exposed + optimizer_s, compute_s, backward,
                          only_last_exposed_backward_s(buckets, n, link), comm > backward)


def fit_ring(sizes: Sequence[float], times: Sequence[float], n: int) -> LinkCost:
    """Fit alpha and a per-byte cost to all-reduce times at one world size (least squares on relative error).

    At one ``n`` the beta and gamma terms are both proportional to ``S``, so they cannot be told
    apart: the fit returns ``gamma = 0`` and a ``beta`` that includes the reduction (``beta + gamma/2``).
    A coefficient that comes out negative is non-physical (noisy small messages can pull the
    joint fit there): the per-byte cost is then the slope between the smallest and the largest
    message, and alpha what is left of the smallest one's time; only times that fall with size
    give ``beta = 0``.
    """
    import numpy as np

    _check_n(n)
    if n < 2:
        raise ValueError("fitting needs n >= 2 (one rank communicates nothing)")
    if len(sizes) != len(times) or len(sizes) < 2 or any(t <= 0 for t in times):
        raise ValueError("need >= 2 (size, time) pairs with times > 0")
    t = np.asarray(times, dtype=float)
    A = np.array([[2 * (n - 1), 2 * (n - 1) / n * s] for s in sizes], dtype=float) / t[:, None]
    coef, *_ = np.linalg.lstsq(A, np.ones_like(t), rcond=None)
    if coef[0] >= 0 and coef[1] >= 0:
        return LinkCost(float(coef[0]), float(coef[1]), 0.0)
    lo, hi = int(np.argmin(sizes)), int(np.argmax(sizes))
    per_byte = 2 * (n - 1) / n
    slope = (t[hi] - t[lo]) / (per_byte * (sizes[hi] - sizes[lo])) if sizes[hi] > sizes[lo] else 0.0
    beta = max(0.0, float(slope))
    alpha = max(0.0, float(t[lo] - per_byte * sizes[lo] * beta) / (2 * (n - 1)))
    return LinkCost(alpha, beta, 0.0)


def fit_ring_totals(bucket_lists: Sequence[Sequence[float]], totals: Sequence[float], n: int,
                    alpha_s: float | None = None) -> LinkCost:
    """Fit alpha and a per-byte cost to the time of whole lists of buckets all-reduced back to back.

    ``totals[c]`` is the measured time of all-reducing ``bucket_lists[c]`` one after another, so the
    model is ``W_c = 2(n-1) alpha K_c + 2(n-1)/n beta G_c`` (``K_c`` buckets of ``G_c`` bytes in all):
    a fit on the sizes a DDP step really uses, not on a sweep of single messages. Least squares on
    relative error. Lists with different bucket counts tell alpha from beta; with ``alpha_s`` given
    (e.g. a sweep's), only the per-byte cost is fitted. The best non-negative fit is returned: when
    the joint fit makes a coefficient negative, the better of the two one-term fits.
    """
    import numpy as np

    _check_n(n)
    if n < 2:
        raise ValueError("fitting needs n >= 2 (one rank communicates nothing)")
    if len(bucket_lists) != len(totals) or not totals or any(t <= 0 for t in totals):
        raise ValueError("need one total time > 0 per list of buckets")
    for buckets in bucket_lists:
        _check_buckets(buckets)
    t = np.asarray(totals, dtype=float)
    design = np.array([[2 * (n - 1) * len(b), 2 * (n - 1) / n * float(sum(b))] for b in bucket_lists]) / t[:, None]

    def rss(coef: Any) -> float:
        return float(np.sum((design @ coef - 1.0) ** 2))

    if alpha_s is not None:
        if alpha_s < 0:
            raise ValueError(f"alpha_s must be >= 0, got {alpha_s}")
        rest = 1.0 - design[:, 0] * alpha_s
        beta = float(design[:, 1] @ rest / (design[:, 1] @ design[:, 1]))
        return LinkCost(float(alpha_s), max(0.0, beta), 0.0)
    if len({len(b) for b in bucket_lists}) < 2:
        raise ValueError("alpha and beta need lists with at least two different bucket counts (or give alpha_s)")
    coef, *_ = np.linalg.lstsq(design, np.ones_like(t), rcond=None)
    if coef[0] < 0 or coef[1] < 0:  # the constrained optimum lies on an axis: one term only
        one = []
        for j in (0, 1):
            c = np.zeros(2)
            c[j] = max(0.0, float(design[:, j].sum() / (design[:, j] @ design[:, j])))
            one.append(c)
        coef = min(one, key=rss)
    return LinkCost(float(coef[0]), float(coef[1]), 0.0)
