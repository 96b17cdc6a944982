"""Run an optional recorder hook around one call, without an agent or a real session."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from types import SimpleNamespace
from typing import Any

from mgtrace.recorder import features
from mgtrace.recorder.hooks_common import optional_patches
from mgtrace.recorder.patches import PatchSet


@contextmanager
def optional_hook(owner_name: str, owner: Any) -> Iterator[SimpleNamespace]:
    """While open, ``owner`` (the class a V1 target names ``owner_name``) carries its
    optional hook, recording into the yielded session's ``rec``; no hook may fail."""
    target = next(t for t in features.V1_TARGETS if t.owner == owner_name)
    sess = SimpleNamespace(live=True, rec={}, failures=[])
    sess.hook_failed = lambda name, exc: sess.failures.append((name, exc))
    patches = PatchSet()
    patches.install(optional_patches(sess, {target: owner}))
    try:
        yield sess
    finally:
        patches.remove()
    assert sess.failures == []
