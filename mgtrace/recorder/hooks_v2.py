"""Hooks for vLLM's V2 GPU model runner: request slots and a per-step idx_mapping.

V2 keeps per-request values in slot-indexed device vectors, so the batch rows of a step are
assembled from the CPU mirrors ``prepare_inputs`` returns plus stream-ordered captures of
the slot vectors at ``preprocess_state`` (accepted counts and running columns as the step
consumed them). Under pipeline parallelism a non-last rank runs step T's post-process
``pp_size`` steps later; the PPHandler hooks remember which step pushed each pending
receive, so that launch is recorded with ``batch_step`` T.

Block tables: ``BlockTables.append_block_ids`` keeps each write's slot, the Mamba groups'
new block ids and the column it starts at; ``gather_block_tables`` and
``get_dummy_block_tables`` keep how many input rows the gather runs over and how many a
dummy run zeroed. All of it is CPU values; the assembler rebuilds both table sets
(``v2_tables``).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from mgtrace.recorder.features import Target, owner_of
from mgtrace.recorder.hooks_common import (
    arg,
    hook,
    launcher_patches,
    optional_patches,
    runner_step_patches,
)
from mgtrace.recorder.patches import Patch
from mgtrace.recorder.session import Session
from mgtrace.recorder.v2_tables import Gather
from mgtrace.recorder.wire import raw


def _begin(sess: Session, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
    if arg(args, kwargs, 3, "dummy_run") is True:
        # warm-up and DP padding batches are not engine steps: close the open step and
        # record nothing until the next real one
        sess.end_step()
        return
    sess.begin_step(arg(args, kwargs, 1, "scheduler_output"))


def _copy(value: Any, n: int) -> Any:
    return None if value is None else raw(value[:n])


def _inputs_after(
    sess: Session, _t: Any, ib: Any, args: tuple[Any, ...], kwargs: dict[str, Any]
) -> None:
    rec = sess.rec
    if rec is None or ib is None:
        return
    n = ib.num_reqs
    rec["req_ids"] = list(ib.req_ids[:n])
    rec["idx"] = raw(ib.idx_mapping_np[:n])
    rec["computed"] = raw(ib.num_computed_tokens_np[:n])
    rec["scheduled"] = raw(ib.num_scheduled_tokens[:n])
    rec["draft"] = _copy(ib.num_draft_tokens_per_req, n)
    rec["prefilling"] = raw(ib.is_prefilling_np[:n])
    rec["prompt"] = raw(ib.prefill_len_np[:n])


# the slot vectors ``preprocess_state`` reads, in capture order (tuples: no list per step)
_PRE_NAMES = ("idx_mapping", "num_accepted", "state_idx")
_PRE_NAMES_COMPUTED = (*_PRE_NAMES, "num_computed")


def _pre_state(sess: Session, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
    """Before ``preprocess_state``: the slot vectors its kernels read, stream-ordered. The
    computed counts among them are the device's (``req_states.num_computed_tokens``), the
    ones the advance kernel reads: under async scheduling the batch's CPU mirror is the
    scheduler's optimistic count, which still holds the previous step's rejected drafts."""
    state = args[0]
    ib = arg(args, kwargs, 1, "input_batch")
    if sess.rec is None or not getattr(state, "_align_mode", False) or ib.num_reqs == 0:
        return
    n = ib.num_reqs
    acc, sidx = state.num_accepted_tokens_gpu, state._mamba_state_idx_gpu
    tensors: tuple[Any, ...] = (ib.idx_mapping, acc, sidx)
    lengths: tuple[int, ...] = (n, acc.shape[0], sidx.shape[0])
    names = _PRE_NAMES
    computed = arg(args, kwargs, 4, "num_computed_tokens")
    if computed is not None:
        tensors = (*tensors, computed)
        lengths = (*lengths, computed.shape[0])
        names = _PRE_NAMES_COMPUTED
    sess.grab(
        tensors,
        lengths,
        {
            "step": sess.step,
            "kernel": "v2_pre",
            "batch_step": sess.step,
            "n": n,
            "names": names,
        },
    )


def _post_state_after(
    sess: Session, _t: Any, _r: Any, args: tuple[Any, ...], kwargs: dict[str, Any]
) -> None:
    sess.deferred_batch_step = None


class _PPHooks:
    """Which step pushed each pending receive of a non-last PP rank's FIFO.

    vLLM's ``PPHandler.queue`` holds one entry per in-flight step, oldest first: every step
    pops the oldest (``get_prev_sampled_outputs``, the first thing a real step does) and
    appends a slot that its own ``receive`` fills. The first time a recording sees a
    handler, the entries already queued were pushed before the recording began: entry ``i``
    of ``n`` by step ``step - n + i``, a negative step, which the trace has no batch of (as a
    trimmed trace's deferred batches sit at negative steps). Each later ``receive`` tags
    only the slot it filled, ``queue[-1]``."""

    def __init__(self) -> None:
        self.seen: set[int] = set()

    def first_sight(self, sess: Session, handler: Any) -> None:
        if id(handler) in self.seen:
            return
        self.seen.add(id(handler))
        queue = handler.queue
        for i, entry in enumerate(queue):
            if entry is not None:
                sess.pp_origin[id(entry)] = sess.step - len(queue) + i

    def prev_before(self, sess: Session, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        self.first_sight(sess, args[0])
        queue = args[0].queue
        slot = queue[0] if queue else None
        sess.deferred_batch_step = None if slot is None else sess.pp_origin.pop(id(slot), None)

    def receive_after(
        self, sess: Session, _t: Any, _r: Any, args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> None:
        handler = args[0]
        queue = handler.queue
        if id(handler) not in self.seen:
            # no pop seen this step (not expected of vLLM): the slot just filled is this
            # step's, the ones before it older
            self.seen.add(id(handler))
            for i, entry in enumerate(queue):
                if entry is not None:
                    sess.pp_origin[id(entry)] = sess.step - len(queue) + 1 + i
        elif queue and queue[-1] is not None:
            sess.pp_origin[id(queue[-1])] = sess.step


def _append_blocks(groups: Sequence[int] | None) -> Any:
    """Before ``append_block_ids``: the Mamba groups' writes, with the column each starts at
    (``num_blocks`` is read before the call advances it)."""

    def before(sess: Session, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        rec = sess.rec
        if rec is None:
            return
        tables = args[0]
        slot = int(arg(args, kwargs, 1, "req_index"))
        new_ids = arg(args, kwargs, 2, "new_block_ids")
        overwrite = bool(arg(args, kwargs, 3, "overwrite"))
        to_null = bool(getattr(tables, "redirect_writes_to_null_block", False))
        num_blocks = tables.num_blocks.np
        writes = []
        for local, gid in enumerate(range(len(new_ids)) if groups is None else groups):
            ids = new_ids[gid]
            start = 0 if overwrite else int(num_blocks[gid, slot])
            writes.append((local, start, [0] * len(ids) if to_null else list(ids)))
        rec.setdefault("bt_writes", []).append((slot, overwrite, writes))

    return before


class _GatherHooks:
    """What decides a gather beyond the batch: the rows it zeroes, the rows a dummy run
    zeroed before it (dummy runs are not steps: no record is open, so the count waits here),
    and, at the first gather of a recording, every slot's ``num_blocks`` of the Mamba groups
    (a CPU array), which tells the assembler which rows were filled before recording."""

    def __init__(self, groups: Sequence[int] | None) -> None:
        self.groups = None if groups is None else list(groups)
        self.rows = 0
        self.counts_sent = False

    def dummy(self, sess: Session, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        num_reqs = int(arg(args, kwargs, 1, "num_reqs"))
        dirty = int(getattr(args[0], "_num_dirty_rows", 0))
        self.rows = max(self.rows, num_reqs, dirty)

    def gather(self, sess: Session, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        rec = sess.rec
        if rec is None or arg(args, kwargs, 3, "out") is not None:
            return  # a caller's own buffers are not the input tables
        num_reqs = int(arg(args, kwargs, 1, "idx_mapping").shape[0])  # metadata: no sync
        padded = int(arg(args, kwargs, 2, "num_reqs_padded"))
        dirty = int(getattr(args[0], "_num_dirty_rows", 0))
        rec["gather"] = Gather(num_reqs, max(padded, dirty), self.rows)
        self.rows = 0
        if sess.table_ptrs is None:
            sess.table_ptrs = self.table_ptrs(args[0])
        if not self.counts_sent:
            counts = args[0].num_blocks.np
            rec["bt_counts"] = raw(counts if self.groups is None else counts[self.groups])
            self.counts_sent = True

    def table_ptrs(self, tables: Any) -> dict[str, list[int]]:
        """Where the Mamba groups' source and input tables live (tensor metadata, no
        device access)."""
        gids = range(len(tables.block_tables)) if self.groups is None else self.groups
        return {
            "source": [tables.block_tables[g].gpu.data_ptr() for g in gids],
            "input": [tables.input_block_tables[g].data_ptr() for g in gids],
        }


def _table_patches(sess: Session, owner: Any, groups: Sequence[int] | None) -> list[Patch]:
    clears = _GatherHooks(groups)
    patches = [
        Patch(
            owner, "append_block_ids", hook(sess, "append_block_ids", before=_append_blocks(groups))
        )
    ]
    optional = {"gather_block_tables": clears.gather, "get_dummy_block_tables": clears.dummy}
    for name, before in optional.items():
        if callable(getattr(owner, name, None)):
            patches.append(Patch(owner, name, hook(sess, name, before=before)))
    return patches


def v2_patches(
    sess: Session, owners: dict[Target, Any], mamba_groups: Sequence[int] | None = None
) -> list[Patch]:
    """The V2 hook set; ``mamba_groups`` are the KV-cache group ids whose block tables are
    recorded (None: every group, in order)."""
    runner = owner_of(owners, "GPUModelRunner", "execute_model")
    state = owner_of(owners, "MambaHybridModelState", "preprocess_state")
    pp = owner_of(owners, "PPHandler", "receive")
    pp_hooks = _PPHooks()
    patches = [
        *runner_step_patches(sess, runner, _begin),
        Patch(runner, "prepare_inputs", hook(sess, "prepare_inputs", after=_inputs_after)),
        Patch(state, "preprocess_state", hook(sess, "preprocess_state", before=_pre_state)),
        Patch(
            state,
            "postprocess_state",
            hook(sess, "postprocess_state", after=_post_state_after),
        ),
        Patch(pp, "receive", hook(sess, "pp_receive", after=pp_hooks.receive_after)),
        Patch(
            pp, "get_prev_sampled_outputs", hook(sess, "pp_get_prev", before=pp_hooks.prev_before)
        ),
        *launcher_patches(
            sess,
            owner_of(owners, "MambaSpecDecodeGPUContext", "run_fused_precopy"),
            "run_fused_postprocess_align",
        ),
        *_table_patches(sess, owner_of(owners, "BlockTables", "append_block_ids"), mamba_groups),
    ]
    patches += optional_patches(sess, owners)
    return patches
