"""The engine scheduler: token budget, chunked prefill, spec decode, preemption, align allocation.

Per step it emits a SchedulerOutput equivalent (``SchedOut``). Counts follow vLLM's request
bookkeeping: ``num_tokens`` = prompt + output, a request is in its prefill while
``num_computed < num_tokens - 1`` and decodes (1 + drafts) once only the last sampled token is
left. Under async scheduling the counts are optimistic: a step's drafts are assumed accepted
when the next step is scheduled, and the rejected ones are taken back when the result arrives.
A request preempted while a step of it is in flight keeps what that step samples: the tokens
are delivered when its result arrives, without touching the reset counters, and the request
resumes only after that, replaying them in its prefill.

The hot counters live in arrays indexed by request number (``ReqStore``), so that the common
step (every running request decodes without a new block) is scheduled with a few numpy ops;
any request that needs more (a prefill chunk, a new block, a retired block, a tight budget)
goes through the scalar path, which defines the rules.
"""

from __future__ import annotations

from bisect import bisect_left
from collections import deque
from dataclasses import dataclass, field

import numpy as np

from mgtrace.sim.block_pool import AlignAllocator, BlockPool, PoolExhausted, PrefixCache
from mgtrace.sim.checkpoints import checkpoint_of, checkpoints_of, chunk_tokens
from mgtrace.sim.config import SimConfig
from mgtrace.sim.workload import Arrival

WAITING, RUNNING, FINISHING, FINISHED = range(4)
STATUS_NAMES = ("waiting", "running", "finishing", "finished")
KIND_NEW, KIND_CACHED, KIND_RESUMED = range(3)
KIND_NAMES = np.array(["new", "cached", "resumed"], dtype=object)

NO_LIMIT = np.iinfo(np.int64).max

# int64 fields and the value a new request starts with
_INT_FIELDS = {
    "nc": 0,
    "ntok": 0,
    "nout": 0,
    # sampling steps whose result is pending; kept under a synchronous pipeline only, where
    # a request waits for its sampled token (its prefill chunks go on at once: vLLM
    # advances num_computed when it schedules a chunk)
    "inflight": 0,
    # under V2's async pipeline, the first step the request may decode in again (vLLM's
    # ``next_decode_eligible_step``): pp steps after its last sampling step
    "next_decode": 0,
    "inflight_tok": 0,
    # tokens of the steps scheduled before the request's preemption whose results are still
    # pending (vLLM's num_stale_output_tokens): their sampled tokens are still delivered,
    # and the request resumes only once they are
    "stale_tok": 0,
    "epoch": 0,
    # the epoch while the request is RUNNING, else -1: a step's result for a row is current
    # exactly when the row's epoch equals it
    "live_epoch": -1,
    # tokens a decode takes: 1, plus k while the request carries drafts (from its first
    # sampling step on, until preempted)
    "n_dec": 1,
    # tokens a decode may reach with the blocks held: (row length - S) * B, so that
    # cdiv(tokens, B) + S <= row length is tokens <= cover
    "cover": 0,
    "prompt": 0,
    "output_len": 0,
    "boundary": 0,
    "first_step": 0,
    "last_step": 0,
    # while a previous state block is held at column c: (c + 1) * B, the processed tokens
    # up to which it stays (retire frees it once cdiv(processed, B) - 1 > c); else NO_LIMIT
    "keep_until": NO_LIMIT,
}


