"""Run vLLM's own align kernels on an mgtrace pool, for differential checks.

vLLM's kernels read per-request arrays indexed by request slot and state metadata in its
own terms (base addresses, page strides, inner sizes, conv widths, DS row counts); this
module translates a launch description and a pool into exactly those arguments and calls
the kernels directly, on the same bytes the mgtrace backends use.

vLLM (0.33 and 0.34) indexes block-table rows by request slot in both copy kernels and by
batch row in the aligned-indices gather; launches under any other rule cannot be compared.
"""

from __future__ import annotations

from dataclasses import dataclass
from types import ModuleType

import numpy as np
import torch

from mgtrace.errors import UsageError
from mgtrace.kernels.launch import AlignLaunch
from mgtrace.kernels.pool import BlockTables, StatePool
from mgtrace.kernels.runtime import load_vllm_module

VLLM_MODULE = "vllm.v1.worker.mamba_utils"


def load_vllm_kernels(device: str = "cpu") -> ModuleType:
    """vLLM's align kernel module, or a UsageError saying why it cannot be imported."""
    try:
        return load_vllm_module(VLLM_MODULE, "postprocess_mamba_fused_kernel", device)
    except UsageError:
        raise
    except Exception as exc:  # vLLM's import can fail in many ways on a bare machine
        raise UsageError(
            f"vLLM's align kernels cannot be imported ({exc.__class__.__name__}: {exc}); "
            "install the peer with `make peer`"
        ) from None


def vllm_version() -> str | None:
    try:
        import vllm

        return str(vllm.__version__)
    except Exception:
        return None


def _as_i64(addr: int) -> int:
    return addr - (1 << 64) if addr >= (1 << 63) else addr


