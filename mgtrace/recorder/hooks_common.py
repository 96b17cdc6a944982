"""Wrapper construction shared by all hooks, and the align-kernel launcher hooks.

A wrapper calls the original exactly once with the original arguments, whatever its own code
does: the recording code runs inside ``try`` and a failure is counted on the session, never
raised. When the session is not live, a wrapper is a plain pass-through.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from typing import Any

from mgtrace.recorder.assemble import BOUND_PTRS
from mgtrace.recorder.features import (
    POSTPROCESS_ALIGN_PARAMS,
    POSTPROCESS_PARAMS,
    PRECOPY_PARAMS,
    Target,
    owner_of,
)
from mgtrace.recorder.patches import Patch
from mgtrace.recorder.session import Session
from mgtrace.recorder.wire import raw

Before = Callable[[Session, tuple[Any, ...], dict[str, Any]], Any]
After = Callable[[Session, Any, Any, tuple[Any, ...], dict[str, Any]], None]

_FAILED = object()


def hook(
    sess: Session,
    name: str,
    before: Before | None = None,
    after: After | None = None,
    *,
    required: bool = True,
) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """A ``Patch.make`` that runs ``before(sess, args, kwargs)`` and/or
    ``after(sess, token, result, args, kwargs)`` around the original. A ``required`` hook
    that fails drops its step (the step would replay without what it records); an optional
    one only leaves its column empty, as a vLLM without its target does."""

    def make(orig: Callable[..., Any]) -> Callable[..., Any]:
        # one wrapper shape per hook kind: the fewest checks on the engine's hot path
        if after is None and before is not None:

            def wrapper(*args: Any, **kwargs: Any) -> Any:
                if sess.live:
                    try:
                        before(sess, args, kwargs)
                    except Exception as exc:
                        sess.hook_failed(name, exc, drop_step=required)
                return orig(*args, **kwargs)

        elif before is None and after is not None:

            def wrapper(*args: Any, **kwargs: Any) -> Any:
                result = orig(*args, **kwargs)
                if sess.live:
                    try:
                        after(sess, None, result, args, kwargs)
                    except Exception as exc:
                        sess.hook_failed(name, exc, drop_step=required)
                return result

        else:

            def wrapper(*args: Any, **kwargs: Any) -> Any:
                if not sess.live:
                    return orig(*args, **kwargs)
                token = None
                if before is not None:
                    try:
                        token = before(sess, args, kwargs)
                    except Exception as exc:
                        sess.hook_failed(name, exc, drop_step=required)
                        token = _FAILED
                result = orig(*args, **kwargs)
                if after is not None and token is not _FAILED and sess.live:
                    try:
                        after(sess, token, result, args, kwargs)
                    except Exception as exc:
                        sess.hook_failed(name, exc, drop_step=required)
                return result

        functools.update_wrapper(wrapper, orig)
        return wrapper

    return make


def _ends_step(result: Any) -> bool:
    """Whether execute_model's return ends the step: an output does; None (sample_tokens
    follows) and a pipeline stage's IntermediateTensors (its sample_tokens still runs the
    receive and the post-process) do not."""
    return result is not None and type(result).__name__ != "IntermediateTensors"


def _execute_hook(sess: Session, begin: Before) -> Callable[[Callable[..., Any]], Any]:
    """execute_model: opens the step, and ends it where the return says so, or when the
    original raises (no step runs on after that: a stop must not wait for it)."""

    def make(orig: Callable[..., Any]) -> Callable[..., Any]:
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            if not sess.live:
                return orig(*args, **kwargs)
            try:
                begin(sess, args, kwargs)
            except Exception as exc:
                sess.hook_failed("execute_model", exc)
            try:
                result = orig(*args, **kwargs)
            except BaseException:
                sess.step_done()
                raise
            if _ends_step(result):
                sess.step_done()
            return result

        functools.update_wrapper(wrapper, orig)
        return wrapper

    return make


def _sampled(
    sess: Session, _t: Any, _r: Any, args: tuple[Any, ...], kwargs: dict[str, Any]
) -> None:
    sess.step_done()


def runner_step_patches(sess: Session, runner: Any, begin: Before) -> list[Patch]:
    """``execute_model`` opens a step (``begin``) and, when it returns an output, ends it;
    otherwise ``sample_tokens``, where the runner has it, ends it. A stop that finds a
    step running waits for its end rather than record half of it."""
    sess.step_ends_observed = True
    patches = [Patch(runner, "execute_model", _execute_hook(sess, begin))]
    if callable(getattr(runner, "sample_tokens", None)):
        patches.append(Patch(runner, "sample_tokens", hook(sess, "sample_tokens", after=_sampled)))
    return patches


def arg(
    args: tuple[Any, ...], kwargs: dict[str, Any], index: int, name: str, default: Any = None
) -> Any:
    """A call argument by position (counting self) or keyword."""
    if len(args) > index:
        return args[index]
    return kwargs.get(name, default)


def call_args(
    args: tuple[Any, ...], kwargs: dict[str, Any], names: tuple[str, ...]
) -> Sequence[Any]:
    """Arguments after self, by name, however the caller passed them (one fast path each
    for all-positional and all-keyword calls, which is how vLLM calls the launchers)."""
    if not kwargs:
        if len(args) == len(names) + 1:
            return args[1:]
        got = list(args[1:])
        return got + [None] * (len(names) - len(got))
    if len(args) == 1:
        return [kwargs.get(n) for n in names]
    return [arg(args, kwargs, i + 1, n) for i, n in enumerate(names)]


def has_two_tables(ctx: Any) -> bool:
    name = "aligned_index_block_table_ptrs"
    cls = ctx if isinstance(ctx, type) else type(ctx)
    return hasattr(ctx, name) or name in getattr(cls, "__annotations__", {})


_V1_BINDING = ("req_slot", "v1")


def binding(ctx: Any, kind: str) -> tuple[str, str]:
    """(row rule, bound table) of an align context, from what the context carries.

    A context with a separate table set for the aligned indices binds the per-slot source
    tables for its copies and indexes them by request slot; one without it binds one table
    list that V2 fills with the gathered, batch-ordered tables."""
    two_tables = has_two_tables(ctx)
    if kind == "v1":
        return _V1_BINDING
    return ("req_slot", "source") if two_tables else ("batch_row", "input")


_BINDINGS: dict[tuple[int, str], tuple[Any, tuple[str, str]]] = {}
# the last context looked up, its kind and binding (held, like the cache's entries)
_LAST_BINDING: list[tuple[Any, str, tuple[str, str]]] = [(None, "", _V1_BINDING)]


def _binding_of(ctx: Any, kind: str) -> tuple[str, str]:
    """``binding`` once per (initialized) context object: it reads class annotations. The
    cache holds the context, so its id is not reused while cached."""
    last = _LAST_BINDING[0]
    if last[0] is ctx and last[1] == kind:  # one context serves every launch of a run
        return last[2]
    key = (id(ctx), kind)
    hit = _BINDINGS.get(key)
    if hit is not None and hit[0] is ctx:
        _LAST_BINDING[0] = (ctx, kind, hit[1])
        return hit[1]
    if len(_BINDINGS) >= 16:
        _BINDINGS.clear()
    found = binding(ctx, kind)
    _BINDINGS[key] = (ctx, found)
    _LAST_BINDING[0] = (ctx, kind, found)
    return found


def _grab_bound_ptrs(sess: Session, ctx: Any) -> None:
    """Once per align context of a V2 recording: capture the table pointers its copy
    kernels were bound to (a device vector, copied on the stream like the launch inputs),
    for the assembler to name the bound table by the tables' data_ptrs."""
    if sess.table_ptrs is None or id(ctx) in sess.ptrs_grabbed:
        return
    ptrs = getattr(ctx, "block_table_ptrs", None)
    if ptrs is None:
        return
    import torch

    sess.ptrs_grabbed.add(id(ctx))
    words = ptrs.view(torch.int32)  # int64 pointers as int32 pairs: the ring's element type
    tag = {
        "step": sess.step,
        "kernel": BOUND_PTRS,
        "batch_step": sess.step,
        "n": 0,
        "names": ["ptrs"],
        "tables": sess.table_ptrs,
    }
    sess.grab((words,), (words.shape[0],), tag)


