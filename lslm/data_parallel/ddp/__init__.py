"""DistributedDataParallel from scratch: three gradient synchronisations behind one API, and torch's.

* :class:`NaiveDDP` - after backward, one all-reduce per gradient;
* :class:`FusedDDP` - after backward, gradients packed into flat buffers (Horovod's tensor fusion);
* :class:`BucketedDDP` - buckets all-reduced asynchronously *during* backward (torch DDP's design);
* :class:`TorchDDP` - ``torch.nn.parallel.DistributedDataParallel`` behind the same API.

::

    ddp = make_ddp(model, ctx, variant="bucketed", bucket_cap_mb=25.0)
    loss = ddp(x, y)[1]; loss.backward(); ddp.finish_grad_sync(); optimizer.step()

Shared behaviour (broadcast at start, ``no_sync``, unused parameters) is described
in :mod:`lslm.data_parallel.ddp.base`; bucket planning in ``buckets``; bitwise
replica checks in ``checks``.
"""

from lslm.data_parallel.buckets import cap_bytes, plan_buckets
from lslm.data_parallel.ddp.base import BROADCAST_LABEL, GRAD_LABEL, UNUSED_LABEL, BucketPlanDDP, DDPBase
from lslm.data_parallel.ddp.bucketed import BucketedDDP
from lslm.data_parallel.ddp.checks import CHECK_LABEL, assert_same_across_ranks, first_mismatch, tensor_digest
from lslm.data_parallel.ddp.factory import VARIANTS, make_ddp
from lslm.data_parallel.ddp.fused import FusedDDP
from lslm.data_parallel.ddp.naive import NaiveDDP
from lslm.data_parallel.ddp.torch_ddp import TorchDDP

__all__ = ["BROADCAST_LABEL", "BucketPlanDDP", "BucketedDDP", "CHECK_LABEL", "DDPBase", "FusedDDP", "GRAD_LABEL",
           "NaiveDDP", "TorchDDP",
           "UNUSED_LABEL", "VARIANTS", "assert_same_across_ranks", "cap_bytes", "first_mismatch", "make_ddp",
           "plan_buckets", "tensor_digest"]
