"""One virtual pipeline stage at run time: forward, backward (``B``, or ``I`` + ``W``) per micro-batch.

:class:`StageRuntime` wraps a :class:`~lslm.pipeline.partition.GPTStage` and keeps, per
micro-batch, what the backward will need: the stage's input (a leaf that requires grad,
so the backward leaves the gradient to send back in ``input.grad``) and its output (the
root of the backward; on the last stage the scaled loss). The executor hands it tensors
and takes tensors back; all communication stays in the executor.

Two memory techniques, both optional:

* **Rematerialisation** (GPipe, Huang et al. 2019, section 2.3; "activation
  checkpointing" per stage): the forward runs under ``no_grad`` and keeps only the input;
  right before the backward the forward runs again with grad, under the forward's autocast and from
  the same RNG state (restored, then put back, so dropout masks replay exactly and nothing else
  changes; :mod:`lslm.runtime.replay`).
  Memory per micro-batch in flight drops to one input; compute grows by one forward.
* **Output deallocation** (Megatron-LM, ``deallocate_output_tensor``): once a stage's
  output has been sent, only its ``grad_fn`` is needed for the backward, not its values
  (the last op of a block is a residual add, which saves nothing). So the output keeps
  its autograd identity while its ``.data`` becomes a 1-element tensor, freeing
  ``b x T x C`` elements per micro-batch in flight. The send itself holds a detached
  alias of the old storage until it completes (:mod:`lslm.pipeline.p2p`), so the
  bytes really go away only then. ``torch.autograd.backward(out, grad)`` would now
  refuse (its Python wrapper checks ``grad.shape == out.shape``, and ``out`` has shape
  ``(1,)``): Megatron calls the C++ engine directly for that reason (``custom_backward``).
  We start the backward from ``out``'s *gradient edge* instead
  (``torch.autograd.graph.get_gradient_edge``), which ``torch.autograd.backward``
  accepts and checks against the shape recorded in the graph at forward time: the
  same effect through a public API.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from contextlib import nullcontext
from typing import Any

import torch
import torch.nn.functional as F
from torch.autograd.graph import get_gradient_edge

from lslm.pipeline.memory import PipelineMemory
from lslm.pipeline.partition import GPTStage
from lslm.pipeline.split_backward import WeightGradStore
from lslm.runtime.replay import ForwardState, capture_forward_state, replaying
from lslm.runtime.startup import synchronize
from lslm.tensor_parallel.random import RNGStatesTracker

__all__ = ["StageRuntime"]


class StageRuntime:
    """Per-micro-batch forward / backward of one virtual stage (``module``) on this rank.

    ``store``: the stage's :class:`WeightGradStore` when its linears were split (needed for
    ``I``/``W``); ``memory``: the rank's :class:`PipelineMemory` when tracking activations.
    ``loss_fn(logits, targets)``: the last stage's mean loss over a micro-batch's tokens
    (default: cross-entropy of full logits; a tensor-parallel head needs the vocabulary-parallel one).
    ``tracker``: the tensor-parallel random streams (``ctx.rng``), replayed with the default generator by
    ``remat``'s re-run so that dropout inside a tensor-parallel stage draws the forward's masks again.
    """

    def __init__(self, module: GPTStage, device: torch.device, *, remat: bool = False,
                 store: WeightGradStore | None = None, memory: PipelineMemory | None = None,
                 loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] | None = None,
                 tracker: RNGStatesTracker | None = None) -> None:
        self.module, self.device, self.remat, self.store, self.memory = module, device, remat, store, memory
        self.tracker = tracker
        self.loss_fn = loss_fn
        self.index = module.index
        self.is_first, self.is_last = module.is_first, module.is_last
        self.inputs: dict[int, torch.Tensor] = {}
        self.outputs: dict[int, torch.Tensor] = {}
        self.targets: dict[int, tuple[torch.Tensor, float]] = {}
        self.forward_states: dict[int, ForwardState] = {}  # remat: what each micro-batch's forward ran under

    @property
    def dtype(self) -> torch.dtype:
        """The stage's compute dtype, read from its parameters (a model cast after splitting sends half tensors)."""
        return next(self.module.parameters()).dtype

    # -- helpers ------------------------------------------------------------------------
    def _saving(self, mb: int) -> Any:
        return self.memory.saving((self.index, mb)) if self.memory is not None else nullcontext()

    def _run(self, mb: int, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The stage's output for ``x`` and, on the last stage, (weighted loss, unweighted loss)."""
        out = self.module(x)
        if not self.is_last:
            return out, None
        y, weight = self.targets[mb]
        if self.loss_fn is not None:
            loss = self.loss_fn(out, y)
        else:  # as GPT.forward: the softmax in fp32, the mean over this micro-batch's tokens
            loss = F.cross_entropy(out.float().flatten(0, 1), y.flatten(), ignore_index=-100)
        return loss * weight, loss.detach()

    # -- the four actions ------------------------------------------------------------
    def forward(self, mb: int, x: torch.Tensor, target: torch.Tensor | None = None,
                loss_weight: float = 1.0) -> torch.Tensor:
        """Forward micro-batch ``mb``: token ids (first stage) or hidden states ``x``.

        Returns the output to pass on (hidden states), or on the last stage the micro-batch's
        mean cross-entropy against ``target`` (detached, unweighted); the backward starts from
        that loss times ``loss_weight`` (``loss_scale / m``: the micro-batch losses then sum to
        the batch mean).
        """
        if mb in self.inputs:
            raise RuntimeError(f"stage {self.index}: F of micro-batch {mb} ran twice in this step")
        if not self.is_first:
            if x.grad_fn is not None or not x.is_leaf:
                x = x.detach()  # handed over from the previous stage on this rank: a new leaf here
            x.requires_grad_(True)  # its .grad after the backward is what goes back to the previous stage
        if self.is_last:
            if target is None:
                raise ValueError(f"the last stage ({self.index}) needs the targets of micro-batch {mb}")
            self.targets[mb] = (target, loss_weight)
        self.inputs[mb] = x
        key = (self.index, mb)
        if self.remat:
            self.forward_states[mb] = capture_forward_state(self.device, self.tracker)
            with torch.no_grad():
                out, loss = self._run(mb, x)
            if self.memory is not None:
                self.memory.hold(key, x, target)
        else:
            with self._saving(mb):
                out, loss = self._run(mb, x)
            self.outputs[mb] = out
            if self.memory is not None:
                self.memory.hold(key, x, out)
                if not self.is_last:
                    self.memory.output_bytes[key] = out.numel() * out.element_size()
        if self.is_last:
            assert loss is not None
            return loss
        return out.detach() if self.remat else out

    def deallocate_output(self, mb: int) -> int:
        """Megatron's output deallocation after ``mb``'s output was sent (module doc); returns the bytes freed."""
        out = self.outputs.get(mb)
        if out is None or self.is_last or out._base is not None:
            # Rematerialised (nothing kept), the loss (never sent), or a view: swapping a view's .data would not
            # free its base's storage (Megatron refuses views for the same reason).
            return 0
        nbytes = out.numel() * out.element_size()
        if self.memory is not None:
            self.memory.drop((self.index, mb), out)
        # Keeps out.grad_fn (the backward's root); the old storage lives on in the send's alias.
        out.data = torch.empty((1,), device=out.device, dtype=out.dtype)
        return nbytes

    def backward(self, mb: int, grad_output: torch.Tensor | None = None, *, split: bool = False) -> torch.Tensor | None:
        """Backward of micro-batch ``mb`` from ``grad_output`` (the gradient of this stage's output; None on the
        last stage, which starts from its loss): a full ``B``, or with ``split`` only the input gradient (``I``,
        weight gradients deferred to :meth:`weight`). Returns the gradient of the stage's input (None on the
        first stage)."""
        if mb not in self.inputs:
            raise RuntimeError(f"stage {self.index}: backward of micro-batch {mb} before its forward")
        if split and self.store is None:
            raise RuntimeError(f"stage {self.index} has no WeightGradStore: split its linears to run I/W")
        if not self.is_last and grad_output is None:
            raise RuntimeError(f"stage {self.index}: backward of micro-batch {mb} needs its output's gradient")
        x = self.inputs.pop(mb)
        key = (self.index, mb)
        if self.remat:
            # The re-run is timed only when memory is tracked: a device sync per micro-batch would otherwise stall
            # a GPU's queue for nothing (synchronize is a no-op on CPU).
            measuring = self.memory is not None
            if measuring:
                synchronize(self.device)
            t0 = time.perf_counter()
            # The forward's autocast and random streams: the re-run computes what the forward computed.
            with replaying(self.forward_states.pop(mb), self.tracker), self._saving(mb):
                root, _ = self._run(mb, x)
            if measuring:
                synchronize(self.device)
            if self.memory is not None:
                self.memory.note_remat(time.perf_counter() - t0)
                self.memory.hold(key, root)  # the re-run output lives until this backward ends
                self.memory.observe()  # the re-run micro-batch on top of the kept inputs: remat's peak
        else:
            root = self.outputs.pop(mb)
        self.targets.pop(mb, None)
        with self.store.deferring(mb) if split and self.store is not None else nullcontext():
            if self.is_last:
                torch.autograd.backward(root)
            else:
                assert grad_output is not None
                # The gradient edge, not the tensor: root may be deallocated to shape (1,) (module doc).
                torch.autograd.backward(get_gradient_edge(root), grad_tensors=grad_output)
        if self.memory is not None:
            self.memory.release(key, self.store.tensors(mb) if split and self.store is not None else ())
        return None if self.is_first else x.grad

    def weight(self, mb: int) -> None:
        """``W`` of micro-batch ``mb``: the weight gradients its ``I`` deferred."""
        if self.store is None:
            raise RuntimeError(f"stage {self.index} has no WeightGradStore: split its linears to run I/W")
        self.store.flush(mb)
        if self.memory is not None:
            self.memory.release((self.index, mb))

    def finish(self) -> None:
        """End of a step: every forward had its backward (and every ``I`` its ``W``)."""
        if self.inputs or self.outputs:
            raise RuntimeError(f"stage {self.index}: micro-batches {sorted(self.inputs)} ran F without a backward")
        if self.store is not None:
            self.store.reset()
