"""Align kernels: a launch description, validation, a numpy reference and Triton kernels.

Importing this package does not import Triton; ``mgtrace.kernels.runtime`` loads the Triton
kernels for a device.
"""

from mgtrace.kernels.launch import AlignLaunch, launch_from_arrow, launch_to_arrow
from mgtrace.kernels.pool import BlockTables, StatePool, StateSpec
from mgtrace.kernels.reference import LaunchResult, run_reference
from mgtrace.kernels.validate import MalformedMetadata, Validation, validate_launch

__all__ = [
    "AlignLaunch",
    "BlockTables",
    "LaunchResult",
    "MalformedMetadata",
    "StatePool",
    "StateSpec",
    "Validation",
    "launch_from_arrow",
    "launch_to_arrow",
    "run_reference",
    "validate_launch",
]
