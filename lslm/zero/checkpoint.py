"""Sharded ZeRO checkpoints: each rank writes its slice, a manifest says what is where, any dp size loads it.

**Save** (:func:`save_zero`, collective over the dp group). Every rank writes one file,
``rank{r}-of-{N}.pt``, holding for each piece of a parameter it owns (:class:`~lslm.zero.layout.Piece`)
the parameter's name, the element range, its fp32 master values and the optimizer's state of
that range (Adam's moments; scalars such as ``step`` once), plus the scaler. The file goes to a
temporary name, is flushed to disk (``fsync``) and renamed into place; only when every rank's
file is there does rank 0 write ``manifest.json`` the same way, with the world size, the stage,
every parameter's name and shape, each file's element ranges, size and SHA-256, the step and
free ``extra`` fields. A checkpoint is complete exactly when its manifest exists: a job killed
mid-save leaves a folder without one, and the previous checkpoint (another folder) untouched.

**Load** (:func:`load_zero`). The manifest is checked against the model (names and shapes:
another model is refused, naming the first difference), then each rank reads only the files
whose ranges overlap its own pieces (``torch.load(weights_only=True)``), after checking their
size and hash (a truncated or corrupted file is refused, naming it), and copies the overlaps
into its masters and optimizer state. Because each rank reads only some files, the ranks agree
before anything is published: a file refused on one rank is refused on every rank, none loads.
So a checkpoint written at ``N`` ranks loads at any ``M`` (2 -> 3, 4 -> 2): resharding is a matter
of element ranges, because a slice is a range of the flattened parameters. :func:`consolidate`
rebuilds full fp32 parameters in one process (the "zero_to_fp32" question) and :func:`export_dcp`
writes it in PyTorch's distributed-checkpoint format, which FSDP2 loads at any world size.
"""

from __future__ import annotations

import hashlib
import io
import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

from lslm.runtime.files import atomic_write_bytes
from lslm.zero.optimizer import ZeroOptimizer

__all__ = ["FORMAT", "MANIFEST", "consolidate", "export_dcp", "latest_checkpoint", "load_zero", "needed_shards",
           "read_manifest", "save_zero", "shard_name"]

FORMAT = "lslm-zero/1"
MANIFEST = "manifest.json"


def shard_name(rank: int, world: int) -> str:
    """The file rank ``rank`` of ``world`` writes."""
    return f"rank{rank:05d}-of-{world:05d}.pt"


def _names(zero: ZeroOptimizer) -> list[str]:
    names = {id(p): n for n, p in zero.model.named_parameters()}
    return [names[id(p)] for p in zero.params]


def _shapes(zero: ZeroOptimizer) -> list[list[int]]:
    return [list(s) for s in zero.shapes]


def _piece_values(zero: ZeroOptimizer) -> list[tuple[torch.Tensor, dict[str, Any]]]:
    """Per piece: its fp32 master and optimizer state (tensors of the piece's shape are sliceable; scalars are
    copied as they are), read from the files under disk offload."""
    if zero.disk is not None:
        return zero.disk.read_all(zero.optimizer.state if zero.optimizer is not None else {})
    out = []
    for m in zero.masters:
        state = zero.optimizer.state.get(m, {}) if zero.optimizer is not None else {}
        out.append((m.detach().float().clone(),
                    {k: (v.detach().clone() if isinstance(v, torch.Tensor) else v) for k, v in state.items()}))
    return out


