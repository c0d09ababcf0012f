"""Tiny random Gemma 2 models written as GGUF the way llama.cpp's converter does, against transformers.

Each of Gemma 2's own parts is switched on so that an engine without it fails: the attention-logit softcap
(5: the scores reach several times that, so the tanh bends them), the final-logit softcap (3), a sliding
window of 4 tokens on the even layers (prompts of 11 tokens need it in the prefill and every decode step
crosses it), pre- and post-norms with random weights, GeGLU, GQA 4 heads over 2. `test_each_part_shows`
proves each one matters: transformers without it is far from ember.

Converter facts mirrored (llama.cpp `conversion/gemma.py` Gemma2Model, docs/families.md §11): metadata
`context_length`, `embedding_length`, `block_count`, `feed_forward_length`, `attention.head_count(_kv)`,
`attention.layer_norm_rms_epsilon`, `attention.key_length`/`value_length` (= head_dim),
`attn_logit_softcapping`, `final_logit_softcapping`, `attention.sliding_window`: no rope base, no pattern,
no `query_pre_attn_scalar`; every `*norm.weight` stored as w + 1; `lm_head` dropped (the head is
`token_embd`); a SentencePiece vocabulary. Norm tensors stay F32, the others take the file type.

Also: the config reader on metadata-only files (llama.cpp's defaults, the 27B scale rule) and the bad
metadata it refuses in one line.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import gguf
import numpy as np
import pytest
from gguf import GGMLQuantizationType
from reference.names import gguf_tensor_name

import ember
from ember.errors import GGUFError
from ember.families.gemma2 import build_config
from ember.gguf_file import GGUFFile

pytestmark = pytest.mark.reference

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from test_gemma3_reference import LAYER_BOUNDARIES, Capture, hf_capture, relative  # noqa: E402
from test_gemma3_tiny import spm_vocab  # noqa: E402

TOLERANCE = 1e-4
WINDOW = 4
HEAD_DIM = 16
ATTENTION_SOFTCAP = 5.0
FINAL_SOFTCAP = 3.0
PROMPT = [2, 270, 281, 264, 262, 279, 277, 265, 273, 290, 261]
F32, Q8_0 = GGMLQuantizationType.F32, GGMLQuantizationType.Q8_0


def tiny_gemma2(seed: int = 0, **overrides: Any) -> Any:
    """4 layers (0 and 2 slide: transformers' default `layer_types`), hidden 64, 4 query heads over 2 KV
    heads of 16 dims, query_pre_attn_scalar = head_dim (what llama.cpp assumes below 46 layers)."""
    from transformers import Gemma2Config, Gemma2ForCausalLM

    settings = dict(vocab_size=len(spm_vocab()[0]), hidden_size=64, intermediate_size=96, num_hidden_layers=4,
                    num_attention_heads=4, num_key_value_heads=2, head_dim=HEAD_DIM,
                    query_pre_attn_scalar=HEAD_DIM, sliding_window=WINDOW,
                    attn_logit_softcapping=ATTENTION_SOFTCAP, final_logit_softcapping=FINAL_SOFTCAP,
                    max_position_embeddings=64, rms_norm_eps=1e-6, pad_token_id=0, eos_token_id=1,
                    bos_token_id=2, tie_word_embeddings=True, attn_implementation="eager") | overrides
    model = Gemma2ForCausalLM(Gemma2Config(**settings)).to(torch.float32)
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if param.ndim == 1:  # HF norm weight w; the model multiplies by 1 + w
                param.copy_(torch.rand(param.shape, generator=generator) - 0.5)
            elif name.endswith("embed_tokens.weight"):
                param.copy_(torch.randn(param.shape, generator=generator) * 0.5)
            else:
                # queries and keys 3× larger: scores of tens, well into the softcap's bend
                gain = 3.0 if name.endswith(("q_proj.weight", "k_proj.weight")) else 1.0
                param.copy_(torch.randn(param.shape, generator=generator) * gain / param.shape[1] ** 0.5)
        model.model.embed_tokens.weight[:4] = 0.0  # never pick <pad>/<eos>/<bos>/<unk> greedily
    return model.eval()


def _tensor_data(name: str, data: np.ndarray, qtype: GGMLQuantizationType) -> tuple[np.ndarray, Any]:
    if data.ndim == 1 or qtype == F32:
        return np.ascontiguousarray(data, dtype=np.float32), F32
    return gguf.quants.quantize(np.ascontiguousarray(data, dtype=np.float32), qtype), qtype


def write_gemma2_gguf(model: Any, path: Path, qtype: GGMLQuantizationType = F32, *,
                      with_head: bool = False) -> Path:
    """The file llama.cpp's converter writes for `model` (`with_head`: one it would not write, with the
    LM head as `output.weight` too)."""
    config = model.config
    writer = gguf.GGUFWriter(path, "gemma2")
    keys: dict[str, Any] = {
        "context_length": config.max_position_embeddings, "embedding_length": config.hidden_size,
        "block_count": config.num_hidden_layers, "feed_forward_length": config.intermediate_size,
        "attention.head_count": config.num_attention_heads,
        "attention.head_count_kv": config.num_key_value_heads,
        "attention.layer_norm_rms_epsilon": float(config.rms_norm_eps),
        "attention.key_length": config.head_dim, "attention.value_length": config.head_dim,
        "attn_logit_softcapping": float(config.attn_logit_softcapping),
        "final_logit_softcapping": float(config.final_logit_softcapping),
        "attention.sliding_window": config.sliding_window,
    }
    writer.add_type(gguf.GGUFType.MODEL)
    writer.add_name("tiny-gemma2")
    for key, value in keys.items():
        if isinstance(value, float):
            writer.add_float32(f"gemma2.{key}", value)
        else:
            writer.add_uint32(f"gemma2.{key}", int(value))
    writer.add_file_type(int(gguf.LlamaFileType.ALL_F32 if qtype == F32 else gguf.LlamaFileType.MOSTLY_Q8_0))
    tokens, scores, types = spm_vocab()
    writer.add_tokenizer_model("llama")
    writer.add_tokenizer_pre("default")
    writer.add_token_list(tokens)
    writer.add_token_scores(scores)
    writer.add_token_types(types)
    writer.add_bos_token_id(2)
    writer.add_eos_token_id(1)
    writer.add_unk_token_id(3)
    writer.add_pad_token_id(0)
    writer.add_add_bos_token(True)
    writer.add_add_eos_token(False)
    writer.add_add_space_prefix(False)
    writer.add_quantization_version(gguf.GGML_QUANT_VERSION)
    for hf_name, tensor in model.state_dict().items():
        if hf_name == "lm_head.weight" and not with_head:
            continue  # the converter drops it: the head is token_embd
        data = tensor.detach().to(torch.float32).numpy()
        name = ("output.weight" if hf_name == "lm_head.weight"
                else gguf_tensor_name("gemma2", config.num_hidden_layers, hf_name))
        if name.endswith("norm.weight"):
            data = data + np.float32(1.0)  # the converter's norm shift: the file holds 1 + w
        stored, kind = _tensor_data(name, data, qtype)
        writer.add_tensor(name, stored, raw_dtype=kind)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def load_file_weights_into_hf(model: Any, path: Path) -> None:
    """Give `model` the weights `path` holds (dequantized, the norm shift undone): what ember reads."""
    names = {gguf_tensor_name("gemma2", model.config.num_hidden_layers, n): n
             for n in model.state_dict() if n != "lm_head.weight"}
    state = model.state_dict()
    with torch.no_grad():
        for tensor in gguf.GGUFReader(path).tensors:
            data = gguf.dequantize(tensor.data, tensor.tensor_type).astype(np.float32)
            if tensor.name.endswith("norm.weight"):
                data = data - np.float32(1.0)
            state[names[tensor.name]].copy_(torch.from_numpy(data.reshape(state[names[tensor.name]].shape)))


@pytest.fixture(scope="module", params=["f32", "q8_0"])
def pair(request: Any, tmp_path_factory: Any) -> tuple[Any, Any]:
    hf = tiny_gemma2()
    qtype = F32 if request.param == "f32" else Q8_0
    path = write_gemma2_gguf(hf, tmp_path_factory.mktemp("gemma2") / f"tiny-{request.param}.gguf", qtype)
    if qtype != F32:
        load_file_weights_into_hf(hf, path)
    return ember.load_model(path), hf


def test_config_read_from_the_file(pair: tuple[Any, Any]) -> None:
    model, hf = pair
    c = model.config
    assert c.family.value == "gemma2" and c.sliding_window == WINDOW and not c.has_qk_norm
    assert list(c.sliding_layers) == [t == "sliding_attention" for t in hf.config.layer_types]
    assert c.sliding_layers == (True, False, True, False)
    assert c.attention_scale == pytest.approx(hf.config.query_pre_attn_scalar ** -0.5, rel=1e-12)
    assert (c.attention_softcap, c.final_logit_softcap) == (ATTENTION_SOFTCAP, FINAL_SOFTCAP)
    assert c.rope_base == c.rope_base_swa == hf.config.rope_parameters["rope_theta"] == 10000.0


def compare_with_transformers(model: Any, hf: Any, prompt: list[int], steps: int) -> dict[str, float]:
    """Prefill then `steps` decode steps on ember's greedy tokens: worst relative error per boundary."""
    capture = Capture()
    generation = model.generate(prompt, max_new_tokens=steps + 1, experiments=[capture], stop_at_eog=False)
    theirs = hf_capture(hf, prompt, generation.token_ids[:steps])
    assert len(capture.evaluations) == len(theirs) == steps + 1
    worst: dict[str, float] = {}
    for ours, reference in zip(capture.evaluations, theirs, strict=True):
        for boundary in LAYER_BOUNDARIES:
            for x, y in zip(ours.layers[boundary], reference.layers[boundary], strict=True):
                worst[boundary] = max(worst.get(boundary, 0.0), relative(x, y))
        worst["final_norm"] = max(worst.get("final_norm", 0.0), relative(ours.final_norm,
                                                                          reference.final_norm[-1:]))
        worst["logits"] = max(worst.get("logits", 0.0), relative(ours.logits, reference.logits))
    return worst


