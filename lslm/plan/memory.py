"""Per-device memory of one pipeline stage: model states, activations, communication buffers; the most loaded.

A stage's parameters (per tensor-parallel rank): ``L/p`` layers; the first stage adds the embedding, the last
the final norm and the head (with a tied head and ``p > 1`` the last stage keeps its own copy of the word
embedding, as Megatron and lslm do, its gradient summed with the first stage's). Tensor parallelism splits
every matrix and the (vocabulary-parallel) embedding and head over ``t``; LayerNorm weights, the row-parallel
biases and the position embedding are replicated; key/value heads split over ``min(t, kv)``. Megatron pads the
vocabulary to a multiple of ``128 t``; here each rank holds ``ceil(V/t)`` rows (lslm's ``vocab_multiple=1``).

Activations: :mod:`lslm.plan.activations` (in flight x per layer, plus the ends); with recomputation one layer's
full activations exist again during its backward (the "recompute working set"). Communication buffers:
ZeRO-2's staging buckets for the reduce-scatter (2 in flight, lslm's ``max_inflight``), ZeRO-3's gathered
units (this one and the prefetched next, in the parameters' dtype, plus a staging bucket of gradients), the
pipeline's receive buffers (one activation and one gradient), context parallelism's blocks in flight (the ring's
backward, lslm's :mod:`lslm.context_parallel.ring`: the key/value block in hand and the one arriving, two blocks
of ``2 u_kv``, and the dK/dV accumulator being filled, the one sent and the one received, three blocks of
``2 u_kv`` counted in fp32, ``4 / e`` times the inputs' ``e`` bytes an element, as the ring accumulates); Ulysses:
the all-to-all's send and receive buffers of q, k, v, ``2 (u_q + 2 u_kv)``), for one layer at a time, not divided
further by ``cp``. Transient all-gather outputs of sequence parallelism are one layer's input and are not counted.

Under ``torch.autocast`` (``Layout.mixed == "autocast"``) the activations are :mod:`lslm.plan.autocast`'s count
(the fp32 residual stream, the weights' half copies, the loss's fp32 temporaries, at the stage's peak moment), and
the gradients may not be resident at that peak: torch's recipe zeroes them with ``set_to_none=True`` (its default),
so ``.grad`` tensors are created in backward as the activations are freed. They are absent at the activation peak
when nothing else holds them: one micro-batch per step (no accumulation), no data parallelism (DDP's buckets and
lslm's gradient buffer are allocated once and kept), no pipeline. Then the peak is the larger of the states
without gradients plus the activations, and every state plus what the backward leaves (the caller's logits).

Only the first and the last stage need evaluating: a middle stage holds fewer parameters than the first and
fewer micro-batches in flight.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from lslm.plan.activations import (
    cp_element_size,
    cp_units,
    embedding_mask_bytes,
    in_flight_layers,
    last_stage_extra_bytes,
    layer_activation_bytes,
    layer_formula,
    loss_bytes_per_logit,
    loss_temporary_bytes,
)
from lslm.plan.autocast import autocast_activations
from lslm.plan.layout import Layout, layers_on_stage
from lslm.plan.model import ModelSpec
from lslm.plan.params import param_parts
from lslm.plan.states import ModelStates, bytes_per_element, model_states
from lslm.plan.terms import Term

__all__ = ["StageMemory", "gradients_at_peak", "layer_linear_params", "layer_params_per_rank", "most_loaded",
           "replicated_params", "stage_memory", "stage_params", "stage_split"]

KORTHIKANTI = "Korthikanti et al. 2022, Table 2 / §4.2.3 / §5"


def layer_params_per_rank(model: ModelSpec, t: int) -> int:
    """Parameters of one layer on one tensor-parallel rank (module doc: what is split, what replicated)."""
    h, f = model.hidden, model.ffn
    if model.arch == "gpt":
        # LayerNorm weights (and biases) and the two row-parallel biases are replicated; the rest is split.
        replicated = 6 * h if model.bias else 2 * h
        return replicated + (param_parts(model).layer - replicated) // t
    kv = model.kv_heads * model.head_dim
    kv_shards = min(t, model.kv_heads)
    return 2 * h + (2 * h * h + 3 * h * f) // t + 2 * h * kv // kv_shards


def layer_linear_params(model: ModelSpec, t: int) -> int:
    """Elements of one layer's weights and biases that autocast casts (its linears'), on one tensor-parallel rank:
    the layer's parameters less its norms' (LayerNorm weights and biases, or RMSNorm weights: run in fp32)."""
    norms = (4 * model.hidden if model.bias else 2 * model.hidden) if model.arch == "gpt" else 2 * model.hidden
    return layer_params_per_rank(model, t) - norms


def replicated_params(model: ModelSpec, layout: Layout, stage: int) -> int:
    """Parameters of pipeline stage ``stage`` that every tensor-parallel rank holds whole: LayerNorm/RMSNorm
    weights (and biases), the row-parallel biases, the position embedding and the final norm. Under sequence
    parallelism each rank's gradient of them covers only its slice of the sequence, so they are summed over the
    tensor-parallel group once per step (Korthikanti et al. 2022, §4.2.2)."""
    h = model.hidden
    per_layer = (6 * h if model.bias else 2 * h) if model.arch == "gpt" else 2 * h
    total = layers_on_stage(model, layout, stage) * per_layer
    if stage == 0:
        total += model.positions * h
    if stage == layout.pp - 1:
        total += param_parts(model).final_norm
    return total


def stage_split(model: ModelSpec, layout: Layout, stage: int) -> tuple[int, int]:
    """``(layers, root)``: parameters one tensor-parallel rank of pipeline stage ``stage`` holds in its
    ``L/p`` layers, and outside them (embedding on the first stage; final norm and head on the last)."""
    p, t = layout.pp, layout.tp
    if not 0 <= stage < p:
        raise ValueError(f"stage {stage} is outside 0..{p - 1}")
    h = model.hidden
    layers = layers_on_stage(model, layout, stage) * layer_params_per_rank(model, t)
    word = -(-model.vocab // t) * h  # vocabulary-parallel: ceil(V/t) rows (the last rank's padded)
    root = 0
    if stage == 0:
        root += word + model.positions * h
    if stage == p - 1:
        root += param_parts(model).final_norm
        if not model.tied or p > 1:  # untied head, or the last stage's copy of the tied word embedding
            root += word
    return layers, root


def stage_params(model: ModelSpec, layout: Layout, stage: int) -> int:
    """Parameters one tensor-parallel rank of pipeline stage ``stage`` holds (module doc)."""
    return sum(stage_split(model, layout, stage))


@dataclass(frozen=True)
class StageMemory:
    """Bytes one device of pipeline stage ``stage`` needs at its peak, by owner."""

    stage: int
    params: int  #: parameters on this device before ZeRO sharding
    states: ModelStates
    activations: Term
    activations_without_recompute: Term
    buffers: dict[str, Term]
    #: whether the gradients exist at the activations' peak (module doc: not under autocast without accumulation)
    grads_at_peak: bool = True
    #: bytes of activations still held after the backward (the caller's logits under autocast)
    after_backward: float = 0.0
    #: under autocast, the activation bytes at each moment of the step (lslm.plan.autocast)
    moments: dict[str, float] = field(default_factory=dict)

    @property
    def owners(self) -> dict[str, Term]:
        """Every owner on the device: model states, activations, communication buffers."""
        return {**self.states.device, "activations": self.activations, **self.buffers}

    @property
    def states_before_forward(self) -> float:
        """Model-state bytes resident when a step's forward starts: all of them, less the gradients where they are
        created in backward (``grads_at_peak`` False)."""
        grads = 0.0 if self.grads_at_peak else self.states.device["gradients"].value
        return self.states.device_bytes - grads

    @property
    def total(self) -> float:
        """Peak bytes on the device: every owner at once, or, where the gradients are created in backward, the
        larger of the activations' peak without them and the end of the backward with them (module doc)."""
        every = sum(t.value for t in self.owners.values())
        if self.grads_at_peak:
            return every
        buffers = sum(t.value for t in self.buffers.values())
        at_activation_peak = self.states_before_forward + self.activations.value + buffers
        return max(at_activation_peak, self.states.device_bytes + buffers + self.after_backward)


