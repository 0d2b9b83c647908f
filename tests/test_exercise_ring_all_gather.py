"""Notebook 02's exercise: a correct ring passes, each classic mistake gets its own hint, a deadlock is named.

Candidates are judged in one launch per world size (``run_checks``); the deadlocking ring
needs a launch of its own (its ranks are stopped), with a 3 s watchdog on 2 processes.
"""

from __future__ import annotations

import pytest

from lslm.exercises import check_ring_all_gather
from lslm.exercises.core import Verdict, run_checks

RING = "lslm.exercises.ring_all_gather:worker"


def ring_all_gather(output, input, rank, world_size):
    n, m = world_size, input.numel()
    output[rank * m:(rank + 1) * m] = input
    for s in range(n - 1):
        send_block, recv_block = (rank - s) % n, (rank - s - 1) % n
        ops = [dist.P2POp(dist.isend, output[send_block * m:(send_block + 1) * m], (rank + 1) % n),  # noqa: F821
               dist.P2POp(dist.irecv, output[recv_block * m:(recv_block + 1) * m], (rank - 1) % n)]  # noqa: F821
        for work in dist.batch_isend_irecv(ops):  # noqa: F821 - dist comes from the exercise header
            work.wait()


# A ring written with a cell-defined helper function and class: capture must bring both along.
class Neighbours:
    def __init__(self, rank, world_size):
        self.right, self.left = (rank + 1) % world_size, (rank - 1) % world_size


def block(t, j, m):
    return t[j * m:(j + 1) * m]


def ring_with_helpers(output, input, rank, world_size):
    n, m = world_size, input.numel()
    peers = Neighbours(rank, n)
    block(output, rank, m).copy_(input)
    for s in range(n - 1):
        ops = [dist.P2POp(dist.isend, block(output, (rank - s) % n, m), peers.right),  # noqa: F821
               dist.P2POp(dist.irecv, block(output, (rank - s - 1) % n, m), peers.left)]  # noqa: F821
        for work in dist.batch_isend_irecv(ops):  # noqa: F821
            work.wait()


def ring_wrong_block(output, input, rank, world_size):
    n, m = world_size, input.numel()
    output[rank * m:(rank + 1) * m] = input
    for s in range(n - 1):
        send_block, recv_block = (rank - s) % n, (rank + s + 1) % n  # wrong: the block arriving is rank-s-1
        ops = [dist.P2POp(dist.isend, output[send_block * m:(send_block + 1) * m], (rank + 1) % n),  # noqa: F821
               dist.P2POp(dist.irecv, output[recv_block * m:(recv_block + 1) * m], (rank - 1) % n)]  # noqa: F821
        for work in dist.batch_isend_irecv(ops):  # noqa: F821
            work.wait()


def ring_forgets_own_block(output, input, rank, world_size):
    n, m = world_size, input.numel()
    for s in range(n - 1):  # never copies its input into its own block
        send_block, recv_block = (rank - s) % n, (rank - s - 1) % n
        ops = [dist.P2POp(dist.isend, output[send_block * m:(send_block + 1) * m], (rank + 1) % n),  # noqa: F821
               dist.P2POp(dist.irecv, output[recv_block * m:(recv_block + 1) * m], (rank - 1) % n)]  # noqa: F821
        for work in dist.batch_isend_irecv(ops):  # noqa: F821
            work.wait()


def ring_one_step_short(output, input, rank, world_size):
    n, m = world_size, input.numel()
    output[rank * m:(rank + 1) * m] = input
    for s in range(n - 2):  # n-2 steps: one block never arrives
        send_block, recv_block = (rank - s) % n, (rank - s - 1) % n
        ops = [dist.P2POp(dist.isend, output[send_block * m:(send_block + 1) * m], (rank + 1) % n),  # noqa: F821
               dist.P2POp(dist.irecv, output[recv_block * m:(recv_block + 1) * m], (rank - 1) % n)]  # noqa: F821
        for work in dist.batch_isend_irecv(ops):  # noqa: F821
            work.wait()


