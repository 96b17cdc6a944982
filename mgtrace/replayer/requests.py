"""Request ids as small integers: provenance tags and ownership maps store uids, not strings."""

from __future__ import annotations

from collections.abc import Iterable

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

NO_REQUEST = 0  # uid of "nobody": a zeroed tag, a free block
DUMMY_REQUEST = -1  # uid a padded (dummy) row writes with
PADDED_ROW = "<padded row>"  # the writer a finding names for a padded row
SCHEDULER = "<scheduler>"  # ... for the scheduler's own block copies
BUILDER = "<mamba builder>"  # ... for a split its rows do not tell apart


def is_request(name: str | None) -> bool:
    """Whether a finding's request name is an engine request, not one of the stand-ins above."""
    return bool(name) and not name.startswith("<")


def named_writer(name: str | None) -> str:
    """A finding's writer in a sentence: "request X", "a padded row", "the scheduler"."""
    if is_request(name):
        return f"request {name}"
    if name == PADDED_ROW:
        return "a padded row"
    return f"the {str(name).strip('<>')}"


class RequestIds:
    """Stable mapping between engine request ids and uids 1, 2, 3, ... in order of appearance."""

    def __init__(self) -> None:
        self._uid: dict[str, int] = {}
        self._names: list[str] = ["<none>"]

    def uid(self, req_id: str) -> int:
        uid = self._uid.get(req_id)
        if uid is None:
            uid = self._uid[req_id] = len(self._names)
            self._names.append(req_id)
        return uid

    def preload(self, names: Iterable[str]) -> None:
        """Assign uids 1, 2, ... to ``names`` in this order (a saved state uses them)."""
        for name in names:
            self.uid(name)

    @property
    def names(self) -> list[str]:
        return self._names[1:]

    def uids(self, req_ids: Iterable[str]) -> np.ndarray:
        return np.fromiter((self.uid(r) for r in req_ids), dtype=np.int32)

    def uids_of_column(self, column: pa.ChunkedArray) -> np.ndarray:
        """uids of a string column, looking each distinct id up once (a column read as
        dictionary codes: each chunk's dictionary, in order)."""
        if not len(column):
            return np.zeros(0, dtype=np.int32)
        parts = []
        for chunk in column.chunks:
            if not pa.types.is_dictionary(chunk.type):
                chunk = pc.dictionary_encode(chunk)  # ids in order of appearance
                table = self.uids(chunk.dictionary.to_pylist())
            else:  # uids in order of appearance too, not the dictionary's order
                seen = pc.unique(chunk.indices)
                table = np.zeros(len(chunk.dictionary), dtype=np.int32)
                table[seen.to_numpy(zero_copy_only=False)] = self.uids(
                    chunk.dictionary.take(seen).to_pylist()
                )
            parts.append(table[chunk.indices.to_numpy(zero_copy_only=False)])
        return np.concatenate(parts)

    def name(self, uid: int) -> str:
        if uid == DUMMY_REQUEST:
            return PADDED_ROW
        if 0 <= uid < len(self._names):
            return self._names[uid]
        return f"<uid {uid}>"

    def __len__(self) -> int:
        return len(self._names) - 1
