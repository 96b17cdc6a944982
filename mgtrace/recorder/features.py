"""Which vLLM runner is live, and whether this vLLM has everything a hook needs.

Detection looks at the running objects and classes, never at version strings: a fork or a
patched release is recorded as long as it has the attributes below, and refused, naming
each missing piece, when it does not.
"""

from __future__ import annotations

import importlib
import inspect
from dataclasses import dataclass
from typing import Any

from mgtrace.errors import MgtraceError

V1_RUNNER_MODULE = "vllm.v1.worker.gpu_model_runner"
V2_RUNNER_MODULE = "vllm.v1.worker.gpu.model_runner"
RUNNER_MODULES = (V1_RUNNER_MODULE, V2_RUNNER_MODULE)


class RecorderRefusal(MgtraceError):
    """The running vLLM lacks something a hook needs; nothing was patched."""


@dataclass(frozen=True)
class Target:
    """``module[:Class].attr``; optional targets only enrich the trace. ``params``: the
    leading parameters (after ``self``) that its hook reads by position, in order. A vLLM
    whose callable does not begin with them would hand the hook the wrong argument, so it
    counts as missing."""

    module: str
    owner: str | None
    attr: str
    required: bool = True
    params: tuple[str, ...] = ()

    @property
    def label(self) -> str:
        where = f"{self.owner}.{self.attr}" if self.owner else self.attr
        return f"{self.module}:{where}"


_MU = "vllm.v1.worker.mamba_utils"
_CTX = "MambaSpecDecodeGPUContext"
# The launchers' parameters, which their hooks read by name or position.
PRECOPY_PARAMS = ("num_reqs", "state_idx_gpu", "src_col_gpu", "token_bias_gpu", "idx_mapping")
POSTPROCESS_PARAMS = (
    "num_reqs",
    "num_accepted_tokens_gpu",
    "mamba_state_idx_gpu",
    "num_scheduled_tokens_gpu",
    "num_computed_tokens_gpu",
    "num_draft_tokens_gpu",
)
POSTPROCESS_ALIGN_PARAMS = (
    "num_reqs",
    "num_accepted_tokens_gpu",
    "state_idx_gpu",
    "new_num_computed_tokens_gpu",
    "idx_mapping",
)
# Each runner calls its own post-process launcher (V1 in request order, V2 through
# idx_mapping); a vLLM without the V1 runner (0.34 on) has no V1 launcher either.
_PRECOPY_LAUNCHER = Target(_MU, _CTX, "run_fused_precopy", params=PRECOPY_PARAMS)
V1_LAUNCHERS = (
    _PRECOPY_LAUNCHER,
    Target(_MU, _CTX, "run_fused_postprocess", params=POSTPROCESS_PARAMS),
)
V2_LAUNCHERS = (
    _PRECOPY_LAUNCHER,
    Target(_MU, _CTX, "run_fused_postprocess_align", params=POSTPROCESS_ALIGN_PARAMS),
)
_SPLIT = Target(
    "vllm.v1.attention.backends.mamba_attn",
    "BaseMambaAttentionMetadataBuilder",
    "_compute_common_metadata",
    required=False,
)
_GDN_SPLIT = Target(
    "vllm.v1.attention.backends.gdn_attn",
    "GDNAttentionMetadataBuilder",
    "build",
    required=False,
)
# V1 without a speculative config copies states through this, not the fused launchers.
_SCALAR_COPY = Target(
    _MU,
    None,
    "collect_mamba_copy_meta",
    required=False,
    params=(
        "copy_bufs",
        "kv_cache_config",
        "mamba_state_copy_funcs",
        "mamba_group_ids",
        "src_block_idx",
        "dest_block_idx",
        "accept_token_bias",
        "req_state",
    ),
)
_CHECKPOINTS = Target(
    "vllm.model_executor.layers.mamba.checkpoint",
    "MambaPrefillCheckpointBuilder",
    "build",
    required=False,
    params=("m", "request_rows"),
)
_V1_BATCH = "vllm.v1.worker.gpu_input_batch"

