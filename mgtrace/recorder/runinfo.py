"""Run metadata of a live vLLM runner, read once when recording starts."""

from __future__ import annotations

import operator
from pathlib import Path
from typing import Any

from mgtrace.schemas.manifest import RunMetadata, StateLayout

# State kinds in the order a Mamba spec lists its shapes, per backend family (vLLM's
# MambaStateCopyFuncCalculator: mamba/GDN/KDA keep (conv, temporal), linear attention only
# the temporal state, short conv only the conv state).
_KINDS_BY_TYPE = {"LINEAR": ("temporal",), "SHORT_CONV": ("conv",)}


def _get(obj: Any, path: str, default: Any = None) -> Any:
    for name in path.split("."):
        obj = getattr(obj, name, None)
        if obj is None:
            return default
    return obj


def _whole(value: Any) -> int | None:
    """An integer setting as an int; None for anything else (unknown), so that the manifest
    holds only what its reader accepts."""
    if isinstance(value, bool):
        return None
    try:
        return operator.index(value)
    except TypeError:
        return None


def _count(value: Any) -> int | None:
    """``_whole``, and positive."""
    n = _whole(value)
    return n if n is not None and n > 0 else None


def _text(value: Any) -> str | None:
    return None if value is None else str(value)


def mamba_group_ids(runner: Any) -> list[int]:
    """KV-cache group ids of the Mamba groups, in the order the align kernels use."""
    try:
        from vllm.v1.worker import mamba_utils

        cfg = runner.kv_cache_config
        return list(mamba_utils.get_mamba_group_ids(mamba_utils.get_mamba_groups(cfg)))
    except Exception:
        return []


def _attention_groups(runner: Any) -> list[Any]:
    """The runner's attention groups: V1 iterates them itself; V2 keeps a list per KV-cache
    group, and its drafter (speculator) lists of its own."""
    iterate = getattr(runner, "_attn_group_iterator", None)
    if iterate is not None:
        return list(iterate())
    drafter = getattr(getattr(runner, "speculator", None), "attn_groups", None) or []
    return [g for groups in [*getattr(runner, "attn_groups", []), *drafter] for g in groups]


def builder_thresholds(runner: Any) -> dict[str, int | None]:
    out: dict[str, int | None] = {}
    try:
        for group in _attention_groups(runner):
            builder = group.get_metadata_builder()
            out[type(builder).__name__] = _whole(getattr(builder, "reorder_batch_threshold", None))
    except Exception:
        pass
    return out


def _conv_layout() -> str:
    try:
        from vllm.model_executor.layers.mamba.mamba_utils import get_conv_state_layout

        return str(get_conv_state_layout())
    except Exception:
        return "SD"


def prefill_checkpoint_blocks(runner: Any, groups: list[int]) -> int | None:
    """The most prefill checkpoint blocks a Mamba group's spec asks for (0: none); None
    where this vLLM's spec has no such field or the groups cannot be read."""
    try:
        cfg_groups = runner.kv_cache_config.kv_cache_groups
        values = [cfg_groups[g].kv_cache_spec.num_prefill_checkpoint_blocks for g in groups]
    except Exception:
        return None
    return max((_whole(v) or 0 for v in values), default=None)


def state_layout(runner: Any, groups: list[int]) -> list[StateLayout]:
    """Per Mamba group (local order) and layer, the state tensors a block holds."""
    out: list[StateLayout] = []
    try:
        cfg_groups = runner.kv_cache_config.kv_cache_groups
    except Exception:
        return out
    layout = _conv_layout()
    for local, gid in enumerate(groups):
        try:
            group = cfg_groups[gid]
            spec = group.kv_cache_spec
            shapes, dtypes = tuple(spec.shapes), tuple(spec.dtypes)
        except Exception:
            continue
        mamba_type = getattr(getattr(spec, "mamba_type", None), "name", "MAMBA2")
        kinds = _KINDS_BY_TYPE.get(mamba_type, ("conv", "temporal", "temporal", "temporal"))
        for layer, _name in enumerate(getattr(group, "layer_names", ["layer"])):
            for i, (shape, dtype) in enumerate(zip(shapes, dtypes, strict=False)):
                kind = kinds[i] if i < len(kinds) else "temporal"
                out.append(
                    StateLayout(
                        group=local,
                        layer=layer,
                        kind=kind,
                        shape=[int(d) for d in shape],
                        dtype=str(dtype).removeprefix("torch."),
                        conv_layout=layout if kind == "conv" else None,
                    )
                )
    return out