def _tag(
    sess: Session,
    ctx: Any,
    kernel: str,
    n: int,
    names: tuple[str, ...],
    mode: str | None = None,
    cpu: dict[str, Any] | None = None,
    batch_step: int | None = None,
) -> dict[str, Any]:
    if sess.kind == "v1":
        rule, table = _V1_BINDING  # what ``binding`` says of every V1 context
    else:
        rule, table = _binding_of(ctx, sess.kind)
        _grab_bound_ptrs(sess, ctx)
    return {
        "step": sess.step,
        "kernel": kernel,
        "batch_step": sess.step if batch_step is None else batch_step,
        "bt_step": sess.step,
        "row_rule": rule,
        "bt_table": table,
        "mode": mode,
        "n": n,
        "names": names,
        "cpu": cpu,
    }


class _StagedViews:
    """Per row count: the context and, per buffer, (name, attribute, the buffer, a view of
    its first n values, whether that view travels as its bytes alone). One per buffer set,
    so that a look-up is one int key (a tuple key costs its hashing on every launch); the
    context and its buffers are compared by identity. Bounded for contexts made anew."""

    __slots__ = ("bufs", "by_rows")

    def __init__(self, bufs: tuple[tuple[str, str], ...]) -> None:
        self.bufs = bufs
        self.by_rows: dict[int, tuple[Any, tuple[tuple[Any, ...], ...]]] = {}

    def read(self, ctx: Any, n: int) -> dict[str, Any]:
        """The CPU-staged side of a launch's inputs, raw, for the buffers the context has.
        A slice and a conversion check per buffer cost the engine thread more than the
        copy, hence the cached views; a context whose buffer was replaced gets new ones."""
        hit = self.by_rows.get(n)
        if hit is not None and hit[0] is ctx:
            out = {}
            for name, attr, buf, view, as_bytes in hit[1]:
                if getattr(ctx, attr) is not buf:
                    break
                out[name] = view.tobytes() if as_bytes else raw(view)
            else:
                return out
        return self._read_anew(ctx, n)

    def _read_anew(self, ctx: Any, n: int) -> dict[str, Any]:
        if len(self.by_rows) >= 64:
            self.by_rows.clear()
        out, entries = {}, []
        for name, attr in self.bufs:
            buf = getattr(ctx, attr)
            if buf is None:
                continue
            view = buf.np[:n]
            out[name] = raw(view)
            entries.append((name, attr, buf, view, isinstance(out[name], bytes)))
        self.by_rows[n] = (ctx, tuple(entries))
        return out


