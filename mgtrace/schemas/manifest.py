"""The trace manifest: run metadata, parts with checksums, drop counters, completeness.

``manifest.json`` is the only file a reader trusts to know which parts exist: parts are
written under a temporary name and renamed, and the manifest is rewritten atomically after
each part, so a crashed writer leaves a manifest that lists only whole parts.
"""

from __future__ import annotations

import json
import math
from dataclasses import MISSING, asdict, dataclass, field, fields
from pathlib import Path
from typing import Any

from mgtrace.atomic import atomic_write
from mgtrace.errors import ManifestError, SchemaVersionError
from mgtrace.schemas.field_types import check_entries
from mgtrace.schemas.tables import SCHEMA_VERSION, TABLES

MANIFEST_NAME = "manifest.json"
FORMAT_NAME = "mgtrace-trace"
STATE_KINDS = ("conv", "temporal")
# The largest values a manifest may hold: far past any engine's, yet small enough that a
# replay sizing arrays by them (a pool of blocks, a table of rows) can say how much memory
# it needs instead of failing inside numpy. A damaged manifest is refused at them.
RUN_LIMITS = {
    "mamba_block_size": 2**20,  # tokens per Mamba block
    "num_speculative_tokens": 2**10,
    "tp_size": 2**16,
    "pp_size": 2**10,
    "dp_size": 2**16,
    "num_mamba_groups": 2**10,
    "num_blocks": 2**31,  # blocks of the state pool
    "max_num_seqs": 2**20,
    "max_num_batched_tokens": 2**31,
    # a reorder threshold is a query length in tokens: never more than a batch holds
    "runner_reorder_threshold": 2**31,
    "builder_reorder_thresholds": 2**31,  # each builder's
    "prefill_checkpoint_blocks": 2**31,  # blocks per request: never more than the pool
}
MAX_STATE_DIM = 2**31  # one dimension of a state tensor, per block
MAX_STATE_ELEMENTS = 2**40  # elements of a state tensor, per block


@dataclass
class StateLayout:
    """One state tensor of one Mamba layer: what a block of the pool holds."""

    group: int
    layer: int
    kind: str  # conv | temporal
    shape: list[int]  # per block, without the leading block dimension
    dtype: str  # torch dtype name without the "torch." prefix, e.g. "bfloat16"
    conv_layout: str | None = None  # SD (state_len, dim) | DS (dim, state_len); conv only

    def problem(self) -> str | None:
        """The first value no engine's state can have, in words; None when all can be."""
        if self.kind not in STATE_KINDS:
            return f"kind must be conv or temporal, not {self.kind!r:.60}"
        if self.group < 0 or self.layer < 0:
            return f"group and layer must be 0 or more, not {self.group} and {self.layer}"
        if not self.shape or not all(1 <= d <= MAX_STATE_DIM for d in self.shape):
            return f"shape must list one or more dimensions of 1 to 2**31, not {self.shape!r:.60}"
        if math.prod(self.shape) > MAX_STATE_ELEMENTS:
            return f"shape must hold at most 2**40 elements, not {self.shape!r:.60}"
        if self.kind == "conv" and (self.conv_layout or "SD") not in ("SD", "DS"):
            return f"conv_layout must be SD or DS, not {self.conv_layout!r:.60}"
        return None


