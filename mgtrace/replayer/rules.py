"""Counterfactual rules: named transforms of the recorded inputs, "as-recorded" by default.

A rule changes one decision the engine made, so that a replay can ask "would this step have
been clean if ...". Each rule has a small set of values; ``as-recorded`` replays exactly what
the engine consumed. A ``RuleSet`` is the full assignment, printed in a canonical form
(``bt_row_is_req=false,reorder_threshold=1+k``) that the findings table stores and that
bisect prints as command-line flags.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass

from mgtrace.errors import UsageError

AS_RECORDED = "as-recorded"


@dataclass(frozen=True)
class Rule:
    name: str
    values: tuple[str, ...]  # besides as-recorded; "N" stands for any positive integer
    summary: str  # one line for --list-rules
    undoes: str  # the bug class a non-recorded value rules in or out

    @property
    def flag(self) -> str:
        return "--" + self.name.replace("_", "-")

    def accepts(self, value: str) -> bool:
        if value == AS_RECORDED or value in self.values:
            return True
        # isascii: "²" and other Unicode digits pass isdigit() but not int()
        return "N" in self.values and value.isascii() and value.isdigit() and int(value) > 0

    def alternatives(self) -> tuple[str, ...]:
        """The values bisect tries: named values that can differ from what was recorded."""
        return tuple(v for v in self.values if v not in ("N", *self.same_as_recorded))

    # Values that name what a trace records anyway (the kernel's accepted count is the
    # recorded one), so trying them cannot change a replay.
    same_as_recorded: tuple[str, ...] = ()


RULES: dict[str, Rule] = {
    r.name: r
    for r in (
        Rule(
            "bt_row_is_req",
            ("true", "false"),
            "Index the align kernels' block tables by request slot (true) or batch row (false).",
            "stale batch rows under PP deferral (vllm#55506, #55951)",
        ),
        Rule(
            "reorder_threshold",
            ("1+k", "N"),
            "Re-run the batch reorder at this threshold and the Mamba decode/prefill split "
            "(V2, which sorts instead: its sort, then the split at this threshold).",
            "decode rows in the Mamba prefill split (vllm#55894)",
        ),
        Rule(
            "accepted_source",
            ("kernel", "cpu"),
            "Take accepted counts as the kernel read them, or as the CPU held them.",
            "accepted-count copy overtaken by row moves (vllm#51571)",
            same_as_recorded=("kernel",),
        ),
        Rule(
            "clear_vacated_rows",
            ("true",),
            "Treat block-table rows outside the batch as cleared (padded rows write nowhere).",
            "stale rows left by condense (vllm#49757)",
        ),
    )
}


def _canonical_value(rule: Rule, value: str) -> str:
    value = value.strip().lower()
    if value in ("1", "yes", "on") and "true" in rule.values and "N" not in rule.values:
        value = "true"
    if value in ("0", "no", "off") and "false" in rule.values:
        value = "false"
    if value in ("recorded", "asrecorded", "as_recorded"):
        value = AS_RECORDED
    return value


class RuleSet(Mapping[str, str]):
    """An assignment of a value to every rule; immutable and hashable."""

    def __init__(self, values: Mapping[str, str] | None = None) -> None:
        resolved = {name: AS_RECORDED for name in RULES}
        for name, value in (values or {}).items():
            key = name.replace("-", "_")
            rule = RULES.get(key)
            if rule is None:
                raise UsageError(
                    f"unknown rule {name!r}; the rules are {', '.join(RULES)} "
                    "(mgtrace replay --list-rules)"
                )
            canon = _canonical_value(rule, str(value))
            if not rule.accepts(canon):
                allowed = " | ".join((*rule.values, AS_RECORDED))
                raise UsageError(f"rule {key} takes {allowed}, not {value!r}")
            resolved[key] = canon
        self._values = resolved

    def __getitem__(self, key: str) -> str:
        return self._values[key]

    def __iter__(self) -> Iterator[str]:
        return iter(self._values)

    def __len__(self) -> int:
        return len(self._values)

    def __hash__(self) -> int:
        return hash(tuple(sorted(self._values.items())))

    def __eq__(self, other: object) -> bool:
        return isinstance(other, RuleSet) and self._values == other._values

    def __repr__(self) -> str:
        return f"RuleSet({self.canonical()})"

    def changed(self) -> dict[str, str]:
        return {k: v for k, v in self._values.items() if v != AS_RECORDED}

    def canonical(self) -> str:
        """``as-recorded`` when nothing changes, else the changed rules, sorted."""
        changed = self.changed()
        if not changed:
            return AS_RECORDED
        return ",".join(f"{k}={v}" for k, v in sorted(changed.items()))

    def as_flags(self) -> list[str]:
        return [f"{RULES[k].flag}={v}" for k, v in sorted(self.changed().items())]

    def with_(self, **values: str) -> RuleSet:
        merged = dict(self._values)
        merged.update(values)
        return RuleSet(merged)

    @classmethod
    def parse(cls, text: str) -> RuleSet:
        """From the canonical form (or ``as-recorded``)."""
        text = text.strip()
        if text in ("", AS_RECORDED):
            return cls()
        pairs = {}
        seen: dict[str, str] = {}
        for item in re.split(r"[,\s]+", text):
            if not item:
                continue
            name, sep, value = item.partition("=")
            if not sep:
                raise UsageError(f"rule assignments look like name=value, not {item!r}")
            key = name.replace("-", "_")  # as the rule set spells its names
            if key in seen and seen[key].lower() != value.lower():
                raise UsageError(f"{key} is given twice ({seen[key]} and {value}); give one")
            seen[key] = value
            pairs[name] = value
        return cls(pairs)


def single_changes(base: RuleSet, k: int) -> Iterable[RuleSet]:
    """Every rule set that differs from ``base`` in exactly one rule (bisect's candidates)."""
    for name, rule in RULES.items():
        for value in rule.alternatives():
            if name == "reorder_threshold" and value == "1+k" and k == 0:
                continue
            if base[name] != value:
                yield base.with_(**{name: value})


def resolve_threshold(value: str, recorded: int | None, k: int) -> int | None:
    """The reorder threshold a rule value means for a run with ``k`` drafts."""
    if value == AS_RECORDED:
        return recorded
    if value == "1+k":
        return 1 + k
    return int(value)