def test_every_boundary_matches_transformers(pair: tuple[Any, Any]) -> None:
    """Prefill of 11 tokens (window 4), then 6 decode steps: all boundaries, final norm and logits."""
    model, hf = pair
    worst = compare_with_transformers(model, hf, PROMPT, 6)
    print("\nworst relative error: " + ", ".join(f"{k} {v:.1e}" for k, v in worst.items()))
    assert all(error <= TOLERANCE for error in worst.values()), worst
    with torch.no_grad():  # every position's logits from one clean prefill
        every = hf(input_ids=torch.tensor([PROMPT])).logits[0].numpy()
    assert relative(model.logits(PROMPT), every) <= TOLERANCE


def test_greedy_tokens_match_transformers(pair: tuple[Any, Any]) -> None:
    model, hf = pair
    prompt = PROMPT[:5]
    ours = model.generate(prompt, max_new_tokens=12, stop_at_eog=False).token_ids
    with torch.no_grad():
        theirs = hf.generate(torch.tensor([prompt]), max_new_tokens=12, do_sample=False,
                             min_new_tokens=12)[0, len(prompt):].tolist()
    assert ours == theirs


def without_attention_softcap(hf: Any) -> Any:
    for layer in hf.model.layers:
        layer.self_attn.attn_logit_softcapping = None
    return hf


