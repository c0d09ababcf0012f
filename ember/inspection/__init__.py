"""Inspection surfaces: layer/logits dumps, hidden-state extraction, linear probes.

They look at the model without changing it, through `BoundaryRecorder`, a hooks adapter passed to the
engine as its observer (never together with experiments: see `refusal`).
"""

from ember.inspection.dumps import DumpResult, dump_generation, load_dump
from ember.inspection.extraction import (
    PromptSet,
    extract_hidden_states,
    read_prompt_set,
    resolve_layers,
    save_states,
)
from ember.inspection.probes import ProbeReport, log_probe_report, probe_layers
from ember.inspection.recorder import STAGES, BoundaryRecorder, Record, pool_rows
from ember.inspection.refusal import SURFACES, ExperimentConflictError, refuse_with_experiments

__all__ = [
    "STAGES",
    "SURFACES",
    "BoundaryRecorder",
    "DumpResult",
    "ExperimentConflictError",
    "PromptSet",
    "ProbeReport",
    "Record",
    "dump_generation",
    "extract_hidden_states",
    "load_dump",
    "log_probe_report",
    "pool_rows",
    "probe_layers",
    "read_prompt_set",
    "refuse_with_experiments",
    "resolve_layers",
    "save_states",
]
