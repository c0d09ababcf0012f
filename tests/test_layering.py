"""One direction of dependence (docs/architecture.md): importing a layer loads nothing above it. Each
check imports in a fresh interpreter and reads `sys.modules`."""

from __future__ import annotations

import ast
import json
import subprocess
import sys
from pathlib import Path

import pytest

ENGINE = ["ember.config", "ember.families", "ember.ops", "ember.weights", "ember.kv_cache",
          "ember.quant.matrix", "ember.tracing", "ember.tokenizer", "ember.phases", "ember.stages"]
ABOVE_THE_ENGINE = ("ember.experiments", "ember.model", "ember.run", "ember.runs", "ember.records",
                    "ember.studies", "ember.inspection", "ember.cli", "ember.sources", "hydra", "omegaconf",
                    "mlflow")
ABOVE_THE_CONTRACT = (*(m for m in ABOVE_THE_ENGINE if m != "ember.experiments"), "matplotlib")


def loaded_by(*modules: str) -> list[str]:
    code = (f"import importlib, json, sys\nfor m in {list(modules)!r}: importlib.import_module(m)\n"
            "print(json.dumps(sorted(sys.modules)))")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout)


def above(loaded: list[str], prefixes: tuple[str, ...]) -> list[str]:
    return [m for m in loaded if any(m == p or m.startswith(p + ".") for p in prefixes)]


@pytest.mark.parametrize("module", ENGINE)
def test_the_engine_loads_no_experiment_runner_or_records(module: str):
    assert above(loaded_by(module), ABOVE_THE_ENGINE) == []


def test_the_hook_contract_loads_neither_the_model_nor_hydra_nor_mlflow():
    assert above(loaded_by("ember.experiments"), ABOVE_THE_CONTRACT) == []


def test_the_contract_shares_the_engine_s_enums():
    import ember.experiments as ex
    from ember import phases

    assert ex.ModelFamily is phases.ModelFamily and ex.ExecutionPhase is phases.ExecutionPhase


# The engine's own files: whatever they import, at load or inside a function, lies at or below them.
PACKAGE = Path(__file__).resolve().parent.parent / "ember"
ENGINE_FILES = sorted({PACKAGE / f for f in ("config.py", "ops.py", "weights.py", "kv_cache.py", "tracing.py",
                                             "phases.py", "gguf_file.py", "paths.py")}
                      | set((PACKAGE / "families").glob("*.py")) | set((PACKAGE / "quant").glob("*.py"))
                      | set((PACKAGE / "tokenizer").glob("*.py")))


def imported_names(path: Path) -> set[str]:
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module:
            names.add(node.module)
            names.update(f"{node.module}.{alias.name}" for alias in node.names)
    return names


@pytest.mark.parametrize("path", ENGINE_FILES, ids=lambda p: str(p.relative_to(PACKAGE)))
def test_no_engine_file_imports_what_lies_above_it_even_inside_a_function(path: Path):
    assert above(sorted(imported_names(path)), ABOVE_THE_ENGINE) == []


# The records are written for the runner and the studies, which hand them what to record: settings as
# plain values, a summary function.
RECORDS = ["ember.records.store", "ember.records.values", "ember.records.tracker", "ember.records.outbox",
           "ember.records.heartbeat", "ember.records.run", "ember.records.sweep"]
ABOVE_THE_RECORDS = ("ember.runconfig", "ember.run", "ember.runs", "ember.studies", "ember.inspection",
                     "ember.cli", "hydra", "omegaconf")


def test_the_records_load_neither_the_runner_nor_the_studies():
    assert above(loaded_by(*RECORDS), ABOVE_THE_RECORDS) == []


@pytest.mark.parametrize("path", sorted((PACKAGE / "records").glob("*.py")), ids=lambda p: p.name)
def test_no_records_file_imports_the_runner_or_the_studies_even_inside_a_function(path: Path):
    assert above(sorted(imported_names(path)), ABOVE_THE_RECORDS) == []
