"""Arrow schemas of every trace table: the single source of truth for column names.

Each table is long and narrow, one row per natural key, so that SQL over a trace stays
simple. Every column carries a one-line doc in its field metadata; ``docs/trace-format.md``
is generated from these definitions (``python -m mgtrace.schemas.docgen``).

Conventions:
- ``rank`` is the pipeline/tensor-parallel worker rank that produced the row.
- ``step`` is the engine step counter of that rank, starting at 0.
- Categorical columns are strings; Parquet's dictionary encoding makes them nearly free.
- Token ids and prompt text are never part of a trace (privacy by default).
"""

from __future__ import annotations

from dataclasses import dataclass

import pyarrow as pa

SCHEMA_VERSION = 1

I32 = pa.int32()
I64 = pa.int64()
F64 = pa.float64()
STR = pa.string()
BOOL = pa.bool_()
I32_LIST = pa.list_(pa.int32())
I32_LIST_LIST = pa.list_(pa.list_(pa.int32()))

REORDER_REGIONS = ("decode", "short_extend", "long_extend", "prefill")
MAMBA_SPLITS = ("decode", "prefill")
KERNELS = ("precopy", "postprocess", "aligned_indices")
ROW_RULES = ("req_slot", "batch_row")
POSTPROCESS_MODES = ("decision", "precomputed")
BLOCK_TABLE_KINDS = ("v1", "source", "input")
ROW_MOVE_OPS = ("add", "remove", "swap", "move", "clear")
SCHED_KINDS = ("new", "cached", "resumed", "finished", "preempted")
FINDING_KINDS = (
    "foreign_state",
    "wrong_tokens",
    "foreign_block_write",
    "block_collision",
    "malformed",
)


def col(
    name: str,
    type_: pa.DataType,
    doc: str,
    *,
    nullable: bool = True,
    categories: tuple[str, ...] = (),
) -> pa.Field:
    """A documented column. A categorical string column lists its values: a writer may pass
    integer codes into ``categories`` instead of strings (much cheaper on a hot path)."""
    metadata = {"doc": doc}
    if categories:
        metadata["categories"] = ",".join(categories)
    return pa.field(name, type_, nullable=nullable, metadata=metadata)


def key(name: str, type_: pa.DataType, doc: str, *, categories: tuple[str, ...] = ()) -> pa.Field:
    return col(name, type_, doc, nullable=False, categories=categories)


def categories_of(field: pa.Field) -> tuple[str, ...]:
    raw = (field.metadata or {}).get(b"categories")
    return tuple(raw.decode().split(",")) if raw else ()


RANK = key("rank", I32, "Worker rank that produced the row.")
STEP = key("step", I64, "Engine step of that rank, from 0.")


@dataclass(frozen=True)
class TableSpec:
    """One trace table: its Arrow schema, natural key and whether rows belong to a step."""

    name: str
    doc: str
    schema: pa.Schema
    keys: tuple[str, ...]
    per_step: bool

    @property
    def column_names(self) -> tuple[str, ...]:
        return tuple(self.schema.names)

    def field(self, name: str) -> pa.Field:
        return self.schema.field(name)


def _table(
    name: str, doc: str, keys: tuple[str, ...], fields: list[pa.Field], *, per_step: bool = True
) -> TableSpec:
    head = [RANK, STEP] if per_step else []
    schema = pa.schema(head + fields, metadata={"table": name, "doc": doc})
    return TableSpec(name=name, doc=doc, schema=schema, keys=keys, per_step=per_step)


STEPS = _table(
    "steps",
    "One row per engine step and rank: batch size, thresholds in force, and the Mamba split.",
    ("rank", "step"),
    [
        col("wall_ns", I64, "Host monotonic clock at the start of the step, in ns."),
        col("num_reqs", I32, "Rows in the batch."),
        col("num_scheduled_tokens", I32, "Tokens scheduled in the step, drafts included."),
        col("reorder_threshold", I32, "Runner's batch-reorder decode threshold in force."),
        col(
            "mamba_threshold",
            I32,
            "Mamba builder's decode threshold (1+k with spec decode). GDN: 1 where its builder "
            "had no spec mask (all rows in one call), null where it had one.",
        ),
        col("num_mamba_decodes", I32, "Rows the Mamba builder counted as decodes (split index)."),
        col(
            "postprocess_step",
            I64,
            "Step whose batch this step's align post-process processed; null when none ran.",
        ),
        col(
            "accepted_landed",
            BOOL,
            "Whether the previous step's accepted-count copy to host had landed before "
            "this step's row moves (async scheduling).",
        ),
        col(
            "block_copy_src",
            I32_LIST,
            "Whole-block copies the scheduler queued for this step, run before its forward "
            "(kv_cache_block_copies: copy-on-write of partially hit prefix blocks): sources.",
        ),
        col("block_copy_dst", I32_LIST, "Destinations of those copies, in the same order."),
    ],
)