@dataclass
class RunMetadata:
    """What the engine was running; the replayer sizes its pool and rules from this."""

    runner: str = "v1"  # v1 | v2
    vllm_version: str | None = None
    model: str | None = None
    num_speculative_tokens: int = 0
    mamba_block_size: int = 16
    mamba_cache_mode: str = "align"
    async_scheduling: bool = False
    tp_size: int = 1
    pp_size: int = 1
    # data parallelism: dp_size engines, each with a scheduler of its own; this is dp_rank's
    dp_size: int = 1
    dp_rank: int = 0
    max_num_seqs: int | None = None
    max_num_batched_tokens: int | None = None
    num_blocks: int | None = None  # size of the state pool, null block 0 included
    num_mamba_groups: int = 1
    runner_reorder_threshold: int | None = None
    builder_reorder_thresholds: dict[str, int | None] = field(default_factory=dict)
    row_rule: str | None = None  # block-table row rule of the align kernels, req_slot | batch_row
    # state blocks a Mamba group keeps per request for the boundary states its prefill
    # forward stores itself (vLLM's prefill checkpoints)
    prefill_checkpoint_blocks: int | None = None
    # whether batch_rows.checkpoint_tokens/checkpoint_col say where those states went; the
    # replay writes them only then
    prefill_checkpoints_recorded: bool = False
    states: list[StateLayout] = field(default_factory=list)

    @classmethod
    def from_dict(cls, data: dict[str, Any], where: str = MANIFEST_NAME) -> RunMetadata:
        known = {f.name for f in fields(cls)}
        kwargs = {k: v for k, v in data.items() if k in known}
        states = _list(kwargs.pop("states", []), "run.states", where)
        check_entries(cls, kwargs, where, "run.")
        layouts = [_entry(StateLayout, s, where, f"run.states[{i}]") for i, s in enumerate(states)]
        run = cls(**kwargs, states=layouts)
        problem = run.problem()
        if problem:
            raise ValueError(f"{where}: {problem}")
        return run

    def problem(self) -> str | None:
        """The first value no engine can have, in words; None when all can be."""
        if self.runner not in ("v1", "v2"):
            return f"run.runner must be v1 or v2, not {self.runner!r}"
        if self.row_rule not in (None, "req_slot", "batch_row"):
            return f"run.row_rule must be req_slot, batch_row or null, not {self.row_rule!r}"
        at_least = {
            "mamba_block_size": (self.mamba_block_size, 1),
            "num_speculative_tokens": (self.num_speculative_tokens, 0),
            "tp_size": (self.tp_size, 1),
            "pp_size": (self.pp_size, 1),
            "dp_size": (self.dp_size, 1),
            "num_mamba_groups": (self.num_mamba_groups, 1),
            "num_blocks": (self.num_blocks, 1),
            "max_num_seqs": (self.max_num_seqs, 1),
            "max_num_batched_tokens": (self.max_num_batched_tokens, 1),
            "runner_reorder_threshold": (self.runner_reorder_threshold, 0),
            "prefill_checkpoint_blocks": (self.prefill_checkpoint_blocks, 0),
        }
        bounds = [(name, value, low, RUN_LIMITS[name]) for name, (value, low) in at_least.items()]
        high = RUN_LIMITS["builder_reorder_thresholds"]
        bounds += [
            (f"builder_reorder_thresholds[{builder!r:.60}]", value, 0, high)
            for builder, value in self.builder_reorder_thresholds.items()
        ]
        for name, value, low, high in bounds:
            if value is not None and value < low:
                return f"run.{name} must be at least {low}, not {value}"
            if value is not None and value > high:
                shown = value if value < 10**15 else f"{value:.3g}"
                return f"run.{name} must be at most {high} (more than any engine has), not {shown}"
        if not 0 <= self.dp_rank < self.dp_size:
            return f"run.dp_rank must be at least 0 and below dp_size, not {self.dp_rank}"
        for i, state in enumerate(self.states):
            problem = state.problem()
            if problem:
                return f"run.states[{i}].{problem}"
        return None


@dataclass
class PartInfo:
    """One complete Parquet file of one table."""

    table: str
    path: str  # relative to the trace directory
    rows: int
    bytes: int
    sha256: str
    rank: int | None = None
    min_step: int | None = None
    max_step: int | None = None


@dataclass
class Drops:
    """Everything that did not make it into the trace, counted, never silent."""

    steps: int = 0  # steps dropped: a full queue, a failed write, a lost capture or hook
    malformed_steps: int = 0  # steps refused: their columns or values do not fit the schema
    rows: int = 0  # rows inside those steps
    step_ranges: list[list[int]] = field(default_factory=list)  # [rank, first, last], merged

    def add_step(self, rank: int, step: int) -> None:
        if self.step_ranges:
            last = self.step_ranges[-1]
            if last[0] == rank and last[2] + 1 == step:
                last[2] = step
                return
        self.step_ranges.append([rank, step, step])

    def merged_ranges(self) -> list[list[int]]:
        """The ranges sorted, those that touch or overlap joined: drops counted by several
        parties (the writer, the recorder, a failed assembler) arrive out of order."""
        merged: list[list[int]] = []
        for rank, first, last in sorted(self.step_ranges):
            if merged and merged[-1][0] == rank and first <= merged[-1][2] + 1:
                merged[-1][2] = max(merged[-1][2], last)
            else:
                merged.append([rank, first, last])
        return merged

    @property
    def total_steps(self) -> int:
        return self.steps + self.malformed_steps