def without_final_softcap(hf: Any) -> Any:
    hf.config.final_logit_softcapping = None
    return hf


# Gemma 2's parts switched off on the transformers side (same weights), and the boundary an engine
# without the part first goes wrong at
WITHOUT = {
    "attention_softcap": (lambda: without_attention_softcap(tiny_gemma2()), "after_attention"),
    "final_softcap": (lambda: without_final_softcap(tiny_gemma2()), "logits"),
    "sliding_window": (lambda: tiny_gemma2(layer_types=["full_attention"] * 4), "after_attention"),
    "odd_layers_sliding": (lambda: tiny_gemma2(layer_types=["full_attention", "sliding_attention"] * 2),
                           "after_attention"),
}


@pytest.mark.parametrize("part", list(WITHOUT))
def test_each_part_shows(part: str, tmp_path: Path) -> None:
    """The comparison above would catch an engine without each part: transformers without it differs
    from ember (which has it) by far more than the tolerance."""
    build, boundary = WITHOUT[part]
    model = ember.load_model(write_gemma2_gguf(tiny_gemma2(), tmp_path / "tiny.gguf"))
    worst = compare_with_transformers(model, build(), PROMPT, 2)
    assert worst[boundary] > 100 * TOLERANCE, (part, worst)


def test_sliding_layers_hold_only_their_window(pair: tuple[Any, Any]) -> None:
    model, _ = pair
    model.generate([2] + list(range(262, 282)), max_new_tokens=3)
    for layer, slides in zip(model._cache.layers, model.config.sliding_layers, strict=True):
        assert layer.keys.shape[1] == (WINDOW if slides else model.context_length)


# --------------------------------------------------------------------------- the attention routes


