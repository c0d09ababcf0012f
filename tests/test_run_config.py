"""The runner's config: every conf/ option composes and validates; mistakes give one readable message.

No model is loaded here: these check `ember.runconfig` and the Hydra configs themselves.
"""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pytest
import yaml
from hydra import compose, initialize_config_dir

from ember.errors import ConfigError, ContextLengthError
from ember.experiments import BUILTIN_EXPERIMENTS, ActivationStats, ZeroLayerOutput
from ember.run import CONF_DIR
from ember.runconfig import build_experiments, check_model_fit, parse_run_config
from ember.runs.effect import intervention_effect
from ember.runs.prepare import run_name

REPO = Path(__file__).resolve().parent.parent


def composed(*overrides: str):
    with initialize_config_dir(config_dir=CONF_DIR, version_base="1.3"):
        return compose(config_name="config", overrides=list(overrides))


def parsed(*overrides: str):
    return parse_run_config(composed(*overrides))


def test_default_config_is_smollm2_plain_generation():
    run = parsed()
    assert run.model.source == "smollm2-135m" and run.model.family == "llama"
    assert run.experiments == () and run.max_new_tokens > 0 and run.sampling.temperature == 0.0
    assert run.mlflow.enabled and run.mlflow.tracking_uri is None


EXPERIMENT_CONFIGS = sorted(Path(CONF_DIR, "experiment").glob("*.yaml"))


def test_the_experiment_configs_are_found():
    assert {"none", "zero_layer", "steering"} <= {path.stem for path in EXPERIMENT_CONFIGS}


# What a config cannot choose for the user (expert_ablation: which experts to ban).
REQUIRED = {"expert_ablation": ("experiments.0.experts=[3]",)}


@pytest.mark.parametrize("path", EXPERIMENT_CONFIGS, ids=lambda path: path.stem)
def test_every_experiment_config_composes_and_builds(path, monkeypatch):
    """Each conf/experiment/*.yaml, found here: a new file is a new case. `layer=7` for those that take it
    (and the parameters a config leaves for the user to give, REQUIRED)."""
    monkeypatch.syspath_prepend(str(REPO))  # the top-level experiments/ folder
    entries = yaml.safe_load(path.read_text())["experiments"]
    run = parsed(f"experiment={path.stem}", "layer=7", *REQUIRED.get(path.stem, ()))
    assert [spec.label for spec in run.experiments] == [e.get("name") or e["_target_"] for e in entries]
    built = build_experiments(run.experiments, BUILTIN_EXPERIMENTS, layer_count=30)
    assert len(built) == len(entries)
    for entry, experiment in zip(entries, built, strict=True):
        if "${layer}" in (entry.get("layer"), entry.get("layers")):
            reached = getattr(experiment, "layers", None) or (experiment.layer,)  # a researcher's: `layer`
            assert reached == (7,), (entry, reached)


def test_other_groups_compose():
    assert parsed("model=gemma3_270m").model.source == "gemma3-270m"
    assert parsed("model=path", "model.source=/x/y.gguf").model.source == "/x/y.gguf"
    assert parsed("sampling=default").sampling.top_k == 40
    assert not parsed("mlflow=off").mlflow.enabled
    assert parsed().data is None
    capitals = parsed("data=capitals", "data.limit=5").data
    assert capitals.path == "ember:capitals.jsonl" and capitals.limit == 5 and capitals.name == "capitals"
    assert parsed("data=inline").data.items[0]["answer"] == " Paris"
    chat = parsed("+messages=[{role:user,content:hi}]")
    assert chat.messages == ({"role": "user", "content": "hi"},)


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (["max_new_tokens=abc"], "max_new_tokens must be an integer, got 'abc'"),
        (["max_new_tokens=-1"], "max_new_tokens must be at least 0, got -1"),
        (["max_new_tokens=true"], "max_new_tokens must be an integer"),
        (["sampling.temperature=-1"], "sampling.temperature must be in [0, inf)"),
        (["sampling.top_p=0"], "sampling.top_p must be in (0, 1]"),
        (["sampling.top_k=1.5"], "sampling.top_k must be an integer"),
        (["intervention_effect=maybe"], "intervention_effect must be true or false"),
        (["threads=0"], "threads must be at least 1"),
        (["model=path"], "model.source has no value"),
        (["prompt="], "prompt is empty"),
        (["+foo=1"], "unknown config key 'foo'"),
        (["+model.typo=1"], "unknown key model.typo"),
        (["+messages=[{role:robot,content:hi}]"], "messages[0].role must be one of"),
        (["experiments=[{layer:1}]"], "needs exactly one of `name`"),
        (["experiments=[{_target_:nodots}]"], "must be a dotted path"),
    ],
)
def test_bad_values_are_named(overrides, message):
    with pytest.raises(ConfigError) as caught:
        parsed(*overrides)
    assert message in str(caught.value)
    assert "\n" not in str(caught.value)


def build(*overrides: str, layer_count: int = 30):
    return build_experiments(parsed(*overrides).experiments, BUILTIN_EXPERIMENTS, layer_count)


