"""The oracle: compares the tags a request is about to build on with what it should be.

Expectations come from the request's own counts. A request whose running state covers ``E``
verified tokens must find, in its temporal state, its own uid and ``E`` tokens folded in,
and in the conv rows it reads the positions ``E-K+1 .. E-1`` (K-1 = the conv window without
the speculative slots). A state written by another request is legitimate only as a prefix
hit: before the request has written any state of its own since it was added (or re-added
after a preemption), with exactly ``E`` tokens folded.

Each finding names a mechanism without ids or numbers, so that its signature
(``kind:mechanism``) stays the same across runs and can pin a minimization.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
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
from mgtrace.replayer.requests import DUMMY_REQUEST, NO_REQUEST, SCHEDULER, RequestIds
from mgtrace.replayer.tags import TEMPORAL_TAG_INTS, TagPool

# StateRead.what codes. A cached state is the block-boundary state a post-process saves into
# a column other than the running one: nobody reads it until a prefix-cache hit or a resume,
# so it is checked where it is written.
READ_KINDS = ("decode-read", "prefill-read", "next-state", "cached-state")
_VERBS = {"next-state": "will read next", "cached-state": "keeps for the prefix cache"}


def _findings_by_code(
    codes: tuple[tuple[str, str], ...],
) -> tuple[tuple[tuple[str, str, str], ...], ...]:
    """[read kind][finding code] -> (kind, mechanism, signature), made once: the checks look
    a bad row's finding up instead of formatting its names."""
    return tuple(
        tuple((kind, f"{what}:{m}", f"{kind}:{what}:{m}") for kind, m in codes)
        for what in READ_KINDS
    )


# finding codes: 0 never written, 1 another request's, 2 and 3 its own, ahead and behind
_TEMPORAL_FINDINGS = _findings_by_code(
    (
        (WRONG_TOKENS, "temporal:unwritten"),
        (FOREIGN_STATE, "temporal"),
        (WRONG_TOKENS, "temporal:ahead"),
        (WRONG_TOKENS, "temporal:behind"),
    )
)
_CONV_FINDINGS = _findings_by_code(
    (
        (WRONG_TOKENS, "conv:unwritten"),
        (FOREIGN_STATE, "conv"),
        (WRONG_TOKENS, "conv:ahead"),
        (WRONG_TOKENS, "conv:behind"),
    )
)


def _finding_codes(
    unwritten: np.ndarray, foreign: np.ndarray, ahead: np.ndarray, rows: np.ndarray
) -> list[int]:
    """The finding code of each of ``rows``, the first that holds in that order."""
    code = np.where(ahead[rows], 2, 3)
    code[foreign[rows]] = 1
    code[unwritten[rows]] = 0
    return code.tolist()


def _verb(what: str) -> str:
    return _VERBS.get(what, "reads")


def _wants(what: str, tokens: int) -> str:
    """What the state should cover, as a finding says it."""
    if what == "cached-state":
        return f"the block boundary is at {tokens}"
    return f"it has {tokens}"


def _positions(pos: np.ndarray) -> str:
    """A conv window's positions: ``a..b`` where they run on one by one, else each of them
    (a window a partial write left mixed, 3309, 3307, 3308, is no range 3309..3308)."""
    if (np.diff(pos) == 1).all():
        return f"{int(pos[0])}..{int(pos[-1])}"
    return ", ".join(str(int(x)) for x in pos)


@dataclass
class StateRead:
    """Rows about to read state: where, and what they should find there."""

    what: np.ndarray  # per row, mechanism prefix as a code into READ_KINDS
    rows: np.ndarray  # batch rows
    uid: np.ndarray
    expected_tokens: np.ndarray  # E per row
    temporal_blocks: np.ndarray  # [groups, rows]
    conv_blocks: np.ndarray  # [groups, rows]
    conv_offset: np.ndarray  # first conv row read, per row
    # Per row: the request has no state of its own yet, so a prefix share is legal. Taken
    # when the read happens (a deferred check runs after later steps have written).
    may_share: np.ndarray | None = None

    def kind(self, i: int) -> str:
        return READ_KINDS[int(self.what[i])]

    def subset(self, sel: np.ndarray) -> StateRead:
        return StateRead(
            what=self.what[sel],
            rows=self.rows[sel],
            uid=self.uid[sel],
            expected_tokens=self.expected_tokens[sel],
            temporal_blocks=self.temporal_blocks[:, sel],
            conv_blocks=self.conv_blocks[:, sel],
            conv_offset=self.conv_offset[sel],
            may_share=None if self.may_share is None else self.may_share[sel],
        )


