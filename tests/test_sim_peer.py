"""Peer tier: the simulator's batch rules against the real vLLM package on the CPU.

vLLM is imported with CUDA hidden and the CPU target, so ``InputBatch`` builds without
pinned memory. Each case drives the real InputBatch and the simulator's ``InputRows`` through
the same random rounds of removals, additions, condense and reorder, and compares row order,
computed counts, accepted-count buffers, block-table rows and the exact swap sequence.
"""

from __future__ import annotations

import json
import os
import random
from types import SimpleNamespace

import numpy as np
import pytest

from mgtrace.sim.input_rows import InputRows
from mgtrace.sim.reorder import decode_count, regions, reorder_swaps
from tests.conftest import skip_without_v1_runner

pytestmark = pytest.mark.peer

MAX_REQS = 24
MAX_LEN = 512
WIDTH = 16


@pytest.fixture(scope="module")
def vllm_mods():
    os.environ.setdefault("CUDA_VISIBLE_DEVICES", "")
    os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
    try:
        import torch
        from vllm.sampling_params import SamplingParams
        from vllm.v1.attention.backends import utils as attn_utils
    except Exception as exc:  # vLLM absent, or present but not importable here
        pytest.skip(
            f"vLLM is not importable ({exc.__class__.__name__}: {exc}); "
            "run `make peer` to install the peer package"
        )
    return SimpleNamespace(torch=torch, SamplingParams=SamplingParams, attn=attn_utils)


@pytest.fixture(scope="module")
def v1_mods(vllm_mods):
    """With the V1 runner's InputBatch, which vLLM 0.34 removed (its tests skip there)."""
    skip_without_v1_runner()
    from vllm.v1.worker.gpu_input_batch import CachedRequestState, InputBatch

    return SimpleNamespace(
        **vars(vllm_mods), CachedRequestState=CachedRequestState, InputBatch=InputBatch
    )


def _input_batch(v):
    return v.InputBatch(
        max_num_reqs=MAX_REQS,
        max_model_len=MAX_LEN,
        max_num_batched_tokens=4096,
        device=v.torch.device("cpu"),
        vocab_size=1000,
        block_sizes=[16],
        max_num_blocks_per_req=[WIDTH],
    )


def _state(v, req_id: str, prompt: int, computed: int, blocks: list[int]):
    return v.CachedRequestState(
        req_id=req_id,
        prompt_token_ids=[1] * prompt,
        mm_features=[],
        sampling_params=v.SamplingParams(),
        generator=None,
        block_ids=(list(blocks),),
        num_computed_tokens=computed,
        output_token_ids=[],
    )


def _real_row(ib, row: int) -> list[int]:
    bt = ib.block_table[0]
    return bt.block_table.np[row, : bt.num_blocks_per_row[row]].tolist()


