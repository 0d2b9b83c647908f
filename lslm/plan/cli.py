"""``lslm plan``: the calculator on the command line (one layout's table, or ``--search`` for the best ones).

A preset model (``--model gpt3-175b``) or one described by flags (``--layers --hidden --heads ...``), a
hardware preset with its numbers overridden (``--peak-tflops``, ``--efficiency``, ``--hbm-gb``,
``--devices-per-node``, ``--intra-gbps``/``--inter-gbps``, ``--intra-alpha-us``/``--inter-alpha-us``), and a layout
(``--dp --dp-shard --tp --pp --v --cp --cp-method --zero --sp --recompute --precision --mixed``; ``--search-cp 1 2
4 8`` lets the search choose context parallelism; ``--mixed autocast`` prices ``torch.autocast`` over fp32 weights
instead of Megatron-style half weights with fp32 masters). ``--validate`` prints the time model against the
committed bench step times instead (:mod:`lslm.plan.validate`), and the memory model against the H200 runs
(:mod:`lslm.plan.validate_memory`), the calibrated ``h200`` time model against the same runs' step times
(:mod:`lslm.plan.validate_gpu`) and against published multi-GPU runs (:mod:`lslm.plan.published`). Bad input
is refused through ``parser.error`` with the calculator's own
message (what to change).
"""

from __future__ import annotations

import argparse
import dataclasses
from typing import Any

from lslm.plan.estimate import estimate
from lslm.plan.hardware import PRECISIONS, Link, hardware_presets
from lslm.plan.inputs import check_arguments, check_weights_fit, describe_flags
from lslm.plan.layout import CP_METHODS, MIXED, OFFLOADS, RECOMPUTE, Layout
from lslm.plan.model import ModelSpec, model_presets
from lslm.plan.published import format_published, validate_published
from lslm.plan.search import search, why_none_fit
from lslm.plan.validate import format_validation, load_results, results_dir, validate
from lslm.plan.validate_gpu import BREAKDOWN_FILE, breakdown, format_breakdown, format_gpu_validation, validate_gpu
from lslm.plan.validate_memory import (
    format_memory_validation,
    load_gpu_rows,
    reserved_ratio_range,
    validate_memory,
)

__all__ = ["EPILOG", "add_arguments", "run"]