def gradients_at_peak(layout: Layout, m: int) -> bool:
    """Whether the gradients are resident at the activations' peak (module doc): always with Megatron-style
    masters (the fp32 ``main_grad`` buffer); under autocast only with accumulation, data or pipeline parallelism."""
    return not (layout.mixed == "autocast" and m == 1 and layout.pp == 1 and layout.dp * layout.cp == 1)


def _activations(model: ModelSpec, layout: Layout, m: int, stage: int, recompute: str,
                 mask_bytes: int) -> tuple[float, str]:
    if layout.mixed == "autocast":
        a = autocast_activations(model, layout, m, stage, recompute, layer_linear_params(model, layout.tp),
                                 mask_bytes=mask_bytes)
        return a.value, a.formula
    one = layer_activation_bytes(model, layout, recompute, mask_bytes=mask_bytes)
    rank_layers = in_flight_layers(model, layout, m, stage)
    total = rank_layers * one
    formula = f"{rank_layers:g} layer-micro-batches in flight x [{layer_formula(model, layout, recompute)}]"
    if stage == 0 and model.dropout and recompute != "full":
        total += embedding_mask_bytes(model, layout, m, mask_bytes=mask_bytes)
        formula += " + embedding dropout masks"
    if stage == layout.pp - 1:
        total += last_stage_extra_bytes(model, layout)
        formula += " + final norm, head input and the loss's saved fp32 softmax 4sbV/t"
    working = layer_activation_bytes(model, layout, "none", mask_bytes=mask_bytes) - one
    if recompute != "none" and working > 0:  # selective under flash attention recomputes nothing it did not keep
        total += working
        formula += " + one layer recomputed during its backward"
    return total, formula