_PRECOPY_CPU = (
    ("state_idx", "mamba_state_idx_buf"),
    ("src_col", "precopy_src_col_buf"),
    ("token_bias", "precopy_token_bias_buf"),
)
_POST_CPU = (
    ("state_idx", "mamba_state_idx_buf"),
    ("num_scheduled", "num_scheduled_tokens_buf"),
    ("num_computed", "num_computed_tokens_buf"),
    ("num_draft", "num_draft_tokens_buf"),
)


_PRECOPY_STAGED = _StagedViews(_PRECOPY_CPU)
_POST_STAGED = _StagedViews(_POST_CPU)


def staged_inputs(ctx: Any, n: int) -> dict[str, Any]:
    """The post-process inputs the runner staged on the CPU for ``n`` requests, raw."""
    return _POST_STAGED.read(ctx, n)


# the vectors each launch kind captures, in order (tuples: no list built per launch)
_PRECOPY_NAMES = ("state_idx", "src_col", "token_bias")
_PRECOPY_NAMES_V2 = ("idx_mapping", *_PRECOPY_NAMES)
_POSTPROCESS_NAMES = ("num_accepted", "state_idx", "num_scheduled", "num_computed", "num_draft")
_POSTPROCESS_ALIGN_NAMES = ("idx_mapping", "num_accepted", "state_idx", "num_computed")


