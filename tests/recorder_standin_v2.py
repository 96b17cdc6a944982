"""A stand-in V2 engine built from vLLM's real V2 objects, for the recorder tests on any vLLM
with the V2 runner (0.33 and 0.34, which has no other).

Real: ``BlockTables`` (appends, staged writes, the gather of the batch's input rows; plain
CPU memory, as UVA needs an accelerator), ``MambaHybridModelState``'s ``add_request``,
``preprocess_state`` and ``postprocess_state`` with vLLM's Triton kernels interpreted
(advance, precopy, the accepted-count scatter, the post-process), ``sort_batch_req_ids``
and ``InputBatch``. Stand-in: the scheduler (``recorder_standin.Scheduler``, its outputs
built as the installed vLLM's dataclasses take them) and ``execute_model``,
``prepare_inputs`` and ``sample_tokens``: small functions that call the real pieces in the
V2 runner's order, installed on the real runner class with vLLM's parameter names, so that
the recorder finds and wraps them as it would vLLM's own.
"""

from __future__ import annotations

import os

os.environ.setdefault("CUDA_VISIBLE_DEVICES", "")
os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
os.environ.setdefault("TRITON_INTERPRET", "1")

import dataclasses
from types import SimpleNamespace
from typing import Any, ClassVar

import numpy as np
import torch

from tests.recorder_standin import (
    CPU,
    MAX_BLOCKS,
    MAX_REQS,
    AlignMemory,
    B,
    K,
    Scheduler,
    kv_cache_config,
)


def _fitted(cls: type, **always: Any) -> Any:
    """``cls`` called with the keyword arguments it has: vLLM 0.33 and 0.34 differ in a few
    fields of the scheduler's dataclasses (0.34 dropped the resumed set, made
    ``prefill_token_ids`` required)."""
    names = {f.name for f in dataclasses.fields(cls)}

    def make(**kwargs: Any) -> Any:
        given = {**always, **kwargs}
        return cls(**{k: v for k, v in given.items() if k in names})

    return make


def v2_modules() -> SimpleNamespace:
    """What the stand-in scheduler builds its outputs from, fitted to this vLLM."""
    from vllm.sampling_params import SamplingParams
    from vllm.v1.core.sched.output import CachedRequestData, NewRequestData, SchedulerOutput

    def new_request(**kwargs: Any) -> Any:
        # the V2 runner prefills from prefill_token_ids (optional in 0.33, required in 0.34)
        return _fitted(NewRequestData)(prefill_token_ids=kwargs["prompt_token_ids"], **kwargs)

    return SimpleNamespace(
        NewRequestData=new_request,
        CachedRequestData=_fitted(CachedRequestData),
        SchedulerOutput=_fitted(SchedulerOutput),
        SamplingParams=SamplingParams,
    )