def save_zero(zero: ZeroOptimizer, folder: str | Path, *, step: int, extra: Mapping[str, Any] | None = None) -> Path:
    """Write this rank's shard and (rank 0, after every rank's) the manifest into ``folder``; return the folder.

    Collective over the dp group. ``step`` and ``extra`` (JSON-serialisable) are kept in the manifest.
    Raises ``ValueError`` if ``folder`` already holds a complete checkpoint (never overwritten in place:
    save each step to its own folder, so the previous one survives a failed save).
    """
    folder = Path(folder)
    if zero.replicas > 1:
        raise ValueError(f"saving under HSDP ({zero.replicas} replicas of each shard) is not implemented: every "
                         "replica would write the same shard files; load_zero works (any layout loads)")
    if (folder / MANIFEST).exists():
        raise ValueError(f"{folder} already holds a complete checkpoint; save to a new folder (one per step)")
    names = _names(zero)
    pieces = []
    for pc, (master, state) in zip(zero.layout.pieces, _piece_values(zero)):
        pieces.append({"param": names[pc.param], "start": pc.start, "stop": pc.stop, "master": master,
                       "state": state})
    payload = {"format": FORMAT, "rank": zero.rank, "world": zero.world, "pieces": pieces,
               "param_groups": [{k: v for k, v in g.items() if k != "params"} for g in zero.param_groups],
               "scaler": zero.scaler.state_dict() if zero.scaler is not None else None}
    buf = io.BytesIO()
    torch.save(payload, buf)
    data = buf.getvalue()
    name = shard_name(zero.rank, zero.world)
    error: OSError | None = None
    try:
        atomic_write_bytes(folder / name, data)
    except OSError as e:  # a full disk, a read-only folder: every rank must hear of it, not hang
        error = e
    ok = torch.full((1,), 0.0 if error is not None else 1.0, device=zero.device)
    record = {"file": name, "bytes": len(data), "sha256": hashlib.sha256(data).hexdigest(),
              "ranges": [[p["param"], p["start"], p["stop"]] for p in pieces]}
    zero.ctx.comm.all_reduce(ok, op=torch.distributed.ReduceOp.MIN, group=zero.group, label="zero checkpoint")
    if not bool(ok.item()):
        if error is not None:
            raise OSError(f"could not write {folder / name}: {error}") from error
        raise OSError(f"another rank could not write its shard into {folder}; no manifest written, so the previous "
                      "checkpoint stays the last complete one")
    records = zero.ctx.comm.all_gather_object(record, group=zero.group, label="zero checkpoint")
    if zero.rank == 0:
        manifest = {"format": FORMAT, "world": zero.world, "stage": zero.stage, "dtype": str(zero.dtype),
                    "step": int(step), "extra": dict(extra or {}),
                    "params": [{"name": n, "shape": s} for n, s in zip(names, _shapes(zero))], "shards": records}
        atomic_write_bytes(folder / MANIFEST, json.dumps(manifest, indent=1).encode())
    zero.ctx.comm.barrier(group=zero.group, label="zero checkpoint")  # nobody reads it before it exists
    return folder


def read_manifest(folder: str | Path) -> dict[str, Any]:
    """The manifest of the checkpoint in ``folder``; ``ValueError`` if there is none (an incomplete save)."""
    path = Path(folder) / MANIFEST
    if not path.exists():
        raise ValueError(f"{folder} has no {MANIFEST}: not a complete lslm ZeRO checkpoint (a save interrupted "
                         "before every shard was written leaves none)")
    manifest = json.loads(path.read_text())
    if manifest.get("format") != FORMAT:
        raise ValueError(f"{path} is format {manifest.get('format')!r}, expected {FORMAT!r}")
    return manifest


def latest_checkpoint(root: str | Path) -> Path | None:
    """The complete checkpoint (a sub-folder with a manifest) of the highest step under ``root``; ``None`` if none.

    Folders without a manifest (a save cut short) are skipped, so the previous checkpoint is the one resumed.
    """
    best: tuple[int, Path] | None = None
    for folder in Path(root).glob("*") if Path(root).is_dir() else ():
        if (folder / MANIFEST).is_file():
            try:
                step = int(read_manifest(folder)["step"])
            except (ValueError, KeyError, json.JSONDecodeError):
                continue
            if best is None or step > best[0]:
                best = (step, folder)
    return best[1] if best is not None else None


def _read_shard(folder: Path, record: Mapping[str, Any]) -> dict[str, Any]:
    path = folder / record["file"]
    if not path.exists():
        raise ValueError(f"{path} is missing (the manifest lists it)")
    data = path.read_bytes()
    if len(data) != record["bytes"]:
        raise ValueError(f"{path} has {len(data)} bytes, the manifest says {record['bytes']}: truncated or replaced")
    if hashlib.sha256(data).hexdigest() != record["sha256"]:
        raise ValueError(f"{path} does not match its SHA-256 in the manifest: corrupted or replaced")
    return torch.load(io.BytesIO(data), weights_only=True)


def _check_model(zero: ZeroOptimizer, manifest: Mapping[str, Any], path: Path) -> None:
    saved = [(p["name"], list(p["shape"])) for p in manifest["params"]]
    here = list(zip(_names(zero), _shapes(zero)))
    if sorted(saved) != sorted(here):
        diff = sorted(set(map(str, saved)) ^ set(map(str, here)))
        raise ValueError(f"the checkpoint {path} holds another model: {len(saved)} parameters there, {len(here)} here; "
                         f"first difference {diff[0] if diff else '(order)'}")


