"""Byte-addressed Mamba state pool and block tables, laid out the way vLLM lays them out.

vLLM slices every state tensor of a layer out of one page per block, so each state is a base
address plus a block stride (the page size, possibly padded) and a natural size. The kernels
see exactly that: a flat byte buffer, a per-state byte offset inside the page, and a page
stride computed in int64 so that pages past 2**31 bytes do not wrap.

A pool on the CPU owns a numpy byte array, and torch wraps the same memory only when a
caller asks for ``buffer``: the numpy reference, and so a CPU replay, never imports torch
(seconds at every start of the command line). A pool on a GPU owns a uint8 torch tensor.
"""

from __future__ import annotations

import math
import mmap
from collections.abc import Sequence
from dataclasses import dataclass
from functools import cached_property
from typing import TYPE_CHECKING, Any

import numpy as np

from mgtrace.errors import UsageError

if TYPE_CHECKING:
    import torch

CONV_LAYOUTS = ("SD", "DS")
STATE_KINDS = ("conv", "temporal")

ELEM_SIZES = {
    "bool": 1,
    "uint8": 1,
    "int8": 1,
    "float8_e4m3fn": 1,
    "float8_e5m2": 1,
    "int16": 2,
    "uint16": 2,
    "float16": 2,
    "bfloat16": 2,
    "int32": 4,
    "uint32": 4,
    "float32": 4,
    "int64": 8,
    "uint64": 8,
    "float64": 8,
}

# Linux MAP_NORESERVE: a huge pool mapping costs nothing until its pages are touched.
_MAP_NORESERVE = 0x4000


@dataclass(frozen=True)
class StateSpec:
    """One state tensor of one layer, per block (the leading block dimension left out)."""

    group: int  # local Mamba group index: which block table the state's blocks come from
    kind: str  # conv | temporal
    shape: tuple[int, ...]
    dtype: str
    conv_layout: str | None = None  # SD (state_len, dim) | DS (dim, state_len); conv only

    def __post_init__(self) -> None:
        if self.kind not in STATE_KINDS:
            raise UsageError(f"unknown state kind {self.kind!r}; expected conv or temporal")
        if self.dtype not in ELEM_SIZES:
            raise UsageError(f"unsupported state dtype {self.dtype!r}")
        if self.group < 0:
            raise UsageError(f"a state's group index must be >= 0, got {self.group}")
        if any(d <= 0 for d in self.shape) or not self.shape:
            raise UsageError(f"state shape {self.shape} must have positive dimensions")
        if self.kind == "conv":
            if len(self.shape) != 2:
                raise UsageError(f"a conv state has two dimensions per block, got {self.shape}")
            if (self.conv_layout or "SD") not in CONV_LAYOUTS:
                raise UsageError(f"unknown conv layout {self.conv_layout!r}")

    @classmethod
    def from_layout(cls, layout: object) -> StateSpec:
        """From a manifest ``StateLayout`` (group, kind, shape, dtype, conv_layout)."""
        return cls(
            group=int(layout.group),  # type: ignore[attr-defined]
            kind=str(layout.kind),  # type: ignore[attr-defined]
            shape=tuple(int(d) for d in layout.shape),  # type: ignore[attr-defined]
            dtype=str(layout.dtype).removeprefix("torch."),  # type: ignore[attr-defined]
            conv_layout=getattr(layout, "conv_layout", None),
        )

    @property
    def layout(self) -> str:
        return (self.conv_layout or "SD") if self.kind == "conv" else "-"

    @property
    def elem_size(self) -> int:
        return ELEM_SIZES[self.dtype]

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * self.elem_size

    @property
    def width(self) -> int:
        """Conv window length in tokens (the slide axis); 0 for a temporal state."""
        if self.kind != "conv":
            return 0
        return self.shape[0] if self.layout == "SD" else self.shape[1]

    @property
    def unit_bytes(self) -> int:
        """Bytes one token of shift moves along a row: a token row (SD) or an element (DS)."""
        if self.kind != "conv":
            return 0
        return self.shape[1] * self.elem_size if self.layout == "SD" else self.elem_size

    @property
    def rows(self) -> int:
        """Independent rows the window slides in: 1 (SD, temporal) or dim (DS)."""
        return self.shape[0] if self.kind == "conv" and self.layout == "DS" else 1

    @property
    def row_bytes(self) -> int:
        """Bytes between the starts of two rows (DS), or the whole state."""
        if self.kind == "conv" and self.layout == "DS":
            return self.shape[1] * self.elem_size
        return self.nbytes


