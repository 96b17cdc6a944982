"""A stand-in V1 engine built from the real vLLM objects, for the recorder tests (vLLM 0.33:
0.34 has no V1 runner; ``AlignMemory`` serves the V2 tests on either).

The bookkeeping vLLM does per step runs on real objects: ``InputBatch`` (add, remove,
condense, swap), the runner's ``_may_reorder_batch`` and the module-level reorder function,
``mamba_utils.preprocess_mamba`` and ``stage_postprocess_inputs_to_gpu``, the runner's
``_update_states_after_model_execute`` and ``MambaSpecDecodeGPUContext``'s launchers with
vLLM's Triton kernels under ``TRITON_INTERPRET=1``. Built with ``k=0`` it serves without a
speculative config, as vLLM then does: no align context, and ``preprocess_mamba`` copies the
states itself (``collect_mamba_copy_meta``, then ``batch_memcpy``). Only the parts that need
a model and a scheduler are replaced: ``execute_model``, ``_update_states`` and
``sample_tokens`` are small functions here that call the real pieces in vLLM's order,
installed on the real runner class so that the recorder wraps them exactly as it would wrap
vLLM's own.

Run as a program it is a stand-in engine process: it loads the mgtrace plugin through a
``vllm.general_plugins`` entry point object, like vLLM does, then steps forever (or
``--steps N``), printing ``READY <pid>`` once the plugin is loaded.
"""

from __future__ import annotations

import os

os.environ.setdefault("CUDA_VISIBLE_DEVICES", "")
os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
os.environ.setdefault("TRITON_INTERPRET", "1")

import argparse
import sys
import time
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any

import numpy as np
import torch

from mgtrace.recorder.features import V1_RUNNER_MODULE

B = 4  # mamba block size
K = 2  # speculative tokens
MAX_REQS = 8
MAX_BLOCKS = 32
NUM_BLOCKS = 160
CPU = torch.device("cpu")


def vllm_modules() -> SimpleNamespace:
    import vllm.v1.attention.backends.utils as attn_utils
    import vllm.v1.worker.gpu_model_runner as gmr
    from vllm.sampling_params import SamplingParams
    from vllm.v1.core.sched.output import CachedRequestData, NewRequestData, SchedulerOutput
    from vllm.v1.utils import CpuGpuBuffer
    from vllm.v1.worker import gpu_input_batch, mamba_utils

    return SimpleNamespace(
        gmr=gmr,
        mu=mamba_utils,
        gib=gpu_input_batch,
        attn_utils=attn_utils,
        SchedulerOutput=SchedulerOutput,
        CachedRequestData=CachedRequestData,
        NewRequestData=NewRequestData,
        CpuGpuBuffer=CpuGpuBuffer,
        SamplingParams=SamplingParams,
    )


def kv_cache_config(k: int = K) -> Any:
    """One Mamba group with one layer holding a conv and a temporal state, in align mode."""
    from vllm.v1.kv_cache_interface import KVCacheConfig, KVCacheGroupSpec, MambaSpec

    spec = MambaSpec(
        block_size=B,
        shapes=((2 + k, 8), (2, 4)),
        dtypes=(torch.float32, torch.float32),
        mamba_cache_mode="align",
        num_speculative_blocks=k,
    )
    return KVCacheConfig(
        num_blocks=NUM_BLOCKS,
        kv_cache_tensors=[],
        kv_cache_groups=[KVCacheGroupSpec(["mamba.0"], spec)],
    )