def test_ablation_takes_heads_without_a_layer():
    (ablation,) = build("experiment=ablation", "experiments.0.heads=[[9,3],[9,1],[2,0]]")
    assert ablation.heads == {2: (0,), 9: (1, 3)} and ablation.layers == ()
    with pytest.raises(ConfigError, match="needs `layer`"):
        build("experiment=ablation")


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (["experiment=zero_layer", "layer=30"], "layer=30 is out of range: this model has 30 layers (0..29)"),
        (["experiment=zero_layer", "layer=-1"], "layer=-1 is out of range"),
        (["experiment=zero_layer"], "needs a value for 'layer': add layer=N with N in 0..29"),
        (["experiment=zero_layer", "layer=seven"], "layer must be an integer, got 'seven'"),
        (["experiments=[{name:zero_layer_output,layer:seven}]"], "must be a layer index"),
        (["experiment=zero_layer", "layer=1", "experiments.0.target=head"], "target 'head' is not one of"),
        (["experiment=zero_layer", "layer=1", "+experiments.0.strength=2"], "has no parameter 'strength'"),
        (["experiments=[{name:zero_layer_output,layer:[1,40]}]"], "layer[1]=40 is out of range"),
        (["experiments=[{name:nope}]"], "unknown experiment 'nope' in experiments[0]; built-in experiments: "
                                        "ablation, activation_patching, activation_stats, "
                                        "attention_patterns, direct_logit_attribution, expert_ablation, "
                                        "expert_usage, "
                                        "head_patching, logit_lens, path_patching, steering, zero_layer "
                                        "(alias zero_layer_output)"),
        (["experiments=[{name:zero_layr,layer:1}]"],
         "unknown experiment 'zero_layr' in experiments[0] (did you mean zero_layer?)"),
        (["experiments=[{name:zero_layer,layer:1,tagret:mlp}]"], "has no parameter 'tagret' (did you mean "
                                                                 "target?)"),
        (["experiments=[{_target_:no_such_module.Thing}]"], "cannot import module 'no_such_module'"),
        (["experiments=[{_target_:ember.errors.ConfigError}]"], "is not an ember.experiments.Experiment"),
        (["experiments=[{name:activation_stats,phases:sometimes}]"], "'sometimes' is not one of"),
    ],
)
def test_bad_experiments_are_named(overrides, message):
    with pytest.raises(ConfigError) as caught:
        build(*overrides)
    assert message in str(caught.value)


def test_builtins_build_with_their_parameters():
    zero, stats = build("experiment=stats_and_zero", "layer=4", "+experiments.0.target=mlp")
    assert isinstance(zero, ZeroLayerOutput) and zero.layers == (4,) and zero.target == "mlp"
    assert isinstance(stats, ActivationStats)


def test_model_fit_checks_family_layer_and_lengths():
    run = parsed("layer=3")
    fit = dict(path="m.gguf", architecture="llama", family="llama", layer_count=30, context_length=64)
    run = parsed("layer=3", "model.context_length=null")
    check_model_fit(run, **fit, prompt_token_count=5)
    with pytest.raises(ConfigError, match="model.family is 'gemma3' but m.gguf is a llama model"):
        check_model_fit(parsed("model=gemma3_270m"), **fit)
    with pytest.raises(ConfigError, match="layer=31 is out of range"):
        check_model_fit(parsed("layer=31"), **fit)
    with pytest.raises(ContextLengthError, match="max_new_tokens=64 cannot fit"):
        check_model_fit(parsed("max_new_tokens=64", "model.context_length=null"), **fit)
    with pytest.raises(ContextLengthError, match=r"the prompt \(60 tokens\) plus max_new_tokens=16"):
        check_model_fit(run, **fit, prompt_token_count=60)
    with pytest.raises(ContextLengthError, match=r"holds \(32: model.context_length=32; this model supports"):
        check_model_fit(parsed("model.context_length=32"), **fit, prompt_token_count=20)
    with pytest.raises(ContextLengthError, match="longer than the model's trained context"):
        check_model_fit(parsed("model.context_length=100"), **fit)


def test_run_names_show_experiment_parameters_that_differ_from_defaults():
    run = parsed("experiment=zero_layer", "layer=7")
    experiments = build_experiments(run.experiments, BUILTIN_EXPERIMENTS, 30)
    assert run_name(run.experiments, experiments, "smollm2-135m") == "zero_layer_output[layer=7] smollm2-135m"
    assert run_name((), [], "smollm2-135m") == "generate smollm2-135m"


def test_intervention_effect_kl_agreement_and_first_divergence():
    rng = np.random.default_rng(0)
    clean = rng.standard_normal((5, 50)).astype(np.float32)
    same = intervention_effect(clean, clean.copy())
    assert same.vacuous and same.first_divergent_step == -1 and np.allclose(same.kl, 0.0, atol=1e-9)

    changed = clean.copy()
    changed[3] = -changed[3]  # flips the argmax at step 3 only
    effect = intervention_effect(clean, changed)
    assert not effect.vacuous and effect.first_divergent_step == 3
    assert effect.top1_agree.tolist() == [True, True, True, False, True]
    assert effect.kl[3] > 0.1 and np.allclose(effect.kl[[0, 1, 2, 4]], 0.0, atol=1e-9)
    # KL(p || q) against a direct computation
    p = np.exp(clean[3] - clean[3].max()) / np.exp(clean[3] - clean[3].max()).sum()
    q = np.exp(changed[3] - changed[3].max()) / np.exp(changed[3] - changed[3].max()).sum()
    assert math.isclose(effect.kl[3], float((p * np.log(p / q)).sum()), rel_tol=1e-5)