@dataclass
class Manifest:
    run: RunMetadata = field(default_factory=RunMetadata)
    source: dict[str, Any] = field(default_factory=dict)
    parts: list[PartInfo] = field(default_factory=list)
    drops: Drops = field(default_factory=Drops)
    errors: dict[str, Any] = field(default_factory=dict)  # counted errors with first message
    ground_truth: dict[str, Any] | None = None  # injected bugs (simulator traces only)
    complete: bool = False
    created_unix: float = 0.0
    closed_unix: float | None = None
    mgtrace_version: str = ""
    schema_version: int = SCHEMA_VERSION
    format: str = FORMAT_NAME

    def to_dict(self) -> dict[str, Any]:
        out = asdict(self)
        out["drops"]["step_ranges"] = self.drops.merged_ranges()
        return out

    @classmethod
    def from_dict(cls, data: dict[str, Any], *, where: str = MANIFEST_NAME) -> Manifest:
        if not isinstance(data, dict) or data.get("format") != FORMAT_NAME:
            raise ManifestError(f"{where} is not an mgtrace manifest (no format: {FORMAT_NAME!r})")
        version = data.get("schema_version")
        if type(version) is not int:  # true and 1.0 equal 1; "1" is not a version either
            raise SchemaVersionError(
                f"{where} has schema version {version!r}, not a whole number; mgtrace "
                f"writes version {SCHEMA_VERSION} as the number {SCHEMA_VERSION}"
            )
        if version != SCHEMA_VERSION:
            raise SchemaVersionError(
                f"{where} has schema version {version!r}, but this mgtrace reads version "
                f"{SCHEMA_VERSION} only; use the mgtrace release that wrote it"
            )
        for entry in REQUIRED_ENTRIES:  # every writer writes them; defaults would pass for facts
            if entry not in data:
                raise ManifestError(
                    f"{where} has no {entry} section, so what the engine ran (runner, k, "
                    "block size) is unknown"
                )
        try:
            parts = [
                _entry(PartInfo, p, where, f"parts[{i}]")
                for i, p in enumerate(_list(data.get("parts", []), "parts", where))
            ]
            drops = _entry(Drops, data.get("drops", {}), where, "drops")
            _check_step_ranges(drops.step_ranges, where)
            run = RunMetadata.from_dict(_object(data["run"], "run", where), where)
            # the top-level entries, as their annotations say (a float for a timestamp, ...)
            top = {k: data[k] for k in _TOP_LEVEL if k in data}
            check_entries(cls, top, where, "")
            _check_errors(top.get("errors", {}), where)
            _check_ground_truth(top.get("ground_truth"), where)
        except ValueError as exc:
            raise ManifestError(str(exc)) from None
        except TypeError as exc:
            raise ManifestError(f"{where} has a malformed entry ({exc})") from None
        seen: set[str] = set()
        for part in parts:
            if part.table not in TABLES:
                raise ManifestError(f"{where} lists a part of unknown table {part.table!r}")
            if part.path in seen:  # read twice, its rows would count twice
                raise ManifestError(f"{where} lists the part {part.path} twice")
            seen.add(part.path)
        return cls(
            run=run,
            source=dict(top.get("source", {})),
            parts=parts,
            drops=drops,
            errors=dict(top.get("errors", {})),
            ground_truth=top.get("ground_truth"),
            complete=top.get("complete", False),
            created_unix=float(top.get("created_unix", 0.0)),
            closed_unix=top.get("closed_unix"),
            mgtrace_version=top.get("mgtrace_version", ""),
        )


# Top-level entries a manifest must have: ``run``'s defaults would describe an engine that
# never ran.
REQUIRED_ENTRIES = ("run",)

_TOP_LEVEL = (
    "source",
    "errors",
    "ground_truth",
    "complete",
    "created_unix",
    "closed_unix",
    "mgtrace_version",
)


def _check_step_ranges(ranges: list[Any], where: str) -> None:
    """Each dropped range is [rank, first step, last step], none negative, first <= last."""
    for i, r in enumerate(ranges):
        if not (
            isinstance(r, list)
            and len(r) == 3
            and all(type(x) is int and x >= 0 for x in r)
            and r[1] <= r[2]
        ):
            raise ValueError(
                f"{where}: drops.step_ranges[{i}] must be [rank, first step, last step] "
                f"with first <= last, not {r!r:.60}"
            )


def _check_errors(errors: dict[str, Any], where: str) -> None:
    """Each error kind: how many times, and the first message."""
    for kind, entry in errors.items():
        entry = _object(entry, f"errors.{kind}", where)
        if type(entry.get("count")) is not int or not isinstance(entry.get("first"), str):
            raise ValueError(f"{where}: errors.{kind} must hold an integer count and a message")


