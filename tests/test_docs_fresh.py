"""docs/trace-format.md is generated from the schemas; a stale copy fails here."""

from pathlib import Path

import pytest

from mgtrace.schemas.docgen import render

pytestmark = pytest.mark.unit

DOC = Path(__file__).resolve().parents[1] / "docs" / "trace-format.md"


def test_trace_format_doc_is_current() -> None:
    assert DOC.read_text() == render(), "run `make docs` to regenerate docs/trace-format.md"


def test_doc_names_every_column() -> None:
    from mgtrace.schemas.tables import TABLES

    text = render()
    for spec in TABLES.values():
        for name in spec.schema.names:
            assert f"`{name}`" in text
