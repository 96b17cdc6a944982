"""The oracle: compares the tags a request is about to build on with what it should be.

Expectations come from the request's own counts. A request whose running state covers ``E``
verified tokens must find, in its temporal state, its own uid and ``E`` tokens folded in,
and in the conv rows it reads the positions ``E-K+1 .. E-1`` (K-1 = the conv window without
the speculative slots). A state written by another request is legitimate only as a prefix
hit: before the request has written any state of its own, with exactly ``E`` tokens folded.

Each finding names a mechanism without ids or numbers, so that its signature
(``kind:mechanism``) stays the same across runs and can pin a minimization.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from mgtrace.replayer.findings import (
    BLOCK_COLLISION,
    FOREIGN_BLOCK_WRITE,
    FOREIGN_STATE,
    WRONG_TOKENS,
    Finding,
)
from mgtrace.replayer.ownership import NULL_BLOCK, BlockOwnership
from mgtrace.replayer.requests import DUMMY_REQUEST, NO_REQUEST, RequestIds
from mgtrace.replayer.tags import TagPool


def _verb(what: str) -> str:
    return "will read next" if what == "next-state" else "reads"


@dataclass
class StateRead:
    """Rows about to read state: where, and what they should find there."""

    what: list[str]  # per row, mechanism prefix: decode-read, prefill-read, next-state
    rows: np.ndarray  # batch rows
    uid: np.ndarray
    expected_tokens: np.ndarray  # E per row
    temporal_blocks: np.ndarray  # [groups, rows]
    conv_blocks: np.ndarray  # [groups, rows]
    conv_offset: np.ndarray  # first conv row read, per row

    def subset(self, sel: np.ndarray) -> StateRead:
        return StateRead(
            what=[self.what[i] for i in sel.tolist()],
            rows=self.rows[sel],
            uid=self.uid[sel],
            expected_tokens=self.expected_tokens[sel],
            temporal_blocks=self.temporal_blocks[:, sel],
            conv_blocks=self.conv_blocks[:, sel],
            conv_offset=self.conv_offset[sel],
        )


@dataclass
class Oracle:
    rank: int
    ids: RequestIds
    pool: TagPool
    ownership: BlockOwnership
    conv_keep: int  # conv rows a read relies on (K-1)
    findings: list[Finding] = field(default_factory=list)
    repeats: dict[tuple[int, str], int] = field(default_factory=dict)
    wrote: np.ndarray = field(default_factory=lambda: np.zeros(1024, dtype=bool))

    def mark_written(self, uids: np.ndarray) -> None:
        """These requests now have a state of their own (a prefix share is no longer legal)."""
        if len(uids) and uids.max() >= len(self.wrote):
            grown = np.zeros(max(2 * len(self.wrote), int(uids.max()) + 1), dtype=bool)
            grown[: len(self.wrote)] = self.wrote
            self.wrote = grown
        self.wrote[uids] = True

    def has_written(self, uids: np.ndarray) -> np.ndarray:
        inside = (uids >= 0) & (uids < len(self.wrote))
        return inside & self.wrote[np.where(inside, uids, 0)]

    def _report(self, uid: int, f: Finding) -> None:
        key = (uid, f.signature)
        seen = self.repeats.get(key, 0)
        self.repeats[key] = seen + 1
        if not seen:  # a corrupted request stays corrupted: report its first occurrence only
            self.findings.append(f)

    # ----------------------------------------------------------------- reads
    def check_reads(self, step: int, read: StateRead) -> None:
        """Every row must find its own state with exactly E tokens; the few rows that do not
        go through the detailed checks, which tell prefix hits from foreign reads."""
        if not len(read.rows):
            return
        suspect = np.zeros(len(read.rows), dtype=bool)
        for g, gs in enumerate(self.pool.groups):
            if gs.temporal is not None:
                blocks = read.temporal_blocks[g]
                ok = blocks >= 0
                uid, tokens = self.pool.read_temporal_head(g, np.where(ok, blocks, 0))
                suspect |= ok & ((uid != read.uid) | (tokens != read.expected_tokens))
            if gs.conv is not None and self.conv_keep > 0:
                blocks = read.conv_blocks[g]
                ok = blocks >= 0
                uids, pos, inside = self.pool.read_conv_rows(
                    g, np.where(ok, blocks, 0), read.conv_offset, self.conv_keep
                )
                want = read.expected_tokens[:, None] - self.conv_keep + self._keep_range
                good = ((uids == read.uid[:, None]) & (pos == want)) | ~inside
                suspect |= ok & ~good.all(axis=1)
        if not suspect.any():
            return
        detail = read.subset(np.flatnonzero(suspect))
        for g, gs in enumerate(self.pool.groups):
            if gs.temporal is not None:
                self._check_temporal(step, detail, g)
            if gs.conv is not None and self.conv_keep > 0:
                self._check_conv(step, detail, g)

    @property
    def _keep_range(self) -> np.ndarray:
        return np.arange(self.conv_keep)

    def _check_temporal(self, step: int, read: StateRead, g: int) -> None:
        blocks = read.temporal_blocks[g]
        ok = blocks >= 0
        tags = np.zeros((len(blocks), 4), dtype=np.int64)
        tags[ok] = self.pool.read_temporal(g, blocks[ok])
        uid_t, tok_t, step_t = tags[:, 0], tags[:, 1], tags[:, 2]
        mine = uid_t == read.uid
        prefix = ~mine & ~self.has_written(read.uid) & (tok_t == read.expected_tokens)
        prefix &= uid_t > 0
        unwritten = ok & (uid_t == NO_REQUEST)
        foreign = ok & ~mine & ~prefix & ~unwritten
        wrong = ok & mine & (tok_t != read.expected_tokens)
        for i in np.flatnonzero(foreign | wrong | unwritten).tolist():
            uid, e, t = int(read.uid[i]), int(read.expected_tokens[i]), int(tok_t[i])
            name = self.ids.name(uid)
            if unwritten[i]:
                kind, mech = WRONG_TOKENS, f"{read.what[i]}:temporal:unwritten"
                detail = (
                    f"request {name} {_verb(read.what[i])} a temporal state no request has written "
                    f"(block {int(blocks[i])}); it has {e} tokens"
                )
                writer_id, writer_step = None, None
            elif foreign[i]:
                writer = self.ids.name(int(uid_t[i]))
                who = "a padded row" if uid_t[i] == DUMMY_REQUEST else f"request {writer}"
                kind, mech = FOREIGN_STATE, f"{read.what[i]}:temporal"
                detail = (
                    f"request {name} {_verb(read.what[i])} a temporal state written by {who} "
                    f"at step {int(step_t[i])} ({t} tokens folded in; it has {e})"
                )
                writer_id, writer_step = writer, int(step_t[i])
            else:
                rel = "ahead" if t > e else "behind"
                kind, mech = WRONG_TOKENS, f"{read.what[i]}:temporal:{rel}"
                detail = (
                    f"request {name} {_verb(read.what[i])} its own temporal state with {t} "
                    f"tokens folded in where it has {e} (written at step {int(step_t[i])})"
                )
                writer_id, writer_step = name, int(step_t[i])
            self._report_read(step, read, i, g, blocks, kind, mech, detail, writer_id, writer_step)

    def _report_read(
        self,
        step: int,
        read: StateRead,
        i: int,
        g: int,
        blocks: np.ndarray,
        kind: str,
        mechanism: str,
        detail: str,
        writer_req_id: str | None,
        writer_step: int | None,
    ) -> None:
        uid = int(read.uid[i])
        self._report(
            uid,
            Finding(
                kind=kind,
                mechanism=mechanism,
                rank=self.rank,
                step=step,
                req_id=self.ids.name(uid),
                batch_row=int(read.rows[i]),
                detail=detail,
                group=g,
                block_id=int(blocks[i]),
                writer_req_id=writer_req_id,
                writer_step=writer_step,
            ),
        )

    def _check_conv(self, step: int, read: StateRead, g: int) -> None:
        blocks = read.conv_blocks[g]
        ok = blocks >= 0
        if not ok.any():
            return
        got_uid, got_pos, inside = self.pool.read_conv_rows(
            g, np.where(ok, blocks, 0), read.conv_offset, self.conv_keep
        )
        want_pos = read.expected_tokens[:, None] - self.conv_keep + np.arange(self.conv_keep)
        may_share = ~self.has_written(read.uid)
        uid_ok = (got_uid == read.uid[:, None]) | (may_share[:, None] & (got_uid > 0))
        pos_ok = got_pos == want_pos
        never = ok & ((got_uid == NO_REQUEST) & inside).any(axis=1)
        bad_uid = ok & ~(uid_ok | ~inside).all(axis=1)
        bad_pos = ok & ~bad_uid & ~(pos_ok | ~inside).all(axis=1)
        for i in np.flatnonzero(bad_uid | bad_pos).tolist():
            uid = int(read.uid[i])
            name = self.ids.name(uid)
            if never[i]:
                kind, mech = WRONG_TOKENS, f"{read.what[i]}:conv:unwritten"
                detail = f"request {name} {_verb(read.what[i])} conv rows no request has written"
                writer_id = None
            elif bad_uid[i]:
                j = int(np.argmax(~uid_ok[i] & inside[i]))
                writer = self.ids.name(int(got_uid[i, j]))
                kind, mech = FOREIGN_STATE, f"{read.what[i]}:conv"
                detail = f"request {name} {_verb(read.what[i])} conv rows of {writer}"
                writer_id = writer
            else:
                j = int(np.argmax(~pos_ok[i] & inside[i]))
                rel = "ahead" if got_pos[i, j] > want_pos[i, j] else "behind"
                kind, mech = WRONG_TOKENS, f"{read.what[i]}:conv:{rel}"
                detail = (
                    f"request {name} {_verb(read.what[i])} conv positions {int(got_pos[i, 0])}.."
                    f"{int(got_pos[i, -1])} where it needs {int(want_pos[i, 0])}.."
                    f"{int(want_pos[i, -1])}"
                )
                writer_id = name
            self._report_read(step, read, i, g, blocks, kind, mech, detail, writer_id, None)

    # ----------------------------------------------------------------- writes
    def check_writes(
        self,
        step: int,
        what: str,
        group: int,
        blocks: np.ndarray,
        uid: np.ndarray,
        rows: np.ndarray,
    ) -> None:
        """Writes into blocks another live request owns, and two rows hitting one block."""
        if not len(blocks):
            return
        blocks = np.asarray(blocks, dtype=np.int64)
        real = (blocks > NULL_BLOCK) & (blocks < self.ownership.num_blocks)
        owner = np.zeros(len(blocks), dtype=np.int64)
        owner[real] = self.ownership.owner[group, blocks[real]]
        bad = real & (owner != 0) & (owner != uid)
        for i in np.flatnonzero(bad).tolist():
            writer = self.ids.name(int(uid[i]))
            victim = self.ids.name(int(owner[i]))
            self._report(
                int(owner[i]),
                Finding(
                    kind=FOREIGN_BLOCK_WRITE,
                    mechanism=what,
                    rank=self.rank,
                    step=step,
                    req_id=victim,
                    batch_row=int(rows[i]),
                    detail=(
                        f"{'a padded row' if uid[i] == DUMMY_REQUEST else 'request ' + writer} "
                        f"writes block {int(blocks[i])}, owned by request {victim} since step "
                        f"{int(self.ownership.since[group, blocks[i]])}"
                    ),
                    group=group,
                    block_id=int(blocks[i]),
                    writer_req_id=writer,
                    writer_step=step,
                ),
            )
        live = blocks[real]
        if len(live) != len(np.unique(live)):
            vals, counts = np.unique(live, return_counts=True)
            for b in vals[counts > 1].tolist():
                hit = np.flatnonzero(blocks == b)
                names = sorted({self.ids.name(int(uid[i])) for i in hit})
                if len(names) < 2:
                    continue
                self._report(
                    int(uid[hit[0]]),
                    Finding(
                        kind=BLOCK_COLLISION,
                        mechanism=what,
                        rank=self.rank,
                        step=step,
                        req_id=names[0],
                        batch_row=int(rows[hit[0]]),
                        detail=f"rows of {', '.join(names)} write block {b} in one {what}",
                        group=group,
                        block_id=int(b),
                        writer_req_id=names[-1],
                        writer_step=step,
                    ),
                )
