"""Galaxy's planner and cost model: how a served Transformer is split across devices.

Only the coordinator plans, so these live beside its serving run; the plan and the
profiles it reads are contracts in `common.galaxy`.
"""
