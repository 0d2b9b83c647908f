"""lslm.metrics.compute_dtypes: matmul flops and attention calls by the dtype they ran in, against hand counts, and
the replay-outside-autocast bug it exists to catch (lslm.tensor_parallel.recompute, its replay patched to leave
autocast: three of each layer's four matmul passes then run in fp32, as on the H200 runs of 2026-11-28)."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import pytest
import torch
import torch.nn.functional as F

import lslm.tensor_parallel.recompute as recompute_module
from lslm.metrics.compute_dtypes import ComputeDtypes
from lslm.models.gpt import GPT, GPTConfig
from lslm.tensor_parallel.recompute import apply_recompute

B, S, H, L, V = 2, 16, 32, 2, 64


def test_matmul_flops_and_attention_calls_by_dtype():
    a, w, bias = torch.randn(8, 16), torch.randn(16, 24), torch.randn(24)
    x, y = torch.randn(3, 8, 16), torch.randn(3, 16, 4)
    with ComputeDtypes() as c:
        torch.mm(a, w)  # 2 * 8 * 16 * 24
        torch.addmm(bias, a, w)  # the same product
        torch.bmm(x, y)  # 2 * 3 * 8 * 16 * 4
        with torch.autocast("cpu", dtype=torch.bfloat16):
            torch.mm(a, w)  # cast to bf16 before it dispatches
    assert c.matmul_flops == {"float32": 2 * 6144 + 3072, "bfloat16": 6144}
    assert c.fp32_share() == pytest.approx(15360 / 21504)
    q = torch.randn(1, 2, 8, 4, requires_grad=True)
    with ComputeDtypes() as c:
        F.scaled_dot_product_attention(q, q, q, is_causal=True).sum().backward()
    assert c.attention_calls == {"float32": 2} and c.matmul_flops == {}  # forward and backward
    assert ComputeDtypes().fp32_share() == 0.0


def _step_dtypes(mode: str) -> ComputeDtypes:
    torch.manual_seed(0)
    model = apply_recompute(GPT(GPTConfig(vocab_size=V, block_size=S, n_layer=L, n_head=2, n_embd=H,
                                          tie_weights=False)), mode)
    idx = torch.randint(0, V, (B, S))
    with ComputeDtypes() as c:
        with torch.autocast("cpu", dtype=torch.bfloat16):
            _, loss = model(idx, idx)
        loss.backward()
    return c


LAYER = 2 * B * S * 12 * H * H  # one layer's forward matmul flops (qkv 3h², proj h², fc1 and fc2 4h² each)
HEAD = 2 * B * S * H * V


@pytest.mark.parametrize("mode, replays", [("none", 0), ("full", 1)])
def test_recomputation_replays_its_matmuls_in_bf16(mode: str, replays: int):
    c = _step_dtypes(mode)
    assert c.matmul_flops == {"bfloat16": (3 + replays) * L * LAYER + 3 * HEAD}
    assert set(c.attention_calls) == {"bfloat16"}


def test_a_replay_outside_autocast_shows_as_fp32_flops(monkeypatch: pytest.MonkeyPatch):
    real = recompute_module.replaying

    @contextlib.contextmanager
    def without_autocast(state: Any, tracker: Any) -> Iterator[None]:  # the bug: the replay leaves autocast
        with real(state, tracker), torch.autocast("cpu", enabled=False):
            yield

    monkeypatch.setattr(recompute_module, "replaying", without_autocast)
    c = _step_dtypes("full")
    # forward in bf16 (layers and head), the head's backward in bf16; each layer's replay and backward in fp32
    assert c.matmul_flops == {"bfloat16": L * LAYER + 3 * HEAD, "float32": 3 * L * LAYER}
    assert c.attention_calls == {"bfloat16": L, "float32": 2 * L}