class StatePool:
    """``num_blocks`` pages of ``page_bytes``; state ``s`` lives at ``offsets[s]`` of a page.

    Block 0 is vLLM's null block: an ordinary page as far as the kernels go.
    """

    def __init__(
        self,
        specs: Sequence[StateSpec],
        num_blocks: int,
        *,
        page_bytes: int | None = None,
        offsets: Sequence[int] | None = None,
        device: str | torch.device = "cpu",
        buffer: torch.Tensor | np.ndarray | None = None,
    ) -> None:
        if not specs:
            raise UsageError("a state pool needs at least one state")
        if num_blocks <= 0:
            raise UsageError(f"a state pool needs at least one block, got {num_blocks}")
        layouts = {s.layout for s in specs if s.kind == "conv"}
        if len(layouts) > 1:
            raise UsageError("all conv states of a pool share one layout (SD or DS)")
        self.specs = tuple(specs)
        self.num_blocks = int(num_blocks)
        if offsets is None:
            packed, pos = [], 0
            for s in self.specs:
                packed.append(pos)
                pos += s.nbytes
            offsets = packed
        self.offsets = tuple(int(o) for o in offsets)
        if len(self.offsets) != len(self.specs):
            raise UsageError("one page offset per state is needed")
        end = max(o + s.nbytes for o, s in zip(self.offsets, self.specs, strict=True))
        self.page_bytes = int(page_bytes if page_bytes is not None else end)
        if min(self.offsets) < 0 or end > self.page_bytes:
            raise UsageError(f"states end at byte {end}, past the page of {self.page_bytes}")
        self._mapping: mmap.mmap | None = None
        self._kind_masks: dict[int, np.ndarray] = {}
        self._views: dict[type, np.ndarray] = {}
        self._all_used: dict[int, bool] = {}
        size = self.num_blocks * self.page_bytes
        self._host: np.ndarray | None = None  # the bytes of a CPU pool made here
        self._buffer: torch.Tensor | None = None
        if isinstance(buffer, np.ndarray):
            if buffer.dtype != np.uint8 or buffer.ndim != 1 or buffer.size < size:
                raise UsageError(f"the pool buffer must be a flat uint8 array of >= {size} bytes")
            self._host = buffer
        elif buffer is None and str(device) == "cpu":
            try:
                self._host = np.zeros(size, dtype=np.uint8)
            except (MemoryError, ValueError):  # ValueError: more than numpy can index
                raise self._too_large(size, device) from None
        else:
            import torch

            if buffer is None:
                try:
                    buffer = torch.zeros(size, dtype=torch.uint8, device=device)
                except (MemoryError, RuntimeError):  # torch.OutOfMemoryError is a RuntimeError
                    raise self._too_large(size, device) from None
            if buffer.dtype != torch.uint8 or buffer.dim() != 1 or buffer.numel() < size:
                raise UsageError(f"the pool buffer must be a flat uint8 tensor of >= {size} bytes")
            self._buffer = buffer

    def _too_large(self, size: int, device: object) -> UsageError:
        return UsageError(
            f"the state pool of {self.num_blocks} blocks of {self.page_bytes} bytes "
            f"({size / 2**30:.1f} GiB) cannot be allocated on {device}"
        )

    @property
    def buffer(self) -> torch.Tensor:
        """The pool bytes as a flat uint8 tensor (on the CPU: the same memory as ``numpy``)."""
        if self._buffer is None:
            import torch

            self._buffer = torch.from_numpy(self._host)
        return self._buffer

    @property
    def on_host(self) -> bool:
        """Whether the bytes live in host memory (numpy views of them are free)."""
        return self._host is not None or self.buffer.device.type == "cpu"

    @classmethod
    def from_run(cls, run: object, *, device: str | torch.device = "cpu") -> StatePool:
        """The recorded state layout (a manifest ``RunMetadata``) at full size."""
        states = getattr(run, "states", None) or []
        num_blocks = getattr(run, "num_blocks", None)
        if not states or not num_blocks:
            raise UsageError("the run metadata has no state layout or no pool size")
        return cls([StateSpec.from_layout(s) for s in states], int(num_blocks), device=device)

    @classmethod
    def sparse(cls, specs: Sequence[StateSpec], num_blocks: int, *, page_bytes: int) -> StatePool:
        """A CPU pool in reserved-but-untouched memory, for pages too large to fill."""
        size = num_blocks * page_bytes
        mapping = mmap.mmap(-1, size, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | _MAP_NORESERVE)
        buffer = np.frombuffer(mapping, dtype=np.uint8, count=size)
        pool = cls(specs, num_blocks, page_bytes=page_bytes, buffer=buffer)
        pool._mapping = mapping  # keeps the memory alive as long as the pool
        return pool

    @property
    def device(self) -> torch.device:
        return self.buffer.device

    @property
    def groups(self) -> tuple[int, ...]:
        return tuple(sorted({s.group for s in self.specs}))

    @cached_property
    def state_bytes(self) -> int:
        """Natural bytes of all states of one block."""
        return sum(s.nbytes for s in self.specs)

    @cached_property
    def max_group(self) -> int:
        return max(s.group for s in self.specs)

    def group_kinds(self, num_groups: int) -> tuple[np.ndarray, np.ndarray]:
        """Per group: whether it has a conv state, whether it has a temporal state."""
        mask = self.group_kind_mask(num_groups)
        return mask[:, 1], mask[:, 2]

    def group_kind_mask(self, num_groups: int) -> np.ndarray:
        """[groups, 3] bool: the group reads its destination, conv source, temporal source."""
        cached = self._kind_masks.get(num_groups)
        if cached is None:
            cached = np.zeros((num_groups, 3), dtype=bool)
            for s in self.specs:
                cached[s.group, 0] = True
                cached[s.group, 1 if s.kind == "conv" else 2] = True
            self._kind_masks[num_groups] = cached
        return cached

    def all_kinds_used(self, num_groups: int) -> bool:
        """Whether every group has both a conv and a temporal state."""
        used = self._all_used.get(num_groups)
        if used is None:
            used = self._all_used[num_groups] = bool(self.group_kind_mask(num_groups).all())
        return used

    @property
    def conv_layout(self) -> str:
        return next((s.layout for s in self.specs if s.kind == "conv"), "SD")

    def numpy(self) -> np.ndarray:
        """The pool bytes as a numpy view (CPU pools only)."""
        return self.view(np.uint8)

    def view(self, dtype: type) -> np.ndarray:
        """The pool's blocks as a flat numpy view of ``dtype`` words (CPU pools only)."""
        cached = self._views.get(dtype)
        if cached is None:
            if not self.on_host:
                raise UsageError("the numpy view needs a CPU pool")
            size = self.num_blocks * self.page_bytes
            data = self._host if self._host is not None else self.buffer.numpy()
            cached = self._views[dtype] = data[:size].view(dtype)
        return cached

    def clone(self, device: str | torch.device | None = None) -> StatePool:
        """A pool with the same layout and a copy of the bytes (dense memory)."""
        size = self.num_blocks * self.page_bytes
        buffer: Any
        if (device is None or str(device) == "cpu") and self.on_host:
            buffer = self.numpy()[:size].copy()
        else:
            import torch

            target = torch.device(device) if device is not None else self.device
            buffer = self.buffer[:size].to(target, copy=True)
        return StatePool(
            self.specs,
            self.num_blocks,
            page_bytes=self.page_bytes,
            offsets=self.offsets,
            buffer=buffer,
        )

    def state_view(self, s: int, block: int) -> np.ndarray:
        """The natural bytes of state ``s`` in ``block`` (CPU pools only)."""
        start = block * self.page_bytes + self.offsets[s]
        return self.numpy()[start : start + self.specs[s].nbytes]

    @cached_property
    def metadata(self) -> dict[str, np.ndarray]:
        """Per-state arrays as the kernels read them (addresses filled in by the launcher)."""
        specs = self.specs
        return {
            "offset": np.array(self.offsets, dtype=np.int64),
            "block_bytes": np.full(len(specs), self.page_bytes, dtype=np.int64),
            "group": np.array([s.group for s in specs], dtype=np.int32),
            "width": np.array([s.width for s in specs], dtype=np.int32),
            "unit": np.array([s.unit_bytes for s in specs], dtype=np.int64),
            "rows": np.array([s.rows for s in specs], dtype=np.int32),
            "row_bytes": np.array([s.row_bytes for s in specs], dtype=np.int64),
            "nbytes": np.array([s.nbytes for s in specs], dtype=np.int64),
        }


