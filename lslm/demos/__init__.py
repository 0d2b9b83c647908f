"""Small workers the notebooks launch to show one thing each (not training recipes, not library code).

Launch targets live here (or in :mod:`lslm.bench`), never inside library modules: ``make lint``'s layer contracts
keep the library below them.

* ``smoke`` - a 2-process all-reduce, a deliberate failure, a rank that sleeps (the launcher's tests, notebook 01);
* ``processes`` - the torchrun environment and init methods (notebook 01);
* ``collectives_demo`` - every lslm collective next to torch's with bytes counted, the deadlock lesson (02);
* ``data_parallel_demo`` - single-process DataParallel on any device list (``python -m lslm.demos.data_parallel_demo``);
* ``gradient_accumulation`` - gbs = mbs x k x dp across processes (04b);
* ``ddp_memory`` - a DDP rank's parameters, gradient buckets and AdamW states, counted and by glibc's
  allocator, in one process on the fake backend (04);
* ``tensor_parallel_demo`` - split matmuls, the MLP order, the qkv trap, per-layer traffic, SP drift, dropout
  streams, a Hugging Face GPT-2 made tensor-parallel (05);
* ``activation_check`` - one layer's saved activations measured next to Korthikanti et al.'s table (05);
* ``dtensor_compare`` - serial, lslm and DTensor tensor parallelism on one tiny GPT (05);
* ``hf_llama_gqa`` - a Hugging Face Llama with grouped-query attention, tensor-parallel over more ranks than it
  has key/value heads (05); ``tp_time_model`` - a tensor-parallel step's time model against the measurement (05);
* ``pipeline_demo`` - schedules on processes, torch pipelining side by side (06);
* ``precision_demo``, ``precision_costs``, ``precision_ranks``, ``precision_fp8`` - mixed precision, its costs,
  its agreement across ranks, fp8's errors per scaling scheme (07);
* ``zero_demo``, ``deepspeed_side_by_side`` - ZeRO's stages on processes, and lslm's stage 3 next to FSDP2 and
  DeepSpeed (08);
* ``three_d_demo``, ``three_d_torch`` - the 3D run against the serial one, and the same GPT with torch's DTensor,
  pipelining and FSDP2 on the same mesh, in one launch (09); ``recompute_check`` - activation recomputation's
  bytes and flops against Korthikanti et al. §5 (09);
* ``cp_attention`` - ring attention, zig-zag and Ulysses against full attention at several cp in one launch (10);
* ``moe_training`` - an expert-parallel MoE layer against serial, load balance over training (10);
* ``onebit_demo`` - 1-bit Adam against Adam and without error feedback; writes ``bench/results/onebit_adam`` (10);
* ``pld`` - progressive layer dropping against the baseline: time per step, tokens and seconds to a target
  loss (10; ``python -m lslm.demos.pld --out bench/results/pld``).
"""
