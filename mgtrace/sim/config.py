"""What one simulated run is: scenario, engine shape, seed and the injected bugs."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from mgtrace.errors import UsageError
from mgtrace.schemas.manifest import RUN_LIMITS

SCENARIOS = ("pairs", "mixed", "steady")
RUNNERS = ("v1", "v2")
# The model's linear-attention layers: Mamba2 (Nemotron-H) splits a batch by position, GDN
# (Qwen3-Next) by its spec-decode rows, and runs the two kernel groups in the other order.
MIXERS = ("mamba2", "gdn")

# Bug toggles, each reproducing one upstream mechanism (see mgtrace.sim.bugs).
BUG_REORDER = "reorder-threshold-mismatch"
BUG_BATCH_ROW = "batch-row-block-table"
BUG_ASYNC_RACE = "async-accepted-race"
BUG_STALE_ROW = "stale-condense-row"
BUGS = (BUG_REORDER, BUG_BATCH_ROW, BUG_ASYNC_RACE, BUG_STALE_ROW)


MAX_POOL_BLOCKS = 1 << 20  # a million blocks: more than any engine's Mamba pool


# days of simulation at a few thousand steps a second; a step number stays well in int64
MAX_STEPS = 10**9


@dataclass
class SimConfig:
    """One simulated engine run. Every random choice is drawn from ``seed``."""

    scenario: str = "pairs"
    steps: int = 2000
    runner: str = "v1"
    mixer: str = "mamba2"
    k: int = 3  # num_speculative_tokens (MTP drafts per decode step)
    pp: int = 1  # pipeline-parallel size
    seed: int = 0
    bugs: tuple[str, ...] = ()
    max_num_seqs: int = 96
    max_num_batched_tokens: int = 8192
    mamba_block_size: int = 256
    num_blocks: int | None = None  # state pool size incl. the null block; None: sized to fit
    async_scheduling: bool = True
    acceptance_rate: float = 0.7  # per-draft-token acceptance probability
    prefix_hit_prob: float = 0.5  # chance a request with a cached prefix family uses the hit
    d2h_early_prob: float = 0.25  # chance the accepted-count copy lands before the row moves
    length_scale: float = 1.0  # scales prompt and output lengths (small runs in tests)
    output: Path | None = None
    overwrite: bool = False
    cudagraph_padding: bool = True  # pad uniform decode batches to a capture size
    # vLLM >= 0.33's Mamba prefill checkpoints (mgtrace.sim.checkpoints); off: the older
    # rule, where the scheduler ends a prefill chunk on the boundary it wants cached
    prefill_checkpoints: bool = False

    @property
    def spec_blocks(self) -> int:
        """num_speculative_blocks of the Mamba spec: one state block per draft."""
        return self.k

    @property
    def mamba_threshold(self) -> int:
        """The Mamba builders' decode threshold: 1 + k with spec decode, 1 without."""
        return 1 + self.k

    @property
    def async_pipeline(self) -> bool:
        """V2 with a pipeline and async scheduling: a request's decodes are pp steps apart,
        scheduled on optimistic counts while the previous one's result is still pending
        (vLLM's ``decode_stagger``). V1 does not overlap a pipeline: its PP runs are
        synchronous."""
        return self.runner == "v2" and self.pp > 1 and self.async_scheduling

    @property
    def steps_in_flight(self) -> int:
        """Steps whose results are still pending when the next step is scheduled: vLLM's
        ``max_concurrent_batches`` less one."""
        if self.pp > 1:
            return self.pp - 1 + int(self.async_pipeline)
        return int(self.async_scheduling)

    @property
    def builder_name(self) -> str:
        """The linear-attention builder, named as a recording names it."""
        return "GDNAttentionMetadataBuilder" if self.mixer == "gdn" else "mamba2"

    @property
    def pool_blocks(self) -> int:
        if self.num_blocks is not None:
            return self.num_blocks
        # Each running request holds its running block, k spec blocks, the previous state
        # block until it is retired (and its prefill checkpoint block, where there are
        # any); the 64 spare blocks keep cached boundary states in the free queue a while.
        per_request = self.k + 3 + int(self.prefill_checkpoints)
        return 1 + self.max_num_seqs * per_request + 64

    def validate(self) -> SimConfig:
        """Raise UsageError (one sentence) on any value the simulator cannot run."""
        if self.scenario not in SCENARIOS:
            raise UsageError(
                f"unknown scenario {self.scenario!r}; choose one of {', '.join(SCENARIOS)}"
            )
        if self.runner not in RUNNERS:
            raise UsageError(f"unknown runner {self.runner!r}; choose v1 or v2")
        if self.mixer not in MIXERS:
            raise UsageError(f"unknown mixer {self.mixer!r}; choose mamba2 or gdn")
        if not 1 <= self.steps <= MAX_STEPS:
            raise UsageError(
                f"--steps must be at least 1 and at most {MAX_STEPS:,}, got {self.steps}"
            )
        if not 0 <= self.k <= 16:
            raise UsageError(f"--k must be between 0 and 16, got {self.k}")
        if not 1 <= self.pp <= 8:
            raise UsageError(f"--pp must be between 1 and 8, got {self.pp}")
        if self.max_num_seqs < 1 or self.max_num_seqs > 4096:
            raise UsageError(f"--max-num-seqs must be between 1 and 4096, got {self.max_num_seqs}")
        if self.mamba_block_size < 2 or self.mamba_block_size <= self.k:
            raise UsageError(f"--block-size ({self.mamba_block_size}) must exceed --k ({self.k})")
        # what a manifest may hold (a trace read back refuses more)
        for flag, value, name in (
            ("--block-size", self.mamba_block_size, "mamba_block_size"),
            ("--max-num-batched-tokens", self.max_num_batched_tokens, "max_num_batched_tokens"),
        ):
            if value > RUN_LIMITS[name]:
                raise UsageError(f"{flag} must be at most {RUN_LIMITS[name]}, got {value}")
        if self.max_num_batched_tokens < self.mamba_block_size:
            raise UsageError(
                f"--max-num-batched-tokens ({self.max_num_batched_tokens}) must be at least "
                f"one Mamba block (--block-size, {self.mamba_block_size} tokens)"
            )
        if self.seed < 0:
            raise UsageError(f"--seed must be 0 or more, got {self.seed}")
        if self.pool_blocks < 1 + 2 * (self.k + 2):
            raise UsageError(
                f"--num-blocks ({self.pool_blocks}) is too small to run a request; "
                f"with --k {self.k} it must be at least {1 + 2 * (self.k + 2)}"
            )
        if self.pool_blocks > MAX_POOL_BLOCKS:
            # the pool, its free list and a replay's tag pages scale with it
            raise UsageError(
                f"--num-blocks ({self.pool_blocks}) is more than the simulator models "
                f"({MAX_POOL_BLOCKS})"
            )
        for name, p in (
            ("acceptance_rate", self.acceptance_rate),
            ("prefix_hit_prob", self.prefix_hit_prob),
            ("d2h_early_prob", self.d2h_early_prob),
        ):
            if not 0.0 <= p <= 1.0:
                raise UsageError(f"{name} must be between 0 and 1, got {p}")
        if not 0.0 < self.length_scale <= 10.0:
            raise UsageError(f"length_scale must be in (0, 10], got {self.length_scale}")
        unknown = [b for b in self.bugs if b not in BUGS]
        if unknown:
            raise UsageError(f"unknown bug {unknown[0]!r}; the toggles are {', '.join(BUGS)}")
        self.bugs = tuple(dict.fromkeys(self.bugs))
        if self.runner == "v1" and self.pp > 1 and self.k > 0:
            raise UsageError(
                "the V1 runner does not support MTP with pipeline parallelism; "
                "use --runner v2 or --pp 1"
            )
        if BUG_BATCH_ROW in self.bugs and (self.runner != "v2" or self.pp < 2):
            raise UsageError(f"{BUG_BATCH_ROW} needs --runner v2 and --pp 2 or more")
        if BUG_BATCH_ROW in self.bugs and self.k < 1:
            # without drafts the decode writes its running block itself: the late
            # post-process copies nothing, whichever block-table row it indexes
            raise UsageError(
                f"{BUG_BATCH_ROW} corrupts through the post-process's copies, which have "
                "nothing to copy without speculative decoding (--k 1 or more)"
            )
        if BUG_ASYNC_RACE in self.bugs and (self.runner != "v1" or not self.async_scheduling):
            raise UsageError(f"{BUG_ASYNC_RACE} needs --runner v1 with async scheduling")
        if BUG_STALE_ROW in self.bugs and self.runner != "v1":
            raise UsageError(f"{BUG_STALE_ROW} is a V1 InputBatch bug; use --runner v1")
        if BUG_STALE_ROW in self.bugs and self.k < 1:
            raise UsageError(
                f"{BUG_STALE_ROW} reads stale rows through the align context's padded gather, "
                "which vLLM builds only with speculative decoding (--k 1 or more)"
            )
        if BUG_REORDER in self.bugs and (self.runner != "v1" or self.k < 1):
            raise UsageError(f"{BUG_REORDER} needs --runner v1 and --k 1 or more")
        if BUG_ASYNC_RACE in self.bugs and self.k < 1:
            raise UsageError(f"{BUG_ASYNC_RACE} needs speculative decoding (--k 1 or more)")
        return self

    def has(self, bug: str) -> bool:
        return bug in self.bugs
