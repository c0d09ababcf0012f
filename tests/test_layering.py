"""One direction of dependence (docs/architecture.md): importing a layer loads nothing above it. Each
check imports in a fresh interpreter and reads `sys.modules`."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

ENGINE = ["ember.config", "ember.families", "ember.ops", "ember.weights", "ember.kv_cache",
          "ember.quant.matrix", "ember.tracing", "ember.tokenizer", "ember.phases", "ember.stages"]
ABOVE_THE_ENGINE = ("ember.experiments", "ember.model", "ember.run", "ember.runs", "ember.tracking",
                    "ember.studies", "ember.inspection", "ember.cli", "hydra", "omegaconf", "mlflow")
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
