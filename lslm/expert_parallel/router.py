"""The top-k router of a mixture-of-experts layer and its two auxiliary losses.

Routing: a linear gate (no bias) gives one logit per expert; a softmax over *all* experts
gives the probabilities ``p``; each token picks its ``top_k`` most probable experts. The gates
that weigh the chosen experts' outputs follow one of two conventions (``renormalize``):

* ``True`` (Mixtral, Jiang et al. 2024, Section 2.1; GShard for k = 2): the k chosen
  probabilities renormalised to sum to 1. With k = 1 every gate is then 1 and the router
  learns only from the auxiliary losses, so top-1 models use
* ``False`` (Switch Transformer, Fedus et al. 2021, Section 2.1, eq. 2): the raw probability
  ``p_i(x)`` of each chosen expert.

Auxiliary losses (both computed on the tokens this call routes, before any capacity drop):

* load balancing, Switch eq. 4: ``N · Σ_i f_i · P_i`` with ``f_i`` the fraction of the
  ``T · k`` assignments that go to expert ``i`` (for k = 1 exactly Switch's fraction of tokens)
  and ``P_i`` the mean router probability of expert ``i``. It is 1 when both are uniform;
  only ``P`` carries a gradient (``f`` counts an argmax).
* router z-loss, ST-MoE (Zoph et al. 2022) eq. 5: ``(1/T) Σ_t (log Σ_i exp(x_{t,i}))²`` on the
  logits, which keeps them small (and the softmax well conditioned in low precision).
"""

from __future__ import annotations

import numbers
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn as nn

__all__ = ["Routing", "TopKRouter", "check_positive_int", "check_routing", "load_balancing_loss", "router_z_loss"]


def check_positive_int(name: str, value: Any) -> None:
    """ValueError naming ``name`` unless ``value`` is an int >= 1 (a bool is refused: Python counts it as an int)."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < 1:
        raise ValueError(f"{name} must be an int >= 1, got {value!r}")


def check_routing(num_experts: int, top_k: int, renormalize: bool | None = None) -> None:
    """ValueError unless ``num_experts`` and ``top_k`` are ints with ``1 <= top_k <= num_experts`` and
    ``renormalize`` is a bool or None (a fractional top_k would otherwise fail inside ``torch.topk``)."""
    check_positive_int("num_experts", num_experts)
    if isinstance(top_k, bool) or not isinstance(top_k, numbers.Integral):
        raise ValueError(f"top_k must be an int (experts per token), got {top_k!r}")
    if not 1 <= top_k <= num_experts:
        raise ValueError(f"top_k = {top_k} must be between 1 and num_experts = {num_experts}")
    if renormalize is not None and not isinstance(renormalize, bool):
        raise ValueError(f"renormalize must be a bool (or None for the default), got {renormalize!r}")


@dataclass
class Routing:
    """One routing decision for ``T`` tokens: ``logits``/``probs`` ``(T, E)``, ``experts``/``gates`` ``(T, k)``."""

    logits: torch.Tensor
    probs: torch.Tensor
    experts: torch.Tensor
    gates: torch.Tensor

    @property
    def num_experts(self) -> int:
        """``E``, the number of experts routed over."""
        return self.probs.shape[-1]


def load_balancing_loss(routing: Routing) -> torch.Tensor:
    """Switch Transformer eq. 4 (Fedus et al. 2021): ``N · Σ_i f_i · P_i`` over the routed tokens (see module doc)."""
    n_exp = routing.num_experts
    counts = torch.bincount(routing.experts.flatten(), minlength=n_exp).to(routing.probs.dtype)
    f = counts / routing.experts.numel()  # fraction of the T·k assignments per expert (a count: no gradient)
    p = routing.probs.mean(0)
    return n_exp * (f * p).sum()


def router_z_loss(routing: Routing) -> torch.Tensor:
    """ST-MoE eq. 5 (Zoph et al. 2022): the mean over tokens of ``logsumexp(logits)²``."""
    return torch.logsumexp(routing.logits, -1).square().mean()


class TopKRouter(nn.Module):
    """Softmax over ``num_experts``, top ``top_k``, gates renormalised (Mixtral) or raw (Switch): see module doc."""

    def __init__(self, n_embd: int, num_experts: int, top_k: int, renormalize: bool = True,
                 device: torch.device | None = None) -> None:
        super().__init__()
        check_positive_int("n_embd", n_embd)
        check_routing(num_experts, top_k, renormalize)
        self.num_experts, self.top_k, self.renormalize = num_experts, top_k, renormalize
        self.gate = nn.Linear(n_embd, num_experts, bias=False, device=device)

    def forward(self, x: torch.Tensor) -> Routing:
        """Route ``x`` ``(T, C)``: logits, probabilities, the chosen experts and their gates."""
        logits = self.gate(x)
        probs = torch.softmax(logits.float(), -1).to(logits.dtype)
        top_p, experts = probs.topk(self.top_k, -1)
        gates = top_p / top_p.sum(-1, keepdim=True) if self.renormalize else top_p
        return Routing(logits=logits, probs=probs, experts=experts, gates=gates)
