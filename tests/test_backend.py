"""Backend-correct communication, checked without a GPU.

We rarely have GPUs, so NCCL's rules are enforced here on the CPU:

* a static scan: every tensor factory (``torch.zeros``, ``torch.tensor``, ...) in a
  communication module names its ``device=`` (``*_like``/``new_*`` inherit it), unless
  the line says why the CPU is right with ``# lslm: cpu-ok (reason)``;
* every collective run on "meta" tensors (a device that is not the CPU) through a
  transport that only records: whatever lslm sends or receives lives on the data's
  device, and the barrier's byte on ``comm.device``;
* paired point-to-point: no rank ever has a separately posted send and receive to
  the same peer outstanding at once - they go through one ``batch_isend_irecv``
  (NCCL deadlocks otherwise, see :func:`lslm.collectives.p2p.post_pairs`).
"""

from __future__ import annotations

import ast
from pathlib import Path
from typing import Any

import pytest
import torch

from lslm.collectives import ALGORITHMS, barrier
from lslm.runtime import Comm
from tests.helpers import REPO_ROOT, fake_world

FACTORIES = {"zeros", "ones", "empty", "full", "tensor", "as_tensor", "arange", "rand", "randn", "randint",
             "randperm", "linspace", "logspace", "eye", "empty_strided"}
MARKER = "# lslm: cpu-ok ("
# Modules that communicate through torch.distributed: the runtime, the collectives, DDP, the harness,
# recipes, benches, demos and exercises, and each later chapter's package once it exists.
COMM_DIRS = ["lslm/runtime", "lslm/collectives", "lslm/data_parallel/ddp", "lslm/harness", "lslm/recipes",
             "lslm/bench", "lslm/demos", "lslm/exercises", "lslm/tensor_parallel", "lslm/sequence_parallel",
             "lslm/context_parallel", "lslm/pipeline", "lslm/pipeline_parallel", "lslm/precision", "lslm/zero",
             "lslm/fsdp", "lslm/expert_parallel", "lslm/integrations"]


def factory_calls_without_device(path: Path) -> list[str]:
    """``"path:line: code"`` for each ``torch.<factory>(...)`` call in ``path`` without ``device=`` or the marker."""
    source = path.read_text()
    lines = source.splitlines()
    found = []
    for node in ast.walk(ast.parse(source)):
        if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
                and isinstance(node.func.value, ast.Name) and node.func.value.id == "torch"
                and node.func.attr in FACTORIES):
            continue
        if any(k.arg == "device" for k in node.keywords):
            continue
        span = lines[node.lineno - 1:(node.end_lineno or node.lineno)]
        if any(MARKER in line for line in span):
            continue
        name = path.relative_to(REPO_ROOT) if path.is_relative_to(REPO_ROOT) else path.name
        found.append(f"{name}:{node.lineno}: {lines[node.lineno - 1].strip()}")
    return found


def comm_files(dirs: list[str] = COMM_DIRS) -> list[Path]:
    """Every Python file of the packages among ``dirs`` that exist today."""
    return sorted(p for d in dirs if (REPO_ROOT / d).is_dir() for p in (REPO_ROOT / d).rglob("*.py"))


def test_the_scan_finds_factories_without_a_device(tmp_path: Path) -> None:
    probe = tmp_path / "probe.py"
    probe.write_text("import torch\n"
           "a = torch.zeros(3)\n"
           "b = torch.zeros(3, device=x.device)\n"
           "c = torch.empty_like(a)\n"
           "d = torch.tensor([1],\n    dtype=torch.int64)\n"
           "e = torch.ones(2)  # lslm: cpu-ok (host-side counter)\n")
    found = factory_calls_without_device(probe)
    assert [f.split(": ")[0] for f in found] == ["probe.py:2", "probe.py:5"]


def test_communication_modules_name_the_device_of_every_tensor_they_create() -> None:
    files = comm_files()
    assert len(files) >= 20  # the scan really sees the packages
    found = [f for p in files for f in factory_calls_without_device(p)]
    assert not found, ("tensors created without device= (NCCL needs them on the data's device; if the CPU is "
                       "right, say why with '# lslm: cpu-ok (reason)'):\n" + "\n".join(found))