def needed_shards(zero: ZeroOptimizer, manifest: Mapping[str, Any]) -> list[Mapping[str, Any]]:
    """The manifest's shard records holding an element of one of this rank's pieces: only those are read.

    Two element ranges ``[s, b)`` and ``[a, z)`` of one parameter overlap when ``s < z`` and ``a < b``.
    """
    names = _names(zero)
    mine = [(names[pc.param], pc.start, pc.stop) for pc in zero.layout.pieces]
    return [rec for rec in manifest["shards"]
            if any(n == p and s < z and a < b for n, s, b in mine for p, a, z in rec["ranges"])]


def _agreement_group(zero: ZeroOptimizer) -> Any:
    """Every rank that loads this checkpoint together: the dp group (replicas included), and with tensor or pipeline
    parallelism every rank of the job (dp x tp x pp; context parallelism is refused by ZeroOptimizer)."""
    ctx = zero.ctx
    return ctx.group("dp", "tp", "pp") if ctx.tp_size * ctx.pp_size > 1 else ctx.group("dp")


def _read_pieces(zero: ZeroOptimizer, folder: Path) -> tuple[dict[str, Any], list[torch.Tensor],
                                                              list[dict[str, Any]], Any]:
    """Everything this rank needs from the checkpoint, read and checked, nothing of ``zero`` changed yet:
    the manifest, the masters and optimizer state of each piece, the scaler's state."""
    manifest = read_manifest(folder)
    _check_model(zero, manifest, folder / MANIFEST)
    names = _names(zero)
    mine = [(names[pc.param], pc.start, pc.stop) for pc in zero.layout.pieces]
    values = _piece_values(zero)  # clones: filled here, published only once every rank has read its part
    masters = [v[0] for v in values]
    states = [v[1] for v in values]
    filled = [0] * len(mine)
    shard_scalars: dict[str, Any] = {}
    scaler_state = None
    for rec in needed_shards(zero, manifest):
        shard = _read_shard(folder, rec)
        scaler_state = shard["scaler"]
        for piece in shard["pieces"]:
            for k, (n, s, b) in enumerate(mine):
                lo, hi = max(s, piece["start"]), min(b, piece["stop"])
                if n != piece["param"] or lo >= hi:
                    continue
                src = slice(lo - piece["start"], hi - piece["start"])
                dst = slice(lo - s, hi - s)
                masters[k][dst].copy_(piece["master"][src])
                for key, value in piece["state"].items():
                    if isinstance(value, torch.Tensor) and value.dim() == 1 and value.numel() == piece["stop"] - \
                            piece["start"]:
                        states[k].setdefault(key, torch.zeros(b - s, dtype=value.dtype, device=masters[k].device))
                        states[k][key][dst].copy_(value[src])
                    else:
                        shard_scalars[key] = value  # step counts: the same for every piece
                filled[k] += hi - lo
    missing = [m for m, f in zip(mine, filled) if f != m[2] - m[1]]
    if missing:
        raise ValueError(f"the checkpoint in {folder} does not cover {missing[0]} (its shards' ranges leave a gap)")
    for state in states:
        for key, value in shard_scalars.items():
            state[key] = value.clone() if isinstance(value, torch.Tensor) else value
    return manifest, masters, states, scaler_state


