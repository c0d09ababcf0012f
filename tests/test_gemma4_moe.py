"""Gemma 4's mixture-of-experts layers (26B-A4B) against transformers' Gemma4ForCausalLM, float32, eager.

A tiny random model with `enable_moe_block` (8 experts of which each token takes 2, expert width 32,
beside a dense FFN of 96) is written to GGUF as llama.cpp's converter writes it
(tests/reference/gemma4_gguf.py), loaded in ember and greedy-generated through a recording Experiment
(a prefill of 12 tokens across the window of 6, then decode steps); HF runs the same tokens with forward
hooks (tests/reference/gemma4_reference.py). Compared per evaluation and layer within 1e-4 relative
(max|Δ| / max|ref|): the residual entering the layer, after_attention, after_mlp (the dense FFN and the
experts together), the layer output, final norm and logits, and the router logits; the experts chosen
must be HF's. Random router scales and per-expert scales (not ones) make a mistake in either show.

Cases: the 26B-A4B layout (no PLE, no KV sharing, V = K on full layers) in F32 and Q8_0 (HF gets gguf-py's
dequantization of the file), the same with the experts' gate and up as two tensors, and the MoE block
on the E2B-style layout (PLE, KV sharing, double-wide dense FFN).
"""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from gguf import GGMLQuantizationType  # noqa: E402
from reference.compare import compare_evaluations, relative_error  # noqa: E402
from reference.ember_recorder import BoundaryRecorder, record_generation  # noqa: E402
from reference.gemma4_gguf import Gemma4Spec, dequantized_state, random_state, tiny_gemma4_vocab, write_gguf  # noqa: E402,E501
from reference.gguf_writer import rewrite_gguf  # noqa: E402

import ember  # noqa: E402
from ember.errors import ConfigError, GGUFError  # noqa: E402
from ember.experiments import Experiment  # noqa: E402
from ember.experiments.expert_usage import ExpertUsage  # noqa: E402
from ember.families.experts import route  # noqa: E402
from ember.families.gemma4 import Gemma4Config  # noqa: E402
from ember.inspection.extraction import extract_hidden_states  # noqa: E402
from ember.phases import ModelFamily  # noqa: E402
from ember.stages import layer_names, model_layer_names  # noqa: E402

pytestmark = pytest.mark.reference

TOLERANCE = 1e-4
TOP_K, EXPERTS = 2, 8
DECODE_STEPS = 6
PROMPT = [2, 280, 281, 282, 283, 290, 291, 292, 293, 294, 300, 301]  # 12 tokens, window 6
F32, Q8_0 = GGMLQuantizationType.F32, GGMLQuantizationType.Q8_0
MOE = {"enable_moe_block": True, "num_experts": EXPERTS, "top_k_experts": TOP_K, "moe_intermediate_size": 32}
LAYOUT_26B = {"attention_k_eq_v": True, "num_global_key_value_heads": 1, "hidden_size_per_layer_input": 0,
              "num_kv_shared_layers": 0, "use_double_wide_mlp": False}
CASES = {  # name: (spec changes, file type)
    "26b": ({**MOE, **LAYOUT_26B}, F32),
    "26b-q8_0": ({**MOE, **LAYOUT_26B}, Q8_0),
    "26b-split-gate-up": ({**MOE, **LAYOUT_26B, "split_gate_up_exps": True}, F32),
    "e2b-layout": (MOE, F32),
}


def _spec(**changes) -> Gemma4Spec:
    return Gemma4Spec(vocab_size=len(tiny_gemma4_vocab().tokens), **changes)


def _file(tmp_path, name: str = "26b", seed: int = 5):
    """(spec, HF-named weights as the file holds them, path)."""
    changes, qtype = CASES[name]
    spec = _spec(**changes)
    state = random_state(spec, seed=seed)
    path = write_gguf(tmp_path / f"{name}.gguf", spec, state, qtype=qtype)
    if qtype != F32:
        state = dequantized_state(path, spec)  # HF gets gguf-py's dequantization of the file
    return spec, state, path


def _hf(spec, state):
    from reference.gemma4_reference import build_hf

    return build_hf(spec, state)


def _capture(hf_model, decode: list[int]):
    from reference.gemma4_reference import capture

    return capture(hf_model, PROMPT, decode)


def _check_against(ours, reference, label: str) -> None:
    worst = compare_evaluations(ours, reference)
    print("\n" + "\n".join(f"  {label} {w}" for w in worst.values()))
    failures = [str(w) for w in worst.values() if not w.relative <= TOLERANCE]
    assert not failures, f"{label}: relative error above {TOLERANCE}:\n" + "\n".join(failures)


