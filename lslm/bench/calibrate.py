"""Calibration measurements of one device: what the calculator's presets and the course's GPU claims rest on.

Five parts, each a list of rows whose field names are those of the shared H200 file
(``../shared/gpu/h200_2026-11-28.json``), so one reader takes both:

* ``gemm``: bf16 ``a @ w.t()`` for a transformer layer's four GEMMs (``qkv``, ``proj``, ``fc1``, ``fc2``):
  ``tokens, hidden, gemm, n, k, s, tflops`` (``2·tokens·n·k`` flops), and the same GEMM and its two backward
  GEMMs launched back to back (``s_queued``, ``s_dgrad``, ``s_wgrad`` and their ``tflops_*``): whether a GEMM
  timed alone reads slower than in a step, and what the backward's shapes run at (:func:`gemm`);
* ``attention``: ``F.scaled_dot_product_attention``, causal, bf16, forward + backward:
  ``head_dim, seq, batch, heads, s_fwd_bwd, tflops`` (flops ``3.5 x 4·B·H·s²·d / 2``: two forward matmuls,
  backward 2.5x the forward, half of the square under the causal mask);
* ``adamw``: one ``torch.optim.AdamW.step`` (fused on CUDA) over fp32 parameters:
  ``params, s, gbytes_per_s`` (28 bytes per parameter: read p, g, m, v; write p, m, v);
* ``gpt``: lslm's GPT trained in bf16 autocast with AdamW: ``step_s, tokens_per_s, mfu`` (flops
  ``6·N·tokens + 6·L·h·s²·B`` by :func:`lslm.metrics.flops.gpt_step_flops`, ``N`` the matmul weights, head
  included, embedding lookups not; over ``peak_bf16_dense``) and allocator bytes on CUDA
  (``mem_states_bytes`` before the forward, ``mem_peak_bytes`` during forward + backward, their difference
  ``mem_activation_bytes``, ``reserved_bytes``, and ``mem_start_bytes``: allocated before the model is built, what
  earlier runs left; None on the CPU);
* ``recompute`` (:func:`gpt_recompute`): the same GPT at 407M and 1.4B parameters (micro-batch 8) with
  ``apply_recompute`` ``none`` / ``selective`` / ``full``, the ``gpt`` fields plus ``recompute`` and the dtypes its
  matmuls and attention ran in (``matmul_flops_by_dtype``, ``attention_calls_by_dtype``): the runs of the shared
  ``h200_recompute_2026-11-28.json``, measured again with replays under the forward's autocast.

Every time is a median over repeats after warm-ups, timed with CUDA events on a GPU (the stream's own
time, not the host's queueing) and ``perf_counter`` on the CPU, where ops are synchronous and
``torch.cuda`` is never touched. :data:`SIZES` holds the GPU sizes (small enough for the whole
``lslm gpu-check`` to stay under five minutes) and tiny CPU sizes that only exercise the code paths.
"""

from __future__ import annotations

import gc
import statistics
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F

from lslm.metrics.flops import DEVICE_PEAKS, gpt_step_flops, peak_for

__all__ = ["PEAK_BF16_DENSE", "SIZES", "adamw", "attention", "gemm", "gpt", "gpt_recompute", "peak_flops",
           "time_median"]

#: Dense bf16 peak by GPU name: :data:`lslm.metrics.flops.DEVICE_PEAKS`' bf16 column (vendor datasheets, no
#: sparsity), the MFU denominators. Unknown GPU: MFU is None.
PEAK_BF16_DENSE = {gpu: peaks["bf16"] for gpu, peaks in DEVICE_PEAKS.items() if "bf16" in peaks}