# -- what the collectives actually post ------------------------------------------------
class _Done:
    """A work that is already complete; remembers that it was waited on."""

    def __init__(self, entry: list[Any] | None = None) -> None:
        self.entry = entry

    def wait(self, *_: Any) -> bool:
        if self.entry is not None:
            self.entry[2] = True
        return True

    def is_completed(self) -> bool:
        return True


class RecordingComm(Comm):
    """A Comm whose p2p calls move nothing: they record devices and what is outstanding, per peer."""

    def __init__(self, device: str) -> None:
        super().__init__(device=device)
        self.devices: set[str] = set()
        self.outstanding: list[list[Any]] = []  # [kind, peer, waited] of directly posted isend/irecv
        self.unpaired: list[str] = []
        self.batches = 0

    def _direct(self, kind: str, t: torch.Tensor, peer: int) -> _Done:
        self.devices.add(t.device.type)
        for other, p, waited in self.outstanding:
            if p == peer and other != kind and not waited:
                self.unpaired.append(f"{kind} to/from {peer} posted while a {other} with it was outstanding")
        entry = [kind, peer, False]
        self.outstanding.append(entry)
        return _Done(entry)

    def isend(self, tensor: torch.Tensor, dst: int, group: Any = None, label: str = "") -> _Done:
        return self._direct("send", tensor, dst)

    def irecv(self, tensor: torch.Tensor, src: int, group: Any = None, label: str = "") -> _Done:
        return self._direct("recv", tensor, src)

    def batch_isend_irecv(self, ops: Any, label: str = "") -> list[_Done]:
        self.batches += 1
        self.devices.update(p.tensor.device.type for p in ops)
        return [_Done() for _ in ops]


def _run(name: str, n: int, comm: Comm, device: str) -> None:
    algo = ALGORITHMS[name]
    k, x = algo.kind, torch.empty(24, device=device)
    if k == "all_reduce":
        algo.fn(x, comm=comm, check=False)
    elif k in ("broadcast", "reduce"):
        algo.fn(x, 0, comm=comm, check=False)
    elif k == "all_gather":
        algo.fn(torch.empty(n * 24, device=device), x, comm=comm, check=False)
    elif k == "reduce_scatter":
        algo.fn(torch.empty(24 // n, device=device), x, comm=comm, check=False)
    elif k == "all_to_all":
        algo.fn(torch.empty(24, device=device), x, comm=comm, check=False)
    elif k == "scatter":
        algo.fn(torch.empty(24, device=device), [torch.empty(24, device=device)] * n, 0, comm=comm, check=False)
    else:
        algo.fn(x, [torch.empty(24, device=device) for _ in range(n)], 0, comm=comm, check=False)


@pytest.mark.parametrize("n", [2, 3, 4])
def test_collectives_post_on_the_data_device_and_batch_paired_p2p(n: int) -> None:
    for rank in range(n):
        with fake_world(rank, n):
            for name in ALGORITHMS:
                # meta tensors share no memory to tell apart, so the aliasing check of all-to-all
                # would refuse them; all-to-all allocates nothing itself (the scan covers its check).
                device = "cpu" if name == "all_to_all_pairwise" else "meta"
                comm = RecordingComm(device=device)
                _run(name, n, comm, device)
                assert comm.devices <= {device}, (name, rank, comm.devices)
                assert not comm.unpaired, (name, rank, comm.unpaired)
            comm = RecordingComm(device="meta")
            barrier(comm)
            assert comm.devices == {"meta"} and not comm.unpaired and comm.batches == (n - 1).bit_length()
    # The pipelined ring all-reduce of a 2-rank ring sends to and receives from one peer: all batched.
    with fake_world(0, 2):
        comm = RecordingComm(device="meta")
        ALGORITHMS["all_reduce_ring"].fn(torch.empty(40, device="meta"), comm=comm, check=False, pipeline_bytes=8)
        # Chunks of 20 elements in pieces of 2: the reduce-scatter posts one batch per piece (10), the
        # all-gather one per step (1); nothing is posted directly.
        assert comm.batches == 11 and not comm.outstanding
