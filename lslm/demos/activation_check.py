"""Activation bytes of one transformer layer, measured, next to Korthikanti et al. (2022) Table 2.

What is measured: the bytes autograd saves for backward during one lslm
:class:`~lslm.models.gpt.Block`'s forward, with :class:`~lslm.metrics.ActivationMemory`
(unique storages, parameters excluded), in fp32 on the CPU. Two ways, which agree exactly:
saved-tensor hooks around one block, and the difference between a whole GPT of two
layers and one of one layer. :func:`saved_tensors` lists what was saved (autograd node,
field, shape, dtype) so every term of :func:`lslm.metrics.activation_theory.layer_terms`
can be checked against the real tensor.

Attention runs through SDPA's math backend (``attention="math"``): it materialises and
saves the ``s x s`` probabilities, the paper's ``5as/h`` term. The fused ("flash") CPU
kernel saves only O(s) statistics (``attention="flash"``, dropout 0: on CPU it has no
dropout, so any ``dropout_p > 0`` falls back to the math path anyway).

:func:`tp_worker` measures the same block per rank after ``apply_tensor_parallel``, for
several tensor-parallel sizes in one launch, sequence parallelism off and on; :func:`run`
puts serial and tensor-parallel measurements in one table for the notebook. Both also read glibc's
allocator around one more forward of the block (:func:`~lslm.metrics.malloc_delta.saved_by_allocator`): the
bytes its graph holds, nothing registered, on each rank.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import nn

from lslm.metrics.activation_theory import adapted_layer_bytes, korthikanti_layer_bytes, layer_terms
from lslm.metrics.activations import ActivationMemory
from lslm.metrics.malloc_delta import saved_by_allocator
from lslm.metrics.storage import storage_of

__all__ = ["attention_backend", "block_config", "run", "saved_tensors", "serial_layer", "table", "plot",
           "tp_worker"]

ATTENTION = ("math", "flash")


def block_config(s: int, b: int, h: int, a: int, dropout: float, n_layer: int = 1) -> Any:
    """The :class:`~lslm.models.gpt.GPTConfig` of a measurement: context ``s``, width ``h``, ``a`` heads."""
    from lslm.models.gpt import GPTConfig

    return GPTConfig(vocab_size=128, block_size=s, n_layer=n_layer, n_head=a, n_embd=h, dropout=dropout)


@contextlib.contextmanager
def attention_backend(kind: str) -> Iterator[None]:
    """Force SDPA's ``"math"`` backend (saves the ``s^2`` probabilities) or its fused ``"flash"`` one."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    if kind not in ATTENTION:
        raise ValueError(f"attention must be one of {ATTENTION}, got {kind!r}")
    with sdpa_kernel(SDPBackend.MATH if kind == "math" else SDPBackend.FLASH_ATTENTION):
        yield


def _check_sizes(s: int, b: int, h: int, a: int, dropout: float, attention: str) -> None:
    # layer_terms validates sizes and the attention kind; dropout is a probability here.
    layer_terms(s, b, h, a, attention=attention, dropout=dropout > 0)
    if not 0.0 <= dropout < 1.0:
        raise ValueError(f"dropout must be in [0, 1), got {dropout!r}")


