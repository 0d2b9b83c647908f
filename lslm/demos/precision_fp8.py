"""fp8 measured on the course's GPT: matmul and gradient errors per scaling scheme, and short training runs.

Every function uses the serial baseline's GPT (:mod:`lslm.recipes.train`) widened to
``n_embd = 128`` by default, so that DeepSeek-V3's 128-wide tiles fit the layers, with the
shipped corpus and the baseline's AdamW. The schemes are :data:`lslm.precision.fp8.RECIPES`
(``bf16`` there is the same emulation with bf16 operands, the yardstick). All of it runs in
one process on the CPU in a few seconds; nothing is timed (emulation is slow by design).
"""

from __future__ import annotations

import copy
from collections.abc import Sequence
from typing import Any

import torch
from torch import nn

from lslm.demos.precision_demo import demo_batches, demo_config, optimizer_factory
from lslm.precision import prepare_precision
from lslm.precision.fp8 import RECIPES, OperandQuantizer, emulate_fp8, relative_error
from lslm.recipes.train import build_model

__all__ = ["FP8_MODEL", "SCHEMES", "fp8_gradient_errors", "fp8_loss_curves", "fp8_matmul_errors", "trained_gpt"]

#: The model the fp8 demos use by default: the baseline widened to 128 (DeepSeek-V3's tiles are 128 wide).
FP8_MODEL: dict[str, Any] = {"n_embd": 128, "n_head": 4, "n_layer": 2}
#: The schemes compared, in order (keys of RECIPES).
SCHEMES = tuple(RECIPES)


def _schemes(schemes: Sequence[str] | None) -> list[str]:
    chosen = list(schemes) if schemes is not None else list(SCHEMES)
    unknown = [s for s in chosen if s not in RECIPES]
    if unknown:
        raise ValueError(f"unknown scheme(s) {unknown}; known: {list(RECIPES)}")
    return chosen


def trained_gpt(steps: int = 20, batch_size: int = 8, seed: int = 0, **model: Any) -> dict[str, Any]:
    """The fp32 GPT after ``steps`` AdamW steps, the next batch, and each linear layer's amax history.

    Returns ``model``, ``batch``, ``config`` and ``amax``: ``{layer: {"x", "w", "g": [one amax
    per step]}}`` of every ``nn.Linear``'s input, weight and output gradient during training,
    what a delayed-scaling recipe would have recorded.
    """
    cfg = demo_config(batch_size, seed, {**FP8_MODEL, **model}, minimum=0, steps=steps)
    gpt = build_model(cfg)
    opt = optimizer_factory(cfg)(list(gpt.parameters()))
    amax: dict[str, dict[str, list[float]]] = {}
    hooks = []
    for name, mod in gpt.named_modules():
        if isinstance(mod, nn.Linear):
            rec = amax.setdefault(name, {"x": [], "w": [], "g": []})

            def fwd(m: nn.Module, inp: Any, out: Any, rec: dict[str, list[float]] = rec) -> None:
                rec["x"].append(float(inp[0].detach().abs().max()))
                rec["w"].append(float(m.weight.detach().abs().max()))

            def bwd(m: nn.Module, gin: Any, gout: Any, rec: dict[str, list[float]] = rec) -> None:
                rec["g"].append(float(gout[0].detach().abs().max()))
            hooks += [mod.register_forward_hook(fwd), mod.register_full_backward_hook(bwd)]
    for x, y in demo_batches(cfg, steps):
        opt.zero_grad(set_to_none=True)
        gpt(x, y)[1].backward()
        torch.nn.utils.clip_grad_norm_(gpt.parameters(), cfg.grad_clip)
        opt.step()
    for h in hooks:
        h.remove()
    return {"model": gpt, "batch": demo_batches(cfg, steps + 1)[steps], "config": cfg, "amax": amax}


def _prefill(quant: OperandQuantizer, history: dict[str, list[float]]) -> None:
    """Give a delayed recipe's per-role histories the amaxes training recorded (no-op otherwise)."""
    for role, scaler in quant.delayed.items():
        scaler.history.extend(history[role][-scaler.history.maxlen:])


