"""Typed identifiers shared by every service.

`NewType` keeps them plain strings on the wire while letting the type checker
catch a device id passed where a job id belongs.
"""

from typing import NewType

__all__ = ["DeviceId", "JobId", "PlanEpoch", "RoundNo"]

DeviceId = NewType("DeviceId", str)
JobId = NewType("JobId", str)
PlanEpoch = NewType("PlanEpoch", int)
RoundNo = NewType("RoundNo", int)
