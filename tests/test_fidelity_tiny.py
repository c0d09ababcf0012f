"""ember against transformers on tiny random models of the llama block's architectures (`llama`, `qwen3`,
`qwen2`, `olmo2`, `granite`, `smollm3`), boundary by boundary.

Each case builds an HF model (float32, eager attention, random weights and norm weights), writes it as
GGUF the way llama.cpp's converter does (tests/reference/gguf_writer.py), loads that file in ember and
greedy-generates through a recording Experiment: one prefill over the prompt, then DECODE_STEPS
single-token decode steps. HF then runs the same tokens (prompt, then ember's generated tokens one at a
time against its KV cache) with forward hooks. For F16/Q8_0 files HF gets the same dequantized weights.

Compared per evaluation and layer: the residual entering the layer, the attention output and the MLP
output (both before the residual add: OLMo 2's after its post-norms, Granite's times its residual
multiplier), the layer output; then the final-norm hidden state and the logits of the evaluation's last
token. Relative error of a tensor = max |ember − hf| / max |hf| over the whole tensor; every one must
be ≤ 1e-4.
"""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

import gguf  # noqa: E402
from reference.compare import compare_evaluations, relative_error  # noqa: E402
from reference.ember_recorder import record_generation  # noqa: E402
from reference.gguf_writer import load_gguf_weights_into_hf, write_gguf  # noqa: E402
from reference.hf_capture import capture  # noqa: E402
from reference.tiny_models import (  # noqa: E402
    LLAMA3_ROPE,
    tiny_granite,
    tiny_llama,
    tiny_olmo2,
    tiny_qwen2,
    tiny_qwen3,
    tiny_smollm3,
)

import ember  # noqa: E402
from ember.errors import GGUFError  # noqa: E402

pytestmark = pytest.mark.reference

TOLERANCE = 1e-4
DECODE_STEPS = 6
PROMPT = [40, 71, 100, 33, 259, 120, 87, 66, 200, 5, 44, 45, 46, 47, 48, 49, 50, 51, 52, 53, 262, 270]
LINEAR_ROPE = {"rope_type": "linear", "rope_theta": 10000.0, "factor": 2.0}
F32, F16, Q8_0 = gguf.GGMLQuantizationType.F32, gguf.GGMLQuantizationType.F16, gguf.GGMLQuantizationType.Q8_0

CASES = {
    # GQA (4 query heads on 2 KV heads), llama3 rope scaling as rope_freqs, separate LM head
    "llama-rope_freqs": (lambda: tiny_llama(rope_parameters=LLAMA3_ROPE), F32),
    # linear rope scaling, tied LM head
    "llama-linear_rope": (lambda: tiny_llama(rope_parameters=LINEAR_ROPE, tie_word_embeddings=True), F32),
    # QK-norm, NEOX rope, head_dim 32 ≠ 64/4, tied LM head
    "qwen3": (lambda: tiny_qwen3(), F32),
    # dequantization paths: HF gets the dequantized weights read back from the file
    "llama-rope_freqs-q8_0": (lambda: tiny_llama(rope_parameters=LLAMA3_ROPE), Q8_0),
    "qwen3-f16": (lambda: tiny_qwen3(tie_word_embeddings=False), F16),
    # q/k/v biases, NEOX rope, tied LM head; then with a separate head through Q8_0 (biases stay F32)
    "qwen2": (lambda: tiny_qwen2(), F32),
    "qwen2-q8_0": (lambda: tiny_qwen2(tie_word_embeddings=False), Q8_0),
    # post-norms only, QK-norm over all heads, separate LM head
    "olmo2": (lambda: tiny_olmo2(), F32),
    # embedding ×3, residual ×0.5 on both branches, attention scale 0.125 (not 1/√16), logits / 4;
    # permuted Q/K rows (NORM rope), tied head
    "granite": (lambda: tiny_granite(), F32),
    # layer 3 without rope (llama.cpp's fixed step of 4), permuted Q/K rows, tied head
    "smollm3": (lambda: tiny_smollm3(), F32),
}


def _run_case(case: str, tmp_path):
    build, qtype = CASES[case]
    hf_model = build()
    path = write_gguf(hf_model, tmp_path / f"{case}.gguf", qtype=qtype)
    if qtype != F32:
        load_gguf_weights_into_hf(hf_model, path)
    model = ember.load_model(path)
    ours, generated = record_generation(model, PROMPT, DECODE_STEPS)
    reference = capture(hf_model, PROMPT, generated[:DECODE_STEPS])
    return ours, reference, generated


@pytest.mark.parametrize("case", list(CASES))
def test_every_boundary_matches_transformers(case, tmp_path):
    ours, reference, _ = _run_case(case, tmp_path)
    worst = compare_evaluations(ours, reference)
    report = "\n".join(f"  {case} {w}" for w in worst.values())
    print(f"\n{report}")
    failures = [str(w) for w in worst.values() if not w.relative <= TOLERANCE]
    assert not failures, f"{case}: relative error above {TOLERANCE}:\n" + "\n".join(failures)