V1_TARGETS: tuple[Target, ...] = (
    Target(V1_RUNNER_MODULE, "GPUModelRunner", "execute_model", params=("scheduler_output",)),
    # where present, a step whose execute_model returned None ends here
    Target(V1_RUNNER_MODULE, "GPUModelRunner", "sample_tokens", required=False),
    Target(V1_RUNNER_MODULE, "GPUModelRunner", "_update_states"),
    Target(
        V1_RUNNER_MODULE,
        None,
        "reorder_batch_to_split_decodes_and_prefills",
        params=("input_batch", "scheduler_output", "decode_threshold"),
    ),
    Target(_V1_BATCH, "InputBatch", "add_request", params=("request",)),
    Target(_V1_BATCH, "InputBatch", "remove_request", params=("req_id",)),
    Target(_V1_BATCH, "InputBatch", "swap_states", params=("i1", "i2")),
    Target(_V1_BATCH, "InputBatch", "condense"),
    Target(
        _MU,
        None,
        "preprocess_mamba",
        params=(
            "scheduler_output",
            "kv_cache_config",
            "cache_config",
            "mamba_state_idx",
            "input_batch",
            "requests",
            "forward_context",
            "mamba_state_copy_funcs",
            "copy_bufs",
            "align_ctx",
        ),
    ),
    Target(
        _MU,
        None,
        "stage_postprocess_inputs_to_gpu",
        params=("ctx", "scheduler_output", "req_ids", "num_reqs"),
    ),
    *V1_LAUNCHERS,
    _SCALAR_COPY,
    _SPLIT,
    _GDN_SPLIT,
    _CHECKPOINTS,
)

_V2_STATE = "vllm.v1.worker.gpu.model_states.mamba_hybrid"
_V2_TABLES = "vllm.v1.worker.gpu.block_table"

V2_TARGETS: tuple[Target, ...] = (
    Target(
        V2_RUNNER_MODULE,
        "GPUModelRunner",
        "execute_model",
        params=("scheduler_output", "intermediate_tensors", "dummy_run"),
    ),
    Target(V2_RUNNER_MODULE, "GPUModelRunner", "sample_tokens", required=False),
    Target(V2_RUNNER_MODULE, "GPUModelRunner", "prepare_inputs"),
    Target(
        _V2_STATE,
        "MambaHybridModelState",
        "preprocess_state",
        params=("input_batch", "block_tables", "kv_cache_config", "num_computed_tokens"),
    ),
    Target(_V2_STATE, "MambaHybridModelState", "postprocess_state"),
    Target("vllm.v1.worker.gpu.pp_utils", "PPHandler", "receive"),
    Target("vllm.v1.worker.gpu.pp_utils", "PPHandler", "get_prev_sampled_outputs"),
    Target(
        _V2_TABLES,
        "BlockTables",
        "append_block_ids",
        params=("req_index", "new_block_ids", "overwrite"),
    ),
    Target(
        _V2_TABLES,
        "BlockTables",
        "gather_block_tables",
        required=False,
        params=("idx_mapping", "num_reqs_padded", "out"),
    ),
    Target(
        _V2_TABLES, "BlockTables", "get_dummy_block_tables", required=False, params=("num_reqs",)
    ),
    *V2_LAUNCHERS,
    _SPLIT,
    _GDN_SPLIT,
    _CHECKPOINTS,
)

# Attributes a live runner instance must carry for the hooks to read what they record.
V1_INSTANCE_ATTRS = ("input_batch", "requests", "mamba_state_idx", "reorder_batch_threshold")
V2_INSTANCE_ATTRS = ("req_states", "model_state")


def resolve(target: Target) -> Any | None:
    """The object owning ``target.attr`` (module or class), or None when absent."""
    try:
        mod = importlib.import_module(target.module)
    except Exception:
        return None
    owner: Any = mod if target.owner is None else getattr(mod, target.owner, None)
    if owner is None or not callable(getattr(owner, target.attr, None)):
        return None
    return owner


