"""Galaxy's executor: hybrid model parallelism, ring collectives and block profiling.

Tensor parallelism on the attention and MLP blocks, sequence parallelism on the
connective blocks, ring AllGather and ReduceScatter at the switches (optionally
overlapped with the GEMMs tile by tile). Only a worker runs these; the networked ring
is `services.worker.tiles.ZmqRing`.
"""
