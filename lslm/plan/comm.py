"""Communication per step, per axis: which collectives, how many bytes, on which link, how long.

Each entry is a :class:`Collective`: an algorithm of :func:`lslm.metrics.collective_costs.cost_coefficients`
(ring all-reduce, all-gather, reduce-scatter) or a point-to-point send, its payload ``S`` (the whole buffer:
what an all-reduce reduces, what an all-gather returns), the group size ``n``, how many times per step, and the
link it runs on (:meth:`lslm.plan.hardware.Hardware.link`). Its time is the alpha-beta model along the
critical path, ``a alpha + b S beta`` per call (``2(n - 1)`` messages and ``2(n-1)/n S`` bytes for a ring
all-reduce; ``n - 1`` and ``(n-1)/n S`` for all-gather and reduce-scatter; 1 and ``S`` for a send), or, where
the link carries a measured table of that collective at that group size whose sizes bracket ``S``, the table
read at ``S`` (:attr:`lslm.plan.hardware.Link.measured`: the ``cpu-box`` preset's gloo collectives). A ring
collective whose group spans nodes runs through the network adapters of all its ranks on a node at once
(:meth:`lslm.plan.hardware.Hardware.link` with the group's ranks per node: FSDP over whole nodes gets eight
adapters' bandwidth, a data-parallel group beside ``tp = 8`` one); point-to-point sends, the pipeline's and the
context-parallel ring's, get one adapter.

* **dp** (``dp · cp`` ranks; Rajbhandari et al. 2020 §7): stage 0 all-reduces the gradients (``2Ψ`` elements
  through each rank); stages 1-2 reduce-scatter the gradients and all-gather the updated parameters (``Ψ + Ψ``,
  the same volume), stage 2 reduce-scattering every micro-batch's gradients as backward produces them (it keeps
  only its slice, so it cannot accumulate whole gradients first: ``(m + 1)Ψ`` per step); stage 3 all-gathers
  each layer before its forward and again before its backward and reduce-scatters its gradients, **every
  micro-batch** (``3Ψ`` per micro-batch; the parameters outside the
  layers, embedding and head, are gathered once per micro-batch and kept until its backward, as lslm does:
  ``2Ψ_root``). Messages are buckets of ``bucket_mb`` (stage 3: one per layer).
* **HSDP** (``dp_shard < dp``): the collectives above run in the shard group (``dp_shard · cp`` ranks,
  collectives labelled axis ``"dp_shard"``, their link the span of that group), and once per step each rank's
  gradient slices are all-reduced across the ``dp / dp_shard`` replicas (axis ``"dp_replicate"``, one call per
  bucket, ``g·Ψ / N`` in all: ``1/dp_shard`` of DDP's all-reduce), on the link spanning the whole dp group.
* **tp** (``t`` ranks; Shoeybi et al. 2019 §3, Korthikanti et al. 2022 §4.2.2), per layer and micro-batch,
  ``A = e · s b h``: without sequence parallelism two all-reduces of ``A`` in the forward and two in the
  backward; with it, each becomes an all-gather and a reduce-scatter, plus two all-gathers in the backward that
  re-gather the saved sharded inputs (Megatron's and lslm's choice). Full recomputation repeats the forward's.
  The first stage adds the embedding's all-reduce (with SP: a reduce-scatter, and an all-gather in the
  backward), the last the head's (without SP one all-reduce in the backward; with it an all-gather in the
  forward, a re-gather and a reduce-scatter in the backward) and the vocabulary-parallel cross-entropy's two
  small all-reduces (the max, ``4 s b`` bytes; the target logit and the sum of exponentials, ``8 s b``).
  With sequence parallelism the gradients of the replicated parameters (norms, row-parallel biases, position
  embedding) are summed over the group once per step; with fewer key/value heads than ranks (GQA), so are the
  replicated heads' (lslm's ``kv-heads`` buffer: a slot per head). ``regather=False`` (lslm's plan for Hugging
  Face models) keeps the gathered inputs instead of re-gathering them: 2 fewer all-gathers per layer. These are
  the calls lslm's :func:`~lslm.tensor_parallel.apply.apply_tensor_parallel` and its gradient sync make (tests
  count them in its ledger, and in the committed ``bench/results/tp.json``).
* **pp** (Narayanan et al. 2021 §2.2): per micro-batch and chunk, one activation forward and one gradient
  backward of ``e · s b h`` (``/t`` with SP), ``v`` chunks per rank; nothing leaves the model's first stage
  backward or its last stage forward (:func:`pp_sends`; a test counts lslm's executor's sends).
* **cp** (``c`` ranks, strided by ``t``: the group spans ``c · t`` devices; Liu et al. 2023, ring attention;
  Jacobs et al. 2023, DeepSpeed-Ulysses §3), per layer and micro-batch, with ``u_q = e · b (s/c) h/t`` (this
  rank's queries) and ``u_kv`` (its keys, or values: ``kv/a`` of ``u_q``, at least one head per rank):
  the **ring** sends its key/value block ``c - 1`` times in the forward (``2 u_kv`` each, behind the attention
  of the block in hand), again ``c - 1`` times in the backward, and the dK/dV accumulator ``c`` times (it
  travels the whole ring to come home, in fp32: ``2 u_kv · 4/e`` each); **Ulysses** all-to-alls q, k, v
  (``u_q + 2 u_kv``; it needs the key/value heads of each tp rank divisible by ``c``, and lslm does not replicate
  them) and the output (``u_q``) in the forward and their gradients in the backward, on the critical path.
  Recomputation (full or
  selective: the attention core) repeats the forward's. The payloads are what lslm's ledger records (the
  ring's sends; Ulysses' whole all-to-all inputs, ``(c - 1)/c`` of which leave the rank): the same formulas as
  :func:`lslm.context_parallel.traffic.cp_traffic`, and a test equals them with the ledger of lslm's
  context-parallel GPT. The loss's two one-number all-reduces over ``dp · cp`` are left out.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

from lslm.metrics.collective_costs import cost_coefficients
from lslm.plan.activations import cp_element_size, cp_units
from lslm.plan.hardware import Hardware, Link
from lslm.plan.layout import Layout, layers_on_stage
from lslm.plan.memory import replicated_params, stage_split
from lslm.plan.model import ModelSpec
from lslm.plan.states import bytes_per_element

__all__ = ["AXES", "AxisComm", "Collective", "communication", "pp_sends"]

AXES = ("dp", "tp", "pp", "cp")


@dataclass(frozen=True)
class Collective:
    """``count`` calls of ``algorithm`` on ``n`` ranks with ``payload`` bytes each, over ``link``."""

    axis: str
    label: str
    algorithm: str  #: a name of :func:`lslm.metrics.collective_costs.cost_coefficients`, or "p2p"
    payload: float
    n: int
    count: float
    link: Link
    formula: str

    @property
    def wire_bytes(self) -> float:
        """Bytes each rank sends over all calls (the ``b S`` term: ``2(n-1)/n S`` for a ring all-reduce)."""
        return self.count * self._coefficients()[1] * self.payload

    @property
    def time_s(self) -> float:
        """Time of all calls back to back: each call's measured time where the link has a measurement of this
        algorithm and group size around the payload (:meth:`~lslm.plan.hardware.Link.measured_time`), else
        alpha-beta."""
        if self.n > 1:
            measured = self.link.measured_time(self.algorithm, self.n, self.payload)
            if measured is not None:
                return self.count * measured
        a, b, _ = self._coefficients()
        cost = self.link.for_algorithm(self.algorithm).cost
        return self.count * (a * cost.alpha_s + b * self.payload * cost.beta_s_per_byte)

    def _coefficients(self) -> tuple[float, float, float]:
        if self.n <= 1:
            return 0.0, 0.0, 0.0
        if self.algorithm == "p2p":
            return 1.0, 1.0, 0.0
        return cost_coefficients(self.algorithm, self.n)


@dataclass(frozen=True)
class AxisComm:
    """One axis's collectives per step on the most loaded device."""

    axis: str
    group: int
    link: Link
    collectives: tuple[Collective, ...]

    @property
    def payload_bytes(self) -> float:
        """Sum of payloads x calls (what the ledger records as bytes)."""
        return sum(c.payload * c.count for c in self.collectives)

    @property
    def wire_bytes(self) -> float:
        """Bytes each rank sends per step."""
        return sum(c.wire_bytes for c in self.collectives)

    @property
    def time_s(self) -> float:
        """All of the axis's communication back to back (before any overlap)."""
        return sum(c.time_s for c in self.collectives)


