"""A stand-in V2 runner step for the recorder's benchmarks: vLLM's V2 call structure and
names, 96 decode rows, k=3, built from plain numpy arrays and torch tensors so that it runs
where vLLM is not installed.

Per step, as vLLM 0.34's V2 runner: ``execute_model`` appends two requests' new blocks
(``BlockTables.append_block_ids``), gathers the batch's input tables, builds the step's
``InputBatch`` in ``prepare_inputs`` (its ``idx_mapping`` a new device tensor, as
``async_tensor_h2d`` makes it), and runs ``MambaHybridModelState.preprocess_state``, whose
pre-copy launch reads slot vectors through ``idx_mapping``; ``sample_tokens`` runs
``postprocess_state`` and its ``run_fused_postprocess_align``. The builder split (the V1
stand-in's builder) runs too.
Each "kernel" is a small device op. ``PPHandler`` exists (the hooks need it) and is not
called: one pipeline stage.
"""

from __future__ import annotations

import json
import time
from types import SimpleNamespace
from typing import Any

import numpy as np
import torch
from bench_recorder import MAX_BLOCKS, MAX_REQS, ROWS, Builder, K, sched_fields
from bench_recorder import Ctx as V1Ctx

from mgtrace.recorder import features

GROWING_ROWS = 2  # requests that cross into a new block each step


class Buf:
    """A CPU array beside its device copy, like vLLM's UVA and staged buffers."""

    def __init__(self, shape: tuple[int, ...], device: torch.device) -> None:
        self.np = np.zeros(shape, np.int32)
        self.gpu = torch.zeros(shape, dtype=torch.int32, device=device)


class BlockTables:
    def __init__(self, device: torch.device) -> None:
        self.num_blocks = Buf((1, MAX_REQS), device)
        self.block_tables = [Buf((MAX_REQS, MAX_BLOCKS), device)]
        self.input_block_tables = [
            torch.zeros((MAX_REQS, MAX_BLOCKS), dtype=torch.int32, device=device)
        ]
        self.num_blocks.np[0, :ROWS] = 12

    def append_block_ids(self, req_index: int, new_block_ids: Any, overwrite: bool) -> None:
        start = 0 if overwrite else int(self.num_blocks.np[0, req_index])
        ids = new_block_ids[0]
        end = min(start + len(ids), MAX_BLOCKS)
        self.block_tables[0].np[req_index, start:end] = ids[: end - start]
        self.num_blocks.np[0, req_index] = end

    def gather_block_tables(
        self, idx_mapping: Any, num_reqs_padded: int, out: Any = None
    ) -> tuple[Any, ...]:
        n = idx_mapping.shape[0]
        self.input_block_tables[0][:n].copy_(self.block_tables[0].gpu[:n])  # the gather kernel
        return tuple(self.input_block_tables)

    def get_dummy_block_tables(self, num_reqs: int) -> tuple[Any, ...]:
        return tuple(self.input_block_tables)


class Ctx(V1Ctx):
    """The align context V2 binds to the per-slot source tables (the pre-copy launcher is
    the V1 stand-in's: the same parameters)."""

    aligned_index_block_table_ptrs: Any = None

    def __init__(self, tables: BlockTables, device: torch.device) -> None:
        self.is_initialized = True
        self.block_table_ptrs = torch.tensor(
            [tables.block_tables[0].gpu.data_ptr()], dtype=torch.int64, device=device
        )

    def run_fused_postprocess_align(
        self,
        num_reqs: int,
        num_accepted_tokens_gpu: Any,
        state_idx_gpu: Any,
        num_computed_tokens_gpu: Any,
        idx_mapping: Any,
    ) -> None:
        num_accepted_tokens_gpu.clamp_(max=K + 1)  # in place, like the kernel


class MambaHybridModelState:
    def __init__(self, ctx: Ctx, device: torch.device) -> None:
        self._align_mode = True
        self._mamba_ctx = ctx
        self.num_accepted_tokens_gpu = torch.full((MAX_REQS,), 2, dtype=torch.int32, device=device)
        self._mamba_state_idx_gpu = torch.full((MAX_REQS,), 7, dtype=torch.int32, device=device)
        self._mamba_src_col_gpu = torch.full((MAX_REQS,), 6, dtype=torch.int32, device=device)
        self._mamba_src_off_gpu = torch.ones(MAX_REQS, dtype=torch.int32, device=device)

    def preprocess_state(
        self,
        input_batch: Any,
        block_tables: Any,
        kv_cache_config: Any,
        num_computed_tokens: Any,
    ) -> None:
        self._mamba_ctx.run_fused_precopy(
            input_batch.num_reqs,
            self._mamba_state_idx_gpu,
            self._mamba_src_col_gpu,
            self._mamba_src_off_gpu,
            input_batch.idx_mapping,
        )

    def postprocess_state(self, input_batch: Any, num_computed_tokens: Any) -> None:
        self._mamba_ctx.run_fused_postprocess_align(
            input_batch.num_reqs,
            self.num_accepted_tokens_gpu,
            self._mamba_state_idx_gpu,
            num_computed_tokens,
            input_batch.idx_mapping,
        )


class PPHandler:
    def __init__(self) -> None:
        self.queue: list[Any] = []

    def receive(self, *args: Any) -> None:
        pass

    def get_prev_sampled_outputs(self, *args: Any) -> None:
        pass