class V2Engine:
    """One real V2 runner instance (no __init__; the attributes the steps use)."""

    def __init__(self, k: int = K, misaddress_at: int | None = None) -> None:
        """``misaddress_at``: the step whose post-process is handed its first two rows' slots
        swapped, so that it saves each one's state into the other's blocks (a corruption the
        replay must name)."""
        import vllm.v1.worker.gpu.buffer_utils as buffer_utils
        import vllm.v1.worker.gpu.model_runner as mr
        import vllm.v1.worker.gpu.model_states.mamba_hybrid as mh
        from vllm.v1.worker.gpu.block_table import BlockTables
        from vllm.v1.worker.gpu.input_batch import InputBuffers

        buffer_utils.is_uva_available = lambda: False  # plain CPU memory for the UVA buffers
        cfg = kv_cache_config(k)
        tables = BlockTables([B], MAX_REQS, 256, [MAX_BLOCKS], CPU)
        # Under PP a post-process runs after later steps re-gathered the input tables, so
        # vLLM points the copies at the per-slot source tables.
        self.memory = AlignMemory.create(k, table=tables.block_tables[0].gpu)
        ctx = self.memory.ctx
        state = object.__new__(mh.MambaHybridModelState)
        state.rope_state = state.prompt_embeds_state = None
        state.recoverssm = None
        state._align_mode, state._use_flashinfer_replayssm = True, False
        state.cache_config = SimpleNamespace(mamba_block_size=B)
        state._mamba_ctx, state._mamba_group_ids = ctx, [0]
        state._mamba_spec = cfg.kv_cache_groups[0].kv_cache_spec
        state.num_accepted_tokens_gpu = torch.ones(MAX_REQS, dtype=torch.int32)
        state._mamba_state_idx_gpu = torch.zeros(MAX_REQS, dtype=torch.int32)
        state._mamba_src_col_gpu = torch.full((MAX_REQS,), -1, dtype=torch.int32)
        state._mamba_src_off_gpu = torch.zeros(MAX_REQS, dtype=torch.int32)
        runner = object.__new__(mr.GPUModelRunner)
        runner.req_states = SimpleNamespace(req_id_to_index={})
        runner.model_state = state
        runner.block_tables = tables
        runner.kv_cache_config = cfg
        runner.cache_config = SimpleNamespace(
            mamba_cache_mode="align",
            enable_prefix_caching=True,
            mamba_block_size=B,
            use_replayssm=False,
        )
        runner.speculative_config = SimpleNamespace(num_speculative_tokens=k) if k else None
        runner.model_config = SimpleNamespace(is_hybrid=True, model="standin-v2")
        runner.use_async_scheduling = False
        runner.decode_query_len = 1 + k
        runner.standin = self
        self.runner = runner
        self.buffers = InputBuffers(MAX_REQS, 256, CPU)
        self.sched = Scheduler(v2_modules(), k=k)
        self.free_slots = list(range(MAX_REQS - 1, -1, -1))  # LIFO, lowest slot on top
        self.computed = torch.zeros(MAX_REQS, dtype=torch.int32)  # the device's, per slot
        self.finished: set[str] = set()
        self.truths: list[dict[str, Any]] = []
        self.misaddress_at = misaddress_at

    def step(self) -> dict[str, Any]:
        """One engine step through the runner class's (possibly hooked) methods."""
        so = self.sched.schedule(self.finished)
        runner = self.runner
        type(runner).execute_model(runner, so)  # returns None: sample_tokens ends the step
        type(runner).sample_tokens(runner, None)
        return self.truths[-1]


def standin_execute_model(
    self: Any, scheduler_output: Any, intermediate_tensors: Any = None, dummy_run: bool = False
) -> None:
    """The V2 runner's order: free finished slots, add new requests (slot, block ids, model
    state), append the running ones' blocks, sort the batch, gather its input tables,
    prepare the inputs, and run the model state's preprocess (advance and precopy)."""
    from vllm.v1.worker.gpu.model_runner import sort_batch_req_ids

    eng, so = self.standin, scheduler_output
    slots = self.req_states.req_id_to_index
    for rid in sorted(so.finished_req_ids):
        eng.free_slots.append(slots.pop(rid))
    for new in so.scheduled_new_reqs:
        slot = slots[new.req_id] = eng.free_slots.pop()
        eng.computed[slot] = new.num_computed_tokens
        self.model_state.add_request(slot, new)
        self.block_tables.append_block_ids(slot, new.block_ids, overwrite=True)
    cached = so.scheduled_cached_reqs
    for rid, computed, ids in zip(
        cached.req_ids, cached.num_computed_tokens, cached.new_block_ids, strict=True
    ):
        eng.computed[slots[rid]] = computed
        if ids is not None:
            self.block_tables.append_block_ids(slots[rid], ids, overwrite=False)
    self.block_tables.apply_staged_writes()
    req_ids = sort_batch_req_ids(
        so.num_scheduled_tokens, so.scheduled_spec_decode_tokens, self.decode_query_len
    )
    idx = torch.tensor([slots[r] for r in req_ids], dtype=torch.int32)
    tables = self.block_tables.gather_block_tables(idx, num_reqs_padded=len(req_ids))
    batch = self.prepare_inputs(so, req_ids, None, 0)
    computed_before = eng.computed.clone()
    sidx_before = self.model_state._mamba_state_idx_gpu.clone()
    acc_before = self.model_state.num_accepted_tokens_gpu.clone()
    self.model_state.preprocess_state(batch, tables, self.kv_cache_config, eng.computed)
    eng.truths.append(
        {
            "req_ids": list(req_ids),
            "idx_mapping": idx.tolist(),
            "computed": computed_before[idx.long()].tolist(),
            "src_col": sidx_before[idx.long()].tolist(),
            "token_bias": [max(a - 1, 0) for a in acc_before[idx.long()].tolist()],
            "state_idx": self.model_state._mamba_state_idx_gpu[idx.long()].tolist(),
            "source": self.block_tables.block_tables[0].gpu.numpy().copy(),
        }
    )
    self.standin_batch, self.standin_so = batch, so