@dataclass
class VllmLayout:
    """vLLM's flattened state metadata and bound block tables for one pool."""

    tables: list[torch.Tensor]
    table_ptrs: torch.Tensor
    table_stride: int
    meta: list[torch.Tensor]
    conv_dim_first: bool

    @classmethod
    def build(cls, pool: StatePool, tables: BlockTables) -> VllmLayout:
        device = pool.device
        strides = {t.shape[1] for t in tables.tables}
        if len(strides) != 1:
            raise UsageError("vLLM's kernels need block tables of one width for all groups")
        dev_tables = tables.to_torch(device)
        base = pool.buffer.data_ptr()
        ds = pool.conv_layout == "DS"
        addrs, block, elem, inner, width, group, rows, row_stride = ([] for _ in range(8))
        for spec, off in zip(pool.specs, pool.offsets, strict=True):
            addrs.append(_as_i64(base + off))
            block.append(pool.page_bytes)
            elem.append(spec.elem_size)
            group.append(spec.group)
            if spec.kind == "temporal":
                inner.append(spec.nbytes // spec.elem_size)
                width.append(0)
                rows.append(0)
                row_stride.append(0)
            elif ds:
                inner.append(1)
                width.append(spec.shape[1])
                rows.append(spec.shape[0])
                row_stride.append(spec.shape[1] * spec.elem_size)
            else:
                inner.append(spec.shape[1])
                width.append(spec.shape[0])
                rows.append(0)
                row_stride.append(0)

        def t(values: list[int], dtype: torch.dtype) -> torch.Tensor:
            return torch.tensor(values, dtype=dtype, device=device)

        return cls(
            tables=dev_tables,
            table_ptrs=t([_as_i64(x.data_ptr()) for x in dev_tables], torch.int64),
            table_stride=int(dev_tables[0].stride(0)),
            meta=[
                t(addrs, torch.int64),
                t(block, torch.int64),
                t(elem, torch.int32),
                t(inner, torch.int64),
                t(width, torch.int32),
                t(group, torch.int32),
                t(rows, torch.int32),
                t(row_stride, torch.int64),
            ],
            conv_dim_first=ds,
        )


def comparable(launch: AlignLaunch, has_idx_mapping: bool) -> str | None:
    """Why vLLM's kernels cannot run this launch, or None when they can."""
    slots = np.asarray(np.ma.getdata(launch.req_slot))
    identity = bool(np.array_equal(slots, np.arange(launch.num_rows)))
    if launch.kernel == "aligned_indices":
        if (slots < 0).any():
            return "vLLM's aligned-indices gather has no padded rows"
        if launch.row_rule != "batch_row" and not identity:
            return "vLLM gathers aligned indices by batch row"
        return None
    if launch.row_rule != "req_slot" and not identity:
        return "vLLM copies through request-slot block-table rows"
    if not has_idx_mapping and not identity:
        return "without idx_mapping vLLM's rows are the request slots"
    return None


def alignment_problem(pool: StatePool) -> str | None:
    """Why vLLM's compiled kernels would fault on this pool's layout, or None.

    vLLM's copy of a DS conv state moves whole 2- and 4-byte elements through typed pointers
    (its byte copies of everything else handle any alignment), relying on each state starting
    at a multiple of its element size, as every layout vLLM allocates does. Compiled for a
    GPU, a load off that alignment faults ("misaligned address") and poisons the process's
    CUDA context; the interpreter does not care. mgtrace's kernels take any layout."""
    if pool.conv_layout != "DS":
        return None
    base = pool.buffer.data_ptr()
    for spec, off in zip(pool.specs, pool.offsets, strict=True):
        size = spec.elem_size
        if spec.kind != "conv" or size not in (2, 4):
            continue
        if (base + off) % size or pool.page_bytes % size:
            return (
                f"vLLM's DS conv copy loads whole {size}-byte elements, and this pool puts "
                f"them off that alignment (state at byte {off} of {pool.page_bytes}-byte pages)"
            )
    return None


def _slot_array(launch: AlignLaunch, name: str, size: int, has_idx: bool, fill: int) -> np.ndarray:
    values = launch.column(name)
    if not has_idx:
        return values.copy()
    out = np.full(size, fill, dtype=np.int32)
    slots = launch.column("req_slot")
    live = slots >= 0
    out[slots[live]] = values[live]
    return out


def run_vllm(
    mod: ModuleType,
    launch: AlignLaunch,
    pool: StatePool,
    tables: BlockTables,
    *,
    has_idx_mapping: bool = True,
    tiles: int = 1,
    copy_block: int = 1024,
) -> np.ndarray | None:
    """Run vLLM's kernel for ``launch`` (already validated and sanitized) on ``pool``.

    Returns the accepted counts per batch row (post-process), the aligned indices
    [groups, rows, 1 + k], or None (precopy).
    """
    reason = comparable(launch, has_idx_mapping)
    if reason is None and pool.device.type != "cpu":
        reason = alignment_problem(pool)
    if reason:
        raise UsageError(reason)
    layout = VllmLayout.build(pool, tables)
    device = pool.device
    n = launch.num_rows
    slots_np = launch.column("req_slot")
    size = max(int(slots_np.max(initial=-1)) + 1, n)

    def dev(a: np.ndarray) -> torch.Tensor:
        # A private copy: on the CPU, from_numpy would alias the snapshot and the output.
        return torch.from_numpy(np.array(a, dtype=np.int32)).to(device)

    idx_mapping = dev(slots_np) if has_idx_mapping else None
    if launch.kernel == "aligned_indices":
        k = launch.num_speculative_tokens
        out = torch.full((len(tables), n, k + 1), -1, dtype=torch.int32, device=device)
        seq = dev(launch.column("seq_len"))
        groups = len(tables)
        mod.get_aligned_state_indices_multi_group_kernel[(-(-n // 32),)](
            layout.table_ptrs,
            seq,
            out,
            layout.table_stride,
            seq.stride(0),
            out.stride(0),
            out.stride(1),
            out.stride(2),
            n,
            CACHE_BLOCK_SIZE=launch.block_size,
            NUM_GROUPS=groups,
            BLOCK_GROUPS=_pow2(groups),
            NUM_STATE_SLOTS=k + 1,
            BLOCK_STATE_SLOTS=_pow2(k + 1),
            BLOCK_ROWS=32,
            num_warps=1,
        )
        return out.cpu().numpy()
    grid = (n, len(pool.specs), tiles)
    if launch.kernel == "precopy":
        mod.precopy_mamba_align_fused_kernel[grid](
            dev(_slot_array(launch, "state_idx", size, has_idx_mapping, 0)),
            dev(_slot_array(launch, "src_col", size, has_idx_mapping, -1)),
            dev(_slot_array(launch, "token_bias", size, has_idx_mapping, 0)),
            layout.table_ptrs,
            layout.table_stride,
            *layout.meta,
            idx_mapping,
            n,
            COPY_BLOCK_SIZE=copy_block,
            CONV_STATE_DIM_FIRST=layout.conv_dim_first,
            HAS_IDX_MAPPING=has_idx_mapping,
            TEMPORAL_TILES=tiles,
        )
        _sync(device)
        return None
    precomputed = launch.mode == "precomputed"
    accepted = _slot_array(launch, "num_accepted", size, has_idx_mapping, 1)
    snapshot = dev(accepted)
    out = dev(accepted)
    computed = dev(_slot_array(launch, "num_computed", size, has_idx_mapping, 0))
    scheduled = (
        None if precomputed else dev(_slot_array(launch, "num_scheduled", size, has_idx_mapping, 0))
    )
    draft = None if precomputed else dev(_slot_array(launch, "num_draft", size, has_idx_mapping, 0))
    mod.postprocess_mamba_fused_kernel[grid](
        snapshot,
        dev(_slot_array(launch, "state_idx", size, has_idx_mapping, 0)),
        scheduled,
        computed,
        draft,
        layout.table_ptrs,
        layout.table_stride,
        *layout.meta,
        out,
        idx_mapping,
        n,
        block_size=launch.block_size,
        COPY_BLOCK_SIZE=copy_block,
        CONV_STATE_DIM_FIRST=layout.conv_dim_first,
        HAS_IDX_MAPPING=has_idx_mapping,
        PRECOMPUTED_NEW_COMPUTED=precomputed,
        TEMPORAL_TILES=tiles,
    )
    out_np = out.cpu().numpy()
    rows_out = launch.column("num_accepted").copy()
    live = slots_np >= 0
    rows_out[live] = out_np[slots_np[live]] if has_idx_mapping else out_np[np.nonzero(live)[0]]
    return rows_out


def _pow2(x: int) -> int:
    return 1 << max(0, (x - 1).bit_length())


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