class ReqStore:
    """Per-request counters, one slot per request number, grown by doubling."""

    def __init__(self, capacity: int = 1024) -> None:
        self.cap = 0
        self.n = 0
        self.req_ids = np.empty(0, dtype=object)
        self.reqs = np.empty(0, dtype=object)  # the Request of each slot
        for name in _INT_FIELDS:
            setattr(self, name, np.zeros(0, np.int64))
        self.status = np.zeros(0, np.int8)
        self._grow(capacity)

    def _grow(self, cap: int) -> None:
        def grown(a: np.ndarray, fill: object = 0) -> np.ndarray:
            out = np.full(cap, fill, dtype=a.dtype)
            out[: len(a)] = a
            return out

        self.req_ids = grown(self.req_ids, None)
        self.reqs = grown(self.reqs, None)
        for name, fill in _INT_FIELDS.items():
            setattr(self, name, grown(getattr(self, name), fill))
        self.status = grown(self.status)
        self.cap = cap

    def new(self, req: Request, a: Arrival, block_size: int, drop: bool) -> int:
        if self.n == self.cap:
            self._grow(self.cap * 2)
        i = self.n
        self.n += 1
        self.req_ids[i] = req.req_id
        self.reqs[i] = req
        self.ntok[i] = a.prompt_len
        self.prompt[i] = a.prompt_len
        self.output_len[i] = a.output_len
        # where a family member resumes: the prefix's last full block, less the block that
        # full attention drops from a hit under EAGLE's block drop
        boundary = (a.prefix_len // block_size - drop) * block_size
        self.boundary[i] = boundary if a.family >= 0 and boundary > 0 else -1
        self.first_step[i] = -1
        self.last_step[i] = -1
        return i


class Request:
    """A request's identity and rarely-changing facts; its counters live in the store."""

    __slots__ = (
        "arrival",
        "family",
        "finish_reason",
        "group",
        "idx",
        "num_preemptions",
        "output_len",
        "prefix_hit_tokens",
        "prefix_len",
        "prompt_len",
        "req_id",
        "resumed",
        "store",
        "wants_hit",
    )

    def __init__(
        self, req_id: str, a: Arrival, store: ReqStore, block_size: int, drop: bool
    ) -> None:
        self.req_id = req_id
        self.arrival = a
        self.prompt_len = a.prompt_len
        self.output_len = a.output_len
        self.family = a.family
        self.prefix_len = a.prefix_len
        self.wants_hit = a.wants_hit
        self.group = a.group
        self.prefix_hit_tokens = 0
        self.finish_reason = "running"
        self.resumed = False
        self.num_preemptions = 0
        self.store = store
        self.idx = store.new(self, a, block_size, drop)

    @property
    def num_computed(self) -> int:
        return int(self.store.nc[self.idx])

    @property
    def num_tokens(self) -> int:
        return int(self.store.ntok[self.idx])

    @property
    def num_output(self) -> int:
        return int(self.store.nout[self.idx])

    @property
    def status(self) -> str:
        return STATUS_NAMES[self.store.status[self.idx]]

    @property
    def first_step(self) -> int:
        return int(self.store.first_step[self.idx])

    @property
    def last_step(self) -> int:
        return int(self.store.last_step[self.idx])


@dataclass(slots=True)
class Scheduled:
    """One scheduled request of a step (a view of a ``SchedOut`` position)."""

    req: Request
    kind: str  # new | cached | resumed
    num_scheduled: int
    num_draft: int
    num_computed: int  # scheduler's count before the step (optimistic under async)
    new_block_ids: list[int]
    samples: bool  # whether the step samples a token for it (final chunk or decode)
    epoch: int


@dataclass
class SchedOut:
    """A step's SchedulerOutput, one array entry per scheduled request, in schedule order."""

    step: int
    idx: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int64))
    kind: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int8))
    num_scheduled: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int64))
    num_draft: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int64))
    num_computed: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int64))
    samples: np.ndarray = field(default_factory=lambda: np.zeros(0, bool))
    epoch: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int64))
    new_block_ids: dict[int, list[int]] = field(default_factory=dict)  # position -> ids
    # the run's request ids by request number, as of this step (request numbers index it)
    names: np.ndarray = field(default_factory=lambda: np.empty(0, dtype=object))
    # the run's Requests by request number, as of this step (request numbers index it)
    requests: np.ndarray = field(default_factory=lambda: np.empty(0, dtype=object))
    finished: list[Request] = field(default_factory=list)
    preempted: list[Request] = field(default_factory=list)
    total_tokens: int = 0
    # ``reqs`` and ``req_ids``, made on first use: most steps read a few positions only,
    # through ``req_at`` and ``id_at``, and two lists per step cost more than those reads
    _reqs: list[Request] | None = field(default=None, repr=False)
    _req_ids: list[str] | None = field(default=None, repr=False)

    def __len__(self) -> int:
        return len(self.idx)

    @property
    def reqs(self) -> list[Request]:
        """The scheduled Requests, in schedule order."""
        if self._reqs is None:
            self._reqs = self.requests[self.idx].tolist()
        return self._reqs

    @property
    def req_ids(self) -> list[str]:
        """The scheduled request ids, in schedule order."""
        if self._req_ids is None:
            self._req_ids = self.names[self.idx].tolist()
        return self._req_ids

    def req_at(self, pos: int) -> Request:
        return self.requests[self.idx[pos]]

    def id_at(self, pos: int) -> str:
        return self.names[self.idx[pos]]

    def ids_at(self, pos: int) -> list[int]:
        return self.new_block_ids.get(pos, [])

    @property
    def scheduled(self) -> list[Scheduled]:
        return [
            Scheduled(
                req=r,
                kind=str(KIND_NAMES[self.kind[i]]),
                num_scheduled=int(self.num_scheduled[i]),
                num_draft=int(self.num_draft[i]),
                num_computed=int(self.num_computed[i]),
                new_block_ids=self.ids_at(i),
                samples=bool(self.samples[i]),
                epoch=int(self.epoch[i]),
            )
            for i, r in enumerate(self.reqs)
        ]