def align_context(mu: Any, conv: torch.Tensor, temporal: torch.Tensor, table: torch.Tensor) -> Any:
    """A real, initialised ``MambaSpecDecodeGPUContext`` over one layer's conv and temporal
    state and one block table. Its fields differ between vLLM releases (0.34 renamed the
    accepted-count copy and dropped the V1 buffers), so they are filled by name."""
    import dataclasses

    names = {f.name for f in dataclasses.fields(mu.MambaSpecDecodeGPUContext)}

    def t(values: list[int], dtype: torch.dtype) -> torch.Tensor:
        return torch.tensor(values, dtype=dtype)

    kwargs: dict[str, Any] = dict(
        state_base_addrs=t([conv.data_ptr(), temporal.data_ptr()], torch.int64),
        state_block_strides=t([conv.stride(0) * 4, temporal.stride(0) * 4], torch.int64),
        state_elem_sizes=t([4, 4], torch.int32),
        state_inner_sizes=t([conv.stride(1), temporal[0].numel()], torch.int64),
        state_conv_widths=t([conv.size(1), 0], torch.int32),
        state_group_indices=t([0, 0], torch.int32),
        state_dim_row_count=t([0, 0], torch.int32),
        state_dim_row_stride=t([0, 0], torch.int64),
        block_size=B,
        num_states=2,
        mamba_group_ids=[0],
        num_groups=1,
        block_table_ptrs=t([table.data_ptr()], torch.int64),
        aligned_index_block_table_ptrs=t([table.data_ptr()], torch.int64),
        block_table_stride_req=table.stride(0),
        is_initialized=True,
    )
    for name in ("num_accepted_tokens_out", "num_accepted_tokens_snapshot"):
        if name in names:
            kwargs[name] = torch.zeros(MAX_REQS, dtype=torch.int32)
    staging = sorted(n for n in names if n.endswith("_buf"))  # 0.33's V1 staging buffers
    if staging:
        from vllm.v1.utils import CpuGpuBuffer

        for name in staging:
            kwargs[name] = CpuGpuBuffer(MAX_REQS, dtype=torch.int32, device=CPU, pin_memory=False)
    return mu.MambaSpecDecodeGPUContext(**kwargs)


@dataclass
class AlignMemory:
    """One layer's state memory, a block table and the align context pointing at them, for
    driving the V2 model state on its own (no V1 runner: vLLM 0.34 has none). The tensors
    live as long as this object: the context holds only their addresses."""

    conv: torch.Tensor
    temporal: torch.Tensor
    table: torch.Tensor
    ctx: Any

    @classmethod
    def create(cls, k: int = K, table: torch.Tensor | None = None) -> AlignMemory:
        """``table``: the block table the context points at (default: a zeroed one)."""
        from vllm.v1.worker import mamba_utils

        conv = torch.zeros(NUM_BLOCKS, 2 + k, 8, dtype=torch.float32)
        temporal = torch.zeros(NUM_BLOCKS, 2, 4, dtype=torch.float32)
        if table is None:
            table = torch.zeros(MAX_REQS, MAX_BLOCKS, dtype=torch.int32)
        return cls(conv, temporal, table, align_context(mamba_utils, conv, temporal, table))


@dataclass
class Req:
    req_id: str
    prompt: int
    computed: int = 0
    blocks: list[int] = field(default_factory=list)
    output: int = 0
    max_output: int = 6