#: sizes per part: "gpu" for a real check, "tiny" for the CPU dry run (code paths and JSON only)
SIZES: dict[str, dict[str, Any]] = {
    "gpu": {"gemm": {"tokens": (2048, 8192), "hidden": (768, 2048, 4096)},
            "attention": {"head_dim": (64, 128), "seq": (1024, 4096, 8192), "tokens": 16384},
            "adamw": {"params": (25_000_000, 100_000_000)},
            "gpt": [{"name": "124M", "n_layer": 12, "n_embd": 768, "n_head": 12, "micro_batch": 4},
                    {"name": "350M", "n_layer": 24, "n_embd": 1024, "n_head": 16, "micro_batch": 4}],
            "recompute": [{"name": "407M", "n_layer": 24, "n_embd": 1024, "n_head": 16, "micro_batch": 8},
                          {"name": "1.4B", "n_layer": 24, "n_embd": 2048, "n_head": 16, "micro_batch": 8}],
            "gpt_seq": 2048, "gpt_vocab": 50304, "repeats": 10, "recompute_repeats": 5},
    "tiny": {"gemm": {"tokens": (64,), "hidden": (32,)},
             "attention": {"head_dim": (16,), "seq": (64,), "tokens": 128},
             "adamw": {"params": (10_000,)},
             "gpt": [{"name": "tiny", "n_layer": 1, "n_embd": 32, "n_head": 2, "micro_batch": 2}],
             "recompute": [{"name": "tiny", "n_layer": 2, "n_embd": 32, "n_head": 2, "micro_batch": 2}],
             "gpt_seq": 32, "gpt_vocab": 256, "repeats": 2, "recompute_repeats": 2},
}


def peak_flops(device_name: str) -> float | None:
    """The dense bf16 peak of the GPU called ``device_name`` (:func:`lslm.metrics.flops.peak_for`), else None."""
    return peak_for(device_name, "bf16")


def time_median(fn: Callable[[], Any], device: torch.device, *, warmup: int = 2, repeats: int = 10) -> float:
    """Median seconds of ``fn()`` over ``repeats`` calls after ``warmup`` untimed ones.

    On CUDA each call is bracketed by two events on the current stream and the host waits for the
    second (the kernels' time, not their launch); on the CPU ``perf_counter`` (ops are synchronous).
    """
    if repeats < 1:
        raise ValueError(f"repeats must be >= 1, got {repeats}")
    for _ in range(warmup):
        fn()
    times = []
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        for _ in range(repeats):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) / 1e3)
    else:
        for _ in range(repeats):
            t0 = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t0)
    return statistics.median(times)


QUEUED_CALLS = 20  #: GEMMs launched back to back per timed call in :func:`gemm`'s ``*_queued`` and backward figures


