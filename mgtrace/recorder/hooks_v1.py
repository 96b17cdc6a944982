"""Hooks for vLLM's V1 GPU model runner, where the batch row is the persistent InputBatch row.

What each hook keeps (all host-side copies; the device is never read here):
- ``execute_model`` entry: opens the step; keeps the scheduler output by reference.
- ``_update_states``: whether the previous step's accepted-count copy had landed (an event
  query, which does not wait) and, on exit, the batch after condense and reorder.
- ``swap_states`` / ``condense`` / ``add_request`` / ``remove_request``: row moves with the
  accepted counts they carried.
- the module-level reorder function: the threshold the runner actually passed.
- ``preprocess_mamba``: accepted counts and computed counts as the precopy consumed them, the
  running columns before and after.
- ``stage_postprocess_inputs_to_gpu``: the CPU-staged post-process inputs.
- ``collect_mamba_copy_meta``: without a speculative config vLLM builds no align context and
  ``preprocess_mamba`` hands each state copy to this function (then one ``batch_memcpy``); its
  arguments are the copy's whole input, host values, and the assembler writes them as the
  precopy launch the fused path would have run.
"""

from __future__ import annotations

from typing import Any

from mgtrace.recorder.features import Target, owner_of
from mgtrace.recorder.hooks_common import (
    arg,
    hook,
    launcher_patches,
    optional_patches,
    runner_step_patches,
    staged_inputs,
)
from mgtrace.recorder.patches import Patch
from mgtrace.recorder.session import Session
from mgtrace.recorder.wire import raw


