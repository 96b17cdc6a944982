"""The Python API the CLI and the notebooks share.

>>> import mgtrace
>>> t = mgtrace.simulate("run.trace", bugs=["reorder-threshold-mismatch"], steps=2000)
>>> t.info()["steps"]
2000
>>> t.sql("SELECT mamba_split, count(*) FROM batch_rows GROUP BY ALL").fetchall()
>>> t.replay().first_step, t.replay(reorder_threshold="1+k").clean
>>> t.bisect().sentence()
>>> t.history("req-000002", to_step=20).to_pylist()
>>> t.minimize("repro").steps
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable, Iterator, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pyarrow as pa

from mgtrace.errors import MgtraceError, TraceReplacedError, UsageError
from mgtrace.replayer.rules import RuleSet
from mgtrace.schemas.manifest import MANIFEST_NAME
from mgtrace.schemas.reader import TraceReader

if TYPE_CHECKING:
    import duckdb

    from mgtrace.replayer.bisect import Verdict
    from mgtrace.replayer.diff import RulesDiff, TraceDiff
    from mgtrace.replayer.loop import ReplayResult
    from mgtrace.replayer.minimize import MinimizeResult
    from mgtrace.schemas.manifest import Manifest, RunMetadata


def _rules(rules: RuleSet | str | None, values: dict[str, Any]) -> RuleSet:
    if rules is not None and not isinstance(rules, (RuleSet, str)):
        raise UsageError(
            f"rules must be a RuleSet or a string such as 'bt_row_is_req=true', not {rules!r:.40}"
        )
    base = RuleSet.parse(rules) if isinstance(rules, str) else (rules or RuleSet())
    chosen = {k: str(v).lower() if isinstance(v, bool) else str(v) for k, v in values.items()}
    return base.with_(**chosen) if chosen else base


def _flag(name: str, value: object) -> bool:
    """A yes/no argument: ``save="no"`` must not save (a non-empty string is truthy)."""
    if type(value) is not bool:
        raise UsageError(f"{name} must be True or False, not {value!r:.40}")
    return value


def _path(what: str, value: object) -> Path:
    if not isinstance(value, (str, Path)):
        raise UsageError(f"{what} is a path (a string or a Path), not {value!r:.40}")
    return Path(value)


def _rule_text(name: str, value: object) -> str:
    if not isinstance(value, str):
        raise UsageError(
            f"{name} must be a string such as 'reorder_threshold=1+k', not {value!r:.40}"
        )
    return value


# the command line's words in the sentences of the checks the API shares with it
_PYTHON_WORDS = {
    "--from-step": "from_step",
    "--to-step": "to_step",
    "--skip-bad-parts": "skip_bad_parts=True",
}


@contextlib.contextmanager
def _said_for_python() -> Iterator[None]:
    """Re-raise the shared checks' errors in the API's words (``from_step``, not
    ``--from-step``); only around checks whose sentences hold no shell command."""
    try:
        yield
    except MgtraceError as exc:
        said = exc.message
        for flag, word in _PYTHON_WORDS.items():
            said = said.replace(flag, word)
        if said == exc.message:
            raise
        raise type(exc)(said, exit_code=exc.exit_code) from None


class Trace:
    """One trace directory: its metadata, its tables, and the offline analyses on it."""

    def __init__(self, path: str | Path, *, skip_bad_parts: bool = False) -> None:
        if not isinstance(path, (str, Path)):
            raise UsageError(f"a trace is opened by its path, not {path!r:.40}")
        _flag("skip_bad_parts", skip_bad_parts)
        self.path = Path(path)
        self._skip_bad_parts = skip_bad_parts
        with _said_for_python():
            reader = TraceReader(self.path, skip_bad_parts=skip_bad_parts)
        self._adopt(reader)

    @classmethod
    def _over(cls, reader: TraceReader, *, skip_bad_parts: bool) -> Trace:
        """A Trace over a reader the command line opened, whose errors keep its own words
        (``--skip-bad-parts``, not ``skip_bad_parts=True``)."""
        self = cls.__new__(cls)
        self.path = reader.path
        self._skip_bad_parts = skip_bad_parts
        self._adopt(reader)
        return self

    def __repr__(self) -> str:
        from mgtrace.replayer.steps import ranks_of

        try:
            self._fresh()
        except MgtraceError:  # a repr never raises: it says what became of the trace
            return f"Trace({str(self.path)!r}, removed or replaced since it was opened)"

        state = "complete" if self.reader.complete else "incomplete"
        rows, ranks = self.reader.rows("steps"), len(ranks_of(self.reader))
        # the steps table holds a row per step and rank: a PP step is one step
        steps = f"{rows} steps" if ranks < 2 else f"{rows} step rows on {ranks} ranks"
        return f"Trace({str(self.path)!r}, {steps}, {state})"

    @property
    def manifest(self) -> Manifest:
        return self.reader.manifest

    @property
    def run(self) -> RunMetadata:
        return self.reader.manifest.run

    def reload(self) -> Trace:
        """Read the manifest again: the trace as it is now, also where another trace has
        replaced it (every method reads again by itself what replays added)."""
        with _said_for_python():
            reader = TraceReader(self.path, skip_bad_parts=self._skip_bad_parts)
        self._adopt(reader)
        return self

    def _adopt(self, reader: TraceReader) -> None:
        """Read through ``reader`` from now on (its connection made when first asked)."""
        self.reader, self._con = reader, None
        self._stamp = self._manifest_stamp()

    def _manifest_stamp(self) -> int | None:
        try:
            return (self.path / MANIFEST_NAME).stat().st_mtime_ns
        except OSError:
            return None

    def _fresh(self) -> None:
        """Read the trace again where its manifest changed since (a replay, here or from the
        command line, saved findings into it); one sentence where the trace was removed or
        replaced by another since it was opened, rather than a pyarrow or DuckDB error, or
        answers that mix two runs."""
        stamp = self._manifest_stamp()
        if stamp == self._stamp:
            return
        where = f"the trace at {self.path}"
        if stamp is None:
            raise TraceReplacedError(f"{where} was removed since it was opened")
        with _said_for_python():
            now = TraceReader(self.path, skip_bad_parts=self._skip_bad_parts)
        if now.manifest.created_unix != self.reader.manifest.created_unix:
            raise TraceReplacedError(
                f"{where} was replaced by another since it was opened; call reload() or "
                "mgtrace.open it again"
            )
        self.reader, self._con, self._stamp = now, None, stamp

    # ------------------------------------------------------------------ data
    def info(self) -> dict[str, Any]:
        """Run metadata, steps, requests, ranks, size, completeness and drops."""
        self._fresh()
        from mgtrace.query.info import trace_info

        return trace_info(self.reader)

    def sql(self, query: str) -> duckdb.DuckDBPyRelation:
        """A DuckDB relation over the trace views; call .df(), .arrow(), .fetchall(), .show().
        ``query`` may name a canned query as ``@NAME``, as ``mgtrace sql`` does."""
        self._fresh()
        from mgtrace.query.canned import named
        from mgtrace.query.views import run_query

        if not isinstance(query, str):
            raise UsageError(f"a query is a string, not {query!r:.40}")
        if self._con is None:
            self._con = self.reader.connect()
        return run_query(self._con, named(query, self.run.num_speculative_tokens))

    def table(self, name: str, *, columns: list[str] | None = None) -> pa.Table:
        self._fresh()
        from mgtrace.schemas.tables import TABLES

        if columns is not None and not isinstance(columns, (str, list, tuple)):
            raise UsageError(f"columns is a list of column names, not {columns!r:.40}")
        if columns is not None and name in TABLES:  # an unknown table: the reader says so
            columns = [columns] if isinstance(columns, str) else list(columns)
            known = set(TABLES[name].schema.names)
            unknown = [c for c in columns if c not in known]
            if unknown:
                raise UsageError(
                    f"table {name} has no column {', '.join(map(str, unknown))}; its columns: "
                    f"{', '.join(sorted(known))}"
                )
        return self.reader.table(name, columns=columns)

    def history(
        self,
        request: str,
        *,
        from_step: int | None = None,
        to_step: int | None = None,
        rules: str | None = "as-recorded",
        rank: int | None = None,
    ) -> pa.Table:
        """One request's lines, as ``mgtrace history --format json`` gives them (numbers in
        their own columns: ``accepted_prev_cpu``, ``prev_state_col``; ``request``: the id, or
        a unique part of it; ``rules=None``: findings of every saved replay; ``rank``: that
        rank's lines only)."""
        self._fresh()
        from mgtrace.cli import check_step_window
        from mgtrace.query.history import check_rank, request_history, resolve_request
        from mgtrace.replayer.checkpoint import start_state

        if not isinstance(request, str):
            raise UsageError(f"a request is named by its id (a string), not {request!r:.40}")
        for name, value in (("from_step", from_step), ("to_step", to_step)):
            if value is not None and (type(value) is not int or value < 0):
                raise UsageError(f"{name} must be a step number (0 or more), not {value!r:.40}")
        with _said_for_python():
            check_step_window(from_step, to_step)
        # "any": every saved replay's findings, as `mgtrace history --rules any` says
        rules = None if rules in (None, "any") else _rules(rules, {}).canonical()
        if rank is not None:
            check_rank(self.reader, rank, self.path)
        if self._con is None:
            self._con = self.reader.connect()
        req_id = resolve_request(self._con, request, start_state(self.reader))
        return request_history(
            self._con,
            req_id,
            from_step=from_step,
            to_step=to_step,
            rules=rules,
            run=self.run,
            rank=rank,
            start=start_state(self.reader),
        )

    # ------------------------------------------------------------------ analyses
    def replay(
        self,
        rules: RuleSet | str | None = None,
        *,
        backend: str = "reference",
        device: str = "cpu",
        layout: str = "compact",
        from_step: int | None = None,
        to_step: int | None = None,
        save: bool = False,
        allow_gaps: bool = False,
        ranks: Sequence[int] | None = None,
        **rule_values: Any,
    ) -> ReplayResult:
        """Replay under ``rules`` (keyword rules such as ``reorder_threshold="1+k"`` too).

        With ``save=True`` the findings are added to the trace's ``findings`` table; with
        ``allow_gaps=True`` the replay crosses dropped or left-out steps (it may mislead);
        ``ranks``: only those ranks (every rank by default).
        """
        self._fresh()
        from mgtrace.replayer.cli import check_replay_window, last_step_of, replay_id_for
        from mgtrace.replayer.findings import save_findings
        from mgtrace.replayer.loop import replay_trace
        from mgtrace.replayer.steps import some_ranks

        ruleset = _rules(rules, rule_values)
        _flag("save", save)
        _flag("allow_gaps", allow_gaps)
        if isinstance(ranks, int):  # ranks=0 once replayed every rank, ranks=1 a TypeError
            raise UsageError(f"ranks is a list of rank numbers such as [{ranks}], not {ranks!r}")
        with _said_for_python():
            check_replay_window(self.reader, self.path, from_step, to_step)
        chosen = some_ranks(self.reader, ranks, self.path)
        result = replay_trace(
            self.reader,
            ruleset,
            backend=backend,
            device=device,
            layout=layout,
            from_step=from_step,
            to_step=to_step,
            allow_gaps=allow_gaps,
            ranks=chosen,
        )
        if save:
            save_findings(
                self.path,
                result.findings,
                replay_id=replay_id_for(
                    ruleset, from_step, to_step, last_step_of(self.reader), chosen
                ),
                rules=ruleset.canonical(),
                stopped_at_gap=result.stopped_at_gap,
                crossed_gaps=result.crossed_gaps,
                read_from=self.reader.manifest,
            )
            self.reload()
        return result

    def bisect(
        self,
        rules: RuleSet | str | None = None,
        *,
        horizon: int = 32,
        backend: str = "reference",
        device: str = "cpu",
        **rule_values: Any,
    ) -> Verdict:
        """The first bad step, its requests, and the rule change that makes it good."""
        self._fresh()
        from mgtrace.replayer.bisect import bisect

        # as --horizon's x>=1: a horizon below 1 ends the "good" replay before the first bad
        # step, so every rule looks like a fix
        if type(horizon) is not int or horizon < 1:
            raise UsageError(
                f"horizon must be a whole number of steps, 1 or more, not {horizon!r:.40}"
            )
        return bisect(
            self.path,
            base=_rules(rules, rule_values),
            horizon=horizon,
            backend=backend,
            device=device,
            skip_bad_parts=self._skip_bad_parts,
        )

    def minimize(
        self,
        output: str | Path,
        *,
        signature: str | None = None,
        force: bool = False,
        rules: RuleSet | str | None = None,
        **rule_values: Any,
    ) -> MinimizeResult:
        """The smallest trace that still shows the same first finding, and a pytest file."""
        self._fresh()
        from mgtrace.errors import OutputError
        from mgtrace.replayer.minimize import minimize

        output = _path("the minimized trace", output)
        _flag("force", force)
        try:
            return minimize(
                self.path,
                output,
                rules=_rules(rules, rule_values),
                signature=signature,
                force=force,
                skip_bad_parts=self._skip_bad_parts,
            )
        except OutputError as exc:  # said as the command line says it: say it for Python
            raise OutputError(exc.message.replace("--force", "force=True")) from None

    def diff(
        self,
        other: Trace | str | Path | None = None,
        *,
        rules_a: str = "as-recorded",
        rules_b: str | None = None,
    ) -> TraceDiff | RulesDiff:
        """The first step where another trace, or another rule set on this one, diverges."""
        self._fresh()
        from mgtrace.replayer.diff import diff_rules, diff_traces

        _rule_text("rules_a", rules_a)
        if rules_b is not None:
            _rule_text("rules_b", rules_b)
        if other is not None:
            if rules_b is not None or rules_a != "as-recorded":  # as `mgtrace diff` refuses it
                raise UsageError("compare two traces or two rule sets, not both")
            if not isinstance(other, Trace):
                other = _path("the other trace", other)
            reader = other.reader if isinstance(other, Trace) else TraceReader(other)
            return diff_traces(self.reader, reader)
        if rules_b is None:
            raise UsageError("give another trace, or rules_b to compare rule sets on this one")
        return diff_rules(self.reader, RuleSet.parse(rules_a), RuleSet.parse(rules_b))


