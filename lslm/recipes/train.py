"""Single-process training of :class:`lslm.models.GPT` on the corpus: the serial reference.

Every parallel recipe in the course is checked against this loop: same seed, same
data, same optimiser, so the loss curves can be compared number for number.

    python -m lslm.recipes.train --steps 30 --out runs/baseline.json

On CPU the run is bitwise reproducible: the same config gives the same losses.
"""

from __future__ import annotations

import argparse
import json
import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass, fields
from pathlib import Path
from typing import Any

import torch

from lslm.data.corpus import atomic_write_bytes
from lslm.data.dataset import batches, token_blocks
from lslm.models.gpt import GPT, GPTConfig
from lslm.runtime.printing import progress

__all__ = ["TrainConfig", "train", "build_model", "data_stream", "main"]


@dataclass
class TrainConfig:
    """Everything that defines a baseline run. The defaults train in a few seconds on 2 CPU cores."""

    # model
    n_layer: int = 2
    n_head: int = 4
    n_embd: int = 64
    dropout: float = 0.0
    vocab_size: int = 1024
    block_size: int = 64
    # optimisation
    batch_size: int = 8
    steps: int = 30
    lr: float = 3e-3
    weight_decay: float = 0.1
    grad_clip: float = 1.0
    seed: int = 0
    # bookkeeping
    log_every: int = 10
    device: str = "cpu"
    out: str | None = None

    def __post_init__(self) -> None:
        for name in ("batch_size", "steps", "log_every"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"TrainConfig.{name} must be a positive int, got {value!r}")
        if not isinstance(self.seed, int) or self.seed < 0:
            raise ValueError(f"TrainConfig.seed must be an int >= 0, got {self.seed!r}")
        if not self.lr > 0:
            raise ValueError(f"TrainConfig.lr must be > 0, got {self.lr!r}")
        if self.weight_decay < 0 or self.grad_clip < 0:
            raise ValueError("TrainConfig.weight_decay and grad_clip must be >= 0 (grad_clip=0 disables clipping)")
        self.model_config()  # fail now, not after the data is built, on bad model sizes

    def model_config(self) -> GPTConfig:
        """The :class:`GPTConfig` these settings describe."""
        return GPTConfig(vocab_size=self.vocab_size, block_size=self.block_size, n_layer=self.n_layer,
                         n_head=self.n_head, n_embd=self.n_embd, dropout=self.dropout)


def build_model(cfg: TrainConfig) -> GPT:
    """The model of ``cfg``, initialised from ``cfg.seed`` (the same weights on every call)."""
    torch.manual_seed(cfg.seed)
    return GPT(cfg.model_config())


def data_stream(cfg: TrainConfig, *, rank: int = 0, world_size: int = 1) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """Endless ``(x, y)`` batches of this rank's shard: epoch 0, 1, ... each reshuffled from ``cfg.seed``."""
    data = token_blocks(cfg.block_size, cfg.vocab_size, rank=rank, world_size=world_size)
    if len(data) < cfg.batch_size:
        raise ValueError(f"batch_size={cfg.batch_size} exceeds the {len(data)} blocks available; lower it")
    epoch = 0
    while True:
        yield from batches(data, cfg.batch_size, seed=cfg.seed, epoch=epoch)
        epoch += 1


def _optimizer(model: GPT, cfg: TrainConfig) -> torch.optim.AdamW:
    # Decay matrices only: shrinking biases and LayerNorm gains towards 0 only hurts.
    decay = [p for p in model.parameters() if p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    groups = [{"params": decay, "weight_decay": cfg.weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    # foreach=False: the plain per-parameter loop, the easiest to mirror in sharded optimisers.
    return torch.optim.AdamW(groups, lr=cfg.lr, betas=(0.9, 0.95), eps=1e-8, foreach=False)


def train(cfg: TrainConfig) -> dict[str, Any]:
    """Train for ``cfg.steps`` steps and return the run record.

    Keys: ``losses`` (one float per step), ``step_times_s``, ``tokens_per_step``,
    ``num_parameters``, ``config`` (``asdict(cfg)``) and ``device``. Written as JSON
    to ``cfg.out`` when set.
    """
    device = torch.device(cfg.device)
    model = build_model(cfg).to(device)
    model.train()
    optimizer = _optimizer(model, cfg)
    stream = data_stream(cfg)
    losses: list[float] = []
    step_times: list[float] = []
    bar = progress(range(cfg.steps), desc="train")
    for step in bar:
        x, y = next(stream)
        t0 = time.perf_counter()
        x, y = x.to(device), y.to(device)
        _, loss = model(x, y)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        if cfg.grad_clip > 0:
            torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.grad_clip)
        optimizer.step()
        # .item() waits for the device, so the time below is the real step time.
        losses.append(loss.item())
        step_times.append(time.perf_counter() - t0)
        if step % cfg.log_every == 0 or step == cfg.steps - 1:
            bar.set_postfix(loss=f"{losses[-1]:.3f}")
    result = {
        "losses": losses,
        "step_times_s": step_times,
        "tokens_per_step": cfg.batch_size * cfg.block_size,
        "num_parameters": model.num_parameters(),
        "config": asdict(cfg),
        "device": str(device),
    }
    if cfg.out:
        atomic_write_bytes(Path(cfg.out), (json.dumps(result, indent=1) + "\n").encode("utf-8"))
    return result


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m lslm.recipes.train", description="Serial baseline training run.")
    defaults = TrainConfig()
    for f in fields(TrainConfig):
        default = getattr(defaults, f.name)
        kind = str if f.name == "out" else type(default)
        parser.add_argument(f"--{f.name.replace('_', '-')}", dest=f.name, type=kind, default=default,
                            help=f"(default: {default})")
    return parser


def main(argv: list[str] | None = None) -> dict[str, Any]:
    """Command line entry point; returns the run record (handy in tests)."""
    args = _parser().parse_args(argv)
    try:
        cfg = TrainConfig(**vars(args))
    except ValueError as exc:
        _parser().error(str(exc))
    result = train(cfg)
    losses = result["losses"]
    ms = 1000 * sorted(result["step_times_s"])[len(losses) // 2]
    print(f"loss {losses[0]:.3f} -> {losses[-1]:.3f} over {cfg.steps} steps; "
          f"median step {ms:.1f} ms; {result['num_parameters']:,} parameters"
          + (f"; wrote {cfg.out}" if cfg.out else ""))
    return result


if __name__ == "__main__":
    main()
