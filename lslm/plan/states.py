"""Model-state bytes per device by owner: parameters, gradients, fp32 master weights, optimizer states.

For the ``Ψ`` parameters a device holds (its pipeline stage, its tensor-parallel shard), ``N = dp · cp``
ranks sharing them (HSDP: ``N = dp_shard · cp``, the states replicated ``dp / dp_shard`` times), Adam (two
fp32 moments, 8 bytes), and bytes per element ``p`` (parameters: 4 fp32, 2
bf16/fp16), ``g`` (gradients: 4 with an fp32 ``main_grad``, Megatron's and lslm's default, or ``p``), ``k``
(fp32 master weights: 4 in bf16/fp16, 0 in fp32, where the parameters are the masters). Under
``torch.autocast`` (``Layout.mixed == "autocast"``) the parameters stay fp32 and are the masters: ``p = g = 4``,
``k = 0``, 16 bytes per parameter with Adam; autocast's half copies of the weights are activations
(:mod:`lslm.plan.autocast`), not states:

=======  ==============  ==============  ==============  ==============
stage    parameters      gradients       masters         optimizer
=======  ==============  ==============  ==============  ==============
0        ``p Ψ``         ``g Ψ``         ``k Ψ``         ``8 Ψ``
1        ``p Ψ``         ``g Ψ``         ``k Ψ / N``     ``8 Ψ / N``
2        ``p Ψ``         ``g Ψ / N``     ``k Ψ / N``     ``8 Ψ / N``
3        ``p Ψ / N``     ``g Ψ / N``     ``k Ψ / N``     ``8 Ψ / N``
=======  ==============  ==============  ==============  ==============

With ``p = g = 2``, ``k + 8 = 12`` this is the ZeRO paper's ``(2 + 2 + K)Ψ`` family (Rajbhandari et al. 2020,
§5.4, ``K = 12``, :func:`lslm.metrics.zero_estimates.paper_bytes`); with ``g = 4`` it is Megatron-LM's
convention of 18 bytes per parameter, ``6 + 12/d`` with its distributed optimizer (stage 1).
``offload="cpu"`` (ZeRO-Offload, Ren et al. 2021) moves the masters and optimizer states to the host, which
also keeps an fp32 copy of the gradient slice to step with: ``(4 + 8 + 4)Ψ/N`` there (DeepSpeed's 16 bytes per
parameter of host states), and fp32 masters even when the device trains in fp32.

**Padding, exactly as lslm lays out ZeRO** (:mod:`lslm.zero.layout`): the stage's parameters sit in flat
buckets, each rounded up to a multiple of ``N`` elements; rank ``r`` owns the ``r``-th of ``N`` equal slices of
every bucket, padding at the bucket's end. Whole buffers (parameters below stage 3, gradients below stage 2)
hold the padding; slices hold ``size`` elements; masters and optimizer states exist only for the *parameter*
elements of a rank's slices (so the last ranks, whose slices hold the padding, own fewer). Pass lslm's
bucket sizes (``buckets``) to reproduce its bytes exactly; without them the stage is one bucket. Adam's
4-byte ``step`` per tensor piece is not counted (it is bytes per tensor, not per parameter).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from lslm.plan.layout import Layout
from lslm.plan.terms import Term

__all__ = ["OWNERS", "ModelStates", "bytes_per_element", "model_states"]

OWNERS = ("parameters", "gradients", "master_weights", "optimizer_states")
ADAM_BYTES = 8
SOURCE = "ZeRO §5.4 (Rajbhandari et al. 2020); Megatron-LM distributed optimizer; lslm.zero.layout padding"


def bytes_per_element(layout: Layout) -> dict[str, int]:
    """``p, g, k`` and Adam's 8 for the layout's precision and gradient dtype (module doc)."""
    fp32_params = layout.precision == "fp32" or layout.mixed == "autocast"  # autocast: fp32 params are the masters
    p = 4 if fp32_params else 2
    g = 4 if layout.grad_dtype == "fp32" else p
    k = 0 if fp32_params else 4
    return {"parameters": p, "gradients": g, "master_weights": k, "optimizer_states": ADAM_BYTES}


@dataclass(frozen=True)
class ModelStates:
    """Model-state bytes of one device, by owner, and what stays on the host with offload."""

    device: dict[str, Term]
    host: dict[str, Term]

    @property
    def device_bytes(self) -> float:
        """Sum over owners on the device."""
        return sum(t.value for t in self.device.values())


def _slices(buckets: Sequence[int], n: int, rank: int) -> tuple[int, int, int]:
    """(padded total, elements per rank's slices, parameter elements in rank ``rank``'s slices)."""
    padded = slice_total = owned = 0
    for numel in buckets:
        size = -(-numel // n)
        padded += size * n
        slice_total += size
        owned += max(0, min(size, numel - rank * size))
    return padded, slice_total, owned


def model_states(psi: int, layout: Layout, *, buckets: Sequence[int] | None = None, rank: int = 0) -> ModelStates:
    """Bytes by owner for ``psi`` parameters on one device of ``layout`` (its ``dp · cp`` ranks share them).

    ``buckets``: element counts of the flat buckets (they must sum to ``psi``); ``rank``: the data-parallel
    rank (rank 0 owns full slices: the most loaded); under HSDP the rank inside the shard group.
    """
    n = layout.dp_shard_size * layout.cp
    buckets = [psi] if buckets is None else list(buckets)
    if sum(buckets) != psi or any(b < 0 for b in buckets):
        raise ValueError(f"buckets must be element counts >= 0 summing to psi={psi}, got sum {sum(buckets)}")
    if not 0 <= rank < n:
        raise ValueError(f"rank {rank} is outside the {n} ranks that share the model states")
    width = bytes_per_element(layout)
    offload = layout.offload != "none"  # "disk" streams the same states through the host
    if offload:  # the host steps fp32 masters of its own, whatever the device's precision
        width["master_weights"] = 4
    padded, slice_total, owned = _slices(buckets, n, rank) if layout.zero else (psi, psi, psi)
    stage = layout.zero
    numel = {"parameters": slice_total if stage >= 3 else padded,
             "gradients": slice_total if stage >= 2 else padded,
             "master_weights": owned, "optimizer_states": owned}
    sym = {"parameters": "p", "gradients": "g", "master_weights": "k", "optimizer_states": "8"}
    sharded = {"parameters": stage >= 3, "gradients": stage >= 2, "master_weights": stage >= 1,
               "optimizer_states": stage >= 1}
    device, host = {}, {}
    for owner in OWNERS:
        value = width[owner] * numel[owner]
        formula = f"{sym[owner]}·Ψ" + (" / N" if sharded[owner] else "") + f"  ({sym[owner]} = {width[owner]})"
        term = Term(owner, value, "B", formula, SOURCE)
        offloaded = offload and owner in ("master_weights", "optimizer_states")
        (host if offloaded else device)[owner] = term
        if offloaded:
            device[owner] = Term(owner, 0.0, "B", "offloaded to the host (ZeRO-Offload)", "Ren et al. 2021")
    if offload:
        host["gradients"] = Term("gradients", 4 * owned, "B", "4·Ψ / N: the fp32 copy of the slice the host steps",
                                 "Ren et al. 2021; lslm.zero (offload)")
    return ModelStates(device, host)
