"""Trace format: Arrow schemas, manifest, writer and reader."""

from mgtrace.schemas.manifest import Manifest, PartInfo, RunMetadata, StateLayout
from mgtrace.schemas.tables import SCHEMA_VERSION, TABLES, TableSpec

__all__ = [
    "SCHEMA_VERSION",
    "TABLES",
    "Manifest",
    "PartInfo",
    "RunMetadata",
    "StateLayout",
    "TableSpec",
]
