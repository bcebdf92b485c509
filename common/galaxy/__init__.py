"""Galaxy-style collaborative Transformer inference: the contracts (Ye et al., INFOCOM'24).

What the coordinator and the workers exchange about a served Transformer: its shape
(`config`), a plan's head/column/row splits (`plan`) and a device's measured block
times (`profile`). The engines live with their users: the planner and cost model in
`services.coordinator.galaxy`, the executor, ring and collectives in
`services.worker.galaxy`, and the blocks, model and weights both load in
`services.lib.galaxy`.
"""