def rank_and_world() -> tuple[int, int]:
    try:
        import torch.distributed as dist

        if dist.is_available() and dist.is_initialized():
            return dist.get_rank(), dist.get_world_size()
    except Exception:
        pass
    return 0, 1


def engine_folder(out: Path, rank: int, world: int, run: RunMetadata) -> tuple[Path, int]:
    """The folder a worker of global ``rank`` in a ``world`` records into, and its rank
    within its engine. With data parallelism vLLM offsets torch.distributed's rank by
    dp_rank * TP * PP and counts every DP rank's workers in its world
    (``init_distributed_environment``), yet each DP rank is an engine with a scheduler of
    its own: its workers record into ``out/dp-NNN``, ranked within it. Sets ``run.dp_rank``."""
    per_engine = run.tp_size * run.pp_size
    if run.dp_size > 1:
        if world == run.dp_size * per_engine:  # the offset world; else the engine's own
            run.dp_rank, rank, world = rank // per_engine, rank % per_engine, per_engine
        out = out / f"dp-{run.dp_rank:03d}"
    return (out / f"rank-{rank:03d}" if world > 1 else out), rank


def run_metadata(runner: Any, kind: str, groups: list[int], row_rule: str | None) -> RunMetadata:
    try:
        import vllm

        version = getattr(vllm, "__version__", None)
    except Exception:
        version = None
    spec_k = _get(runner, "speculative_config.num_speculative_tokens", 0) or 0
    dp_size = _count(_get(runner, "vllm_config.parallel_config.data_parallel_size")) or 1
    dp_rank = _whole(_get(runner, "vllm_config.parallel_config.data_parallel_rank"))
    async_sched = getattr(runner, "use_async_scheduling", None)
    if async_sched is None:
        async_sched = bool(_get(runner, "vllm_config.scheduler_config.async_scheduling", False))
    return RunMetadata(
        runner=kind,
        vllm_version=version,
        model=_text(_get(runner, "model_config.model")),
        num_speculative_tokens=int(spec_k),
        mamba_block_size=int(_get(runner, "cache_config.mamba_block_size", 16) or 16),
        mamba_cache_mode=str(_get(runner, "cache_config.mamba_cache_mode", "align")),
        async_scheduling=bool(async_sched),
        tp_size=int(_get(runner, "vllm_config.parallel_config.tensor_parallel_size", 1) or 1),
        pp_size=int(_get(runner, "vllm_config.parallel_config.pipeline_parallel_size", 1) or 1),
        dp_size=dp_size,
        dp_rank=dp_rank if dp_rank is not None and 0 <= dp_rank < dp_size else 0,
        max_num_seqs=_count(_get(runner, "vllm_config.scheduler_config.max_num_seqs")),
        max_num_batched_tokens=_count(
            _get(runner, "vllm_config.scheduler_config.max_num_batched_tokens")
        ),
        num_blocks=_count(_get(runner, "kv_cache_config.num_blocks")),
        num_mamba_groups=max(1, len(groups)),
        runner_reorder_threshold=_whole(getattr(runner, "reorder_batch_threshold", None)),
        builder_reorder_thresholds=builder_thresholds(runner),
        row_rule=row_rule,
        prefill_checkpoint_blocks=prefill_checkpoint_blocks(runner, groups),
        states=state_layout(runner, groups),
    )