def json_log_v2(fh: Any, runner: Any, so: Any, step: int) -> None:
    """A probe-style logger of the fields the V2 recorder keeps, serialised synchronously
    every step: per row the batch order, request slot, CPU counts, the block-table row, and
    the slot vectors the align kernels read on the device (read back, which
    synchronizes); per step the scheduler's per-request counts and lists."""
    ib, state = runner.batch, runner.model_state
    n = ib.num_reqs
    idx = ib.idx_mapping.tolist()
    device = {
        "accepted_dev": state.num_accepted_tokens_gpu[ib.idx_mapping].tolist(),
        "state_idx_dev": state._mamba_state_idx_gpu[ib.idx_mapping].tolist(),
        "src_col_dev": state._mamba_src_col_gpu[ib.idx_mapping].tolist(),
        "token_bias_dev": state._mamba_src_off_gpu[ib.idx_mapping].tolist(),
        "computed_dev": runner.computed[ib.idx_mapping].tolist(),
    }
    widths = runner.block_tables.num_blocks.np[0]
    source = runner.block_tables.block_tables[0].np
    host = {
        "computed": ib.num_computed_tokens_np[:n].tolist(),
        "scheduled": ib.num_scheduled_tokens[:n].tolist(),
        "draft": ib.num_draft_tokens_per_req[:n].tolist(),
        "prefilling": ib.is_prefilling_np[:n].tolist(),
        "prompt": ib.prefill_len_np[:n].tolist(),
    }
    rows = []
    for i, r in enumerate(ib.req_ids[:n]):
        slot = idx[i]
        row = {name: values[i] for name, values in (*host.items(), *device.items())}
        row.update(
            batch_row=i,
            req_id=r,
            slot=slot,
            block_table=source[slot, : widths[slot]].tolist(),
        )
        rows.append(row)
    record = {"step": step, "t": time.time(), "sched": sched_fields(so), "rows": rows}
    fh.write(json.dumps(record) + "\n")


def build_runner_v2(device: torch.device) -> tuple[Any, dict[features.Target, Any]]:
    """The stand-in runner and, per V2 hook target, the class that owns it."""
    tables = BlockTables(device)
    ctx = Ctx(tables, device)
    state = MambaHybridModelState(ctx, device)
    builder = Builder()
    slots = np.arange(ROWS, dtype=np.int64)[::-1].copy()  # V2's batch order by slot: any
    req_ids = [f"cmpl-{i:08x}-0" for i in range(ROWS)]

    class GPUModelRunner:
        def __init__(self) -> None:
            self.req_states = SimpleNamespace(
                req_id_to_index=dict(zip(req_ids, slots.tolist(), strict=True))
            )
            self.model_state = state
            self.block_tables = tables
            self.kv_cache_config = None
            self.computed = torch.full((MAX_REQS,), 100, dtype=torch.int32, device=device)
            self.step = 0
            self.batch: Any = None

        def execute_model(
            self, scheduler_output: Any, intermediate_tensors: Any = None, dummy_run: bool = False
        ) -> None:
            self.step += 1
            for i in range(GROWING_ROWS):  # two requests take a new block this step
                slot = int(slots[(self.step * GROWING_ROWS + i) % ROWS])
                self.block_tables.append_block_ids(slot, ([self.step % 4096 + 1],), False)
            idx = torch.from_numpy(slots).to(device, non_blocking=True)
            tables_in = self.block_tables.gather_block_tables(idx, num_reqs_padded=ROWS)
            self.batch = self.prepare_inputs(scheduler_output, req_ids, None, 0)
            self.model_state.preprocess_state(
                self.batch, tables_in, self.kv_cache_config, self.computed
            )
            builder._compute_common_metadata(
                None, num_accepted_tokens=state.num_accepted_tokens_gpu
            )

        def prepare_inputs(
            self,
            scheduler_output: Any,
            batch_req_state: Any,
            batch_desc: Any,
            num_active_loras: int,
        ) -> Any:
            n = len(batch_req_state)
            return SimpleNamespace(
                num_reqs=n,
                req_ids=batch_req_state,
                idx_mapping=torch.from_numpy(slots).to(device, non_blocking=True),
                idx_mapping_np=slots,
                num_computed_tokens_np=np.full(n, 100, np.int32),
                num_scheduled_tokens=np.full(n, 1 + K, np.int32),
                num_draft_tokens_per_req=np.full(n, K, np.int32),
                is_prefilling_np=np.zeros(n, bool),
                prefill_len_np=np.full(n, 90, np.int32),
            )

        def sample_tokens(self, grammar_output: Any) -> Any:
            self.model_state.postprocess_state(self.batch, self.computed)
            return grammar_output

    owner_of = {
        "GPUModelRunner": GPUModelRunner,
        "MambaHybridModelState": MambaHybridModelState,
        "PPHandler": PPHandler,
        "BlockTables": BlockTables,
        "MambaSpecDecodeGPUContext": Ctx,
        "BaseMambaAttentionMetadataBuilder": Builder,
    }
    owners = {}
    for t in features.V2_TARGETS:
        owner = owner_of.get(t.owner or "")
        if owner is not None and callable(getattr(owner, t.attr, None)):
            owners[t] = owner
    return GPUModelRunner(), owners
