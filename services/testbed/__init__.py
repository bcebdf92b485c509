"""Emulated edge devices on one Linux machine: namespaces, shaped links, cgroups.

See `services.testbed.bed.Testbed` for the whole testbed, `spec` for what it
emulates and the presets, `net` and `cgroups` for the kernel plumbing, and
`survey` for finding (and removing) testbeds by name.
"""

from services.testbed.bed import Testbed
from services.testbed.spec import TestbedDevice, TestbedSpec, cluster_spec, load_testbed, preset
from services.testbed.survey import cleanup_leftovers

__all__ = [
    "Testbed",
    "TestbedDevice",
    "TestbedSpec",
    "cleanup_leftovers",
    "cluster_spec",
    "load_testbed",
    "preset",
]
