"""Single-process DataParallel: the ``torch.nn.DataParallel`` algorithm, written out.

One module per step of the algorithm: ``comm`` (scatter, gather and broadcast as
autograd Functions), ``replicate``, ``apply`` (one thread per replica), ``ledger``
(the bytes every copy moves), ``data_parallel`` (the module that wires them up) and
``measure`` (the GIL, the output-device imbalance and the cost of replicating).
"""

from lslm.data_parallel.single_process.apply import ReplicaError, parallel_apply
from lslm.data_parallel.single_process.comm import chunk_sizes
from lslm.data_parallel.single_process.data_parallel import DataParallel, gather, gpt_token_loss, scatter, to_devices
from lslm.data_parallel.single_process.ledger import Transfer, TransferLedger, tensor_bytes
from lslm.data_parallel.single_process.replicate import replicate

__all__ = ["DataParallel", "ReplicaError", "Transfer", "TransferLedger", "chunk_sizes", "gather", "gpt_token_loss",
           "parallel_apply", "replicate", "scatter", "tensor_bytes", "to_devices"]