_UNSET = np.zeros(0, np.int64)  # never read: every SchedOut array is replaced by build

# columns of a step's scheduled rows while they are collected (one int64 matrix at build)
_KEY, _IDX, _KIND, _N, _D, _NC, _SAMPLES, _EPOCH = range(8)


def _merge(block: np.ndarray, rows: list[tuple[int, ...]]) -> tuple[np.ndarray, list[int]]:
    """The columns of ``block`` and ``rows`` (both ascending in ``_KEY``, keys distinct) in
    one key-ordered matrix, and the matrix position of each of ``rows``."""
    if not rows:
        return block, []
    m = block.shape[1]
    r = len(rows)
    keys = block[_KEY].tolist()
    mat = np.empty((8, m + r), np.int64)
    pos = []
    prev = 0  # block columns before ``prev`` are placed
    for j, row in enumerate(rows):
        i = bisect_left(keys, row[_KEY], prev)  # block columns before row j
        if i > prev:
            mat[:, prev + j : i + j] = block[:, prev:i]
        mat[:, i + j] = row
        pos.append(i + j)
        prev = i
    mat[:, prev + r :] = block[:, prev:]
    return mat, pos


class _Builder:
    """Collects a step's scheduled rows; ``build`` puts them in running-list order."""

    WAITING_KEY = 1 << 40  # admissions from the waiting queue come after every running row

    def __init__(self, run: list[Request]) -> None:
        self.run = run  # the running list this step walks: a running row's key indexes it
        self.new_ids: dict[int, list[int]] = {}  # scalar row -> ids, only where non-empty
        self.rows: list[tuple[int, ...]] = []  # scalar-path rows, in the _KEY.. column order
        # decode rows committed in one go, kept as arrays: (idx, n, nc, epoch, keys)
        self.many: tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, np.ndarray] | None
        self.many = None

    def add(
        self,
        i: int,
        kind: int,
        n: int,
        d: int,
        nc: int,
        samples: bool,
        epoch: int,
        new_ids: list[int],
        key: int,
    ) -> None:
        """A scalar-path row of request number ``i``."""
        if new_ids:
            self.new_ids[len(self.rows)] = new_ids
        self.rows.append((key, i, kind, n, d, nc, samples, epoch))

    def add_many(
        self,
        idx: np.ndarray,
        n: np.ndarray,
        nc: np.ndarray,
        epoch: np.ndarray,
        keys: np.ndarray,
    ) -> None:
        """Decode rows of the running list (``keys`` index it) with no new blocks: cached,
        sampling, drafts = n - 1 (at most one batch per step, kept as arrays: no per-row
        Python values)."""
        assert self.many is None
        self.many = (idx, n, nc, epoch, keys)

    def build(self, out: SchedOut, store: ReqStore) -> None:
        # one matrix row per column, so that the SchedOut arrays are contiguous views of it;
        # the rows go in key (running-list) order, with the admissions last
        rows = self.rows
        # the scalar-path rows were added in key order (running rows as the walk met them,
        # then the admissions), the one-go rows too: the two are merged
        if self.many is None:
            mat = np.array(rows, np.int64).T.copy() if rows else np.zeros((8, 0), np.int64)
            pos_of: list[int] | range = range(len(rows))  # scalar row -> position in ``mat``
        else:
            idx, n, nc, epoch, keys = self.many
            block = np.empty((8, len(idx)), np.int64)
            block[_KEY] = keys
            block[_IDX] = idx
            block[_KIND] = KIND_CACHED
            block[_N] = n
            np.subtract(n, 1, out=block[_D])
            block[_NC] = nc
            block[_SAMPLES] = 1
            block[_EPOCH] = epoch
            mat, pos_of = _merge(block, rows)
        # scalar rows are added in position order, so this dict is in position order too
        out.new_block_ids = {pos_of[r]: ids for r, ids in self.new_ids.items()}
        out.idx = mat[_IDX]
        out.requests = store.reqs
        out.kind = mat[_KIND].astype(np.int8)
        out.num_scheduled = mat[_N]
        out.num_draft = mat[_D]
        out.num_computed = mat[_NC]
        out.samples = mat[_SAMPLES].astype(bool)
        out.epoch = mat[_EPOCH]
        out.names = store.req_ids