@pytest.mark.parametrize("seed", range(12))
def test_rows_and_reorder_match_input_batch(v1_mods, seed: int) -> None:
    v = v1_mods
    rng = random.Random(seed)
    real = _input_batch(v)
    ours = InputRows(MAX_REQS)
    real_swaps: list[tuple[int, int]] = []
    real_swap = real.swap_states

    def recording_swap(i1: int, i2: int) -> None:
        real_swaps.append((i1, i2))
        real_swap(i1, i2)

    real.swap_states = recording_swap
    prompts: dict[str, int] = {}
    next_id = 0
    for _round in range(30):
        ours.begin_step()
        n0 = ours.num_reqs
        before = np.array([rng.randint(1, 4) for _ in range(n0)], np.int32)
        real.num_accepted_tokens_cpu[:n0] = before
        ours.acc[:n0] = before
        live = list(ours.req_row)
        for rid in rng.sample(live, k=rng.randint(0, len(live))):
            real.remove_request(rid)
            ours.remove(rid)
        for rid in list(ours.req_row):
            if rng.random() < 0.3 and len(ours.bt[ours.req_row[rid]]) < WIDTH:
                extra = [rng.randint(1, 999)]
                real.block_table.append_row([extra], real.req_id_to_index[rid])
                ours.append_blocks(rid, extra)
        for _ in range(rng.randint(0, MAX_REQS - ours.num_reqs)):
            rid = f"r{next_id}"
            next_id += 1
            prompt = rng.randint(1, 200)
            computed = rng.choice([0, 0, rng.randint(0, prompt), prompt, prompt + 3])
            blocks = [rng.randint(0, 999) for _ in range(rng.randint(1, 4))]
            prompts[rid] = prompt
            real.add_request(_state(v, rid, prompt, computed, blocks))
            ours.add(rid, computed, prompt, blocks)
        real.condense()
        ours.condense()
        n = ours.num_reqs
        assert real.req_ids == ours.req_ids()
        assert real.num_accepted_tokens_cpu[:n].tolist() == ours.acc[:n].tolist()
        # the accepted-count buffer must travel with the rows through the reorder
        marks = np.array([rng.randint(1, 4) for _ in range(n)], np.int32)
        real.num_accepted_tokens_cpu[:n] = marks
        ours.acc[:n] = marks
        sched = {rid: rng.choice([1, 2, 3, 4, 5, 9, 40]) for rid in ours.req_ids()}
        threshold = rng.choice([1, 2, 4])
        real_swaps.clear()
        v.attn.reorder_batch_to_split_decodes_and_prefills(
            real, SimpleNamespace(num_scheduled_tokens=sched), decode_threshold=threshold
        )
        sched_n = np.array([sched[r] for r in ours.req_ids()])
        our_swaps = reorder_swaps(regions(sched_n, ours.nc[:n], ours.prompt[:n], threshold))
        for a, b in our_swaps:
            ours.swap(a, b)
        assert real_swaps == our_swaps
        assert real.req_ids == ours.req_ids()
        assert real.num_computed_tokens_cpu[:n].tolist() == ours.nc[:n].tolist()
        assert real.num_accepted_tokens_cpu[:n].tolist() == ours.acc[:n].tolist()
        for row in range(MAX_REQS):
            assert _real_row(real, row) == ours.bt[row], row
        real.refresh_metadata()


def _metadata(v, qlen: np.ndarray, computed: np.ndarray, is_prefilling):
    """vLLM's CommonAttentionMetadata of a batch with these query lengths and computed
    counts, on the CPU, with the builder's ``is_prefilling``."""
    torch = v.torch
    n = len(qlen)
    qsl = torch.tensor(np.concatenate([[0], np.cumsum(qlen)]), dtype=torch.int32)
    seq = torch.tensor(computed + qlen, dtype=torch.int32)
    return v.attn.CommonAttentionMetadata(
        query_start_loc=qsl,
        query_start_loc_cpu=qsl,
        seq_lens=seq,
        num_reqs=n,
        num_actual_tokens=int(qlen.sum()),
        max_query_len=int(qlen.max()),
        max_seq_len=int(seq.max()),
        block_table_tensor=torch.zeros((n, 4), dtype=torch.int32),
        slot_mapping=torch.zeros(int(qlen.sum()), dtype=torch.int64),
        is_prefilling=is_prefilling,
        seq_lens_cpu_upper_bound=seq,
    )


@pytest.mark.parametrize("seed", range(40))
def test_split_matches_split_decodes_and_prefills(vllm_mods, seed: int) -> None:
    v = vllm_mods
    rng = np.random.default_rng(seed)
    n = int(rng.integers(1, 32))
    threshold = int(rng.choice([1, 2, 4, 8]))
    qlen = rng.choice([1, 2, 3, 4, 5, 8, 17, 300], size=n)
    computed = rng.choice([0, 10, 100, 500], size=n)
    prompt = rng.choice([5, 50, 200, 1000], size=n)
    order = np.argsort(regions(qlen, computed, prompt, threshold), kind="stable")
    qlen, computed, prompt = qlen[order], computed[order], prompt[order]
    prefilling = computed < prompt
    cm = _metadata(v, qlen, computed, v.torch.tensor(prefilling))
    num_decodes, *_ = v.attn.split_decodes_and_prefills(
        cm, decode_threshold=threshold, treat_short_extends_as_decodes=False
    )
    assert num_decodes == decode_count(qlen, prefilling, threshold)


