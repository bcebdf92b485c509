"""Galaxy-style collaborative Transformer inference (Ye et al., INFOCOM'24).

Hybrid model parallelism: tensor parallelism on the attention and MLP blocks,
sequence parallelism on the connective blocks between them, ring AllGather and
ReduceScatter at the switches (optionally overlapped with the GEMMs tile by
tile), and a heterogeneity- and memory-aware planner choosing the splits.
"""
