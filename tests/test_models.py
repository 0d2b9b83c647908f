"""The small GPT, the Hugging Face builders, and the serial baseline training run."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch

from lslm.harness import parse_config
from lslm.models import GPT, GPTConfig, build_hf_gpt2, build_hf_llama
from lslm.recipes.train import TrainConfig, main, serial_device, train

pytestmark = pytest.mark.usefixtures("lslm_cache")  # conftest.py: a per-session cache, never ~/.cache


def _tiny(seed: int = 0, **overrides) -> GPT:
    torch.manual_seed(seed)
    return GPT(GPTConfig.tiny(**overrides))


# --- our GPT ----------------------------------------------------------------------------


def test_forward_shapes_and_initial_loss() -> None:
    model = _tiny()
    cfg = model.config
    idx = torch.randint(0, cfg.vocab_size, (3, cfg.block_size), generator=torch.Generator().manual_seed(1))
    logits, loss = model(idx)
    assert logits.shape == (3, cfg.block_size, cfg.vocab_size) and loss is None
    logits, loss = model(idx[:, :10], idx[:, 1:11])
    assert logits.shape == (3, 10, cfg.vocab_size)
    # Small init gives near-uniform predictions: loss close to ln(V).
    assert abs(loss.item() - math.log(cfg.vocab_size)) < 0.05


def test_backward_reaches_every_parameter() -> None:
    model = _tiny()
    idx = torch.randint(0, 1024, (2, 16))
    _, loss = model(idx, idx)
    loss.backward()
    for name, p in model.named_parameters():
        assert p.grad is not None, name
        assert torch.isfinite(p.grad).all(), name
        assert p.grad.abs().sum() > 0, name


def test_causal() -> None:
    model = _tiny().eval()
    idx = torch.randint(0, 1024, (1, 20), generator=torch.Generator().manual_seed(2))
    changed = idx.clone()
    changed[0, 12] = (changed[0, 12] + 1) % 1024
    a, _ = model(idx)
    b, _ = model(changed)
    assert torch.equal(a[:, :12], b[:, :12])  # the past cannot see the future
    assert not torch.allclose(a[:, 12:], b[:, 12:])


def test_sequence_first_runs_the_same_model_and_returns_batch_first_logits_without_a_copy() -> None:
    model = _tiny()
    idx = torch.randint(0, 1024, (3, 16), generator=torch.Generator().manual_seed(1))
    want, loss = model(idx, idx)
    loss.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad()
    model.sequence_first = True
    assert all(block.attn.sequence_first for block in model.blocks)
    got, loss = model(idx, idx)
    loss.backward()
    assert got.shape == want.shape and got.transpose(0, 1).is_contiguous()  # a view of the (T, B, V) logits
    # fp32: the same per-row arithmetic; weight gradients sum their rows in another order (largest seen 4.5e-8).
    torch.testing.assert_close(got, want, rtol=0, atol=1e-6)
    for n, p in model.named_parameters():
        torch.testing.assert_close(p.grad, grads[n], rtol=0, atol=1e-6, msg=n)
    model.sequence_first = False
    assert not any(block.attn.sequence_first for block in model.blocks)


def test_deterministic_init_and_names() -> None:
    a, b = _tiny(seed=7), _tiny(seed=7)
    assert all(torch.equal(p, q) for p, q in zip(a.parameters(), b.parameters(), strict=True))
    names = dict(a.named_parameters())
    for name in ("wte.weight", "wpe.weight", "blocks.0.attn.c_attn.weight", "blocks.0.attn.c_proj.weight",
                 "blocks.1.mlp.c_fc.weight", "blocks.1.mlp.c_proj.bias", "ln_f.weight", "lm_head.weight"):
        assert name in names
    assert names["blocks.0.attn.c_attn.weight"].shape == (3 * 64, 64)
    assert names["blocks.0.mlp.c_fc.weight"].shape == (4 * 64, 64)
    # Residual projections start smaller (GPT-2's 1/sqrt(2 n_layer) scaling).
    assert names["blocks.0.attn.c_proj.weight"].std() < names["blocks.0.attn.c_attn.weight"].std()


def test_tie_weights_and_parameter_count() -> None:
    untied, tied = _tiny(), _tiny(tie_weights=True)
    assert untied.lm_head.weight is not untied.wte.weight
    assert tied.lm_head.weight is tied.wte.weight
    assert untied.num_parameters() - tied.num_parameters() == 1024 * 64
    assert untied.num_parameters() == 235_264
    assert untied.num_parameters(non_embedding=True) == 235_264 - 1024 * 64 - 64 * 64


@pytest.mark.parametrize(
    "overrides",
    [dict(n_embd=65), dict(n_head=0), dict(n_layer=0), dict(vocab_size=-1), dict(block_size=0),
     dict(dropout=1.0), dict(dropout=-0.1), dict(n_embd=64.0), dict(n_kv_head=3), dict(n_kv_head=0),
     dict(n_kv_head=True), dict(n_kv_head=8)],
)
def test_config_validation(overrides: dict) -> None:
    with pytest.raises(ValueError):
        GPTConfig.tiny(**overrides)


def test_grouped_query_attention_is_multi_head_attention_on_repeated_kv_heads() -> None:
    """n_kv_head = 2 of 4 heads: the same logits and gradients as the multi-head GPT whose c_attn rows repeat each
    key/value head for its 2 query heads; n_kv_head = n_head is the default model, names, shapes and values."""
    torch.manual_seed(0)
    gqa = GPT(GPTConfig.tiny(n_kv_head=2))
    mha = _tiny(seed=0)
    assert [(n, p.shape) for n, p in _tiny(seed=0, n_kv_head=4).named_parameters()] == [
        (n, p.shape) for n, p in mha.named_parameters()]
    assert all(torch.equal(p, q) for p, q in zip(_tiny(seed=0, n_kv_head=4).parameters(), mha.parameters()))
    assert gqa.blocks[0].attn.c_attn.weight.shape == (64 + 2 * 2 * 16, 64)
    with torch.no_grad():
        for name, p in gqa.named_parameters():
            if "c_attn" in name:  # [q | k | v], k and v 2 heads of 16 rows: repeat each head's rows twice
                q, k, v = p.split([64, 32, 32])
                rep = [t.unflatten(0, (2, 16)).repeat_interleave(2, 0).flatten(0, 1) for t in (k, v)]
                mha.get_parameter(name).copy_(torch.cat([q, *rep]))
            else:
                mha.get_parameter(name).copy_(p)
    idx = torch.randint(0, 1024, (2, 64), generator=torch.Generator().manual_seed(1))
    (lg, loss_g), (lm, loss_m) = gqa(idx, idx), mha(idx, idx)
    torch.testing.assert_close(lg, lm, rtol=0, atol=1e-5)
    loss_g.backward()
    loss_m.backward()
    w = mha.blocks[1].attn.c_attn.weight.grad
    k_sum = w[64:].unflatten(0, (2, 2, 2, 16)).sum(2).flatten(0, 2)  # the repeated heads' gradients, summed
    torch.testing.assert_close(gqa.blocks[1].attn.c_attn.weight.grad, torch.cat([w[:64], k_sum]), rtol=0, atol=1e-6)
    from lslm.tensor_parallel.apply import gpt_plan

    with pytest.raises(ValueError, match="grouped-query"):  # tensor parallelism shards c_attn as multi-head
        gpt_plan(gqa)


def test_sequence_too_long() -> None:
    with pytest.raises(ValueError, match="block_size"):
        _tiny()(torch.zeros(1, 65, dtype=torch.long))


def test_a_head_with_a_slice_of_the_vocabulary_is_refused_before_the_loss() -> None:
    # A vocabulary-sharded head (what apply_tensor_parallel builds) gives V/t logits; target ids
    # past them must raise a ValueError from the shapes, not reach cross_entropy (a CUDA device assert).
    model = _tiny()
    model.lm_head = torch.nn.Linear(64, 512, bias=False)
    x = torch.randint(0, 1024, (2, 8))
    with pytest.raises(ValueError, match=r"512 logits per position but the vocabulary has 1024.*vocab_parallel_cr"):
        model(x, x)
    logits, loss = model(x)  # without targets the model still gives its (sharded) logits
    assert logits.shape == (2, 8, 512) and loss is None


# --- Hugging Face builders --------------------------------------------------------------


def _check_fresh_causal_lm(model: torch.nn.Module, vocab_size: int) -> None:
    """A randomly initialised LM: logits of the right shape, loss near ln(V), a gradient on every parameter."""
    x = torch.randint(0, vocab_size, (2, 16))
    out = model(input_ids=x, labels=x)
    assert out.logits.shape == (2, 16, vocab_size)
    assert abs(out.loss.item() - math.log(vocab_size)) < 0.1
    out.loss.backward()
    assert all(p.grad is not None for p in model.parameters())


def test_hf_gpt2() -> None:
    model = build_hf_gpt2(vocab_size=1024, n_positions=64, n_layer=2, n_head=4, n_embd=64, seed=0)
    again = build_hf_gpt2(vocab_size=1024, n_positions=64, n_layer=2, n_head=4, n_embd=64, seed=0)
    assert all(torch.equal(p, q) for p, q in zip(model.parameters(), again.parameters(), strict=True))
    # Same architecture as our GPT, so the same number of parameters.
    assert sum(p.numel() for p in model.parameters()) == _tiny().num_parameters()
    _check_fresh_causal_lm(model, vocab_size=1024)


def test_hf_llama() -> None:
    torch.manual_seed(123)
    before = torch.rand(1)
    torch.manual_seed(123)
    model = build_hf_llama(1024, 64, 2, 4, 64, 176, num_key_value_heads=2, seed=0)
    assert torch.equal(torch.rand(1), before)  # the caller's RNG stream is untouched
    assert model.config.num_key_value_heads == 2
    _check_fresh_causal_lm(model, vocab_size=1024)


def test_hf_bad_arguments() -> None:
    with pytest.raises(ValueError, match="divisible"):
        build_hf_gpt2(1024, 64, 2, 3, 64)
    with pytest.raises(ValueError, match="num_key_value_heads"):
        build_hf_llama(1024, 64, 2, 4, 64, 176, num_key_value_heads=3)
    with pytest.raises(ValueError, match="attn_implementation"):
        build_hf_gpt2(1024, 64, 2, 4, 64, attn_implementation="flash")


# --- serial baseline --------------------------------------------------------------------


def test_training_lowers_loss_and_is_deterministic(tmp_path: Path) -> None:
    # On the CPU (bitwise reproducibility is the CPU's promise; CUDA kernels may sum in varying order).
    cfg = TrainConfig(steps=20, out=str(tmp_path / "run.json"), device="cpu")
    first = train(cfg)
    losses = first["losses"]
    assert len(losses) == len(first["step_times_s"]) == 20
    assert abs(losses[0] - math.log(1024)) < 0.05
    assert sum(losses[-3:]) / 3 < losses[0] - 0.7
    assert first["tokens_per_step"] == 8 * 64 and first["num_parameters"] == 235_264
    assert json.loads((tmp_path / "run.json").read_text())["losses"] == losses
    second = train(TrainConfig(steps=20, device="cpu"))
    assert second["losses"] == losses  # bitwise: same seed, same data, same losses


def test_train_cli(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "runs" / "cli.json"
    result = main(["--steps", "3", "--n-layer", "1", "--batch-size", "4", "--out", str(out)])
    assert len(result["losses"]) == 3 and out.is_file()
    assert result["config"]["n_layer"] == 1
    assert "loss" in capsys.readouterr().out


def test_train_config_validation() -> None:
    with pytest.raises(ValueError, match="steps"):
        TrainConfig(steps=0)
    with pytest.raises(ValueError, match="n_head"):
        TrainConfig(n_embd=30, n_head=4)
    with pytest.raises(SystemExit):
        main(["--lr", "-1"])


@pytest.mark.parametrize("gpus", [0, 1, 2])
def test_train_device_auto_picks_cuda_0_when_there_is_a_gpu(monkeypatch: pytest.MonkeyPatch, gpus: int) -> None:
    # The one-process rule of init_distributed: cuda:0 with any GPU, else the CPU; LSLM_DEVICE and --device override.
    monkeypatch.setattr(torch.cuda, "is_available", lambda: gpus > 0)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: gpus)
    monkeypatch.delenv("LSLM_DEVICE", raising=False)
    monkeypatch.setenv("LSLM_BACKEND", "nccl")  # meant for launched ranks: ignored by a one-process run
    assert TrainConfig().device == "auto"
    assert serial_device(TrainConfig().device) == (torch.device("cuda", 0) if gpus else torch.device("cpu"))
    cfg, _ = parse_config(TrainConfig, ["--device", "cpu"])
    assert serial_device(cfg.device) == torch.device("cpu")
    monkeypatch.setenv("LSLM_DEVICE", "cpu")
    assert serial_device("auto") == torch.device("cpu")
    if gpus:
        assert serial_device("cuda") == torch.device("cuda", 0)
        with pytest.raises(ValueError, match="does not exist"):
            serial_device(f"cuda:{gpus}")
    else:
        with pytest.raises(ValueError, match="no CUDA device is available"):
            serial_device("cuda")


def test_train_cli_device_cpu_overrides_a_gpu(monkeypatch: pytest.MonkeyPatch) -> None:
    # A (pretended) GPU machine: --device cpu still trains on the CPU, and the CLI says where it ran.
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.delenv("LSLM_DEVICE", raising=False)
    result = main(["--device", "cpu", "--steps", "1", "--n-layer", "1", "--batch-size", "2"])
    assert result["device"] == "cpu"
