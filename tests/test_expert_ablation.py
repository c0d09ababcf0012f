"""`expert_ablation`: experts banned at the router stage, per layer or everywhere, against transformers
with the same experts' router logits set to −inf (the tiny qwen3moe of tests/test_qwen3moe.py and the
tiny Gemma 4 26B-A4B layout of tests/test_gemma4_moe.py); its mistakes in one line; `python -m ember.run
... experiment=expert_ablation 'experiments.0.experts=[3]'` swept over layers with the effect metrics."""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from reference.compare import relative_error  # noqa: E402
from reference.ember_recorder import BoundaryRecorder, record_generation  # noqa: E402
from reference.hf_capture import capture  # noqa: E402
from run_support import runs_of  # noqa: E402
from test_qwen3moe import DECODE_STEPS, PROMPT, TOP_K, _check_against, _model_and_file, _same_choices  # noqa: E402

import ember  # noqa: E402
from ember import run as runner  # noqa: E402
from ember.errors import ConfigError  # noqa: E402
from ember.experiments import ModelContext  # noqa: E402
from ember.experiments.expert_ablation import ExpertAblation  # noqa: E402
from ember.families.experts import route  # noqa: E402
from ember.phases import ModelFamily  # noqa: E402
from ember.runs import models  # noqa: E402

pytestmark = pytest.mark.reference

LAYERS, EXPERTS = 3, 8


def _ban_in_qwen3moe(hf_model, experts: list[int], layers: list[int]) -> None:
    """transformers' Qwen3MoeTopKRouter.forward with the experts' logits −inf before the softmax and top-k
    (the gate returns its own top-k, so a hook on its output would come too late)."""
    for layer in layers:
        gate = hf_model.model.layers[layer].mlp.gate

        def forward(hidden_states, gate=gate):
            logits = torch.nn.functional.linear(hidden_states.reshape(-1, gate.hidden_dim), gate.weight)
            logits[:, experts] = -torch.inf
            probabilities = torch.nn.functional.softmax(logits, dtype=torch.float, dim=-1)
            top, indices = torch.topk(probabilities, gate.top_k, dim=-1)
            top /= top.sum(dim=-1, keepdim=True)
            return logits, top.to(logits.dtype), indices

        gate.forward = forward


def _generate(model, experiments, steps: int = DECODE_STEPS + 1):
    recorder = BoundaryRecorder()
    generation = model.generate(
        PROMPT,
        max_new_tokens=steps,
        temperature=0.0,
        add_bos=False,
        experiments=[*experiments, recorder],
        stop_at_eog=False,
    )
    ours = recorder.evaluations
    sequence = PROMPT + list(generation.token_ids)
    for evaluation in ours:
        count = evaluation.before_layer[0].shape[0]
        evaluation.token_ids = sequence[evaluation.start_position : evaluation.start_position + count]
    return ours, list(generation.token_ids)


def _most_chosen(evaluation, layer: int, n: int) -> list[int]:
    counts = np.bincount(route(evaluation.router[layer], TOP_K)[0].ravel(), minlength=EXPERTS)
    return sorted(int(e) for e in np.argsort(-counts, kind="stable")[:n])


@pytest.mark.parametrize("where", ["layer 1", "everywhere"])
def test_qwen3moe_without_the_banned_experts_equals_transformers_without_them(where, tmp_path) -> None:
    hf_model, path = _model_and_file(tmp_path)
    model = ember.load_model(path)
    plain, _ = record_generation(model, PROMPT, 0)
    experts = _most_chosen(plain[0], 1, 2)  # the two experts most rows of the prompt take at layer 1
    layers = [1] if where == "layer 1" else list(range(LAYERS))
    ablation = ExpertAblation(experts=experts, layer=1 if where == "layer 1" else None)
    ours, generated = _generate(model, [ablation])

    for evaluation in ours:
        for layer in range(LAYERS):
            banned = np.isneginf(evaluation.router[layer][:, experts]).all()
            assert banned == (layer in layers), (evaluation.start_position, layer)
            if layer in layers:
                assert not np.isin(route(evaluation.router[layer], TOP_K)[0], experts).any()
    assert relative_error(ours[0].after_mlp[1], plain[0].after_mlp[1])[0] > 1e-2
    _ban_in_qwen3moe(hf_model, experts, layers)
    reference = capture(hf_model, PROMPT, generated[:DECODE_STEPS])
    _check_against(ours, reference, f"qwen3moe-expert_ablation-{where}")
    _same_choices(ours, reference)

    # what it reports: the choices the ban sent elsewhere, counted from the unbanned router logits
    result = ablation.results()
    metrics = {(m.name, m.step): m.value for m in result.metrics}
    rows = len(PROMPT) + DECODE_STEPS  # the prefill and the decode steps (the last token is not evaluated)
    assert metrics[("banned_rows", 0)] == rows * len(layers)
    table = result.tables["rerouted"]
    assert {(r["phase"], r["layer"], r["expert"]) for r in table} == {
        (phase, layer, e) for phase in ("prefill", "decode") for layer in layers for e in experts
    }
    first = layers[0]  # the first banned layer's prefill input is the clean model's
    rerouted = sum(r["rerouted"] for r in table if r["phase"] == "prefill" and r["layer"] == first)
    assert rerouted == np.isin(route(plain[0].router[first], TOP_K)[0], experts).sum() > 0
    assert metrics[("rerouted_choices", 0)] == sum(r["rerouted"] for r in table)
    assert metrics[("rerouted_by_layer", 1)] == sum(r["rerouted"] for r in table if r["layer"] == 1)