@dataclass
class _PendingRead:
    """A read whose tags were gathered on the device and are checked at the next flush."""

    clock: int  # the report order it takes among the immediate checks
    step: int
    read: StateRead
    inside: np.ndarray
    shape: tuple[int, ...]


@dataclass
class Oracle:
    rank: int
    ids: RequestIds
    pool: TagPool
    ownership: BlockOwnership
    conv_keep: int  # conv rows a read relies on (K-1)
    # A trace that began mid-run: a block it never saw written may hold state from before
    # the recording, whose writer no replay can know, so such a read is left unchecked.
    unwritten_unknown: bool = False
    # Check reads in bulk at ``flush`` (the tags are gathered at read time on the device):
    # the replay then waits for the device once per flush instead of once per read.
    defer_reads: bool = False
    findings: list[Finding] = field(default_factory=list)
    repeats: dict[tuple[int, str], int] = field(default_factory=dict)
    wrote: np.ndarray = field(default_factory=lambda: np.zeros(1024, dtype=bool))
    # Log mode (a segment replayed from a start state of placeholders, ``parallel``): the
    # report attempts go to ``events`` in order, each key once (later attempts are counted
    # in ``repeats``), and a read that meets a word below ``placeholder_below`` is logged
    # there unchecked, for the process that knows the words to check.
    events: list[tuple] | None = None
    placeholder_below: int | None = None

    def __post_init__(self) -> None:
        self._keep_range = np.arange(self.conv_keep)
        # Window positions relative to E: a read of E tokens wants E-K+1 .. E-1 (K-1 rows).
        self._keep_offsets = self._keep_range - self.conv_keep
        self._clock = 0  # advances with every immediate report and every deferred read
        self._report_clock: int | None = None  # set while a deferred read reports
        self._keys: list[tuple[int, int]] = []  # per finding: (clock, order within it)
        self._pending: list[_PendingRead] = []

    def mark_written(self, uids: np.ndarray) -> None:
        """These requests now have a state of their own (a prefix share is no longer legal)."""
        if len(uids) and uids.max() >= len(self.wrote):
            grown = np.zeros(max(2 * len(self.wrote), int(uids.max()) + 1), dtype=bool)
            grown[: len(self.wrote)] = self.wrote
            self.wrote = grown
        self.wrote[uids] = True

    def start_over(self, uids: np.ndarray) -> None:
        """These requests were re-added after a preemption: they let go of every block, so
        like new ones they have no state of their own and may start from a prefix hit."""
        inside = uids[(uids >= 0) & (uids < len(self.wrote))]
        self.wrote[inside] = False

    def has_written(self, uids: np.ndarray) -> np.ndarray:
        inside = (uids >= 0) & (uids < len(self.wrote))
        return inside & self.wrote[np.where(inside, uids, 0)]

    def _report(self, uid: int, f: Finding) -> None:
        key = (uid, f.signature)
        seen = self.repeats.get(key, 0)
        self.repeats[key] = seen + 1
        if seen:  # a corrupted request stays corrupted: report its first occurrence only
            return
        if self.events is not None:
            self.events.append(("report", key, f))
            return
        del self._keys[len(self.findings) :]  # callers may truncate findings (restore)
        if self._report_clock is None:
            self._clock += 1
            self._keys.append((self._clock, 0))
        else:
            self._keys.append((self._report_clock, len(self._keys)))
        self.findings.append(f)

    def _first_occurrences(
        self,
        read: StateRead,
        rows: np.ndarray,
        codes: list[int],
        findings: tuple[tuple[tuple[str, str, str], ...], ...],
    ) -> Iterator[tuple[int, int, str, str, str]]:
        """(row, uid, read kind, finding kind, mechanism) of each of ``rows`` whose finding
        (``findings[read kind][code]``) its request has not had yet; a repeat is counted."""
        whats = read.what[rows].tolist()
        for i, uid, what, code in zip(
            rows.tolist(), read.uid[rows].tolist(), whats, codes, strict=True
        ):
            kind, mechanism, signature = findings[what][code]
            if not self._repeated(uid, signature):
                yield i, uid, READ_KINDS[what], kind, mechanism

    def _repeated(self, uid: int, signature: str) -> bool:
        """Count one more occurrence of a finding already reported for ``uid`` and say so,
        before its detail is written: a corrupted request repeats its findings step after
        step (over a million times in a long buggy trace), and only the first is kept."""
        key = (uid, signature)
        seen = self.repeats.get(key)
        if seen:
            self.repeats[key] = seen + 1
        return bool(seen)

    def forget_reports(self) -> None:
        """Start reporting afresh (where a step window begins): every key's next occurrence
        is reported again, and repeats are counted from here on. Deferred reads are checked
        first, so that their reports belong to the steps before."""
        self.flush()
        self.findings = []
        self.repeats = {}
        self._keys = []
        if self.events is not None:
            self.events = []

    def start_log(self, placeholder_below: int | None) -> None:
        """Log mode from here on, with nothing reported or repeated so far."""
        self.flush()
        self.findings = []
        self.repeats = {}
        self._keys = []
        self.events = []
        self.placeholder_below = placeholder_below

    # ----------------------------------------------------------------- reads
    def check_reads(self, step: int, read: StateRead) -> None:
        """Every row must find its own state with exactly E tokens; the few rows that do not
        go through the detailed checks, which tell prefix hits from foreign reads."""
        if not len(read.rows):
            return
        at, inside = self._read_index(read)
        if self.defer_reads:
            self._clock += 1
            read.may_share = ~self.has_written(read.uid)
            self.pool.gather_later(at)
            self._pending.append(_PendingRead(self._clock, step, read, inside, at.shape))
            return
        self._check_tags(step, read, self.pool.gather(at), inside)

    def flush(self) -> None:
        """Check the deferred reads (one transfer back from the device), in read order."""
        pending, self._pending = self._pending, []
        if not pending:
            return
        before = len(self.findings)
        tags = self.pool.collect([p.shape for p in pending])
        for p, t in zip(pending, tags, strict=True):
            self._report_clock = p.clock
            try:
                self._check_tags(p.step, p.read, t, p.inside)
            finally:
                self._report_clock = None
        if len(self.findings) > before:  # put them where an immediate check would have
            del self._keys[len(self.findings) :]
            order = sorted(range(len(self.findings)), key=self._keys.__getitem__)
            self.findings[:] = [self.findings[i] for i in order]
            self._keys[:] = [self._keys[i] for i in order]

    def discard_pending(self) -> None:
        """Drop deferred reads not yet checked (a restore rewinds past them)."""
        self._pending = []
        self.pool.discard_gathered()

    def _read_index(self, read: StateRead) -> tuple[np.ndarray, np.ndarray]:
        """Word indices [groups, rows, fields] of every tag the read checks, and which conv
        rows lie inside the window [groups, rows, keep]."""
        if len(self.pool.groups) == 1:  # the common case: no stacking of groups
            gs = self.pool.groups[0]
            at, inside = self.pool.read_index(
                0,
                read.temporal_blocks[0],
                read.conv_blocks[0],
                read.conv_offset,
                self.conv_keep if gs.conv is not None else 0,
            )
            return at[None], inside[None]
        parts = [
            self.pool.read_index(
                g,
                read.temporal_blocks[g],
                read.conv_blocks[g],
                read.conv_offset,
                self.conv_keep if gs.conv is not None else 0,
            )
            for g, gs in enumerate(self.pool.groups)
        ]
        if len(parts) == 1:
            return parts[0][0][None], parts[0][1][None]
        width = max(p[0].shape[1] for p in parts)
        at = np.zeros((len(parts), len(read.rows), width), dtype=np.int64)
        inside = np.zeros((len(parts), len(read.rows), self.conv_keep), dtype=bool)
        for g, (a, ins) in enumerate(parts):
            at[g, :, : a.shape[1]] = a
            inside[g, :, : ins.shape[1]] = ins
        return at, inside

    def _check_tags(self, step: int, read: StateRead, tags: np.ndarray, inside: np.ndarray) -> None:
        """``tags`` [groups, rows, fields]: the words ``_read_index`` addresses."""
        if self.placeholder_below is not None and self._meets_placeholder(read, tags):
            if read.may_share is None:  # as the check would take it now
                read.may_share = ~self.has_written(read.uid)
            self.events.append(("check", step, read, tags, inside))
            return
        keep = self.conv_keep
        suspect = np.zeros(len(read.rows), dtype=bool)
        for g, gs in enumerate(self.pool.groups):
            t = tags[g]
            if gs.temporal is not None:
                ok = read.temporal_blocks[g] >= 0
                suspect |= ok & ((t[:, 0] != read.uid) | (t[:, 1] != read.expected_tokens))
            if gs.conv is not None and keep > 0:
                ok = read.conv_blocks[g] >= 0
                uids, pos = t[:, TEMPORAL_TAG_INTS : TEMPORAL_TAG_INTS + keep], t[:, -keep:]
                want = read.expected_tokens[:, None] + self._keep_offsets
                # A row is suspect when a window row inside the window is not the one it needs.
                wrong = (uids != read.uid[:, None]) | (pos != want)
                wrong &= inside[g]
                suspect |= ok & wrong.any(axis=1)
        # count_nonzero and nonzero: a fraction of the cost of .any() and flatnonzero here.
        if not np.count_nonzero(suspect):
            return
        sel = suspect.nonzero()[0]
        detail = read.subset(sel)
        if detail.may_share is None:
            detail.may_share = ~self.has_written(detail.uid)
        for g, gs in enumerate(self.pool.groups):
            t = tags[g][sel]
            if gs.temporal is not None:
                self._check_temporal(step, detail, g, t[:, :TEMPORAL_TAG_INTS])
            if gs.conv is not None and keep > 0:
                self._check_conv(
                    step,
                    detail,
                    g,
                    t[:, TEMPORAL_TAG_INTS : TEMPORAL_TAG_INTS + keep],
                    t[:, -keep:],
                    inside[g][sel],
                )

    def check_logged(
        self, step: int, read: StateRead, tags: np.ndarray, inside: np.ndarray
    ) -> None:
        """Judge a read that another process logged, on the words its placeholders name."""
        self._check_tags(step, read, tags, inside)

    def _meets_placeholder(self, read: StateRead, tags: np.ndarray) -> bool:
        """Whether a row with a block has a placeholder among its words (whatever the word
        is used for: the details name positions and writer steps too)."""
        for g in range(len(self.pool.groups)):
            hit = (tags[g] < self.placeholder_below).any(axis=1)
            hit &= (read.temporal_blocks[g] >= 0) | (read.conv_blocks[g] >= 0)
            if np.count_nonzero(hit):
                return True
        return False

    def _check_temporal(self, step: int, read: StateRead, g: int, got: np.ndarray) -> None:
        blocks = read.temporal_blocks[g]
        ok = blocks >= 0
        tags = np.where(ok[:, None], got, 0).astype(np.int64)
        uid_t, tok_t, step_t = tags[:, 0], tags[:, 1], tags[:, 2]
        mine = uid_t == read.uid
        prefix = ~mine & read.may_share & (tok_t == read.expected_tokens)
        prefix &= uid_t > 0
        unwritten = ok & (uid_t == NO_REQUEST)
        foreign = ok & ~mine & ~prefix & ~unwritten
        wrong = ok & mine & (tok_t != read.expected_tokens)
        judged = foreign | wrong if self.unwritten_unknown else foreign | wrong | unwritten
        rows = np.flatnonzero(judged)
        codes = _finding_codes(unwritten, foreign, tok_t > read.expected_tokens, rows)
        for i, uid, what, kind, mech in self._first_occurrences(
            read, rows, codes, _TEMPORAL_FINDINGS
        ):
            e, t = int(read.expected_tokens[i]), int(tok_t[i])
            name = self.ids.name(uid)
            if unwritten[i]:
                detail = (
                    f"request {name} {_verb(what)} a temporal state no request has written "
                    f"(block {int(blocks[i])}); {_wants(what, e)} tokens"
                )
                writer_id, writer_step = None, None
            elif foreign[i]:
                writer = self.ids.name(int(uid_t[i]))
                who = "a padded row" if uid_t[i] == DUMMY_REQUEST else f"request {writer}"
                detail = (
                    f"request {name} {_verb(what)} a temporal state written by {who} "
                    f"at step {int(step_t[i])} ({t} tokens folded in; {_wants(what, e)})"
                )
                writer_id, writer_step = writer, int(step_t[i])
            else:
                detail = (
                    f"request {name} {_verb(what)} its own temporal state with {t} "
                    f"tokens folded in where {_wants(what, e)} (written at step {int(step_t[i])})"
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

    def _check_conv(
        self,
        step: int,
        read: StateRead,
        g: int,
        got_uid: np.ndarray,
        got_pos: np.ndarray,
        inside: np.ndarray,
    ) -> None:
        blocks = read.conv_blocks[g]
        ok = blocks >= 0
        if not ok.any():
            return
        want_pos = read.expected_tokens[:, None] - self.conv_keep + np.arange(self.conv_keep)
        if self.unwritten_unknown:  # window rows never seen written are not judged
            inside = inside & (got_uid != NO_REQUEST)
        may_share = read.may_share
        pos_ok = got_pos == want_pos
        # another request's conv rows are a legal prefix share only at the positions the
        # reader needs (as a shared temporal state must hold exactly E tokens); at others
        # they are that request's state, named as its writer, not the reader's own
        uid_ok = (got_uid == read.uid[:, None]) | (may_share[:, None] & (got_uid > 0) & pos_ok)
        never = ok & ((got_uid == NO_REQUEST) & inside).any(axis=1)
        bad_uid = ok & ~(uid_ok | ~inside).all(axis=1)
        bad_pos = ok & ~bad_uid & ~(pos_ok | ~inside).all(axis=1)
        rows = np.flatnonzero(bad_uid | bad_pos)
        # the first window row inside the window at a wrong position, per row
        first_off = np.argmax(~pos_ok & inside, axis=1)
        at = np.arange(len(first_off))
        ahead = got_pos[at, first_off] > want_pos[at, first_off]
        codes = _finding_codes(never, bad_uid, ahead, rows)
        for i, uid, what, kind, mech in self._first_occurrences(read, rows, codes, _CONV_FINDINGS):
            name = self.ids.name(uid)
            if never[i]:
                detail = f"request {name} {_verb(what)} conv rows no request has written"
                writer_id = None
            elif bad_uid[i]:
                j = int(np.argmax(~uid_ok[i] & inside[i]))
                writer = self.ids.name(int(got_uid[i, j]))
                detail = f"request {name} {_verb(what)} conv rows of {writer}"
                writer_id = writer
            else:
                detail = (
                    f"request {name} {_verb(what)} conv positions {_positions(got_pos[i])} "
                    f"where it needs {_positions(want_pos[i])}"
                )
                writer_id = name
            self._report_read(step, read, i, g, blocks, kind, mech, detail, writer_id, None)

    # ----------------------------------------------------------------- writes
    def _behind_note(self, owner: int, group: int, block: int) -> str:
        # say when the block sits behind the column the owner now runs at: not yet freed,
        # but a deferred post-process or the prefix cache is its only possible reader
        behind = self.ownership.column_behind(owner, group, block)
        return (
            ""
            if behind is None
            else f" (its column {behind[0]}; it now runs at column {behind[1]})"
        )

    def check_copy_destinations(self, step: int, src: np.ndarray, dst: np.ndarray) -> None:
        """The scheduler's block copies (copy-on-write of a partial prefix hit) land on a block
        it allocated in this very step. One that lands on a block another live request has
        held since an earlier step overwrites that request's state. ``dst``: ids in the pool."""
        for group in range(self.ownership.owner.shape[0]):
            owner = self.ownership.owner_or_free(group, dst)
            since = self.ownership.since[group][dst]
            for i in np.flatnonzero((owner != NO_REQUEST) & (since < step)).tolist():
                block, victim = int(dst[i]), self.ids.name(int(owner[i]))
                self._report(
                    int(owner[i]),
                    Finding(
                        kind=FOREIGN_BLOCK_WRITE,
                        mechanism="block-copy",
                        rank=self.rank,
                        step=step,
                        req_id=victim,
                        batch_row=None,
                        detail=(
                            f"the scheduler's copy of block {int(src[i])} writes block {block}, "
                            f"owned by request {victim} since step {int(since[i])}"
                            f"{self._behind_note(int(owner[i]), group, block)}"
                        ),
                        group=group,
                        block_id=block,
                        writer_req_id=SCHEDULER,
                        writer_step=step,
                    ),
                )

    def check_sources(
        self,
        step: int,
        what: str,
        blocks: np.ndarray,
        read: np.ndarray,
        uid: np.ndarray,
        rows: np.ndarray,
        freed_now: Mapping[tuple[int, int], int] | None = None,
        into: np.ndarray | None = None,
    ) -> None:
        """Reads of state from a block the reading request's scheduler row does not name, or
        from the null block: no prefix share, whatever the block's tags say.

        ``blocks``: [group, kind, row] block ids read; ``read``: bool [group, kind], the
        kinds each group has (an id at a kind the group lacks is never read). ``freed_now``:
        (group, block) -> the request whose scheduling freed it at this step (still its
        state for a post-process deferred to this step). ``into``: [group, row], a copy's
        destination blocks; a copy matters here only where it lands in the reader's own
        block (one into the null block moves nothing anyone reads, one into another's block
        is a foreign write, reported as such). Owned blocks pass at numpy speed, every group
        and kind at once; only the rest (shared prefix blocks, a block freed this step) are
        looked up one by one."""
        if not blocks.size:
            return
        # Ids outside the pool (negative ones too, as unsigned) map to num_blocks: free.
        unsigned = blocks.view(np.dtype(f"u{blocks.dtype.itemsize}"))
        clamped = np.minimum(unsigned, self.ownership.num_blocks).view(blocks.dtype)
        owner = self.ownership.owners(clamped)
        odd = owner != uid
        if not np.count_nonzero(odd):  # most steps: every read is of an owned block
            return
        odd &= (uid >= 0) & (blocks >= 0) & read[:, :, None]
        if not np.count_nonzero(odd):
            return
        for g, k, i in zip(*np.nonzero(odd), strict=True):
            group, u, b = int(g), int(uid[i]), int(blocks[g, k, i])
            if self._own_block(u, group, b, freed_now):
                continue
            if into is not None and not self._own_block(u, group, int(into[g, i]), freed_now):
                continue
            name = self.ids.name(u)
            null = b == NULL_BLOCK
            self._report(
                u,
                Finding(
                    kind=FOREIGN_STATE,
                    mechanism=f"{what}:{'null-block' if null else 'not-held'}",
                    rank=self.rank,
                    step=step,
                    req_id=name,
                    batch_row=int(rows[i]),
                    detail=(
                        f"request {name} reads state from "
                        + (
                            "the null block, where the engine keeps no state"
                            if null
                            else f"block {b}, which the scheduler has not given it"
                        )
                    ),
                    group=group,
                    block_id=b,
                ),
            )

    def _own_block(
        self, uid: int, group: int, block: int, freed_now: Mapping[tuple[int, int], int] | None
    ) -> bool:
        """Whether ``block`` is ``uid``'s state: held now, or freed by its scheduling at this
        step."""
        if self.ownership.holds(uid, group, block):
            return True
        return bool(freed_now) and freed_now.get((group, block)) == uid

    def check_writes(
        self,
        step: int,
        what: str,
        group: int,
        blocks: np.ndarray,
        uid: np.ndarray,
        rows: np.ndarray,
        owned_until_now: Mapping[tuple[int, int], int] | None = None,
    ) -> None:
        """Writes into blocks another live request owns, and two rows hitting one block.

        ``owned_until_now`` maps (group, block) to the request that held the block until this
        step's scheduling freed it: a write by that request, ordered before the step's own
        use of its blocks, is its own."""
        if not len(blocks):
            return
        blocks = np.asarray(blocks, dtype=np.int64)
        num_blocks = self.ownership.num_blocks
        # Ids outside the pool (negative ones too, as unsigned) map to num_blocks, which like
        # the null block nobody owns.
        clamped = np.minimum(blocks.view(np.uint64), num_blocks).view(np.int64)
        owner = self.ownership.owner_or_free(group, clamped)
        bad = (owner != 0) & (owner != uid)
        for i in bad.nonzero()[0].tolist() if np.count_nonzero(bad) else ():
            if owned_until_now and owned_until_now.get((group, int(blocks[i]))) == uid[i]:
                continue
            writer = self.ids.name(int(uid[i]))
            victim = self.ids.name(int(owner[i]))
            note = self._behind_note(int(owner[i]), group, int(blocks[i]))
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
                        f"{int(self.ownership.since[group, blocks[i]])}{note}"
                    ),
                    group=group,
                    block_id=int(blocks[i]),
                    writer_req_id=writer,
                    writer_step=step,
                ),
            )
        ordered = np.sort(clamped)
        same = ordered[1:] == ordered[:-1]  # a sort and a compare: cheaper than np.unique
        # Repeats of the null block or of ids outside the pool are no collision; most writes
        # repeat no block at all, which one count settles.
        if np.count_nonzero(same) and np.count_nonzero(
            same & (ordered[1:] > NULL_BLOCK) & (ordered[1:] < num_blocks)
        ):
            live = blocks[(blocks > NULL_BLOCK) & (blocks < num_blocks)]
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
