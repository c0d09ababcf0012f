"""A study's plain answer scoring (nothing attached, at most one token generated) evaluates its items'
prompts in batches: the same rows as one generation per item, on SmolLM2."""

from __future__ import annotations

import pytest
from hydra import compose, initialize_config_dir

from ember.run import CONF_DIR
from ember.runs.prepare import prepare
from ember.runs.study import Study


def study_of(model, *overrides: str) -> Study:
    with initialize_config_dir(config_dir=CONF_DIR, version_base="1.3"):
        cfg = compose(config_name="config", overrides=[*overrides, "threads=1", "mlflow=off"])
    return Study(prepare(cfg), model, recorder=None, say=print, progress=False)


@pytest.mark.parametrize("overrides", [
    ("data=capitals", "data.limit=6", "max_new_tokens=1"),
    ("data=capitals", "data.limit=3", "max_new_tokens=0"),
    ("data=sentiment", "data.limit=4", "max_new_tokens=1", "sampling=default", "sampling.temperature=1.5"),
    ("data=inline", "data.items=[Once upon a time,The weather today is,Hello]", "max_new_tokens=1"),
])
def test_batched_answer_scoring_equals_one_generation_per_item(smollm2, overrides):
    study = study_of(smollm2, *overrides)
    assert study._items_batched(study.prepared.run)
    items, run = study.plan.items, study.prepared.run
    batched = study._generate_batch(items, run)
    alone = [study._generate(item, run) for item in items]
    for a, b in zip(alone, batched, strict=True):
        assert a.row == b.row and a.key == b.key and a.series == b.series == {}
        assert a.values.keys() == b.values.keys()
        for name, value in a.values.items():
            # the batch's float32 rounding: logits within 1e-5 relative of their scale (~20)
            tolerance = 2e-4 if "logit" in name else 1e-6
            assert b.values[name] == pytest.approx(value, rel=1e-5, abs=tolerance), name
    if items[0].answer_ids:
        assert {"answer.prob", "answer.rank", "answer.correct"} <= alone[0].values.keys()


def test_per_item_experiments_or_generation_keep_one_generation_per_item(smollm2):
    def batched(*overrides: str) -> bool:
        study = study_of(smollm2, *overrides)
        return study._items_batched(study.prepared.run)

    assert not batched("data=capitals", "data.limit=2", "max_new_tokens=2")
    assert not batched("data=capitals", "data.limit=2", "max_new_tokens=1", "experiment=zero_layer",
                       "layer=3")