def _check_ground_truth(truth: Any, where: str) -> None:
    """A simulator's ground truth, in the parts every reader of it uses."""
    if truth is None:
        return
    truth = _object(truth, "ground_truth", where)
    injected = truth.get("injected", [])
    if not isinstance(injected, list) or not all(isinstance(x, str) for x in injected):
        raise ValueError(f"{where}: ground_truth.injected must be a list of bug names")
    first = truth.get("first_step")
    if first is not None and type(first) is not int:
        raise ValueError(f"{where}: ground_truth.first_step must be a step number or null")
    _object(truth.get("bugs", {}), "ground_truth.bugs", where)


def _object(value: Any, label: str, where: str) -> dict[str, Any]:
    if not isinstance(value, dict):
        raise ValueError(f"{where}: {label} must be an object, not {value!r:.60}")
    return value


def _list(value: Any, label: str, where: str) -> list[Any]:
    if not isinstance(value, list):
        raise ValueError(f"{where}: {label} must be a list, not {value!r:.60}")
    return value


def _entry(cls: Any, value: Any, where: str, label: str) -> Any:
    """One dataclass from one JSON object, its entries type-checked and none missing or
    unknown."""
    check_entries(cls, _object(value, label, where), where, f"{label}.")
    known = {f.name for f in fields(cls)}
    required = {
        f.name for f in fields(cls) if f.default is MISSING and f.default_factory is MISSING
    }
    missing, unknown = sorted(required - set(value)), sorted(set(value) - known)
    if missing:
        raise ValueError(f"{where}: {label} lacks {', '.join(missing)}")
    if unknown:
        raise ValueError(f"{where}: {label} has unknown entries {', '.join(unknown)}")
    return cls(**value)


def write_json_atomic(path: Path, data: Any) -> None:
    """Write JSON under a temporary name in the same directory, then rename over ``path``."""
    text = json.dumps(data, indent=1, sort_keys=False) + "\n"
    atomic_write(path, lambda fh: fh.write(text.encode()))


def save_manifest(trace_dir: Path, manifest: Manifest) -> None:
    write_json_atomic(trace_dir / MANIFEST_NAME, manifest.to_dict())


def is_trace_directory(path: Path) -> bool:
    """Whether ``path`` is a directory whose manifest says it is an mgtrace trace: what
    --force may replace (a ``manifest.json`` of some other program does not count)."""
    try:
        data = json.loads((path / MANIFEST_NAME).read_text())
    except (OSError, UnicodeDecodeError, ValueError, RecursionError):
        return False
    return isinstance(data, dict) and data.get("format") == FORMAT_NAME


def read_manifest_file(path: Path) -> Manifest:
    """One ``manifest.json``, parsed and checked."""
    try:
        data = json.loads(path.read_text())
    except OSError as exc:
        raise ManifestError(f"{path} cannot be read ({exc.strerror or exc})") from None
    except UnicodeDecodeError:
        raise ManifestError(f"{path} is not text; it is not an mgtrace manifest") from None
    except json.JSONDecodeError as exc:
        raise ManifestError(
            f"{path} is not valid JSON ({exc.msg}: line {exc.lineno}, column {exc.colno}); "
            "it may have been cut short"
        ) from None
    except RecursionError:  # nested deeper than Python's JSON decoder goes: no manifest
        raise ManifestError(f"{path} is nested too deeply; it is not an mgtrace manifest") from None
    return Manifest.from_dict(data, where=str(path))


def load_manifest(trace_dir: Path) -> Manifest:
    """The manifest of a trace directory; for a multi-rank recording (``rank-NNN``
    subdirectories) the union of its ranks' manifests."""
    from mgtrace.schemas import ranks

    path = trace_dir / MANIFEST_NAME
    if path.is_file():
        own = read_manifest_file(path)
        if ranks.is_merged(own):
            return ranks.merge_ranks(
                trace_dir, ranks.rank_directories(trace_dir), _read_rank, own=own
            )
        return own
    found = ranks.rank_directories(trace_dir)
    if found:
        return ranks.merge_ranks(trace_dir, found, _read_rank)
    engines = ranks.engine_directories(trace_dir)
    if engines:
        raise ManifestError(
            f"{trace_dir} holds one trace per engine ({', '.join(e.name for e in engines)}); "
            f"name one of them, e.g. {engines[0]}"
        )
    if path.exists():  # a folder, a device: damaged, or never a trace
        raise ManifestError(f"{path} is not a file; the trace's manifest is damaged")
    raise ManifestError(f"{trace_dir} has no {MANIFEST_NAME}; it is not an mgtrace trace")


def _read_rank(rank_dir: Path) -> Manifest:
    return read_manifest_file(rank_dir / MANIFEST_NAME)
