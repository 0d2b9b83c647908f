"""How a model is laid out over devices: the parallel sizes and the memory-saving options, checked together.

Axes, outermost to innermost, as lslm's grid orders them (:mod:`lslm.runtime`): ``pp, dp, cp, tp``, so the
tensor-parallel group is ``tp`` consecutive devices (the fastest links), a data-parallel group strides over
``tp · cp`` and spans ``dp · cp · tp`` devices, and pipeline neighbours are ``dp · cp · tp`` devices apart.

Options: ``zero`` (0: plain data parallelism; 1-3: ZeRO stages, Rajbhandari et al. 2020), ``offload``
(``"cpu"``: the fp32 masters and optimizer states live in host memory, ZeRO-Offload, Ren et al. 2021;
``"disk"``: they live in files and pass through host memory each step, as lslm's ZeRO offload to disk does;
its memory is counted as ``"cpu"``'s),
``sequence_parallel`` (Korthikanti et al. 2022 §4.2.2), ``recompute`` (``"none"``, ``"selective"``: the
attention core, §5; ``"full"``: every layer keeps only its input), ``precision`` (``fp32``; ``bf16``/``fp16``
with fp32 master weights), ``mixed`` (with ``bf16``/``fp16``, how the half precision is applied:
``"masters"``, Megatron's and DeepSpeed's: half-precision parameters, fp32 master weights and Adam, every
activation in the half dtype, 16 bytes per parameter with half gradients or 18 with fp32 ``main_grad``;
``"autocast"``, ``torch.autocast`` over fp32 parameters: fp32 parameters, gradients and Adam, no separate
masters, 16 bytes per parameter, activations a mix of fp32 and half by autocast's op lists,
:mod:`lslm.plan.autocast`), ``grad_dtype`` (``"fp32"``: Megatron's and lslm's fp32 ``main_grad``; ``"param"``:
gradients in the parameters' dtype, the ZeRO paper's accounting; under autocast the parameters are fp32, so
both are fp32), ``v`` virtual stages per pipeline rank
(interleaved 1F1B), ``flash_attention`` (no ``s^2`` tensors kept), ``regather`` (with sequence parallelism
the column-parallel layers keep their sharded input and all-gather it again in backward, Megatron's choice and
lslm's for its GPT; False keeps the gathered input), ``bucket_mb`` (data-parallel bucket size, which sets how
many messages a step sends), ``optimizer`` (``"adamw"`` or ``"sgd-momentum"``: the bytes its step streams per
element, :data:`lslm.plan.hardware.OPTIMIZER_BYTES`; the optimizer states' memory is Adam's either way),
``cp_method`` (with ``cp > 1``: ``"ring"``, ring attention on the zig-zag layout, or ``"ulysses"``,
DeepSpeed-Ulysses' all-to-all; :mod:`lslm.context_parallel` implements both; it names the attention core, so
``"ulysses"`` at ``cp = 1`` is that core on one device), ``dp_shard`` (HSDP, torchtitan's
``dp_replicate x dp_shard``: the ZeRO states shard over ``dp_shard · cp`` ranks and are replicated
``dp / dp_shard`` times; ``None``: ``dp``, plain sharding), ``dp_overlap`` (True: the data-parallel reduction
starts during the backward, as lslm's bucketed DDP, torch DDP and ZeRO do; False: it runs after the whole backward,
as Megatron-LM's ``local`` DDP did before its ``--overlap-grad-reduce`` option: ``train_step`` called
``allreduce_gradients()`` once the forward-backward function had returned).

Context parallelism splits the sequence: every device of a ``cp`` group holds ``s/cp`` tokens of each sequence and
the whole model (parameters are replicated over ``cp``; gradients are reduced over ``dp · cp``).

:func:`check_layout` refuses a layout that cannot run, with what to change.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from lslm.plan.hardware import PRECISIONS
from lslm.plan.model import ModelSpec

__all__ = ["CP_METHODS", "MIXED", "OFFLOADS", "OPTIMIZERS", "RECOMPUTE", "Layout", "check_layout", "layers_on_stage",
           "microbatches"]

RECOMPUTE = ("none", "selective", "full")
OFFLOADS = ("none", "cpu", "disk")
OPTIMIZERS = ("adamw", "sgd-momentum")
CP_METHODS = ("ring", "ulysses")
MIXED = ("masters", "autocast")


@dataclass(frozen=True)
class Layout:
    """Parallel sizes and options (module doc)."""

    dp: int = 1
    tp: int = 1
    pp: int = 1
    v: int = 1
    cp: int = 1
    zero: int = 0
    offload: str = "none"
    sequence_parallel: bool = False
    recompute: str = "none"
    precision: str = "bf16"
    grad_dtype: str = "fp32"
    flash_attention: bool = False
    regather: bool = True
    bucket_mb: float = 25.0
    optimizer: str = "adamw"
    cp_method: str = "ring"
    dp_shard: int | None = None
    mixed: str = "masters"
    dp_overlap: bool = True  #: False: the data-parallel reduction waits for the whole backward (module doc)
    #: layers of each pipeline stage, first to last (None: ``n_layer / pp`` each); e.g. Llama 3 405B's 126 layers
    #: on 16 stages, one fewer on the first and the last: ``(7,) + (8,) * 14 + (7,)``
    stage_layers: tuple[int, ...] | None = None

    def __post_init__(self) -> None:
        for name in ("dp", "tp", "pp", "v", "cp"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"Layout.{name} must be an int >= 1, got {value!r}")
        if self.zero not in (0, 1, 2, 3):
            raise ValueError(f"Layout.zero must be 0 (no ZeRO), 1, 2 or 3, got {self.zero!r}")
        if self.offload not in OFFLOADS:
            raise ValueError(f"Layout.offload must be one of {OFFLOADS}, got {self.offload!r}")
        if self.offload != "none" and self.zero == 0:
            raise ValueError(f"offload={self.offload!r} moves the optimizer's partition off the device "
                             "(ZeRO-Offload): it needs zero >= 1")
        if self.recompute not in RECOMPUTE:
            raise ValueError(f"Layout.recompute must be one of {RECOMPUTE}, got {self.recompute!r}")
        if self.precision not in PRECISIONS:
            raise ValueError(f"Layout.precision must be one of {PRECISIONS}, got {self.precision!r}")
        if self.mixed not in MIXED:
            raise ValueError(f"Layout.mixed must be one of {MIXED}, got {self.mixed!r}")
        if self.mixed == "autocast" and self.precision == "fp32":
            raise ValueError("mixed='autocast' casts to a half dtype: it needs precision 'bf16' or 'fp16' "
                             "(precision='fp32' trains without autocast)")
        if self.grad_dtype not in ("fp32", "param"):
            raise ValueError(f"Layout.grad_dtype must be 'fp32' (main_grad) or 'param', got {self.grad_dtype!r}")
        if self.sequence_parallel and self.tp == 1:
            raise ValueError("sequence_parallel splits the LayerNorm/dropout region over the tensor-parallel "
                             "group: it needs tp > 1")
        if self.v > 1 and self.pp == 1:
            raise ValueError(f"v={self.v} virtual stages need a pipeline (pp > 1)")
        if self.optimizer not in OPTIMIZERS:
            raise ValueError(f"Layout.optimizer must be one of {OPTIMIZERS} (it sets the optimizer step's bytes "
                             f"per element), got {self.optimizer!r}")
        if self.cp_method not in CP_METHODS:
            raise ValueError(f"Layout.cp_method must be one of {CP_METHODS}, got {self.cp_method!r}")
        if self.dp_shard is not None:
            if isinstance(self.dp_shard, bool) or not isinstance(self.dp_shard, int) or self.dp_shard < 1:
                raise ValueError(f"Layout.dp_shard must be an int >= 1 (or None: dp), got {self.dp_shard!r}")
            if self.dp % self.dp_shard:
                raise ValueError(f"dp_shard={self.dp_shard} does not divide dp={self.dp}: HSDP splits dp into "
                                 "dp_replicate x dp_shard")
            if self.dp_shard < self.dp and self.zero == 0:
                raise ValueError(f"dp_shard={self.dp_shard} < dp={self.dp} shards ZeRO's states over part of dp "
                                 "(HSDP): it needs zero >= 1")
        if not isinstance(self.dp_overlap, bool):
            raise ValueError(f"Layout.dp_overlap must be True or False, got {self.dp_overlap!r}")
        if not 0 < self.bucket_mb < math.inf:
            raise ValueError(f"Layout.bucket_mb must be finite and > 0 (megabytes per data-parallel bucket), "
                             f"got {self.bucket_mb!r}")
        if self.stage_layers is not None:
            layers = tuple(self.stage_layers)
            if len(layers) != self.pp or any(isinstance(n, bool) or not isinstance(n, int) or n < 1 for n in layers):
                raise ValueError(f"Layout.stage_layers must give {self.pp} ints >= 1 (one per pipeline stage), "
                                 f"got {self.stage_layers!r}")
            object.__setattr__(self, "stage_layers", layers)

    @property
    def dp_shard_size(self) -> int:
        """Data-parallel ranks the model states are sharded over (``dp_shard``, default ``dp``)."""
        return self.dp if self.dp_shard is None else self.dp_shard

    @property
    def dp_replicate(self) -> int:
        """HSDP's replicas of the shards: ``dp / dp_shard`` (1 without HSDP)."""
        return self.dp // self.dp_shard_size

    @property
    def world(self) -> int:
        """Devices: ``dp · tp · pp · cp``."""
        return self.dp * self.tp * self.pp * self.cp

    @property
    def schedule(self) -> str:
        """The pipeline schedule modelled: ``"1f1b"`` (``v = 1``) or ``"interleaved"`` (Narayanan et al. 2021)."""
        return "interleaved" if self.v > 1 else "1f1b"

    def describe(self) -> str:
        """A one-line summary, e.g. ``dp 16 x tp 8 x pp 8 (v 2), ZeRO-1, SP, recompute selective, bf16``."""
        dp = f"dp {self.dp}" + (f" (replicate {self.dp_replicate} x shard {self.dp_shard_size})"
                                if self.dp_replicate > 1 else "")
        pp = f"pp {self.pp}" + (f" (v {self.v})" if self.v > 1 else "")
        if self.stage_layers is not None:
            pp += f" (layers {self.stage_layers[0]}, {self.stage_layers[1] if self.pp > 2 else ''}..., " \
                  f"{self.stage_layers[-1]})" if self.pp > 3 else f" (layers {self.stage_layers})"
        parts = [dp, f"tp {self.tp}", pp]
        if self.cp > 1:
            parts.append(f"cp {self.cp} ({self.cp_method})")
        opts = [f"ZeRO-{self.zero}" if self.zero else "no ZeRO"]
        if self.offload != "none":
            opts.append(f"offload {self.offload}")
        if self.sequence_parallel:
            opts.append("SP")
        opts += [f"recompute {self.recompute}", self.precision + (" autocast" if self.mixed == "autocast" else "")]
        return " x ".join(parts) + ", " + ", ".join(opts)