def fp8_matmul_errors(trained: dict[str, Any], layer: str = "blocks.0.mlp.c_fc", schemes: Sequence[str] | None = None,
                      outlier: float | None = None) -> list[dict[str, Any]]:
    """Relative error ``||y_q - y|| / ||y||`` of ``layer``'s matmul ``y = x W^T`` on its real input, per scheme.

    ``x`` is what the layer receives on ``trained``'s batch (a forward hook), ``W`` its weight;
    ``y_q`` multiplies the operands as each scheme stores them, in fp32 (a delayed scheme
    scales with the history of amaxes recorded in training, not with this batch's). ``outlier``: multiply
    one activation entry per token (channel 0) by this factor first, the "massive activations"
    LLMs develop. Rows: ``scheme``, ``error``, ``x_error`` (the activation's own rounding error).
    """
    gpt = trained["model"]
    lin = dict(gpt.named_modules())[layer]
    if not isinstance(lin, nn.Linear):
        raise ValueError(f"{layer!r} is not an nn.Linear")
    seen: list[torch.Tensor] = []
    handle = lin.register_forward_hook(lambda m, inp, out: seen.append(inp[0].detach().reshape(-1, inp[0].shape[-1])))
    with torch.no_grad():
        gpt(*trained["batch"])
    handle.remove()
    x, w = seen[0].clone(), lin.weight.detach()
    if outlier is not None:
        x[:, 0] *= outlier
    y = x @ w.t()
    rows = []
    for name in _schemes(schemes):
        q = OperandQuantizer(RECIPES[name])
        _prefill(q, trained["amax"][layer])  # delayed: the scale comes from the training steps' amaxes
        xq = q("x", x, along_last=True)
        rows.append({"scheme": name, "error": relative_error(xq @ q("w", w, along_last=True).t(), y),
                     "x_error": relative_error(xq, x)})
    return rows


def fp8_gradient_errors(trained: dict[str, Any], schemes: Sequence[str] | None = None) -> list[dict[str, Any]]:
    """Relative error of the whole model's gradients with fp8-emulated linear layers, per scheme.

    The same weights and batch as ``trained``; every ``nn.Linear`` but the head runs its
    three GEMMs as the scheme stores their operands (:func:`~lslm.precision.fp8.emulate_fp8`),
    the rest stays fp32; a delayed scheme scales with the amax histories of training. Rows:
    ``scheme``, ``error`` (over all parameters' gradients, one global norm), ``worst`` and
    ``worst_param`` (the parameter with the largest relative
    error), ``loss_diff`` (``|loss_q - loss| / loss``).
    """
    gpt = trained["model"]
    x, y = trained["batch"]

    def grads(model: nn.Module) -> tuple[list[torch.Tensor], float]:
        model.zero_grad(set_to_none=True)
        loss = model(x, y)[1]
        loss.backward()
        return [p.grad.detach().clone() for p in model.parameters()], loss.item()

    exact, loss = grads(gpt)
    names = [n for n, _ in gpt.named_parameters()]
    rows = []
    for name in _schemes(schemes):
        twin = copy.deepcopy(gpt)
        for layer in emulate_fp8(twin, name):
            _prefill(dict(twin.named_modules())[layer].quant, trained["amax"][layer])
        got, loss_q = grads(twin)
        per = [relative_error(a, b) for a, b in zip(got, exact)]
        k = max(range(len(per)), key=per.__getitem__)
        rows.append({"scheme": name, "error": relative_error(got, exact), "worst": per[k], "worst_param": names[k],
                     "loss_diff": abs(loss_q - loss) / loss})
    gpt.zero_grad(set_to_none=True)
    return rows


def fp8_loss_curves(steps: int = 30, schemes: Sequence[str] | None = None, batch_size: int = 8, seed: int = 0,
                    **model: Any) -> dict[str, Any]:
    """``steps`` training steps with fp8-emulated linear layers per scheme, next to lslm's bf16 and fp32 modes.

    fp8 runs: fp32 weights (their own masters), every linear but the head fp8-emulated,
    the baseline's AdamW and clipping. ``bf16``: :func:`~lslm.precision.prepare_precision`'s bf16
    mode (bf16 model, fp32 masters). Same seed, same batches. Returns ``losses`` per run
    (``fp32``, ``bf16 mode``, then each scheme) and ``final``: each run's mean loss over its
    last 5 steps.
    """
    cfg = demo_config(batch_size, seed, {**FP8_MODEL, **model}, steps=steps)
    runs: dict[str, tuple[str, str | None]] = {"fp32": ("fp32", None), "bf16 mode": ("bf16", None)}
    runs |= {f"fp8 {s}" if s != "bf16" else "bf16 operands": ("fp32", s) for s in _schemes(schemes)}
    losses: dict[str, list[float]] = {}
    for run, (mode, scheme) in runs.items():
        gpt = build_model(cfg)
        if scheme is not None:
            emulate_fp8(gpt, scheme)
        setup = prepare_precision(gpt, mode, optimizer_factory(cfg))
        out = []
        for x, y in demo_batches(cfg, steps):
            setup.optimizer.zero_grad()
            loss = gpt(x, y)[1]
            setup.optimizer.backward(loss)
            setup.optimizer.step(max_grad_norm=cfg.grad_clip)
            out.append(loss.item())
        losses[run] = out
    tail = min(5, steps)
    return {"losses": losses, "final": {k: sum(v[-tail:]) / tail for k, v in losses.items()}, "steps": steps}
