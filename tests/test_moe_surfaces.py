"""Everything else works on a mixture-of-experts file (issue 26, point 5): `ember generate --dump-layers`,
`ember extract` (the router stage too), `ember probe`, and studies over a prompt set through
`python -m ember.run` (logit_lens, activation_patching, expert_usage with expert_ablation), on the tiny
qwen3moe GGUF of tests/test_qwen3moe.py."""

from __future__ import annotations

import json

import numpy as np
import pytest

pytest.importorskip("torch")
pytest.importorskip("transformers")

from run_support import runs_of  # noqa: E402
from test_qwen3moe import _model_and_file  # noqa: E402

from ember import cli  # noqa: E402
from ember import run as runner  # noqa: E402
from ember.runs import models  # noqa: E402
from ember.stages import model_layer_names  # noqa: E402

pytestmark = pytest.mark.reference

LAYERS, EXPERTS, HIDDEN = 3, 8, 64
ITEMS = [  # clean and corrupted prompts of the same token count in the tiny vocabulary; one-token answers
    {"prompt": "is on", "corrupted": "is in", "answer": " the", "wrong_answer": " a", "label": 1},
    {"prompt": "it is on", "corrupted": "it is in", "answer": " the", "wrong_answer": " a", "label": 0},
]


@pytest.fixture(scope="module")
def moe_file(tmp_path_factory):
    folder = tmp_path_factory.mktemp("moe-surfaces")
    _, path = _model_and_file(folder)
    prompts = folder / "prompts.jsonl"
    prompts.write_text("".join(json.dumps(item) + "\n" for item in ITEMS * 2))
    return folder, path, prompts


def test_dumps_extract_and_probe_on_a_mixture_of_experts(moe_file, tmp_path) -> None:
    folder, path, prompts = moe_file
    model = ["--model", str(path), "--no-mlflow", "--quiet"]
    dump = tmp_path / "dump"
    assert (
        cli.main(
            [
                "generate",
                "is on",
                "--max-new-tokens",
                "2",
                "--dump-layers",
                "--dump-logits",
                "--dump-dir",
                str(dump),
                *model,
            ]
        )
        == cli.EXIT_OK
    )
    with np.load(dump / "layers.npz") as layers:
        routers = sorted(name for name in layers.files if "router" in name)
        assert len(routers) == 2 * LAYERS  # the prefill and one decode step, every layer
        assert all(layers[name].shape[-1] == EXPERTS for name in routers)

    for stage, width in (("router", EXPERTS), ("after_mlp", HIDDEN)):
        out = tmp_path / f"{stage}.npz"
        assert cli.main(["extract", str(prompts), "--stage", stage, "--out", str(out), *model]) == cli.EXIT_OK
        with np.load(out) as saved:
            assert saved["states"].shape == (len(ITEMS) * 2, LAYERS, width)
            assert np.isfinite(saved["states"]).all()

    assert cli.main(["probe", str(prompts), "--folds", "2", "--stage", "router", *model]) == cli.EXIT_OK


@pytest.mark.parametrize("experiment", ["logit_lens", "activation_patching", "expert_usage"])
def test_a_study_over_two_items_runs_on_a_mixture_of_experts(experiment, moe_file, monkeypatch) -> None:
    from run_support import prepared_store

    folder, path, prompts = moe_file
    work = folder / experiment
    prepared_store(work / "outputs")
    monkeypatch.chdir(work)
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    monkeypatch.delenv("HYDRA_FULL_ERROR", raising=False)
    models.clear()
    extra = (
        ["+experiments=[{name:expert_ablation,experts:[0,1]},{name:expert_usage}]"]
        if experiment == "expert_usage"
        else [f"experiment={experiment}"]
    )
    assert (
        runner.main(
            [
                "model=path",
                f"model.source={path}",
                "data=file",
                f"data.path={prompts}",
                "data.limit=2",
                *extra,
                "max_new_tokens=1",
                f"mlflow.experiment_name=t_{experiment}",
            ]
        )
        == 0
    )
    (run,) = [r for r in runs_of(work, f"t_{experiment}") if r.info.status == "FINISHED"]
    metrics = run.data.metrics
    assert metrics["study.items"] == 2
    expected = {
        "logit_lens": ["logit_lens.target_prob", "logit_lens.kl_to_final"],
        "activation_patching": ["activation_patching.mlp.max", "activation_patching.residual.max"],
        # the ban's effect per item against the clean model, the counts made under the ban
        "expert_usage": [
            "effect.kl_mean",
            "answer.prob_delta",
            "expert_ablation.rerouted_choices",
            "expert_usage.load_entropy",
        ],
    }[experiment]
    assert set(expected) <= set(metrics), sorted(metrics)
    assert all(np.isfinite(metrics[key]) for key in expected)


def test_the_router_stage_is_one_of_the_file_s_stages(moe_file) -> None:
    import ember

    _, path, _ = moe_file
    assert "router" in model_layer_names(ember.load_model(path).config)
