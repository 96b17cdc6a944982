"""Hooks for vLLM's V2 GPU model runner: request slots and a per-step idx_mapping.

V2 keeps per-request values in slot-indexed device vectors, so the batch rows of a step are
assembled from the CPU mirrors ``prepare_inputs`` returns plus stream-ordered captures of
the slot vectors at ``preprocess_state`` (accepted counts and running columns as the step
consumed them). Under pipeline parallelism a non-last rank runs step T's post-process
``pp_size`` steps later; the PPHandler hooks remember which step pushed each pending
receive, so that launch is recorded with ``batch_step`` T.
"""

from __future__ import annotations

from typing import Any

from mgtrace.recorder.features import Target, owner_of
from mgtrace.recorder.hooks_common import arg, hook, launcher_patches, split_patch
from mgtrace.recorder.patches import Patch
from mgtrace.recorder.session import Session


def _begin(sess: Session, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
    if kwargs.get("dummy_run") or (len(args) > 3 and args[3] is True):
        # warm-up and DP padding batches are not engine steps: close the open step and
        # record nothing until the next real one
        sess.end_step()
        return
    sess.begin_step(arg(args, kwargs, 1, "scheduler_output"))


def _copy(value: Any, n: int) -> Any:
    return None if value is None else value[:n].copy()


def _inputs_after(
    sess: Session, _t: Any, ib: Any, args: tuple[Any, ...], kwargs: dict[str, Any]
) -> None:
    rec = sess.rec
    if rec is None or ib is None:
        return
    n = ib.num_reqs
    rec["req_ids"] = list(ib.req_ids[:n])
    rec["idx"] = ib.idx_mapping_np[:n].copy()
    rec["computed"] = ib.num_computed_tokens_np[:n].copy()
    rec["scheduled"] = ib.num_scheduled_tokens[:n].copy()
    rec["draft"] = _copy(ib.num_draft_tokens_per_req, n)
    rec["prefilling"] = ib.is_prefilling_np[:n].copy()
    rec["prompt"] = ib.prefill_len_np[:n].copy()


def _pre_state(sess: Session, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
    state = args[0]
    ib = arg(args, kwargs, 1, "input_batch")
    if sess.rec is None or not getattr(state, "_align_mode", False) or ib.num_reqs == 0:
        return
    n = ib.num_reqs
    acc, sidx = state.num_accepted_tokens_gpu, state._mamba_state_idx_gpu
    sess.grab(
        [ib.idx_mapping, acc, sidx],
        [n, acc.shape[0], sidx.shape[0]],
        {
            "step": sess.step,
            "kernel": "v2_pre",
            "batch_step": sess.step,
            "n": n,
            "names": ["idx_mapping", "num_accepted", "state_idx"],
        },
    )


def _post_state_before(sess: Session, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
    if sess.rec is not None:
        bs = sess.deferred_batch_step
        sess.rec["post_step"] = sess.step if bs is None else bs


def _post_state_after(
    sess: Session, _t: Any, _r: Any, args: tuple[Any, ...], kwargs: dict[str, Any]
) -> None:
    sess.deferred_batch_step = None


def _receive_after(
    sess: Session, _t: Any, _r: Any, args: tuple[Any, ...], kwargs: dict[str, Any]
) -> None:
    for entry in args[0].queue:
        if entry is not None and id(entry) not in sess.pp_origin:
            sess.pp_origin[id(entry)] = sess.step


def _prev_before(sess: Session, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
    queue = args[0].queue
    slot = queue[0] if queue else None
    sess.deferred_batch_step = None if slot is None else sess.pp_origin.pop(id(slot), None)


def v2_patches(sess: Session, owners: dict[Target, Any]) -> list[Patch]:
    runner = owner_of(owners, "GPUModelRunner", "execute_model")
    state = owner_of(owners, "MambaHybridModelState", "preprocess_state")
    pp = owner_of(owners, "PPHandler", "receive")
    patches = [
        Patch(runner, "execute_model", hook(sess, "execute_model", before=_begin)),
        Patch(runner, "prepare_inputs", hook(sess, "prepare_inputs", after=_inputs_after)),
        Patch(state, "preprocess_state", hook(sess, "preprocess_state", before=_pre_state)),
        Patch(
            state,
            "postprocess_state",
            hook(sess, "postprocess_state", before=_post_state_before, after=_post_state_after),
        ),
        Patch(pp, "receive", hook(sess, "pp_receive", after=_receive_after)),
        Patch(pp, "get_prev_sampled_outputs", hook(sess, "pp_get_prev", before=_prev_before)),
        *launcher_patches(sess, owner_of(owners, "MambaSpecDecodeGPUContext", "run_fused_precopy")),
    ]
    builder = owner_of(owners, "BaseMambaAttentionMetadataBuilder", "_compute_common_metadata")
    if builder is not None:
        patches.append(split_patch(sess, builder))
    return patches
