"""Typed identifiers shared by every service, and the check a job id passes at every border.

`NewType` keeps them plain strings on the wire while letting the type checker
catch a device id passed where a job id belongs. The job id check lives here,
beside the type, so that the records (`common.records`) and the CLI check an
id without importing the job schema (and torch with it).
"""

from __future__ import annotations

import re
from typing import NewType

from common.errors import ConfigError

__all__ = ["JOB_ID_PATTERN", "DeviceId", "JobId", "PlanEpoch", "RoundNo", "check_job_id"]

DeviceId = NewType("DeviceId", str)
JobId = NewType("JobId", str)
PlanEpoch = NewType("PlanEpoch", int)
RoundNo = NewType("RoundNo", int)

JOB_ID_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9._-]{0,63}$"
"""A job id: it becomes part of Redis keys (``ckpt:<id>:...``), so it never holds ``:``,
glob characters (``*?[]``), spaces or a leading dot or dash, and stays short."""

_JOB_ID = re.compile(JOB_ID_PATTERN)


def check_job_id(value: object, sender: str = "the request") -> JobId:
    """Return `value` as a JobId if it matches `JOB_ID_PATTERN`, else raise ConfigError.

    Every boundary that takes a job id from outside (a job file, a SubmitJob or
    CancelJob, the CLI) calls this, so that no id can widen a Redis key into a
    pattern or reach into another job's keys.

    Raises:
        ConfigError: Names the sender, the pattern and the value received.

    """
    if not isinstance(value, str) or not _JOB_ID.fullmatch(value):
        raise ConfigError(
            f"job_id from {sender}: expected 1-64 letters, digits, '.', '_' or '-' starting "
            f"with a letter or digit (pattern {JOB_ID_PATTERN}), got {value!r}"
        )
    return JobId(value)
