"""ZeRO-3 frees a unit for real after its forward (lslm.zero.gather), and offloaded gradients land before the host
reads them (lslm.zero.offload).

Autograd saves views of a gathered unit's buffer (``nn.Linear``'s ``addmm`` saves ``weight.t()``), so dropping the
parameters' references frees nothing; the buffer's storage must shrink. The first test counts, exactly, the bytes
of the storages autograd holds after the forward, in one process on torch's fake process group (sharding and
storages are real; values are not, which the bytes do not depend on). The same frees measured by glibc's allocator at
2 and 4 gloo ranks, where nothing is registered or traced, are tests/test_zero_memory.py's.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from lslm.demos.zero_demo import MODEL, zero3_memory_timeline
from lslm.models.gpt import GPT, GPTConfig
from lslm.runtime.context import ParallelContext
from lslm.runtime.grid import RankGrid
from lslm.zero import ZeroOptimizer
from lslm.zero.offload import HostCopies
from tests.helpers import fake_world, forbid_cuda_from_lslm


def _ctx(world: int, rank: int) -> ParallelContext:
    return ParallelContext.create(RankGrid.build(world, dp=world), rank=rank, local_rank=rank, node_rank=0,
                                  device=torch.device("cpu"), backend="fake", timeout_s=5)


def _forward_saved(reshard: bool) -> tuple[dict[int, Any], ZeroOptimizer, torch.Tensor]:
    """The course GPT (4 blocks) at stage 3 on rank 0 of 2: every storage autograd saved in one forward."""
    torch.manual_seed(0)
    model = GPT(GPTConfig(**MODEL))
    zero = ZeroOptimizer(model, torch.optim.AdamW(model.parameters()), _ctx(2, 0), stage=3,
                         reshard_after_forward=reshard)
    saved: dict[int, Any] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        storage = t.untyped_storage()
        saved[storage._cdata] = storage  # the storage object itself, stable across a resize
        return t

    x = torch.randint(0, MODEL["vocab_size"], (2, 16))
    zero.zero_grad()
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        _, loss = model(x, x)
    return saved, zero, loss


def test_after_the_forward_no_saved_tensor_holds_a_released_unit() -> None:
    with fake_world(0, 2):
        held, unit_bytes = {}, 0
        for reshard in (True, False):
            saved, zero, loss = _forward_saved(reshard)
            root = len(zero.buckets) - 1
            units = {b: t.untyped_storage() for b, t in zero.gather.buffers.items() if b != root}
            assert len(units) == MODEL["n_layer"] >= 4
            # autograd saved views of every unit's buffer: what kept the whole storage alive before
            assert all(st._cdata in saved for st in units.values())
            if reshard:  # released after its forward: the storage those views share is empty
                assert [st.nbytes() for st in units.values()] == [0] * len(units)
            unit_bytes = sum(4 * (z - a) for b, (a, z, _, _) in enumerate(zero.buckets) if b != root)
            held[reshard] = sum(st.nbytes() for st in saved.values())
            zero.backward(loss)  # the backward re-grows each unit's storage before its re-gather, and runs
            zero.step()
            assert zero.gather.storage_bytes() == 0  # and between steps nothing is left gathered
    # The same activations either way: freeing takes away exactly every unit's whole buffer, padding included.
    assert held[False] - held[True] == unit_bytes > 0


def test_prefetch_sets_how_many_units_are_whole_at_once() -> None:
    """The root, the unit computing and ``prefetch`` units gathered ahead of it (0: none), counted by the gathers'
    own bookkeeping over one step of a small GPT of 4 blocks."""
    with fake_world(0, 2):
        for prefetch, whole in ((0, 2), (1, 3), (2, 4)):
            torch.manual_seed(0)
            model = GPT(GPTConfig.tiny(n_layer=4, vocab_size=64, block_size=8, n_embd=16))
            zero = ZeroOptimizer(model, torch.optim.AdamW(model.parameters()), _ctx(2, 0), stage=3,
                                 prefetch=prefetch)
            x = torch.randint(0, 64, (2, 8))
            zero.zero_grad()
            zero.backward(model(x, x)[1])
            zero.step()
            assert zero.gather.max_buckets_gathered == whole, (prefetch, zero.gather.max_buckets_gathered)
            assert zero.gather.storage_bytes() == 0


def test_the_memory_profiler_sees_the_freed_units() -> None:
    """PyTorch's memory profiler, one stage-3 step of notebook 08's GPT (lslm.demos.zero_demo.zero3_memory_timeline):
    the step peaks at the loss (every activation alive, the logits' gradient made, no block gathered again yet), where
    kept gathered holds every block's bucket and stage 3 none, so their parameter bytes differ by exactly the blocks'
    buckets; and the timeline carries lslm's collectives: the root's gather, each block's two, five reduce-scatters."""
    freed, kept = zero3_memory_timeline(), zero3_memory_timeline(reshard_after_forward=False)
    blocks = GPT(GPTConfig(**MODEL)).blocks
    assert len(blocks) == 4 and all(sum(p.numel() for p in b.parameters()) % 2 == 0 for b in blocks)  # no padding
    assert kept.peak()["parameter"] - freed.peak()["parameter"] == sum(4 * p.numel() for p in blocks.parameters())
    for tl in (freed, kept):
        ops = [name.split()[0].rsplit(":", 1)[-1] for name, _, _ in tl.ranges]
        assert (ops.count("all_gather"), ops.count("reduce_scatter")) == (9, 5) if tl is freed else (5, 5), ops


def test_offloaded_gradients_land_before_the_host_steps(monkeypatch: pytest.MonkeyPatch) -> None:
    """The order by construction: every copy into the host buffers is issued, then waited for, then the host steps;
    on the CPU path no torch.cuda function is called (the copies are synchronous, the wait has nothing to do)."""
    forbid_cuda_from_lslm(monkeypatch)
    with fake_world(0, 2):
        torch.manual_seed(0)
        model = GPT(GPTConfig.tiny())
        zero = ZeroOptimizer(model, torch.optim.AdamW(model.parameters()), _ctx(2, 0), stage=2, offload="cpu")
        assert not zero.host_copies.asynchronous  # host and device are one memory here
        log: list[str] = []
        copies, real_copy, real_wait = zero.host_copies, zero.host_copies.copy, zero.host_copies.wait
        monkeypatch.setattr(copies, "copy", lambda dst, src: (log.append("copy"), real_copy(dst, src))[1])
        monkeypatch.setattr(copies, "wait", lambda: (log.append("wait"), real_wait())[1])
        inner, real_step = zero.optimizer, zero.optimizer.step
        monkeypatch.setattr(inner, "step", lambda *a, **k: (log.append(f"step pending={copies.pending}"),
                                                            real_step(*a, **k))[1])
        x = torch.randint(0, 10, (2, 8))
        zero.zero_grad()
        zero.backward(model(x, x)[1])
        zero.step(max_grad_norm=1.0)
    pieces = len(zero.layout.pieces)
    assert log == ["copy"] * pieces + ["wait", "step pending=False"]


def test_host_copies_wait_clears_what_is_pending() -> None:
    copies = HostCopies(torch.device("cpu"))
    dst, src = torch.zeros(3), torch.arange(3.0)
    copies.copy(dst, src)
    copies.issued()
    assert copies.pending
    copies.wait()
    assert not copies.pending and torch.equal(dst, src)
