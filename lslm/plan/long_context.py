"""Why long sequences break tensor + sequence parallelism alone: activation memory per device against ``s``.

Tensor parallelism with sequence parallelism divides a layer's activations by ``t`` (Korthikanti et al. 2022,
``sbh/t (34 + 5as/h)``), but ``t`` stops at a node (its all-gathers and reduce-scatters need the fastest
links) and the heads, while the activations keep growing as ``s``: past some length a layer's tokens no longer
fit next to the model states. Context parallelism splits ``s`` itself over ``cp`` more devices, so the same
activations fall as ``1/cp`` while the model states per device stay (parameters are replicated over ``cp``).
:func:`activation_vs_sequence` tabulates this from :func:`lslm.plan.estimate` (every number traced to its
formula there); :func:`lslm.plot.long_context.plot_activation_vs_sequence` draws it.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace
from typing import Any

from lslm.plan.estimate import estimate
from lslm.plan.hardware import hardware_presets
from lslm.plan.layout import Layout
from lslm.plan.model import model_presets

__all__ = ["SEQ_LENS", "activation_vs_sequence", "format_activation_table"]

#: 8k to 1M tokens, doubling
SEQ_LENS = tuple(8192 * 2**i for i in range(8))


def activation_vs_sequence(model: str = "llama3-8b", hardware: str = "h100-sxm", *, tp: int = 8,
                           cps: Sequence[int] = (1, 2, 4, 8), seq_lens: Sequence[int] = SEQ_LENS,
                           recompute: str = "none", flash_attention: bool = True, zero: int = 0,
                           cp_method: str = "ring") -> list[dict[str, Any]]:
    """One row per (sequence length, cp): activations, model states and total per device, and whether it fits.

    The layout is ``tp`` with sequence parallelism, ``cp`` context-parallel ranks (ring attention by default),
    no pipeline and no data parallelism (``dp = 1``: one sequence of ``seq_len`` tokens per step, micro-batch 1),
    on ``tp · cp`` devices of ``hardware`` (presets of :func:`lslm.plan.hardware_presets`); ``zero = 0`` keeps the
    model states whole on every device so that only the activations move with ``cp``. Row keys: ``seq_len``,
    ``cp``, ``devices``, ``activations_bytes``, ``states_bytes`` (parameters, gradients, masters, optimizer
    states), ``other_bytes`` (communication buffers), ``total_bytes``, ``usable_bytes``, ``fits``,
    ``layout`` (its one-line description), ``formula`` (the activations' formula as the calculator traces it),
    ``model``, ``hardware`` and ``tp``.
    """
    base = model_presets()[model]
    hw = hardware_presets()[hardware]
    rows = []
    for seq in seq_lens:
        spec = replace(base, seq_len=seq, micro_batch=1, global_batch=1, max_positions=None)
        for cp in cps:
            layout = Layout(tp=tp, cp=cp, cp_method=cp_method, sequence_parallel=tp > 1, recompute=recompute,
                            flash_attention=flash_attention, zero=zero)
            est = estimate(spec, layout, hw)
            mem = est.memory
            acts = mem.activations.value
            states = mem.states.device_bytes
            rows.append({"seq_len": seq, "cp": cp, "devices": layout.world, "activations_bytes": acts,
                         "states_bytes": states, "other_bytes": mem.total - acts - states,
                         "total_bytes": mem.total, "usable_bytes": hw.usable_bytes, "fits": est.fits,
                         "layout": layout.describe(), "formula": mem.activations.formula, "model": spec.name,
                         "hardware": hw.name, "tp": tp})
    return rows


def format_activation_table(rows: Sequence[dict[str, Any]]) -> str:
    """:func:`activation_vs_sequence`'s rows as text: one line per sequence length, activations per device (GB)
    for each ``cp`` and whether the device fits, the model states per device once."""
    cps = sorted({r["cp"] for r in rows})
    by = {(r["seq_len"], r["cp"]): r for r in rows}
    first = rows[0]
    lines = [f"activations per device (GB = 1e9 B; model states {first['states_bytes'] / 1e9:.1f} GB per device at "
             f"every cp, {first['usable_bytes'] / 1e9:.1f} GB usable; *: does not fit)",
             f"{'seq_len':>9} " + " ".join(f"{'TP+SP alone' if c == 1 else f'cp={c}':>12}" for c in cps)]
    for seq in sorted({r["seq_len"] for r in rows}):
        cells = []
        for c in cps:
            r = by[(seq, c)]
            cells.append(f"{r['activations_bytes'] / 1e9:>11.1f}{' ' if r['fits'] else '*'}")
        lines.append(f"{seq:>9,} " + " ".join(cells))
    return "\n".join(lines)