def stage_memory(model: ModelSpec, layout: Layout, m: int, stage: int, *, dp_rank: int = 0,
                 mask_bytes: int = 1) -> StageMemory:
    """Memory of one device of pipeline stage ``stage`` with ``m`` micro-batches per step (module doc).

    ``mask_bytes``: a saved dropout mask's bytes per element (the hardware's ``dropout_mask_bytes``)."""
    psi = stage_params(model, layout, stage)
    states = model_states(psi, layout, rank=dp_rank)
    with_r, f_with = _activations(model, layout, m, stage, layout.recompute, mask_bytes)
    without, f_without = _activations(model, layout, m, stage, "none", mask_bytes)
    source = "lslm.plan.autocast (torch.autocast's op lists)" if layout.mixed == "autocast" else KORTHIKANTI
    acts = Term("activations", with_r, "B", f_with, "lslm.plan.op_sac (torchtitan's op-level selective "
                "checkpointing); " + KORTHIKANTI if layout.recompute == "op" else source)
    acts0 = Term("activations (no recompute)", without, "B", f_without, source)
    moments: dict[str, float] = {}
    after = 0.0
    if layout.mixed == "autocast":
        a = autocast_activations(model, layout, m, stage, layout.recompute, layer_linear_params(model, layout.tp),
                                 mask_bytes=mask_bytes)
        moments, after = a.moments, a.after_backward
    width = bytes_per_element(layout)
    n = layout.dp_shard_size * layout.cp
    bucket = layout.bucket_mb * 2**20
    buffers: dict[str, Term] = {}
    if layout.zero == 2 and n > 1:
        staging = min(2 * bucket, width["gradients"] * psi)
        buffers["zero-2 staging buckets"] = Term("zero-2 staging buckets", staging, "B",
                                                 "2 buckets of gradients in flight (max_inflight = 2)", "lslm.zero")
    if layout.zero == 3 and n > 1:
        unit = layer_params_per_rank(model, layout.tp)
        gathered = 2 * unit * width["parameters"] + unit * width["gradients"]
        buffers["zero-3 gathered units"] = Term(
            "zero-3 gathered units", gathered, "B",
            "2 layers gathered (current + prefetched) x p + 1 layer of gradients staged x g",
            "ZeRO §5.3; lslm.zero (one unit of look-ahead)")
    if stage == layout.pp - 1 and layout.mixed != "autocast":  # autocast: in its moments (lslm.plan.autocast)
        peak = loss_bytes_per_logit(model, layout)
        buffers["loss temporaries"] = Term(
            "loss temporaries", loss_temporary_bytes(model, layout), "B",
            f"({peak} - 4)sbV/t: {model.loss}'s loss at its backward, {peak} bytes per logit with its saved softmax",
            "lslm.plan.activations, 'The loss' (each style's tensors; the CPU allocator's peak)")
    if layout.pp > 1:
        e = 2 if layout.precision != "fp32" and layout.mixed != "autocast" else 4  # autocast: the fp32 residual
        region = layout.tp if layout.sequence_parallel else 1
        recv = 2 * e * model.seq_len // layout.cp * model.micro_batch * model.hidden / region
        buffers["pipeline receive buffers"] = Term("pipeline receive buffers", recv, "B",
                                                   "an activation and a gradient: 2 x e·sbh (/t with SP)",
                                                   "Narayanan et al. 2021 §2.2")
    if layout.cp > 1:
        uq, ukv = cp_units(model, layout)
        if layout.cp_method == "ring":
            acc = 4 / cp_element_size(layout)  # the dK/dV accumulators are fp32 whatever the inputs' dtype
            buffers["context-parallel ring blocks"] = Term(
                "context-parallel ring blocks", 2 * 2 * ukv + 3 * 2 * ukv * acc, "B",
                "2 x 2u_kv (K/V in hand and arriving) + 3 x 2u_kv x 4/e (dK/dV filled, sent and received, in fp32; "
                "one layer's backward)", "lslm.context_parallel.ring")
        else:
            buffers["Ulysses all-to-all buffers"] = Term(
                "Ulysses all-to-all buffers", 2 * (uq + 2 * ukv), "B",
                "send + receive of q, k, v: 2 (u_q + 2u_kv), one layer at a time", "lslm.context_parallel.ulysses")
    return StageMemory(stage, psi, states, acts, acts0, buffers, gradients_at_peak(layout, m), after, moments)


def most_loaded(model: ModelSpec, layout: Layout, m: int, *,
                mask_bytes: int = 1) -> tuple[StageMemory, list[StageMemory]]:
    """The first and last stages' memory (every stage's with uneven ``Layout.stage_layers``), and whichever needs
    more (module doc)."""
    stages = [stage_memory(model, layout, m, 0, mask_bytes=mask_bytes)]
    if layout.stage_layers is not None:  # uneven stages: any stage may be the most loaded
        stages += [stage_memory(model, layout, m, s, mask_bytes=mask_bytes) for s in range(1, layout.pp)]
    elif layout.pp > 1:
        stages.append(stage_memory(model, layout, m, layout.pp - 1, mask_bytes=mask_bytes))
    return max(stages, key=lambda s: s.total), stages