def _calls(total_bytes: float, bucket_bytes: float) -> tuple[float, float]:
    """(count, payload) for ``total_bytes`` cut into buckets of at most ``bucket_bytes`` (equal-sized here)."""
    if total_bytes <= 0:
        return 0.0, 0.0
    count = math.ceil(total_bytes / bucket_bytes)
    return float(count), total_bytes / count


def _dp(model: ModelSpec, layout: Layout, hw: Hardware, m: int, stage: int) -> AxisComm:
    n = layout.dp_shard_size * layout.cp
    link = hw.link(n * layout.tp, hw.ranks_per_node(n, layout.tp))
    width = bytes_per_element(layout)
    layer_part, root = stage_split(model, layout, stage)
    psi = layer_part + root
    g, p = width["gradients"] * psi, width["parameters"] * psi
    bucket = layout.bucket_mb * 2**20
    out: list[Collective] = []
    if layout.zero == 0:
        c, s = _calls(g, bucket)
        out.append(Collective("dp", "gradient all-reduce", "all_reduce_ring", s, n, c, link, "2Ψ (all-reduce, g·Ψ)"))
    elif layout.zero in (1, 2):
        c, s = _calls(g, bucket)
        if layout.zero == 1:
            out.append(Collective("dp", "gradient reduce-scatter", "reduce_scatter_ring", s, n, c, link, "Ψ (g·Ψ)"))
        else:  # only slices of the gradients are kept: every micro-batch's are reduce-scattered as they appear
            out.append(Collective("dp", "gradient reduce-scatter (per micro-batch)", "reduce_scatter_ring", s, n,
                                  c * m, link, "Ψ per micro-batch (g·Ψ)"))
        c, s = _calls(p, bucket)
        out.append(Collective("dp", "parameter all-gather", "all_gather_ring", s, n, c, link, "Ψ (p·Ψ)"))
    else:
        layers = layers_on_stage(model, layout, stage)
        one = layer_part // layers
        pl, gl = width["parameters"] * one, width["gradients"] * one
        out += [Collective("dp", "layer all-gather (forward)", "all_gather_ring", pl, n, layers * m, link,
                           "Ψ per micro-batch"),
                Collective("dp", "layer all-gather (backward)", "all_gather_ring", pl, n, layers * m, link,
                           "Ψ per micro-batch"),
                Collective("dp", "layer gradient reduce-scatter", "reduce_scatter_ring", gl, n, layers * m, link,
                           "Ψ per micro-batch")]
        if root:
            out += [Collective("dp", "root all-gather", "all_gather_ring", width["parameters"] * root, n, m, link,
                               "Ψ_root per micro-batch (kept from its forward to its backward)"),
                    Collective("dp", "root gradient reduce-scatter", "reduce_scatter_ring", width["gradients"] * root,
                               n, m, link, "Ψ_root per micro-batch")]
    if layout.dp_replicate > 1:  # HSDP: the above inside the shard group, then the slices across replicas
        out = [dataclasses.replace(c, axis="dp_shard") for c in out]
        if layout.zero == 3:  # one bucket per layer, and the root
            per_layer = layer_part // (layers_on_stage(model, layout, stage))
            calls = [(width["gradients"] * per_layer / n, float(layers_on_stage(model, layout, stage)))]
            calls += [(width["gradients"] * root / n, 1.0)] if root else []
        else:
            c, s = _calls(g, bucket)
            calls = [(s / n, c)]
        stride = layout.dp_shard_size * layout.cp * layout.tp
        across = hw.link(layout.dp * layout.cp * layout.tp, hw.ranks_per_node(layout.dp_replicate, stride))
        out += [Collective("dp_replicate", "gradient slice all-reduce across replicas", "all_reduce_ring", size,
                           layout.dp_replicate, count, across, "g·Ψ / N once per step: the slice, summed over the "
                           "shard group, then over the replicas") for size, count in calls]
    return AxisComm("dp", layout.dp * layout.cp, link, tuple(out))


