"""Eager elementwise traffic: lslm.metrics.traffic's count by op, and the calculator's count of torchtitan's eager
Llama block (lslm.plan.calibrated.torchtitan_layer_bytes) against it on a block written op for op as torchtitan's."""

from dataclasses import replace

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from lslm.metrics.traffic import ElementwiseTraffic
from lslm.plan.calibrated import elementwise_bytes, microbatch_times, torchtitan_layer_bytes
from lslm.plan.gpu_calibration import H200_CALIBRATION
from lslm.plan.layout import Layout
from lslm.plan.model import ModelSpec, model_presets

BF16 = torch.bfloat16


def test_traffic_counts_reads_and_writes_views_free_broadcasts_once_matmuls_aside():
    x = torch.randn(64, 32, dtype=BF16)
    w = torch.randn(32, dtype=BF16)
    with ElementwiseTraffic() as t:
        xf = x.float()  # read 2 x 2048, write 4 x 2048
        xf.t(), xf.view(-1)  # views: nothing
        xf * w  # w broadcast over rows (stride 0): its 32 elements once; read 4 x 2048 + 2 x 32, write 4 x 2048
        x @ x.t()  # a matmul: priced by its flops, not here
    n = 64 * 32
    assert t.total == (2 + 4) * n + (4 * n + 2 * 32 + 4 * n)
    assert set(t.by_op) == {"_to_copy", "mul"}


class _RMSNorm(nn.Module):
    """torchtitan's ``RMSNorm`` (norms.py, norm_type "rmsnorm"): in fp32, then cast back, then the weight."""

    def __init__(self, dim: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim, dtype=BF16))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + 1e-5)).type_as(x) * self.weight


class _EagerLlamaBlock(nn.Module):
    """One layer as torchtitan's eager Llama runs it (models/llama/model.py): pre-norm attention with rotary
    embeddings as complex products on fp32 copies, ``repeat_kv`` by expand + reshape, flash-style attention,
    SwiGLU as ``silu`` then ``*``. Our code, op for op the same sequence."""

    def __init__(self, h: int, heads: int, kv: int, f: int) -> None:
        super().__init__()
        self.heads, self.kv, self.d = heads, kv, h // heads

        def lin(i: int, o: int) -> nn.Linear:
            return nn.Linear(i, o, bias=False, dtype=BF16)

        self.wq, self.wk, self.wv, self.wo = lin(h, h), lin(h, kv * self.d), lin(h, kv * self.d), lin(h, h)
        self.w1, self.w2, self.w3 = lin(h, f), lin(f, h), lin(h, f)
        self.attention_norm, self.ffn_norm = _RMSNorm(h), _RMSNorm(h)

    def _rotary(self, x: torch.Tensor, freqs: torch.Tensor) -> torch.Tensor:
        z = torch.view_as_complex(x.float().reshape(*x.shape[:-1], -1, 2))
        return torch.view_as_real(z * freqs.view(1, x.shape[1], 1, -1)).flatten(3).type_as(x)

    def _repeat_kv(self, x: torch.Tensor) -> torch.Tensor:
        b, s, kv, d = x.shape
        n = self.heads // kv
        return x if n == 1 else x[:, :, :, None, :].expand(b, s, kv, n, d).reshape(b, s, kv * n, d)

    def forward(self, x: torch.Tensor, freqs: torch.Tensor) -> torch.Tensor:
        b, s, h = x.shape
        y = self.attention_norm(x)
        q = self._rotary(self.wq(y).view(b, s, self.heads, self.d), freqs)
        k = self._rotary(self.wk(y).view(b, s, self.kv, self.d), freqs)
        v = self.wv(y).view(b, s, self.kv, self.d)
        k, v = self._repeat_kv(k), self._repeat_kv(v)
        o = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True)
        h_ = x + self.wo(o.transpose(1, 2).reshape(b, s, h))  # the kernel's output is token-major: no copy
        y = self.ffn_norm(h_)
        return h_ + self.w2(F.silu(self.w1(y)) * self.w3(y))


def _traffic(block: _EagerLlamaBlock, batch: int, s: int) -> tuple[int, int]:
    block.zero_grad(set_to_none=True)  # a gradient accumulated into an existing .grad would add a pass
    torch.manual_seed(0)
    freqs = torch.polar(torch.ones(s, block.d // 2), torch.randn(s, block.d // 2))
    x = torch.randn(batch, s, block.wq.in_features, dtype=BF16, requires_grad=True)
    with ElementwiseTraffic() as fwd:
        out = block(x, freqs)
    grad = torch.randn_like(out)
    with ElementwiseTraffic() as bwd:
        out.backward(grad)
    return fwd.total, bwd.total


@pytest.mark.parametrize(("h", "heads", "kv", "f"), [(256, 4, 2, 512), (256, 4, 4, 512), (384, 6, 2, 640),
                                                     (512, 8, 2, 1024)])
def test_torchtitan_count_equals_the_eager_block_op_by_op(h: int, heads: int, kv: int, f: int):
    """Per token (the difference of two batch sizes: the weights and the rotary table are read once a call,
    whatever the batch), forward and backward, exactly."""
    torch.manual_seed(0)
    block = _EagerLlamaBlock(h, heads, kv, f)
    (f2, b2), (f4, b4) = _traffic(block, 2, 64), _traffic(block, 4, 64)
    per_token = ((f4 - f2) / 128, (b4 - b2) / 128)
    spec = ModelSpec(2, h, heads, 1000, 64, n_kv_head=kv, ffn_hidden=f, arch="llama", dropout=False,
                     kernels="torchtitan")
    assert per_token == torchtitan_layer_bytes(spec, Layout(precision="bf16"))


def test_torchtitan_kernels_in_the_time_model():
    llama = replace(model_presets()["llama3-8b"], loss="torchtitan")
    eager = replace(llama, kernels="torchtitan")
    half = Layout(dp=8, zero=3, flash_attention=True, recompute="op", precision="bf16")
    fused_fwd = elementwise_bytes(llama, half)[0]
    fwd, bwd = torchtitan_layer_bytes(eager, half)
    assert 3.3 < (fwd + bwd) / (3 * fused_fwd) < 3.5  # Llama 3 8B: 3.4 times the fused count
    a, b = (microbatch_times(m, half, H200_CALIBRATION, 32, True) for m in (llama, eager))
    tokens = llama.micro_batch * llama.seq_len
    # forward + backward + the op-level replay of the forward, per layer
    assert b.elementwise - a.elementwise == pytest.approx(
        32 * tokens * (2 * fwd + bwd - 4 * fused_fwd) / H200_CALIBRATION.hbm_Bps)
    assert (a.gemm, a.attention) == (b.gemm, b.attention)
    with pytest.raises(ValueError, match="arch='llama'"):
        ModelSpec(2, 64, 4, 100, 16, kernels="torchtitan")
    with pytest.raises(ValueError, match="kernels"):
        ModelSpec(2, 64, 4, 100, 16, kernels="compiled")
    with pytest.raises(ValueError, match="masters"):
        microbatch_times(eager, replace(half, mixed="autocast", precision="fp32"), H200_CALIBRATION, 32, True)
