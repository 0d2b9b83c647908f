"""lslm.tensor_parallel.random: the RNG tracker, the model-parallel seeds, and dropout masks across real ranks.

What a fork guarantees (Megatron's tracker does the same): the default generator leaves
the block in exactly the state it entered it, so every later default draw is the one it
would have been without the block; the named stream continues where its previous fork
stopped. In-process tests check the tracker on this process's generators (CPU, and
CUDA where present); one launch per world size (2 ranks tp=2; 4 ranks tp=2 x dp=2)
checks which masks agree across ranks.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Iterator
from types import SimpleNamespace
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from lslm.runtime import ParallelContext, RankGrid
from lslm.tensor_parallel.random import (
    DEFAULT_RNG,
    TENSOR_PARALLEL_RNG,
    RNGStatesTracker,
    fork_rng_in_forward,
    model_parallel_seed,
    stream_seeds,
)
from tests.helpers import fake_world, nproc_backends, run_workers, visible_gpus

SEED = 1234
DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(visible_gpus() < 1, reason="no CUDA device"))]


@pytest.fixture(autouse=True)
def _keep_global_rng() -> Iterator[None]:
    """These tests re-seed the process's generators: give the next test file the state it had."""
    with torch.random.fork_rng(devices=[]):
        yield


def _gen_state(device: torch.device) -> torch.Tensor:
    return torch.cuda.get_rng_state(device) if device.type == "cuda" else torch.get_rng_state()


def _tracker(device: str, seed: int = SEED) -> RNGStatesTracker:
    tracker = RNGStatesTracker(device)
    tracker.add(TENSOR_PARALLEL_RNG, seed)
    return tracker


def _bits(t: torch.Tensor) -> str:
    return "".join("1" if v else "0" for v in t.ne(0).tolist())


def _draw(device: torch.device | str, generator: torch.Generator | None = None) -> torch.Tensor:
    return torch.rand(8, device=device, generator=generator)


# -- the tracker, in this process ------------------------------------------------------------
@pytest.mark.parametrize("device", DEVICES)
def test_fork_leaves_the_default_stream_exactly_where_it_was(device: str) -> None:
    tracker = _tracker(device)
    dev = tracker.device
    torch.manual_seed(7)
    before = _gen_state(dev).clone()
    with tracker.fork():
        _draw(dev)
    assert torch.equal(_gen_state(dev), before)
    with_fork = _draw(dev)
    torch.manual_seed(7)
    assert torch.equal(_draw(dev), with_fork)  # the next default draw is the one it would have been


@pytest.mark.parametrize("device", DEVICES)
def test_the_named_stream_continues_across_forks_and_survives_exceptions(device: str) -> None:
    tracker = _tracker(device)
    dev = tracker.device
    ref = torch.Generator(device=dev).manual_seed(SEED)  # one uninterrupted stream from the same seed
    torch.manual_seed(7)
    before = _gen_state(dev).clone()
    with tracker.fork(TENSOR_PARALLEL_RNG):
        first = _draw(dev)
    with pytest.raises(KeyError), tracker.fork():
        second = _draw(dev)
        raise KeyError("in the block")
    assert torch.equal(_gen_state(dev), before)  # restored on the exception path too
    with tracker.fork():
        third = _draw(dev)
    for got in (first, second, third):
        assert torch.equal(got, _draw(dev, ref))


def test_nested_forks_and_fork_of_the_default_stream() -> None:
    tracker = _tracker("cpu")
    torch.manual_seed(7)
    with tracker.fork():
        tp_a = _draw("cpu")
        with tracker.fork(DEFAULT_RNG):  # back on the default stream, where it stopped
            d1 = _draw("cpu")
            with tracker.fork():  # the tp stream continues inside
                tp_b = _draw("cpu")
        tp_c = _draw("cpu")
    d2 = _draw("cpu")
    ref_tp = torch.Generator().manual_seed(SEED)
    assert [torch.equal(t, _draw("cpu", ref_tp)) for t in (tp_a, tp_b, tp_c)] == [True] * 3
    torch.manual_seed(7)
    assert torch.equal(d1, _draw("cpu")) and torch.equal(d2, _draw("cpu"))
    torch.manual_seed(7)
    with tracker.fork(DEFAULT_RNG):  # at top level: the default stream, as without a fork
        d3 = _draw("cpu")
    d4 = _draw("cpu")
    torch.manual_seed(7)
    assert torch.equal(d3, _draw("cpu")) and torch.equal(d4, _draw("cpu"))


