"""Tiny random Phi-3 models written as GGUF the way llama.cpp's converter does, against transformers.

Each of phi3's own parts is switched on so that an engine without it fails: fused `qkv_proj` and
`gate_up_proj` (an engine taking the halves the other way round fails), partial rotary (8 of 16 dims
per head), LongRoPE with short and long factors far from 1 (original context 8, trained context 64: the
converter's attention factor is √(1 + ln 8 / ln 8) = √2), GQA 4 heads over 2. `test_each_part_shows`
proves each one matters: transformers without it is far from ember.

Converter facts mirrored (llama.cpp `conversion/phi.py` Phi3MiniModel, docs/families.md §12): metadata
`context_length` (max_position_embeddings), `rope.scaling.original_context_length`, `embedding_length`,
`feed_forward_length`, `block_count`, `attention.head_count(_kv)`, `attention.layer_norm_rms_epsilon`,
`rope.dimension_count` = int(partial_rotary_factor · H) // heads, `rope.freq_base`,
`attention.sliding_window` (0 without one); with LongRoPE also `rope.scaling.attn_factor` and the F32
tensors `rope_factors_long.weight` / `rope_factors_short.weight`; no key_length, no scaling type. HF's
fused tensors keep their names' layout: `qkv_proj` → `attn_qkv`, `gate_up_proj` → `ffn_up`. A SentencePiece
vocabulary (Phi-3; Phi-4-mini's gpt-4o BPE is tests/test_tokenizer_gpt4o.py's).

Which factors: llama.cpp picks by the context it is given (long when it exceeds the original context);
transformers by the longest position in each call. The long models here are loaded with the file's
context (64) and given prompts longer than 8; the short one with a context of 8 and prompts within it.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import gguf
import numpy as np
import pytest
from gguf import GGMLQuantizationType
from reference.names import gguf_tensor_name

import ember
from ember.errors import GGUFError
from ember.families.phi3 import build_config
from ember.gguf_file import GGUFFile

pytestmark = pytest.mark.reference

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from reference.hf_capture import capture as hf_capture  # noqa: E402
from test_gemma3_reference import LAYER_BOUNDARIES, Capture, relative  # noqa: E402
from test_gemma3_tiny import spm_vocab  # noqa: E402

TOLERANCE = 1e-4
HIDDEN, HEADS, KV_HEADS, HEAD_DIM = 64, 4, 2, 16
ORIGINAL_CONTEXT, CONTEXT = 8, 64
SHORT = [1.0, 1.3, 2.0, 3.5]
LONG = [1.5, 4.0, 9.0, 20.0]
PROMPT = [2, 270, 281, 264, 262, 279, 277, 265, 273, 290, 261]  # 11 tokens: past the original context
SHORT_PROMPT = [2, 270, 281, 264, 262]
F32, Q8_0 = GGMLQuantizationType.F32, GGMLQuantizationType.Q8_0


def longrope(short: list[float] = SHORT, long: list[float] = LONG, **extra: Any) -> dict[str, Any]:
    return {"rope_type": "longrope", "short_factor": list(short), "long_factor": list(long)} | extra


def tiny_phi3(seed: int = 0, *, swap_gate_up: bool = False, **overrides: Any) -> Any:
    """3 layers, hidden 64, 4 query heads over 2 KV heads of 16 dims, rotary over half of each head
    (8 dims: 4 factors), LongRoPE. `swap_gate_up`: the same file's weights with gate and up exchanged."""
    from transformers import Phi3Config, Phi3ForCausalLM

    settings = dict(vocab_size=len(spm_vocab()[0]), hidden_size=HIDDEN, intermediate_size=96,
                    num_hidden_layers=3, num_attention_heads=HEADS, num_key_value_heads=KV_HEADS,
                    partial_rotary_factor=0.5, max_position_embeddings=CONTEXT,
                    original_max_position_embeddings=ORIGINAL_CONTEXT, rope_scaling=longrope(),
                    rope_theta=10000.0, sliding_window=None, rms_norm_eps=1e-5, pad_token_id=0,
                    eos_token_id=1, bos_token_id=2, tie_word_embeddings=False,
                    attn_implementation="eager") | overrides
    model = Phi3ForCausalLM(Phi3Config(**settings)).to(torch.float32)
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if param.ndim == 1:
                param.copy_(0.5 + torch.rand(param.shape, generator=generator))
            elif name.endswith("embed_tokens.weight"):
                param.copy_(torch.randn(param.shape, generator=generator) * 0.5)
            else:  # queries and keys larger (attention far from uniform, so rope's angles matter), not
                # so large that a row attends to one position only
                gain = 1.5 if name.endswith("qkv_proj.weight") else 1.0
                param.copy_(torch.randn(param.shape, generator=generator) * gain / param.shape[1] ** 0.5)
        model.model.embed_tokens.weight[:4] = 0.0  # never pick <pad>/<eos>/<bos>/<unk> greedily
        if swap_gate_up:
            for layer in model.model.layers:
                gate, up = layer.mlp.gate_up_proj.weight.chunk(2, dim=0)
                layer.mlp.gate_up_proj.weight.copy_(torch.cat([up.clone(), gate.clone()]))
    return model.eval()