def gemm(device: torch.device, sizes: dict[str, Any], repeats: int = 10) -> list[dict[str, Any]]:
    """bf16 GEMM throughput of a layer's four shapes at each token count and hidden size.

    ``s``/``tflops``: one forward GEMM ``a @ w.t()`` between two events (the shared file's figure: a small GEMM's
    launch is inside it). The rest are :data:`QUEUED_CALLS` GEMMs launched back to back per timing, divided by that
    count, as a training step queues them: ``s_queued`` the same forward GEMM, ``s_dgrad`` its input gradient
    ``g @ w`` (``tokens x n`` by ``n x k``) and ``s_wgrad`` its weight gradient ``g.t() @ a`` (``n x tokens`` by
    ``tokens x k``: the reduction runs over the tokens), each with its ``tflops_*`` (``2·tokens·n·k`` flops each).
    """
    out = []
    for tokens in sizes["tokens"]:
        for h in sizes["hidden"]:
            for name, (n, k) in {"qkv": (3 * h, h), "proj": (h, h), "fc1": (4 * h, h), "fc2": (h, 4 * h)}.items():
                a = torch.randn(tokens, k, device=device, dtype=torch.bfloat16)
                w = torch.randn(n, k, device=device, dtype=torch.bfloat16)
                g = torch.randn(tokens, n, device=device, dtype=torch.bfloat16)
                flops = 2 * tokens * n * k
                s = time_median(lambda a=a, w=w: a @ w.t(), device, warmup=3, repeats=repeats)
                row = {"tokens": tokens, "hidden": h, "gemm": name, "n": n, "k": k, "s": s, "tflops": flops / s / 1e12}
                for part, fn in (("queued", lambda a=a, w=w: a @ w.t()), ("dgrad", lambda g=g, w=w: g @ w),
                                 ("wgrad", lambda g=g, a=a: g.t() @ a)):
                    t = time_median(lambda fn=fn: [fn() for _ in range(QUEUED_CALLS)], device, warmup=1,
                                    repeats=max(1, repeats // 2)) / QUEUED_CALLS
                    row[f"s_{part}"], row[f"tflops_{part}"] = t, flops / t / 1e12
                out.append(row)
    return out


def attention(device: torch.device, sizes: dict[str, Any], repeats: int = 5) -> list[dict[str, Any]]:
    """Causal attention forward + backward throughput by head dim and sequence (``tokens`` per call in total)."""
    out = []
    for d in sizes["head_dim"]:
        heads = 16 if d <= 64 else 8  # about 1K model width either way, as the shared file
        for seq in sizes["seq"]:
            batch = max(1, sizes["tokens"] // seq)
            q, k, v = (torch.randn(batch, heads, seq, d, device=device, dtype=torch.bfloat16, requires_grad=True)
                       for _ in range(3))
            grad = torch.randn(batch, heads, seq, d, device=device, dtype=torch.bfloat16)

            def step(q: torch.Tensor = q, k: torch.Tensor = k, v: torch.Tensor = v, grad: torch.Tensor = grad) -> None:
                F.scaled_dot_product_attention(q, k, v, is_causal=True).backward(grad)

            s = time_median(step, device, warmup=2, repeats=repeats)
            flops = 3.5 * 4 * batch * heads * seq * seq * d / 2
            out.append({"head_dim": d, "seq": seq, "batch": batch, "heads": heads, "s_fwd_bwd": s,
                        "tflops": flops / s / 1e12})
    return out


def adamw(device: torch.device, sizes: dict[str, Any], repeats: int = 5) -> list[dict[str, Any]]:
    """One AdamW step's time and state traffic (28 bytes per fp32 parameter) by parameter count."""
    out = []
    fused = device.type == "cuda"  # the fused kernel is the GPU's fast path; the CPU row only checks the code
    for n in sizes["params"]:
        p = torch.nn.Parameter(torch.randn(n, device=device))
        p.grad = torch.randn(n, device=device)
        opt = torch.optim.AdamW([p], lr=1e-4, fused=fused)
        s = time_median(opt.step, device, warmup=2, repeats=repeats)
        out.append({"params": n, "s": s, "gbytes_per_s": 28 * n / s / 1e9, "fused": fused})
        del p, opt
    return out


def _memory(device: torch.device, what: str) -> int | None:
    if device.type != "cuda":
        return None  # the CPU has no allocator statistics (and the CPU path never touches torch.cuda)
    return {"allocated": torch.cuda.memory_allocated, "peak": torch.cuda.max_memory_allocated,
            "reserved": torch.cuda.memory_reserved}[what](device)


def gpt(device: torch.device, sizes: dict[str, Any], peak: float | None, repeats: int = 6) -> list[dict[str, Any]]:
    """lslm's GPT (untied head) trained in bf16 autocast with AdamW: step time, MFU and allocator bytes per size.

    A size that fails (out of memory on a small GPU) gives a row with ``error`` instead of stopping the rest.
    """
    seq, vocab = sizes["gpt_seq"], sizes["gpt_vocab"]
    return [_gpt_row(device, spec, seq, vocab, peak, repeats, "none") for spec in sizes["gpt"]]


def gpt_recompute(device: torch.device, sizes: dict[str, Any], peak: float | None,
                  repeats: int = 5) -> list[dict[str, Any]]:
    """lslm's GPT at each size of ``sizes["recompute"]`` with ``apply_recompute(model, mode)`` for ``none``,
    ``selective`` and ``full``: the :func:`gpt` row's fields (under the shared recompute file's names, with
    ``recompute`` the mode), and ``matmul_flops_by_dtype`` / ``attention_calls_by_dtype``: one untimed step under
    :class:`lslm.metrics.compute_dtypes.ComputeDtypes`, so each row says in which precision its replays ran
    (all ``bfloat16`` under autocast; ``float32`` flops are a replay outside the forward's autocast)."""
    seq, vocab = sizes["gpt_seq"], sizes["gpt_vocab"]
    return [_gpt_row(device, spec, seq, vocab, peak, repeats, mode, probe_dtypes=True)
            for spec in sizes["recompute"] for mode in ("none", "selective", "full")]


def _gpt_row(device: torch.device, spec: dict[str, Any], seq: int, vocab: int, peak: float | None, repeats: int,
             recompute: str, probe_dtypes: bool = False) -> dict[str, Any]:
    row: dict[str, Any] = {"name": spec["name"], "n_layer": spec["n_layer"], "n_embd": spec["n_embd"],
                           "n_head": spec["n_head"], "seq": seq, "micro_batch": spec["micro_batch"],
                           "vocab": vocab, "compiled": False, "recompute": recompute}
    try:
        row.update(_gpt_one(device, spec, seq, vocab, peak, repeats, recompute, probe_dtypes))
    except (RuntimeError, ValueError) as exc:  # torch.OutOfMemoryError is a RuntimeError
        row["error"] = f"{type(exc).__name__}: {str(exc)[:300]}"
    gc.collect()  # a recomputed model holds itself in a cycle (block -> replaced forward -> block): free it now
    if device.type == "cuda":
        torch.cuda.empty_cache()  # the next run starts from an empty cache, as its memory figures assume
    return row


def _gpt_one(device: torch.device, spec: dict[str, Any], seq: int, vocab: int, peak: float | None, repeats: int,
             recompute: str, probe_dtypes: bool) -> dict[str, Any]:
    from lslm.metrics.compute_dtypes import ComputeDtypes
    from lslm.models.gpt import GPT, GPTConfig
    from lslm.tensor_parallel.recompute import apply_recompute

    L, h, batch = spec["n_layer"], spec["n_embd"], spec["micro_batch"]
    start = _memory(device, "allocated")  # what earlier runs left allocated (0 when each freed its own)
    torch.manual_seed(0)
    with torch.device(device):  # built where it trains: a 1.4B model initialised on the host takes seconds
        model = GPT(GPTConfig(vocab_size=vocab, block_size=seq, n_layer=L, n_head=spec["n_head"], n_embd=h,
                              tie_weights=False))
    apply_recompute(model, recompute)
    n = sum(p.numel() for p in model.parameters())
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=device.type == "cuda")
    idx = torch.randint(0, vocab, (batch, seq), device=device)

    def step() -> None:
        with torch.autocast(device.type, dtype=torch.bfloat16):
            _, loss = model(idx, idx)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    first = time_median(step, device, warmup=0, repeats=1)  # allocations, kernel selection: reported apart
    probe: dict[str, Any] = {}
    if probe_dtypes:  # an untimed step (the dispatch mode's Python call per op would skew the timed ones)
        with ComputeDtypes() as dtypes:
            step()
        probe = {"matmul_flops_by_dtype": dtypes.matmul_flops, "attention_calls_by_dtype": dtypes.attention_calls}
    before = _memory(device, "allocated")
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    s = time_median(step, device, warmup=1, repeats=repeats)
    peak_bytes = _memory(device, "peak")
    flops = gpt_step_flops(model.config, batch).model  # lslm.metrics.flops: 6·N·tokens + 6·L·h·s²·B, causal
    return {"params": n, "first_step_s": first, "step_s": s, "tokens_per_s": batch * seq / s,
            "mfu": flops / s / peak if peak else None, "mem_states_bytes": before, "mem_peak_bytes": peak_bytes,
            "mem_activation_bytes": None if before is None else peak_bytes - before,
            "reserved_bytes": _memory(device, "reserved"), "mem_start_bytes": start, **probe}
