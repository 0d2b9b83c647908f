"""A mixture-of-experts layer in place of the GPT block's MLP, serial (every expert on this rank).

:class:`MoE` routes each token to ``top_k`` of ``num_experts`` small MLPs (:class:`Expert`: Linear,
GELU, Linear, like the dense block's) with :class:`~lslm.expert_parallel.router.TopKRouter`,
applies the capacity (:mod:`~lslm.expert_parallel.dispatch`), runs each expert on the assignments
it keeps and sums the gated outputs back per token (Shazeer et al. 2017, eq. 1:
``y = Σ_i G(x)_i E_i(x)`` over the chosen experts). After each forward it keeps its auxiliary
losses (``aux``) and counts (``stats``: assignments per expert, routed and kept, and dropped).

:func:`apply_moe` swaps every block's MLP of lslm's GPT for a fresh :class:`MoE` from outside (the
model stays plain; experts start from nn.Linear's default init under torch's RNG);
:func:`moe_aux_loss` adds the layers' auxiliary losses to the training loss.
"""

from __future__ import annotations

import numbers
from typing import Any

import torch
import torch.nn as nn

from lslm.expert_parallel.dispatch import Assignments, assign, check_capacity_factor, expert_capacity
from lslm.expert_parallel.router import (
    TopKRouter,
    check_positive_int,
    check_routing,
    load_balancing_loss,
    router_z_loss,
)
from lslm.models.gpt import Block

__all__ = ["Expert", "MoE", "apply_moe", "check_moe", "moe_aux_loss", "moe_layers", "route_tokens"]


def check_moe(num_experts: int, top_k: int, capacity_factor: float | None, ep: int = 1) -> None:
    """Refuse a configuration no MoE layer can run (ValueError naming the argument, with the fix), before anything
    is built: ints where counts are meant, ``1 <= top_k <= num_experts``, a finite ``capacity_factor`` > 0 or None,
    experts that divide over ``ep``."""
    check_routing(num_experts, top_k)
    check_capacity_factor(capacity_factor)
    check_positive_int("ep", ep)
    if num_experts % ep:
        raise ValueError(f"num_experts = {num_experts} is not divisible by ep = {ep}: every expert-parallel rank "
                         f"owns the same number of experts; choose num_experts as a multiple of {ep}")


def route_tokens(router: TopKRouter, flat: torch.Tensor,
                 capacity_factor: float | None) -> tuple[Assignments, dict[str, torch.Tensor], dict[str, Any]]:
    """Route ``flat`` ``(T, C)``, apply the capacity: (kept assignments, auxiliary losses, counts).

    The one routing step of the serial and the expert-parallel layer, so both route alike.
    The counts come to the host (``.tolist()``): the split sizes of an all-to-all are host integers.
    """
    routing = router(flat)
    cap = expert_capacity(flat.shape[0], router.num_experts, router.top_k, capacity_factor)
    a = assign(routing.experts, routing.gates, router.num_experts, cap)
    aux = {"load_balancing": load_balancing_loss(routing), "z": router_z_loss(routing)}
    stats = {"per_expert": a.per_expert.tolist(), "routed": a.routed.tolist(), "dropped": a.dropped,
             "capacity": cap, "tokens": flat.shape[0]}
    return a, aux, stats


class Expert(nn.Module):
    """One expert: ``c_fc`` (C -> hidden), GELU (tanh, as the dense MLP), ``c_proj`` (hidden -> C)."""

    def __init__(self, n_embd: int, hidden: int, bias: bool = True, device: torch.device | None = None) -> None:
        super().__init__()
        self.c_fc = nn.Linear(n_embd, hidden, bias=bias, device=device)
        self.gelu = nn.GELU(approximate="tanh")
        self.c_proj = nn.Linear(hidden, n_embd, bias=bias, device=device)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """The expert's MLP on ``x`` ``(M, C)``."""
        return self.c_proj(self.gelu(self.c_fc(x)))


