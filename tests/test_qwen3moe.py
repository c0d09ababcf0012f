"""The `qwen3moe` family (mixture of experts) against transformers' Qwen3MoeForCausalLM, float32.

A tiny random model (3 layers, 8 experts of which each token takes 2, norm_topk_prob on) is written as
GGUF the way llama.cpp's converter writes Qwen3-30B-A3B (tests/reference/gguf_writer.py), loaded in
ember and greedy-generated through a recording Experiment (a prefill, then single-token decode steps);
HF runs the same tokens with forward hooks. Compared, per evaluation and layer, within 1e-4 relative
(max|Δ| / max|ref|): the residual entering the layer, attention output, MLP (mixture) output, layer
output, final norm and logits, and the router logits; the experts chosen must be HF's.

The Q8_0 file's experts are multiplied from their blocks (views of the mapped file, one per expert);
HF gets gguf-py's dequantization of the same file. The router stage is writable: banning an expert
(−inf) is checked against HF whose router is patched by hand to do the same.
"""

from __future__ import annotations

import gguf
import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from reference.compare import compare_evaluations, relative_error  # noqa: E402
from reference.ember_recorder import BoundaryRecorder, record_generation  # noqa: E402
from reference.gguf_writer import load_gguf_weights_into_hf, rewrite_gguf, write_gguf  # noqa: E402
from reference.hf_capture import capture  # noqa: E402
from reference.tiny_models import tiny_qwen3, tiny_qwen3moe  # noqa: E402

import ember  # noqa: E402
from ember.errors import ConfigError, GGUFError  # noqa: E402
from ember.experiments import Experiment  # noqa: E402
from ember.families.experts import route  # noqa: E402
from ember.families.qwen3moe import Qwen3MoeConfig  # noqa: E402
from ember.inspection.extraction import extract_hidden_states  # noqa: E402
from ember.phases import ModelFamily  # noqa: E402
from ember.quant.matrix import QuantizedMatrix  # noqa: E402

pytestmark = pytest.mark.reference

TOLERANCE = 1e-4
DECODE_STEPS = 5
TOP_K = 2
PROMPT = [40, 71, 100, 33, 259, 120, 87, 66, 200, 5, 44, 45, 46, 47, 48, 49, 50, 51, 52, 53, 262, 270]
F32, Q8_0 = gguf.GGMLQuantizationType.F32, gguf.GGMLQuantizationType.Q8_0


def _model_and_file(tmp_path, qtype=F32):
    hf_model = tiny_qwen3moe(top_k=TOP_K)
    path = write_gguf(hf_model, tmp_path / f"tiny-qwen3moe-{qtype.name}.gguf", qtype=qtype)
    if qtype != F32:
        load_gguf_weights_into_hf(hf_model, path)  # HF gets gguf-py's dequantization of the file
    return hf_model, path


def _check_against(ours, reference, label: str) -> None:
    worst = compare_evaluations(ours, reference)
    print("\n" + "\n".join(f"  {label} {w}" for w in worst.values()))
    failures = [str(w) for w in worst.values() if not w.relative <= TOLERANCE]
    assert not failures, f"{label}: relative error above {TOLERANCE}:\n" + "\n".join(failures)


def _same_choices(ours, reference) -> None:
    """ember's router logits match HF's and pick HF's experts, row by row, in every layer."""
    for mine, theirs in zip(ours, reference, strict=True):
        assert len(mine.router) == len(theirs.router) == 3
        for layer, (logits, hf_logits, hf_chosen) in enumerate(zip(mine.router, theirs.router, theirs.chosen,
                                                                   strict=True)):
            finite = np.isfinite(hf_logits)  # a banned expert's logit is −inf in both
            assert np.array_equal(np.isfinite(logits), finite), (mine.start_position, layer)
            assert relative_error(np.where(finite, logits, 0), np.where(finite, hf_logits, 0))[0] <= TOLERANCE
            chosen, _ = route(logits, TOP_K)
            assert np.array_equal(np.sort(chosen, axis=1), np.sort(hf_chosen, axis=1)), (mine.start_position,
                                                                                       layer)


