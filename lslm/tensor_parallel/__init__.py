"""lslm.tensor_parallel: Megatron-style tensor parallelism and sequence parallelism, applied to a model from outside.

Filled in as the chapter is built; see the module docs of :mod:`.mappings`, :mod:`.layers`,
:mod:`.cross_entropy` and :mod:`.apply`.
"""
