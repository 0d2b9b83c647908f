"""Small experiments notebook 07 runs in-process: fp16 with and without loss scaling, the scaler, autocast.

Every function trains (or runs) the serial baseline's GPT (:mod:`lslm.recipes.train`:
2 blocks, width 64, vocabulary 1024, 64 tokens, batches of 8 from the shipped corpus,
AdamW with its settings, gradients clipped at 1.0) for a few steps on the CPU and
returns plain numbers. Model fields (``n_layer``, ``n_embd``, ...) are keyword overrides.
fp16 matmuls are slow on most CPUs (measured here: several times fp32's step time), so
the step counts are small. The sources of each rule are in :mod:`lslm.precision`.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from lslm.data_parallel.grad_buffer import main_grad_or_grad
from lslm.models.gpt import GPT
from lslm.precision import (
    DynamicLossScaler,
    LossScaleAtMinimumError,
    MixedPrecisionOptimizer,
    PrecisionSetup,
    bytes_per_param,
    prepare_precision,
)
from lslm.precision.formats import FORMATS
from lslm.recipes.train import TrainConfig, adamw, build_model, data_stream

# HALF_DTYPES, demo_config, demo_batches and optimizer_factory are shared with lslm.demos.precision_costs.
__all__ = ["HALF_DTYPES", "MODEL_FIELDS", "Blowup", "autocast_vs_lslm", "demo_batches", "demo_config",
           "fp16_without_scaling", "gradients_of_gpt", "min_scale_failure", "optimizer_factory", "scaler_first_steps"]

MODEL_FIELDS = ("n_layer", "n_head", "n_embd", "vocab_size", "block_size", "dropout")
HALF_DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16}
_BATCHES: dict[tuple[int, ...], list[tuple[torch.Tensor, torch.Tensor]]] = {}


def demo_config(batch_size: int, seed: int, model: dict[str, Any], minimum: int = 1, **counts: int) -> TrainConfig:
    """The baseline's settings with ``model`` overrides; ``counts`` (steps, ...) checked to be >= ``minimum``."""
    unknown = set(model) - set(MODEL_FIELDS)
    if unknown:
        raise ValueError(f"unknown model field(s) {sorted(unknown)}; model overrides are {MODEL_FIELDS}")
    for name, value in counts.items():
        if not isinstance(value, int) or isinstance(value, bool) or value < minimum:
            raise ValueError(f"{name} must be an int >= {minimum}, got {value!r}")
    return TrainConfig(batch_size=batch_size, seed=seed, **model)