@pytest.mark.parametrize("qtype", [F32, Q8_0], ids=["f32", "q8_0"])
def test_every_boundary_and_choice_matches_transformers(qtype, tmp_path) -> None:
    hf_model, path = _model_and_file(tmp_path, qtype)
    model = ember.load_model(path)
    assert isinstance(model.config, Qwen3MoeConfig) and model.config.family is ModelFamily.QWEN3MOE
    assert (model.config.expert_count, model.config.expert_used_count, model.config.feed_forward_length) == (
        8, TOP_K, 64)
    ours, generated = record_generation(model, PROMPT, DECODE_STEPS)
    reference = capture(hf_model, PROMPT, generated[:DECODE_STEPS])
    _check_against(ours, reference, f"qwen3moe-{qtype.name}")
    _same_choices(ours, reference)
    # the routing is exercised: the prompt's tokens spread over most experts in every layer
    for logits in ours[0].router:
        assert len(np.unique(route(logits, TOP_K)[0])) >= 6


def test_expert_kernels_read_each_expert_s_blocks_as_gguf_py(tmp_path) -> None:
    """Each expert of a Q8_0 3-D tensor is a view of its own blocks: decoded bit-identical to gguf-py's
    dequantization of that expert, and multiplied as the decoded matrix is (one row, a few, a prefill:
    the three product paths of `ember.quant.matrix`)."""
    _, path = _model_and_file(tmp_path, Q8_0)
    reader = gguf.GGUFReader(path)
    tensor = next(t for t in reader.tensors if t.name == "blk.1.ffn_down_exps.weight")
    assert tensor.tensor_type == Q8_0
    expected = gguf.dequantize(tensor.data, tensor.tensor_type)  # [experts, H, F]
    model = ember.load_model(path)
    experts = model._forward.weights.layers[1].expert_down
    assert len(experts) == expected.shape[0] == 8
    rng = np.random.default_rng(0)
    for e, matrix in enumerate(experts):
        assert isinstance(matrix, QuantizedMatrix) and matrix.shape == expected.shape[1:]
        assert np.array_equal(matrix.dequantize(), expected[e])
        for rows in (1, 5, 70):
            x = rng.standard_normal((rows, matrix.shape[1])).astype(np.float32)
            out = matrix.matmul(x, np.empty((rows, matrix.shape[0]), np.float32))
            assert relative_error(out, x @ expected[e].T)[0] <= 1e-5, (e, rows)
    assert not model._forward.store.full_dequantizations  # no expert tensor was dequantized whole
    # weights="float32" dequantizes each 3-D tensor once and slices it: the same model
    dense = ember.load_model(path, weights="float32")
    assert dense._forward.store.full_dequantizations["blk.1.ffn_down_exps.weight"] == 1
    assert relative_error(model.evaluate(PROMPT)[None], dense.evaluate(PROMPT)[None])[0] <= 1e-5


def test_each_chosen_expert_is_multiplied_once_over_the_rows_routed_to_it(tmp_path) -> None:
    """A prefill multiplies each expert some row chose once, over exactly those rows; a decode step only
    its k chosen experts, one row each; no other expert is touched."""
    _, path = _model_and_file(tmp_path, Q8_0)
    model = ember.load_model(path)
    calls = []

    class Counting:  # an expert's gate/up weight that notes each product
        def __init__(self, layer: int, expert: int, inner) -> None:
            self.layer, self.expert, self.inner, self.shape = layer, expert, inner, inner.shape

        def matmul(self, x, out):
            calls.append((self.layer, self.expert, x.shape[0]))
            return self.inner.matmul(x, out)

    for i, layer in enumerate(model._forward.weights.layers):
        layer.expert_gate_up = [Counting(i, e, m) for e, m in enumerate(layer.expert_gate_up)]
    recorder = BoundaryRecorder()
    model.generate(PROMPT, max_new_tokens=4, temperature=0.0, add_bos=False, stop_at_eog=False,
                   experiments=[recorder])
    expected = []
    for evaluation in recorder.evaluations:
        for layer, logits in enumerate(evaluation.router):
            experts, rows = np.unique(route(logits, TOP_K)[0], return_counts=True)
            expected += [(layer, int(e), int(n)) for e, n in zip(experts, rows, strict=True)]
    assert calls == expected
    assert [n for _, _, n in calls[-3 * TOP_K:]] == [1] * 3 * TOP_K  # the last decode step: k experts a layer