def signature_problem(target: Target, owner: Any) -> str | None:
    """Why the target's parameters do not begin with ``target.params``; None when they do
    (or the callable has no Python signature to compare)."""
    if not target.params:
        return None
    try:
        names = list(inspect.signature(getattr(owner, target.attr)).parameters)
    except (TypeError, ValueError):
        return None
    if target.owner is not None:
        names = names[1:]  # self
    if names[: len(target.params)] == list(target.params):
        return None
    return (
        f"{target.label} takes ({', '.join(names)}), where the hook reads "
        f"({', '.join(target.params)})"
    )


def resolve_all(targets: tuple[Target, ...]) -> tuple[dict[Target, Any], list[str]]:
    """Owners of every present target whose parameters are as its hook reads them, and what
    is wrong with each required one that is missing or differs."""
    owners: dict[Target, Any] = {}
    missing: list[str] = []
    for t in targets:
        owner = resolve(t)
        problem = t.label if owner is None else signature_problem(t, owner)
        if problem is None:
            owners[t] = owner
        elif t.required:
            missing.append(problem)
    return owners, missing


def owner_of(owners: dict[Target, Any], owner: str | None, attr: str) -> Any:
    """The resolved owner (class or module) of the target named ``owner.attr``."""
    for t, obj in owners.items():
        if t.owner == owner and t.attr == attr:
            return obj
    return None


def runner_kind(runner: Any) -> str:
    """``v1`` or ``v2`` from the classes the runner derives from."""
    for cls in type(runner).__mro__:
        if cls.__name__ == "GPUModelRunner":
            if cls.__module__ == V2_RUNNER_MODULE:
                return "v2"
            if cls.__module__ == V1_RUNNER_MODULE:
                return "v1"
    raise RecorderRefusal(
        f"{type(runner).__module__}.{type(runner).__name__} is neither vLLM's V1 nor V2 "
        "GPUModelRunner; mgtrace cannot record it"
    )


def check_runner(runner: Any) -> tuple[str, dict[Target, Any]]:
    """Choose the hook set for a live runner, or refuse naming every missing piece."""
    kind = runner_kind(runner)
    targets = V1_TARGETS if kind == "v1" else V2_TARGETS
    owners, missing = resolve_all(targets)
    attrs = V1_INSTANCE_ATTRS if kind == "v1" else V2_INSTANCE_ATTRS
    missing += [f"runner attribute {a}" for a in attrs if not hasattr(runner, a)]
    if missing:
        raise RecorderRefusal(
            f"this vLLM's {kind.upper()} runner lacks what the recorder hooks need: "
            + ", ".join(missing)
        )
    if getattr(getattr(runner, "cache_config", None), "use_replayssm", False) is True:
        raise RecorderRefusal(
            "this engine serves with --use-replayssm: its Mamba2 decodes keep recent inputs "
            "in a ring and store the whole state only when they flush it, which mgtrace's "
            "replay does not model; restart the engine without --use-replayssm to record it"
        )
    if kind == "v1" and not _v1_fused_align(runner) and _SCALAR_COPY not in owners:
        raise RecorderRefusal(
            "this V1 runner serves without speculative decoding (no speculative_config, or "
            "a model that is not hybrid), so vLLM copies its align-mode Mamba states through "
            f"{_SCALAR_COPY.label}, which this vLLM lacks; mgtrace cannot see those copies"
        )
    return kind, owners


def _v1_fused_align(runner: Any) -> bool:
    """Whether V1 copies align states through the fused launchers: vLLM builds the align
    context (``MambaBuffers.create(with_postprocess_align=...)``) only for a hybrid model
    with a speculative config; otherwise ``preprocess_mamba`` takes its scalar
    ``collect_mamba_copy_meta``/``batch_memcpy`` path, which its own hook records."""
    if getattr(runner, "speculative_config", None) is None:
        return False
    return bool(getattr(getattr(runner, "model_config", None), "is_hybrid", True))