def saved_tensors(fn: Callable[[], torch.Tensor], exclude: nn.Module | None = None) -> tuple[torch.Tensor, list[dict]]:
    """Run ``fn()`` under saved-tensor hooks; return its output and one row per saved tensor, in forward order.

    Each row: ``saved_by`` (autograd node and field, read from the graph after the
    forward), ``shape``, ``dtype``, ``storage_bytes`` and ``new`` (first time this storage
    is saved: the rows with ``new`` sum to :class:`ActivationMemory`'s bytes). Tensors of
    ``exclude``'s parameters and buffers are left out, as ActivationMemory leaves them out.
    """
    skip = {storage_of(p)[0] for p in (*exclude.parameters(), *exclude.buffers())} if exclude is not None else set()
    packed: list[tuple[Any, tuple[int, ...], torch.dtype, int]] = []

    def pack(t: torch.Tensor) -> torch.Tensor:
        key, nbytes, _ = storage_of(t)
        if key not in skip:
            packed.append((key, tuple(t.shape), t.dtype, nbytes))
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = fn()
    names = _names_by_shape_and_storage(out)
    rows, seen = [], set()
    for key, shape, dtype, nbytes in packed:
        candidates = names.get((key, shape), [])
        rows.append({"saved_by": candidates.pop(0) if candidates else "?", "shape": list(shape),
                     "dtype": str(dtype).removeprefix("torch."), "storage_bytes": nbytes, "new": key not in seen})
        seen.add(key)
    return out, rows


def _names_by_shape_and_storage(out: torch.Tensor) -> dict[tuple[Any, tuple[int, ...]], list[str]]:
    """``(storage, shape) -> ["Node.field", ...]`` for every tensor saved in ``out``'s graph (outermost node last)."""
    found: dict[tuple[Any, tuple[int, ...]], list[str]] = {}
    stack, visited = [out.grad_fn], set()
    while stack:
        node = stack.pop()
        if node is None or node in visited:
            continue
        visited.add(node)
        fields = [(f.removeprefix("_saved_"), getattr(node, f)) for f in dir(node) if f.startswith("_saved_")]
        if not fields and hasattr(node, "saved_tensors"):  # a custom autograd Function
            with contextlib.suppress(RuntimeError):
                fields = [(f"saved_tensors[{i}]", v) for i, v in enumerate(node.saved_tensors)]
        for field, value in fields:
            if isinstance(value, torch.Tensor):
                found.setdefault((storage_of(value)[0], tuple(value.shape)), []).insert(0, f"{node.name()}.{field}")
        stack.extend(nxt for nxt, _ in node.next_functions)
    return found


def _measure(fn: Callable[[], torch.Tensor], model: nn.Module, attention: str
             ) -> tuple[ActivationMemory, tuple[torch.Tensor, list[dict]]]:
    """Two forwards of ``fn``: one counted by ActivationMemory, one listed by :func:`saved_tensors`.

    Saved-tensor hooks do not nest (only the innermost pair sees a tensor), so the
    count and the listing cannot share one forward. The second forward's output is returned.
    """
    with attention_backend(attention), ActivationMemory(model) as act:
        fn()
    with attention_backend(attention):
        return act, saved_tensors(fn, exclude=model)


def _allocator_bytes(block: nn.Module, x: torch.Tensor, attention: str) -> int | None:
    """Glibc's figure for what ``block``'s graph keeps (``x`` cloned inside, so the block input it saves counts as
    the hooks count it); ``None`` off glibc or off the CPU. Run after the counted forwards: first calls are behind."""
    if x.device.type != "cpu":
        return None
    with attention_backend(attention):
        got, nodes = saved_by_allocator(lambda: block(x.clone()), repeats=3)
    del nodes
    return got


def _block_input(s: int, b: int, h: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed + 1)
    return torch.randn(b, s, h, generator=g)  # lslm: cpu-ok (seeded CPU generator; callers move it)