BATCH_ROWS = _table(
    "batch_rows",
    "One row per batch row of a step, in batch order after the reorder.",
    ("rank", "step", "batch_row"),
    [
        key("batch_row", I32, "Position in the step's batch."),
        key("req_id", STR, "Engine request id."),
        col(
            "req_slot",
            I32,
            "Persistent request slot: the InputBatch row (V1) or idx_mapping[batch_row] (V2).",
        ),
        col("num_scheduled", I32, "Tokens scheduled for the row this step, drafts included."),
        col(
            "num_computed",
            I32,
            "Tokens computed before this step, as the align kernels read it: V1's host count "
            "after the async correction (at `preprocess_mamba`); V2's device count per slot "
            "(captured before `preprocess_state`), not the batch's CPU mirror, which is the "
            "scheduler's optimistic count under async scheduling.",
        ),
        col("num_prompt", I32, "Prompt length."),
        col("num_draft", I32, "Draft tokens scheduled for the row."),
        col(
            "accepted_prev",
            I32,
            "Accepted count of the previous step as this step consumed it "
            "(decode window column accepted_prev-1, precopy bias accepted_prev-1).",
        ),
        col(
            "accepted_prev_cpu",
            I32,
            "The CPU-held accepted count, only where it differs from accepted_prev.",
        ),
        col(
            "accepted",
            I32,
            "Tokens accepted this step (1..k+1); null when the row sampled nothing.",
        ),
        col(
            "prev_state_col",
            I32,
            "Mamba running column before the precopy; -1 for a fresh request.",
        ),
        col(
            "state_col",
            I32,
            "Mamba running column after the precopy: cdiv(computed+scheduled, B)-1.",
        ),
        col("is_prefilling", BOOL, "Whether the request was still in its prompt."),
        col(
            "reorder_region",
            STR,
            "Reorder region: decode | short_extend | long_extend | prefill.",
            categories=REORDER_REGIONS,
        ),
        col(
            "mamba_split",
            STR,
            "Where the Mamba builder put the row: decode | prefill.",
            categories=MAMBA_SPLITS,
        ),
        col(
            "checkpoint_tokens",
            I32,
            "Prefill checkpoint: tokens folded into the state the prefill also stored mid-query "
            "(query start + the builder's offset); null when the row stored none.",
        ),
        col(
            "checkpoint_col",
            I32,
            "Block-table column that checkpoint state went to: cdiv(computed+scheduled, B)-2.",
        ),
    ],
)

LAUNCHES = _table(
    "launches",
    "One row per batch row of an align kernel launch: the inputs exactly as the kernel read them.",
    ("rank", "step", "kernel", "batch_row"),
    [
        key("kernel", STR, "precopy | postprocess | aligned_indices.", categories=KERNELS),
        key("batch_row", I32, "Program index b of the launch grid."),
        col("batch_step", I64, "Step whose batch (and idx_mapping) the launch processed."),
        col("req_slot", I32, "idx_mapping[batch_row] (V2), batch_row (V1); -1 for a padded row."),
        col(
            "row_rule",
            STR,
            "Block-table row rule compiled in: req_slot | batch_row.",
            categories=ROW_RULES,
        ),
        col("bt_row", I32, "Block-table row the kernel indexed under its rule."),
        col(
            "bt_table",
            STR,
            "Which block table was bound: v1 | source | input.",
            categories=BLOCK_TABLE_KINDS,
        ),
        col("bt_step", I64, "Step whose content of that block table was live at launch."),
        col(
            "mode",
            STR,
            "Post-process mode: decision (V1) | precomputed (V2); null otherwise.",
            categories=POSTPROCESS_MODES,
        ),
        col("num_accepted", I32, "Accepted count the kernel read (snapshot before normalisation)."),
        col("num_accepted_cpu", I32, "CPU-held accepted count, only where it differs."),
        col("state_idx", I32, "mamba_state_idx: post-process source column, precopy destination."),
        col("num_scheduled", I32, "Decision mode: scheduled tokens."),
        col("num_computed", I32, "Decision mode: computed before; precomputed mode: new computed."),
        col("num_draft", I32, "Decision mode: draft tokens."),
        col("src_col", I32, "Precopy: source (previous running) column."),
        col("token_bias", I32, "Precopy: accepted-token bias (accepted-1)."),
        col("seq_len", I32, "Aligned indices: sequence length."),
    ],
)