EPILOG = """\
examples:
  lslm plan --model gpt3-175b --devices 1024 --tp 8 --pp 8 --zero 1 --sp --recompute selective
  lslm plan --model llama3-8b --devices 8 --search --flash
  lslm plan --model llama3-8b --seq 65536 --devices 16 --tp 8 --cp 2 --sp --flash
  lslm plan --model llama3-8b --seq 131072 --devices 32 --search --search-cp 1 2 4 8 --flash
  lslm plan --layers 24 --hidden 1024 --heads 16 --vocab 50304 --seq 2048 --micro-batch 8 --flash --mixed autocast
  lslm plan --layers 24 --hidden 2048 --heads 16 --vocab 50257 --seq 2048 --global-batch 512 --devices 64 --search
  lslm plan --validate"""


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The options of ``lslm plan`` (module doc)."""
    m = p.add_argument_group("model (a preset, or every shape flag)")
    m.add_argument("--model", choices=sorted(model_presets()), default=None, help="a published model")
    for flag, help_text in (("--layers", "transformer layers"), ("--hidden", "hidden size h"),
                            ("--heads", "attention heads"), ("--kv-heads", "key/value heads (GQA; default: heads)"),
                            ("--ffn", "MLP width (default 4h for gpt; required for llama)"),
                            ("--vocab", "vocabulary size"), ("--seq", "sequence length"),
                            ("--micro-batch", "sequences per micro-batch"),
                            ("--global-batch", "sequences per optimizer step")):
        m.add_argument(flag, type=int, default=None, help=help_text)
    m.add_argument("--arch", choices=("gpt", "llama"), default=None, help="model family (default gpt)")
    m.add_argument("--tied", action="store_true", help="the head shares the token embedding")
    h = p.add_argument_group("hardware")
    h.add_argument("--hardware", choices=sorted(hardware_presets()), default="h100-sxm", help="default: h100-sxm")
    h.add_argument("--peak-tflops", type=float, default=None, help="peak Tflop/s at --precision (overrides)")
    h.add_argument("--efficiency", type=float, default=None, help="fraction of peak reached (default 1.0)")
    h.add_argument("--hbm-gb", type=float, default=None, help="device memory in GiB (overrides)")
    h.add_argument("--devices-per-node", type=int, default=None, help="devices on the fast link (overrides)")
    for kind in ("intra", "inter"):
        h.add_argument(f"--{kind}-gbps", type=float, default=None,
                       help=f"{kind}-node bandwidth per device and direction, GB/s (overrides)")
        h.add_argument(f"--{kind}-alpha-us", type=float, default=None,
                       help=f"{kind}-node latency per message, microseconds (overrides)")
    lay = p.add_argument_group("layout")
    lay.add_argument("--devices", type=int, default=None, help="device count (dp x tp x pp x cp must equal it)")
    for flag in ("--dp", "--tp", "--pp", "--v", "--cp"):
        lay.add_argument(flag, type=int, default=None if flag == "--dp" else 1, help=f"{flag[2:]} size")
    lay.add_argument("--cp-method", choices=CP_METHODS, default="ring",
                     help="with --cp > 1: ring attention (zig-zag) or Ulysses all-to-all (default ring)")
    lay.add_argument("--dp-shard", type=int, default=None,
                     help="HSDP: shard the ZeRO states over this many of the dp ranks, replicate over the rest "
                          "(default: all of dp)")
    lay.add_argument("--zero", type=int, choices=(0, 1, 2, 3), default=0, help="ZeRO stage (default 0)")
    lay.add_argument("--offload", choices=OFFLOADS, default="none", help="optimizer offload (ZeRO-Offload)")
    lay.add_argument("--sp", action="store_true", help="sequence parallelism (needs --tp > 1)")
    lay.add_argument("--no-regather", action="store_true",
                     help="with --sp: keep the gathered inputs instead of all-gathering them again in backward")
    lay.add_argument("--recompute", choices=RECOMPUTE, default="none", help="activation recomputation")
    lay.add_argument("--precision", choices=PRECISIONS, default="bf16", help="default bf16 (fp32 masters)")
    lay.add_argument("--mixed", choices=MIXED, default="masters",
                     help="with bf16/fp16: 'masters' (default), half weights with fp32 masters, Megatron/DeepSpeed "
                          "(18 bytes/param with fp32 main_grad, 16 with half gradients), half activations; "
                          "'autocast', torch.autocast over fp32 weights (16 bytes/param), activations a mix: the fp32 "
                          "residual, the weights' half copies, the loss's fp32 temporaries")
    lay.add_argument("--stage-layers", type=int, nargs="+", default=None, metavar="N",
                     help="layers of each pipeline stage, first to last (default: n_layer / pp each), e.g. 7 8 ... 8 7")
    lay.add_argument("--flash", action="store_true", help="fused attention: no s^2 activations kept")
    p.add_argument("--search", action="store_true", help="rank the layouts that fit --devices by step time")
    p.add_argument("--zero-with-pp", action="store_true",
                   help="with --search: also try ZeRO-2/3 with pipeline parallelism (no framework runs it by default)")
    p.add_argument("--search-cp", type=int, nargs="+", default=[1], metavar="CP",
                   help="context-parallel sizes --search tries, with --cp-method (default: 1)")
    p.add_argument("--top", type=int, default=10, help="layouts --search prints (default 10)")
    p.add_argument("--validate", action="store_true",
                   help="the time model against the committed TP, pipeline and ZeRO bench step times (cpu-box), "
                        "and the memory model against lslm's GPT measured on an H200 in bf16 autocast")
    p.add_argument("--results", default=None, help="with --validate: the folder of the bench JSON files "
                                                   "(default bench/results)")


def _model(ns: argparse.Namespace, parser: argparse.ArgumentParser) -> ModelSpec:
    base = model_presets()[ns.model] if ns.model else None
    shape = {"n_layer": ns.layers, "hidden": ns.hidden, "n_head": ns.heads, "vocab": ns.vocab, "seq_len": ns.seq}
    if base is None:
        missing = [f"--{k}" for k, v in zip(("layers", "hidden", "heads", "vocab", "seq"), shape.values()) if v is None]
        if missing:
            parser.error(f"give --model PRESET or the model's shape: missing {' '.join(missing)}")
        spec: dict[str, Any] = dict(shape, arch=ns.arch or "gpt", tied=ns.tied)
        if spec["arch"] == "llama":
            spec["dropout"] = False
    else:
        spec = {k: v for k, v in shape.items() if v is not None}
        if ns.arch:
            spec["arch"] = ns.arch
        if ns.tied:
            spec["tied"] = True
    for key, value in (("n_kv_head", ns.kv_heads), ("ffn_hidden", ns.ffn), ("micro_batch", ns.micro_batch),
                       ("global_batch", ns.global_batch)):
        if value is not None:
            spec[key] = value
    return dataclasses.replace(base, **spec) if base else ModelSpec(**spec)


def run(ns: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    """Print one layout's table, or the ``--top`` layouts of ``--search``. Returns the exit status."""
    try:
        check_arguments(ns)  # every number in range before any work (lslm.plan.inputs)
        if ns.validate:
            rows = validate(load_results(ns.results))
            print("the calculator (cpu-box preset) against the committed benches' measured step times")
            print(format_validation(rows))
            print()
            try:
                gpu = load_gpu_rows(results_dir(ns.results) / "gpu")
            except ValueError as exc:  # the time rows stand on their own
                print(f"(memory against the H200 runs not shown: {exc})")
                return 0
            print("the calculator (mixed='autocast', flash attention) against lslm's GPT on one H200, bf16 autocast: "
                  "peak and states before the forward (memory_allocated); files: "
                  + ", ".join(sorted({r["file"] for r in gpu})))
            print(format_memory_validation(validate_memory(gpu)))
            print()
            print("the calculator (h200 preset: GEMM, attention and AdamW efficiencies measured on one H200) against "
                  "lslm's GPT step times on that H200 (not used to calibrate)")
            print(format_gpu_validation(validate_gpu(gpu)))
            if (results_dir(ns.results) / "gpu" / BREAKDOWN_FILE).is_file():
                print("where the time goes: one step's kernels profiled by kind on that H200 against the model")
                print(format_breakdown(breakdown(results_dir(ns.results) / "gpu")))
            print()
            print("the calculator (a100-80gb / h100-sxm / h100-96gb-hbm2e: the H200's efficiencies scaled by peak and "
                  "bandwidth) "
                  "against published multi-GPU runs (lslm.plan.published: each row's table, row and assumptions)")
            print(format_published(validate_published(), slack=reserved_ratio_range(gpu)))
            return 0
        if ns.results is not None:
            parser.error("--results goes with --validate")
        model = _model(ns, parser)
        hw = hardware_presets()[ns.hardware]
        changes: dict[str, Any] = {}
        if ns.peak_tflops is not None:
            changes["peak_flops"] = {**hw.peak_flops, ns.precision: ns.peak_tflops * 1e12}
        if ns.efficiency is not None:
            changes["compute_efficiency"] = ns.efficiency
        if ns.hbm_gb is not None:
            changes["hbm_bytes"] = ns.hbm_gb * 2**30
        if ns.devices_per_node is not None:
            changes["devices_per_node"] = ns.devices_per_node
        for kind in ("intra", "inter"):
            link = getattr(hw, kind)
            gbps, alpha_us = getattr(ns, f"{kind}_gbps"), getattr(ns, f"{kind}_alpha_us")
            if gbps is not None or alpha_us is not None:
                changes[kind] = Link(link.alpha_s if alpha_us is None else alpha_us * 1e-6,
                                     link.bandwidth_Bps if gbps is None else gbps * 1e9)
        hw = dataclasses.replace(hw, **changes)
        if ns.search:
            if ns.devices is None:
                parser.error("--search needs --devices (how many devices to lay the model out on)")
            check_weights_fit(model, hw, ns.devices, ns.precision, ns.mixed, describe_flags(ns))
            options: dict[str, Any] = dict(precision=ns.precision, flash_attention=ns.flash, mixed=ns.mixed,
                                           zero_with_pp=ns.zero_with_pp,
                                           context_parallel=tuple(ns.search_cp), cp_methods=(ns.cp_method,))
            found = search(model, hw, ns.devices, top=ns.top, **options)
            if not found:
                print(f"no layout of {model.name} fits {ns.devices} x {hw.name} "
                      f"({hw.usable_bytes / 1e9:.1f} GB usable each): {why_none_fit(model, hw, ns.devices, **options)}")
                return 1
            print(f"{model.name} on {ns.devices} x {hw.name}: the {len(found)} fastest layouts that fit "
                  + ("(each operation at " + hw.calibration.provenance()
                     if hw.calibration is not None and ns.precision != "fp32"
                     else f"(compute at {hw.compute_efficiency:g} x peak") + "; MFU is model flops over peak)")
            for i, e in enumerate(found, 1):
                print(f"{i:>3}. {e.layout.describe()}, micro-batch {e.model.micro_batch}: step {e.step_s:.3f} s, "
                      f"{e.peak_bytes / 1e9:.1f} GB on the most loaded device, MFU {e.mfu:.1%}")
            print()
            print(found[0].format())
            return 0
        world_rest = ns.tp * ns.pp * ns.cp
        if ns.dp is None and ns.devices is not None and ns.devices % world_rest:
            parser.error(f"--devices {ns.devices} is not a multiple of tp x pp x cp = {world_rest}: no whole dp fits")
        dp = ns.dp if ns.dp is not None else (ns.devices // world_rest if ns.devices else 1)
        layout = Layout(dp=dp, dp_shard=ns.dp_shard, tp=ns.tp, pp=ns.pp, v=ns.v, cp=ns.cp, cp_method=ns.cp_method,
                        zero=ns.zero, offload=ns.offload, sequence_parallel=ns.sp, recompute=ns.recompute,
                        precision=ns.precision, flash_attention=ns.flash, regather=not ns.no_regather,
                        mixed=ns.mixed, stage_layers=tuple(ns.stage_layers) if ns.stage_layers else None)
        check_weights_fit(model, hw, ns.devices or layout.world, ns.precision, ns.mixed, describe_flags(ns))
        print(estimate(model, layout, hw, ns.devices).format())
        return 0
    except ValueError as exc:
        parser.error(str(exc))
    return 2  # pragma: no cover - parser.error exits