def test_forks_exited_out_of_order_are_an_error() -> None:
    tracker = _tracker("cpu")
    tracker.add("other", SEED + 1)
    outer, inner = tracker.fork(), tracker.fork("other")
    outer.__enter__()
    inner.__enter__()
    with pytest.raises(RuntimeError, match="out of order"):
        outer.__exit__(None, None, None)


def test_duplicate_names_and_seeds_and_bad_names_are_rejected() -> None:
    tracker = _tracker("cpu")
    with pytest.raises(ValueError, match="'tensor-parallel' already exists"):
        tracker.add(TENSOR_PARALLEL_RNG, SEED + 1)
    with pytest.raises(ValueError, match=f"seed {SEED} is already used by stream 'tensor-parallel'"):
        tracker.add("other", SEED)
    for bad_name in (DEFAULT_RNG, "", 3):
        with pytest.raises(ValueError, match="stream name"):
            tracker.add(bad_name, 99)  # type: ignore[arg-type]
    for bad_seed in (-1, 1.5, True, "7"):
        with pytest.raises(ValueError, match="seed must be an int"):
            tracker.add("other", bad_seed)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"seed 5 is already used by stream 'default'"):
        RNGStatesTracker("cpu", default_seed=5).add("x", 5)
    assert tracker.names == [TENSOR_PARALLEL_RNG]
    tracker.reset()
    assert tracker.names == []
    tracker.add(TENSOR_PARALLEL_RNG, SEED)  # name and seed free again


def test_fork_of_an_unknown_stream_names_the_known_ones() -> None:
    tracker = _tracker("cpu")
    with pytest.raises(ValueError, match=r"unknown RNG stream 'dropout'; known: \['default', 'tensor-parallel'\]"):
        with tracker.fork("dropout"):
            pass
    with pytest.raises(ValueError, match="unknown RNG stream 'dropout'"):
        fork_rng_in_forward(nn.Identity(), tracker, "dropout")


def test_get_states_set_states_round_trip() -> None:
    tracker = _tracker("cpu")
    tracker.add("other", SEED + 1)
    with tracker.fork():
        _draw("cpu")
    saved = tracker.get_states()
    assert sorted(saved) == ["other", TENSOR_PARALLEL_RNG]
    with tracker.fork():
        saved_inside = tracker.get_states()  # inside a fork: the live stream's state as of now
        a = _draw("cpu")
    with tracker.fork("other"):
        o = _draw("cpu")
    restored = _tracker("cpu", seed=99)  # another tracker (a resumed run) takes the checkpoint
    restored.set_states(saved)
    with restored.fork():
        assert torch.equal(_draw("cpu"), a)
    with restored.fork("other"):
        assert torch.equal(_draw("cpu"), o)
    restored.set_states(saved_inside)
    with restored.fork():
        assert torch.equal(_draw("cpu"), a)
    with pytest.raises(ValueError, match="not a cpu generator state"):
        restored.set_states({"x": torch.zeros(16, dtype=torch.uint8)})  # a CUDA-sized state
    with pytest.raises(ValueError, match="bad stream name 'default'"):
        restored.set_states({DEFAULT_RNG: saved[TENSOR_PARALLEL_RNG]})
    with restored.fork(), pytest.raises(RuntimeError, match="outside any fork"):
        restored.set_states(saved)