@pytest.mark.parametrize("seed", range(20))
def test_gdn_positional_split_matches_its_builders_call(vllm_mods, seed: int) -> None:
    """GDN without a spec mask: its builder marks rows without prior state as prefilling
    (``seq_len <= query_len`` among prefilling rows) and splits at threshold 1."""
    from mgtrace.sim.reorder import builder_split

    v = vllm_mods
    torch = v.torch
    rng = np.random.default_rng(1000 + seed)
    n = int(rng.integers(1, 32))
    qlen = rng.choice([1, 2, 3, 4, 5, 8, 17, 300], size=n)
    computed = rng.choice([0, 10, 100, 500], size=n)
    prompt = rng.choice([5, 50, 200, 1000], size=n)
    order = np.argsort(regions(qlen, computed, prompt, 1), kind="stable")
    if seed % 2:  # also batches in no particular order
        order = rng.permutation(n)
    qlen, computed, prompt = qlen[order], computed[order], prompt[order]
    seq = torch.tensor(computed + qlen, dtype=torch.int32)
    query = torch.tensor(qlen, dtype=torch.int32)
    no_prior_state = (query > 0) & (seq <= query) & torch.tensor(computed < prompt)
    cm = _metadata(v, qlen, computed, no_prior_state)
    num_decodes, *_ = v.attn.split_decodes_and_prefills(
        cm, decode_threshold=1, treat_short_extends_as_decodes=False
    )
    ours = builder_split("gdn", qlen, computed, prompt, np.zeros(n, np.int64), 0)
    assert ours.num_decodes == num_decodes and ours.threshold == 1
    assert ours.decode.tolist() == [i < num_decodes for i in range(n)]


# ---------------------------------------------------------------- preemption under async


@pytest.fixture(scope="module")
def vllm_async_scheduler(vllm_mods, tmp_path_factory):
    """A factory of vLLM's real AsyncScheduler over one full-attention group of ``blocks``
    blocks (null block included), with a tiny local model config (nothing is downloaded)."""
    try:
        from vllm.config import CacheConfig, ModelConfig, SchedulerConfig, VllmConfig
        from vllm.sampling_params import SamplingParams
        from vllm.v1.core.sched.async_scheduler import AsyncScheduler
        from vllm.v1.kv_cache_interface import (
            FullAttentionSpec,
            KVCacheConfig,
            KVCacheGroupSpec,
        )
        from vllm.v1.outputs import ModelRunnerOutput
        from vllm.v1.request import Request
        from vllm.v1.structured_output import StructuredOutputManager
    except Exception as exc:
        pytest.skip(f"vLLM's scheduler is not importable ({exc.__class__.__name__}: {exc})")
    model_dir = tmp_path_factory.mktemp("tiny-llama")
    (model_dir / "config.json").write_text(
        json.dumps(
            {
                "architectures": ["LlamaForCausalLM"],
                "model_type": "llama",
                "hidden_size": 64,
                "intermediate_size": 128,
                "num_attention_heads": 4,
                "num_key_value_heads": 4,
                "num_hidden_layers": 1,
                "vocab_size": 1000,
                "max_position_embeddings": 2048,
                "torch_dtype": "float32",
            }
        )
    )
    model = ModelConfig(
        model=str(model_dir), skip_tokenizer_init=True, max_model_len=1024, dtype="float32"
    )

    def make(blocks: int, block_size: int = 16):
        cfg = VllmConfig(
            model_config=model,
            scheduler_config=SchedulerConfig(
                max_num_seqs=8,
                max_num_batched_tokens=256,
                max_model_len=1024,
                is_encoder_decoder=False,
            ),
            cache_config=CacheConfig(block_size=block_size, enable_prefix_caching=False),
        )
        cfg.cache_config.num_gpu_blocks = blocks
        spec = FullAttentionSpec(
            block_size=block_size, num_kv_heads=4, head_size=16, dtype=vllm_mods.torch.float32
        )
        kv = KVCacheConfig(
            num_blocks=blocks,
            kv_cache_tensors=[],
            kv_cache_groups=[KVCacheGroupSpec(["layer.0"], spec)],
        )
        sched = AsyncScheduler(
            vllm_config=cfg,
            kv_cache_config=kv,
            structured_output_manager=StructuredOutputManager(cfg),
            block_size=block_size,
        )
        return sched

    return SimpleNamespace(
        make=make, Request=Request, SamplingParams=SamplingParams, Output=ModelRunnerOutput
    )