def serial_layer(s: int = 64, b: int = 2, h: int = 64, a: int = 8, *, dropout: float = 0.1, attention: str = "math",
                 seed: int = 0) -> dict[str, Any]:
    """Measure one layer on one process, fp32 CPU: hooks around one block, and GPT(2 layers) - GPT(1 layer).

    Returns both byte counts, the saved-tensor rows of the block, the adapted formula
    (:func:`~lslm.metrics.activation_theory.adapted_layer_bytes`) and the paper's
    (:func:`~lslm.metrics.activation_theory.korthikanti_layer_bytes`, 2-byte accounting).
    """
    from lslm.models.gpt import GPT

    _check_sizes(s, b, h, a, dropout, attention)
    whole = {}
    tokens = torch.randint(128, (b, s + 1),
                           generator=torch.Generator().manual_seed(seed))  # lslm: cpu-ok (serial, in-process)
    for n_layer in (1, 2):
        torch.manual_seed(seed)
        model = GPT(block_config(s, b, h, a, dropout, n_layer)).train()
        with attention_backend(attention), ActivationMemory(model) as act:
            model(tokens[:, :-1], tokens[:, 1:])
        whole[n_layer] = act.bytes
    torch.manual_seed(seed)
    model = GPT(block_config(s, b, h, a, dropout, 1)).train()
    x = _block_input(s, b, h, seed).requires_grad_()
    act, (_, rows) = _measure(lambda: model.blocks[0](x), model, attention)
    options = dict(dropout=dropout > 0, attention=attention)
    return {"config": "serial", "t": 1, "sequence_parallel": False, "s": s, "b": b, "h": h, "a": a,
            "measured_bytes": act.bytes, "difference_bytes": whole[2] - whole[1], "saved": rows,
            "allocator_bytes": _allocator_bytes(model.blocks[0], x, attention),
            "adapted_bytes": adapted_layer_bytes(s, b, h, a, **options),
            "paper_bytes": korthikanti_layer_bytes(s, b, h, a),
            "paper_fp32_bytes": korthikanti_layer_bytes(s, b, h, a, act_bytes=4, mask_bytes=4)}


#: Tensor-parallel measurement modes: (sequence parallel, column layers re-gather their input in backward).
MODES = {"tp": (False, True), "sp": (True, True), "sp-keep-gathered": (True, False)}


def tp_worker(s: int = 64, b: int = 2, h: int = 64, a: int = 8, dropout: float = 0.1, attention: str = "math",
              seed: int = 0, modes: tuple[str, ...] = ("tp", "sp"), tps: tuple[int, ...] | None = None,
              listing: bool = True) -> dict[str, Any]:
    """Launch target: one block's saved bytes on this rank for each tensor-parallel size in ``tps`` and each mode.

    ``tps`` defaults to the world size; each must divide it (``t`` smaller than the world:
    the other ranks form further tensor-parallel groups, data parallel to this one, so one
    launch measures several ``t``). Modes (:data:`MODES`): ``"tp"`` tensor parallelism,
    ``"sp"`` with sequence parallelism (column layers save their sequence slice and
    re-gather it in backward, as Megatron), ``"sp-keep-gathered"`` (they save the gathered
    input instead). Every rank builds the same one-layer GPT from ``seed``, applies
    ``apply_tensor_parallel``, feeds its block the same input (its sequence slice under
    sequence parallelism) and counts what the block saves (forward only: see the comment in
    :func:`_measure_tp`). Returns per ``(t, mode)`` the measured bytes and the
    adapted and paper formulas (and, on rank 0 if ``listing``, the saved tensors).
    """
    from lslm.runtime import ParallelContext, RankGrid, init_distributed

    unknown = [m for m in modes if m not in MODES]
    if unknown:
        raise ValueError(f"unknown modes {unknown}; choose from {list(MODES)}")
    world = int(os.environ.get("WORLD_SIZE", "1"))  # as torchrun set it
    tps = (world,) if tps is None else tuple(tps)
    if any(world % t for t in tps):
        raise ValueError(f"every tensor-parallel size in {tps} must divide the world size {world}")
    with init_distributed(tp=world, seed=seed) as ctx:
        results = []
        for t in tps:
            # Groups are created collectively: every rank builds every context, in the same order.
            pctx = ctx if t == world else ParallelContext.create(
                RankGrid.build(world, tp=t), rank=ctx.rank, local_rank=ctx.local_rank, node_rank=ctx.node_rank,
                device=ctx.device, backend=ctx.backend, timeout_s=ctx.timeout_s)
            for mode in modes:
                res = _measure_tp(pctx, mode, s, b, h, a, dropout, attention, seed)
                if not (listing and ctx.rank == 0):
                    res.pop("saved")
                results.append(res)
        ctx.barrier()
    return {"rank": ctx.rank, "results": results}