class _Attention(nn.Module):
    def __init__(self, fail: bool = False) -> None:
        super().__init__()
        self.fail = fail
        self.resid_dropout = nn.Dropout(0.5)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        core = F.dropout(x, p=0.5)
        if self.fail:
            raise ArithmeticError("forward failed")
        return core, self.resid_dropout(x)


def test_fork_rng_in_forward_moves_a_modules_dropout_to_the_stream_and_leaves_the_default_alone() -> None:
    x = torch.ones(64)
    tracker = _tracker("cpu")
    block = nn.Sequential(nn.Linear(64, 64), nn.Dropout(0.5))
    fork_rng_in_forward(block, tracker)
    torch.manual_seed(7)
    before = torch.get_rng_state()
    out = block(x)
    assert torch.equal(torch.get_rng_state(), before)  # the default stream did not move
    ref = _tracker("cpu")
    with ref.fork():
        assert torch.equal(out.ne(0), F.dropout(torch.ones(64), p=0.5).ne(0))  # the tp stream's mask


def test_fork_rng_in_forward_puts_the_forward_on_the_stream_and_restores_the_default() -> None:
    x = torch.ones(64)
    tracker = _tracker("cpu")
    attn = _Attention()
    handles = [*fork_rng_in_forward(attn, tracker), *fork_rng_in_forward(attn.resid_dropout, tracker, DEFAULT_RNG)]
    torch.manual_seed(7)
    core, resid = attn(x)
    after = _draw("cpu")
    # Reference without hooks: the same draws, made explicitly on each stream.
    ref = _tracker("cpu")
    torch.manual_seed(7)
    with ref.fork():
        assert torch.equal(core, F.dropout(x, p=0.5))
    assert torch.equal(resid, F.dropout(x, p=0.5))  # the residual dropout took the default stream's draw
    assert torch.equal(after, _draw("cpu"))
    for h in handles:
        h.remove()
    torch.manual_seed(7)
    core = attn(x)[0]  # hooks removed: back on the default stream
    torch.manual_seed(7)
    assert torch.equal(core, F.dropout(x, p=0.5))


def test_fork_rng_in_forward_restores_the_default_stream_when_forward_raises() -> None:
    tracker = _tracker("cpu")
    attn = _Attention(fail=True)
    fork_rng_in_forward(attn, tracker)
    torch.manual_seed(7)
    before = torch.get_rng_state()
    with pytest.raises(ArithmeticError):
        attn(torch.ones(8))
    assert torch.equal(torch.get_rng_state(), before)
    with tracker.fork():  # the failed call's draw advanced the stream all the same
        second = _draw("cpu")
    ref = _tracker("cpu")
    with ref.fork():
        F.dropout(torch.ones(8), p=0.5)
    with ref.fork():
        assert torch.equal(second, _draw("cpu"))


# -- the model-parallel seeds --------------------------------------------------------------
def test_stream_seeds_are_megatrons_offsets() -> None:
    assert stream_seeds(10, tp_rank=0, pp_rank=0) == {DEFAULT_RNG: 10, TENSOR_PARALLEL_RNG: 2728}
    assert stream_seeds(10, tp_rank=3, pp_rank=2) == {DEFAULT_RNG: 210, TENSOR_PARALLEL_RNG: 2931}


def test_model_parallel_seed_on_every_rank_of_a_fake_tp2_pp2_dp2_grid() -> None:
    seen: dict[tuple[int, int], tuple[str, str]] = {}
    grid = RankGrid.build(8, tp=2, pp=2, dp=2)
    for rank in range(8):
        with fake_world(rank, 8):
            ctx = ParallelContext.create(grid, rank=rank, local_rank=rank, node_rank=0, device=torch.device("cpu"),
                                         backend="fake", timeout_s=5)
            tracker = model_parallel_seed(ctx, SEED)
            assert ctx.rng is tracker
            masks = (_bits(F.dropout(torch.ones(64), 0.5)), "")
            with tracker.fork():
                masks = (masks[0], _bits(F.dropout(torch.ones(64), 0.5)))
        key = (ctx.pp_rank, ctx.tp_rank)
        assert seen.setdefault(key, masks) == masks  # dp replicas of one (stage, tp rank) agree
    for pp in range(2):
        assert seen[pp, 0][0] == seen[pp, 1][0]  # default: one mask per stage, whatever the tp rank
        assert seen[pp, 0][1] != seen[pp, 1][1]  # tensor parallel: one mask per tp rank
    assert seen[0, 0][0] != seen[1, 0][0] and seen[0, 0][1] != seen[1, 0][1]  # stages differ