# (prompt, output) per request: the pool is short, so the last ones are preempted while a
# step of theirs is in flight; the last request's output ends in such a step
_PREEMPT_LOAD = ((15, 40), (15, 40), (15, 40), (14, 2))


class _Steps:
    """One engine driven with ``lag`` steps in flight; a scheduled row that ends its prefill
    or decodes samples one token, delivered when the step's result arrives. The budget takes
    a whole prefill, but an align-mode Mamba scheduler (the simulator's) ends a resumed
    prefill's first chunk at its last cacheable block boundary (``block``)."""

    def __init__(self, lag: int, block: int | None = None) -> None:
        self.lag = lag
        self.block = block
        self.sampled: dict[str, int] = {}  # tokens sampled for a request so far
        self.flight: dict[str, int] = {}  # the last step a request was scheduled in
        self.stale_preemptions = 0
        self.finished_waiting = 0
        self.waiting: set[str] = set()  # preempted, not resumed
        self.resumes = 0
        self.prompt: dict[str, int] = {}
        self.output: dict[str, int] = {}

    def check(self, step: int, rows: list[tuple[str, bool, int, bool]], pre: set, fin: set) -> None:
        """The rules on one scheduled step: ``rows`` (request, resumed, tokens, samples), the
        requests it preempted and those it reports finished."""
        for rid, resumed, n, samples in rows:
            if resumed:
                # every step before the preemption has delivered its token
                assert self.flight[rid] <= step - 1 - self.lag, (step, rid)
                tokens = self.prompt[rid] + self.sampled[rid]
                if self.block and tokens - 1 >= self.block:  # k = 0: no block drop
                    tokens = (tokens - 1) // self.block * self.block
                assert n == tokens, (step, rid)
                self.waiting.discard(rid)
                self.resumes += 1
            self.sampled[rid] = self.sampled.get(rid, 0) + samples
            self.flight[rid] = step
        for rid in fin & self.waiting:
            self.finished_waiting += 1
            assert self.sampled[rid] == self.output[rid], rid
        for rid in pre:
            self.stale_preemptions += self.flight[rid] > step - 1 - self.lag
            self.waiting.add(rid)


def _drive_vllm(factory, lag: int, steps: int) -> _Steps:
    sched = factory.make(blocks=6)
    t = _Steps(lag)
    for i, (prompt, output) in enumerate(_PREEMPT_LOAD):
        rid = "abcd"[i]
        t.prompt[rid], t.output[rid] = prompt, output
        params = factory.SamplingParams(max_tokens=output, ignore_eos=True)
        sched.add_request(factory.Request(rid, [1] * prompt, params, None))
    pending = []
    for step in range(steps):
        so = sched.schedule()
        # the V2 runner's output lists resumed requests among the new ones (vLLM 0.34, with
        # only that runner, has no resumed set left)
        resumed = set(getattr(so.scheduled_cached_reqs, "resumed_req_ids", ()))
        resumed |= {r.req_id for r in so.scheduled_new_reqs if r.req_id in t.flight}
        rows = [(r, r in resumed, n, True) for r, n in so.num_scheduled_tokens.items()]
        t.check(step, rows, set(so.preempted_req_ids or ()), set(so.finished_req_ids))
        pending.append(so)
        if len(pending) > lag:
            done = pending.pop(0)
            ids = list(done.num_scheduled_tokens)
            fields = {"req_ids": ids, "sampled_token_ids": [[7] for _ in ids]}
            if "req_id_to_index" in factory.Output.__dataclass_fields__:  # 0.34 dropped it
                fields["req_id_to_index"] = {r: i for i, r in enumerate(ids)}
            out = factory.Output(**fields)
            sched.update_from_output(done, out)
    return t