@pytest.mark.parametrize(("case", "unscaled_rope"), [
    ("llama-rope_freqs", {"rope_type": "default", "rope_theta": 10000.0}),
    ("llama-linear_rope", {"rope_type": "default", "rope_theta": 10000.0}),
])
def test_rope_scaling_is_visible_at_these_positions(case, unscaled_rope, tmp_path):
    """The comparison above would catch an engine that ignored the rope scaling."""
    ours, _, generated = _run_case(case, tmp_path)
    tied = case == "llama-linear_rope"
    unscaled = capture(tiny_llama(rope_parameters=unscaled_rope, tie_word_embeddings=tied), PROMPT,
                       generated[:DECODE_STEPS])
    errors = [relative_error(a.logits, b.logits[-1:])[0] for a, b in zip(ours, unscaled, strict=True)]
    assert max(errors) > 100 * TOLERANCE


def test_llama_qk_permutation_is_needed(tmp_path):
    """A llama file written without the converter's Q/K row permutation does not match HF: the test
    above would catch an engine whose rope layout disagreed with the permutation."""
    hf_model = tiny_llama(rope_parameters=LLAMA3_ROPE)
    path = write_gguf(hf_model, tmp_path / "unpermuted.gguf", permute_qk=False)
    ours, generated = record_generation(ember.load_model(path), PROMPT, DECODE_STEPS)
    reference = capture(hf_model, PROMPT, generated[:DECODE_STEPS])
    assert relative_error(ours[0].before_layer[0], reference[0].before_layer[0])[0] <= TOLERANCE
    assert relative_error(ours[0].after_attention[0], reference[0].after_attention[0])[0] > 100 * TOLERANCE


def _without_biases(model):
    with torch.no_grad():
        for layer in model.model.layers:
            for projection in (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj):
                projection.bias.zero_()
    return model


class PerHeadNorm(torch.nn.Module):
    """An RMSNorm over each head's dims instead of the whole vector (the weights as they are)."""

    def __init__(self, norm, head_dim: int) -> None:
        super().__init__()
        self.norm, self.head_dim = norm, head_dim

    def forward(self, x):
        heads = x.view(*x.shape[:-1], -1, self.head_dim)
        heads = heads * torch.rsqrt(heads.pow(2).mean(-1, keepdim=True) + self.norm.variance_epsilon)
        return self.norm.weight * heads.view(x.shape)


def _qk_norm_per_head(model):
    for layer in model.model.layers:
        attention = layer.self_attn
        attention.q_norm = PerHeadNorm(attention.q_norm, attention.head_dim)
        attention.k_norm = PerHeadNorm(attention.k_norm, attention.head_dim)
    return model


# each family's distinctive feature switched off on the transformers side (same weights otherwise), and
# the boundary where an engine that lacked it would first go wrong
WITHOUT_FEATURE = {
    "qwen2": (lambda: _without_biases(tiny_qwen2()), "after_attention"),
    "olmo2": (lambda: _qk_norm_per_head(tiny_olmo2()), "after_attention"),
    "granite-embedding": (lambda: tiny_granite(embedding_multiplier=1.0), "before_layer"),
    "granite-residual": (lambda: tiny_granite(residual_multiplier=1.0), "after_attention"),
    "granite-attention": (lambda: tiny_granite(attention_multiplier=0.25), "after_attention"),
    "granite-logits": (lambda: tiny_granite(logits_scaling=1.0), "logits"),
    "smollm3": (lambda: tiny_smollm3_roped_everywhere(), "after_attention"),
}


def tiny_smollm3_roped_everywhere():
    model = tiny_smollm3()
    for layer in model.model.layers:
        layer.self_attn.use_rope = True
    return model


@pytest.mark.parametrize("variant", list(WITHOUT_FEATURE))
def test_each_distinctive_feature_is_visible(variant, tmp_path):
    """The comparison above would catch an engine without the family's feature: transformers without it
    differs from ember (which has it) by far more than the tolerance, at the first boundary it touches."""
    case = variant.split("-")[0]
    ours, _, generated = _run_case(case, tmp_path)
    build, boundary = WITHOUT_FEATURE[variant]
    without = capture(build(), PROMPT, generated[:DECODE_STEPS])
    worst = compare_evaluations(ours, without)[boundary]
    assert worst.relative > 100 * TOLERANCE, worst


def _refusal(model, tmp_path) -> str:
    path = write_gguf(model, tmp_path / "refused.gguf")
    with pytest.raises(GGUFError) as caught:
        ember.load_model(path)
    message = str(caught.value)
    assert "\n" not in message
    return message


def test_a_block_with_some_of_its_qkv_biases_is_refused_in_one_line(tmp_path):
    model = tiny_qwen2()
    model.model.layers[1].self_attn.k_proj.bias = None
    assert "'blk.1.attn_k.bias' is missing" in _refusal(model, tmp_path)


def test_granite_biases_ember_does_not_add_are_refused_in_one_line(tmp_path):
    """llama.cpp adds granite's optional output-projection and MLP biases; ember's block has none, so a
    file with them is refused rather than run wrong."""
    assert "'blk.0.attn_output.bias'" in _refusal(tiny_granite(attention_bias=True), tmp_path)


def test_olmo2_without_its_own_lm_head_is_refused_in_one_line(tmp_path):
    """llama.cpp requires olmo2's `output.weight` (no tied head)."""
    assert "output.weight" in _refusal(tiny_olmo2(tie_word_embeddings=True), tmp_path)