class MoE(nn.Module):
    """Top-k routed experts, serial (see the module doc); ``capacity_factor=None`` is dropless."""

    def __init__(self, n_embd: int, hidden: int, num_experts: int, top_k: int = 2,
                 capacity_factor: float | None = 1.25, renormalize: bool | None = None, bias: bool = True,
                 dropout: float = 0.0, device: torch.device | None = None) -> None:
        super().__init__()
        check_moe(num_experts, top_k, capacity_factor)
        check_positive_int("n_embd", n_embd)
        check_positive_int("hidden", hidden)
        check_routing(num_experts, top_k, renormalize)
        if not isinstance(bias, bool):
            raise ValueError(f"bias must be a bool, got {bias!r}")
        # nn.Dropout's own range check lets NaN through (NaN compares false both ways).
        if isinstance(dropout, bool) or not isinstance(dropout, numbers.Real) or not 0.0 <= dropout <= 1.0:
            raise ValueError(f"dropout must be a probability in [0, 1], got {dropout!r}")
        renormalize = top_k > 1 if renormalize is None else renormalize  # Switch for top-1, Mixtral otherwise
        self.num_experts, self.top_k, self.capacity_factor = num_experts, top_k, capacity_factor
        self.router = TopKRouter(n_embd, num_experts, top_k, renormalize, device)
        self.experts = nn.ModuleList(Expert(n_embd, hidden, bias, device) for _ in range(num_experts))
        self.dropout = nn.Dropout(dropout)
        self.aux: dict[str, torch.Tensor] = {}
        self.stats: dict[str, Any] = {}

    def route(self, flat: torch.Tensor) -> Assignments:
        """Route ``flat`` ``(T, C)``, apply the capacity; keep the auxiliary losses (``aux``) and counts (``stats``)."""
        a, self.aux, self.stats = route_tokens(self.router, flat, self.capacity_factor)
        return a

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``x`` ``(..., C)`` -> the gated sum of the chosen experts' outputs, same shape."""
        flat = x.reshape(-1, x.shape[-1])
        a = self.route(flat)
        out = torch.zeros_like(flat)
        start = 0
        for e, n in enumerate(a.per_expert.tolist()):
            rows = a.tokens[start:start + n]
            y = self.experts[e](flat.index_select(0, rows)) * a.gates[start:start + n, None]
            out = out.index_add(0, rows, y)
            start += n
        return self.dropout(out.view_as(x))


def moe_layers(model: nn.Module) -> list[nn.Module]:
    """Every module of ``model`` that keeps MoE auxiliary losses (serial or expert-parallel), in order."""
    return [m for m in model.modules() if isinstance(getattr(m, "aux", None), dict) and hasattr(m, "router")]


def moe_aux_loss(model: nn.Module, balance_coef: float = 1e-2, z_coef: float = 1e-3) -> torch.Tensor:
    """``Σ_layers balance_coef · L_balance + z_coef · L_z`` from the last forward (Switch's α = 1e-2, ST-MoE's 1e-3)."""
    layers = moe_layers(model)
    if not layers or not layers[0].aux:
        raise ValueError("no MoE layer has run a forward yet: call the model first")
    return sum(balance_coef * m.aux["load_balancing"] + z_coef * m.aux["z"] for m in layers)


def apply_moe(model: nn.Module, num_experts: int, top_k: int = 2, capacity_factor: float | None = 1.25,
              renormalize: bool | None = None, hidden: int | None = None) -> nn.Module:
    """Replace every GPT block's MLP by a :class:`MoE` (in place; returns the model).

    ``hidden``: each expert's inner width (default: the dense MLP's). The MoE keeps the MLP's
    dropout module (applied to the combined output) and its device.
    """
    check_moe(num_experts, top_k, capacity_factor)
    check_routing(num_experts, top_k, renormalize)
    if hidden is not None:
        check_positive_int("hidden", hidden)
    blocks = [m for m in model.modules() if isinstance(m, Block)]
    if not blocks:
        raise ValueError(f"apply_moe found no lslm GPT Block in {type(model).__name__}")
    for block in blocks:
        mlp = block.mlp
        if isinstance(mlp, MoE):
            raise ValueError("apply_moe was already applied to this model")
        fc = mlp.c_fc
        moe = MoE(fc.in_features, hidden or fc.out_features, num_experts, top_k, capacity_factor, renormalize,
                  bias=fc.bias is not None, device=fc.weight.device)
        moe.dropout = mlp.dropout
        block.mlp = moe
    return model