def _same_choices(ours, reference, layers: int) -> None:
    """ember's router logits match HF's and pick HF's experts, row by row, in every layer."""
    for mine, theirs in zip(ours, reference, strict=True):
        assert len(mine.router) == len(theirs.router) == len(theirs.chosen) == layers
        for layer, (logits, hf_logits, hf_chosen) in enumerate(zip(mine.router, theirs.router, theirs.chosen,
                                                                   strict=True)):
            finite = np.isfinite(hf_logits)  # a banned expert's logit is −inf in both
            assert np.array_equal(np.isfinite(logits), finite), (mine.start_position, layer)
            assert relative_error(np.where(finite, logits, 0), np.where(finite, hf_logits, 0))[0] <= TOLERANCE
            chosen, _ = route(logits, TOP_K)
            assert np.array_equal(np.sort(chosen, axis=1), np.sort(hf_chosen, axis=1)), (mine.start_position,
                                                                                       layer)


@pytest.mark.parametrize("name", sorted(CASES))
def test_every_boundary_and_choice_matches_transformers(name, tmp_path) -> None:
    spec, state, path = _file(tmp_path, name)
    model = ember.load_model(path, context_length=64)
    config = model.config
    assert isinstance(config, Gemma4Config) and config.family is ModelFamily.GEMMA4
    experts = (config.expert_count, config.expert_used_count, config.expert_feed_forward_length)
    assert experts == (EXPERTS, TOP_K, 32)
    ours, generated = record_generation(model, PROMPT, DECODE_STEPS)
    reference = _capture(_hf(spec, state), generated[:DECODE_STEPS])
    _check_against(ours, reference, f"gemma4-moe-{name}")
    _same_choices(ours, reference, spec.num_hidden_layers)
    # the routing is exercised: the prompt's tokens spread over most experts in every layer
    for logits in ours[0].router:
        assert len(np.unique(route(logits, TOP_K)[0])) >= 6


def test_the_gate_up_layouts_are_the_same_model(tmp_path) -> None:
    """The fused `ffn_gate_up_exps` and the split `ffn_gate_exps` + `ffn_up_exps` files of the same weights
    give the same logits; the per-expert scale and the router's input scale each change them."""
    fused = ember.load_model(_file(tmp_path, "26b", seed=9)[2], context_length=64)
    split = ember.load_model(_file(tmp_path, "26b-split-gate-up", seed=9)[2], context_length=64)
    logits = fused.evaluate(PROMPT)
    assert relative_error(split.evaluate(PROMPT)[None], logits[None])[0] <= 1e-6
    for layer in fused._forward.weights.layers:
        layer.experts.expert_scale = np.ones_like(layer.experts.expert_scale)
    assert relative_error(fused.evaluate(PROMPT)[None], logits[None])[0] > 1e-3
    for layer in split._forward.weights.layers:
        layer.experts.router_scale = np.ones_like(layer.experts.router_scale)
    assert relative_error(split.evaluate(PROMPT)[None], logits[None])[0] > 1e-3


class Ban(Experiment):
    """Sets one expert's router logit to −inf in one layer: no row may choose it."""

    name = "ban"

    def __init__(self, layer: int, expert: int) -> None:
        self.layer, self.expert = layer, expert

    def router(self, ctx, router_logits) -> None:
        if ctx.layer_index == self.layer:
            router_logits.values_mut()[:, self.expert] = -np.inf


def _ban_in_hf(hf_model, layer: int, expert: int) -> None:
    """HF's router of `layer` with the expert's logit −inf before its softmax and top-k: a forward hook on
    `router.proj` replaces its output; transformers' own router does the rest."""

    def ban(module, args, logits):
        logits = logits.clone()
        logits[:, expert] = -torch.inf
        return logits

    hf_model.model.layers[layer].router.proj.register_forward_hook(ban)


def test_banning_an_expert_at_the_router_stage_equals_transformers_without_it(tmp_path) -> None:
    spec, state, path = _file(tmp_path)
    model = ember.load_model(path, context_length=64)
    layer = 1
    plain, _ = record_generation(model, PROMPT, 0)
    counts = np.bincount(route(plain[0].router[layer], TOP_K)[0].ravel(), minlength=EXPERTS)
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
        assert np.isneginf(evaluation.router[layer][:, expert]).all()
        assert expert not in route(evaluation.router[layer], TOP_K)[0]
    assert relative_error(ours[0].after_mlp[layer], plain[0].after_mlp[layer])[0] > 100 * TOLERANCE
    hf_model = _hf(spec, state)
    _ban_in_hf(hf_model, layer, expert)
    reference = _capture(hf_model, list(generation.token_ids)[:DECODE_STEPS])
    _check_against(ours, reference, "gemma4-moe-ban")
    _same_choices(ours, reference, spec.num_hidden_layers)


def test_expert_usage_counts_the_experts_transformers_chooses(tmp_path) -> None:
    spec, state, path = _file(tmp_path)
    model = ember.load_model(path, context_length=64)
    usage = ExpertUsage()
    generation = model.generate(PROMPT, max_new_tokens=DECODE_STEPS + 1, temperature=0.0, add_bos=False,
                                experiments=[usage], stop_at_eog=False)
    result = usage.results()
    counts = result.arrays["counts"]
    reference = _capture(_hf(spec, state), list(generation.token_ids)[:DECODE_STEPS])
    expected = np.zeros((spec.num_hidden_layers, EXPERTS), np.int64)
    for evaluation in reference:
        for layer, chosen in enumerate(evaluation.chosen):
            expected[layer] += np.bincount(chosen.ravel(), minlength=EXPERTS)
    assert np.array_equal(counts, expected)
    assert counts.sum() == spec.num_hidden_layers * (len(PROMPT) + DECODE_STEPS) * TOP_K
    entropies = [m.value for m in result.metrics if m.name == "load_entropy"]
    assert len(entropies) == spec.num_hidden_layers and all(0 < e <= np.log2(EXPERTS) for e in entropies)
    assert len(result.tables["choices"]) == spec.num_hidden_layers * (len(PROMPT) + DECODE_STEPS)


