"""GPU check of lslm.metrics.flops (issue 31): the peak table found by the device's name, and MFU of lslm's GPT.

Run on a CUDA machine from the repository root: ``PYTHONPATH=. python3 scripts/gpu_mfu_check.py`` (writes
``gpu_mfu_check.json`` into ``$OUT``, else the working directory). It prints the device's peaks per precision
(:func:`lslm.metrics.flops.device_peak`), times lslm's GPT (124M and 350M, untied, vocabulary 50,304, sequence
2,048, micro-batch 8, bf16 autocast, fused AdamW) with ``lslm.bench.calibrate.gpt`` (its MFU now from
:func:`~lslm.metrics.flops.gpt_step_flops`; ``mfu_old_formula_all_params`` is the count it used before, ``6·N``
over every parameter, embedding lookups included), and trains the same models 12 steps through the harness
(:func:`lslm.harness.train_loop` with ``Built.flops``), whose throughput line every recipe prints.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch

from lslm.bench import calibrate
from lslm.harness import Built, StepTimer, train_loop
from lslm.metrics.flops import device_peak, gpt_step_flops
from lslm.models.gpt import GPT, GPTConfig

SEQ, VOCAB, BATCH = 2048, 50304, 8
SIZES = ((12, 768, 12, "124M"), (24, 1024, 16, "350M"))


@dataclass
class _Loop:
    steps: int = 12
    log_every: int = 100


def _harness_row(dev: torch.device, n_layer: int, n_embd: int, n_head: int) -> dict[str, Any]:
    cfg = GPTConfig(vocab_size=VOCAB, block_size=SEQ, n_layer=n_layer, n_head=n_head, n_embd=n_embd)
    torch.manual_seed(0)
    model = GPT(cfg).to(dev)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)
    gen = torch.Generator(device=dev).manual_seed(0)

    def batches() -> Iterator[torch.Tensor]:
        while True:
            yield torch.randint(0, VOCAB, (BATCH, SEQ + 1), device=dev, generator=gen)

    def step(batch: torch.Tensor, timer: StepTimer) -> torch.Tensor:
        with torch.autocast("cuda", dtype=torch.bfloat16):
            _, loss = model(batch[:, :-1], batch[:, 1:])
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss

    built = Built(model=model, optimizer=opt, step=step, batches=batches(), device=dev,
                  name=f"gpt L{n_layer} h{n_embd} bf16", flops=gpt_step_flops(cfg, BATCH, precision="bf16"))
    rec = train_loop(_Loop(), built)
    torch.cuda.empty_cache()
    return {"n_layer": n_layer, "n_embd": n_embd, **rec["throughput"]}


def main() -> None:
    """Measure and write the JSON (module doc)."""
    dev = torch.device("cuda:0")
    name = torch.cuda.get_device_name(dev)
    out: dict[str, Any] = {"device_name": name, "torch": torch.__version__,
                           "allow_tf32": torch.backends.cuda.matmul.allow_tf32,
                           "peaks": {p: device_peak(dev, p) for p in ("fp32", "tf32", "bf16", "fp16")}}
    print(json.dumps(out, indent=1), flush=True)
    sizes = {"gpt": [{"name": label, "n_layer": L, "n_embd": h, "n_head": a, "micro_batch": BATCH}
                     for L, h, a, label in SIZES], "gpt_seq": SEQ, "gpt_vocab": VOCAB}
    rows = calibrate.gpt(dev, sizes, calibrate.peak_flops(name), repeats=6)
    for r in rows:
        tokens = r["micro_batch"] * SEQ
        old = 6 * r["params"] * tokens + 6 * r["n_layer"] * r["n_embd"] * SEQ * tokens
        r["mfu_old_formula_all_params"] = old / r["step_s"] / 989e12
        print({k: r[k] for k in ("name", "params", "step_s", "tokens_per_s", "mfu", "mfu_old_formula_all_params")},
              flush=True)
    out["calibrate_gpt"] = rows
    out["harness"] = [_harness_row(dev, L, h, a) for L, h, a, _ in SIZES]
    with open(os.path.join(os.environ.get("OUT", "."), "gpu_mfu_check.json"), "w") as f:
        json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