def _measure_tp(pctx: Any, mode: str, s: int, b: int, h: int, a: int, dropout: float, attention: str,
                seed: int) -> dict[str, Any]:
    """One block under ``apply_tensor_parallel`` over ``pctx``'s TP group in ``mode``; see :func:`tp_worker`."""
    from lslm.models.gpt import GPT
    from lslm.tensor_parallel.apply import apply_tensor_parallel

    t = pctx.tp_size
    sp, regather = MODES[mode]
    torch.manual_seed(seed)
    model = GPT(block_config(s, b, h, a, dropout, 1)).to(pctx.device).train()
    apply_tensor_parallel(model, pctx, sequence_parallel=sp, regather_input=regather)
    x = _block_input(s, b, h, seed).to(pctx.device)
    if sp:  # under sequence parallelism the GPT runs sequence-first: this rank's (s/t, b, h) slice
        x = x.transpose(0, 1).chunk(t, dim=0)[pctx.tp_rank]
    x = x.contiguous().requires_grad_()
    act, (y, rows) = _measure(lambda: model.blocks[0](x), model, attention)
    # No backward here: the bytes are counted in the forward, and the re-gathering backward is
    # tested in tests/test_tp_layers.py and tests/test_tp_model.py. A 4-process launch of this
    # worker *with* a backward aborted at exit ("terminate called without an active exception",
    # SIGABRT in native code) in about 1 of 15 runs on torch 2.13 / gloo; cause not found yet.
    del y
    allocator = _allocator_bytes(model.blocks[0], x, attention)
    # Float dropout noise on the CPU, a bool mask from the fused kernel elsewhere (not measured here).
    options = dict(dropout=dropout > 0, attention=attention, regather=regather,
                   mask_bytes=4 if pctx.device.type == "cpu" else 1)
    return {"config": f"t={t}" + {"tp": "", "sp": " +SP", "sp-keep-gathered": " +SP (keep)"}[mode],
            "mode": mode, "t": t, "tp_rank": pctx.tp_rank, "sequence_parallel": sp, "regather": regather,
            "s": s, "b": b, "h": h, "a": a, "measured_bytes": act.bytes, "allocator_bytes": allocator,
            "adapted_bytes": adapted_layer_bytes(s, b, h, a, t, sp, **options),
            "paper_bytes": korthikanti_layer_bytes(s, b, h, a, t, sp),
            "paper_fp32_bytes": korthikanti_layer_bytes(s, b, h, a, t, sp, act_bytes=4, mask_bytes=4), "saved": rows}


def run(s: int = 64, b: int = 2, h: int = 64, a: int = 8, tps: tuple[int, ...] = (2, 4), *, dropout: float = 0.1,
        attention: str = "math", seed: int = 0, timeout: float = 120.0, **launch_kwargs: Any) -> list[dict[str, Any]]:
    """Serial measurement here, then one launch of ``max(tps)`` processes measuring every ``t`` in ``tps``
    (SP off and on): one row per configuration.

    Each row: ``config``, ``t``, ``sequence_parallel``, ``measured_bytes`` (rank 0; the
    test checks every rank), ``allocator_bytes`` (glibc's figure for the same block's graph on that rank,
    :func:`~lslm.metrics.malloc_delta.saved_by_allocator`; ``None`` off glibc), ``adapted_bytes``,
    ``paper_bytes`` and the ratios ``measured / adapted`` and ``measured / paper``. The workers run on the CPU with gloo
    whatever the machine: the accounting is that of fp32 on the CPU (float dropout noise).
    """
    from lslm.launcher.launch import launch

    _check_sizes(s, b, h, a, dropout, attention)
    for t in tps:
        layer_terms(s, b, h, a, t, True)  # ValueError before any process starts
        if max(tps) % t:
            raise ValueError(f"one launch of max(tps)={max(tps)} processes measures every t: each t in {tps} "
                             "must divide it")
    rows = [serial_layer(s, b, h, a, dropout=dropout, attention=attention, seed=seed)]
    if tps:
        options = {"output": "none", "env": {"LSLM_DEVICE": "cpu", "LSLM_BACKEND": "gloo"}, **launch_kwargs}
        res = launch("lslm.demos.activation_check:tp_worker", nproc=max(tps), timeout=timeout, **options,
                     s=s, b=b, h=h, a=a, dropout=dropout, attention=attention, seed=seed, tps=list(tps),
                     listing=False)
        rows.extend(res[0]["results"])
    for row in rows:
        row["measured_over_adapted"] = row["measured_bytes"] / row["adapted_bytes"]
        row["measured_over_paper"] = row["measured_bytes"] / row["paper_bytes"]
        row["measured_over_paper_fp32"] = row["measured_bytes"] / row["paper_fp32_bytes"]
    return rows