def standin_prepare_inputs(
    self: Any,
    scheduler_output: Any,
    batch_req_state: Any,
    batch_desc: Any,
    num_active_loras: int,
) -> Any:
    """vLLM's ``InputBatch`` for the sorted rows (``batch_req_state``: here, their ids): a
    dummy one from ``make_dummy``, given the step's rows, counts and query offsets."""
    from vllm.v1.worker.gpu.input_batch import InputBatch

    eng, so, req_ids = self.standin, scheduler_output, batch_req_state
    slots = [self.req_states.req_id_to_index[r] for r in req_ids]
    n = len(req_ids)
    scheduled = np.array([so.num_scheduled_tokens[r] for r in req_ids], dtype=np.int32)
    drafts = np.array(
        [len(so.scheduled_spec_decode_tokens.get(r, ())) for r in req_ids], dtype=np.int32
    )
    prompt = np.array([eng.sched.reqs[r].prompt for r in req_ids], dtype=np.int32)
    computed = eng.computed.numpy()[slots].astype(np.int32)
    starts = np.zeros(n + 1, dtype=np.int32)
    np.cumsum(scheduled, out=starts[1:])
    batch = InputBatch.make_dummy(n, int(scheduled.sum()), eng.buffers, is_padding=False)
    return dataclasses.replace(
        batch,
        req_ids=list(req_ids),
        idx_mapping=torch.tensor(slots, dtype=torch.int32),
        idx_mapping_np=np.array(slots, dtype=np.intp),
        num_scheduled_tokens=scheduled,
        num_draft_tokens=int(drafts.sum()),
        num_draft_tokens_per_req=drafts if drafts.any() else None,
        query_start_loc=torch.from_numpy(starts),
        query_start_loc_np=starts,
        num_computed_tokens_np=computed,
        prefill_len_np=prompt,
        num_computed_prefill_tokens_np=np.minimum(computed, prompt),
        is_prefilling_np=computed < prompt,
    )


def standin_sample_tokens(self: Any, grammar_output: Any) -> None:
    """The sampled counts, the new computed counts per slot, then the model state's
    post-process (the accepted-count scatter and the align post-process)."""
    eng = self.standin
    batch, so = self.standin_batch, self.standin_so
    req_ids = list(batch.req_ids)
    out, eng.finished = eng.sched.accepted(req_ids, so)
    sampled = (out != -1).sum(1).to(torch.int32)
    for r, slot in zip(req_ids, batch.idx_mapping.tolist(), strict=True):
        eng.computed[slot] = eng.sched.reqs[r].computed
    idx = batch.idx_mapping
    if eng.sched.step - 1 == eng.misaddress_at and len(idx) > 1:
        idx = idx.clone()
        idx[[0, 1]] = idx[[1, 0]]
    self.model_state.postprocess_state(idx, sampled, eng.computed)
    eng.truths[-1]["sampled"] = sampled.tolist()
    eng.truths[-1]["computed_after"] = eng.computed[batch.idx_mapping.long()].tolist()


class StandinV2Methods:
    """Install the stand-in's runner methods on the real V2 runner class (and restore)."""

    NAMES: ClassVar[dict[str, Any]] = {
        "execute_model": standin_execute_model,
        "prepare_inputs": standin_prepare_inputs,
        "sample_tokens": standin_sample_tokens,
    }

    def __enter__(self) -> StandinV2Methods:
        import vllm.v1.worker.gpu.model_runner as mr

        self.cls = mr.GPUModelRunner
        self.saved = {name: vars(self.cls).get(name) for name in self.NAMES}
        for name, fn in self.NAMES.items():
            setattr(self.cls, name, fn)
        return self

    def __exit__(self, *exc: object) -> None:
        for name, fn in self.saved.items():
            if fn is None:
                delattr(self.cls, name)
            else:
                setattr(self.cls, name, fn)