def open_trace(path: str | Path, *, skip_bad_parts: bool = False) -> Trace:
    return Trace(path, skip_bad_parts=skip_bad_parts)


def simulate(
    output: str | Path,
    *,
    scenario: str = "pairs",
    steps: int = 2000,
    runner: str = "v1",
    k: int = 3,
    pp: int = 1,
    seed: int = 0,
    bugs: Iterable[str] = (),
    force: bool = False,
    **options: Any,
) -> Trace:
    """Run the engine simulator into ``output`` and open the trace it wrote."""
    import dataclasses

    from mgtrace.errors import OutputError
    from mgtrace.outputs import refuse_a_trace_inside_a_trace, require_output_folder
    from mgtrace.sim.config import SimConfig
    from mgtrace.sim.engine import simulate as run

    output = _path("the output trace", output)
    _flag("force", force)
    if isinstance(bugs, str):
        bugs = (bugs,)  # one name, or several
    elif not isinstance(bugs, Iterable):
        raise UsageError(f"bugs is a list of bug names, not {bugs!r:.40}")
    bugs = tuple(bugs)
    fields = {f.name: f for f in dataclasses.fields(SimConfig)}
    for name in options:
        if name not in fields or name in ("output", "overwrite"):
            known = sorted(
                set(fields)
                - {"output", "overwrite", "bugs", "scenario", "steps", "runner", "k", "pp", "seed"}
            )
            raise UsageError(f"simulate has no option {name!r}; its options: {', '.join(known)}")
    given = {"steps": steps, "k": k, "pp": pp, "seed": seed, **options}
    for name, value in given.items():
        kind = str(fields[name].type)  # the annotation's text (postponed annotations)
        if value is None and "None" in kind:
            continue
        if kind.startswith("int") and type(value) is not int:
            raise UsageError(f"{name} must be a whole number, not {value!r:.40}")
        if kind.startswith("float") and (type(value) not in (int, float)):
            raise UsageError(f"{name} must be a number, not {value!r:.40}")
        if kind.startswith("bool"):
            _flag(name, value)
    require_output_folder(output, str(output))  # as `mgtrace simulate -o`: no folder made
    refuse_a_trace_inside_a_trace(output)
    cfg = SimConfig(
        scenario=scenario,
        steps=steps,
        runner=runner,
        k=k,
        pp=pp,
        seed=seed,
        bugs=bugs,
        output=output,
        overwrite=force,
        **options,
    )
    try:
        run(cfg.validate())
    except OutputError as exc:  # said as the command line says it: say it for Python
        raise OutputError(exc.message.replace("--force", "force=True")) from None
    return Trace(output)
