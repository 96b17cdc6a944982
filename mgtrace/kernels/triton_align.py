"""Triton align kernels: the precopy, the post-process and the aligned-state-indices gather.

Grid of the copy kernels: (batch rows, states, temporal tiles). Program (b, s, t) resolves
row b's decision, then moves state s of that row. Per-row inputs are read in batch order
(the launch description holds them as the kernel read them); ``req_slot`` < 0 marks padding.
The block-table row is the request slot or the batch row, fixed at compile time
(``ROW_IS_SLOT``), like the two rules vLLM has shipped. The mamba block size is a runtime
argument, so one compiled variant serves every model.

Addresses are int64 throughout: block ids are widened before they meet the block stride,
so pages larger than 2**31 bytes do not wrap.

On a machine without a GPU, set ``TRITON_INTERPRET=1`` before importing this module (see
``mgtrace.kernels.runtime``). The interpreter runs programs one at a time and checks no
bounds, so launches must be validated first (``run_triton`` does).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
import triton
import triton.language as tl

from mgtrace.kernels.launch import AlignLaunch
from mgtrace.kernels.pool import BlockTables, StatePool
from mgtrace.kernels.reference import LaunchResult
from mgtrace.kernels.validate import Validation, validate_launch

COPY_CHUNK = 1024  # u64 words (or bytes on the misaligned path) per vector step
ROW_TILE = 32  # DS conv rows moved per vector step
BYTE_TILE = 64  # DS conv bytes per row per vector step (a whole window in practice)


@triton.jit
def _copy_bytes(src, dst, nbytes, part, parts, ordered, CHUNK: tl.constexpr):
    """Copy ``nbytes`` from ``src`` to ``dst`` (int64 addresses); do share ``part`` of ``parts``.

    Same sub-8-byte alignment: byte head up to 8-byte alignment, u64 body, byte tail.
    Otherwise bytes only (misaligned u64 accesses fault on some GPUs). With ``ordered`` (a
    same-block left shift, one program) every step barriers between its loads and its
    stores: a later step never loads what an earlier step stored (the source lies above
    the destination), and the barrier keeps a fast warp from storing over bytes a slow warp
    has yet to load, so the shift behaves as a memmove.
    """
    # Distinct names per section: Triton types a loop-carried name by its first shape.
    lanes8 = tl.arange(0, 8)
    lanes = tl.arange(0, CHUNK)
    if ((src ^ dst) & 7) == 0:
        head = tl.minimum((8 - (dst & 7)) & 7, nbytes)
        words = (nbytes - head) // 8
        if part == 0:
            head_mask = lanes8 < head
            head_v = tl.load(src.to(tl.pointer_type(tl.uint8)) + lanes8, mask=head_mask)
            if ordered:
                tl.debug_barrier()
            tl.store(dst.to(tl.pointer_type(tl.uint8)) + lanes8, head_v, mask=head_mask)
        src64 = (src + head).to(tl.pointer_type(tl.uint64))
        dst64 = (dst + head).to(tl.pointer_type(tl.uint64))
        for w in range(part * CHUNK, words, parts * CHUNK):
            body_mask = (w + lanes) < words
            body_v = tl.load(src64 + w + lanes, mask=body_mask)
            if ordered:
                tl.debug_barrier()
            tl.store(dst64 + w + lanes, body_v, mask=body_mask)
        if part == parts - 1:
            done = head + words * 8
            tail_mask = lanes8 < nbytes - done
            tail_v = tl.load((src + done).to(tl.pointer_type(tl.uint8)) + lanes8, mask=tail_mask)
            if ordered:
                tl.debug_barrier()
            tl.store((dst + done).to(tl.pointer_type(tl.uint8)) + lanes8, tail_v, mask=tail_mask)
    else:
        src8 = src.to(tl.pointer_type(tl.uint8))
        dst8 = dst.to(tl.pointer_type(tl.uint8))
        for i in range(part * CHUNK, nbytes, parts * CHUNK):
            byte_mask = (i + lanes) < nbytes
            byte_v = tl.load(src8 + i + lanes, mask=byte_mask)
            if ordered:
                tl.debug_barrier()
            tl.store(dst8 + i + lanes, byte_v, mask=byte_mask)


@triton.jit
def _shift_rows(src, dst, rows, row_bytes, span, ordered, ROWS: tl.constexpr, BYTES: tl.constexpr):
    """DS conv: in each of ``rows`` rows, move ``span`` bytes from ``src`` to ``dst``."""
    r_lanes = tl.arange(0, ROWS)[:, None].to(tl.int64)
    c_lanes = tl.arange(0, BYTES)[None, :].to(tl.int64)
    src8 = src.to(tl.pointer_type(tl.uint8))
    dst8 = dst.to(tl.pointer_type(tl.uint8))
    for r0 in range(0, rows, ROWS):
        r = r0 + r_lanes
        for c0 in range(0, span, BYTES):
            c = c0 + c_lanes
            m = (r < rows) & (c < span)
            v = tl.load(src8 + r * row_bytes + c, mask=m)
            if ordered:
                tl.debug_barrier()
            tl.store(dst8 + r * row_bytes + c, v, mask=m)


@triton.jit
def _copy_state(
    s,
    bt_row,
    src_col,
    dst_col,
    bias,
    part,
    table_addrs,
    table_strides,
    state_addrs,
    state_block_bytes,
    state_groups,
    state_widths,
    state_units,
    state_rows,
    state_row_bytes,
    state_nbytes,
    TILES: tl.constexpr,
    CHUNK: tl.constexpr,
    CONV_DS: tl.constexpr,
    ROWS: tl.constexpr,
    BYTES: tl.constexpr,
):
    """Move state ``s`` of one row from column ``src_col`` (+ bias) to ``dst_col``."""
    g = tl.load(state_groups + s)
    row = tl.load(table_addrs + g).to(tl.pointer_type(tl.int32)) + bt_row.to(tl.int64) * tl.load(
        table_strides + g
    )
    base = tl.load(state_addrs + s)
    stride = tl.load(state_block_bytes + s)
    dst_block = tl.load(row + dst_col).to(tl.int64)
    dst = base + dst_block * stride
    width = tl.load(state_widths + s)
    if width == 0:
        # Temporal: the whole state, taken from the speculative column the bias selects.
        src_block = tl.load(row + src_col + bias).to(tl.int64)
        _copy_bytes(
            base + src_block * stride, dst, tl.load(state_nbytes + s), part, TILES, False, CHUNK
        )
    elif part == 0:
        # Conv windows are small: one program slides the whole window left by the bias.
        keep = width - bias
        if keep > 0:
            src_block = tl.load(row + src_col).to(tl.int64)
            unit = tl.load(state_units + s)
            ordered = (src_block == dst_block) & (bias > 0)
            src = base + src_block * stride + bias.to(tl.int64) * unit
            if CONV_DS:
                _shift_rows(
                    src,
                    dst,
                    tl.load(state_rows + s),
                    tl.load(state_row_bytes + s),
                    keep.to(tl.int64) * unit,
                    ordered,
                    ROWS,
                    BYTES,
                )
            else:
                _copy_bytes(src, dst, keep.to(tl.int64) * unit, 0, 1, ordered, CHUNK)


# The block size is a runtime argument: one compiled kernel serves every block size (a
# division by a register costs nothing next to the copies).
@triton.jit(do_not_specialize=["block_size"])
def align_postprocess_kernel(
    req_slots,
    accepted,
    state_cols,
    scheduled,
    computed,
    drafts,
    accepted_out,
    table_addrs,
    table_strides,
    state_addrs,
    state_block_bytes,
    state_groups,
    state_widths,
    state_units,
    state_rows,
    state_row_bytes,
    state_nbytes,
    block_size,
    PRECOMPUTED: tl.constexpr,
    ROW_IS_SLOT: tl.constexpr,
    CONV_DS: tl.constexpr,
    TILES: tl.constexpr,
    CHUNK: tl.constexpr,
    ROWS: tl.constexpr,
    BYTES: tl.constexpr,
):
    """Post-process of one (row, state, tile). ``accepted`` is the snapshot every program
    reads and ``accepted_out`` a separate buffer (pre-filled with the same counts) that
    receives the resets: were they one buffer, the program of state 0 would reset the count
    before the programs of the other states read it, and those would skip their copy."""
    b = tl.program_id(0)
    s = tl.program_id(1)
    part = tl.program_id(2)
    slot = tl.load(req_slots + b)
    if slot >= 0:
        n_acc = tl.load(accepted + b)
        src = tl.load(state_cols + b)
        if PRECOMPUTED:
            new_computed = tl.load(computed + b)
            running = new_computed - n_acc + 1
        else:
            running = tl.load(computed + b) + tl.load(scheduled + b) - tl.load(drafts + b)
            new_computed = running + n_acc - 1
        blocks = new_computed // block_size
        boundary = blocks * block_size
        if boundary >= running:
            bias = boundary - running
            dst = blocks - 1
            # The boundary state lands in the running column itself: the next step reads it
            # as a fresh window, so the accepted count it sees becomes 1. One program writes.
            if (src == dst) & (s == 0) & (part == 0):
                tl.store(accepted_out + b, 1)
            if (src != dst) | (bias != 0):
                bt_row = slot if ROW_IS_SLOT else b
                _copy_state(
                    s,
                    bt_row,
                    src,
                    dst,
                    bias,
                    part,
                    table_addrs,
                    table_strides,
                    state_addrs,
                    state_block_bytes,
                    state_groups,
                    state_widths,
                    state_units,
                    state_rows,
                    state_row_bytes,
                    state_nbytes,
                    TILES,
                    CHUNK,
                    CONV_DS,
                    ROWS,
                    BYTES,
                )


@triton.jit
def align_precopy_kernel(
    req_slots,
    state_cols,
    src_cols,
    token_biases,
    table_addrs,
    table_strides,
    state_addrs,
    state_block_bytes,
    state_groups,
    state_widths,
    state_units,
    state_rows,
    state_row_bytes,
    state_nbytes,
    ROW_IS_SLOT: tl.constexpr,
    CONV_DS: tl.constexpr,
    TILES: tl.constexpr,
    CHUNK: tl.constexpr,
    ROWS: tl.constexpr,
    BYTES: tl.constexpr,
):
    b = tl.program_id(0)
    s = tl.program_id(1)
    part = tl.program_id(2)
    slot = tl.load(req_slots + b)
    if slot >= 0:
        src = tl.load(src_cols + b)
        dst = tl.load(state_cols + b)
        # A fresh request (src < 0) has nothing to carry; the same column needs no move.
        if (src >= 0) & (src != dst):
            bias = tl.load(token_biases + b)
            bt_row = slot if ROW_IS_SLOT else b
            _copy_state(
                s,
                bt_row,
                src,
                dst,
                bias,
                part,
                table_addrs,
                table_strides,
                state_addrs,
                state_block_bytes,
                state_groups,
                state_widths,
                state_units,
                state_rows,
                state_row_bytes,
                state_nbytes,
                TILES,
                CHUNK,
                CONV_DS,
                ROWS,
                BYTES,
            )


@triton.jit(do_not_specialize=["block_size", "num_rows"])
def align_indices_kernel(
    req_slots,
    seq_lens,
    out,
    table_addrs,
    table_strides,
    num_rows,
    block_size,
    SLOTS: tl.constexpr,
    SLOTS_POW2: tl.constexpr,
    ROW_IS_SLOT: tl.constexpr,
):
    b = tl.program_id(0)
    g = tl.program_id(1)
    slot = tl.load(req_slots + b)
    if slot >= 0:
        first = tl.maximum((tl.load(seq_lens + b) - 1) // block_size, 0)
        bt_row = slot if ROW_IS_SLOT else b
        row = tl.load(table_addrs + g).to(tl.pointer_type(tl.int32)) + bt_row.to(
            tl.int64
        ) * tl.load(table_strides + g)
        j = tl.arange(0, SLOTS_POW2)
        m = j < SLOTS
        ids = tl.load(row + first + j, mask=m)
        tl.store(out + (g * num_rows + b).to(tl.int64) * SLOTS + j, ids, mask=m)


def _as_i64(addr: int) -> int:
    """A pointer's bit pattern as a signed int64 (GPU addresses may set the top bit)."""
    return addr - (1 << 64) if addr >= (1 << 63) else addr