def test_gemma4_moe_without_the_banned_experts_everywhere_equals_transformers(tmp_path) -> None:
    from test_gemma4_moe import DECODE_STEPS as STEPS
    from test_gemma4_moe import PROMPT as G_PROMPT
    from test_gemma4_moe import _capture, _file, _hf
    from test_gemma4_moe import _check_against as check
    from test_gemma4_moe import _same_choices as same

    spec, state, path = _file(tmp_path)
    model = ember.load_model(path, context_length=64)
    experts = [0, 5]
    ablation = ExpertAblation(experts=experts)
    recorder = BoundaryRecorder()
    generation = model.generate(
        G_PROMPT,
        max_new_tokens=STEPS + 1,
        temperature=0.0,
        add_bos=False,
        experiments=[ablation, recorder],
        stop_at_eog=False,
    )
    ours = recorder.evaluations
    sequence = G_PROMPT + list(generation.token_ids)
    for evaluation in ours:
        count = evaluation.before_layer[0].shape[0]
        evaluation.token_ids = sequence[evaluation.start_position : evaluation.start_position + count]
        for logits in evaluation.router:
            assert np.isneginf(logits[:, experts]).all()
    assert ablation.results().metrics[0].value > 0  # the ban took choices away from both experts

    hf_model = _hf(spec, state)

    def ban(module, args, logits):
        logits = logits.clone()
        logits[:, experts] = -torch.inf
        return logits

    for layer in hf_model.model.layers:
        layer.router.proj.register_forward_hook(ban)
    reference = _capture(hf_model, list(generation.token_ids)[:STEPS])
    check(ours, reference, "gemma4-moe-expert_ablation")
    same(ours, reference, spec.num_hidden_layers)


def test_gpt_oss_without_the_banned_expert_equals_transformers_with_its_router_bias_at_minus_inf(
        tmp_path) -> None:
    """gpt-oss routes by the k largest biased logits, then a softmax over those k: a −inf logit (ember's
    ban at the router stage, transformers' router bias) never makes the k."""
    from reference.compare import compare_evaluations
    from test_gptoss_tiny import PROMPT as O_PROMPT
    from test_gptoss_tiny import TOLERANCE, load_file_weights_into_hf, tiny_gptoss, write_gptoss_gguf

    hf = tiny_gptoss()
    path = write_gptoss_gguf(hf, tmp_path / "tiny-gptoss.gguf")
    load_file_weights_into_hf(hf, path)
    model = ember.load_model(path)
    assert model.config.family is ModelFamily.GPT_OSS
    ablation = ExpertAblation(experts=[3])
    recorder = BoundaryRecorder()
    generation = model.generate(O_PROMPT, max_new_tokens=3, temperature=0.0, add_bos=False, stop_at_eog=False,
                                experiments=[ablation, recorder])
    sequence = O_PROMPT + list(generation.token_ids)
    for evaluation in recorder.evaluations:
        count = evaluation.before_layer[0].shape[0]
        evaluation.token_ids = sequence[evaluation.start_position:evaluation.start_position + count]
        for logits in evaluation.router:
            assert np.isneginf(logits[:, 3]).all()
    assert ablation.results().metrics[0].value > 0  # expert 3 lost choices to the ban

    with torch.no_grad():
        for layer in hf.model.layers:
            layer.mlp.router.bias[3] = -float("inf")
    reference = capture(hf, O_PROMPT, list(generation.token_ids)[:2])
    worst = compare_evaluations(recorder.evaluations, reference)
    assert all(w.relative <= TOLERANCE for w in worst.values()), worst


# ------------------------------------------------------------------------------------------- mistakes