class Ban(Experiment):
    """Sets one expert's router logit to −inf in one layer: no row may choose it."""

    name = "ban"

    def __init__(self, layer: int, expert: int) -> None:
        self.layer, self.expert = layer, expert

    def router(self, ctx, router_logits) -> None:
        if ctx.layer_index == self.layer:
            router_logits.values_mut()[:, self.expert] = -np.inf


def _ban_in_hf(hf_model, layer: int, expert: int) -> None:
    """HF's router of `layer` with expert's logit −inf before its softmax and top-k: transformers'
    Qwen3MoeTopKRouter.forward written out with the ban added."""
    gate = hf_model.model.layers[layer].mlp.gate

    def forward(hidden_states):
        hidden_states = hidden_states.reshape(-1, gate.hidden_dim)
        logits = torch.nn.functional.linear(hidden_states, gate.weight)
        logits[:, expert] = -torch.inf
        probabilities = torch.nn.functional.softmax(logits, dtype=torch.float, dim=-1)
        top, indices = torch.topk(probabilities, gate.top_k, dim=-1)
        top /= top.sum(dim=-1, keepdim=True)
        return logits, top.to(logits.dtype), indices

    gate.forward = forward


def test_banning_an_expert_at_the_router_stage_equals_transformers_without_it(tmp_path) -> None:
    hf_model, path = _model_and_file(tmp_path)
    model = ember.load_model(path)
    layer = 1
    plain, _ = record_generation(model, PROMPT, 0)
    counts = np.bincount(route(plain[0].router[layer], TOP_K)[0].ravel(), minlength=8)
    expert = int(np.argmax(counts))  # the expert most rows of the prompt take there
    assert counts[expert] > 0

    recorder = BoundaryRecorder()
    generation = model.generate(PROMPT, max_new_tokens=DECODE_STEPS + 1, temperature=0.0, add_bos=False,
                                experiments=[Ban(layer, expert), recorder], stop_at_eog=False)
    ours = recorder.evaluations
    sequence = PROMPT + list(generation.token_ids)
    for evaluation in ours:
        count = evaluation.before_layer[0].shape[0]
        evaluation.token_ids = sequence[evaluation.start_position:evaluation.start_position + count]
    for evaluation in ours:  # the recorder saw the logits as the ban left them: the expert is never taken
        assert np.isneginf(evaluation.router[layer][:, expert]).all()
        assert expert not in route(evaluation.router[layer], TOP_K)[0]
    # the ban changed the layer's output (the choice changed), and HF banning the same way agrees
    assert relative_error(ours[0].after_mlp[layer], plain[0].after_mlp[layer])[0] > 100 * TOLERANCE
    _ban_in_hf(hf_model, layer, expert)
    reference = capture(hf_model, PROMPT, list(generation.token_ids)[:DECODE_STEPS])
    _check_against(ours, reference, "qwen3moe-ban")
    _same_choices(ours, reference)


def test_the_router_stage_shows_each_layer_s_logits_and_watching_changes_nothing(tmp_path) -> None:
    _, path = _model_and_file(tmp_path)
    model = ember.load_model(path)
    calls = []

    class Count(Experiment):
        name = "count"

        def router(self, ctx, router_logits) -> None:
            calls.append((ctx.layer_index, router_logits.shape))

    with_hook = model.generate(PROMPT, max_new_tokens=3, temperature=0.0, add_bos=False,
                               experiments=[Count()], stop_at_eog=False)
    without = model.generate(PROMPT, max_new_tokens=3, temperature=0.0, add_bos=False, stop_at_eog=False)
    assert with_hook.token_ids == without.token_ids
    assert calls[:3] == [(0, (len(PROMPT), 8)), (1, (len(PROMPT), 8)), (2, (len(PROMPT), 8))]
    assert calls[3:] == [(i, (1, 8)) for _ in range(2) for i in range(3)]