def _begin(sess: Session, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
    sess.begin_step(arg(args, kwargs, 1, "scheduler_output"))


def _landed(sess: Session, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
    rec = sess.rec
    if rec is None:
        return
    event = getattr(args[0], "num_accepted_tokens_event", None)
    rec["landed"] = None if event is None else bool(event.query())


def _batch_after_update(groups: list[int]) -> Any:
    def after(
        sess: Session, _t: Any, _r: Any, args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> None:
        rec = sess.rec
        if rec is None:
            return
        runner = args[0]
        ib = runner.input_batch
        n = ib.num_reqs
        rec["req_ids"] = ib._req_ids[:n]
        rec["computed"] = raw(ib.num_computed_tokens_cpu[:n])
        rec["prompt"] = raw(ib.num_prompt_tokens[:n])
        rec.setdefault("threshold", runner.reorder_batch_threshold)
        if groups and n:
            tables = []
            for local, gid in enumerate(groups):
                bt = ib.block_table[gid]
                counts = bt.num_blocks_per_row[:n]
                width = int(counts[counts.argmax()])  # argmax costs a fifth of max()
                tables.append((local, raw(bt.block_table.np[:n, :width]), raw(counts)))
            rec["bt"] = tables

    return after


def _reorder(sess: Session, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
    if sess.rec is not None:
        sess.rec["threshold"] = arg(args, kwargs, 2, "decode_threshold", 1)


def _swap(sess: Session, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
    rec = sess.rec
    if rec is None:
        return
    if len(args) == 3:  # how vLLM calls it
        ib, i1, i2 = args
    else:
        ib, i1, i2 = args[0], arg(args, kwargs, 1, "i1"), arg(args, kwargs, 2, "i2")
    acc = ib.num_accepted_tokens_cpu
    rec["moves"].append(
        ("swap", i1, i2, ib._req_ids[i1], ib._req_ids[i2], int(acc[i1]), int(acc[i2]))
    )


def _condense_before(sess: Session, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    ib = args[0]
    ids = ib._req_ids
    # Condense only fills holes below the last live row. When every row past the first
    # num_reqs is empty, the live rows are exactly those and there is no hole: nothing is
    # copied (most steps). Only that short tail is scanned: ``None in`` a list of strings
    # costs a rich comparison per element.
    tail = ids[len(ib.req_id_to_index) :]
    if tail.count(None) == len(tail):
        return None
    ids = list(ids)
    return ids, raw(ib.num_accepted_tokens_cpu[: len(ids)])


def _condense_after(
    sess: Session, token: Any, _r: Any, args: tuple[Any, ...], kwargs: dict[str, Any]
) -> None:
    if sess.rec is None or token is None:
        return
    before, acc = token
    after = list(args[0]._req_ids)
    if after != before:  # a condense that moved nothing adds no row_moves rows
        sess.rec["moves"].append(("condense", before, after, acc))


def _add_after(
    sess: Session, _t: Any, _r: Any, args: tuple[Any, ...], kwargs: dict[str, Any]
) -> None:
    if sess.rec is None:
        return
    ib = args[0]
    req_id = arg(args, kwargs, 1, "request").req_id
    row = ib.req_id_to_index.get(req_id)
    sess.rec["moves"].append(("add", row, None, req_id, None, None, None))


def _remove_after(
    sess: Session, _t: Any, row: Any, args: tuple[Any, ...], kwargs: dict[str, Any]
) -> None:
    if sess.rec is None or row is None:
        return
    ib = args[0]
    req_id = arg(args, kwargs, 1, "req_id")
    sess.rec["moves"].append(
        ("remove", row, None, req_id, None, int(ib.num_accepted_tokens_cpu[row]), None)
    )


def _pre_before(sess: Session, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    rec = sess.rec
    if rec is None:
        return None
    if len(args) > 4:  # how vLLM passes them
        state_idx, ib = args[3], args[4]
    else:
        state_idx = arg(args, kwargs, 3, "mamba_state_idx")
        ib = arg(args, kwargs, 4, "input_batch")
    n = len(ib.req_ids)
    rec["acc_prev"] = raw(ib.num_accepted_tokens_cpu[:n])
    rec["computed_pre"] = raw(ib.num_computed_tokens_cpu[:n])
    rec["sidx_before"] = dict(state_idx)
    if arg(args, kwargs, 9, "align_ctx") is None:
        rec["scalar_copies"] = []  # this step copies through collect_mamba_copy_meta
    return state_idx


def _pre_after(
    sess: Session, state_idx: Any, _r: Any, args: tuple[Any, ...], kwargs: dict[str, Any]
) -> None:
    if sess.rec is not None and state_idx is not None:
        sess.rec["sidx_after"] = dict(state_idx)


def _scalar_copy(sess: Session, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
    rec = sess.rec
    if rec is None:
        return
    copies = rec.get("scalar_copies")
    if copies is None:  # called outside preprocess_mamba's scalar path: not a step's copy
        return
    copies.append(
        (
            arg(args, kwargs, 7, "req_state").req_id,
            int(arg(args, kwargs, 4, "src_block_idx")),
            int(arg(args, kwargs, 5, "dest_block_idx")),
            int(arg(args, kwargs, 6, "accept_token_bias")),
        )
    )


def _staged(sess: Session, _t: Any, _r: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
    if sess.rec is None:
        return
    ctx = arg(args, kwargs, 0, "ctx")
    sess.rec["staged"] = staged_inputs(ctx, int(arg(args, kwargs, 3, "num_reqs")))


def v1_patches(sess: Session, owners: dict[Target, Any], mamba_groups: list[int]) -> list[Patch]:
    runner = owner_of(owners, "GPUModelRunner", "execute_model")
    runner_mod = owner_of(owners, None, "reorder_batch_to_split_decodes_and_prefills")
    ib = owner_of(owners, "InputBatch", "swap_states")
    mu = owner_of(owners, None, "preprocess_mamba")
    patches = [
        *runner_step_patches(sess, runner, _begin),
        Patch(
            runner,
            "_update_states",
            hook(sess, "_update_states", before=_landed, after=_batch_after_update(mamba_groups)),
        ),
        Patch(
            runner_mod,
            "reorder_batch_to_split_decodes_and_prefills",
            hook(sess, "reorder", before=_reorder),
        ),
        Patch(ib, "swap_states", hook(sess, "swap_states", before=_swap)),
        Patch(
            ib, "condense", hook(sess, "condense", before=_condense_before, after=_condense_after)
        ),
        Patch(ib, "add_request", hook(sess, "add_request", after=_add_after)),
        Patch(ib, "remove_request", hook(sess, "remove_request", after=_remove_after)),
        Patch(
            mu,
            "preprocess_mamba",
            hook(sess, "preprocess_mamba", before=_pre_before, after=_pre_after),
        ),
        Patch(
            mu,
            "stage_postprocess_inputs_to_gpu",
            hook(sess, "stage_postprocess_inputs_to_gpu", after=_staged),
        ),
        *launcher_patches(
            sess,
            owner_of(owners, "MambaSpecDecodeGPUContext", "run_fused_precopy"),
            "run_fused_postprocess",
        ),
    ]
    scalar = owner_of(owners, None, "collect_mamba_copy_meta")
    if scalar is not None:
        patches.append(
            Patch(scalar, "collect_mamba_copy_meta", hook(sess, "scalar_copy", before=_scalar_copy))
        )
    patches += optional_patches(sess, owners)
    return patches