def _context(experts: int = EXPERTS, top_k: int = TOP_K) -> ModelContext:
    family = ModelFamily.QWEN3MOE if experts else ModelFamily.QWEN3
    return ModelContext(
        family, "tiny", family.value, LAYERS, 64, expert_count=experts, experts_per_token=top_k
    )


@pytest.mark.parametrize(
    ("params", "context", "message"),
    [
        (dict(experts=[8]), {}, "expert 8 is outside the model: tiny has 8 experts per layer \\(0..7\\)"),
        (
            dict(experts=list(range(7))),
            {},
            "banning 7 of tiny's 8 experts leaves 1, fewer than the 2 each token takes",
        ),
        (dict(experts=[1], layer=3), {}, "layer 3 is outside the model: tiny has 3 layers \\(0..2\\)"),
        (
            dict(experts=[1]),
            dict(experts=0, top_k=0),
            "tiny is not a mixture of experts \\(family qwen3\\): it has no router",
        ),
    ],
)
def test_what_the_model_cannot_take_is_one_line(params, context, message) -> None:
    ablation = ExpertAblation(**params)
    with pytest.raises(ConfigError, match=message) as raised:
        ablation.on_model_loaded(_context(**context))
    assert "\n" not in str(raised.value)


@pytest.mark.parametrize(
    ("params", "message"),
    [
        (dict(), "expert_ablation needs `experts`"),
        (dict(experts=[]), "experts must be an index or a non-empty list"),
        (dict(experts=[-1]), "experts must be an index or a non-empty list"),
        (dict(experts=[1], phases="later"), "phases: 'later' is not one of"),
    ],
)
def test_bad_parameters_are_one_line(params, message) -> None:
    with pytest.raises(ConfigError, match=message):
        ExpertAblation(**params)


# ------------------------------------------------------------------------------------ the command line


@pytest.fixture
def moe_workdir(tmp_path, monkeypatch):
    from run_support import prepared_store

    prepared_store(tmp_path / "outputs")
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    monkeypatch.delenv("HYDRA_FULL_ERROR", raising=False)
    _, path = _model_and_file(tmp_path)
    return tmp_path, path


def test_swept_over_layers_from_the_command_line_with_the_effect_metrics(moe_workdir, capsys) -> None:
    workdir, path = moe_workdir
    models.clear()
    assert (
        runner.main(
            [
                "-m",
                "model=path",
                f"model.source={path}",
                "experiment=expert_ablation",
                "experiments.0.experts=[3]",
                "layer=range(0,3)",
                "prompt=the cat",
                "max_new_tokens=3",
                "stop_at_eog=false",
                "mlflow.experiment_name=t_moe",
            ]
        )
        == 0
    )
    children = [r for r in runs_of(workdir, "t_moe") if r.data.tags.get("mlflow.parentRunId")]
    assert sorted(r.data.params["experiments.0.layer"] for r in children) == ["0", "1", "2"]
    for run in children:
        assert run.info.status == "FINISHED"
        assert run.data.params["experiments.0.experts.0"] == "3"
        metrics = run.data.metrics
        assert "expert_ablation.rerouted_choices" in metrics and "expert_ablation.banned_rows" in metrics
        assert "effect.top1_agreement" in metrics and "effect.first_divergent_step" in metrics


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (
            ["experiments.0.experts=[8]"],
            "expert 8 is outside the model: tiny-qwen3moe-F32 has 8 experts",
        ),
        (
            ["experiments.0.experts=[0,1,2,3,4,5,6]"],
            "banning 7 of tiny-qwen3moe-F32's 8 experts leaves 1",
        ),
        (["experiments.0.experts=[1]", "layer=3"], "layer=3 is out of range"),
        ([], "expert_ablation needs `experts`"),
        (["experiments.0.experts=[1]", "model=smollm2_135m"], "is not a mixture of experts (family llama)"),
    ],
    ids=["expert past the model's", "fewer than top-k left", "layer past the model's", "no experts", "dense"],
)
def test_mistakes_on_the_command_line_are_one_line_and_exit_2(args, message, moe_workdir, capsys) -> None:
    _, path = moe_workdir
    model = [] if "model=smollm2_135m" in args else ["model=path", f"model.source={path}"]
    models.clear()
    code = runner.main([*model, "experiment=expert_ablation", *args, "mlflow.experiment_name=t_moe_bad"])
    # a first run on an empty cache also reports the default model's download: not part of the error
    lines = [line for line in capsys.readouterr().err.splitlines()
             if line.strip() and not line.startswith("ember: downloading ")]
    assert code == 2 and len(lines) == 1, lines
    assert lines[0].startswith("ember: ") and message in lines[0], lines
