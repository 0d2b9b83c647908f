"""The machine the calculator plans for: compute rate, memory, and the two kinds of link (alpha-beta each).

A device has a peak rate per precision (flop/s), ``hbm_bytes`` of memory of which ``reserved_bytes`` are not
the model's (runtime context, allocator slack, library workspaces: an editable assumption), and
``devices_per_node`` peers on the fast intra-node link; groups that span nodes run at the inter-node link's
cost: on the GPU presets one network adapter per device, which a ring collective uses for each of its ranks on a
node at once (:meth:`Hardware.link`). Each link is Hockney's alpha-beta model
(:class:`lslm.metrics.step_time.LinkCost`): ``alpha`` seconds per message, ``1/bandwidth`` seconds per byte, per
direction, per device.

The GPU presets are **vendor datasheet figures** (dense tensor-core peaks, link bandwidths per direction); the
latencies (``alpha``) are our assumptions. Nothing here was measured on those GPUs: edit any field
(``dataclasses.replace``) to plan with your own measurements. ``compute_efficiency`` scales every peak (1.0:
the roofline's upper bound; the fraction of peak a real run reaches is what to measure and put here).

More fields describe a CPU box and stay unset on the GPU presets (:mod:`lslm.plan.timing` says how each
enters the step): ``layer_overhead_s``, a layer pass's fixed cost; ``optimizer_Bps``, the optimizer step's
streaming rate; ``cores``, the cores all the processes share; ``host_copy_Bps`` and ``disk_Bps``, offload's
copies to the host and to the disk; and a link's ``measured`` table of collective times. The ``cpu-box``
preset's numbers are calibrated from committed measurements (:mod:`lslm.plan.calibrate`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from typing import Any

from lslm.metrics.flops import DEVICE_PEAKS
from lslm.metrics.step_time import LinkCost
from lslm.plan.gpu_calibration import H200_CALIBRATION, GpuCalibration

__all__ = ["OPTIMIZER_BYTES", "PRECISIONS", "Hardware", "Link", "hardware_presets"]

PRECISIONS = ("fp32", "bf16", "fp16")
GiB = 2**30
#: bytes an optimizer step reads and writes per fp32 element in torch's single-tensor (``foreach=False``) loop:
#: AdamW ``p.mul_`` (8: decay), ``m.lerp_(g)`` (12), ``v.mul_().addcmul_(g, g)`` (8 + 12), ``v.sqrt() / c``
#: ``.add_(eps)`` (8 + 8 + 8), ``p.addcdiv_(m, denom)`` (16); SGD with momentum ``buf.mul_().add_(g)``
#: (8 + 12), ``p.add_(buf)`` (12)
OPTIMIZER_BYTES = {"adamw": 80, "sgd-momentum": 32}


@dataclass(frozen=True)
class Link:
    """One kind of link: ``alpha_s`` per message, ``bandwidth_Bps`` bytes per second per direction per device.

    ``per_algorithm``: ``(algorithm, alpha_s, bandwidth_Bps)`` entries that price one collective algorithm of
    :func:`lslm.metrics.collective_costs.cost_coefficients` with its own fit (gloo's all-gather and
    reduce-scatter are not its all-reduce at a different size: each is measured); other algorithms, and
    point-to-point sends, use ``alpha_s`` and ``bandwidth_Bps``.

    ``measured``: ``(algorithm, n, ((payload_bytes, seconds), ...))`` entries, one call's measured time at a few
    payloads on ``n`` ranks (:meth:`measured_time`). Where one brackets a call, it prices the call instead of
    the fit: a two-parameter fit over four decades of sizes misses the middle of the range (gloo at 4 processes
    on 2 cores: all-gathers of 64 KiB-1 MiB took 2.0-2.6 ms where the fit says about 1.4). Outside the measured
    sizes, and for other group sizes, the fit prices the call. Empty on the GPU presets.

    ``adapters``: how many devices' network adapters the link's bandwidth adds up (:meth:`Hardware.link`: a ring
    collective across nodes runs one ring per adapter of its ranks on a node); 1 for a single link.
    """

    alpha_s: float
    bandwidth_Bps: float
    per_algorithm: tuple[tuple[str, float, float], ...] = ()
    measured: tuple[tuple[str, int, tuple[tuple[float, float], ...]], ...] = ()
    adapters: int = 1

    def __post_init__(self) -> None:
        for entry in self.measured:
            name, n, points = entry
            if len(points) < 2 or any(not (b > 0 and t > 0) for b, t in points) \
                    or list(points) != sorted(points) or len({b for b, _ in points}) != len(points):
                raise ValueError(f"Link.measured[{name!r}, {n}] must hold >= 2 (payload bytes > 0, seconds > 0) "
                                 f"points in increasing payload, got {points!r}")
        if not (isinstance(self.alpha_s, (int, float)) and self.alpha_s >= 0 and math.isfinite(self.alpha_s)):
            raise ValueError(f"Link.alpha_s must be a finite number >= 0 (seconds per message), got {self.alpha_s!r}")
        if not (isinstance(self.bandwidth_Bps, (int, float)) and 0 < self.bandwidth_Bps < math.inf):
            raise ValueError(f"Link.bandwidth_Bps must be finite and > 0 (bytes per second), "
                             f"got {self.bandwidth_Bps!r}")

    def for_algorithm(self, algorithm: str) -> Link:
        """The link that prices ``algorithm``: its own entry of ``per_algorithm`` if it has one, else this one."""
        for name, alpha, bandwidth in self.per_algorithm:
            if name == algorithm:
                return Link(alpha, bandwidth)
        return self

    def measured_time(self, algorithm: str, n: int, payload: float) -> float | None:
        """Seconds of one call of ``algorithm`` on ``n`` ranks with ``payload`` bytes read off ``measured``: the
        two measured sizes around ``payload`` interpolated in log time against log size (a power law between
        neighbouring measurements); None where no measurement of that algorithm and group size brackets it."""
        for name, group, points in self.measured:
            if name != algorithm or group != n or not points[0][0] <= payload <= points[-1][0]:
                continue
            for (b0, t0), (b1, t1) in zip(points, points[1:]):
                if payload <= b1:
                    x = math.log(payload / b0) / math.log(b1 / b0)
                    return t0 * (t1 / t0) ** x
        return None

    @property
    def cost(self) -> LinkCost:
        """The link as :class:`~lslm.metrics.step_time.LinkCost` (no separate reduction cost: gamma = 0)."""
        return LinkCost(float(self.alpha_s), 1.0 / float(self.bandwidth_Bps), 0.0)

    @classmethod
    def from_fit(cls, fit: dict[str, Any]) -> Link:
        """From a fit of :func:`lslm.metrics.collective_costs.fit_alpha_beta` (``bench/results/collectives.json``)."""
        return cls(float(fit["alpha_s"]), 1.0 / float(fit["beta_s_per_byte"]))


@dataclass(frozen=True)
class Hardware:
    """A device type and how devices are connected (module doc); every field editable."""

    name: str
    peak_flops: dict[str, float] = field(default_factory=dict)  #: precision -> flop/s (dense)
    hbm_bytes: float = 80 * GiB
    devices_per_node: int = 8
    intra: Link = Link(5e-6, 450e9)
    inter: Link = Link(10e-6, 50e9)
    reserved_bytes: float = 0.0
    compute_efficiency: float = 1.0
    host_bytes_per_node: float | None = None  #: CPU memory per node (offload targets it); None: not checked
    #: bytes per element of a saved dropout mask: 1 where fused dropout keeps a bool mask (accelerators), 4 on a
    #: CPU, where torch's dropout multiplies by a saved float noise tensor (lslm.metrics.activation_theory)
    dropout_mask_bytes: int = 1
    #: fixed seconds of one transformer layer's forward and backward that do not scale with its matmul flops
    #: (elementwise ops, softmax, layer norms, op dispatch); (0, 0) on the GPU presets: not modelled there
    layer_overhead_s: tuple[float, float] = (0.0, 0.0)
    #: bytes per second the optimizer step streams (:data:`OPTIMIZER_BYTES` per element); None: not timed
    optimizer_Bps: float | None = None
    #: cores all the devices share (a CPU box: processes beyond it time-slice, and no core is left to overlap
    #: communication with compute); None: every device computes on its own (GPUs)
    cores: int | None = None
    #: bytes per second one process copies between device and host memory for offload (``Layout.offload``:
    #: the gradient slice down, the updated parameter slice up); None: not timed
    host_copy_Bps: float | None = None
    #: bytes per second one process reads and writes its optimizer partition from and to disk
    #: (``Layout.offload = "disk"``); None: not timed
    disk_Bps: float | None = None
    #: measured efficiencies (GEMMs by shape, attention, AdamW, streaming rate): where set, half-precision compute
    #: is priced operation by operation (:mod:`lslm.plan.calibrated`) instead of at peak x compute_efficiency
    calibration: GpuCalibration | None = None
    #: each device has its own inter-node adapter and ``inter`` is one adapter's rate: a ring collective whose
    #: group holds ``k`` devices of each node runs ``k`` rings at once, one through each adapter (NCCL's channels),
    #: so it moves ``k`` times ``inter``'s bandwidth, at most ``intra``'s (:meth:`link`). False: ``inter`` is
    #: what any group spanning nodes gets (the ``cpu-box``'s measured 4-process fit)
    adapter_per_device: bool = False

    def __post_init__(self) -> None:
        if isinstance(self.devices_per_node, bool) or not isinstance(self.devices_per_node, int) \
                or self.devices_per_node < 1:
            raise ValueError(f"Hardware.devices_per_node must be an int >= 1, got {self.devices_per_node!r}")
        if not 0 < self.hbm_bytes < math.inf:
            raise ValueError(f"Hardware.hbm_bytes must be finite and > 0 (bytes per device), got {self.hbm_bytes!r}")
        if not 0 <= self.reserved_bytes < self.hbm_bytes:
            raise ValueError(f"Hardware.reserved_bytes must be in [0, hbm_bytes), got {self.reserved_bytes!r}")
        if self.dropout_mask_bytes not in (1, 2, 4):
            raise ValueError(f"Hardware.dropout_mask_bytes must be 1, 2 or 4, got {self.dropout_mask_bytes!r}")
        if len(self.layer_overhead_s) != 2 or min(self.layer_overhead_s) < 0:
            raise ValueError(f"Hardware.layer_overhead_s must be (forward, backward) seconds >= 0, "
                             f"got {self.layer_overhead_s!r}")
        if self.optimizer_Bps is not None and not 0 < self.optimizer_Bps < math.inf:
            raise ValueError(f"Hardware.optimizer_Bps must be finite and > 0 bytes per second or None, "
                             f"got {self.optimizer_Bps!r}")
        for name in ("host_copy_Bps", "disk_Bps"):
            value = getattr(self, name)
            if value is not None and not 0 < value < math.inf:
                raise ValueError(f"Hardware.{name} must be finite and > 0 bytes per second or None, got {value!r}")
        if self.cores is not None and (isinstance(self.cores, bool) or not isinstance(self.cores, int)
                                       or self.cores < 1):
            raise ValueError(f"Hardware.cores must be an int >= 1 or None, got {self.cores!r}")
        if not 0 < self.compute_efficiency <= 1:
            raise ValueError(f"Hardware.compute_efficiency must be in (0, 1], got {self.compute_efficiency!r}")
        for precision, rate in self.peak_flops.items():
            if precision not in PRECISIONS:
                raise ValueError(f"Hardware.peak_flops: unknown precision {precision!r}; use {PRECISIONS}")
            if not (isinstance(rate, (int, float)) and 0 < rate < math.inf):
                raise ValueError(f"Hardware.peak_flops[{precision!r}] must be finite and > 0 flop/s, got {rate!r}")

    @property
    def usable_bytes(self) -> float:
        """Memory the model may use: ``hbm_bytes - reserved_bytes``."""
        return self.hbm_bytes - self.reserved_bytes

    def flops(self, precision: str) -> float:
        """The rate the calculator assumes for ``precision``: peak x ``compute_efficiency``."""
        if precision not in self.peak_flops:
            known = ", ".join(sorted(self.peak_flops)) or "none"
            raise ValueError(f"hardware {self.name!r} has no compute rate for {precision} (it has: {known}); "
                             f"give one, e.g. dataclasses.replace(hw, peak_flops={{**hw.peak_flops, "
                             f"'{precision}': 1e12}}) or `lslm plan --peak-tflops`")
        return self.peak_flops[precision] * self.compute_efficiency

    def link(self, span: int, per_node: int = 1) -> Link:
        """The link a group whose ranks span ``span`` consecutive devices runs at: intra-node if it fits in one
        node, else the inter-node link (a ring is as slow as its slowest hop). ``per_node``: how many of the
        group's ranks share a node, for a ring collective (all-reduce, all-gather, reduce-scatter); with
        :attr:`adapter_per_device` those ranks' adapters carry ``per_node`` rings at once, so the link's bandwidth
        is ``per_node`` times the adapter's, at most the intra-node link's. NVIDIA's NCCL team reports 192 GB/s
        of all-reduce bus bandwidth between DGX A100 nodes of eight 200 Gb/s adapters (NVIDIA/nccl issue 812),
        about eight adapters' worth; an all-to-all or a point-to-point send gets one adapter (``per_node = 1``)."""
        if span <= self.devices_per_node:
            return self.intra
        if self.adapter_per_device and per_node > 1:
            bandwidth = min(per_node * self.inter.bandwidth_Bps, self.intra.bandwidth_Bps)
            return replace(self.inter, bandwidth_Bps=bandwidth, adapters=per_node)
        return self.inter

    def ranks_per_node(self, n: int, stride: int) -> int:
        """How many ranks of a group of ``n``, ``stride`` devices apart, share one node (at least 1)."""
        return max(1, min(n, self.devices_per_node // stride))


def hardware_presets() -> dict[str, Hardware]:
    """``h100-sxm``, ``a100-80gb``, ``h200`` (datasheet peaks and link bandwidths; alphas assumed) and ``cpu-box``.

    Half-precision compute on the GPUs is priced by measured efficiencies (``calibration``,
    :mod:`lslm.plan.calibrated`): ``h200``'s are those one H200 measured (:data:`~lslm.plan.gpu_calibration.
    H200_CALIBRATION`: GEMMs by shape, flash attention, fused AdamW); ``h100-sxm`` and ``a100-80gb`` assume the
    same fractions of their own peaks and the H200's streaming rates scaled by their HBM bandwidth (3.35 and
    2.039 TB/s over 4.8): not measured on those GPUs. fp32 compute stays at peak x ``compute_efficiency``.

    * H100 SXM5 80 GB: 989 Tflop/s dense bf16/fp16, 67 Tflop/s fp32 (non-tensor); NVLink 4 at 900 GB/s
      both directions (450 GB/s each way); one 400 Gb/s InfiniBand NDR adapter per GPU (50 GB/s).
    * A100 SXM 80 GB: 312 Tflop/s dense bf16/fp16, 19.5 Tflop/s fp32; NVLink 3 at 600 GB/s (300 each way);
      one 200 Gb/s HDR adapter per GPU (25 GB/s).
    * H200 SXM 141 GB: the H100's peaks and links (NVLink 4; one 400 Gb/s adapter per GPU assumed); 141e9 bytes.
    * ``cpu-box``: this course's 2-core CPU machine, gloo, fp32, every number calibrated from committed quiet
      measurements by :func:`lslm.plan.calibrate.calibrate_cpu_box` (rounded to 4 digits here; a test keeps
      them equal): the matmul rate of one thread, 74.08 Gflop/s, and a layer pass's fixed cost, 0.620 ms
      forward and 0.454 ms backward (fitted to ``bench/results/pipeline.json``'s stage times at 2 processes);
      the optimizer's streaming rate, 15.71 GB/s (``zero.json``, the DDP entry's AdamW step at 2 processes);
      ``cores = 2``; a "node" of 2 processes whose ``intra`` link is the 2-process fit of
      ``collectives.json`` and whose ``inter`` link, for groups of more processes than cores, the 4-process
      fit (point-to-point: the fit of lslm's algorithms; all-reduce, all-gather, reduce-scatter: a fit of
      gloo's own each; and each of these three's measured times at 5 sizes, 4 KiB-64 MiB, which price a call
      whose size they bracket); offload's host copies at 3.942 GB/s and disk reads and writes at 1.905 GB/s per
      process (``zero_offload.json``). No bf16 rate: it was not measured. Its "device memory" is half of the machine's
      23 GiB (``free -g`` when this was written), one share per process.
    ``reserved_bytes`` (2 GiB on the GPUs) is our assumption for the CUDA context and allocator slack.
    """
    def peaks(gpu: str) -> dict[str, float]:  # lslm.metrics.flops' datasheet table, the precisions planned here
        return {p: DEVICE_PEAKS[gpu][p] for p in PRECISIONS}

    # Only the H200 was measured: the H100 and A100 presets assume its efficiencies (GEMM, attention) at their
    # own peaks and its streaming rates scaled by their datasheet HBM bandwidth over the H200's 4.8 TB/s.
    h100 = Hardware("H100 SXM 80GB", peaks("H100"), hbm_bytes=80 * GiB,
                    devices_per_node=8, intra=Link(5e-6, 450e9), inter=Link(10e-6, 50e9), reserved_bytes=2 * GiB,
                    adapter_per_device=True,
                    calibration=H200_CALIBRATION.scaled("H100 SXM", peaks("H100")["bf16"], 3.35 / 4.8))
    a100 = Hardware("A100 SXM 80GB", peaks("A100"), hbm_bytes=80 * GiB,
                    devices_per_node=8, intra=Link(5e-6, 300e9), inter=Link(10e-6, 25e9), reserved_bytes=2 * GiB,
                    adapter_per_device=True,
                    calibration=H200_CALIBRATION.scaled("A100 SXM", peaks("A100")["bf16"], 2.039 / 4.8))
    h200 = Hardware("H200 SXM 141GB", peaks("H200"), hbm_bytes=141e9,
                    devices_per_node=8, intra=Link(5e-6, 450e9), inter=Link(10e-6, 50e9), reserved_bytes=2 * GiB,
                    adapter_per_device=True,
                    calibration=H200_CALIBRATION)
    sizes = (4096.0, 65536.0, 1048576.0, 16777216.0, 67108864.0)  # collectives.json: 4 KiB-64 MiB

    def table(algorithm: str, n: int, ms: tuple[float, ...]) -> tuple[str, int, tuple[tuple[float, float], ...]]:
        return algorithm, n, tuple((b, t * 1e-3) for b, t in zip(sizes, ms))

    two = Link(1.982e-4, 3.339e9, (("all_gather_ring", 2.985e-4, 1.005e9), ("all_reduce_ring", 2.128e-4, 1.660e9),
                                   ("reduce_scatter_ring", 6.238e-4, 4.243e8)),
               (table("all_gather_ring", 2, (0.4357, 0.3428, 0.558, 11.72, 64.55)),
                table("all_reduce_ring", 2, (0.4271, 0.4256, 1.827, 10.08, 37.61)),
                table("reduce_scatter_ring", 2, (1.902, 0.5544, 3.275, 18.15, 80.21))))
    four = Link(2.507e-4, 3.504e9, (("all_gather_ring", 4.287e-4, 6.047e8), ("all_reduce_ring", 7.505e-4, 1.176e9),
                                    ("reduce_scatter_ring", 1.113e-3, 3.886e8)),
                (table("all_gather_ring", 4, (1.226, 2.6, 2.017, 21.48, 116.3)),
                 table("all_reduce_ring", 4, (4.662, 4.401, 6.0, 24.41, 95.31)),
                 table("reduce_scatter_ring", 4, (4.066, 4.211, 3.981, 36.05, 168.5))))
    cpu = Hardware("CPU box (gloo)", {"fp32": 74.08e9}, hbm_bytes=11 * GiB, devices_per_node=2, intra=two,
                   inter=four, dropout_mask_bytes=4, layer_overhead_s=(6.201e-4, 4.536e-4), optimizer_Bps=15.71e9,
                   cores=2, host_copy_Bps=3.942e9, disk_Bps=1.905e9)
    return {"h100-sxm": h100, "a100-80gb": a100, "h200": h200, "cpu-box": cpu}
