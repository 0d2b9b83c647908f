"""Measure on a GPU what ``bench/results/gpu/h200_breakdown_2026-11-28.json`` holds (run from the repo root).

Two things the calibrated time model (:mod:`lslm.plan.calibrated`) assumes rather than measures:

* ``elementwise``: the streaming rate of memory-bound ops one at a time (fp32 add, the fp32 -> bf16 cast, bf16
  GELU, fp32 LayerNorm over 2,048 features, fp32 log-softmax over a 50,304 vocabulary), bytes read + written over
  the median of 10 CUDA-event-timed calls after 3 warm-ups;
* ``gpt_<L>x<h>_b<B>``: lslm's GPT (24 x 1,024 and 24 x 2,048, micro-batch 8, sequence 2,048, vocabulary 50,304)
  in bf16 autocast with fused AdamW, as ``h200_2026-11-28.json``'s ``gpt`` rows ran: the median step of 6 after
  3 warm-ups (``step_s``), and one step under ``torch.profiler`` with its kernels' time summed by kind
  (``kernel_s``: ``gemm`` for cuBLAS / nvjet / CUTLASS kernels, ``attention`` for flash / cuDNN SDPA,
  ``optimizer`` for the fused AdamW kernel, ``other`` for the rest: elementwise, norms, reductions, copies, the
  loss) and the 25 longest kernels (``top``: name, seconds, calls).

Usage: ``OUT=<dir> PYTHONPATH=. python scripts/gpu_breakdown.py`` (about 45 s on an H200).
"""

import json
import os

import torch
import torch.nn.functional as F
from torch.profiler import ProfilerActivity, profile

from lslm.models.gpt import GPT, GPTConfig

DEVICE = "cuda"
KINDS = (("gemm", ("gemm", "cutlass", "nvjet", "xmma", "cublas")), ("attention", ("flash", "fmha", "attention")),
         ("optimizer", ("adam",)))


def median_s(fn, reps: int = 10) -> float:
    """Median seconds of ``fn`` over ``reps`` CUDA-event-timed calls after 3 warm-ups."""
    for _ in range(3):
        fn()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    return sorted(times)[reps // 2]


def elementwise() -> list[dict]:
    """Streaming rates of single memory-bound ops (module doc)."""
    n = 2**28
    x, y = torch.randn(n, device=DEVICE), torch.randn(n, device=DEVICE)
    g = torch.randn(16384, 8192, device=DEVICE, dtype=torch.bfloat16)
    ln = torch.randn(16384, 2048, device=DEVICE)
    w = torch.ones(2048, device=DEVICE)
    z = torch.randn(16384, 50304, device=DEVICE)
    ops = (("add fp32", lambda: x + y, 12 * n), ("cast fp32->bf16", lambda: x.to(torch.bfloat16), 6 * n),
           ("gelu bf16", lambda: F.gelu(g), 4 * g.numel()),
           ("layer_norm fp32", lambda: F.layer_norm(ln, (2048,), w, w), 8 * ln.numel()),
           ("log_softmax fp32", lambda: z.log_softmax(-1), 8 * z.numel()))
    rows = []
    for name, fn, nbytes in ops:
        s = median_s(fn)
        rows.append({"op": name, "bytes": nbytes, "s": s, "bytes_per_s": nbytes / s})
    return rows


def gpt_breakdown(n_layer: int, hidden: int, heads: int, batch: int, seq: int = 2048, vocab: int = 50304) -> dict:
    """One GPT's step time and its kernels' time by kind (module doc)."""
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=vocab, block_size=seq, n_layer=n_layer, n_head=heads, n_embd=hidden))
    model = model.to(DEVICE)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)
    idx = torch.randint(0, vocab, (batch, seq), device=DEVICE)

    def step() -> None:
        with torch.autocast("cuda", dtype=torch.bfloat16):
            _, loss = model(idx, idx)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    step_s = median_s(step, 6)
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        step()
        torch.cuda.synchronize()
    kinds: dict = {}
    top = []
    for event in prof.key_averages():
        if event.device_type != torch.autograd.DeviceType.CUDA:
            continue
        name = event.key.lower()
        kind = next((k for k, words in KINDS if any(word in name for word in words)), "other")
        kinds[kind] = kinds.get(kind, 0.0) + event.self_device_time_total / 1e6
        top.append((event.key[:90], event.self_device_time_total / 1e6, event.count))
    kinds["top"] = sorted(top, key=lambda t: -t[1])[:25]
    return {"step_s": step_s, "kernel_s": kinds}


def main() -> None:
    out = {"elementwise": elementwise()}
    for n_layer, hidden, heads, batch in ((24, 1024, 16, 8), (24, 2048, 16, 8)):
        out[f"gpt_{n_layer}x{hidden}_b{batch}"] = gpt_breakdown(n_layer, hidden, heads, batch)
    out["torch"] = torch.__version__
    with open(os.path.join(os.environ["OUT"], "breakdown.json"), "w") as f:
        json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