@dataclass
class DeviceLayout:
    """Pool and block-table metadata as device tensors, built once per (pool, tables)."""

    tables: list[torch.Tensor]
    table_addrs: torch.Tensor
    table_strides: torch.Tensor
    state: dict[str, torch.Tensor]
    conv_ds: bool
    row_tile_bytes: int

    @classmethod
    def build(cls, pool: StatePool, tables: BlockTables) -> DeviceLayout:
        return cls.over(pool, tables.to_torch(pool.device))

    @classmethod
    def over(cls, pool: StatePool, dev_tables: list[torch.Tensor]) -> DeviceLayout:
        """The layout over block tables already on the device (kept by address: refill
        them in place and the layout stays valid)."""
        device = pool.device
        meta = pool.metadata
        base = pool.buffer.data_ptr()
        addrs = np.array([_as_i64(base + int(o)) for o in meta["offset"]], dtype=np.int64)
        state = {
            "addrs": addrs,
            "block_bytes": meta["block_bytes"],
            "groups": meta["group"],
            "widths": meta["width"],
            "units": meta["unit"],
            "rows": meta["rows"],
            "row_bytes": meta["row_bytes"],
            "nbytes": meta["nbytes"],
        }
        return cls(
            tables=dev_tables,
            table_addrs=torch.tensor(
                [_as_i64(t.data_ptr()) for t in dev_tables], dtype=torch.int64, device=device
            ),
            table_strides=torch.tensor(
                [t.stride(0) for t in dev_tables], dtype=torch.int64, device=device
            ),
            state={k: torch.from_numpy(np.array(v)).to(device) for k, v in state.items()},
            conv_ds=pool.conv_layout == "DS",
            # One tile size for every pool keeps the number of compiled variants small.
            row_tile_bytes=BYTE_TILE,
        )

    def state_args(self) -> tuple[torch.Tensor, ...]:
        st = self.state
        return (
            st["addrs"],
            st["block_bytes"],
            st["groups"],
            st["widths"],
            st["units"],
            st["rows"],
            st["row_bytes"],
            st["nbytes"],
        )


