"""Single-process DataParallel on any device list: correctness, output-device imbalance, replicate cost.

    python -m lslm.demos.data_parallel_demo                          # all GPUs, or cpu,cpu without CUDA
    python -m lslm.demos.data_parallel_demo --devices cuda:0,cuda:1 --model small --batch 32
    python -m lslm.demos.data_parallel_demo --devices cpu,cpu --gil --out dp.json
    python -m lslm.demos.data_parallel_demo --devices cuda:0,cpu --vocab 32768 --seq 256   # one GPU

Prints a short report and returns (or writes with ``--out``) a JSON-able record:
``check`` (largest difference of DataParallel's logits, loss and gradients from the
plain model), ``imbalance`` (bytes per copy, bytes gathered onto the output device
and, on CUDA, each device's peak allocated memory, for gathered logits and for the
parallel loss), ``replicate`` (see :func:`~lslm.data_parallel.single_process.measure.replicate_cost`),
``torch_data_parallel`` (on two or more distinct GPUs: the difference from
``torch.nn.DataParallel``'s output) and, with ``--gil``, the GIL benchmark.
"""

from __future__ import annotations

import argparse
import json
from typing import Any

import torch

from lslm.data_parallel.single_process.data_parallel import DataParallel, gpt_token_loss, to_devices
from lslm.data_parallel.single_process.measure import gil_benchmark, measure_step, replicate_cost
from lslm.metrics.memory import format_bytes
from lslm.models.gpt import GPT, GPTConfig

__all__ = ["default_devices", "main", "run"]


def default_devices() -> list[str]:
    """Every CUDA GPU when there are two or more, else two CPU "devices"."""
    if torch.cuda.is_available() and torch.cuda.device_count() >= 2:
        return [f"cuda:{i}" for i in range(torch.cuda.device_count())]
    return ["cpu", "cpu"]


def _max_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    return (a.detach().float().cpu() - b.detach().float().cpu()).abs().max().item()


def run(devices: list[str] | None = None, *, model: str = "tiny", batch: int = 8, seq: int = 64,
        vocab: int | None = None, seed: int = 0, gil: bool = False, repeats: int = 5) -> dict[str, Any]:
    """Run the checks and measurements on ``devices`` and return the record (see module doc)."""
    devs = to_devices(devices or default_devices())
    sizes: dict[str, Any] = {"block_size": max(seq, 8)}
    if vocab is not None:
        sizes["vocab_size"] = vocab
    cfg = (GPTConfig.tiny if model == "tiny" else GPTConfig.small)(**sizes)
    torch.manual_seed(seed)
    net = GPT(cfg).to(devs[0])
    g = torch.Generator().manual_seed(seed + 1)
    idx = torch.randint(0, cfg.vocab_size, (batch, seq), generator=g).to(devs[0])  # lslm: cpu-ok (host RNG, moved)
    y = torch.randint(0, cfg.vocab_size, (batch, seq), generator=g).to(devs[0])  # lslm: cpu-ok (host RNG, moved)

    net.zero_grad(set_to_none=True)
    ref_logits, ref_loss = net(idx, y)
    ref_loss.backward()
    ref_grads = {n: p.grad.clone() for n, p in net.named_parameters()}
    net.zero_grad(set_to_none=True)
    logits, _ = DataParallel(net, devs)(idx)
    loss = gpt_token_loss(logits, y)
    loss.backward()
    check = {"logits": _max_diff(logits, ref_logits), "loss": _max_diff(loss, ref_loss),
             "grads": max(_max_diff(p.grad, ref_grads[n]) for n, p in net.named_parameters())}

    imbalance = {}
    for mode, parallel_loss in (("gathered logits", False), ("parallel loss", True)):
        res = measure_step(net, idx, y, devs, parallel_loss=parallel_loss)
        res["bytes"] = {f"{phase}/{op}": b for (phase, op), b in res["bytes"].items()}
        imbalance[mode] = res
    record: dict[str, Any] = {
        "devices": [str(d) for d in devs], "batch": batch, "seq": seq, "model": model,
        "num_parameters": net.num_parameters(), "vocab_size": cfg.vocab_size, "check": check,
        "imbalance": imbalance, "replicate": replicate_cost(net, idx, y, devs, repeats=repeats),
    }
    cuda = [d for d in devs if d.type == "cuda"]
    if len({d.index for d in cuda}) == len(devs) >= 2:  # torch's DataParallel needs distinct GPUs
        torch_dp = torch.nn.DataParallel(net, device_ids=[d.index for d in devs])
        with torch.no_grad():
            record["torch_data_parallel"] = {"logits": _max_diff(torch_dp(idx)[0], ref_logits)}
    if gil:
        record["gil"] = gil_benchmark(repeats=repeats)
    return record


def _print(record: dict[str, Any]) -> None:
    print(f"devices {record['devices']}, batch {record['batch']} x {record['seq']} tokens, "
          f"vocabulary {record['vocab_size']:,}, {record['num_parameters']:,} parameters")
    c = record["check"]
    print(f"max |DataParallel - plain|: logits {c['logits']:.2e}, loss {c['loss']:.2e}, grads {c['grads']:.2e}")
    for mode, res in record["imbalance"].items():
        peaks = ", ".join(f"{d} {format_bytes(b)}" for d, b in res["peak_bytes"].items()) or "n/a on CPU"
        print(f"{mode:<16} gathered onto output device {res['gathered_bytes']:>12,} B; peak memory: {peaks}")
    r = record["replicate"]
    print(f"replicate: {r['broadcast_bytes']:,} B broadcast, {1e3 * r['replicate_s']:.2f} ms; "
          f"plain step {1e3 * r['model_step_s']:.2f} ms, DataParallel step {1e3 * r['dp_step_s']:.2f} ms")
    if "torch_data_parallel" in record:
        print(f"max |torch.nn.DataParallel - plain| logits: {record['torch_data_parallel']['logits']:.2e}")
    for row in record.get("gil", []):
        print(f"GIL {row['workload']:<18} x{row['replicas']}: serial {row['serial_ms']:.1f} ms, "
              f"threads {row['threaded_ms']:.1f} ms, speedup {row['speedup']:.2f}")


def main(argv: list[str] | None = None) -> dict[str, Any]:
    """Command line entry point; returns the record."""
    p = argparse.ArgumentParser(prog="python -m lslm.demos.data_parallel_demo", description=__doc__.split("\n")[0])
    p.add_argument("--devices", default=None, help="comma-separated, e.g. cuda:0,cuda:1 or cpu,cpu")
    p.add_argument("--model", choices=("tiny", "small"), default="tiny")
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--seq", type=int, default=64)
    p.add_argument("--vocab", type=int, default=None, help="vocabulary size (default: the model's, 1024)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--gil", action="store_true", help="also run the GIL benchmark")
    p.add_argument("--out", default=None, help="write the record as JSON here")
    a = p.parse_args(argv)
    record = run(a.devices.split(",") if a.devices else None, model=a.model, batch=a.batch, seq=a.seq,
                 vocab=a.vocab, seed=a.seed, gil=a.gil, repeats=a.repeats)
    _print(record)
    if a.out:
        with open(a.out, "w", encoding="utf-8") as f:
            json.dump(record, f, indent=1)
    return record


if __name__ == "__main__":
    main()
