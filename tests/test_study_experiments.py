"""The built-in study experiments on SmolLM2, item by item (the runner's passes, without a job):
the readout (contract v0.2), logit lens, activation patching, ablation and steering."""

from __future__ import annotations

import numpy as np
import pytest

from ember.data import load_prompt_set, parse_data_spec
from ember.experiments import Experiment
from ember.experiments.ablation import Ablation
from ember.experiments.activation_patching import ActivationPatching
from ember.experiments.logit_lens import LogitLens, _top_k
from ember.experiments.readout import log_softmax
from ember.experiments.steering import Steering, make_direction
from ember.experiments.study import Evaluation
from ember.experiments.zero_layer_output import ZeroLayerOutput
from ember.rows import BatchEntry
from ember.runs.study import Evaluator, drive, evaluate_request, run_item, run_items, run_prepare
from ember.runs.study_plan import study_item


def items_of(model, name: str, limit: int):
    prompts = load_prompt_set(parse_data_spec({"path": f"ember:{name}.jsonl", "limit": limit}))
    return [study_item(i, item, model.tokenizer) for i, item in enumerate(prompts.items)]


class Residuals(Experiment):
    """Keeps every layer's prefill output rows and the last logits row."""

    name = "residuals"
    may_write = False

    def __init__(self) -> None:
        self.rows: dict[int, np.ndarray] = {}
        self.logits: np.ndarray | None = None

    def after_layer(self, ctx, hidden):
        if ctx.execution.phase.value == "prefill":
            self.rows[ctx.layer_index] = hidden.values().copy()

    def after_logits(self, ctx, logits):
        if self.logits is None:
            self.logits = logits.values().copy()


IDS = [504, 3575, 282, 4649, 314]  # "The capital of France is"


def test_readout_of_the_last_layer_is_the_models_logits_bit_for_bit(smollm2):
    seen = Residuals()
    smollm2.generate(IDS, max_new_tokens=1, experiments=[seen])
    readout = smollm2.model_context.readout
    last = readout.logits(seen.rows[smollm2.config.layer_count - 1])
    assert np.array_equal(last, smollm2.logits(IDS))           # every position, as one prefill gives them
    assert np.array_equal(last[-1], seen.logits[0])             # the generation's own after_logits row
    assert np.array_equal(readout.logits(seen.rows[29][-1]), seen.logits)   # one row alone
    assert readout.token_text([504, 3575]) == ["The", " capital"]
    with pytest.raises(ValueError, match="width 576"):
        readout.logits(np.zeros((2, 7), np.float32))


def test_readout_changes_nothing_in_the_engine(smollm2):
    before = smollm2.generate(IDS, max_new_tokens=4)

    class ReadEverything(Experiment):
        name = "read_everything"
        may_write = False

        def after_layer(self, ctx, hidden):
            ctx.execution.model.readout.logits(hidden.values())

    during = smollm2.generate(IDS, max_new_tokens=4, experiments=[ReadEverything()])
    after = smollm2.generate(IDS, max_new_tokens=4)
    assert before.token_ids == during.token_ids == after.token_ids


def test_logit_lens_last_layer_is_the_models_prediction(smollm2):
    item = items_of(smollm2, "capitals", 1)[0]
    lens = LogitLens(top_k=3, figure_items=1)
    result = run_item(smollm2, lens, item)
    layers = smollm2.config.layer_count
    # the lens is batched: its prompt is evaluated as a batch (of one here), whose logits it reports exactly
    evaluated = smollm2.evaluate_batch([BatchEntry(np.asarray(item.token_ids, np.int64))]).logits[0]
    expected = float(np.exp(log_softmax(evaluated))[item.answer_id])
    assert result.series["target_prob"][layers - 1] == pytest.approx(expected, abs=1e-12)
    generated = float(np.exp(log_softmax(smollm2.logits(list(item.token_ids))[-1]))[item.answer_id])
    assert result.series["target_prob"][layers - 1] == pytest.approx(generated, abs=1e-5)
    assert result.series["kl_to_final"][layers - 1] == pytest.approx(0.0, abs=1e-12)
    assert result.series["target_rank"][layers - 1] == 0.0  # SmolLM2 knows Paris
    assert len(result.series["target_prob"]) == layers
    results = lens.results()
    top = [r for r in results.tables["top_tokens"] if r["layer"] == layers - 1]
    assert [r["token"] for r in top][0] == " Paris" and len(top) == 3
    assert results.arrays["item0_target_probs"].shape == (layers, len(item.token_ids))
    assert "item0_layers_by_positions" in results.figures
    # the page: a table per mapped item, the last layer's row on top, its last cell the model's top token
    page = results.file_builders["logit_lens.html"]().decode("utf-8")
    first_row = page.split("<tbody><tr><th>")[1].split("</tr>")[0]
    assert first_row.startswith(f"{layers - 1}</th>") and first_row.count("<td") == len(item.token_ids)
    assert first_row.rsplit("<td", 1)[1].endswith("> Paris</td>")
    assert page.count("<table>") == 1


