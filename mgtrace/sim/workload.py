"""Seeded closed-loop load generators: who arrives when, with which prompt and output length.

The shapes follow the field reproducers: ``pairs`` keeps ~30 pairs in flight, each a ~60k-token
prompt followed 1.5 +- 1 s later by a short one, so short prefills land while long ones are on
continuing chunks; ``mixed`` sends 1 in 7 prompts at ~24k tokens, the other long ones at ~2.3k
and the rest as a bare question; ``steady`` keeps the engine full of medium requests. Prompts of
one family share a filler prefix, which is what makes prefix-cache hits possible.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from mgtrace.sim.config import SimConfig

QUESTION_TOKENS = (60, 160)  # a bare question, chat template included


@dataclass
class Arrival:
    """One request as the client sends it."""

    client_id: str
    arrival_s: float
    prompt_len: int
    output_len: int
    max_tokens: int
    family: int  # prompts of one family share ``prefix_len`` filler tokens; -1: none
    prefix_len: int
    wants_hit: bool  # whether the prefix cache may serve it (seeded once per request)
    group: int  # the pair (pairs) or slot (others) that sent it


class Client:
    """Closed loop: ``concurrency`` units in flight; a finished unit starts the next one."""

    def __init__(self, cfg: SimConfig) -> None:
        self.cfg = cfg
        self.rng = np.random.default_rng([cfg.seed, 0x5EED])
        self.scale = cfg.length_scale
        self.sent = 0
        self.queue: list[Arrival] = []  # sent in the future (pairs' delayed short request)
        self.open_units: dict[int, int] = {}  # group -> requests of it still running
        self.next_group = 0
        if cfg.scenario == "pairs":
            self.units = 30
            self.max_tokens = 3000
        elif cfg.scenario == "mixed":
            self.units = 110
            self.max_tokens = 16000
        else:
            self.units = cfg.max_num_seqs
            self.max_tokens = 2048
        self.max_tokens = max(8, int(self.max_tokens * self.scale))

    def _tokens(self, lo: float, hi: float) -> int:
        # Generator.uniform(lo, hi) is lo + (hi - lo) * random(): the same draw and value,
        # without uniform's argument handling (a few times the cost of the draw)
        return max(2, int((lo + (hi - lo) * self.rng.random()) * self.scale))

    def _output_len(self, mean: float) -> int:
        n = int(self.rng.gamma(1.6, mean / 1.6) * self.scale) + 1
        return max(1, min(n, self.max_tokens))

    def _arrival(
        self,
        at: float,
        prompt: int,
        out: int,
        family: int,
        prefix: int,
        group: int,
    ) -> Arrival:
        self.sent += 1
        return Arrival(
            client_id=f"c{self.sent - 1:06d}",
            arrival_s=at,
            prompt_len=prompt,
            output_len=out,
            max_tokens=self.max_tokens,
            family=family,
            prefix_len=min(prefix, prompt - 1),
            wants_hit=bool(self.rng.random() < self.cfg.prefix_hit_prob),
            group=group,
        )

    def _start_unit(self, now: float) -> list[Arrival]:
        g = self.next_group
        self.next_group += 1
        q = self._tokens(*QUESTION_TOKENS)
        if self.cfg.scenario == "pairs":
            filler = int(60000 * self.scale)
            long = self._arrival(now, filler + q, self._output_len(1400), 0, filler, g)
            delay = max(0.0, 1.5 + self.rng.uniform(-1.0, 1.0))
            short = self._arrival(
                now + delay, self._tokens(*QUESTION_TOKENS), self._output_len(1400), -1, 0, g
            )
            self.open_units[g] = 2
            self.queue.append(short)
            return [long]
        self.open_units[g] = 1
        if self.cfg.scenario == "mixed":
            i = self.sent
            if i % 7 == 0:
                filler, fam = int(24000 * self.scale), 1
            elif i % 2 == 0:
                filler, fam = int(2250 * self.scale), 2
            else:
                filler, fam = 0, -1
            return [self._arrival(now, filler + q, self._output_len(1800), fam, filler, g)]
        # Generator.choice over 3 values draws integers(0, 3): the same stream, 5x cheaper
        filler = int((0, 512, 1024)[int(self.rng.integers(0, 3))] * self.scale)
        fam = 3 + int(self.rng.integers(0, 4)) if filler else -1
        return [
            self._arrival(
                now, filler + self._tokens(200, 1500), self._output_len(500), fam, filler, g
            )
        ]

    def poll(self, now: float) -> list[Arrival]:
        """Requests that arrive by ``now``, in arrival order."""
        out: list[Arrival] = []
        while len(self.open_units) < self.units:
            out.extend(self._start_unit(now))
        if self.queue:
            due = [a for a in self.queue if a.arrival_s <= now]
            if due:
                self.queue = [a for a in self.queue if a.arrival_s > now]
                out.extend(due)
        if len(out) > 1:
            out.sort(key=lambda a: a.arrival_s)
        return out

    def finished(self, group: int) -> None:
        left = self.open_units.get(group, 0) - 1
        if left <= 0:
            self.open_units.pop(group, None)
        else:
            self.open_units[group] = left


def step_seconds(num_scheduled_tokens: int, num_reqs: int) -> float:
    """Engine step duration: a fixed launch cost plus a per-token and per-row cost."""
    return 0.012 + 1.5e-6 * num_scheduled_tokens + 3e-5 * num_reqs
