"""Typed records: one module owns each Redis key family, its model and its reads and writes.

Everything a service keeps in Redis about a job or a device goes through here,
so a field is named and typed in one place and a reader gets a model, not a
dict of JSON: `jobs` (the ``job:<id>`` hash and the ``jobs`` index), `devices`
(``device:<id>``), `events` and `metrics` (a job's streams), `documents` (its
spec, plan and cluster), `counters` (the fence and the plan epoch) and
`federation` (the ``fl:<id>`` hash). Keys are built from checked job ids
(`common.ids.check_job_id`) or from exact names, never handed to Redis as a
pattern. Only `common.store` touches the Redis client.
"""

__all__: list[str] = []