def _drive_sim(lag: int, steps: int) -> _Steps:
    from mgtrace.sim import SimConfig
    from mgtrace.sim.scheduler import KIND_RESUMED, Scheduler
    from mgtrace.sim.workload import Arrival

    cfg = SimConfig(
        k=0, mamba_block_size=16, num_blocks=5, max_num_seqs=8, max_num_batched_tokens=256
    )
    sched = Scheduler(cfg.validate())
    t = _Steps(lag, cfg.mamba_block_size)
    for i, (prompt, output) in enumerate(_PREEMPT_LOAD):
        rid = "abcd"[i]
        t.prompt[rid], t.output[rid] = prompt, output
        sched.new_request(rid, Arrival("c", 0.0, prompt, output, output, -1, 0, False, 0))
    pending = []
    for step in range(steps):
        so = sched.schedule(step)
        rows = [
            (r, k == KIND_RESUMED, int(n), bool(s))
            for r, k, n, s in zip(so.req_ids, so.kind, so.num_scheduled, so.samples, strict=True)
        ]
        pre = {r.req_id for r in so.preempted}
        t.check(step, rows, pre, {r.req_id for r in so.finished})
        pending.append(so)
        if len(pending) > lag:
            done = pending.pop(0)
            sched.apply_results(done, np.ones(len(done), np.int64))
    return t


@pytest.mark.parametrize("lag", [1, 2])
def test_preemption_keeps_in_flight_output_like_the_async_scheduler(
    vllm_async_scheduler, lag: int
) -> None:
    """vLLM's _preempt_request marks a request's in-flight output stale: update_from_output
    still appends its tokens (leaving the reset counters alone), the scheduler resumes the
    request only once that output is in, and the resumed prefill replays it; output that
    completes the request finishes it while it waits. The same rules hold in vLLM's
    AsyncScheduler and in the simulator's scheduler, one or two steps in flight. Control:
    both preempt requests with a step in flight, resume some and finish one while
    preempted."""
    for t in (_drive_vllm(vllm_async_scheduler, lag, 120), _drive_sim(lag, 120)):
        assert t.stale_preemptions >= 2 and t.resumes >= 1 and t.finished_waiting >= 1


