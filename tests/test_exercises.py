"""The exercise mechanism accepts correct solutions and rejects wrong ones with a precise message."""

from __future__ import annotations

from lslm.exercises import check_shard_range, materialise, reference_shard_range


def shard_range(n_items: int, rank: int, world_size: int) -> tuple[int, int]:
    base, extra = divmod(n_items, world_size)
    start = rank * base + min(rank, extra)
    return start, start + base + (1 if rank < extra else 0)


def shard_range_drops_remainder(n_items: int, rank: int, world_size: int) -> tuple[int, int]:
    per = n_items // world_size
    return rank * per, (rank + 1) * per


def shard_range_crashes(n_items: int, rank: int, world_size: int) -> tuple[int, int]:
    raise ZeroDivisionError("oops")


def test_reference_covers_everything_once() -> None:
    for world in range(1, 6):
        for n in range(0, 23):
            shards = [reference_shard_range(n, r, world) for r in range(world)]
            assert shards[0][0] == 0 and shards[-1][1] == n
            assert all(a[1] == b[0] for a, b in zip(shards, shards[1:]))
            sizes = [b - a for a, b in shards]
            assert max(sizes) - min(sizes) <= 1 and sizes == sorted(sizes, reverse=True)


def test_materialise_writes_an_importable_module(tmp_path) -> None:
    directory, module = materialise(shard_range, tmp_path)
    text = (directory / f"{module}.py").read_text()
    assert "import torch" in text and "def shard_range" in text


def test_correct_solution_passes(capsys) -> None:
    verdict = check_shard_range(shard_range)
    assert verdict.passed, verdict
    assert capsys.readouterr().out.startswith("PASSED")


def test_wrong_solution_is_rejected_with_rank_and_input(capsys) -> None:
    verdict = check_shard_range(shard_range_drops_remainder, world_sizes=(2,))
    assert not verdict.passed
    assert verdict.details["rank"] == 0 and verdict.details["n_items"] == 1
    assert "rank 0, n_items=1: expected (0, 1), got [0, 0]" in verdict.message
    assert "NOT YET" in capsys.readouterr().out


def test_crashing_solution_is_a_verdict_not_an_error() -> None:
    verdict = check_shard_range(shard_range_crashes, world_sizes=(2,))
    assert not verdict.passed and "ZeroDivisionError" in verdict.message


def ring_all_gather(output, input, rank, world_size):
    import torch.distributed as dist

    n, m = world_size, input.numel()
    output[rank * m:(rank + 1) * m] = input
    for s in range(n - 1):
        send_block, recv_block = (rank - s) % n, (rank - s - 1) % n
        ops = [dist.P2POp(dist.isend, output[send_block * m:(send_block + 1) * m], (rank + 1) % n),
               dist.P2POp(dist.irecv, output[recv_block * m:(recv_block + 1) * m], (rank - 1) % n)]
        for work in dist.batch_isend_irecv(ops):
            work.wait()


def ring_all_gather_wrong_block(output, input, rank, world_size):
    import torch.distributed as dist

    n, m = world_size, input.numel()
    output[rank * m:(rank + 1) * m] = input
    for s in range(n - 1):
        send_block, recv_block = (rank - s) % n, (rank + s + 1) % n  # wrong: the block arriving is rank-s-1
        reqs = [dist.isend(output[send_block * m:(send_block + 1) * m], (rank + 1) % n),
                dist.irecv(output[recv_block * m:(recv_block + 1) * m], (rank - 1) % n)]
        for req in reqs:
            req.wait()


def ring_all_gather_cheating(output, input, rank, world_size):
    import torch.distributed as dist

    dist.all_gather_into_tensor(output, input)


def test_ring_all_gather_checker_accepts_and_rejects() -> None:
    from lslm.exercises import check_ring_all_gather

    assert check_ring_all_gather(ring_all_gather).passed
    wrong = check_ring_all_gather(ring_all_gather_wrong_block, world_sizes=(3,))
    assert not wrong.passed and "expected" in wrong.message and "block" in wrong.message
    cheat = check_ring_all_gather(ring_all_gather_cheating, world_sizes=(2,))
    assert not cheat.passed and "is off during this exercise" in cheat.message