def _tp(model: ModelSpec, layout: Layout, hw: Hardware, m: int, stage: int) -> AxisComm:
    t = layout.tp
    link = hw.link(t, hw.ranks_per_node(t, 1))
    e = 4 if layout.precision == "fp32" else 2
    s, b, h = model.seq_len // layout.cp, model.micro_batch, model.hidden
    a = e * s * b * h
    layers = layers_on_stage(model, layout, stage)
    fwd_passes = 2 if layout.recompute == "full" else 1
    out: list[Collective] = []
    if layout.sequence_parallel:
        regathers = 2 if layout.regather else 0
        out += [Collective("tp", "layer all-gather", "all_gather_ring", a, t,
                           (2 * fwd_passes + 2 + regathers) * layers * m, link,
                           "2 forward (+2 recompute) + 2 backward" + (" + 2 re-gathers" if regathers else "")
                           + " per layer"),
                Collective("tp", "layer reduce-scatter", "reduce_scatter_ring", a, t,
                           (2 * fwd_passes + 2) * layers * m, link, "2 forward (+2 recompute) + 2 backward per layer")]
    else:
        out.append(Collective("tp", "layer all-reduce", "all_reduce_ring", a, t, (2 * fwd_passes + 2) * layers * m,
                              link, "2 forward (+2 recompute) + 2 backward per layer"))
    if stage == 0:
        if layout.sequence_parallel:
            out += [Collective("tp", "embedding reduce-scatter", "reduce_scatter_ring", a, t, m, link, "forward"),
                    Collective("tp", "embedding all-gather", "all_gather_ring", a, t, m, link, "backward")]
        else:
            out.append(Collective("tp", "embedding all-reduce", "all_reduce_ring", a, t, m, link, "forward"))
    if stage == layout.pp - 1:
        if layout.sequence_parallel:
            gathers = 2 if layout.regather else 1
            out += [Collective("tp", "head input all-gather", "all_gather_ring", a, t, gathers * m, link,
                               "forward" + (" + re-gather in backward" if layout.regather else "")),
                    Collective("tp", "head input-gradient reduce-scatter", "reduce_scatter_ring", a, t, m, link,
                               "backward")]
        else:
            out.append(Collective("tp", "head input-gradient all-reduce", "all_reduce_ring", a, t, m, link,
                                  "backward of f"))
        out += [Collective("tp", "cross-entropy max", "all_reduce_ring", 4 * s * b, t, m, link, "fp32, per token"),
                Collective("tp", "cross-entropy target logit + sum of exp", "all_reduce_ring", 8 * s * b, t, m, link,
                           "two fp32 per token, one call")]
    if model.kv_heads < t:  # each key/value head lives on t/kv ranks: their gradients are summed once per step
        kv = 2 * model.hidden * model.kv_heads * model.head_dim * (layers_on_stage(model, layout, stage))
        count, size = _calls(bytes_per_element(layout)["gradients"] * kv, layout.bucket_mb * 2**20)
        out.append(Collective("tp", "replicated key/value-head gradient sum", "all_reduce_ring", size, t, count, link,
                              "once per step: k and v weights, one slot per key/value head"))
    if layout.sequence_parallel:
        grads = bytes_per_element(layout)["gradients"] * replicated_params(model, layout, stage)
        count, size = _calls(grads, layout.bucket_mb * 2**20)
        out.append(Collective("tp", "sequence-parallel gradient sum", "all_reduce_ring", size, t, count, link,
                              "once per step: the replicated parameters' gradients (norms, biases, positions)"))
    return AxisComm("tp", t, link, tuple(out))