def microbatches(model: ModelSpec, layout: Layout) -> int:
    """Micro-batches accumulated per step: ``global_batch / (dp · micro_batch)``."""
    per_rank, rest = divmod(model.global_batch, layout.dp * model.micro_batch)
    if rest or per_rank < 1:
        raise ValueError(f"global_batch={model.global_batch} must be a multiple of dp x micro_batch = "
                         f"{layout.dp} x {model.micro_batch}; e.g. global_batch="
                         f"{max(1, per_rank) * layout.dp * model.micro_batch}")
    return per_rank


def check_layout(model: ModelSpec, layout: Layout, devices: int | None = None) -> None:
    """Raise ``ValueError`` (saying what to change) unless ``layout`` can run ``model`` on ``devices``."""
    if devices is not None and layout.world != devices:
        raise ValueError(f"dp x tp x pp x cp = {layout.dp} x {layout.tp} x {layout.pp} x {layout.cp} = "
                         f"{layout.world} devices, but {devices} were given: make the product equal the device count")
    if model.n_head % layout.tp:
        raise ValueError(f"the {model.n_head} attention heads must split evenly over tp={layout.tp}")
    if model.kv_heads % layout.tp and layout.tp % model.kv_heads:
        raise ValueError(f"the {model.kv_heads} key/value heads must split over tp={layout.tp} (or be replicated: "
                         "tp a multiple of them)")
    if model.ffn % layout.tp:
        raise ValueError(f"the MLP width {model.ffn} must split evenly over tp={layout.tp}")
    if layout.stage_layers is not None:
        if sum(layout.stage_layers) != model.n_layer:
            raise ValueError(f"stage_layers {layout.stage_layers} hold {sum(layout.stage_layers)} layers, but the "
                             f"model has n_layer={model.n_layer}: make them sum to it")
    elif model.n_layer % (layout.pp * layout.v):
        raise ValueError(f"n_layer={model.n_layer} must be divisible by pp x v = {layout.pp} x {layout.v} "
                         "(every virtual stage holds the same number of layers)")
    if model.seq_len % (layout.cp * (layout.tp if layout.sequence_parallel else 1)):
        raise ValueError(f"seq_len={model.seq_len} must split over cp x (tp with sequence parallelism) = "
                         f"{layout.cp * (layout.tp if layout.sequence_parallel else 1)}")
    if layout.cp > 1 and layout.cp_method == "ring" and model.seq_len % (2 * layout.cp):
        raise ValueError(f"seq_len={model.seq_len} must split into 2 x cp = {2 * layout.cp} chunks: ring attention "
                         "uses the zig-zag layout (rank i holds chunks i and 2cp - 1 - i)")
    if layout.cp > 1 and layout.cp_method == "ulysses":
        heads, kv = model.n_head // layout.tp, max(1, model.kv_heads // layout.tp)
        if heads % layout.cp or kv % layout.cp:
            raise ValueError(f"Ulysses splits each tensor-parallel rank's heads over cp: {heads} query and {kv} "
                             f"key/value heads per rank must be divisible by cp={layout.cp}; use a smaller cp or "
                             "cp_method='ring' (no head constraint)")
    m = microbatches(model, layout)
    if layout.v > 1 and m % layout.pp:
        raise ValueError(f"the interleaved schedule needs the micro-batches per step ({m}) to be a multiple of "
                         f"pp={layout.pp} (Narayanan et al. 2021 §2.2.2); change global_batch or micro_batch")


def layers_on_stage(model: ModelSpec, layout: Layout, stage: int) -> int:
    """Transformer layers pipeline stage ``stage`` holds: ``layout.stage_layers[stage]``, else ``n_layer / pp``."""
    if layout.stage_layers is not None:
        return layout.stage_layers[stage]
    return model.n_layer // layout.pp
