"""The Triton kernels on a device copy of the tag pool, checked against the host's.

A replay reads tags after every launch. Read from a GPU, each read is a transfer, and the
host work around them costs more than the reference backend's whole step. So the replay
keeps its tags on the host, moved by the reference kernels, and the Triton kernels run the
same launches, in the same order, on a device copy that also gets every tag write the
forward model makes; ``verify`` (at every flush of the replay) compares the two copies byte
for byte, and the kernels' accepted counts with the host's, and raises on any difference.
Findings are those of the host copy, which the device copy is proven equal to at each flush.
"""

from __future__ import annotations

from typing import Any

from mgtrace.kernels.launch import AlignLaunch
from mgtrace.kernels.pool import BlockTables, StatePool
from mgtrace.kernels.reference import LaunchResult, run_reference
from mgtrace.replayer.tags import TagPool


class MirroredKernels:
    """A backend over ``tags``: the reference on its host pool, ``device_backend`` (a
    streamed Triton backend) on its ``device_pool``."""

    def __init__(self, device_backend: Any, tags: TagPool) -> None:
        if tags.device_pool is None:
            raise ValueError("the tag pool keeps no device copy")
        self.device_backend = device_backend
        self.tags = tags

    def __call__(self, launch: AlignLaunch, pool: StatePool, tables: BlockTables) -> LaunchResult:
        result = run_reference(launch, pool, tables)
        self.device_backend(launch, self.tags.device_pool, tables, validation=result.validation)
        return result

    def verify(self) -> None:
        # streamed.py imports Triton, which a CPU replay must not load before it chose the
        # interpreter; the device backend has loaded it by now
        from mgtrace.kernels.streamed import KernelDisagreement

        self.device_backend.verify()
        where = self.tags.mirror_mismatch()
        if where is not None:
            block, byte = where
            raise KernelDisagreement(
                f"the Triton kernels left block {block} (byte {byte} of its page) different "
                "from the reference kernels on the same launches"
            )