def pp_sends(p: int, v: int, m: int, rank: int) -> int:
    """Sends pipeline rank ``rank`` makes per step: an activation out of each of its ``v`` chunks but the model's
    last, a gradient out of each but the model's first, ``m`` times each: ``2vm`` in the middle, ``(2v - 1)m``
    on the first and last ranks, ``2(v - 1)m`` on a lone one."""
    if p == 1:
        return 0
    return (2 * v - (rank == 0) - (rank == p - 1)) * m


def _pp(model: ModelSpec, layout: Layout, hw: Hardware, m: int, stage: int) -> AxisComm:
    # Neighbouring stages are dp·cp·tp devices apart: once the pipeline spans more than a node some hop crosses
    # nodes, and the pipeline runs at its slowest hop.
    link = hw.link(layout.dp * layout.cp * layout.tp * layout.pp)
    # The stage boundary is the residual stream: fp32 under autocast (lslm.plan.autocast)
    e = 4 if layout.precision == "fp32" or layout.mixed == "autocast" else 2
    region = layout.tp if layout.sequence_parallel else 1
    a = e * model.seq_len // layout.cp * model.micro_batch * model.hidden / region
    sends = pp_sends(layout.pp, layout.v, m, stage)
    return AxisComm("pp", layout.pp, link, (
        Collective("pp", "activation / gradient send", "p2p", a, layout.pp, sends, link,
                   "per micro-batch and chunk: a forward activation and a backward gradient of e·sbh (/t with SP), "
                   "none past the model's ends"),))