def launch_postprocess(
    layout: DeviceLayout,
    num_states: int,
    req_slots: torch.Tensor,
    accepted: torch.Tensor,
    state_cols: torch.Tensor,
    scheduled: torch.Tensor,
    computed: torch.Tensor,
    drafts: torch.Tensor,
    accepted_out: torch.Tensor,
    *,
    block_size: int,
    precomputed: bool,
    row_is_slot: bool,
    tiles: int = 1,
    chunk: int = COPY_CHUNK,
) -> None:
    """Enqueue the post-process on device tensors only (no host sync; graph-capturable).

    ``accepted_out`` must not alias ``accepted`` (see ``align_postprocess_kernel``)."""
    grid = (req_slots.shape[0], num_states, tiles)
    align_postprocess_kernel[grid](
        req_slots,
        accepted,
        state_cols,
        scheduled,
        computed,
        drafts,
        accepted_out,
        layout.table_addrs,
        layout.table_strides,
        *layout.state_args(),
        block_size,
        PRECOMPUTED=precomputed,
        ROW_IS_SLOT=row_is_slot,
        CONV_DS=layout.conv_ds,
        TILES=tiles,
        CHUNK=chunk,
        ROWS=ROW_TILE,
        BYTES=layout.row_tile_bytes,
    )