def table(rows: list[dict[str, Any]]) -> str:
    """The rows of :func:`run` as a fixed-width text table (bytes per layer per rank).

    Columns: measured; the adapted formula (our tensors); the paper's Table 2 (2-byte
    activations, 1-byte masks); the paper's list of tensors at our widths (4 and 4 bytes); with
    allocator figures (CPU, glibc), glibc's bytes for the same graph and its excess over ``measured``.
    """
    alloc = all(r.get("allocator_bytes") is not None for r in rows)
    head = (f"{'configuration':<14}{'measured':>11}{'adapted':>11}{'/adapted':>9}{'paper':>10}{'/paper':>8}"
            f"{'paper@fp32':>12}{'/paper@fp32':>12}" + (f"{'allocator':>11}{'/measured':>10}" if alloc else ""))
    lines = [head, "-" * len(head)]
    for r in rows:
        m = r["measured_bytes"]
        lines.append(f"{r['config']:<14}{m:>11,}{r['adapted_bytes']:>11,}{m / r['adapted_bytes']:>9.4f}"
                     f"{r['paper_bytes']:>10,.0f}{m / r['paper_bytes']:>8.3f}"
                     f"{r['paper_fp32_bytes']:>12,.0f}{m / r['paper_fp32_bytes']:>12.4f}"
                     + (f"{r['allocator_bytes']:>11,}{r['allocator_bytes'] / m:>10.3f}" if alloc else ""))
    return "\n".join(lines)


def plot(rows: list[dict[str, Any]]) -> Any:
    """Bars per configuration: measured, the allocator's figure (where there is one), adapted formula, the paper's
    (2-byte) formula, in KiB; returns the figure."""
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(9, 4.2), dpi=80)
    x = range(len(rows))
    series = [("measured_bytes", "measured (fp32, CPU)"), ("adapted_bytes", "adapted formula (our tensors, fp32)"),
              ("paper_bytes", "Korthikanti et al. Table 2 (2-byte)")]
    if all(r.get("allocator_bytes") is not None for r in rows):
        series.insert(1, ("allocator_bytes", "glibc allocator (mallinfo2)"))
    w = 0.8 / len(series)
    for k, (key, label) in enumerate(series):
        ax.bar([i + (k - (len(series) - 1) / 2) * w for i in x], [r[key] / 1024 for r in rows], w, label=label)
    r0 = rows[0]
    ax.set(xticks=list(x), xticklabels=[r["config"] for r in rows], xlabel="configuration (t = tensor-parallel size)",
           ylabel="activation memory per layer per rank (KiB)",
           title=f"saved for backward by one layer (s={r0['s']}, b={r0['b']}, h={r0['h']}, a={r0['a']})")
    ax.legend(fontsize=9)
    fig.tight_layout()
    return fig