def test_the_router_stage_belongs_to_the_moe_files_of_the_family(tmp_path) -> None:
    """Dense and MoE Gemma 4 files share ModelFamily.GEMMA4; the router stage is the MoE files' only:
    extracting it works on one and is refused on the other in one line; watching it changes nothing."""
    _, _, path = _file(tmp_path)
    model = ember.load_model(path, context_length=64)
    assert model_layer_names(model.config) == layer_names(ModelFamily.GEMMA4, experts=True)
    assert "router" in model_layer_names(model.config)
    prompts = ["the cat", "is on the mat"]
    states, layers = extract_hidden_states(model, prompts, stage="router", progress=False, add_bos=False)
    assert states.shape == (2, 7, EXPERTS) and layers == list(range(7))
    recorder = BoundaryRecorder()
    with_hook = model.generate("is on the mat", max_new_tokens=3, add_bos=False, experiments=[recorder],
                               stop_at_eog=False, temperature=0.0)
    without = model.generate("is on the mat", max_new_tokens=3, add_bos=False, stop_at_eog=False,
                             temperature=0.0)
    assert with_hook.token_ids == without.token_ids
    for layer in layers:
        assert relative_error(states[1, layer][None], recorder.evaluations[0].router[layer][-1:])[0] <= 1e-5

    dense_spec = _spec()
    dense = ember.load_model(write_gguf(tmp_path / "dense.gguf", dense_spec, random_state(dense_spec)),
                             context_length=64)
    assert model_layer_names(dense.config) == layer_names(ModelFamily.GEMMA4)
    assert "router" not in model_layer_names(dense.config)
    with pytest.raises(ConfigError, match="a gemma4 model has no 'router' stage"):
        extract_hidden_states(dense, ["the cat"], stage="router", progress=False)


# ---------------------------------------------------------------------------------------- bad files


@pytest.mark.parametrize(("change", "message"), [
    (dict(replace={"gemma4.expert_used_count": 9}),
     "'gemma4.expert_used_count' is 9, more than 'gemma4.expert_count' \\(8\\)"),
    (dict(drop_key="gemma4.expert_count"),
     "'gemma4.expert_count' is missing, but the file has a router tensor"),
    (dict(replace={"gemma4.expert_count": 0}),
     "'gemma4.expert_count' is 0, but the file has a router tensor"),
    (dict(drop_key="gemma4.expert_feed_forward_length"), "'gemma4.expert_feed_forward_length' is missing"),
    (dict(drop_tensor="blk.3.ffn_down_exps.scale"), "tensor 'blk.3.ffn_down_exps.scale' is missing"),
    (dict(drop_tensor="blk.2.ffn_gate_inp.scale"), "tensor 'blk.2.ffn_gate_inp.scale' is missing"),
    (dict(drop_tensor="blk.0.post_ffw_norm_2.weight"), "tensor 'blk.0.post_ffw_norm_2.weight' is missing"),
    (dict(drop_tensor="blk.2.ffn_gate_up_exps.weight"),
     "tensor 'blk.2.ffn_gate_up_exps.weight' \\(or the pair .*\\) is missing"),
    (dict(reshape={"blk.1.ffn_down_exps.weight": (7, 64, 32)}),
     "tensor 'blk.1.ffn_down_exps.weight' has shape \\(7, 64, 32\\), but .* implies \\(8, 64, 32\\)"),
    (dict(reshape={"blk.0.ffn_gate_up_exps.weight": (8 * 64, 64)}),
     "tensor 'blk.0.ffn_gate_up_exps.weight' has shape \\(512, 64\\), but .* implies \\(8, 64, 64\\)"),
    (dict(reshape={"blk.4.ffn_down_exps.scale": (4,)}),
     "tensor 'blk.4.ffn_down_exps.scale' has shape \\(4,\\), but .* implies \\(8,\\)"),
], ids=["top-k above the expert count", "no expert count", "no experts", "no expert width",
        "no per-expert scale", "no router scale", "no expert output norm", "no gate-up experts",
        "an expert short", "2-D expert tensor", "per-expert scale short"])
def test_bad_moe_metadata_or_tensors_end_in_one_line_naming_the_field(change, message, tmp_path) -> None:
    _, _, path = _file(tmp_path)
    bad = rewrite_gguf(path, tmp_path / "bad.gguf", **change)
    with pytest.raises(GGUFError, match=message) as raised:
        ember.load_model(bad)
    assert "\n" not in str(raised.value)