def launch_precopy(
    layout: DeviceLayout,
    num_states: int,
    req_slots: torch.Tensor,
    state_cols: torch.Tensor,
    src_cols: torch.Tensor,
    token_biases: torch.Tensor,
    *,
    row_is_slot: bool,
    tiles: int = 1,
    chunk: int = COPY_CHUNK,
) -> None:
    """Enqueue the precopy on device tensors only (no host sync; graph-capturable)."""
    grid = (req_slots.shape[0], num_states, tiles)
    align_precopy_kernel[grid](
        req_slots,
        state_cols,
        src_cols,
        token_biases,
        layout.table_addrs,
        layout.table_strides,
        *layout.state_args(),
        ROW_IS_SLOT=row_is_slot,
        CONV_DS=layout.conv_ds,
        TILES=tiles,
        CHUNK=chunk,
        ROWS=ROW_TILE,
        BYTES=layout.row_tile_bytes,
    )


def run_triton(
    launch: AlignLaunch,
    pool: StatePool,
    tables: BlockTables,
    *,
    validation: Validation | None = None,
    max_slots: int | None = None,
    tiles: int = 1,
    chunk: int = COPY_CHUNK,
    layout: DeviceLayout | None = None,
) -> LaunchResult:
    """Validate, then run the launch's kernel on the pool's device; rows that fail never run."""
    if validation is None:
        validation = validate_launch(launch, pool, tables, max_slots=max_slots)
    safe = validation.sanitized(launch)
    result = LaunchResult(validation=validation)
    n = safe.num_rows
    if n == 0:
        return result
    if not (safe.column("req_slot") >= 0).any():
        # Nothing survives validation (or the batch is all padding): launch nothing.
        result.accepted_out = validation.accepted_out(launch)
        if safe.kernel == "aligned_indices":
            k = safe.num_speculative_tokens
            result.aligned_indices = np.full((len(tables), n, k + 1), -1, dtype=np.int32)
        return result
    device = pool.device
    layout = layout or DeviceLayout.build(pool, tables)

    def dev(name: str) -> torch.Tensor:
        return torch.from_numpy(np.array(safe.column(name))).to(device)

    slots = dev("req_slot")
    row_is_slot = safe.row_rule == "req_slot"
    if safe.kernel == "postprocess":
        accepted = dev("num_accepted")
        out = accepted.clone()
        computed = dev("num_computed")
        decision = safe.mode == "decision"
        launch_postprocess(
            layout,
            len(pool.specs),
            slots,
            accepted,
            dev("state_idx"),
            dev("num_scheduled") if decision else computed,
            computed,
            dev("num_draft") if decision else computed,
            out,
            block_size=safe.block_size,
            precomputed=not decision,
            row_is_slot=row_is_slot,
            tiles=tiles,
            chunk=chunk,
        )
        result.accepted_out = out.cpu().numpy()
        if validation.problems:
            # Refused rows never ran; their counts are the host decision (reset or kept).
            host = validation.accepted_out(launch)
            if host is not None:
                result.accepted_out = np.where(validation.bad, host, result.accepted_out)
    elif safe.kernel == "precopy":
        launch_precopy(
            layout,
            len(pool.specs),
            slots,
            dev("state_idx"),
            dev("src_col"),
            dev("token_bias"),
            row_is_slot=row_is_slot,
            tiles=tiles,
            chunk=chunk,
        )
    else:
        k = safe.num_speculative_tokens
        out = torch.full((len(tables), n, k + 1), -1, dtype=torch.int32, device=device)
        align_indices_kernel[(n, len(tables))](
            slots,
            dev("seq_len"),
            out,
            layout.table_addrs,
            layout.table_strides,
            n,
            safe.block_size,
            SLOTS=k + 1,
            SLOTS_POW2=triton.next_power_of_2(k + 1),
            ROW_IS_SLOT=row_is_slot,
        )
        result.aligned_indices = out.cpu().numpy()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return result