# ---------------------------------------------------------------------------------------- bad files


@pytest.mark.parametrize(("change", "message"), [
    (dict(replace={"qwen3moe.expert_used_count": 9}),
     "'qwen3moe.expert_used_count' is 9, more than 'qwen3moe.expert_count' \\(8\\)"),
    (dict(drop_key="qwen3moe.expert_count"), "'qwen3moe.expert_count' is missing"),
    (dict(replace={"qwen3moe.expert_count": 0}), "'qwen3moe.expert_count' is 0"),
    (dict(drop_tensor="blk.2.ffn_up_exps.weight"), "tensor 'blk.2.ffn_up_exps.weight' is missing"),
    (dict(reshape={"blk.1.ffn_down_exps.weight": (7, 64, 64)}),
     "tensor 'blk.1.ffn_down_exps.weight' has shape \\(7, 64, 64\\), but .* implies \\(8, 64, 64\\)"),
    (dict(reshape={"blk.0.ffn_gate_exps.weight": (8 * 64, 64)}),
     "tensor 'blk.0.ffn_gate_exps.weight' has shape \\(512, 64\\), but .* implies \\(8, 64, 64\\)"),
], ids=["top-k above the expert count", "no expert count", "no experts", "missing expert tensor",
        "an expert short", "2-D expert tensor"])
def test_bad_moe_metadata_or_tensors_end_in_one_line_naming_the_field(change, message, tmp_path) -> None:
    _, path = _model_and_file(tmp_path)
    bad = rewrite_gguf(path, tmp_path / "bad.gguf", **change)
    with pytest.raises(GGUFError, match=message) as raised:
        ember.load_model(bad)
    assert "\n" not in str(raised.value)


def test_extracting_the_router_stage(tmp_path) -> None:
    """`ember extract --stage router` pools each prompt's router logits ([experts] wide); a dense model
    has no router stage, said in one line."""
    _, path = _model_and_file(tmp_path)
    model = ember.load_model(path)
    prompts = ["the cat", "is on the mat"]
    states, layers = extract_hidden_states(model, prompts, stage="router", progress=False, add_bos=False)
    assert states.shape == (2, 3, 8) and layers == [0, 1, 2]
    recorder = BoundaryRecorder()
    model.generate(prompts[1], max_new_tokens=1, add_bos=False, experiments=[recorder], stop_at_eog=False)
    for layer in layers:
        assert relative_error(states[1, layer][None], recorder.evaluations[0].router[layer][-1:])[0] <= 1e-5
    dense = ember.load_model(write_gguf(tiny_qwen3(), tmp_path / "dense.gguf"))
    with pytest.raises(ConfigError, match="a qwen3 model has no 'router' stage"):
        extract_hidden_states(dense, prompts, stage="router", progress=False)


def test_a_logit_far_above_the_others_forces_an_expert_in_with_nearly_all_the_weight(tmp_path) -> None:
    _, path = _model_and_file(tmp_path)
    model = ember.load_model(path)

    class Force(Experiment):
        name = "force"

        def router(self, ctx, router_logits) -> None:
            if ctx.layer_index == 0:
                values = router_logits.values_mut()
                values[:, 5] = values.max(axis=1) + 50.0

    recorder = BoundaryRecorder()
    model.generate(PROMPT, max_new_tokens=2, temperature=0.0, add_bos=False, stop_at_eog=False,
                   experiments=[Force(), recorder])
    for evaluation in recorder.evaluations:
        chosen, weights = route(evaluation.router[0], TOP_K)
        assert (chosen[:, 0] == 5).all() and (weights[:, 0] > 0.999).all()