def direct_to_all(output, input, rank, world_size):
    n, m = world_size, input.numel()
    output[rank * m:(rank + 1) * m] = input
    ops = []
    for peer in range(n):  # right result, wrong topology: every rank sends its block to every other rank
        if peer != rank:
            ops.append(dist.P2POp(dist.isend, input, peer))  # noqa: F821
            ops.append(dist.P2POp(dist.irecv, output[peer * m:(peer + 1) * m], peer))  # noqa: F821
    for work in dist.batch_isend_irecv(ops):  # noqa: F821
        work.wait()


def ring_cheating(output, input, rank, world_size):
    dist.all_gather_into_tensor(output, input)  # noqa: F821


def ring_sends_first(output, input, rank, world_size):
    n, m = world_size, input.numel()
    output[rank * m:(rank + 1) * m] = input
    for s in range(n - 1):
        send_block, recv_block = (rank - s) % n, (rank - s - 1) % n
        dist.send(output[send_block * m:(send_block + 1) * m], (rank + 1) % n)  # noqa: F821 - every rank blocks here
        dist.recv(output[recv_block * m:(recv_block + 1) * m], (rank - 1) % n)  # noqa: F821


def ring_stub(output, input, rank, world_size):
    """Fill output with every rank's input, in rank order."""
    raise NotImplementedError


WRONG = {  # world size -> candidate -> the kind its verdict must name
    2: {ring_forgets_own_block: "own_block", ring_one_step_short: "never_written", ring_cheating: "collective"},
    3: {ring_wrong_block: "wrong_block", ring_one_step_short: "never_written", ring_forgets_own_block: "own_block",
        direct_to_all: "not_ring"},
}


@pytest.fixture(scope="module")
def ring_verdicts() -> dict[int, dict[str, Verdict]]:
    """Every candidate at 2 and 3 processes, one launch per world size; helpers captured once for all."""
    out = {}
    for world, wrong in WRONG.items():
        fns = [ring_all_gather, ring_with_helpers, *wrong, ring_stub]
        verdicts = run_checks(fns, RING, world, helpers=(block, Neighbours))
        out[world] = {f.__name__: v for f, v in zip(fns, verdicts)}
    return out


@pytest.mark.parametrize("world", [2, 3])
def test_reference_and_a_ring_with_cell_helpers_pass(ring_verdicts, world) -> None:
    assert ring_verdicts[world]["ring_all_gather"].passed, ring_verdicts[world]["ring_all_gather"]
    assert ring_verdicts[world]["ring_with_helpers"].passed, ring_verdicts[world]["ring_with_helpers"]
    assert ring_verdicts[world]["ring_stub"].state == "not attempted"


@pytest.mark.parametrize("world, candidate", [(w, f) for w, fs in WRONG.items() for f in fs],
                         ids=lambda x: getattr(x, "__name__", str(x)))
def test_each_mistake_gets_its_own_hint(ring_verdicts, world, candidate) -> None:
    verdict = ring_verdicts[world][candidate.__name__]
    assert not verdict.passed and verdict.details["kind"] == WRONG[world][candidate], verdict


def test_wrong_block_names_the_slot_and_whose_data_it_holds(ring_verdicts) -> None:
    verdict = ring_verdicts[3]["ring_wrong_block"]
    assert "block 1 of output holds rank 2's input" in verdict.message
    assert "(rank - s - 1) % world_size" in verdict.hint
    assert "is off during this exercise" in ring_verdicts[2]["ring_cheating"].message


def test_direct_to_all_is_not_a_ring(ring_verdicts) -> None:
    verdict = ring_verdicts[3]["direct_to_all"]
    assert "rank 0 (M=1, float32): sent a block to rank 2; in a ring it sends only to rank 1" in verdict.message
    assert "(rank + 1) % world_size" in verdict.hint


def test_a_deadlocked_ring_is_told_it_deadlocked(capsys) -> None:
    verdict = check_ring_all_gather(ring_sends_first, world_sizes=(2,), deadlock_s=3)
    assert not verdict.passed and verdict.details["kind"] == "deadlock"
    assert verdict.details["stuck"] == [0, 1]
    assert "DEADLOCK with 2 processes: ranks 0, 1 never returned from your ring_sends_first (M=1, float32)" \
        in verdict.message
    assert "batch_isend_irecv" in verdict.hint
    assert capsys.readouterr().out.startswith("NOT YET: DEADLOCK")
