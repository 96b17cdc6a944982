"""Triage plots as matplotlib figures, shared by the notebooks and `mgtrace report`."""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING

from mgtrace.errors import UsageError
from mgtrace.query import canned

if TYPE_CHECKING:
    from matplotlib.figure import Figure

    from mgtrace.api import Trace

REGION_COLORS = {
    "decode": "#4c72b0",
    "short_extend": "#55a868",
    "long_extend": "#dd8452",
    "prefill": "#c44e52",
}
KIND_COLORS = {
    "foreign_state": "#c44e52",
    "wrong_tokens": "#dd8452",
    "foreign_block_write": "#8172b3",
    "block_collision": "#937860",
    "malformed": "#555555",
}


def _figure(width: float = 9.0, height: float = 3.2) -> Figure:
    try:
        from matplotlib.figure import Figure
    except ImportError:
        raise UsageError(
            "plots need matplotlib; install it with: pip install 'mgtrace[report]'"
        ) from None
    return Figure(figsize=(width, height), layout="constrained")


def batch_composition(
    trace: Trace, *, rank: int | None = None, first_bad: int | None = None
) -> Figure:
    """Rows per reorder region over time, and spec-decode rows in the Mamba prefill split, on
    ``rank`` (default: the lowest rank with rows)."""
    if rank is None:
        ((lowest,),) = trace.sql(f"SELECT {canned.LOWEST_RANK}").fetchall()
        rank = 0 if lowest is None else int(lowest)
    t = trace.sql(canned.BATCH_COMPOSITION.format(rank=int(rank))).fetchnumpy()
    fig = _figure()
    ax = fig.add_subplot()
    steps = t["step"]
    regions = list(REGION_COLORS)
    ax.stackplot(
        steps,
        *(t[r] for r in regions),
        labels=regions,
        colors=[REGION_COLORS[r] for r in regions],
        alpha=0.8,
        linewidth=0,
    )
    ax.plot(
        steps,
        t["drafts_in_prefill_split"],
        color="black",
        linewidth=1.0,
        label="spec decodes in Mamba prefill split",
    )
    if first_bad is not None:
        ax.axvline(first_bad, color="red", linestyle="--", linewidth=1, label="first bad step")
    ax.set_xlabel("step")
    ax.set_ylabel("batch rows")
    ax.set_title(f"batch composition, rank {rank}")
    ax.legend(loc="upper right", fontsize=7, ncols=3)
    return fig


def accepted_distribution(trace: Trace) -> Figure:
    t = trace.sql(canned.ACCEPTED_DISTRIBUTION).fetchnumpy()
    fig = _figure(5.0, 3.0)
    ax = fig.add_subplot()
    ax.bar(t["accepted"], t["rows"], color="#4c72b0")
    if not len(t["accepted"]):  # k = 0, or no spec-decode row recorded what it accepted
        ax.text(0.5, 0.5, "no accepted counts", ha="center", va="center", transform=ax.transAxes)
    ax.set_xlabel("tokens accepted per spec-decode step")
    ax.set_ylabel("rows")
    ax.set_title("accepted-count distribution")
    return fig


def first_findings(trace: Trace, *, replay_id: str | None = None) -> list[tuple[str, str, int]]:
    """(kind, request, first step) of every request with a saved finding."""
    return trace.sql(
        "SELECT kind, req_id, min(step) FROM findings "
        f"{canned.findings_filter(replay_id)} GROUP BY kind, req_id"
    ).fetchall()


def corruption_onset(first: Iterable[tuple[str, str, int]]) -> Figure:
    """Requests reaching their first finding, cumulative over steps, by finding kind."""
    fig = _figure(9.0, 3.0)
    ax = fig.add_subplot()
    by_kind: dict[str, list[int]] = {}
    for kind, _req, step in first:
        by_kind.setdefault(kind, []).append(int(step))
    for kind, steps in sorted(by_kind.items()):
        steps.sort()
        ax.step(
            steps, range(1, len(steps) + 1), where="post", label=kind, color=KIND_COLORS.get(kind)
        )
    if by_kind:
        ax.legend(fontsize=7)
    else:
        ax.text(0.5, 0.5, "no findings", ha="center", va="center", transform=ax.transAxes)
    ax.set_xlabel("step")
    ax.set_ylabel("requests affected")
    ax.set_title("corruption onset")
    return fig


def block_ownership(trace: Trace, requests: list[str]) -> Figure:
    """Which blocks the scheduler handed to the chosen requests, and when."""
    blocks = canned.REQUEST_BLOCKS.format(requests=canned.quoted(requests))
    # block 0 is the null block: it pads the block lists of every request and is nobody's
    rows = trace.sql(f"SELECT * FROM ({blocks}) WHERE block_id > 0 ORDER BY step").fetchall()
    fig = _figure(9.0, 3.0)
    ax = fig.add_subplot()
    colors = {}
    for step, req, _kind, block in rows:
        c = colors.setdefault(req, f"C{len(colors) % 10}")
        ax.scatter([step], [block], s=6, color=c)
    for req, c in colors.items():
        ax.scatter([], [], color=c, label=req, s=12)
    ax.set_xlabel("step")
    ax.set_ylabel("block id")
    ax.set_title("block ownership (scheduler deltas)")
    if colors:
        ax.legend(fontsize=7)
    return fig


def to_png(fig: Figure) -> bytes:
    import io

    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=110)
    return buf.getvalue()