class Scheduler:
    """Deterministic arrivals, chunked prefill, k drafts per decode, a fixed accept pattern."""

    def __init__(self, v: SimpleNamespace, chunk: int = 5, k: int = K) -> None:
        self.v = v
        self.chunk = chunk
        self.k = k
        self.reqs: dict[str, Req] = {}
        self.next_block = 1
        self.n = 0
        self.step = 0
        self.scheduled: dict[str, int] = {}
        self.drafts: dict[str, int] = {}

    def _alloc(self, r: Req, tokens: int) -> list[int]:
        need = -(-tokens // B) + self.k
        new = list(range(self.next_block, self.next_block + max(0, need - len(r.blocks))))
        self.next_block += len(new)
        if self.next_block >= NUM_BLOCKS - 8:
            self.next_block = 1
        r.blocks += new
        return new

    def schedule(self, finished: set[str]) -> Any:
        v = self.v
        arrivals = {0: [("a", 6), ("b", 3)], 1: [("c", 9)], 2: [("d", 2)], 4: [("e", 7)]}
        new_reqs, cached_ids, cached_new, cached_comp = [], [], [], []
        num_sched: dict[str, int] = {}
        spec: dict[str, list[int]] = {}
        for rid in finished:
            self.reqs.pop(rid, None)
        for r in list(self.reqs.values()):
            if r.computed >= r.prompt:
                n = 1 + self.k
                if self.k:
                    spec[r.req_id] = [0] * self.k
            else:
                n = min(self.chunk, r.prompt - r.computed)
            num_sched[r.req_id] = n
            cached_ids.append(r.req_id)
            cached_new.append((self._alloc(r, r.computed + n),))
            cached_comp.append(r.computed)
        wave = self.step // 6
        for name, plen in arrivals.get(self.step % 6, []):
            rid = f"{name}{wave}"
            r = self.reqs[rid] = Req(rid, plen)
            n = min(self.chunk, plen)
            num_sched[rid] = n
            self._alloc(r, n)
            new_reqs.append(
                v.NewRequestData(
                    req_id=rid,
                    prompt_token_ids=list(range(plen)),
                    mm_features=[],
                    sampling_params=v.SamplingParams(max_tokens=8),
                    pooling_params=None,
                    block_ids=(list(r.blocks),),
                    num_computed_tokens=0,
                    lora_request=None,
                )
            )
        cached = v.CachedRequestData(
            req_ids=cached_ids,
            resumed_req_ids=set(),
            new_token_ids=[],
            all_token_ids={},
            new_block_ids=cached_new,
            num_computed_tokens=cached_comp,
            num_output_tokens=[0] * len(cached_ids),
        )
        so = v.SchedulerOutput(
            scheduled_new_reqs=new_reqs,
            scheduled_cached_reqs=cached,
            num_scheduled_tokens=num_sched,
            total_num_scheduled_tokens=sum(num_sched.values()),
            scheduled_spec_decode_tokens=spec,
            scheduled_encoder_inputs={},
            num_common_prefix_blocks=[0],
            finished_req_ids=set(finished),
            free_encoder_mm_hashes=[],
        )
        self.scheduled = num_sched
        self.step += 1
        return so

    def accepted(self, req_ids: list[str], so: Any) -> tuple[torch.Tensor, set[str]]:
        """Output token ids [n, 1+k] (-1 rejected) and the requests that finish."""
        out = torch.full((len(req_ids), 1 + self.k), -1, dtype=torch.int64)
        finished = set()
        for i, rid in enumerate(req_ids):
            r = self.reqs[rid]
            n = so.num_scheduled_tokens[rid]
            drafts = len(so.scheduled_spec_decode_tokens.get(rid, ()))
            if drafts:
                acc = 1 + (self.n % (self.k + 1))
                self.n += 1
                r.computed += n - drafts + (acc - 1)
                r.output += acc
            else:
                r.computed += n
                acc = 1  # a partial prefill also samples one token (discarded), like vLLM
                r.output += int(r.computed >= r.prompt)
            out[i, :acc] = 7
            if r.output >= r.max_output:
                finished.add(rid)
        return out, finished


class StandinEngine:
    """Owns one real V1 runner instance (no __init__; the attributes the steps use)."""

    def __init__(self, v: SimpleNamespace | None = None, k: int = K) -> None:
        self.v = v = v or vllm_modules()
        gmr = v.gmr
        ib = v.gib.InputBatch(
            max_num_reqs=MAX_REQS,
            max_model_len=B * MAX_BLOCKS,
            max_num_batched_tokens=256,
            device=CPU,
            vocab_size=32,
            block_sizes=[B],
            max_num_blocks_per_req=[MAX_BLOCKS],
            num_spec_tokens=k,
        )
        runner = object.__new__(gmr.GPUModelRunner)
        runner.input_batch = ib
        runner.requests = {}
        runner.mamba_state_idx = {}
        runner.reorder_batch_threshold = 1  # what a threshold-1 drafter backend pulls it to
        runner.kv_cache_config = kv_cache_config(k)
        runner.speculative_config = SimpleNamespace(num_speculative_tokens=k) if k else None
        runner.model_config = SimpleNamespace(is_hybrid=True, model="standin")
        runner.cache_config = SimpleNamespace(
            mamba_cache_mode="align", enable_prefix_caching=True, mamba_block_size=B
        )
        runner.num_accepted_tokens = v.CpuGpuBuffer(
            MAX_REQS, dtype=torch.int32, device=CPU, pin_memory=False
        )
        # vLLM makes the event only with drafts (no accepted counts come back without them)
        runner.num_accepted_tokens_event = (
            SimpleNamespace(record=lambda: None, query=lambda: True) if k else None
        )
        runner.use_async_scheduling = False
        self.conv = torch.zeros(NUM_BLOCKS, 2 + k, 8, dtype=torch.float32)
        self.temporal = torch.zeros(NUM_BLOCKS, 2, 4, dtype=torch.float32)
        # the layer's states, where vLLM's scalar copy path looks them up
        layer = SimpleNamespace(kv_cache=[self.conv, self.temporal])
        runner.compilation_config = SimpleNamespace(static_forward_context={"mamba.0": layer})
        if k:
            self.ctx = align_context(
                v.mu, self.conv, self.temporal, ib.block_table[0].block_table.gpu
            )
            bufs = SimpleNamespace(
                postprocess_align=self.ctx,
                preprocess=SimpleNamespace(
                    mamba_group_ids=[0],
                    mamba_spec=SimpleNamespace(num_speculative_blocks=k, block_size=B),
                    offset=0,
                ),
            )
            copy_funcs: dict[Any, Any] = {}
        else:
            from vllm.model_executor.layers.mamba.mamba_utils import (
                MambaStateCopyFuncCalculator,
            )
            from vllm.v1.attention.backends.registry import MambaAttentionBackendEnum

            mamba2 = MambaStateCopyFuncCalculator.mamba2_state_copy_func()
            copy_funcs = {MambaAttentionBackendEnum.MAMBA2: mamba2}

            def make_buffer(n: int, dtype: torch.dtype) -> Any:
                return v.CpuGpuBuffer(n, dtype=dtype, device=CPU, pin_memory=False)

            bufs = SimpleNamespace(
                postprocess_align=None,
                preprocess=v.mu.MambaCopyBuffers.create(
                    MAX_REQS, runner.kv_cache_config, copy_funcs, make_buffer
                ),
            )
        runner._get_mamba_bufs = lambda: bufs
        runner._get_mamba_state_copy_funcs = lambda: copy_funcs
        self.bufs = bufs
        self.runner = runner
        self.sched = Scheduler(v, k=k)
        self.finished: set[str] = set()

    def step(self) -> dict[str, Any]:
        """One engine step through the runner class's (possibly hooked) methods."""
        so = self.sched.schedule(self.finished)
        runner = self.runner
        type(runner).execute_model(runner, so)  # returns None: sample_tokens ends the step
        req_ids = list(runner.input_batch.req_ids)
        out, self.finished = self.sched.accepted(req_ids, so)
        runner.standin_sampled = (out, so)
        type(runner).sample_tokens(runner, None)
        return {
            "so": so,
            "req_ids": req_ids,
            "accepted": (out != -1).sum(1).numpy().astype(np.int32),
        }


def standin_update_states(self: Any, scheduler_output: Any) -> None:
    """The order of InputBatch bookkeeping in vLLM's _update_states, on the real objects."""
    from vllm.v1.worker.gpu_input_batch import CachedRequestState

    so = scheduler_output
    ib = self.input_batch
    for rid in so.finished_req_ids:
        self.requests.pop(rid, None)
        ib.remove_request(rid)
    cached = so.scheduled_cached_reqs
    for i, rid in enumerate(cached.req_ids):
        req = self.requests[rid]
        req.num_computed_tokens = cached.num_computed_tokens[i]
        idx = ib.req_id_to_index[rid]
        ib.num_computed_tokens_cpu[idx] = req.num_computed_tokens
        new = cached.new_block_ids[i]
        if new is not None and new[0]:
            for g, ids in enumerate(new):
                req.block_ids[g].extend(ids)
            ib.block_table.append_row(new, idx)
    for new in so.scheduled_new_reqs:
        req = CachedRequestState(
            req_id=new.req_id,
            prompt_token_ids=new.prompt_token_ids,
            mm_features=[],
            sampling_params=new.sampling_params,
            generator=None,
            block_ids=tuple(list(g) for g in new.block_ids),
            num_computed_tokens=0,
            output_token_ids=[],
        )
        self.requests[new.req_id] = req
        ib.add_request(req)
    ib.condense()
    self._may_reorder_batch(so)
    ib.refresh_metadata()


def standin_execute_model(
    self: Any, scheduler_output: Any, intermediate_tensors: Any = None
) -> None:
    """vLLM's align-mode order: update states, commit tables, precopy, stage post-process.
    (Its parameters are named as vLLM's: the recorder checks them.)"""
    import vllm.v1.worker.gpu_model_runner as gmr

    so = scheduler_output
    self._update_states(so)
    ib = self.input_batch
    n = ib.num_reqs
    ib.block_table.commit_block_table(n)
    bufs = self._get_mamba_bufs()
    gmr.mamba_utils.preprocess_mamba(
        so,
        self.kv_cache_config,
        self.cache_config,
        self.mamba_state_idx,
        ib,
        self.requests,
        self.compilation_config.static_forward_context,
        self._get_mamba_state_copy_funcs(),
        bufs.preprocess,
        align_ctx=bufs.postprocess_align,
    )
    self.num_accepted_tokens.np[:n] = ib.num_accepted_tokens_cpu[:n]
    self.num_accepted_tokens.copy_to_gpu(n)
    if bufs.postprocess_align is not None:  # vLLM stages only for the fused post-process
        gmr.mamba_utils.stage_postprocess_inputs_to_gpu(
            bufs.postprocess_align, so, ib.req_ids, n, self.requests, self.mamba_state_idx
        )


def standin_sample_tokens(self: Any, grammar_output: Any) -> None:
    """vLLM's second half of a step: the sampled output, then the align post-process."""
    out, so = self.standin_sampled
    self._update_states_after_model_execute(out, so)


class StandinRunnerMethods:
    """Swap the model-dependent runner methods for the stand-in ones, and back."""

    NAMES = ("execute_model", "_update_states", "sample_tokens")

    def __init__(self, gmr: Any) -> None:
        self.cls = gmr.GPUModelRunner
        self.saved = {n: vars(self.cls)[n] for n in self.NAMES}

    def __enter__(self) -> StandinRunnerMethods:
        self.cls.execute_model = standin_execute_model
        self.cls._update_states = standin_update_states
        self.cls.sample_tokens = standin_sample_tokens
        return self

    def __exit__(self, *exc: object) -> None:
        for name, fn in self.saved.items():
            setattr(self.cls, name, fn)


def load_plugin_like_vllm() -> None:
    """vLLM resolves each ``vllm.general_plugins`` entry point and calls it."""
    from importlib.metadata import EntryPoint

    ep = EntryPoint(
        name="mgtrace", value="mgtrace.recorder.plugin:register", group="vllm.general_plugins"
    )
    ep.load()()


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=0, help="0: step until killed")
    ap.add_argument("--sleep", type=float, default=0.0)
    ap.add_argument("--no-plugin", action="store_true")
    ap.add_argument("--name", default="", help="only shows in the command line (process lists)")
    ap.add_argument(
        "--no-spec", action="store_true", help="serve without speculative decoding (k = 0)"
    )
    ap.add_argument(
        "--missing-launcher",
        action="store_true",
        help="a vLLM without the V1 post-process launcher (refused)",
    )
    ap.add_argument(
        "--runner",
        choices=("v1", "v2"),
        default=None,
        help="default: v1 where this vLLM has it (0.33), else v2 (0.34)",
    )
    a = ap.parse_args()
    runner = a.runner or ("v1" if has_v1_runner() else "v2")
    if runner == "v2" and (a.no_spec or a.missing_launcher):
        ap.error("--no-spec and --missing-launcher are V1 stand-in options")
    # the stand-in's step functions go in before the plugin loads: an agent armed from the
    # environment wraps whatever execute_model the runner class holds when it arms
    if runner == "v2":
        from tests.recorder_standin_v2 import StandinV2Methods, V2Engine

        StandinV2Methods().__enter__()
        if not a.no_plugin:
            load_plugin_like_vllm()
        eng: Any = V2Engine()
    else:
        v = vllm_modules()
        StandinRunnerMethods(v.gmr).__enter__()
        if not a.no_plugin:
            load_plugin_like_vllm()
        launcher = v.mu.MambaSpecDecodeGPUContext.run_fused_postprocess
        if a.missing_launcher:
            del v.mu.MambaSpecDecodeGPUContext.run_fused_postprocess
        eng = StandinEngine(v, k=0 if a.no_spec else K)
        if a.missing_launcher and not a.no_spec:
            # the engine still steps, through the launcher bound on its own context, which
            # the recorder's detection (it looks at the class) does not see
            eng.ctx.run_fused_postprocess = launcher.__get__(eng.ctx)
    _say(f"READY {os.getpid()}")
    done = 0
    while a.steps == 0 or done < a.steps:
        eng.step()
        done += 1
        if a.sleep:
            time.sleep(a.sleep)
    _say(f"DONE {done}")
    return 0


def has_v1_runner() -> bool:
    """Whether the installed vLLM has the V1 runner (0.34 removed it)."""
    import importlib.util

    try:
        return importlib.util.find_spec(V1_RUNNER_MODULE) is not None
    except ImportError:
        return False


def _say(line: str) -> None:
    """``line`` in one write. Stand-ins under one parent share its pipe, and print() writes
    the text and its newline apart when output is unbuffered (PYTHONUNBUFFERED): two
    workers' READY lines then came out as "READY 870READY 871"."""
    sys.stdout.flush()
    os.write(sys.stdout.fileno(), f"{line}\n".encode())


if __name__ == "__main__":
    sys.exit(main())
