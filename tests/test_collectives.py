"""lslm.collectives: correctness against torch.distributed, exact ledger volumes, deadlocks and clear failures.

Launches dominate the run time (3-6 s each on 2 cores), so each world size runs
every case in one launch and the worker returns its mismatches and byte counts.
Correctness and the agreement check run on every available backend (NCCL where
there are enough GPUs); the timeout and deadlock lessons run on gloo only, because
there a timeout raises, while NCCL's watchdog kills the process (see
:mod:`lslm.runtime.startup`).
"""

from __future__ import annotations

import time

import pytest

from lslm.collectives import ALGORITHMS, KINDS, TIMEOUT_HINT, barrier_bytes, check_bytes, chunk_bounds, chunk_sizes
from lslm.collectives.p2p import binomial_children, binomial_parent
from lslm.launcher import LaunchError
from tests.helpers import backends, nproc_backends, run_workers

# 0 and 1 are edge cases (empty tensors; fewer elements than ranks, so empty chunks),
# 24 divides by 2, 3 and 4, 29 by none of them.
LENGTHS = [0, 1, 24, 29]


# -- pure functions (no processes) ----------------------------------------------------
def test_chunks_follow_array_split() -> None:
    assert chunk_sizes(10, 4) == [3, 3, 2, 2]
    assert chunk_sizes(2, 3) == [1, 1, 0]
    assert chunk_bounds(10, 4) == [(0, 3), (3, 6), (6, 8), (8, 10)]
    assert sum(chunk_sizes(1001, 7)) == 1001


def test_registry_covers_every_kind_and_formulas_conserve_bytes() -> None:
    assert {a.kind for a in ALGORITHMS.values()} == set(KINDS)
    for algo in ALGORITHMS.values():
        for n in range(1, 9):
            for numel in (0, 5, 24, 29):
                numel = n * numel if algo.kind == "all_to_all" else numel
                for root in (0, n - 1):
                    sent = sum(algo.sent(n, r, numel, 2, root) for r in range(n))
                    recv = sum(algo.received(n, r, numel, 2, root) for r in range(n))
                    assert sent == recv, (algo.name, n, numel, root)  # every byte sent is received
    ring = ALGORITHMS["all_reduce_ring"]
    assert all(ring.sent(4, r, 400, 4) == 2 * 3 * 100 * 4 for r in range(4))  # 2(n-1)/n N when n | N
    assert ALGORITHMS["broadcast_tree"].sent(5, 0, 10, 1) == 3 * 10  # the root has ceil(log2 5) children
    assert check_bytes(4) == 2 * 80 and barrier_bytes(5) == 3 and check_bytes(1) == 0


def test_binomial_tree_reaches_every_rank_once() -> None:
    for n in range(1, 20):
        reached = [0]
        for v in range(n):  # parents are smaller than children, so this order is a valid schedule
            for child in binomial_children(v, n):
                assert binomial_parent(child, n) == v
                reached.append(child)
        assert sorted(reached) == list(range(n))
        assert len(binomial_children(0, n)) == (n - 1).bit_length()  # ceil(log2 n) rounds from the root


# -- correctness and volumes against torch ------------------------------------------------
@pytest.mark.parametrize("nproc,backend", nproc_backends(2, 3, 4))
def test_every_collective_matches_torch_and_the_byte_formulas(nproc: int, backend: str) -> None:
    res = run_workers("tests.collective_workers:collectives_vs_torch", nproc, backend=backend, lengths=LENGTHS,
                      subgroups=nproc == 4, timeout=240)
    mismatches = [m for r in res for m in r["mismatches"]]
    assert all(not r["validation"] for r in res), [r["validation"] for r in res]
    assert not mismatches, "\n".join(mismatches[:20])
    seen = set()
    for r in res:
        for name, n, rank, numel, elem, root, sent, recv, chk_sent, chk_recv in r["volumes"]:
            algo = ALGORITHMS[name]
            case = (name, n, rank, numel, elem, root)
            assert sent == algo.sent(n, rank, numel, elem, root), case
            assert recv == algo.received(n, rank, numel, elem, root), case
            assert chk_sent == chk_recv == check_bytes(n), case
            seen.add((name, n))
    assert {name for name, _ in seen} == set(ALGORITHMS)
    if nproc == 4:
        assert res[1]["groups"] == [[1, 2, 3], [0, 2]]
        assert {n for _, n in seen} == {4, 3, 2}  # the world and both subgroups were exercised


# -- deadlock lesson ----------------------------------------------------------------------
def test_blocking_ring_deadlocks_even_for_one_element_until_the_timeout() -> None:
    res = run_workers("lslm.demos.collectives_demo:blocking_ring", 2, numel=1, timeout_s=3, timeout=60)
    for r in res:
        assert not r["completed"], r
        assert 2.5 < r["seconds"] < 15, r
        # The first rank to time out tears its connections down, so a peer may see that instead.
        assert "Timed out" in r["error"] or "Connection closed" in r["error"], r
    assert any("Timed out" in r["error"] for r in res), res


def test_short_error_hides_the_path_of_the_machine_that_built_torch() -> None:
    from lslm.demos.collectives_demo import short_error

    exc = RuntimeError("[/__w/pytorch/pytorch/third_party/gloo/gloo/transport/tcp/unbound_buffer.cc:129] "
                       "Timed out waiting 3000ms for send operation to complete\nsecond line")
    assert short_error(exc) == "Timed out waiting 3000ms for send operation to complete (unbound_buffer.cc:129)"
    assert short_error(RuntimeError("plain")) == "plain"


def test_ordered_ring_completes_on_an_odd_ring() -> None:
    res = run_workers("lslm.demos.collectives_demo:ordered_ring", 3, numel=4096, timeout_s=10, timeout=60)
    assert all(r["completed"] and r["correct"] for r in res), res


# -- failures end with a clear error, not a hang -------------------------------------------
@pytest.mark.parametrize("backend", backends(3))
def test_mismatched_shapes_raise_a_clear_error_on_every_algorithm(backend: str) -> None:
    start = time.perf_counter()
    with pytest.raises(LaunchError) as info:
        run_workers("tests.collective_workers:mismatched_shapes", 3, backend=backend, timeout_s=5, timeout=60)
    assert time.perf_counter() - start < 30
    tb = info.value.traceback
    assert "CollectiveError" in tb and "all_reduce_ring" in tb and "mismatched shapes across ranks" in tb, tb


@pytest.mark.parametrize("nproc,tp", [(3, 1), (4, 2)])
def test_a_rank_that_never_calls_makes_the_others_fail_within_the_timeout(nproc: int, tp: int) -> None:
    start = time.perf_counter()
    with pytest.raises(LaunchError) as info:
        run_workers("tests.collective_workers:absent_rank", nproc, timeout_s=3, tp=tp, timeout=60)
    assert time.perf_counter() - start < 30
    tb = info.value.traceback
    assert "CollectiveError" in tb and "all_reduce_ring" in tb and TIMEOUT_HINT in tb, tb