class Scheduler:
    def __init__(self, cfg: SimConfig) -> None:
        self.cfg = cfg
        self.B = cfg.mamba_block_size
        self.k = cfg.k
        # MTP drafts: vLLM drops the last block of a prefix hit (EAGLE's block drop), and its
        # cacheable positions and prefill checkpoints back off one block to match
        self.drop = cfg.k > 0
        self.S = cfg.spec_blocks
        self.pool = BlockPool(cfg.pool_blocks)
        self.alloc = AlignAllocator(self.pool, self.B, cfg.spec_blocks)
        self.cache = PrefixCache(self.pool)
        self.store = ReqStore()
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.to_finish: list[Request] = []
        self.preempted_now: list[Request] = []
        self._run_idx: np.ndarray | None = None  # request numbers of ``running``, cached
        # a synchronous pipeline: a request waits for its pending sampled token (``inflight``)
        self.pp = cfg.pp > 1 and not cfg.async_pipeline
        # V2's async pipeline: a request decodes only every ``stagger`` steps; its prefill
        # chunks go on at once (they sample nothing)
        self.stagger = cfg.pp if cfg.async_pipeline else 0

    # ------------------------------------------------------------------ admission
    def new_request(self, req_id: str, a: Arrival) -> Request:
        req = Request(req_id, a, self.store, self.B, self.drop)
        self.waiting.append(req)
        return req

    # ------------------------------------------------------------------ one step
    def schedule(self, step: int) -> SchedOut:
        # the array fields are set by ``build``: placeholders spare the default factories
        out = SchedOut(
            step=step,
            idx=_UNSET,
            kind=_UNSET,
            num_scheduled=_UNSET,
            num_draft=_UNSET,
            num_computed=_UNSET,
            samples=_UNSET,
            epoch=_UNSET,
        )
        for req in self.to_finish:
            self._release(req)
            out.finished.append(req)
        self.to_finish = []
        self.preempted_now = []
        build = _Builder(list(self.running))
        budget = self._schedule_running(step, build)
        st = self.store
        skipped: list[Request] = []  # back at the front after the walk, in their order
        while (
            self.waiting
            and budget > 0
            and len(self.running) < self.cfg.max_num_seqs
            and not self.preempted_now
        ):
            req = self.waiting[0]
            if st.stale_tok[req.idx]:
                # a step from before its preemption is still in flight: resuming now could
                # resample a position that step's result delivers later
                skipped.append(self.waiting.popleft())
                continue
            # looked up at every try, touching nothing: a request that must wait may find
            # its hit evicted, or a longer one, at the next (vLLM's get_computed_blocks; a
            # resumed request looks it up like a new one, its num_computed_tokens reset)
            hit = self._lookup_hit(req) if st.nc[req.idx] == 0 else None
            nc = int(st.nc[req.idx]) if hit is None else hit[0]
            n, d = self._want(req, budget, nc)
            if n == 0:
                break
            end = nc + n
            checkpoint = self._reserves_checkpoint(req, end, nc)
            try:
                need = self.alloc.blocks_needed(req.req_id, end, checkpoint, hit)
                self._allocate(req, end, need, checkpoint, hit)
            except PoolExhausted:
                break
            if hit is not None:
                st.nc[req.idx] = nc
                if not req.num_preemptions:
                    # vLLM's prefill stats count the first admission only, not a resume's hit
                    req.prefix_hit_tokens = nc
            self.waiting.popleft()
            kind = KIND_RESUMED if req.resumed else KIND_NEW
            self._set_status(req.idx, RUNNING)
            self.running.append(req)
            if self._run_idx is not None:  # kept in step with ``running`` (no rebuild)
                self._run_idx = np.concatenate((self._run_idx, np.array([req.idx], np.int64)))
            # a new or resumed request's row is the whole row: hit columns + fresh tail
            self._commit(
                req,
                kind,
                n,
                d,
                list(self.alloc.rows[req.req_id]),
                step,
                build,
                _Builder.WAITING_KEY + len(build.rows),
            )
            budget -= n
        self.waiting.extendleft(reversed(skipped))
        build.build(out, st)
        # every scheduled token was taken from the budget
        out.total_tokens = self.cfg.max_num_batched_tokens - budget
        out.preempted = list(self.preempted_now)
        return out

    def _schedule_running(self, step: int, build: _Builder) -> int:
        """Running requests in order; returns the budget left.

        Rows that only decode into blocks they already hold ("simple") are committed in one
        go; the others take the scalar path in list order, each with the budget left at its
        position. From the first simple row that would not fit, every row is scalar. A simple
        row may retire its previous state block: the retire, its one pool change, is done in
        list order among the scalar rows' pool changes.
        """
        st = self.store
        budget = self.cfg.max_num_batched_tokens
        run = build.run
        if not run:
            return budget
        if self._run_idx is None:
            self._run_idx = np.fromiter((r.idx for r in run), np.int64, len(run))
        idx = self._run_idx
        nc = st.nc[idx]
        n_dec = st.n_dec[idx]
        simple = st.ntok[idx] - nc == 1
        simple &= nc + n_dec <= st.cover[idx]  # the row covers the decode
        # every request on the running list is RUNNING when a step starts (the finished
        # ones were released first), so only PP makes a row ineligible (result pending, or
        # the async pipeline's decode cadence)
        gated = self.pp or self.stagger
        if self.pp:
            eligible = st.inflight[idx] == 0
            simple &= eligible
        elif self.stagger:
            eligible = st.next_decode[idx] <= step
            simple &= eligible
        # the scalar path retires a row's previous state block once its processed tokens
        # (in-flight drafts excluded) pass ``keep_until`` (positive: the clamp of processed
        # at 0 changes nothing)
        stays = nc - st.inflight_tok[idx] <= st.keep_until[idx]
        if self.pool.num_free >= len(run) - np.count_nonzero(simple):
            # a running row takes at most one block, and only a non-simple one does, so no
            # allocation of this pass meets a short pool (no preemption): a
            # simple row that retires is committed in one go too
            retiring = (simple & ~stays).nonzero()[0].tolist()
        else:
            simple &= stays
            retiring = []
        scalar = eligible ^ simple if gated else ~simple
        want = n_dec * simple
        cs = np.add.accumulate(want)
        taken = 0  # tokens of the rows that went through the scalar path
        start = 0
        r = 0  # the retiring rows before ``retiring[r]`` are retired
        scalar_from = len(run)
        # the scalar candidates: eligible but not simple
        for c in [*scalar.nonzero()[0].tolist(), len(run)]:
            if c > start and int(cs[c - 1]) + taken > budget:
                scalar_from = start + int(cs[start:c].searchsorted(budget - taken, side="right"))
                break
            left = budget - (int(cs[c - 1]) if c else 0) - taken
            if c == len(run) or left <= 0:
                scalar_from = c
                break
            start = c + 1
            if st.status[run[c].idx] != RUNNING:
                continue  # preempted earlier in this step
            r = self._retire_until(c, run, retiring, r)
            t = self._schedule_one(run[c], left, step, build, key=c)
            taken += t or 0
            if self.preempted_now and t is not None:
                scalar_from = c + 1  # a later row may be the victim: go row by row
                break
        self._retire_until(scalar_from, run, retiring, r)  # the later ones are scalar
        sel = want[:scalar_from].nonzero()[0]
        if len(sel):
            self._commit_simple(idx[sel], want[sel], sel, step, build)
        left = budget - (int(cs[scalar_from - 1]) if scalar_from else 0) - taken
        for pos in range(scalar_from, len(run)):
            if left <= 0:
                break
            req = run[pos]
            if st.status[req.idx] != RUNNING or not self._eligible(req.idx, step):
                continue
            left -= self._schedule_one(req, left, step, build, key=pos) or 0
        return left

    def _eligible(self, i: int, step: int) -> bool:
        """Whether running request ``i`` may be scheduled in ``step`` under the pipeline's
        rule: no pending result (synchronous), or past its decode cadence (async; a prefill
        chunk never sets one)."""
        if self.pp:
            return not self.store.inflight[i]
        return not self.stagger or int(self.store.next_decode[i]) <= step

    def _retire_until(self, end: int, run: list[Request], retiring: list[int], r: int) -> int:
        """Retire the rows ``retiring[r:]`` (running-list positions) before ``end``; returns
        the index in ``retiring`` of the first row left."""
        while r < len(retiring) and retiring[r] < end:
            self._retire(run[retiring[r]])
            r += 1
        return r

    def _retire(self, req: Request) -> None:
        """Free the blocks ``req``'s processed tokens have passed (``keep_until``)."""
        st = self.store
        self.alloc.retire(req.req_id, int(st.nc[req.idx] - st.inflight_tok[req.idx]))
        self._note_last(req)  # blocks further on may remain

    def _commit_simple(
        self,
        ids: np.ndarray,
        n: np.ndarray,
        keys: np.ndarray,
        step: int,
        build: _Builder,
    ) -> None:
        """Commit decode rows that need no block change, in one go (running requests: their
        first step was set at admission)."""
        st = self.store
        nc = st.nc[ids]  # a fancy-indexed copy
        build.add_many(ids, n, nc, st.epoch[ids], keys)
        st.last_step[ids] = step
        nc_new = nc + n
        st.nc[ids] = nc_new
        # optimistic: every draft accepted, plus the bonus token (ntok was nc + 1)
        st.ntok[ids] = nc_new + 1
        st.n_dec[ids] = 1 + self.k
        if self.pp:
            st.inflight[ids] += 1
        elif self.stagger:
            st.next_decode[ids] = step + self.stagger
        st.inflight_tok[ids] += n

    def _schedule_one(
        self,
        req: Request,
        budget: int,
        step: int,
        build: _Builder,
        key: int,
    ) -> int | None:
        """The scalar path for one running request: tokens taken, 0 if none, None if the
        request was preempted to make room."""
        n, d = self._want(req, budget)
        if n == 0:
            return 0
        new_ids = self._allocate_or_preempt(req, n)
        if new_ids is None:
            return None
        kind = KIND_RESUMED if req.resumed else KIND_CACHED
        self._commit(req, kind, n, d, new_ids, step, build, key)
        return n

    def _want(self, req: Request, budget: int, nc: int | None = None) -> tuple[int, int]:
        """Tokens (drafts included) and drafts the request would take with ``budget`` left,
        from ``nc`` computed tokens (default: its count; a waiting request's prefix hit)."""
        st = self.store
        if nc is None:
            nc = int(st.nc[req.idx])
        remaining = int(st.ntok[req.idx]) - nc
        if remaining <= 1:
            if remaining < 1:
                return 0, 0
            d = min(int(st.n_dec[req.idx]) - 1, budget - 1)
            return 1 + d, d
        n = chunk_tokens(
            nc,
            min(remaining, budget),
            int(st.prompt[req.idx]),
            int(st.ntok[req.idx]),
            self.B,
            self.drop,
            self.cfg.prefill_checkpoints,
        )
        if n <= 0:
            return 0, 0
        boundary = int(st.boundary[req.idx])
        if (
            boundary > 0
            and self.cache.lookup(req.family) is None
            and nc < boundary < nc + n
            and not self._checkpoint_stores(req, nc, n, boundary)
        ):
            # stop the chunk at the family's boundary so its state can be cached
            n = boundary - nc
        return n, 0

    def _checkpoint_stores(self, req: Request, nc: int, n: int, boundary: int) -> bool:
        """Whether the prompt's last chunk, ``nc`` .. ``nc + n``, stores the state at
        ``boundary`` as its prefill checkpoint (then it need not stop there)."""
        return (
            self.cfg.prefill_checkpoints
            and self._prefill_end(req) <= nc + n
            and checkpoint_of(nc, n, self.B, self.drop)[0] == boundary
        )

    def _prefill_end(self, req: Request) -> int:
        """Where the prefill ends: the prompt, or for a resumed request replaying its
        output, all but the last token."""
        return max(int(self.store.prompt[req.idx]), int(self.store.ntok[req.idx]) - 1)

    def _reserves_checkpoint(self, req: Request, end: int, nc: int | None = None) -> bool:
        """Whether the chunk from ``nc`` (default: the computed count) up to ``end`` has a
        prefill checkpoint whose column needs a block: MambaManager reserves one for every
        chunk under dense retention (the default; only sparse retention keeps just the
        prompt's last one)."""
        if not self.cfg.prefill_checkpoints:
            return False
        if nc is None:
            nc = int(self.store.nc[req.idx])
        if nc >= end:
            return False
        _tokens, col = checkpoint_of(nc, end - nc, self.B, self.drop)
        return col >= 0 and self.alloc.wants_checkpoint_block(req.req_id, col)

    def _lookup_hit(self, req: Request) -> tuple[int, int] | None:
        """The (tokens, block) a request with no computed tokens (new or resumed) would start
        from: its family's cached boundary state, as vLLM's get_computed_blocks finds it (a
        block-aligned hit of at most ``num_tokens - 1`` tokens, so the last token is always
        computed). Changes nothing: the block is touched only by a successful allocation."""
        if req.family < 0 or not req.wants_hit:
            return None
        entry = self.cache.lookup(req.family)
        if entry is None:
            return None
        tokens, _block = entry
        if tokens >= self.store.ntok[req.idx] or tokens < self.B:
            return None
        return entry

    def _allocate(
        self,
        req: Request,
        num_tokens: int,
        need: int,
        checkpoint: bool = False,
        hit: tuple[int, int] | None = None,
    ) -> list[int]:
        """Take ``need`` blocks off the free queue (PoolExhausted, with nothing changed, when
        it holds fewer; cached free blocks count, and handing one out evicts it), starting
        a new request from ``hit``."""
        ids = self.alloc.allocate(req.req_id, num_tokens, need, checkpoint, hit)
        self._set_row_len(req, len(self.alloc.rows[req.req_id]))
        self._note_last(req)
        return ids

    def _set_row_len(self, req: Request, length: int) -> None:
        """Mirror the length of the allocator's block row of ``req`` into the store."""
        self.store.cover[req.idx] = (length - self.S) * self.B

    def _note_last(self, req: Request) -> None:
        """Mirror the first column the allocator will free for ``req`` into the store."""
        col = self.alloc.first_held_col(req.req_id)
        self.store.keep_until[req.idx] = NO_LIMIT if col is None else (col + 1) * self.B

    def _allocate_or_preempt(self, req: Request, n: int) -> list[int] | None:
        st = self.store
        i = req.idx
        rid = req.req_id
        nc = int(st.nc[i])
        # free on the processed basis: in-flight drafts may still be rejected; retire frees
        # the previous state block exactly when processed tokens pass ``keep_until`` (which
        # is positive, so processed is never clamped at 0 then)
        if nc - st.inflight_tok[i] > st.keep_until[i]:
            self._retire(req)
        end = nc + n
        checkpoint = self._reserves_checkpoint(req, end)
        if end <= st.cover[i] and not checkpoint:
            # the row already covers ``end`` (cdiv(end, B) + S <= row length): nothing to
            # take, and a running request is in ``allocated`` already
            return []
        while True:
            try:
                need = self.alloc.blocks_needed(rid, end, checkpoint)
                return self._allocate(req, end, need, checkpoint)
            except PoolExhausted:
                victim = self._pick_victim()
                self._preempt(victim)
                if victim is req:
                    return None

    def _pick_victim(self) -> Request:
        for req in reversed(self.running):
            if self.store.status[req.idx] == RUNNING:
                return req
        raise AssertionError("no running request to preempt")

    def _preempt(self, req: Request) -> None:
        st = self.store
        i = req.idx
        self.alloc.free(req.req_id)
        self._set_row_len(req, 0)
        st.keep_until[i] = NO_LIMIT
        self._drop_running(self.running.index(req))
        self._set_status(i, WAITING)
        st.nc[i] = 0
        st.ntok[i] = req.prompt_len + st.nout[i]
        st.n_dec[i] = 1
        st.inflight[i] = 0
        st.stale_tok[i] = st.inflight_tok[i]
        st.inflight_tok[i] = 0
        st.next_decode[i] = 0
        st.epoch[i] += 1
        req.resumed = True
        req.num_preemptions += 1
        self.waiting.appendleft(req)
        self.preempted_now.append(req)

    def _commit(
        self,
        req: Request,
        kind: int,
        n: int,
        d: int,
        new_ids: list[int],
        step: int,
        build: _Builder,
        key: int,
    ) -> None:
        st = self.store
        i = req.idx
        nc = int(st.nc[i])
        ntok = int(st.ntok[i])
        samples = nc + n >= ntok
        build.add(i, kind, n, d, nc, samples, int(st.epoch[i]), new_ids, key)
        if st.first_step[i] < 0:
            st.first_step[i] = step
        st.last_step[i] = step
        req.resumed = False
        st.nc[i] = nc + n
        if samples:
            st.ntok[i] = ntok + 1 + d  # optimistic: every draft accepted, plus the bonus token
            # the drafter proposes in the same step, so the next step carries k drafts
            st.n_dec[i] = 1 + self.k
        if self.pp and samples:
            st.inflight[i] += 1
        elif self.stagger and samples:
            st.next_decode[i] = step + self.stagger
        st.inflight_tok[i] += n

    # ------------------------------------------------------------------ results
    def apply_results(self, so: SchedOut, accepted: np.ndarray) -> list[Request]:
        """Fold a step's outcome (accepted per position) in; returns the requests it
        finished."""
        if not len(so):
            return []
        st = self.store
        idx = so.idx
        valid = so.epoch == st.live_epoch[idx]  # same epoch, still RUNNING
        stale: list[tuple[int, Request]] = []  # (position, request) finished by stale output
        if np.count_nonzero(valid) < len(valid):
            stale = self._deliver_stale(so, accepted, (~valid).nonzero()[0].tolist())
            keep = valid.nonzero()[0]
            idx = idx[keep]
            n, d, samples = so.num_scheduled[keep], so.num_draft[keep], so.samples[keep]
            acc, nc_before = accepted[keep], so.num_computed[keep]
            pos = keep.tolist()  # kept position -> position in the step
        else:
            n, d, samples = so.num_scheduled, so.num_draft, so.samples
            acc, nc_before = accepted, so.num_computed
            pos = None
        reqs = st.reqs  # by request number: ``idx`` (the kept rows') indexes it
        if self.pp:
            st.inflight[idx] -= samples
        st.inflight_tok[idx] -= n
        if np.count_nonzero(samples) == len(samples):  # the common step: every row sampled
            rejected = d + 1 - acc
            sampled = acc
        else:
            rejected = np.where(samples, d + 1 - acc, 0)
            sampled = np.where(samples, acc, 0)
        st.nc[idx] -= rejected
        st.ntok[idx] -= rejected
        nout = st.nout[idx] + sampled
        st.nout[idx] = nout
        boundaries = st.boundary[idx]
        ends_at = boundaries == nc_before + n
        if self.cfg.prefill_checkpoints:
            # a last prefill chunk whose checkpoint stored the family's boundary state, in the
            # checkpoint's column (under the block drop not always the one behind it)
            stored, ckpt_cols = checkpoints_of(nc_before, n, self.B, self.drop)
            by_ckpt = (stored == boundaries) & (stored > 0) & ~ends_at
            cols = np.where(by_ckpt, ckpt_cols, boundaries // self.B - 1)
            ends_at |= by_ckpt
        ending = ends_at.nonzero()[0].tolist()
        if ending and not self.cfg.prefill_checkpoints:
            cols = boundaries // self.B - 1  # the running column of a chunk ending there
        for p in ending:
            req = reqs[idx[p]]
            boundary = int(st.boundary[req.idx])
            if boundary > 0 and self.cache.lookup(req.family) is None:
                col = int(cols[p])
                row = self.alloc.rows.get(req.req_id)
                if row is not None and col < len(row):
                    self.cache.insert(req.family, boundary, row[col])
        done = (nout >= st.output_len[idx]).nonzero()[0].tolist()
        ended = [(p if pos is None else pos[p], reqs[idx[p]]) for p in done]
        if stale:
            ended = sorted(ended + stale, key=lambda e: e[0])  # in the step's row order
        finished = []
        for _p, req in ended:
            req.finish_reason = "length" if req.output_len >= req.arrival.max_tokens else "stop"
            self._set_status(req.idx, FINISHING)
            self.to_finish.append(req)
            finished.append(req)
        return finished

    def _deliver_stale(
        self, so: SchedOut, accepted: np.ndarray, positions: list[int]
    ) -> list[tuple[int, Request]]:
        """Fold in the rows of ``positions`` whose request was preempted after the step was
        scheduled (the others have finished): vLLM's update_from_output delivers the tokens
        they sampled but leaves the counters the preemption reset (its ``output_is_stale``),
        so the request resumes with them in its prefill. Returns the (position, request)
        pairs whose output is then complete; they leave the waiting queue."""
        st = self.store
        ended = []
        for p in positions:
            i = int(so.idx[p])
            if st.status[i] != WAITING or not st.stale_tok[i]:
                continue
            st.stale_tok[i] -= so.num_scheduled[p]
            if not so.samples[p]:
                continue
            got = int(accepted[p])
            st.nout[i] += got
            st.ntok[i] += got
            if st.nout[i] >= st.output_len[i]:
                req = so.req_at(p)
                self.waiting.remove(req)
                ended.append((p, req))
        return ended

    def _drop_running(self, pos: int) -> None:
        del self.running[pos]
        if self._run_idx is not None:  # a new array: a step's snapshot of it stays as it was
            run_idx = self._run_idx
            self._run_idx = np.concatenate((run_idx[:pos], run_idx[pos + 1 :]))

    def _release(self, req: Request) -> None:
        self.alloc.free(req.req_id)
        self._set_row_len(req, 0)
        self.store.keep_until[req.idx] = NO_LIMIT
        try:
            pos = self.running.index(req)
        except ValueError:
            pass
        else:
            self._drop_running(pos)
        self._set_status(req.idx, FINISHED)

    def _set_status(self, i: int, status: int) -> None:
        st = self.store
        st.status[i] = status
        st.live_epoch[i] = st.epoch[i] if status == RUNNING else -1
