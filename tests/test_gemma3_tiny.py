"""Tiny random Gemma 3 models written as GGUF the way llama.cpp's converter does, against transformers.

Fast enough for the default run. The window is 4 tokens, so prompts of 11 tokens need the sliding mask
in the prefill and every decode step crosses it. Two variants:

* `default`: no pattern key (5 sliding : 1 full, the 7th layer sliding again), no `rope.freq_base_swa`
  (10000), no softcap, GQA 4 heads over 2;
* `explicit`: a per-layer pattern array, `rope.freq_base_swa` 50000, linear rope factor 4 on the full
  layers only, `final_logit_softcapping` 30.

Converter facts mirrored (llama.cpp `conversion/gemma.py`, docs/families.md §4.2): every `*norm.weight` is
stored as w + 1, the LM head is tied (no `output.weight`), norm tensors are F32.
Also: the config reader on metadata-only files (pattern forms, the 27B attention scale, no window).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import gguf
import numpy as np
import pytest
from reference.names import gguf_tensor_name

import ember
from ember.families.gemma3 import build_config
from ember.gguf_file import GGUFFile

pytestmark = pytest.mark.reference

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from test_gemma3_reference import LAYER_BOUNDARIES, Capture, hf_capture, relative  # noqa: E402

WINDOW = 4
HEAD_DIM = 16

def spm_vocab() -> tuple[list[str], list[float], list[int]]:
    """A small SentencePiece-style vocabulary: <pad> <eos> <bos> <unk>, 256 byte tokens, ▁ and letters."""
    tokens = ["<pad>", "<eos>", "<bos>", "<unk>"]
    types = [gguf.TokenType.CONTROL] * 3 + [gguf.TokenType.UNKNOWN]
    tokens += [f"<0x{b:02X}>" for b in range(256)]
    types += [gguf.TokenType.BYTE] * 256
    normal = ["▁"] + [chr(c) for c in range(ord("a"), ord("z") + 1)] + ["▁t", "he", "▁the", "in", "er"]
    tokens += normal
    types += [gguf.TokenType.NORMAL] * len(normal)
    scores = [-1000.0] * 260 + [-float(i) for i in range(len(normal))]
    return tokens, scores, [int(t) for t in types]


def tiny_gemma3(variant: str, seed: int = 0) -> Any:
    from transformers import Gemma3ForCausalLM, Gemma3TextConfig

    vocab = len(spm_vocab()[0])
    common = dict(vocab_size=vocab, hidden_size=64, intermediate_size=96, num_attention_heads=4,
                  num_key_value_heads=2, head_dim=HEAD_DIM, query_pre_attn_scalar=HEAD_DIM,
                  sliding_window=WINDOW, max_position_embeddings=64, rms_norm_eps=1e-6, pad_token_id=0,
                  eos_token_id=1, bos_token_id=2, tie_word_embeddings=True, attn_implementation="eager")
    if variant == "default":
        config = Gemma3TextConfig(num_hidden_layers=7, **common)
    else:
        config = Gemma3TextConfig(
            num_hidden_layers=4, final_logit_softcapping=30.0,
            layer_types=["sliding_attention", "full_attention", "sliding_attention", "full_attention"],
            rope_parameters={"sliding_attention": {"rope_type": "default", "rope_theta": 50000.0},
                             "full_attention": {"rope_type": "linear", "factor": 4.0, "rope_theta": 1e6}},
            **common)
    model = Gemma3ForCausalLM(config).to(torch.float32)
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if param.ndim == 1:  # HF norm weight w; the model multiplies by 1 + w
                param.copy_(torch.rand(param.shape, generator=generator) - 0.5)
            elif name.endswith("embed_tokens.weight"):
                param.copy_(torch.randn(param.shape, generator=generator) * 0.5)
            else:
                param.copy_(torch.randn(param.shape, generator=generator) / param.shape[1] ** 0.5)
        model.model.embed_tokens.weight[:4] = 0.0  # never pick <pad>/<eos>/<bos>/<unk> greedily
    return model.eval()


def write_gemma3_gguf(model: Any, path: Path, variant: str) -> Path:
    config = model.config
    writer = gguf.GGUFWriter(path, "gemma3")
    writer.add_type(gguf.GGUFType.MODEL)
    writer.add_name(f"tiny-gemma3-{variant}")
    writer.add_context_length(config.max_position_embeddings)
    writer.add_embedding_length(config.hidden_size)
    writer.add_block_count(config.num_hidden_layers)
    writer.add_feed_forward_length(config.intermediate_size)
    writer.add_head_count(config.num_attention_heads)
    writer.add_head_count_kv(config.num_key_value_heads)
    writer.add_key_length(config.head_dim)
    writer.add_value_length(config.head_dim)
    writer.add_layer_norm_rms_eps(config.rms_norm_eps)
    writer.add_rope_freq_base(config.rope_parameters["full_attention"]["rope_theta"])
    writer.add_sliding_window(config.sliding_window)
    if variant == "explicit":
        writer.add_sliding_window_pattern([t == "sliding_attention" for t in config.layer_types])
        writer.add_rope_freq_base_swa(config.rope_parameters["sliding_attention"]["rope_theta"])
        writer.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
        writer.add_rope_scaling_factor(config.rope_parameters["full_attention"]["factor"])
        writer.add_final_logit_softcapping(config.final_logit_softcapping)
    writer.add_file_type(gguf.LlamaFileType.ALL_F32)
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
    for hf_name, tensor in model.state_dict().items():
        if hf_name == "lm_head.weight":
            continue  # tied
        data = tensor.detach().to(torch.float32).numpy()
        name = gguf_tensor_name("gemma3", model.config.num_hidden_layers, hf_name)
        if name.endswith("norm.weight"):
            data = data + np.float32(1.0)  # the converter's norm shift: the file holds 1 + w
        writer.add_tensor(name, np.ascontiguousarray(data, dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


@pytest.fixture(scope="module", params=["default", "explicit"])
def pair(request: Any, tmp_path_factory: Any) -> tuple[Any, Any, str]:
    hf = tiny_gemma3(request.param)
    path = write_gemma3_gguf(hf, tmp_path_factory.mktemp("gemma3") / f"tiny-{request.param}.gguf",
                             request.param)
    return ember.load_model(path), hf, request.param


def test_config_read_from_the_file(pair: tuple[Any, Any, str]) -> None:
    model, hf, variant = pair
    c = model.config
    assert c.family.value == "gemma3" and c.sliding_window == WINDOW
    assert list(c.sliding_layers) == [t == "sliding_attention" for t in hf.config.layer_types]
    assert c.attention_scale == pytest.approx(hf.config.query_pre_attn_scalar ** -0.5, rel=1e-12)
    if variant == "default":
        assert c.sliding_layers == (True,) * 5 + (False, True)
        assert (c.rope_base_swa, c.rope_linear_factor, c.final_logit_softcap) == (10000.0, 1.0, 0.0)
    else:
        assert (c.rope_base_swa, c.rope_linear_factor, c.final_logit_softcap) == (50000.0, 4.0, 30.0)


def test_every_boundary_matches_transformers(pair: tuple[Any, Any, str]) -> None:
    """Prefill of 11 tokens (window 4), then 6 decode steps: all boundaries, final norm and logits."""
    model, hf, _ = pair
    prompt = [2, 270, 281, 264, 262, 279, 277, 265, 273, 290, 261]
    capture = Capture()
    generation = model.generate(prompt, max_new_tokens=7, experiments=[capture], stop_at_eog=False)
    theirs = hf_capture(hf, prompt, generation.token_ids[:6])
    assert len(capture.evaluations) == len(theirs) == 7
    for ours, reference in zip(capture.evaluations, theirs, strict=True):
        for boundary in LAYER_BOUNDARIES:
            for layer, (x, y) in enumerate(zip(ours.layers[boundary], reference.layers[boundary],
                                               strict=True)):
                assert relative(x, y) <= 1e-5, (ours.start_position, layer, boundary, relative(x, y))
        assert relative(ours.final_norm, reference.final_norm[-1:]) <= 1e-5
        assert float(np.max(np.abs(ours.logits - reference.logits))) <= 1e-4
    # every position's logits from one clean prefill
    with torch.no_grad():
        every = hf(input_ids=torch.tensor([prompt])).logits[0].numpy()
    assert float(np.max(np.abs(model.logits(prompt) - every))) <= 1e-4


def test_greedy_tokens_match_transformers(pair: tuple[Any, Any, str]) -> None:
    model, hf, _ = pair
    prompt = [2, 270, 281, 264, 262]
    ours = model.generate(prompt, max_new_tokens=12, stop_at_eog=False).token_ids
    with torch.no_grad():
        theirs = hf.generate(torch.tensor([prompt]), max_new_tokens=12, do_sample=False,
                             min_new_tokens=12)[0, len(prompt):].tolist()
    assert ours == theirs


def test_sliding_layers_hold_only_their_window(pair: tuple[Any, Any, str]) -> None:
    model, _, _ = pair
    model.generate([2] + list(range(262, 282)), max_new_tokens=3)
    cache = model._cache
    for layer, slides in zip(cache.layers, model.config.sliding_layers, strict=True):
        held = layer.keys.shape[1]
        assert held == (WINDOW if slides else model.context_length)


# --------------------------------------------------------------------------- config reader


def metadata_only(path: Path, *, layers: int = 6, hidden: int = 64, heads: int = 4, head_dim: int = 16,
                  window: int | None = 8, pattern: int | list[bool] | None = None,
                  scaling: tuple[str, float] | None = None) -> GGUFFile:
    writer = gguf.GGUFWriter(path, "gemma3")
    writer.add_context_length(128)
    writer.add_embedding_length(hidden)
    writer.add_block_count(layers)
    writer.add_feed_forward_length(2 * hidden)
    writer.add_head_count(heads)
    writer.add_head_count_kv(1)
    writer.add_key_length(head_dim)
    writer.add_value_length(head_dim)
    writer.add_layer_norm_rms_eps(1e-6)
    writer.add_rope_freq_base(1e6)
    if window is not None:
        writer.add_sliding_window(window)
    if pattern is not None:
        writer.add_sliding_window_pattern(pattern)
    if scaling is not None:
        writer.add_string("gemma3.rope.scaling.type", scaling[0])
        writer.add_rope_scaling_factor(scaling[1])
    writer.add_token_list(["<pad>", "<eos>", "<bos>"])
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return GGUFFile.open(path)


def test_pattern_forms(tmp_path: Path) -> None:
    default = build_config(metadata_only(tmp_path / "a.gguf", layers=13))
    assert [layer for layer, slides in enumerate(default.sliding_layers) if not slides] == [5, 11]
    period_3 = build_config(metadata_only(tmp_path / "b.gguf", pattern=3))
    assert period_3.sliding_layers == (True, True, False, True, True, False)
    array = build_config(metadata_only(tmp_path / "c.gguf", pattern=[False, True] * 3))
    assert array.sliding_layers == (False, True) * 3
    no_window = build_config(metadata_only(tmp_path / "d.gguf", window=None))
    assert no_window.sliding_layers == (False,) * 6 and no_window.sliding_window == 0
    with pytest.raises(ember.EmberError, match="sliding_window_pattern.*4 entries"):
        build_config(metadata_only(tmp_path / "e.gguf", pattern=[True] * 4))


def test_attention_scale_and_scaling(tmp_path: Path) -> None:
    small = build_config(metadata_only(tmp_path / "a.gguf", hidden=64, heads=4, head_dim=32))
    assert small.attention_scale == pytest.approx(32 ** -0.5, rel=1e-12)  # 1/√head_dim, not 1/√(H / heads)
    # llama.cpp's Gemma 3 27B rule (62 layers): 1/√(H / n_head), HF query_pre_attn_scalar 168
    big = build_config(metadata_only(tmp_path / "b.gguf", layers=62, hidden=5376, heads=32, head_dim=128))
    assert big.attention_scale == pytest.approx(168 ** -0.5, rel=1e-12)
    assert build_config(metadata_only(tmp_path / "c.gguf", scaling=("linear", 8.0))).rope_linear_factor == 8.0
    with pytest.raises(ember.EmberError, match="rope scaling type 'yarn'"):
        build_config(metadata_only(tmp_path / "d.gguf", scaling=("yarn", 4.0)))