def _tensor_data(data: np.ndarray, qtype: GGMLQuantizationType) -> tuple[np.ndarray, Any]:
    if data.ndim == 1 or qtype == F32:
        return np.ascontiguousarray(data, dtype=np.float32), F32
    return gguf.quants.quantize(np.ascontiguousarray(data, dtype=np.float32), qtype), qtype


def write_phi3_gguf(model: Any, path: Path, qtype: GGMLQuantizationType = F32, *,
                    long_factors: list[float] | None = None) -> Path:
    """The file llama.cpp's converter writes for `model` (`long_factors`: a long-factor tensor other than
    the config's, to write a bad file)."""
    config = model.config
    rope = config.rope_parameters
    heads, hidden = config.num_attention_heads, config.hidden_size
    rope_dims = int(rope.get("partial_rotary_factor", 1.0) * hidden) // heads
    original = rope.get("original_max_position_embeddings", config.original_max_position_embeddings)
    writer = gguf.GGUFWriter(path, "phi3")
    keys: dict[str, Any] = {
        "context_length": config.max_position_embeddings, "rope.scaling.original_context_length": original,
        "embedding_length": hidden, "feed_forward_length": config.intermediate_size,
        "block_count": config.num_hidden_layers, "attention.head_count": heads,
        "attention.head_count_kv": config.num_key_value_heads,
        "attention.layer_norm_rms_epsilon": float(config.rms_norm_eps), "rope.dimension_count": rope_dims,
        "rope.freq_base": float(rope["rope_theta"]), "attention.sliding_window": config.sliding_window or 0,
    }
    long, short = rope.get("long_factor"), rope.get("short_factor")
    if long:
        scale = config.max_position_embeddings / original
        factor = math.sqrt(1 + math.log(scale) / math.log(original)) if scale > 1 else 1.0
        keys["rope.scaling.attn_factor"] = factor
    writer.add_type(gguf.GGUFType.MODEL)
    writer.add_name("tiny-phi3")
    for key, value in keys.items():
        if isinstance(value, float):
            writer.add_float32(f"phi3.{key}", value)
        else:
            writer.add_uint32(f"phi3.{key}", int(value))
    writer.add_file_type(int(gguf.LlamaFileType.ALL_F32 if qtype == F32 else gguf.LlamaFileType.MOSTLY_Q8_0))
    tokens, scores, types = spm_vocab()
    # Phi-3's names for the control tokens: llama.cpp looks "</s>", "<unk>", "<s>" and "<|endoftext|>" up
    # by text when a model's name says phi3 (per-token attributes) and refuses a vocabulary without them
    tokens[:4] = ["<|endoftext|>", "</s>", "<s>", "<unk>"]
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
    writer.add_quantization_version(gguf.GGML_QUANT_VERSION)
    for hf_name, tensor in model.state_dict().items():
        if hf_name == "lm_head.weight" and config.tie_word_embeddings:
            continue  # a tied checkpoint has no lm_head tensor to convert
        name = gguf_tensor_name("phi3", config.num_hidden_layers, hf_name)
        stored, kind = _tensor_data(tensor.detach().to(torch.float32).numpy(), qtype)
        writer.add_tensor(name, stored, raw_dtype=kind)
    if long:
        for name, factors in (("rope_factors_long.weight", long_factors or long),
                              ("rope_factors_short.weight", short)):
            writer.add_tensor(name, np.asarray(factors, np.float32), raw_dtype=F32)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def load_file_weights_into_hf(model: Any, path: Path) -> None:
    """Give `model` the weights `path` holds (dequantized): what ember reads."""
    names = {gguf_tensor_name("phi3", model.config.num_hidden_layers, n): n for n in model.state_dict()}
    state = model.state_dict()
    with torch.no_grad():
        for tensor in gguf.GGUFReader(path).tensors:
            if tensor.name not in names:
                continue  # the rope factors
            data = gguf.dequantize(tensor.data, tensor.tensor_type).astype(np.float32)
            target = state[names[tensor.name]]
            target.copy_(torch.from_numpy(data.reshape(target.shape)))