@pytest.mark.parametrize("seed", range(8))
@pytest.mark.parametrize("async_", [False, True])
def test_align_rows_match_mamba_manager(vllm_mods, seed: int, async_: bool) -> None:
    """One request's align-mode block row, step by step (prefill chunks, then decodes with
    drafts and random acceptance), against the real MambaManager and BlockPool: block ids
    show the pool's reuse order of freed blocks."""
    from vllm.v1.core.block_pool import BlockPool as RealPool
    from vllm.v1.core.single_type_kv_cache_manager import MambaManager
    from vllm.v1.kv_cache_interface import MambaSpec

    from mgtrace.sim.block_pool import AlignAllocator, BlockPool

    B, S = 16, 2
    rng = random.Random(seed)
    spec = MambaSpec(
        block_size=B,
        shapes=((4,),),
        dtypes=(vllm_mods.torch.float32,),
        mamba_cache_mode="align",
        num_speculative_blocks=S,
    )
    real_pool = RealPool(200, enable_caching=False, hash_block_size=B)
    real = MambaManager(
        spec, real_pool, enable_caching=False, kv_cache_group_id=0, scheduler_block_size=B
    )
    sim = AlignAllocator(BlockPool(200), B, S)
    prompt = rng.randint(5, 100)
    nc = in_flight = pending = 0  # async: the step in flight, its rejection applied later
    for step in range(40):
        rem = prompt - nc
        if rem > 0:
            d, n = 0, min(rem, rng.choice([16, 32, 48, 100]))
            if n < rem:
                n = ((nc + n) // B) * B - nc or rem
        else:
            d = S
            n = 1 + d
        processed = max(0, nc - in_flight)
        real.remove_skipped_blocks("r", processed)
        real.get_num_blocks_to_allocate("r", nc + n, [], nc, nc, nc + n)
        real.allocate_new_blocks("r", nc + n, nc + n)
        sim.retire("r", processed)
        sim.allocate("r", nc + n)
        assert sim.rows["r"] == [b.block_id for b in real.req_to_blocks["r"]], step
        rejected = 1 + d - rng.randint(1, 1 + d) if d else 0
        if async_:
            nc += n - pending
            in_flight, pending = n, rejected
        else:
            nc += n - rejected
    real.free("r")
    sim.free("r")
    assert [b.block_id for b in real_pool.get_new_blocks(6)] == sim.pool.take(6)


@pytest.mark.parametrize("seed", range(6))
def test_prefix_cache_eviction_matches_block_pool(vllm_mods, seed: int) -> None:
    """Random allocations, caching of held blocks, prefix hits and frees against the real
    BlockPool with caching on: after each, the free queue's order and which cached states
    still hit agree. vLLM evicts a cached block only when get_new_blocks hands it out, so a
    held one stays cached and a freed one stays a hit at the queue's tail until then."""
    from vllm.v1.core.block_pool import BlockPool as RealPool
    from vllm.v1.core.kv_cache_utils import BlockHash, make_block_hash_with_group_id

    from mgtrace.sim.block_pool import BlockPool, PrefixCache

    n_blocks, families = 24, 6
    rng = random.Random(seed)
    real = RealPool(n_blocks, enable_caching=True, hash_block_size=16)
    pool = BlockPool(n_blocks)
    cache = PrefixCache(pool)
    key = [
        make_block_hash_with_group_id(BlockHash(bytes([f + 1]) * 32), 0) for f in range(families)
    ]

    def real_hit(f: int) -> int | None:
        blocks = real.get_cached_block(BlockHash(bytes([f + 1]) * 32), [0])
        return None if blocks is None else blocks[0].block_id

    held: list[list[int]] = []  # per live request, its blocks in allocation order
    evicted_while_cached = 0  # controls: the queue handed out a cached block,
    hit_in_queue = 0  # and a hit took one back out of the queue
    for op in range(300):
        kind = rng.choice(["take", "take", "cache", "hit", "free", "free"])
        if kind == "take" and pool.num_free:
            n = rng.randint(1, min(3, pool.num_free))
            evicted_while_cached += any(b in pool.shared for b in list(pool.free)[:n])
            got = pool.take(n)
            assert [b.block_id for b in real.get_new_blocks(n)] == got, op
            held.append(got)
        elif kind == "cache" and held:
            f = rng.randrange(families)
            block = rng.choice(rng.choice(held))
            if cache.lookup(f) is None and block not in pool.shared:
                cache.insert(f, 16, block)
                real._insert_block_hash(key[f], real.blocks[block], num_tokens=16)
        elif kind == "hit":
            f = rng.randrange(families)
            entry = cache.lookup(f)
            if entry is not None:
                hit_in_queue += entry[1] in pool.free
                pool.touch(entry[1])
                real.touch([real.blocks[entry[1]]])
                held.append([entry[1]])
        elif kind == "free" and held:
            blocks = held.pop(rng.randrange(len(held)))[::-1]  # tail first, as a row is
            pool.release_all(blocks)
            real.free_blocks([real.blocks[b] for b in blocks])
        real_free = [b.block_id for b in real.free_block_queue.get_all_free_blocks()]
        assert list(pool.free) == real_free, (op, kind)
        sim_hits = [None if (e := cache.lookup(f)) is None else e[1] for f in range(families)]
        assert sim_hits == [real_hit(f) for f in range(families)], (op, kind)
    assert evicted_while_cached >= 1 and hit_in_queue >= 1


# ---------------------------------------------------------------- a prefix hit that must wait


@pytest.fixture(scope="module")
def vllm_kv_manager(vllm_mods):
    """A factory of vLLM's real KVCacheManager over one align-mode Mamba group with prefix
    caching, and of requests hashed for it."""
    try:
        from vllm.utils.hashing import sha256
        from vllm.v1.core.kv_cache_manager import KVCacheManager
        from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
        from vllm.v1.kv_cache_interface import KVCacheConfig, KVCacheGroupSpec, MambaSpec
        from vllm.v1.request import Request
    except Exception as exc:
        pytest.skip(f"vLLM's KVCacheManager is not importable ({exc.__class__.__name__}: {exc})")
    init_none_hash(sha256)

    def make(blocks: int, block_size: int):
        spec = MambaSpec(
            block_size=block_size,
            shapes=((4,),),
            dtypes=(vllm_mods.torch.float32,),
            mamba_cache_mode="align",
            num_speculative_blocks=0,
        )
        kv = KVCacheConfig(
            num_blocks=blocks,
            kv_cache_tensors=[],
            kv_cache_groups=[KVCacheGroupSpec(["layer.0"], spec)],
        )
        return KVCacheManager(
            kv, max_model_len=1024, scheduler_block_size=block_size, hash_block_size=block_size
        )

    def request(rid: str, tokens: list[int], max_tokens: int, block_size: int):
        params = vllm_mods.SamplingParams(max_tokens=max_tokens, ignore_eos=True)
        hasher = get_request_block_hasher(block_size, sha256)
        return Request(rid, tokens, params, None, block_hasher=hasher)

    return SimpleNamespace(make=make, request=request)


def test_waiting_prefix_hit_matches_kv_cache_manager(vllm_kv_manager) -> None:
    """A request whose prefix hit's allocation must wait, in the simulator's scheduler and
    in vLLM's KVCacheManager fed the simulator's schedule: vLLM's allocate_slots returns
    None before it touches the hit block, so the block stays in the free queue, another
    request's allocation evicts it, and the next try looks the cache up again and misses.
    After every step the free queue and every block row agree, and the request waits in
    the simulator exactly while vLLM refuses it. Control: the hit was refused at least
    once, then evicted, and the request ran without it."""
    from mgtrace.sim import SimConfig
    from mgtrace.sim.scheduler import KIND_NEW, Scheduler
    from mgtrace.sim.workload import Arrival

    B, blocks = 16, 5
    cfg = SimConfig(k=0, mamba_block_size=B, num_blocks=blocks, max_num_batched_tokens=256)
    sim = Scheduler(cfg.validate())
    real = vllm_kv_manager.make(blocks, B)
    # (arrival step, family, prompt, output, tokens): ``a`` caches family 0's 32-token
    # boundary state and finishes; three others take every block but that one, which ``b``
    # then hits but cannot allocate past; ``f1`` crossing into its second block evicts it
    load = {
        "a": (0, 0, 40, 1, [1] * 32 + [2] * 8),
        "f1": (2, -1, 15, 20, [10] * 15),
        "f2": (2, -1, 2, 4, [11] * 2),
        "f3": (2, -1, 2, 4, [12] * 2),
        "b": (2, 0, 40, 4, [1] * 32 + [3] * 8),
    }
    reqs = {}  # vLLM's requests
    ours = {}  # the simulator's
    refused_hits = 0
    for step in range(12):
        real.new_step_starts()
        for rid, (at, family, prompt, output, tokens) in load.items():
            if at == step:
                arrival = Arrival("c", 0.0, prompt, output, output, family, 32, True, 0)
                ours[rid] = sim.new_request(rid, arrival)
                reqs[rid] = vllm_kv_manager.request(rid, tokens, output, B)
        so = sim.schedule(step)
        assert not so.preempted, step
        for req in so.finished:
            real.free(reqs[req.req_id])
        for rid, kind, n, nc in zip(
            so.req_ids, so.kind, so.num_scheduled, so.num_computed, strict=True
        ):
            r = reqs[rid]
            hit_blocks, hit = None, 0
            if kind == KIND_NEW:
                hit_blocks, hit = real.get_computed_blocks(r)[:2]
                assert hit == nc, (step, rid)
            got = real.allocate_slots(r, int(n), hit, hit_blocks)
            assert got is not None, (step, rid)
            r.num_computed_tokens = int(nc + n)
        sim.apply_results(so, np.ones(len(so), np.int64))
        for rid, samples in zip(so.req_ids, so.samples, strict=True):
            if samples:
                reqs[rid].append_output_token_ids(7)
        if sim.waiting and sim.waiting[0].req_id == "b":
            # the simulator left ``b`` waiting: vLLM refuses it at this point of the step too
            hit_blocks, hit = real.get_computed_blocks(reqs["b"])[:2]
            refused_hits += hit > 0
            want = 40 - hit if hit else 32  # a miss stops the chunk at the family boundary
            assert real.allocate_slots(reqs["b"], want, hit, hit_blocks) is None, step
        real_free = [b.block_id for b in real.block_pool.free_block_queue.get_all_free_blocks()]
        assert list(sim.pool.free) == real_free, step
        rows = real.coordinator.single_type_managers[0].req_to_blocks
        for rid in reqs:
            assert sim.alloc.rows.get(rid, []) == [b.block_id for b in rows[rid]], (step, rid)
    b = ours["b"]
    assert refused_hits >= 1 and b.first_step >= 0 and b.prefix_hit_tokens == 0


def _vllm_split(start: int, n: int, prompt: int, num_tokens: int, B: int, **cfg) -> int:
    """vLLM's ``Scheduler._mamba_block_aligned_split`` on stand-ins: align mode, the Mamba
    block as hash block, no partial hits, no shared-prefix junction, no hash lookahead."""
    from vllm.v1.core.sched.scheduler import Scheduler as RealScheduler

    sched = SimpleNamespace(
        cache_config=SimpleNamespace(block_size=B),
        block_size=B,
        hash_block_size=B,
        mamba_partial_cache_hit=False,
        mamba_shared_prefix_checkpoint=False,
        use_eagle_block_drop=cfg["drop"],
        num_hash_lookahead_tokens=0,
        mamba_has_prefill_checkpoint_blocks=cfg["checkpoints"],
        mamba_prefill_checkpoint_alignment=1,
        max_num_scheduled_tokens=cfg["budget"],
        scheduler_config=SimpleNamespace(long_prefill_token_threshold=0),
    )
    request = SimpleNamespace(
        num_computed_tokens=start,
        num_prompt_tokens=prompt,
        num_tokens=num_tokens,
        shared_prefix_boundary=0,
    )
    return RealScheduler._mamba_block_aligned_split(sched, request, n)


@pytest.mark.parametrize("seed", [0, 1])
def test_prefill_chunks_end_where_mamba_block_aligned_split_ends_them(vllm_mods, seed: int) -> None:
    """The simulator's chunk of a prefilling request (new, after a prefix hit, or resumed
    replaying its output) over random computed counts, budgets, prompts, k and prefill
    checkpoints on or off, against vLLM's split (k > 0: MTP's block drop). Control: some
    chunks stop at the last cacheable boundary before the budget or a block boundary would
    end them."""
    from mgtrace.sim import SimConfig
    from mgtrace.sim.scheduler import Scheduler
    from mgtrace.sim.workload import Arrival

    rng = random.Random(seed)
    cut_short = 0
    for case in range(1500):
        B = rng.choice([8, 16])
        k = rng.choice([0, 1, 3])
        checkpoints = rng.random() < 0.5
        budget = rng.randint(B, 12 * B)
        cfg = SimConfig(
            k=k,
            mamba_block_size=B,
            max_num_batched_tokens=budget,
            prefill_checkpoints=checkpoints,
        )
        sim = Scheduler(cfg.validate())
        prompt = rng.randint(2, 30 * B)
        replayed = rng.choice([0, 0, rng.randint(1, 3 * B)])  # a resumed request's output
        num_tokens = prompt + replayed
        start = rng.randint(0, (num_tokens - 2) // B) * B  # hits and chunks end on a block
        req = sim.new_request(f"r{case}", Arrival("c", 0.0, prompt, 4, 4, -1, 0, False, 0))
        sim.store.nc[req.idx] = start
        sim.store.ntok[req.idx] = num_tokens
        n = min(num_tokens - start, budget)
        ours, drafts = sim._want(req, budget)
        theirs = _vllm_split(
            start, n, prompt, num_tokens, B, drop=k > 0, checkpoints=checkpoints, budget=budget
        )
        assert (ours, drafts) == (theirs, 0), (B, k, checkpoints, budget, prompt, num_tokens, start)
        cut_short += (start + theirs) % B == 0 and theirs < n // B * B
    assert cut_short > 50