def test_logit_lens_items_batched_equal_one_at_a_time(smollm2):
    items = items_of(smollm2, "capitals", 6)
    alone = LogitLens(top_k=3, figure_items=2)
    one_by_one = [run_item(smollm2, alone, item) for item in items]
    together = LogitLens(top_k=3, figure_items=2)
    batched = run_items(smollm2, together, items)   # one batch, every layer's rows read out at once
    for a, b in zip(one_by_one, batched, strict=True):
        assert a.row == b.row and a.values["first_layer_top1"] == b.values["first_layer_top1"]
        series = {name: (np.array(list(a.series[name].values())), np.array(list(b.series[name].values())))
                  for name in a.series}
        # float32 rounding of batched products: logits of magnitude ~20 agree within 1e-5 relative of that
        np.testing.assert_allclose(*series["target_logit"], rtol=0, atol=2e-4)
        np.testing.assert_allclose(*series["target_prob"], rtol=0, atol=1e-5)
        np.testing.assert_allclose(*series["kl_to_final"], rtol=1e-4, atol=1e-4)
        assert np.abs(series["target_rank"][0] - series["target_rank"][1]).max() <= 1  # near ties may swap
    assert [r["item"] for r in together.results().tables["top_tokens"]] == \
        [r["item"] for r in alone.results().tables["top_tokens"]]
    maps_alone, maps_together = alone.results().arrays, together.results().arrays
    assert sorted(maps_together) == ["item0_target_probs", "item1_target_probs"] == sorted(maps_alone)
    for name, probs in maps_alone.items():
        np.testing.assert_allclose(maps_together[name], probs, rtol=0, atol=1e-5)


@pytest.mark.parametrize("k", [1, 5, 16, 17, 60])
def test_logit_lens_top_k_equals_a_stable_sort(k):
    """Both ways of taking the top k (arg-max passes for small k, a partition above) give the order of a
    stable descending sort: largest first, equal values by index."""
    logits = np.random.default_rng(k).standard_normal((7, 3000)).astype(np.float32)
    logits[2, [10, 20, 30]] = logits[2].max() + 1.0            # a tie at the top
    logits[4, :] = 0.5                                          # a row of equal values
    expected = np.argsort(-logits, axis=-1, kind="stable")[:, :k]
    np.testing.assert_array_equal(_top_k(logits, k), expected)


def test_patching_all_positions_restores_everything_and_none_nothing(smollm2):
    item = items_of(smollm2, "capitals", 1)[0]
    layers = [0, 15, 29]
    every = run_item(smollm2, ActivationPatching(sites=["residual"], layers=layers, span="all"), item)
    none = run_item(smollm2, ActivationPatching(sites=["residual"], layers=layers, span="none"), item)
    for layer in layers:
        assert every.series["residual.all"][layer] == pytest.approx(1.0, abs=1e-5)
        assert none.series["residual.none"][layer] == pytest.approx(0.0, abs=1e-5)  # float32 rounding
    assert every.values["logit_diff_clean"] > 0 > every.values["logit_diff_corrupted"]


def test_patching_per_position(smollm2):
    item = items_of(smollm2, "capitals", 1)[0]  # France -> Germany: only position 3 differs
    patching = ActivationPatching(sites=["residual", "mlp"], layers=[0, 20], figure_items=1)
    result = run_item(smollm2, patching, item)
    scores = patching.results().arrays["item0_restored"]       # [sites, layers, positions]
    assert scores.shape == (2, 2, len(item.token_ids))
    assert np.all(scores[:, :, :3] == 0.0)                      # identical prefix: nothing to restore
    assert scores[0, 0, 3] == pytest.approx(1.0, abs=1e-5)      # the clean embedding of ' France'
    assert result.series["residual.changed_last"][0] == scores[0, 0, 3]
    assert result.series["residual.last"][20] == scores[0, 1, 4]
    assert "mean_restored" in patching.results().figures