def test_model_parallel_seed_without_reseeding_keeps_the_default_generator() -> None:
    ctx = SimpleNamespace(tp_rank=1, pp_rank=1, device=torch.device("cpu"), rng=None)
    torch.manual_seed(3)
    before = torch.get_rng_state()
    tracker = model_parallel_seed(ctx, SEED, reseed_default=False)
    assert torch.equal(torch.get_rng_state(), before)
    assert ctx.rng is tracker and tracker.names == [TENSOR_PARALLEL_RNG]
    seeded = model_parallel_seed(SimpleNamespace(**{**vars(ctx), "rng": None}), SEED)  # the same tp stream
    assert torch.equal(tracker.get_states()[TENSOR_PARALLEL_RNG], seeded.get_states()[TENSOR_PARALLEL_RNG])


def test_model_parallel_seed_rejects_a_bad_seed() -> None:
    ctx = SimpleNamespace(tp_rank=0, pp_rank=0, device=torch.device("cpu"), rng=None)
    with pytest.raises(ValueError, match="seed must be an int >= 0"):
        model_parallel_seed(ctx, -3)
    assert ctx.rng is None


# -- real ranks ------------------------------------------------------------------------------
@functools.cache
def _suite(nproc: int, backend: str) -> tuple[dict[str, Any], ...]:
    return tuple(run_workers("tests.tp_random_workers:suite", nproc, backend=backend, tp=2, dp=nproc // 2,
                             seed=SEED))


@pytest.mark.parametrize(("nproc", "backend"), nproc_backends(2, 4))
def test_dropout_masks_across_tp_and_dp_ranks(nproc: int, backend: str) -> None:
    res = _suite(nproc, backend)
    assert [r["rank"] for r in res] == list(range(nproc))
    assert len({r["default"] for r in res}) == 1  # replicated regions: one mask on every rank
    by_tp = {t: {r["tp"] for r in res if r["tp_rank"] == t} for t in (0, 1)}
    assert [len(s) for s in by_tp.values()] == [1, 1]  # dp replicas of a tp rank agree
    assert by_tp[0] != by_tp[1]  # sharded regions: each tp rank its own mask
    for r in res:
        assert r["default_next"] != r["default"]
        assert r["repeat"] == {"default": r["default"], "tp": r["tp"]}  # same seed, same masks
        # Hooked module: attention dropout on the tp stream, residual dropout on the default one.
        assert r["hooked"] == {"core": r["tp"], "resid": r["default"], "after": r["default_next"]}


def test_masks_depend_only_on_seed_and_tp_rank_not_on_world_size() -> None:
    two, four = _suite(2, "gloo"), _suite(4, "gloo")
    for r in four:
        assert (r["default"], r["tp"]) == (two[r["tp_rank"]]["default"], two[r["tp_rank"]]["tp"])


def test_tracker_never_touches_cuda_on_cpu(monkeypatch: pytest.MonkeyPatch) -> None:
    def boom(*_a: Any, **_k: Any) -> None:
        raise AssertionError("torch.cuda called on a CPU path")

    monkeypatch.setattr(torch.cuda, "get_rng_state", boom)
    monkeypatch.setattr(torch.cuda, "set_rng_state", boom)
    tracker = _tracker("cpu")
    with tracker.fork(), contextlib.suppress(ZeroDivisionError):
        _draw("cpu")
        raise ZeroDivisionError
    tracker.set_states(tracker.get_states())