def _capped_attention(q, keys, values, scale, cap, window):
    """Float64, one row at a time (row t at position t over keys 0…t, the window's only): the
    probabilities [heads, T, L] and the heads' outputs [T, heads·hd]."""
    T, heads, hd = q.shape
    group = heads // keys.shape[0]
    probabilities = np.zeros((heads, T, keys.shape[1]))
    for t in range(T):
        seen = [p for p in range(t + 1) if not (window and t - p >= window)]
        for h in range(heads):
            scores = keys[h // group, seen].astype(np.float64) @ q[t, h] * scale
            scores = cap * np.tanh(scores / cap)
            weights = np.exp(scores - scores.max())
            probabilities[h, t, seen] = weights / weights.sum()
    out = np.einsum("htl,hld->thd", probabilities, np.repeat(values, group, axis=0).astype(np.float64))
    return probabilities, out.reshape(T, -1)


@pytest.mark.parametrize("window", [0, 3])
def test_every_attention_route_caps_the_scores(window: int, monkeypatch: Any) -> None:
    """Several rows, one row in NumPy and one row in numba (`ember.ops.attention`), and the pattern the
    hooks see (`ember.rows.form_pattern`): each the float64 softmax of c·tanh(s/c) before the mask."""
    from ember import ops
    from ember.quant import jit_unavailable
    from ember.rows import form_pattern

    rng = np.random.default_rng(window)
    T, heads, kv, hd, scale, cap = 9, 4, 2, 8, 0.35, 0.5  # scores of about ±1: the cap bends them
    q = rng.standard_normal((T, heads, hd)).astype(np.float32)
    keys = rng.standard_normal((kv, T, hd)).astype(np.float32)
    values = rng.standard_normal((kv, T, hd)).astype(np.float32)
    probabilities, expected = _capped_attention(q, keys, values, scale, cap, window)
    positions = np.arange(T)
    uncapped = _capped_attention(q, keys, values, scale, 1e9, window)[1]
    assert relative(uncapped, expected) > 0.05

    several = ops.attention(q, keys, values, start_position=0, scale=scale, out=np.empty((T, heads * hd),
                            np.float32), key_positions=positions if window else None, sliding_window=window,
                            softcap=cap)
    assert relative(several, expected) <= 1e-5
    pattern = np.zeros((heads, T, T), np.float32)
    form_pattern(q, keys, positions, positions, scale, window, pattern, cap)
    assert relative(pattern, probabilities) <= 1e-5

    def last_row() -> np.ndarray:
        return ops.attention(q[-1:], keys, values, start_position=T - 1, scale=scale,
                             out=np.empty((1, heads * hd), np.float32),
                             score_buffer=np.empty(heads * T, np.float32),
                             row_scratch=np.empty((kv, heads // kv, 1), np.float32),
                             spread_buffer=np.empty(heads * T, np.float32), key_positions=positions,
                             sliding_window=window, softcap=cap)

    monkeypatch.setattr(ops, "_token_ops", None)
    assert relative(last_row(), expected[-1:]) <= 1e-5
    if jit_unavailable() is None:
        from ember.quant import token_ops

        monkeypatch.setattr(ops, "_token_ops", token_ops)
        assert relative(last_row(), expected[-1:]) <= 1e-5


# --------------------------------------------------------------------------- the config reader


def metadata_only(path: Path, *, layers: int = 6, hidden: int = 64, heads: int = 4, head_dim: int = 16,
                  drop: tuple[str, ...] = (), **keys: Any) -> GGUFFile:
    """A gemma2 file of metadata only: the converter's keys (window 8, softcaps 50 and 30) unless dropped
    or replaced (`keys`, '.' written as '__': `attention__sliding_window=0`)."""
    writer = gguf.GGUFWriter(path, "gemma2")
    values: dict[str, Any] = {
        "context_length": 128, "embedding_length": hidden, "block_count": layers,
        "feed_forward_length": 2 * hidden, "attention.head_count": heads, "attention.head_count_kv": 1,
        "attention.key_length": head_dim, "attention.value_length": head_dim,
        "attention.layer_norm_rms_epsilon": 1e-6, "attn_logit_softcapping": 50.0,
        "final_logit_softcapping": 30.0, "attention.sliding_window": 8,
    } | {key.replace("__", "."): value for key, value in keys.items()}
    for key, value in values.items():
        if key in drop:
            continue
        if isinstance(value, list):
            writer.add_array(f"gemma2.{key}", value)
        elif isinstance(value, str):
            writer.add_string(f"gemma2.{key}", value)
        elif isinstance(value, float):
            writer.add_float32(f"gemma2.{key}", value)
        else:
            writer.add_int32(f"gemma2.{key}", value)
    writer.add_token_list(["<pad>", "<eos>", "<bos>"])
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return GGUFFile.open(path)


def test_llama_cpp_s_defaults(tmp_path: Path) -> None:
    """Without the keys the converter writes, llama.cpp's gemma2 defaults: softcaps 50 and 30, a window
    of 4096 on every other layer (the first sliding), rope base 10000 everywhere, 1/√head_dim."""
    config = build_config(metadata_only(tmp_path / "a.gguf", drop=(
        "attn_logit_softcapping", "final_logit_softcapping", "attention.sliding_window")))
    assert (config.attention_softcap, config.final_logit_softcap) == (50.0, 30.0)
    assert config.sliding_window == 4096 and config.sliding_layers == (True, False) * 3
    assert config.rope_base == config.rope_base_swa == 10000.0
    assert config.attention_scale == pytest.approx(16 ** -0.5, rel=1e-12)
    swa_base = build_config(metadata_only(tmp_path / "b.gguf", rope__freq_base_swa=5e4))
    assert (swa_base.rope_base, swa_base.rope_base_swa) == (10000.0, 5e4)
    array = build_config(metadata_only(tmp_path / "c.gguf", attention__sliding_window_pattern=[False] * 6,
                                       attention__sliding_window=0))
    assert array.sliding_layers == (False,) * 6 and array.sliding_window == 0


def test_the_27b_attention_scale(tmp_path: Path) -> None:
    """llama.cpp's rule for 46 layers (Gemma 2 27B): 1/√(H / n_head) = 1/√144 (HF query_pre_attn_scalar
    144), not 1/√head_dim (128); 9B (42 layers) keeps 1/√head_dim (256, its query_pre_attn_scalar)."""
    big = build_config(metadata_only(tmp_path / "a.gguf", layers=46, hidden=4608, heads=32, head_dim=128))
    assert big.attention_scale == pytest.approx(144 ** -0.5, rel=1e-12)
    nine = build_config(metadata_only(tmp_path / "b.gguf", layers=42, hidden=3584, heads=16, head_dim=256))
    assert nine.attention_scale == pytest.approx(256 ** -0.5, rel=1e-12)


def test_the_memory_estimate_counts_sliding_layers_at_their_window(tmp_path: Path) -> None:
    """A Gemma-2-9B-shaped file (42 layers, 8 KV heads of 256, a window of 4096 on the even layers) at a
    context of 8192: the full layers' keys and values for every position, the sliding ones' for 4096."""
    from ember.families import FAMILIES
    from ember.memory import estimate_memory

    file = metadata_only(tmp_path / "9b.gguf", layers=42, hidden=3584, heads=16, head_dim=256,
                         attention__head_count_kv=8, attention__sliding_window=4096)
    config = build_config(file)
    estimate = estimate_memory(file, config, FAMILIES["gemma2"].cache_specs(config), 8192, "quantized")
    per_position = 2 * 8 * 256 * 4  # one layer's float32 keys and values at one position
    assert estimate.kv_bytes_per_token == 21 * per_position
    assert estimate.kv_cache == 21 * per_position * (8192 + 4096)


@pytest.mark.parametrize(("keys", "named"), [
    ({"attn_logit_softcapping": 0.0}, "'gemma2.attn_logit_softcapping' is 0.0"),
    ({"final_logit_softcapping": -30.0}, "'gemma2.final_logit_softcapping' is -30.0"),
    ({"attn_logit_softcapping": "fifty"}, "'gemma2.attn_logit_softcapping' is 'fifty'"),
    ({"attention__sliding_window": 0}, "'gemma2.attention.sliding_window' is 0"),
    ({"attention__sliding_window": 0, "attention__sliding_window_pattern": [True, False] * 3},
     "'gemma2.attention.sliding_window' is 0"),
    ({"attention__sliding_window_pattern": [True] * 4}, "'gemma2.attention.sliding_window_pattern' has 4"),
    ({"rope__scaling__factor": 8.0}, "'gemma2.rope.scaling.factor' is 8.0"),
], ids=["attn_softcap_0", "final_softcap_negative", "softcap_text", "window_0", "window_0_pattern",
        "pattern_length", "rope_scaling"])
def test_bad_metadata_is_refused_in_one_line(keys: dict[str, Any], named: str, tmp_path: Path) -> None:
    with pytest.raises(GGUFError) as caught:
        build_config(metadata_only(tmp_path / "bad.gguf", **keys))
    message = str(caught.value)
    assert named in message and "\n" not in message, message


def test_a_file_with_its_own_lm_head_is_refused_in_one_line(tmp_path: Path) -> None:
    """llama.cpp reads gemma2's head from token_embd and loads no file with an `output.weight` too."""
    path = write_gemma2_gguf(tiny_gemma2(), tmp_path / "tiny.gguf", with_head=True)
    with pytest.raises(GGUFError) as caught:
        ember.load_model(path)
    assert "'output.weight'" in str(caught.value) and "\n" not in str(caught.value)
