"""The released checkpoint format: its tensor layout (`layout`) and a validating loader (`loader`)."""

from engine.checkpoint.layout import (
    SKIPPED_PREFIXES,
    SKIPPED_SUFFIXES,
    ReportRow,
    TensorSpec,
    component_of,
    expected_tensors,
    is_text_only_skippable,
    parameter_report,
)
from engine.checkpoint.loader import CheckpointError, load_checkpoint

__all__ = [
    "SKIPPED_PREFIXES",
    "SKIPPED_SUFFIXES",
    "CheckpointError",
    "ReportRow",
    "TensorSpec",
    "component_of",
    "expected_tensors",
    "is_text_only_skippable",
    "load_checkpoint",
    "parameter_report",
]