def test_patching_refuses_unequal_pairs(smollm2):
    from dataclasses import replace

    from ember.errors import ConfigError

    item = items_of(smollm2, "capitals", 1)[0]
    with pytest.raises(ConfigError, match="patching needs equal lengths"):
        ActivationPatching().check_items([replace(item, corrupted_ids=item.corrupted_ids + (13,))])
    with pytest.raises(ConfigError, match="same tokens"):
        ActivationPatching().check_items([replace(item, corrupted_ids=item.token_ids)])
    with pytest.raises(ConfigError, match="has no corrupted"):
        ActivationPatching().check_items([replace(item, corrupted=None, corrupted_ids=None)])


def test_zero_ablation_is_zero_layer_output(smollm2):
    ablation = Ablation(layer=4, target="mlp", mode="zero")
    zero = ZeroLayerOutput(layer=4, target="mlp")
    a = smollm2.generate(IDS, max_new_tokens=3, experiments=[ablation, Residuals()])
    b = smollm2.generate(IDS, max_new_tokens=3, experiments=[zero])
    assert a.token_ids == b.token_ids
    assert ablation.results().metrics[0].value == 3  # prefill + two decode steps


def test_mean_ablation_uses_the_prompt_set_means(smollm2):
    items = items_of(smollm2, "capitals", 3)
    ablation = Ablation(layer=2, target="both", mode="mean")

    class Outputs(Experiment):
        name = "outputs"
        may_write = False

        def __init__(self):
            self.rows = []

        def after_attention(self, ctx, tensor):
            if ctx.layer_index == 2:
                self.rows.append(tensor.values().copy())

    run_prepare(smollm2, ablation, items)
    seen = Outputs()
    for item in items:
        drive(_single(item), lambda request: evaluate_request(smollm2, seen, request))
    later = np.concatenate([rows[1:] for rows in seen.rows])
    first = np.stack([rows[0] for rows in seen.rows])
    means = ablation._means[("attention", 2)]
    np.testing.assert_allclose(means[1], later.mean(axis=0), rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(means[0], first.mean(axis=0), rtol=1e-5, atol=1e-6)
    # applied: every ablated row holds the mean
    smollm2.generate(list(items[0].token_ids), max_new_tokens=1, experiments=[ablation])
    assert ablation.results().tables["means"][0]["rows_averaged"] == sum(len(i.token_ids) for i in items)


def _single(item):
    yield Evaluation(item.token_ids)


def one_at_a_time(model, experiment):
    """Answers a study generator's requests one sequence at a time, never as a batch."""
    def answer(request):
        if isinstance(request, list):
            return [evaluate_request(model, experiment, r) for r in request]
        return evaluate_request(model, experiment, request)
    return answer


def test_mean_ablation_batched_equals_one_at_a_time(smollm2):
    items = items_of(smollm2, "capitals", 6)
    batched, single = (Ablation(layer=[1, 3], target="both", mode="mean") for _ in range(2))
    run_prepare(smollm2, batched, items)
    drive(single.prepare_study(items), one_at_a_time(smollm2, single))
    assert set(batched._means) == set(single._means) == {(s, x) for s in ("attention", "mlp") for x in (1, 3)}
    for key, mean in single._means.items():
        # 1e-5 of the values' scale (float32 summation order differs between batch and single products)
        scale = float(np.abs(mean).max())
        np.testing.assert_allclose(batched._means[key], mean, rtol=1e-5, atol=1e-5 * scale)
        np.testing.assert_array_equal(batched._counts[key], single._counts[key])
    # applied to the items as one batch and one at a time: the same logits, ablated everywhere alike
    together = Evaluator(smollm2, batched).answer([(0, Evaluation(item.token_ids)) for item in items])
    alone = [evaluate_request(smollm2, single, Evaluation(item.token_ids)) for item in items]
    for a, b in zip(together, alone, strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5 * float(np.abs(b).max()))
    clean = smollm2.logits(list(items[0].token_ids))[-1]
    assert float(np.abs(alone[0] - clean).max()) > 0.1  # the ablation does change the logits
    assert batched.results().metrics == single.results().metrics  # ablated tensors: 4 sites × 6 items
    # read at a few logits (`Evaluation.logit_ids`): those alone, in the order asked, on both paths
    ids = (items[0].answer_id, 7, items[0].wrong_answer_id, 7)
    few = Evaluator(smollm2, batched).answer([(0, Evaluation(items[0].token_ids, logit_ids=ids))])[0]
    one = evaluate_request(smollm2, single, Evaluation(items[0].token_ids, logit_ids=ids))
    scale = float(np.abs(alone[0]).max())
    np.testing.assert_allclose(one, alone[0][list(ids)], rtol=0, atol=1e-6 * scale)
    np.testing.assert_allclose(few, alone[0][list(ids)], rtol=0, atol=1e-5 * scale)
    from ember.errors import ConfigError

    with pytest.raises(ConfigError, match="logit_ids .* outside the vocabulary"):
        evaluate_request(smollm2, single, Evaluation(items[0].token_ids, logit_ids=(-1,)))


def test_direction_methods_on_known_differences():
    rng = np.random.default_rng(0)
    truth = rng.normal(size=16)
    truth /= np.linalg.norm(truth)
    diffs = np.outer(rng.uniform(1.0, 3.0, size=40), truth) + 0.05 * rng.normal(size=(40, 16))
    mean = make_direction(diffs, "mean_diff")
    np.testing.assert_allclose(mean, diffs.mean(axis=0).astype(np.float32))
    pca = make_direction(diffs, "pca")
    cosine = float(pca @ truth / np.linalg.norm(pca))
    assert cosine > 0.999                                      # the component, signed like the mean
    assert np.linalg.norm(pca) == pytest.approx(float(np.linalg.norm(diffs.mean(axis=0))), rel=0.01)


@pytest.mark.parametrize(("pool", "method"), [("last", "pca"), ("mean", "mean_diff")])
def test_steering_directions_from_batched_pairs_equal_one_prompt_at_a_time(smollm2, pool, method):
    items = items_of(smollm2, "sentiment", 5)
    steering = Steering(layers=[3, 9], pool=pool, method=method)
    run_prepare(smollm2, steering, items)
    diffs: dict[int, list[np.ndarray]] = {3: [], 9: []}
    scale = 0.0  # the residuals' size: a pair's difference keeps their absolute rounding, not a relative one
    for item in items:
        sides = []
        for ids in (item.token_ids, item.corrupted_ids):
            seen = Residuals()
            smollm2.generate(list(ids), max_new_tokens=0, experiments=[seen])
            sides.append(seen.rows)
        for layer, found in diffs.items():
            pooled = [rows[layer][-1] if pool == "last" else rows[layer].mean(axis=0) for rows in sides]
            scale = max(scale, *(float(np.abs(p).max()) for p in pooled))
            found.append(pooled[0].astype(np.float64) - pooled[1].astype(np.float64))
    for layer, found in diffs.items():
        expected = make_direction(np.stack(found), method)
        np.testing.assert_allclose(steering.directions[layer], expected, rtol=1e-5, atol=1e-5 * scale)


def test_steering_at_scale_zero_changes_nothing_and_a_fit_moves_sentiment(smollm2, tmp_path):
    items = items_of(smollm2, "sentiment", 4)
    steering = Steering(layers=[10, 12], scale=0.0, save=str(tmp_path / "sentiment.gguf"))
    run_prepare(smollm2, steering, items)
    assert set(steering.directions) == {10, 12}
    clean = smollm2.generate(list(items[0].corrupted_ids), max_new_tokens=4)
    steered = smollm2.generate(list(items[0].corrupted_ids), max_new_tokens=4, experiments=[steering])
    assert clean.token_ids == steered.token_ids
    # towards the positive side: the " good" - " bad" logit difference rises on the negative prompts
    push = Steering(vector=str(tmp_path / "sentiment.gguf"), scale=4.0)
    assert push.layers == (10, 12)
    good, bad = items[0].answer_id, items[0].wrong_answer_id
    rises = []
    for item in items:
        ids = list(item.corrupted_ids)
        base = smollm2.logits(ids)[-1]
        pushed = evaluate_request(smollm2, push, Evaluation(ids))
        rises.append((pushed[good] - pushed[bad]) - (base[good] - base[bad]))
    assert min(rises) > 0