def _cp(model: ModelSpec, layout: Layout, hw: Hardware, m: int, stage: int) -> AxisComm:
    c = layout.cp
    link = hw.link(c * layout.tp)
    uq, ukv = cp_units(model, layout)
    acc = 4 / cp_element_size(layout)  # the ring's dK/dV accumulators travel in fp32 (lslm.context_parallel.ring)
    n = layers_on_stage(model, layout, stage) * m  # layer-micro-batches per step
    # recomputation reruns the attention core's forward; "op" keeps its output
    passes = 1 if layout.recompute in ("none", "op") else 2
    if layout.cp_method == "ring":
        out = (Collective("cp", "ring K/V blocks (forward)", "p2p", 2 * ukv, c, (c - 1) * passes * n, link,
                          "c - 1 steps of 2u_kv per layer (x2 with recompute), behind the block's attention"),
               Collective("cp", "ring K/V blocks (backward)", "p2p", 2 * ukv, c, (c - 1) * n, link,
                          "c - 1 steps of 2u_kv per layer"),
               Collective("cp", "ring dK/dV accumulators (backward)", "p2p", 2 * ukv * acc, c, c * n, link,
                          "c hops of 2u_kv per layer (the last one home), in fp32"))
    else:
        qkv = uq + 2 * ukv
        out = (Collective("cp", "q, k, v all-to-all (forward)", "all_to_all_pairwise", qkv, c, passes * n, link,
                          "u_q + 2u_kv per layer (x2 with recompute), sequence- to head-sharded"),
               Collective("cp", "output all-to-all (forward)", "all_to_all_pairwise", uq, c, passes * n, link,
                          "u_q per layer, head- to sequence-sharded"),
               Collective("cp", "output-gradient all-to-all (backward)", "all_to_all_pairwise", uq, c, n, link,
                          "u_q per layer"),
               Collective("cp", "q, k, v gradient all-to-all (backward)", "all_to_all_pairwise", qkv, c, n, link,
                          "u_q + 2u_kv per layer"))
    return AxisComm("cp", c, link, out)


def communication(model: ModelSpec, layout: Layout, hw: Hardware, m: int, stage: int) -> dict[str, AxisComm]:
    """Each axis's communication per step on one device of pipeline stage ``stage`` (module doc).

    An axis of size 1 communicates nothing: its :class:`AxisComm` has no collectives."""
    axes = {"dp": _dp(model, layout, hw, m, stage), "tp": _tp(model, layout, hw, m, stage),
            "pp": _pp(model, layout, hw, m, stage), "cp": _cp(model, layout, hw, m, stage)}
    return {name: ax if ax.group > 1 else AxisComm(name, 1, ax.link, ()) for name, ax in axes.items()}
