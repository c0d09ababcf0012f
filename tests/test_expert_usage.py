"""`expert_usage`: the experts a mixture-of-experts model's tokens take, counted at the router stage,
on the tiny Qwen3 mixture of tests/test_qwen3moe.py (a ban at one layer shows it counts the choice the
engine makes, not the router's unchanged one)."""

from __future__ import annotations

import numpy as np
import pytest

pytest.importorskip("torch")
pytest.importorskip("transformers")

from reference.ember_recorder import BoundaryRecorder  # noqa: E402
from test_qwen3moe import PROMPT, TOP_K, Ban, _model_and_file  # noqa: E402

import ember  # noqa: E402
from ember.experiments import ExperimentError, ModelContext  # noqa: E402
from ember.experiments.expert_usage import ExpertUsage  # noqa: E402
from ember.families.experts import route  # noqa: E402
from ember.phases import ModelFamily  # noqa: E402

pytestmark = pytest.mark.reference


def test_expert_usage_counts_the_choices_the_engine_makes(tmp_path) -> None:
    _, path = _model_and_file(tmp_path)
    model = ember.load_model(path)
    usage, recorder = ExpertUsage(), BoundaryRecorder()
    model.generate(PROMPT, max_new_tokens=3, temperature=0.0, add_bos=False, stop_at_eog=False,
                   experiments=[Ban(1, 0), recorder, usage])
    result = usage.results()
    counts = result.arrays["counts"]
    expected = np.zeros((3, 8), np.int64)
    for evaluation in recorder.evaluations:
        for layer, logits in enumerate(evaluation.router):
            expected[layer] += np.bincount(route(logits, TOP_K)[0].ravel(), minlength=8)
    assert np.array_equal(counts, expected)
    assert (counts.sum(axis=1) == TOP_K * (len(PROMPT) + 2)).all() and counts[1, 0] == 0  # the ban holds
    entropy = {m.step: m.value for m in result.metrics if m.name == "load_entropy"}
    shares = counts[2] / counts[2].sum()
    assert entropy[2] == pytest.approx(-(shares[shares > 0] * np.log2(shares[shares > 0])).sum())
    table = result.tables["choices"]
    assert len(table) == 3 * (len(PROMPT) + 2)
    first = next(r for r in table if r["position"] == 0 and r["layer"] == 2)
    assert first["experts"] == route(recorder.evaluations[0].router[2][:1], TOP_K)[0][0].tolist()
    assert sum(first["weights"]) == pytest.approx(1.0, abs=1e-5)
    assert result.figures["expert_load"].axes[0].get_images()[0].get_array().shape == (3, 8)


def test_expert_usage_refuses_a_model_without_experts() -> None:
    with pytest.raises(ExperimentError, match="tiny is not a mixture of experts"):
        ExpertUsage().on_model_loaded(ModelContext(ModelFamily.QWEN3, "tiny", "qwen3", 3, 64))