def demo_batches(cfg: TrainConfig, n: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """The first ``n`` baseline batches of ``cfg`` (cached: every demo and mode sees the same data)."""
    key = (cfg.block_size, cfg.vocab_size, cfg.batch_size, cfg.seed)
    if len(_BATCHES.get(key, [])) < n:
        stream = data_stream(cfg)
        _BATCHES[key] = [next(stream) for _ in range(n)]
    return _BATCHES[key][:n]


def optimizer_factory(cfg: TrainConfig) -> Callable[[list[torch.Tensor]], torch.optim.Optimizer]:
    """The baseline's AdamW (:func:`lslm.recipes.train.adamw`) over whatever list it is given (masters)."""
    return lambda params: adamw(params, cfg)


def _gradscaler_like(init_scale: float, growth_interval: int = 2000) -> dict[str, Any]:
    # torch.amp.GradScaler's rule: halve on every overflow (hysteresis 1), no floor, x2 after 2000 clean steps.
    return dict(init_scale=init_scale, hysteresis=1, min_scale=None, growth_interval=growth_interval)


def gradients_of_gpt(steps: int = 5, batch_size: int = 8, seed: int = 0, **model: Any) -> list[torch.Tensor]:
    """fp32 gradients (one tensor per parameter) of the baseline GPT after ``steps`` AdamW steps, on the next batch."""
    cfg = demo_config(batch_size, seed, model, minimum=0, steps=steps)
    setup = _train_lslm(cfg, "fp32", steps)["setup"]
    setup.optimizer.zero_grad()
    setup.optimizer.backward(setup.model(*demo_batches(cfg, steps + 1)[steps])[1])
    return [main_grad_or_grad(p).detach().clone() for p in setup.model.parameters()]  # fp32: the buffer


def _train_lslm(cfg: TrainConfig, mode: str, steps: int, *, loss_weight: float = 1.0, scaler: Any = "default",
                probe: Callable[[nn.Module, Any, tuple[torch.Tensor, torch.Tensor]], None] | None = None,
                ) -> dict[str, Any]:
    """``steps`` steps of lslm's ``mode``; ``scaler=None`` in fp16: fp32 masters, no loss scaling at all."""
    gpt = build_model(cfg)
    if mode == "fp16" and scaler is None:
        # fp32 masters and main_grad as prepare_precision's fp16, but no scaler: no scaling, no overflow check.
        mp = MixedPrecisionOptimizer(gpt, optimizer_factory(cfg), torch.float16, scaler=None)
        setup = PrecisionSetup("fp16", gpt, mp, None, torch.float16, "main_grad")
    else:
        extra = {} if scaler == "default" else {"scaler": scaler}
        setup = prepare_precision(gpt, mode, optimizer_factory(cfg), **extra)
    out: dict[str, Any] = {"loss": [], "scale": [], "stepped": [], "setup": setup}
    for x, y in demo_batches(cfg, steps):
        setup.optimizer.zero_grad()
        loss = gpt(x, y)[1]
        setup.optimizer.backward(loss * loss_weight)
        scale = setup.optimizer.loss_scale
        if probe is not None:
            probe(gpt, setup.optimizer, (x, y))
        stepped = setup.optimizer.step(max_grad_norm=cfg.grad_clip)
        for key, value in (("scale", scale), ("stepped", stepped), ("loss", loss.item())):
            out[key].append(value)
    return out


def fp16_without_scaling(steps: int = 10, loss_weight: float = 1.0, init_scale: float = 2.0**16, batch_size: int = 8,
                         seed: int = 0, **model: Any) -> dict[str, Any]:
    """fp16 with fp32 masters, without loss scaling and with GradScaler-like scaling, next to fp32 (Micikevicius §3.2).

    Each step's backward minimises ``loss_weight · loss``; ``loss_weight < 1`` stands for one
    micro-batch of ``1 / loss_weight`` accumulated ones (each divides its loss by the count),
    which makes every half-precision gradient that much smaller. ``underflow[run][k]``: the
    fraction of fp32-nonzero gradient entries that are exactly 0 in the fp16 backward at step
    ``k``, against an fp32 twin of the same masters on the same batch (true underflow,
    intermediate gradients included). Returns ``losses``, ``underflow``, ``scales`` per run,
    ``final_gap_u``: the no-scaling run's last loss minus fp32's in units of fp16's
    ``u · loss``, ``affects_loss`` (``|final_gap_u| > 2``, the bound a correctly scaled half
    run keeps) and ``summary`` (one line of the numbers).
    """
    cfg = demo_config(batch_size, seed, model, steps=steps)
    if not loss_weight > 0:
        raise ValueError(f"loss_weight must be > 0 (1 / the number of accumulated micro-batches), got {loss_weight!r}")
    twin = GPT(cfg.model_config())

    def make_probe(record: list[float]) -> Callable[..., None]:
        def probe(gpt: nn.Module, mp: Any, batch: tuple[torch.Tensor, torch.Tensor]) -> None:
            with torch.no_grad():
                for p, m in zip(twin.parameters(), mp.masters):
                    p.copy_(m)
            twin.zero_grad()
            (twin(*batch)[1] * loss_weight).backward()
            g32 = torch.cat([p.grad.flatten() for p in twin.parameters()])
            g16 = torch.cat([p.main_grad.flatten() for p in gpt.parameters()])  # the fp16 grads, summed in fp32
            nonzero = g32 != 0
            record.append(((g16 == 0) & nonzero).sum().item() / max(1, nonzero.sum().item()))
        return probe

    names = {"none": "fp16, no loss scaling", "dyn": f"fp16, dynamic scale (init 2^{math.log2(init_scale):g})"}
    under: dict[str, list[float]] = {names["none"]: [], names["dyn"]: []}
    runs = {"fp32": _train_lslm(cfg, "fp32", steps, loss_weight=loss_weight),
            names["none"]: _train_lslm(cfg, "fp16", steps, loss_weight=loss_weight, scaler=None,
                                       probe=make_probe(under[names["none"]])),
            names["dyn"]: _train_lslm(cfg, "fp16", steps, loss_weight=loss_weight,
                                      scaler=_gradscaler_like(init_scale), probe=make_probe(under[names["dyn"]]))}
    u = FORMATS["fp16"].unit_roundoff
    gap = (runs[names["none"]]["loss"][-1] - runs["fp32"]["loss"][-1]) / (u * runs["fp32"]["loss"][-1])
    first, last = under[names["none"]][0], under[names["none"]][-1]
    affects = abs(gap) > 2.0  # tests/test_precision_master.py's bound for a correctly scaled half run
    summary = (f"loss weight {loss_weight:g}: without scaling {first:.2%} -> {last:.2%} of nonzero gradient entries "
               f"underflow (steps 1 and {steps}); with scaling at most {max(under[names['dyn']]):.3%}; final loss "
               f"without scaling - fp32 = {gap:+.1f} u·loss: "
               + ("the loss falls behind" if gap > 2.0 else "the loss moves" if affects else "negligible for the loss"))
    return {"losses": {k: r["loss"] for k, r in runs.items()}, "underflow": under,
            "scales": {k: r["scale"] for k, r in runs.items() if k != "fp32"}, "loss_weight": loss_weight,
            "final_gap_u": gap, "affects_loss": affects, "summary": summary}


def _autocast_run(cfg: TrainConfig, dtype: torch.dtype, steps: int, init_scale: float,
                  growth_interval: int = 2000) -> dict[str, Any]:
    """PyTorch's way: fp32 weights and AdamW, ``torch.autocast`` casts per op, GradScaler for fp16 only."""
    gpt = build_model(cfg)
    opt = optimizer_factory(cfg)(list(gpt.parameters()))
    gs = torch.amp.GradScaler("cpu", init_scale=init_scale, growth_interval=growth_interval,
                              enabled=dtype == torch.float16)
    out: dict[str, Any] = {"loss": [], "scale": [], "stepped": []}
    for x, y in demo_batches(cfg, steps):
        opt.zero_grad(set_to_none=True)
        with torch.autocast("cpu", dtype=dtype):
            loss = gpt(x, y)[1]
        before = float(gs.get_scale()) if gs.is_enabled() else 1.0
        gs.scale(loss).backward()
        gs.unscale_(opt)  # clip the true gradients, as the lslm runs do
        torch.nn.utils.clip_grad_norm_(gpt.parameters(), cfg.grad_clip)
        gs.step(opt)
        gs.update()
        stepped = not gs.is_enabled() or float(gs.get_scale()) >= before  # a skip halves the scale
        for key, value in (("scale", before), ("stepped", stepped), ("loss", loss.item())):
            out[key].append(value)
    out["bytes"] = bytes_per_param(gpt, opt)
    return out


def scaler_first_steps(steps: int = 12, init_scale: float = 2.0**16, batch_size: int = 8, seed: int = 0,
                       with_gradscaler: bool = True, growth_interval: int = 2000, **model: Any) -> dict[str, Any]:
    """The first steps of fp16 training with a GradScaler-like :class:`DynamicLossScaler` (hysteresis 1).

    ``growth_interval``: clean steps before the scale doubles (GradScaler's default 2000; a
    few, to see the scale grow within a short run), the same for both scalers.

    Per step of lslm's fp16 mode: ``scale`` (used by that step), ``stepped`` (False: an
    overflow, the step skipped and the scale halved), ``loss`` and ``max_abs_grad`` (the
    largest unscaled gradient, inf on an overflow). ``gradscaler``: the same model under
    ``torch.autocast`` fp16 with ``torch.amp.GradScaler("cpu")`` (``with_gradscaler``).
    ``headroom_log2``: ``floor(log2(65504 / max_abs_grad))`` at the first clean step, the
    largest power-of-two scale at which its final gradients fit in fp16; a run whose
    ``init_scale`` is at or below it never overflows, and only grows after 2000 clean steps.
    """
    cfg = demo_config(batch_size, seed, model, steps=steps)
    grads: list[float] = []

    def probe(gpt: nn.Module, mp: Any, _: Any) -> None:
        grads.append(max(p.main_grad.abs().max().item() for p in gpt.parameters()) / mp.loss_scale)

    if not isinstance(growth_interval, int) or growth_interval < 1:
        raise ValueError(f"growth_interval must be an int >= 1, got {growth_interval!r}")
    run = _train_lslm(cfg, "fp16", steps, scaler=_gradscaler_like(init_scale, growth_interval), probe=probe)
    lslm = {k: run[k] for k in ("scale", "stepped", "loss")} | {"max_abs_grad": grads}
    clean = [g for g, ok in zip(grads, run["stepped"]) if ok]
    headroom = math.floor(math.log2(FORMATS["fp16"].max / clean[0])) if clean else None
    out = {"lslm": lslm, "init_scale": init_scale, "headroom_log2": headroom, "fp16_max": FORMATS["fp16"].max}
    if with_gradscaler:
        gs = _autocast_run(cfg, torch.float16, steps, init_scale, growth_interval)
        out["gradscaler"] = {k: gs[k] for k in ("scale", "stepped", "loss")}
    return out


def autocast_vs_lslm(steps: int = 10, dtype: str = "fp16", init_scale: float = 2.0**16, batch_size: int = 8,
                     seed: int = 0, **model: Any) -> dict[str, Any]:
    """``torch.autocast`` + GradScaler (fp32 weights) next to lslm's half model + fp32 masters, and fp32.

    Returns ``losses`` and ``scales`` per run, ``stepped``, ``bytes_per_param`` (model-state
    bytes per parameter by category and ``total``, measured after the last step:
    autocast 4 + 4 + 8 = 16, lslm 2 + 4 + 4 + 8 = 18), ``param_dtype`` per run, and
    ``max_diff_u``: the largest ``|loss_a - loss_b| / (u · loss_fp32)`` over the steps for
    each pair (``u`` of ``dtype``).
    """
    if dtype not in HALF_DTYPES:
        raise ValueError(f"dtype must be one of {list(HALF_DTYPES)} (the half format both runs compute in), "
                         f"got {dtype!r}")
    cfg = demo_config(batch_size, seed, model, steps=steps)
    scaler = {"scaler": _gradscaler_like(init_scale)} if dtype == "fp16" else {}
    runs = {"fp32": _train_lslm(cfg, "fp32", steps), f"autocast {dtype}": _autocast_run(cfg, HALF_DTYPES[dtype], steps,
                                                                                         init_scale),
            f"lslm {dtype}": _train_lslm(cfg, dtype, steps, **scaler)}
    for r in runs.values():
        if "setup" in r:
            r["bytes"] = bytes_per_param(r["setup"].model, r["setup"].optimizer)
    u, ref = FORMATS[dtype].unit_roundoff, runs["fp32"]["loss"]
    names = list(runs)
    diff = {f"{a} vs {b}": max(abs(x - y) / (u * z) for x, y, z in zip(runs[a]["loss"], runs[b]["loss"], ref))
            for i, a in enumerate(names) for b in names[i + 1:]}
    return {"losses": {k: r["loss"] for k, r in runs.items()}, "scales": {k: r["scale"] for k, r in runs.items()},
            "stepped": {k: r["stepped"] for k, r in runs.items()}, "max_diff_u": diff, "unit_roundoff": u,
            "bytes_per_param": {k: {**r["bytes"].per_param(), "total": r["bytes"].total} for k, r in runs.items()},
            "param_dtype": {"fp32": "float32", f"autocast {dtype}": "float32", f"lslm {dtype}": dtype}}


class Blowup(nn.Module):
    """A model whose activations exceed fp16's range at any loss scale: a linear layer's output times 1e5.

    ``forward(x)`` returns a scalar loss (``(lin(x) · 1e5)²`` averaged, / 1e10, in fp32).
    In fp16 ``lin(x) · 1e5`` is inf wherever ``|lin(x)| > 0.655`` (65504 / 1e5), so the
    loss and every gradient are inf/NaN whatever the scale; in bf16 (max 3.4e38) it is finite.
    """

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """The scalar loss of ``x`` ``(batch, 4)``, computed in the model's dtype up to the square."""
        return (self.lin(x) * 1e5).float().square().mean() / 1e10


def min_scale_failure(max_steps: int = 20, initial_scale_power: int = 4, seed: int = 0) -> dict[str, Any]:
    """DeepSpeed's "loss scale already at minimum" on :class:`Blowup` in fp16, then the same model in bf16.

    fp16 uses DeepSpeed's defaults (:meth:`DynamicLossScaler.from_deepspeed_config`:
    hysteresis 2, ``min_loss_scale`` 1) from ``2^initial_scale_power``. Returns ``fp16``:
    ``scales`` and ``hysteresis`` per step until the error, ``error`` (the message, None if
    none was raised within ``max_steps``), ``error_step``; ``bf16``: ``stepped`` and ``loss``
    per step over as many steps, and ``finite`` (every parameter finite at the end).
    """
    x = torch.randn(8, 4, generator=torch.Generator().manual_seed(seed), device="cpu")  # lslm: cpu-ok (toy data)

    def setup(mode: str) -> Any:
        torch.manual_seed(seed)
        kw = {"scaler": DynamicLossScaler.from_deepspeed_config(
            {"initial_scale_power": initial_scale_power, "min_loss_scale": 1})} if mode == "fp16" else {}
        return prepare_precision(Blowup(), mode, lambda ps: torch.optim.AdamW(ps, lr=1e-3), **kw)

    fp16 = setup("fp16")
    scales, hyst, error, error_step = [], [], None, None
    for step in range(max_steps):
        fp16.optimizer.zero_grad()
        fp16.optimizer.backward(fp16.model(x.to(fp16.param_dtype)))
        scales.append(fp16.scaler.scale)
        hyst.append(fp16.scaler.cur_hysteresis)
        try:
            fp16.optimizer.step()
        except LossScaleAtMinimumError as e:
            error, error_step = str(e), step
            break
    bf16, stepped, losses = setup("bf16"), [], []
    for _ in range(len(scales)):
        bf16.optimizer.zero_grad()
        loss = bf16.model(x.to(bf16.param_dtype))
        bf16.optimizer.backward(loss)
        stepped.append(bf16.optimizer.step())
        losses.append(loss.item())
    return {"fp16": {"scales": scales, "hysteresis": hyst, "error": error, "error_step": error_step},
            "bf16": {"stepped": stepped, "loss": losses,
                     "finite": all(bool(torch.isfinite(p).all()) for p in bf16.model.parameters())}}
