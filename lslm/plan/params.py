"""Parameter counts: the published closed forms, and exact counts by part (what a pipeline stage holds).

* :func:`playbook_params`: the Ultra-Scale Playbook's ``N = h v + L(12 h^2 + 13 h) + 2 h`` for a GPT-2-style
  model: the (tied) token embedding ``h v``; per layer ``12 h^2`` of weights (``3h^2`` qkv, ``h^2`` attention
  output, ``8 h^2`` MLP) and ``13 h`` of biases and LayerNorm (``3h + h + 4h + h`` biases, ``2 · 2h`` for two
  LayerNorms); ``2 h`` the final LayerNorm. Position embeddings are left out.
* :func:`megatron_params`: Narayanan et al. 2021, §5.1: ``P = 12 l h^2 (1 + 13/(12 h) + (V + s)/(12 l h))``
  (tied head, learned positions, no final LayerNorm), the formula behind their Table 1's parameter counts.
* :func:`param_parts`: exact counts by part for either family of :class:`~lslm.plan.model.ModelSpec`
  (embedding, one layer, final norm, head); for ``arch="gpt"`` their total is
  ``sum(p.numel() for p in GPT(cfg).parameters())``, tied or not, with or without bias.
  For ``arch="llama"``: grouped-query attention (``q, o: h^2``; ``k, v: h · kv · d`` each), SwiGLU
  (``3 h f``), two RMSNorm weights per layer and a final one (``h`` each), no biases: the count of Hugging
  Face's ``LlamaForCausalLM``.
* :func:`gpt_tensor_numels`: every parameter tensor of lslm's GPT in ``model.parameters()`` order, the order
  lslm's flat gradient buffer and ZeRO's layout use.
"""

from __future__ import annotations

from dataclasses import dataclass

from lslm.plan.model import ModelSpec

__all__ = ["ParamParts", "gpt_tensor_numels", "largest_tensor", "megatron_params", "param_parts", "playbook_params"]


def playbook_params(h: int, v: int, n_layer: int) -> int:
    """The Ultra-Scale Playbook's ``N = h v + L(12 h^2 + 13 h) + 2 h`` (module doc says which terms)."""
    return h * v + n_layer * (12 * h * h + 13 * h) + 2 * h


def megatron_params(h: int, v: int, n_layer: int, s: int) -> float:
    """Narayanan et al. 2021, §5.1: ``12 l h^2 (1 + 13/(12h) + (V + s)/(12 l h))``."""
    return 12 * n_layer * h * h * (1 + 13 / (12 * h) + (v + s) / (12 * n_layer * h))


@dataclass(frozen=True)
class ParamParts:
    """Exact parameter counts of a model, by part (a pipeline stage holds whole parts)."""

    embedding: int  #: token (and, "gpt", position) embeddings
    layer: int  #: one transformer layer
    n_layer: int
    final_norm: int
    head: int  #: the output projection; 0 when tied (it is the token embedding)
    tied: bool

    @property
    def total(self) -> int:
        """Every parameter once (a tied head is the embedding)."""
        return self.embedding + self.n_layer * self.layer + self.final_norm + self.head


def _gpt_layer(h: int, f: int, bias: bool) -> list[int]:
    b = 1 if bias else 0
    return [h, b * h,  # ln_1 weight, bias
            3 * h * h, b * 3 * h,  # c_attn
            h * h, b * h,  # attn c_proj
            h, b * h,  # ln_2
            f * h, b * f,  # c_fc
            h * f, b * h]  # mlp c_proj


def gpt_tensor_numels(model: ModelSpec) -> list[int]:
    """Element counts of lslm GPT's parameter tensors in ``GPT(cfg).parameters()`` order (zero-size bias slots
    left out, a tied head counted once as the embedding)."""
    if model.arch != "gpt":
        raise ValueError("gpt_tensor_numels describes lslm's GPT; this model has arch='llama'")
    h, b = model.hidden, model.bias
    numels = [model.vocab * h, model.positions * h]
    for _ in range(model.n_layer):
        numels += _gpt_layer(h, model.ffn, b)
    numels += [h, h if b else 0]
    if not model.tied:
        numels.append(model.vocab * h)
    return [n for n in numels if n]


def param_parts(model: ModelSpec) -> ParamParts:
    """Exact parameter counts by part for ``model`` (module doc)."""
    h, f = model.hidden, model.ffn
    head = 0 if model.tied else model.vocab * h
    if model.arch == "gpt":
        return ParamParts(embedding=(model.vocab + model.positions) * h, layer=sum(_gpt_layer(h, f, model.bias)),
                          n_layer=model.n_layer, final_norm=2 * h if model.bias else h, head=head, tied=model.tied)
    kv = model.kv_heads * model.head_dim
    layer = 2 * h * h + 2 * h * kv + 3 * h * f + 2 * h
    return ParamParts(embedding=model.vocab * h, layer=layer, n_layer=model.n_layer, final_norm=h, head=head,
                      tied=model.tied)


def largest_tensor(model: ModelSpec) -> int:
    """The largest parameter tensor (DeepSpeed's "largest layer" for its ZeRO-3 estimate)."""
    h, f = model.hidden, model.ffn
    widest = max(3 * h * h, h * f) if model.arch == "gpt" else max(h * h, h * f)
    return max(model.vocab * h, widest)
