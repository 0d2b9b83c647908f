"""Exercise of notebook 00: predict the bytes of model states before measuring them.

The learner writes ``predict_model_state_bytes(n_params, optimizer)``: the bytes of
fp32 weights + gradients + optimizer state for ``n_params`` (Ψ, a parameter *count*)
parameters trained with ``optimizer`` (``"sgd"``: plain SGD, no state;
``"sgd_momentum"``: one momentum buffer; ``"adam"``: two moments). That is
4+4+0, 4+4+4 and 4+4+8 bytes per parameter: 8Ψ, 12Ψ and 16Ψ bytes.

fp32 Adam's 16Ψ bytes is not the 16Ψ of the ZeRO paper (Rajbhandari et al. 2020,
section 3.1), which is mixed-precision Adam: fp16 weights and gradients (2+2) plus
fp32 master weights, momentum and variance (4+4+4 = 12 bytes, "K = 12").

The checker needs no processes: it builds small real models (a linear layer, an MLP,
a tiny GPT with tied embeddings), runs one real optimizer step, and compares the
prediction with what :func:`lslm.metrics.model_state_bytes` measures, Adam's 4-byte
step counter per parameter *tensor* left out (it does not scale with Ψ).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from lslm.exercises.core import Verdict, report, run_local
from lslm.exercises.registry import Exercise, register

OPTIMIZERS = ("sgd", "sgd_momentum", "adam")
_BYTES_PER_PARAM = {"sgd": 4 + 4 + 0, "sgd_momentum": 4 + 4 + 4, "adam": 4 + 4 + 8}


def reference_predict_model_state_bytes(n_params: int, optimizer: str) -> int:
    """Our solution: fp32 weights (4 B) + gradients (4 B) + optimizer state (0, 4 or 8 B) per parameter."""
    state = {"sgd": 0, "sgd_momentum": 4, "adam": 8}  # Adam: exp_avg and exp_avg_sq, both fp32
    if optimizer not in state:
        raise ValueError(f"unknown optimizer {optimizer!r}")
    return (4 + 4 + state[optimizer]) * n_params


def _gpt() -> nn.Module:
    from lslm.models import GPT, GPTConfig

    return GPT(GPTConfig(vocab_size=64, block_size=8, n_layer=1, n_head=2, n_embd=16, tie_weights=True))


def _loss(model: nn.Module) -> torch.Tensor:
    if isinstance(model, nn.Linear | nn.Sequential):
        width = model.in_features if isinstance(model, nn.Linear) else model[0].in_features
        return model(torch.randn(4, width)).square().mean()  # lslm: cpu-ok (in-process check, CPU models)
    x = torch.randint(0, 64, (2, 8))  # lslm: cpu-ok (in-process check, CPU models)
    return model(x, x)[1]


# Small real models: a layer, an MLP, and a GPT whose tied embedding counts once (Ψ is what the checker passes).
MODELS: dict[str, Callable[[], nn.Module]] = {
    "nn.Linear(16, 8)": lambda: nn.Linear(16, 8),
    "an MLP 32-64-10": lambda: nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 10)),
    "a tiny GPT with tied embeddings": _gpt,
}


def _step(model: nn.Module, optimizer: str) -> torch.optim.Optimizer:
    """One real forward, backward and optimizer step, so gradients and optimizer state exist."""
    params = list(model.parameters())
    opt = {"sgd": lambda: torch.optim.SGD(params, lr=1e-3),
           "sgd_momentum": lambda: torch.optim.SGD(params, lr=1e-3, momentum=0.9),
           "adam": lambda: torch.optim.Adam(params, lr=1e-3)}[optimizer]()
    _loss(model).backward()
    opt.step()
    return opt


@functools.lru_cache(maxsize=1)
def measured_cases() -> tuple[tuple[str, str, int, int, int], ...]:
    """(model, optimizer, Ψ, measured model-state bytes, of which Adam step counters) for every case."""
    from lslm.metrics import model_state_bytes

    cases = []
    for label, build in MODELS.items():
        for optimizer in OPTIMIZERS:
            torch.manual_seed(0)
            model = build()  # fresh weights and no state for each optimizer
            opt = _step(model, optimizer)
            measured = model_state_bytes(model, opt)
            steps = sum(s["step"].numel() * s["step"].element_size() for s in opt.state.values()
                        if isinstance(s.get("step"), torch.Tensor))
            cases.append((label, optimizer, measured.num_params, measured.total, steps))
    return tuple(cases)


# Bytes per parameter for (sgd, sgd_momentum, adam), per mistake.
_PATTERNS = {
    "no_grads": (4, 8, 12),
    "adam_one_moment": (8, 12, 12),
    "numel_not_bytes": (2, 3, 4),
    "no_optimizer_state": (8, 8, 8),
    "weights_only": (4, 4, 4),
}
HINTS = {
    "type": "return the number of bytes as an int",
    "error": "call it by hand for n_params=10 and each of 'sgd', 'sgd_momentum', 'adam' first",
    "no_grads": "after loss.backward() every parameter has a .grad of its own shape and dtype: 4 more bytes "
                "per parameter, whatever the optimizer",
    "adam_one_moment": "Adam keeps two fp32 moments per parameter (exp_avg and exp_avg_sq): 8 bytes of state "
                       "per parameter, not 4",
    "numel_not_bytes": "you counted elements; memory is counted in bytes, and an fp32 element is 4 bytes "
                       "(tensor.element_size())",
    "no_optimizer_state": "the optimizer keeps state of its own: SGD with momentum one buffer per parameter "
                          "(4 bytes), Adam two moments (8 bytes); plain SGD none",
    "weights_only": "count the gradients (4 bytes per parameter) and the optimizer state too, not only the weights",
    "wrong": "per parameter: fp32 weight 4 bytes + fp32 gradient 4 bytes + optimizer state (SGD 0, SGD with "
             "momentum 4, Adam 8 bytes)",
}


def _judge(fn: Callable[[int, str], Any]) -> dict[str, Any]:
    ratios: dict[str, set[float]] = {o: set() for o in OPTIMIZERS}
    first_wrong = None
    for label, optimizer, psi, total, steps in measured_cases():
        got = fn(psi, optimizer)
        if isinstance(got, bool) or not isinstance(got, int | float) or got != int(got):
            return {"passed": False, "hint": HINTS["type"], "details": {"kind": "type", "got": repr(got)},
                    "message": f"predict_model_state_bytes({psi}, {optimizer!r}) returned {got!r}, not a byte count"}
        want = total - steps
        ratios[optimizer].add(got / psi)
        if got != want and first_wrong is None:
            extra = f" + {steps} B of Adam step counters left out" if steps else ""
            first_wrong = {"label": label, "optimizer": optimizer, "psi": psi, "expected": want, "got": int(got),
                           "text": f"{label}, Ψ = {psi:,} parameters, {optimizer!r}: measured {want:,} bytes"
                                   f"{extra}; you predicted {int(got):,}"}
    if first_wrong is None:
        n = len(measured_cases())
        return {"passed": True, "message": f"your predictions match the measured bytes in all {n} cases "
                                           "(3 models x sgd, sgd_momentum, adam)"}
    per_param = tuple(next(iter(ratios[o])) if len(ratios[o]) == 1 else None for o in OPTIMIZERS)
    kind = next((k for k, p in _PATTERNS.items() if per_param == p), "wrong")
    text = first_wrong.pop("text")
    return {"passed": False, "message": text, "hint": HINTS[kind], "details": {"kind": kind, **first_wrong}}


def check_predict_model_state_bytes(fn: Callable[[int, str], int]) -> Verdict:
    """Check the learner's ``predict_model_state_bytes(n_params, optimizer)`` against measurement; print it.

    ``fn`` may be a tuple ``(predict_model_state_bytes, helper, ...)``; nothing is launched.
    """
    return report(run_local(fn, _judge, exercise="predict_model_state_bytes"))


register(Exercise(
    name="predict_model_state_bytes", notebook="00_setup_and_tour", reference=reference_predict_model_state_bytes,
    check=check_predict_model_state_bytes,
    hints=("three things live per parameter once training has stepped: the weight, its gradient and the "
           "optimizer's state; each fp32 number is 4 bytes",
           "SGD keeps no state, SGD with momentum one buffer per parameter, Adam two (exp_avg and exp_avg_sq): "
           "4+4+0, 4+4+4 and 4+4+8 bytes per parameter")))