BLOCK_TABLES = _table(
    "block_tables",
    "Mamba group block-table rows, written only when a row changed (its full new content).",
    ("rank", "step", "group", "table", "row"),
    [
        key("group", I32, "Mamba KV-cache group, local index."),
        key(
            "table",
            STR,
            "v1 (InputBatch rows) | source (V2 per-slot) | input (V2 gathered, batch order).",
            categories=BLOCK_TABLE_KINDS,
        ),
        key("row", I32, "Table row."),
        col("block_ids", I32_LIST, "Block ids of the row; empty after a clear.", nullable=False),
    ],
)

ROW_MOVES = _table(
    "row_moves",
    "InputBatch row bookkeeping in the order it happened within a step.",
    ("rank", "step", "seq"),
    [
        key("seq", I32, "Order within the step."),
        key("op", STR, "add | remove | swap | move | clear.", categories=ROW_MOVE_OPS),
        col("row_a", I32, "Row added/removed/cleared, first swapped row, or move source."),
        col("row_b", I32, "Second swapped row, or move destination."),
        col("req_id", STR, "Request at row_a before the op."),
        col("req_id_b", STR, "Request at row_b before the op."),
        col("accepted_a", I32, "num_accepted_tokens_cpu[row_a] before the op."),
        col("accepted_b", I32, "num_accepted_tokens_cpu[row_b] before the op."),
        col("d2h_landed", BOOL, "Whether the previous step's accepted-count copy had landed."),
    ],
)

SCHED = _table(
    "sched",
    "Scheduler output per step and request; finished and preempted requests get a row too.",
    ("rank", "step", "req_id"),
    [
        key("req_id", STR, "Engine request id."),
        key("kind", STR, "new | cached | resumed | finished | preempted.", categories=SCHED_KINDS),
        col("num_scheduled", I32, "Tokens scheduled, drafts included."),
        col(
            "num_computed", I32, "Scheduler's computed count (optimistic under async spec decode)."
        ),
        col("num_spec", I32, "Draft tokens scheduled."),
        col("num_prompt", I32, "Prompt length (new requests)."),
        col(
            "new_block_ids",
            I32_LIST_LIST,
            "Per KV-cache group, block ids added (replaced for new and resumed requests).",
        ),
    ],
)

REQUESTS = _table(
    "requests",
    "One row per request: arrival, lengths, finish, and the client's corruption label when known.",
    ("req_id",),
    [
        key("req_id", STR, "Engine request id."),
        col("arrival_s", F64, "Arrival time in seconds from the start of the trace."),
        col("first_step", I64, "First step the request was scheduled in."),
        col("last_step", I64, "Last step the request was scheduled in."),
        col("prompt_len", I32, "Prompt tokens."),
        col("output_len", I32, "Output tokens."),
        col(
            "prefix_hit_tokens",
            I32,
            "Prompt tokens served from the prefix cache at the first admission (a resumed "
            "request's hit shows as its resumed sched row's num_computed).",
        ),
        col("finish_reason", STR, "stop | length | abort | running."),
        col("corrupt", BOOL, "Client-side corruption label; null when unknown."),
        col("corruption_marker", STR, "What the client saw (e.g. foreign marker, oov rate)."),
        col("client_id", STR, "Load generator's id for the request."),
    ],
    per_step=False,
)

FINDINGS = _table(
    "findings",
    "Written by replay: one row per finding of the oracle, per replay run.",
    ("replay_id", "rank", "step", "req_id", "kind", "signature"),
    [
        key("replay_id", STR, "Replay run that produced the finding."),
        col("rules", STR, "Rule set of that replay, as rule=value pairs."),
        col("rank", I32, "Worker rank."),
        col("step", I64, "Step at which the finding occurred."),
        col("req_id", STR, "Request that reads or is hit by the bad state."),
        col("batch_row", I32, "Its batch row in that step."),
        key(
            "kind",
            STR,
            "foreign_state | wrong_tokens | foreign_block_write | block_collision | malformed.",
        ),
        key("signature", STR, "Stable signature of the finding (kind + mechanism), for pinning."),
        col("group", I32, "Mamba group involved."),
        col("block_id", I32, "Block involved."),
        col("writer_req_id", STR, "Request whose state was read or overwritten."),
        col("writer_step", I64, "Step at which that state was written."),
        col("detail", STR, "One sentence describing the finding."),
    ],
    per_step=False,
)

TABLES: dict[str, TableSpec] = {
    t.name: t
    for t in (STEPS, BATCH_ROWS, LAUNCHES, BLOCK_TABLES, ROW_MOVES, SCHED, REQUESTS, FINDINGS)
}


def table_spec(name: str) -> TableSpec:
    try:
        return TABLES[name]
    except KeyError:
        from mgtrace.errors import UsageError

        raise UsageError(
            f"unknown table {name!r}; the trace tables are {', '.join(TABLES)}"
        ) from None
