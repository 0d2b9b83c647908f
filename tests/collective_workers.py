"""Workers for tests/test_collectives.py: every lslm collective against torch.distributed's own.

One launch per world size runs every (algorithm, dtype, length, root, op) case and
returns the mismatches plus the ledger's byte counts; the test process compares
those with the formulas of ``lslm.collectives.ALGORITHMS``.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed import ReduceOp

from lslm.collectives import (
    ALGORITHMS,
    CHECK_LABEL,
    TIMEOUT_HINT,
    CollectiveError,
    all_reduce_ring,
    chunk_bounds,
    group_view,
)
from lslm.collectives.p2p import posts_ahead
from lslm.runtime import Comm, CommLedger, init_distributed

DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16, "int64": torch.int64}
TORCH_OPS = {"sum": ReduceOp.SUM, "max": ReduceOp.MAX, "min": ReduceOp.MIN, "prod": ReduceOp.PRODUCT}
ROOTED = ("broadcast", "reduce", "scatter", "gather")
# Extra settings tested as if they were algorithms: the ring all-reduce cut into 2-element pieces
# (several pieces per chunk even on tiny tensors, uneven last pieces included).
# On gloo the rings post receives ahead by default (NCCL: step pairs); the [paired ...] variants
# run the step-pair path on gloo too, so both are checked against torch here.
VARIANTS = {"all_reduce_ring[pipelined]": ("all_reduce_ring", {"pipeline_bytes": 8}),
            "all_reduce_ring[whole chunks]": ("all_reduce_ring", {"pipeline_bytes": None}),
            "all_reduce_ring[paired, pipelined]": ("all_reduce_ring", {"pipeline_bytes": 8, "post_ahead": False}),
            "all_reduce_ring[paired, whole chunks]": ("all_reduce_ring", {"pipeline_bytes": None,
                                                                          "post_ahead": False}),
            "all_gather_ring[paired]": ("all_gather_ring", {"post_ahead": False})}


def _data(seed: int, numel: int, dtype: torch.dtype, op: str = "sum", normal: bool = False,
          device: torch.device | str = "cpu") -> torch.Tensor:
    """Deterministic data on ``device``: small integers (exact in fp16/bf16 sums and products), or standard normals.

    Drawn on the CPU (one generator, the same numbers on every backend), then moved.
    """
    g = torch.Generator().manual_seed(seed)
    if normal:
        return torch.randn(numel, generator=g, device="cpu").to(device, dtype)
    hi = 3 if op == "prod" else 8  # |product| <= 3^4 = 81 and |sum| <= 4 * 8 stay exact in bf16 (8-bit mantissa)
    return torch.randint(-hi, hi + 1, (numel,), generator=g, device="cpu").to(device, dtype)


def _ledger_bytes(comm: Comm) -> list[int]:
    """[data sent, data received, check sent, check received] since the last reset."""
    out = [0, 0, 0, 0]
    for rec in comm.ledger.records:
        col = (0 if rec.op == "send" else 1) + (2 if rec.label == CHECK_LABEL else 0)
        out[col] += rec.nbytes
    return out


def _run_case(name: str, x: torch.Tensor, root: int, op: str, group: Any, comm: Comm,
              ref: Comm) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """Run lslm's ``name`` and torch's equivalent on copies of ``x``; return (ours, expected) for this rank.

    ``root`` is a global rank. (None, None) means this rank has nothing to compare.
    """
    base, extra = VARIANTS.get(name, (name, {}))
    algo = ALGORITHMS[base]
    gv = group_view(group)
    n, r = gv.size, gv.rank
    kind, top = algo.kind, TORCH_OPS[op]
    if kind == "all_reduce":
        ours = algo.fn(x.clone(), op=op, comm=comm, group=group, **extra)
        expected = x.clone()
        if x.numel():
            ref.all_reduce(expected, op=top, group=group)
        return ours, expected
    if kind == "broadcast":
        ours = algo.fn(x.clone(), root, comm=comm, group=group)
        expected = x.clone()
        if x.numel():
            ref.broadcast(expected, root, group=group)
        return ours, expected
    if kind == "reduce":
        ours = algo.fn(x.clone(), root, op=op, comm=comm, group=group)
        expected = x.clone()
        if x.numel():
            ref.reduce(expected, root, op=top, group=group)
        # On other ranks the input must be left untouched (torch's reduce may scribble on it).
        return ours, expected if gv.ranks[r] == root else x
    if kind == "all_gather":
        ours = algo.fn(x.new_empty(n * x.numel()), x.clone(), comm=comm, group=group, **extra)
        expected = x.new_empty(n * x.numel())
        if x.numel():
            ref.all_gather_into_tensor(expected, x.clone(), group=group)
        return ours, expected
    if kind == "reduce_scatter":
        a, b = chunk_bounds(x.numel(), n)[r]
        ours = algo.fn(x.new_empty(b - a), x.clone(), op=op, comm=comm, group=group)
        full = x.clone()
        if x.numel():
            ref.all_reduce(full, op=top, group=group)  # uneven chunks: torch's reduce-scatter wants equal ones
        return ours, full[a:b]
    if kind == "all_to_all":
        ours = algo.fn(torch.empty_like(x), x.clone(), comm=comm, group=group)
        expected = torch.empty_like(x)
        if x.numel():
            ref.all_to_all_single(expected, x.clone(), group=group)
        return ours, expected
    m = x.numel()
    if kind == "scatter":
        items = [x * (i + 1) for i in range(n)] if gv.ranks[r] == root else None
        ours = algo.fn(x.new_empty(m), items, root, comm=comm, group=group)
        expected = x.new_empty(m)
        if m:
            ref.scatter(expected, [t.clone() for t in items] if items else None, root, group=group)
        return ours, expected
    # gather
    is_root = gv.ranks[r] == root
    got = algo.fn(x.clone(), [x.new_empty(m) for _ in range(n)] if is_root else None, root,
                  comm=comm, group=group)
    expected = [x.new_empty(m) for _ in range(n)] if is_root else None
    if m:
        ref.gather(x.clone(), expected, root, group=group)
    if not is_root:
        return None, None
    return torch.cat(list(got)), torch.cat(expected)


def _same(ours: torch.Tensor, expected: torch.Tensor, tol: tuple[float, float] | None) -> bool:
    if ours.shape != expected.shape or ours.dtype != expected.dtype:
        return False
    if tol is None:
        return torch.equal(ours, expected)
    return torch.allclose(ours.float(), expected.float(), rtol=tol[0], atol=tol[1])


def _cases(n: int, lengths: list[int], dtypes: tuple[str, ...]) -> list[tuple[str, str, int, str, bool]]:
    """(algorithm, dtype, numel, op, normal) for one group size."""
    cases = []
    for name in [*ALGORITHMS, *VARIANTS]:
        algo = ALGORITHMS[VARIANTS.get(name, (name,))[0]]
        for dtype in dtypes:
            for numel in lengths:
                if algo.kind == "all_to_all":
                    numel = n * -(-numel // n)  # equal splits only: round up to a multiple of n
                cases.append((name, dtype, numel, "sum", False))
        if algo.kind in ("all_reduce", "reduce", "reduce_scatter"):
            for op in ("max", "min", "prod"):
                for dtype in ("float32", "int64", "bfloat16"):
                    cases.append((name, dtype, lengths[-1], op, False))
            for dtype in ("float32", "bfloat16"):
                cases.append((name, dtype, 1001, "sum", True))
    return cases


# Random normals: float32 sums of <= 4 terms in another order differ by a few ulps (|x| < 10, so < 1e-5);
# bfloat16 keeps 8 significant bits, each of <= 3 roundings may differ by one ulp of a value < 16 (0.0625).
TOLERANCE = {"float32": (1e-5, 1e-5), "bfloat16": (2e-2, 6.25e-2)}


def _sweep(comm: Comm, ref: Comm, group: Any, lengths: list[int], seed0: int, device: torch.device,
           dtypes: tuple[str, ...] = tuple(DTYPES)) -> tuple[list[str], list[list[Any]]]:
    gv = group_view(group)
    n, r = gv.size, gv.rank
    mismatches: list[str] = []
    volumes: list[list[Any]] = []
    for i, (name, dtype, numel, op, normal) in enumerate(_cases(n, lengths, dtypes)):
        base = VARIANTS.get(name, (name,))[0]
        algo = ALGORITHMS[base]
        roots = [gv.ranks[0], gv.ranks[-1]] if algo.kind in ROOTED else [gv.ranks[0]]
        for root in roots:
            x = _data(seed0 + 1000 * i + gv.ranks[r], numel, DTYPES[dtype], op, normal, device)
            comm.ledger.reset()
            ours, expected = _run_case(name, x, root, op, group, comm, ref)
            tol = TOLERANCE[dtype] if normal else None
            if ours is not None and not _same(ours, expected, tol):
                mismatches.append(f"{name} {dtype} numel={numel} op={op} root={root} normal={normal} group={gv.ranks}:"
                                  f" got {ours[:8].tolist()} expected {expected[:8].tolist()}")
            # Every send and receive was waited for (deferred send waits included) before the call returned.
            unwaited = [rec for rec in comm.ledger.records if rec.completion_s is None]
            if unwaited:
                mismatches.append(f"{name} numel={numel}: {len(unwaited)} operations never waited for")
            volumes.append([base, n, r, numel, DTYPES[dtype].itemsize, gv.ranks.index(root), *_ledger_bytes(comm)])
    return mismatches, volumes


def _non_contiguous(comm: Comm, ref: Comm, device: torch.device) -> list[str]:
    """A transposed 2-D tensor goes through the flatten-once / write-back path of in-place collectives."""
    bad = []
    r = dist.get_rank()
    for name in ("all_reduce_ring", "all_reduce_tree", "broadcast_tree"):
        x = _data(77 + r, 35, torch.float32, device=device).view(5, 7).t()
        expected = x.contiguous()
        if name == "broadcast_tree":
            ours = ALGORITHMS[name].fn(x.clone(), 0, comm=comm)
            ref.broadcast(expected, 0)
        else:
            ours = ALGORITHMS[name].fn(x.clone(), comm=comm)
            ref.all_reduce(expected)
        if ours.is_contiguous() or not torch.equal(ours, expected):
            bad.append(f"{name} on a non-contiguous tensor")
    return bad


def _validation_failures(comm: Comm, n: int, r: int, dev: torch.device) -> list[str]:
    """Bad arguments must raise ValueError before any message is sent (so the ranks stay in step)."""
    from lslm import collectives as C

    x = torch.ones(29, device=dev)
    cases: dict[str, Callable[[], Any]] = {
        "all_gather output size": lambda: C.all_gather_ring(torch.empty(n * 29 + 1, device=dev), x, comm=comm),
        "reduce_scatter output size": lambda: C.reduce_scatter_ring(torch.empty(29 // n + 5, device=dev), x, comm=comm),
        "all_to_all not divisible": lambda: C.all_to_all_pairwise(torch.empty(29, device=dev), x, comm=comm),
        "all_to_all aliasing": lambda: C.all_to_all_pairwise(x[: 4 * n], x[: 4 * n], comm=comm),
        "broadcast src outside": lambda: C.broadcast_tree(x.clone(), n + 5, comm=comm),
        "reduce unknown op": lambda: C.reduce_tree(x.clone(), 0, op="mean", comm=comm),
        "all_reduce unknown op": lambda: C.all_reduce_ring(x.clone(), op="avg", comm=comm),
        "mixed dtypes": lambda: C.all_gather_ring(torch.empty(n * 29, dtype=torch.int64, device=dev), x, comm=comm),
    }
    if r == 0:  # root-only arguments are only validated on the root
        cases["scatter list length"] = lambda: C.scatter(torch.empty(29, device=dev), [x] * (n + 1), 0, comm=comm)
        cases["gather non-contiguous"] = lambda: C.gather(
            x, [torch.empty(29, 2, device=dev)[:, 0] for _ in range(n)], 0, comm=comm)
    failures = []
    for what, call in cases.items():
        try:
            call()
            failures.append(f"{what}: no error")
        except ValueError:
            pass
        except Exception as exc:  # noqa: BLE001 - report the wrong kind of error
            failures.append(f"{what}: {type(exc).__name__}: {exc}")
    if comm.ledger.records:
        failures.append(f"messages were sent before validation: {comm.ledger.records[:3]}")
    return failures


def collectives_vs_torch(lengths: list[int], subgroups: bool = False) -> dict[str, Any]:
    """Every algorithm x dtype x length x root (x op) against torch; with ``subgroups``, on two subgroups too."""
    with init_distributed(timeout_s=30) as ctx:
        dev = ctx.device
        # Completion times on: an operation nobody waited for is one whose record never completed.
        comm, ref = Comm(CommLedger(record_completion=True), device=dev), Comm(device=dev)
        start = time.perf_counter()
        validation = _validation_failures(comm, ctx.world_size, ctx.rank, dev)
        if posts_ahead(group_view(None), None) != (ctx.backend == "gloo"):
            validation.append(f"rings post receives ahead on {ctx.backend}: only gloo may")
        mismatches, volumes = _sweep(comm, ref, None, lengths, 0, dev)
        mismatches += _non_contiguous(comm, ref, dev)
        groups: list[list[int]] = []
        if subgroups:
            n = ctx.world_size
            # A group without rank 0 and of non-power-of-two size, and a strided one; every
            # rank creates both (new_group is collective), members use them.
            groups = [list(range(1, n)), list(range(0, n, 2))]
            handles = [dist.new_group(ranks) for ranks in groups]
            for ranks, pg in zip(groups, handles):
                if ctx.rank not in ranks:
                    try:
                        ALGORITHMS["all_reduce_ring"].fn(torch.ones(3, device=dev), comm=comm, group=pg)
                        validation.append(f"rank {ctx.rank} outside {ranks} was not refused")
                    except ValueError:
                        pass
                else:
                    # Fewer cases here: the group logic does not depend on the dtype or the edge lengths.
                    m, v = _sweep(comm, ref, pg, [k for k in lengths if k > 1], 10**6, dev,
                                  dtypes=("float32", "int64"))
                    mismatches += m
                    volumes += v
        return {"mismatches": mismatches, "volumes": volumes, "validation": validation,
                "seconds": time.perf_counter() - start, "groups": groups}


def _mismatched_calls(n: int, r: int, comm: Comm, dev: torch.device) -> list[tuple[str, Callable[[], Any]]]:
    """One call per algorithm in which the last rank disagrees (size, dtype or root)."""
    last = r == n - 1
    numel = 8 + (3 if last else 0)
    x = torch.ones(numel, dtype=torch.float16 if last else torch.float32, device=dev)
    root = n - 1 if last else 0  # a root mismatch on the rooted kinds
    calls: list[tuple[str, Callable[[], Any]]] = []
    for name, algo in ALGORITHMS.items():
        fn, k = algo.fn, algo.kind
        if k == "all_reduce":
            calls.append((name, lambda fn=fn: fn(x.clone(), comm=comm)))
        elif k in ("broadcast", "reduce"):
            calls.append((name, lambda fn=fn: fn(torch.ones(8, device=dev), root, comm=comm)))
        elif k == "all_gather":
            calls.append((name, lambda fn=fn: fn(torch.empty(n * numel, device=dev), torch.ones(numel, device=dev),
                                                  comm=comm)))
        elif k == "reduce_scatter":
            size = chunk_bounds(n * numel, n)[r]
            calls.append((name, lambda fn=fn, s=size: fn(torch.empty(s[1] - s[0], device=dev),
                                                         torch.ones(n * numel, device=dev), comm=comm)))
        elif k == "all_to_all":
            calls.append((name, lambda fn=fn: fn(torch.empty(n * numel, device=dev),
                                                  torch.ones(n * numel, device=dev), comm=comm)))
        elif k == "scatter":
            calls.append((name, lambda fn=fn: fn(torch.empty(numel, device=dev),
                                                  [torch.ones(numel, device=dev)] * n, 0, comm=comm)))
        else:
            calls.append((name, lambda fn=fn: fn(torch.ones(numel, device=dev),
                                                  [torch.empty(numel, device=dev) for _ in range(n)], 0, comm=comm)))
    return calls


def mismatched_shapes(timeout_s: float = 5.0) -> None:
    """Every algorithm with the last rank disagreeing must raise CollectiveError on every rank.

    Each call is caught and checked; the group stays usable because the agreement
    check fails before any data moves. The last call, a ring all-reduce with
    different lengths, is left to raise, so the launch fails with its traceback.
    """
    ctx = init_distributed(timeout_s=timeout_s)
    comm = Comm(device=ctx.device)
    for name, call in _mismatched_calls(ctx.world_size, ctx.rank, comm, ctx.device):
        try:
            call()
        except CollectiveError as exc:
            assert name in str(exc) and "mismatched shapes across ranks" in str(exc), str(exc)
        else:
            raise AssertionError(f"{name} did not notice the mismatch")
    numel = 100 + ctx.rank  # every rank a different length
    all_reduce_ring(torch.ones(numel, device=ctx.device), comm=comm)
    raise AssertionError("all_reduce_ring did not notice the mismatch")


def absent_rank(timeout_s: float = 5.0, tp: int = 1) -> None:
    """The last rank never calls the collective (it sleeps); the others must fail within the timeout.

    With ``tp > 1`` the collective runs on the tensor-parallel subgroup, which checks
    that subgroups inherit the finite timeout of ``init_distributed``; ranks outside
    the absent rank's group complete normally.
    """
    ctx = init_distributed(tp=tp, timeout_s=timeout_s)
    absent = ctx.world_size - 1
    group = ctx.tp_group if tp > 1 else None
    if ctx.rank == absent:
        time.sleep(6 * timeout_s)  # killed by the launcher once a peer has failed
        return
    affected = tp == 1 or ctx.grid.coords_of(absent).pp == ctx.pp_rank and ctx.grid.coords_of(absent).dp == ctx.dp_rank
    start = time.perf_counter()
    try:
        all_reduce_ring(torch.ones(1000, device=ctx.device), comm=ctx.comm, group=group)
    except CollectiveError as exc:
        assert TIMEOUT_HINT in str(exc)
        raise CollectiveError(f"{exc} [after {time.perf_counter() - start:.1f} s]") from exc
    if affected:
        raise AssertionError("all_reduce_ring completed without the last rank")
    time.sleep(6 * timeout_s)  # stay alive so the failure comes from the affected group