VARIANTS = {  # name: (file type, tied LM head, context ember holds, prompt)
    "f32-long": (F32, False, None, PROMPT),
    "q8_0-long": (Q8_0, False, None, PROMPT),
    "f32-short-tied": (F32, True, ORIGINAL_CONTEXT, SHORT_PROMPT),
}


@pytest.fixture(scope="module", params=list(VARIANTS))
def case(request: Any, tmp_path_factory: Any) -> tuple[Any, Any, list[int], str]:
    qtype, tied, context, prompt = VARIANTS[request.param]
    hf = tiny_phi3(tie_word_embeddings=tied)
    path = write_phi3_gguf(hf, tmp_path_factory.mktemp("phi3") / f"tiny-{request.param}.gguf", qtype)
    if qtype != F32:
        load_file_weights_into_hf(hf, path)
    return ember.load_model(path, context_length=context), hf, prompt, request.param


def test_config_read_from_the_file(case: tuple[Any, Any, list[int], str]) -> None:
    model, hf, _, name = case
    c = model.config
    assert c.family.value == "phi3" and c.rope_layout.value == "neox" and not c.has_qk_norm
    assert (c.head_dim, c.rope_dim) == (HEAD_DIM, HEAD_DIM // 2)
    assert c.rope_original_context == ORIGINAL_CONTEXT and c.context_length == CONTEXT
    assert c.rope_attention_factor == pytest.approx(hf.model.rotary_emb.attention_scaling, rel=1e-6)
    assert c.tied_embeddings == name.endswith("tied")
    assert model._forward.rope_factors.tolist() == pytest.approx(SHORT if "short" in name else LONG)


def test_fused_weights_stay_quantized(case: tuple[Any, Any, list[int], str]) -> None:
    """The fused tensors are multiplied from the file's blocks as they are: never dequantized whole."""
    model, _, _, name = case
    if not name.startswith("q8_0"):
        pytest.skip("F32 files hold no blocks")
    model.generate(PROMPT[:4], max_new_tokens=2)
    assert not model._forward.store.full_dequantizations
    layer = model._forward.weights.layers[0]
    assert type(layer.qkv).__name__ == type(layer.gate_up).__name__ == "QuantizedMatrix"
    assert layer.qkv.shape == ((HEADS + 2 * KV_HEADS) * HEAD_DIM, HIDDEN)
    assert layer.gate_up.shape == (2 * 96, HIDDEN)


def compare_with_transformers(model: Any, hf: Any, prompt: list[int], steps: int) -> dict[str, float]:
    """Prefill then `steps` decode steps on ember's greedy tokens: worst relative error per boundary."""
    capture = Capture()
    generation = model.generate(prompt, max_new_tokens=steps + 1, experiments=[capture], stop_at_eog=False)
    theirs = hf_capture(hf, prompt, generation.token_ids[:steps])
    assert len(capture.evaluations) == len(theirs) == steps + 1
    worst: dict[str, float] = {}
    for ours, reference in zip(capture.evaluations, theirs, strict=True):
        for boundary in LAYER_BOUNDARIES:
            for x, y in zip(ours.layers[boundary], getattr(reference, boundary), strict=True):
                worst[boundary] = max(worst.get(boundary, 0.0), relative(x, y))
        worst["final_norm"] = max(worst.get("final_norm", 0.0),
                                  relative(ours.final_norm, reference.final_norm[-1:]))
        worst["logits"] = max(worst.get("logits", 0.0), relative(ours.logits, reference.logits[-1:]))
    return worst


def test_every_boundary_matches_transformers(case: tuple[Any, Any, list[int], str]) -> None:
    """Prefill, then decode steps (the short case stays within the original context of 8)."""
    model, hf, prompt, name = case
    steps = 2 if "short" in name else 6
    worst = compare_with_transformers(model, hf, prompt, steps)
    print(f"\n{name} worst relative error: " + ", ".join(f"{k} {v:.1e}" for k, v in worst.items()))
    assert all(error <= TOLERANCE for error in worst.values()), worst
    with torch.no_grad():  # every position's logits from one clean prefill
        every = hf(input_ids=torch.tensor([prompt])).logits[0].numpy()
    assert relative(model.logits(prompt), every) <= TOLERANCE


def test_greedy_tokens_match_transformers(case: tuple[Any, Any, list[int], str]) -> None:
    model, hf, prompt, name = case
    if "short" in name:
        pytest.skip("the context of 8 holds no long generation")
    ours = model.generate(prompt, max_new_tokens=12, stop_at_eog=False).token_ids
    with torch.no_grad():
        theirs = hf.generate(torch.tensor([prompt]), max_new_tokens=12, do_sample=False,
                             min_new_tokens=12)[0, len(prompt):].tolist()
    assert ours == theirs


# phi3's parts switched off (or done the other way) on the transformers side, same weights; the
# boundary an engine without the part first goes wrong at; whether the short case shows it
WITHOUT = {
    "partial_rotary": (lambda: tiny_phi3(partial_rotary_factor=1.0,
                                         rope_scaling=longrope(SHORT + [1.0] * 4, LONG + [1.0] * 4)),
                       "after_attention", False),
    "long_factors": (lambda: tiny_phi3(rope_scaling=longrope(SHORT, SHORT)), "after_attention", False),
    "attention_factor": (lambda: tiny_phi3(rope_scaling=longrope(attention_factor=1.0)), "after_attention",
                         False),
    "gate_up_order": (lambda: tiny_phi3(swap_gate_up=True), "after_mlp", False),
    "short_factors": (lambda: tiny_phi3(rope_scaling=longrope([1.0] * 4, LONG)), "after_attention", True),
}


@pytest.mark.parametrize("part", list(WITHOUT))
def test_each_part_shows(part: str, tmp_path: Path) -> None:
    """The comparison above would catch an engine without each part: transformers without it differs
    from ember (which has it) by far more than the tolerance."""
    build, boundary, short = WITHOUT[part]
    path = write_phi3_gguf(tiny_phi3(), tmp_path / "tiny.gguf")
    model = ember.load_model(path, context_length=ORIGINAL_CONTEXT if short else None)
    worst = compare_with_transformers(model, build(), SHORT_PROMPT if short else PROMPT, 2)
    assert worst[boundary] > 100 * TOLERANCE, (part, worst)


def test_the_context_picks_the_factors(tmp_path: Path) -> None:
    """llama.cpp's rule: the long factors when the context is longer than the original context (8), the
    short ones up to it; the same prompt's logits differ between the two."""
    path = write_phi3_gguf(tiny_phi3(), tmp_path / "tiny.gguf")
    at_original = ember.load_model(path, context_length=ORIGINAL_CONTEXT)
    past_it = ember.load_model(path, context_length=ORIGINAL_CONTEXT + 1)
    assert at_original._forward.rope_factors.tolist() == pytest.approx(SHORT)
    assert past_it._forward.rope_factors.tolist() == pytest.approx(LONG)
    assert relative(at_original.logits(SHORT_PROMPT), past_it.logits(SHORT_PROMPT)) > 100 * TOLERANCE


def test_a_file_without_longrope_is_plain_partial_rope(tmp_path: Path) -> None:
    """Phi-4-mini's own file has no factors (and no attention factor): rope with the base alone."""
    hf = tiny_phi3(rope_scaling=None, original_max_position_embeddings=CONTEXT)
    model = ember.load_model(write_phi3_gguf(hf, tmp_path / "plain.gguf"))
    assert model._forward.rope_factors is None and model.config.rope_attention_factor == 1.0
    worst = compare_with_transformers(model, hf, PROMPT, 2)
    assert all(error <= TOLERANCE for error in worst.values()), worst


def test_the_sliding_window_is_ignored_as_llama_cpp_does(tmp_path: Path) -> None:
    """llama.cpp switches phi3's sliding window off (Phi-3-mini-4k's 2047): a window of 4 in the file
    changes nothing, on a prompt of 11 tokens."""
    windowed = ember.load_model(write_phi3_gguf(tiny_phi3(sliding_window=4), tmp_path / "windowed.gguf"))
    plain = ember.load_model(write_phi3_gguf(tiny_phi3(), tmp_path / "plain.gguf"))
    assert windowed.gguf.metadata["phi3.attention.sliding_window"] == 4
    assert np.array_equal(windowed.logits(PROMPT), plain.logits(PROMPT))


def test_transformers_gguf_import_is_no_reference(tmp_path: Path) -> None:
    """transformers' own GGUF import of a phi3 file rotates every dim with plain rope (no partial rotary,
    no factors: docs/families.md §5); ember, which reads them, matches the model the file came from."""
    from reference.hf_capture import load_hf_from_gguf

    hf = tiny_phi3()
    path = write_phi3_gguf(hf, tmp_path / "tiny.gguf")
    imported = load_hf_from_gguf(path)
    assert imported.config.rope_parameters.get("partial_rotary_factor", 1.0) == 1.0
    assert imported.config.rope_parameters.get("rope_type") == "default"
    ours = ember.load_model(path).logits(PROMPT)
    with torch.no_grad():
        theirs = hf(input_ids=torch.tensor([PROMPT])).logits[0].numpy()
        import_s = imported(input_ids=torch.tensor([PROMPT])).logits[0].numpy()
    assert relative(ours, theirs) <= TOLERANCE < 100 * TOLERANCE < relative(ours, import_s)


# --------------------------------------------------------------------------- bad metadata


def metadata_only(path: Path, **keys: Any) -> GGUFFile:
    """A phi3 file of metadata only: the converter's keys (head dim 16, rotary 8) unless replaced
    (`keys`, '.' written as '__': `rope__dimension_count=18`)."""
    writer = gguf.GGUFWriter(path, "phi3")
    values: dict[str, Any] = {
        "context_length": 128, "rope.scaling.original_context_length": 32, "embedding_length": HIDDEN,
        "feed_forward_length": 96, "block_count": 2, "attention.head_count": HEADS,
        "attention.head_count_kv": KV_HEADS, "attention.layer_norm_rms_epsilon": 1e-5,
        "rope.dimension_count": 8, "rope.freq_base": 10000.0, "attention.sliding_window": 0,
        "rope.scaling.attn_factor": 1.2,
    } | {key.replace("__", "."): value for key, value in keys.items()}
    for key, value in values.items():
        if isinstance(value, str):
            writer.add_string(f"phi3.{key}", value)
        elif isinstance(value, float):
            writer.add_float32(f"phi3.{key}", value)
        else:
            writer.add_int32(f"phi3.{key}", value)
    writer.add_token_list(["<pad>", "<eos>", "<bos>"])
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return GGUFFile.open(path)


def test_the_keys_are_read(tmp_path: Path) -> None:
    config = build_config(metadata_only(tmp_path / "a.gguf"))
    assert (config.rope_dim, config.head_dim, config.rope_original_context) == (8, 16, 32)
    assert config.rope_attention_factor == pytest.approx(1.2)
    defaults = build_config(metadata_only(tmp_path / "b.gguf", rope__scaling__attn_factor=1.0,
                                          rope__scaling__type="longrope"))
    assert defaults.rope_attention_factor == 1.0


def test_released_shapes(tmp_path: Path) -> None:
    """Phi-4-mini's keys (24 heads over 8 of 128 dims, 96 rotated; 131072 positions, original 4096) and
    Phi-3.5-mini's (32 heads of 96, all rotated)."""
    phi4 = build_config(metadata_only(tmp_path / "phi4.gguf", embedding_length=3072, attention__head_count=24,
                                      attention__head_count_kv=8, rope__dimension_count=96, block_count=32,
                                      context_length=131072, rope__scaling__original_context_length=4096,
                                      rope__scaling__attn_factor=1.1902380714238083))
    assert (phi4.head_dim, phi4.rope_dim, phi4.head_count_kv) == (128, 96, 8)
    assert phi4.rope_original_context == 4096 and phi4.rope_attention_factor == pytest.approx(1.19023807)
    phi35 = build_config(metadata_only(tmp_path / "phi35.gguf", embedding_length=3072,
                                       attention__head_count=32, attention__head_count_kv=32,
                                       rope__dimension_count=96))
    assert (phi35.head_dim, phi35.rope_dim) == (96, 96)


@pytest.mark.parametrize(("keys", "named"), [
    ({"rope__dimension_count": 18}, "'phi3.rope.dimension_count' is 18"),
    ({"rope__dimension_count": 0}, "'phi3.rope.dimension_count' is 0"),
    ({"rope__dimension_count": 7}, "'phi3.rope.dimension_count' is 7"),
    ({"rope__scaling__type": "yarn"}, "'phi3.rope.scaling.type' is 'yarn'"),
    ({"rope__scaling__type": "dynamic"}, "'phi3.rope.scaling.type' is 'dynamic'"),
    ({"rope__scaling__attn_factor": -1.0}, "'phi3.rope.scaling.attn_factor' is -1.0"),
    ({"rope__scaling__original_context_length": 0}, "'phi3.rope.scaling.original_context_length' is 0"),
], ids=["rotary_past_head", "rotary_0", "rotary_odd", "yarn", "unknown_type", "attn_factor", "original_0"])
def test_bad_metadata_is_refused_in_one_line(keys: dict[str, Any], named: str, tmp_path: Path) -> None:
    with pytest.raises(GGUFError) as caught:
        build_config(metadata_only(tmp_path / "bad.gguf", **keys))
    message = str(caught.value)
    assert named in message and "\n" not in message, message


@pytest.mark.parametrize(("factors", "named"), [
    ([1.0, 2.0, 3.0], "'rope_factors_long.weight' has shape (3,)"),
    ([1.0, 0.0, 3.0, 4.0], "'rope_factors_long.weight' has a factor"),
], ids=["wrong_length", "zero_factor"])
def test_bad_factor_tensors_are_refused_in_one_line(factors: list[float], named: str, tmp_path: Path) -> None:
    path = write_phi3_gguf(tiny_phi3(), tmp_path / "bad.gguf", long_factors=factors)
    with pytest.raises(GGUFError) as caught:
        ember.load_model(path)
    message = str(caught.value)
    assert named in message and "\n" not in message, message