@torch.no_grad()
def load_zero(zero: ZeroOptimizer, folder: str | Path) -> dict[str, Any]:
    """Load the checkpoint in ``folder`` into ``zero`` (any dp size, any stage); return its manifest.

    Collective: every rank of the dp group (with tp or pp, of the job) calls it. Each rank reads
    only the shards overlapping its pieces (:func:`needed_shards`). The masters, the optimizer state
    of each piece and the scaler are restored (hyper-parameters such as ``lr`` stay as the optimizer
    was built: a schedule sets them from the step); the model's parameters follow from the masters
    (cast and, below stage 3, all-gathered). Raises ``ValueError`` for an incomplete checkpoint,
    another model, a missing, truncated or corrupted shard, **on every rank alike**: a rank reads
    only some files, so before anything is published the ranks agree (one all-reduce of a flag), and
    if any rank failed every rank raises, naming each failing rank's reason and file. Nothing of
    ``zero`` has changed then, so a caller may fall back to another checkpoint on every rank.
    """
    folder = Path(folder)
    error: Exception | None = None
    try:
        manifest, masters, states, scaler_state = _read_pieces(zero, folder)
    except Exception as e:  # any failure must reach the agreement below: a rank that raised here would leave the
        error = e           # others waiting in the all-reduce until the collective timeout
    group = _agreement_group(zero)
    ok = torch.full((1,), 0.0 if error is not None else 1.0, device=zero.device)
    zero.ctx.comm.all_reduce(ok, op=torch.distributed.ReduceOp.MIN, group=group, label="zero checkpoint")
    if not bool(ok.item()):
        mine = None if error is None else f"rank {zero.ctx.rank}: {type(error).__name__}: {error}"
        reasons = [r for r in zero.ctx.comm.all_gather_object(mine, group=group, label="zero checkpoint") if r]
        raise ValueError(f"the checkpoint in {folder} was refused on every rank, nothing loaded; "
                         + "; ".join(reasons)) from error
    if zero.disk is not None:  # the states go back to their files; the weights go up from the loaded masters
        zero.disk.write_all(list(zip(masters, states)))
        for view, master in zip(zero._owned, masters):
            view.copy_(master)
        if zero.optimizer is not None:  # only the scalars (Adam's step) stay resident, as after a step
            for m, master, state in zip(zero.masters, masters, states):
                zero.optimizer.state[m] = {k: v for k, v in state.items() if not (
                    isinstance(v, torch.Tensor) and v.dim() == 1 and v.numel() == master.numel())}
    else:
        for m, master in zip(zero.masters, masters):
            m.copy_(master)
        if zero.optimizer is not None:
            for m, state in zip(zero.masters, states):
                zero.optimizer.state[m] = state
    if zero.scaler is not None and scaler_state is not None:
        zero.scaler.load_state_dict(scaler_state)
    zero._publish()
    return manifest


def consolidate(folder: str | Path, *, with_state: bool = False) -> Any:
    """Every parameter whole, in fp32, from the shard files alone (one process, no process group).

    ``with_state=True`` returns ``(params, state)``: ``state[name]`` holds the optimizer's state of
    that parameter, whole (Adam's ``exp_avg``/``exp_avg_sq`` shaped like it, ``step`` as saved), what
    a plain torch optimizer over the consolidated parameters needs to continue the run.
    """
    folder = Path(folder)
    manifest = read_manifest(folder)
    numel = {p["name"]: int(torch.Size(p["shape"]).numel()) for p in manifest["params"]}
    flat = {n: torch.zeros(k, dtype=torch.float32) for n, k in numel.items()}  # lslm: cpu-ok (one process, files)
    state: dict[str, dict[str, Any]] = {n: {} for n in numel}
    for rec in manifest["shards"]:
        for piece in _read_shard(folder, rec)["pieces"]:
            name, a, z = piece["param"], piece["start"], piece["stop"]
            flat[name][a:z].copy_(piece["master"])
            for key, value in piece["state"].items():
                if isinstance(value, torch.Tensor) and value.dim() == 1 and value.numel() == z - a:
                    zeros = torch.zeros(numel[name], dtype=value.dtype)  # lslm: cpu-ok (one process, files)
                    state[name].setdefault(key, zeros)[a:z].copy_(value)
                else:
                    state[name][key] = value
    shapes = {p["name"]: p["shape"] for p in manifest["params"]}
    params = {n: flat[n].view(shapes[n]) for n in flat}
    if not with_state:
        return params
    return params, {n: {k: (v.view(shapes[n]) if isinstance(v, torch.Tensor) and v.numel() == numel[n] and v.dim() == 1
                            else v) for k, v in st.items()} for n, st in state.items()}


def export_dcp(folder: str | Path, dcp_dir: str | Path) -> Path:
    """Write the checkpoint in ``folder`` as a ``torch.distributed.checkpoint`` (DCP) folder; return it.

    The state dict is ``{"model": {name: fp32 tensor}, "optim": {name: {state key: tensor}}}`` from
    :func:`consolidate` (one process, no process group), converted with PyTorch's
    ``format_utils.torch_save_to_dcp``: FSDP2 or any DCP reader loads it at whatever world size
    (``dcp.load`` reshards), and ``format_utils.dcp_to_torch_save`` turns it back into one file.
    """
    import tempfile

    from torch.distributed.checkpoint.format_utils import torch_save_to_dcp

    params, state = consolidate(folder, with_state=True)
    with tempfile.TemporaryDirectory() as tmp:
        whole = Path(tmp) / "consolidated.pt"
        torch.save({"model": params, "optim": state}, whole)
        torch_save_to_dcp(str(whole), str(dcp_dir))
    return Path(dcp_dir)