class BlockTables:
    """One int32 block table per Mamba group (local group order), rows x columns.

    A snapshot: the tables are copied and made read-only, because derived lookups are
    cached. To change a row, build a new ``BlockTables`` from edited copies.
    """

    def __init__(self, tables: Sequence[np.ndarray | torch.Tensor]) -> None:
        if not tables:
            raise UsageError("at least one block table is needed")
        converted = []
        for t in tables:
            # a tensor (imported only by whoever made it) or anything numpy takes
            arr = t.detach().cpu().numpy() if hasattr(t, "detach") else np.asarray(t)
            if arr.ndim != 2:
                raise UsageError(f"a block table is two-dimensional, got shape {arr.shape}")
            own = np.array(arr, dtype=np.int32, order="C", copy=True)
            own.setflags(write=False)
            converted.append(own)
        self.tables = tuple(converted)

    def __len__(self) -> int:
        return len(self.tables)

    def __getitem__(self, g: int) -> np.ndarray:
        return self.tables[g]

    @property
    def shapes(self) -> tuple[tuple[int, int], ...]:
        return tuple((int(t.shape[0]), int(t.shape[1])) for t in self.tables)

    @cached_property
    def common_shape(self) -> tuple[int, int] | None:
        """The shape all tables share, or None when they differ."""
        shapes = set(self.shapes)
        return next(iter(shapes)) if len(shapes) == 1 else None

    @cached_property
    def cols32(self) -> np.int32:
        shape = self.common_shape
        return np.int32(shape[1] if shape else 0)

    @cached_property
    def bounds(self) -> np.ndarray:
        """[4, 1] exclusive bounds of (row, column, column, column) for the common shape."""
        rows, cols = self.common_shape or (0, 0)
        return np.array([rows, cols, cols, cols], dtype=np.uint32)[:, None]

    @cached_property
    def total_size(self) -> int:
        return sum(int(t.size) for t in self.tables)

    @cached_property
    def flat(self) -> np.ndarray:
        """All tables end to end, for one gather across groups."""
        if len(self.tables) == 1:
            return self.tables[0].ravel()
        return np.concatenate([t.ravel() for t in self.tables])

    @cached_property
    def flat_offsets(self) -> np.ndarray:
        """[G, 1, 1]: where each group's table starts in ``flat``."""
        sizes = [t.size for t in self.tables]
        return np.cumsum([0, *sizes[:-1]]).astype(np.int32)[:, None, None]

    def to_torch(self, device: str | torch.device) -> list[torch.Tensor]:
        import torch

        return [torch.from_numpy(t.copy()).to(device) for t in self.tables]
