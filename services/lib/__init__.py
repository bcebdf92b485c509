"""Libraries that several services import; not a service (no process, no entry point).

An engine used by exactly one service lives inside that service; one that two truly
share lives here, above `common` (which holds contracts only) and below every service.
`galaxy`: the Transformer blocks, model and weight sources that both the coordinator
(reading a checkpoint's shape) and the workers (loading their shards) use. `export`:
a training job's committed model, for `asteroid export` and Galaxy's checkpoint source.
`lanes` and `split_gain`: Duan & Wu's split device and the measurement of its gain, which
the worker runs and the profiler records in a device's profile.
"""