def _precopy(sess: Session, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
    ctx = args[0]
    n, sidx, src, bias, idx = call_args(args, kwargs, PRECOPY_PARAMS)
    if n == 0 or not ctx.is_initialized or sess.rec is None:
        return
    if idx is None:  # V1: staged in batch order, read as [:n]
        sess.grab(
            (sidx, src, bias),
            (n, n, n),
            _tag(sess, ctx, "precopy", n, _PRECOPY_NAMES, cpu=_PRECOPY_STAGED.read(ctx, n)),
        )
    else:  # V2: slot-indexed vectors read through idx_mapping
        whole = sidx.shape[0]
        sess.grab(
            (idx, sidx, src, bias),
            (n, whole, whole, whole),
            _tag(sess, ctx, "precopy", n, _PRECOPY_NAMES_V2),
        )


def _postprocess(sess: Session, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
    ctx = args[0]
    n, *tensors = call_args(args, kwargs, POSTPROCESS_PARAMS)
    rec = sess.rec
    if n == 0 or not ctx.is_initialized or rec is None:
        return
    staged = rec.get("staged")  # what the staging hook read: as the launch's tag, not copied
    if staged is None:
        staged = staged_inputs(ctx, n)
    rec["post_step"] = sess.step  # steps.postprocess_step: only where a post-process launched
    sess.grab(
        tensors,
        (n, n, n, n, n),
        _tag(sess, ctx, "postprocess", n, _POSTPROCESS_NAMES, mode="decision", cpu=staged),
    )


def _postprocess_align(sess: Session, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
    ctx = args[0]
    n, acc, sidx, comp, idx = call_args(args, kwargs, POSTPROCESS_ALIGN_PARAMS)
    rec = sess.rec
    if n == 0 or not ctx.is_initialized or rec is None:
        return
    batch_step = sess.deferred_batch_step
    # steps.postprocess_step: the batch this launch processed, only where one launched
    rec["post_step"] = sess.step if batch_step is None else batch_step
    sess.grab(
        (idx, acc, sidx, comp),
        (n, acc.shape[0], sidx.shape[0], comp.shape[0]),
        _tag(
            sess,
            ctx,
            "postprocess",
            n,
            _POSTPROCESS_ALIGN_NAMES,
            mode="precomputed",
            batch_step=batch_step,
        ),
    )


def _mamba_split(
    sess: Session, _token: Any, result: Any, args: tuple[Any, ...], kwargs: dict[str, Any]
) -> None:
    rec = sess.rec
    if rec is None or "mamba" in rec:
        return
    builder = args[0]
    spec = kwargs.get("num_accepted_tokens") is not None
    threshold = getattr(builder, "reorder_batch_threshold", None) if spec else 1
    rec["mamba"] = (int(result.num_decodes), threshold, None)


def _gdn_split(
    sess: Session, _token: Any, result: Any, args: tuple[Any, ...], kwargs: dict[str, Any]
) -> None:
    """GDN's split: with spec decode, the rows its mask marks run the spec-decode kernels
    and every other row the prefill ones (plain decodes are folded into the prefills);
    without, the first ``num_decodes`` rows decode. The mask is a host tensor. It travels
    raw (a copy: the builder may reuse its buffer) and the assembler counts it: an array
    object here cost the engine thread about 30 µs a step (``bench_recorder --builder gdn``)."""
    rec = sess.rec
    if rec is None or "mamba" in rec:
        return
    mask = getattr(result, "spec_sequence_masks_cpu", None)
    if mask is None:
        rec["mamba"] = (int(result.num_decodes), 1, None)
    elif mask.is_cpu:  # a device mask would need a copy that waits for the GPU
        rec["mamba"] = (None, None, raw(mask.numpy()))


def launcher_patches(sess: Session, ctx_cls: Any, postprocess: str) -> list[Patch]:
    """The pre-copy launcher and the runner's own post-process launcher: V1's
    ``run_fused_postprocess`` (decision arrays in request order) or V2's
    ``run_fused_postprocess_align`` (through idx_mapping)."""
    before = _postprocess if postprocess == "run_fused_postprocess" else _postprocess_align
    return [
        Patch(ctx_cls, "run_fused_precopy", hook(sess, "run_fused_precopy", before=_precopy)),
        Patch(ctx_cls, postprocess, hook(sess, postprocess, before=before)),
    ]


def _prefill_checkpoints(
    sess: Session, _token: Any, result: Any, args: tuple[Any, ...], kwargs: dict[str, Any]
) -> None:
    """Where a Mamba prefill also stored a state mid-query: per batch row, the tokens that
    state covers and its block-table column. Only prefill steps return metadata; the host
    lists it carries are read, never a device tensor."""
    rec = sess.rec
    offsets = getattr(result, "offsets", None)
    if rec is None or not offsets or "ckpt" in rec:  # every builder of a step says the same
        return
    meta = arg(args, kwargs, 1, "m")
    seq_lens = meta.seq_lens_cpu_upper_bound
    if seq_lens is None or seq_lens.device.type != "cpu":
        return
    rows = arg(args, kwargs, 2, "request_rows")
    query_lens = result.query_lens
    block_size = int(args[0].kv_cache_spec.block_size)
    stored = []
    for i, offset in enumerate(offsets):
        if offset > 0:
            row = int(rows[i])
            seq = int(seq_lens[row])
            # the builder's column rule: cdiv(seq_len, B) - 2
            stored.append((row, seq - int(query_lens[i]) + int(offset), -(-seq // block_size) - 2))
    rec["ckpt"] = stored


def optional_patches(sess: Session, owners: dict[Target, Any]) -> list[Patch]:
    """Hooks that only enrich a trace: the Mamba and GDN builders' split, the prefill
    checkpoints."""
    patches = []
    builder = owner_of(owners, "BaseMambaAttentionMetadataBuilder", "_compute_common_metadata")
    if builder is not None:
        patches.append(
            Patch(
                builder,
                "_compute_common_metadata",
                hook(sess, "mamba_split", after=_mamba_split, required=False),
            )
        )
    gdn = owner_of(owners, "GDNAttentionMetadataBuilder", "build")
    if gdn is not None:
        patches.append(
            Patch(gdn, "build", hook(sess, "gdn_split", after=_gdn_split, required=False))
        )
    checkpoints = owner_of(owners, "MambaPrefillCheckpointBuilder", "build")
    if checkpoints is not None:
        patches.append(
            Patch(
                checkpoints,
                "build",
                hook(sess, "prefill_checkpoints", after=_prefill_checkpoints, required=False),
            )
        )
    return patches
