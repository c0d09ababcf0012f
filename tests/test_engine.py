"""The engine on the real SmolLM2 file: consistency of prefill and decode, generation, limits, errors."""

from __future__ import annotations

import gguf
import numpy as np
import pytest
from allocations import step_allocations, typical

import ember
from ember.errors import ConfigError, ContextLengthError, GGUFError, UnsupportedArchitectureError
from ember.experiments.adapters import DISABLED_HOOKS
from ember.experiments.context import ExecutionPhase

PROMPT_IDS = [1, 9690, 314, 253, 1326, 30, 2, 198, 1, 4093, 198]


def test_decode_logits_equal_a_full_prefill_of_the_same_tokens(smollm2):
    generation = smollm2.generate(PROMPT_IDS, max_new_tokens=6, stop_at_eog=False)
    assert len(generation.token_ids) == 6
    # Decode's last evaluation saw PROMPT + the first 5 generated tokens; a one-shot prefill of the same
    # sequence must give the same logits at every position (the KV cache path equals the batch path).
    sequence = PROMPT_IDS + generation.token_ids
    every = smollm2.logits(sequence)
    assert every.shape == (len(sequence), smollm2.config.vocab_size)
    greedy_from_prefill = every[len(PROMPT_IDS) - 1:-1].argmax(axis=1).tolist()
    assert greedy_from_prefill == generation.token_ids


def test_decode_step_matches_prefill_numerically(smollm2):
    forward = smollm2._forward
    ids = np.array(PROMPT_IDS, dtype=np.int64)
    cache = forward.new_cache(64)
    forward.forward(ids[:-1], 0, cache, forward.new_workspace(len(ids) - 1, 64), DISABLED_HOOKS,
                    ExecutionPhase.PREFILL)
    decoded = forward.forward(ids[-1:], len(ids) - 1, cache, forward.new_workspace(1, 64), DISABLED_HOOKS,
                              ExecutionPhase.DECODE).copy()
    batch = smollm2.logits(PROMPT_IDS)[-1]
    assert np.abs(decoded[0] - batch).max() <= 1e-4 * np.abs(batch).max()


def test_greedy_generation_is_sensible_and_repeatable(smollm2):
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    first = smollm2.chat(messages, max_new_tokens=12)
    second = smollm2.chat(messages, max_new_tokens=12)
    assert first.token_ids == second.token_ids
    assert first.prompt_token_ids[:1] == [smollm2.tokenizer.bos_id]  # <|im_start|> parsed as a token
    assert "Paris" in first.text


def test_seeded_sampling_is_repeatable_and_seed_dependent(smollm2):
    settings = dict(max_new_tokens=12, temperature=1.0, top_k=50, top_p=0.95, stop_at_eog=False)
    a = smollm2.generate("Once upon a time", seed=1, **settings)
    b = smollm2.generate("Once upon a time", seed=1, **settings)
    c = smollm2.generate("Once upon a time", seed=2, **settings)
    assert a.token_ids == b.token_ids
    assert a.token_ids != c.token_ids


def test_streamed_text_is_the_final_text(smollm2):
    pieces: list[str] = []
    generation = smollm2.generate("The three primary colors are", max_new_tokens=10, on_text=pieces.append)
    assert "".join(pieces) == generation.text
    assert generation.text == smollm2.tokenizer.decode(generation.token_ids)


def test_generation_reports_timings_and_stop_reason(smollm2):
    generation = smollm2.generate(PROMPT_IDS, max_new_tokens=4, stop_at_eog=False)
    assert generation.stop_reason == "length" and generation.complete
    assert generation.prompt_token_ids == PROMPT_IDS
    t = generation.timings
    assert t.prompt_tokens == len(PROMPT_IDS) and t.decode_evaluations == 3
    assert t.prefill_tokens_per_second > 0 and t.decode_tokens_per_second > 0


def test_a_prompt_that_does_not_fit_fails_before_any_compute(smollm2):
    with pytest.raises(ContextLengthError, match="does not fit the context of 1024"):
        smollm2.generate(list(range(1000)), max_new_tokens=100)


def test_bad_token_ids_and_lengths_are_config_errors(smollm2):
    with pytest.raises(ConfigError, match="outside the vocabulary"):
        smollm2.generate([1, 10**6])
    with pytest.raises(ConfigError, match="empty"):
        smollm2.generate([])
    with pytest.raises(ConfigError, match="context_length"):
        ember.load_model(smollm2.source, context_length=10**6)


@pytest.mark.parametrize("architecture", ["llama", "qwen3"])
def test_decode_allocates_no_activations_after_warm_up(tmp_path, architecture):
    # A model whose smallest activation row (hidden 2048 floats = 8 KiB) is far larger than NumPy's
    # per-call bookkeeping (iterator structs, views: under 3 KiB), so any activation allocated during
    # decode shows in the traced peak.
    path = tmp_path / "wide.gguf"
    _write_gguf(path, architecture, hidden=2048, ffn=4096, layers=2, head_dim=64)
    model = ember.load_model(path)
    forward = model._forward
    cache = forward.new_cache(32)
    workspace = forward.new_workspace(1, 32)
    forward.forward(np.array([0, 1, 2]), 0, cache, forward.new_workspace(3, 32), DISABLED_HOOKS,
                    ExecutionPhase.PREFILL)
    token = np.array([3])
    forward.forward(token, 3, cache, workspace, DISABLED_HOOKS, ExecutionPhase.DECODE)  # warm-up
    smallest_activation = model.config.hidden_size * 4
    # long enough that anything scaling with the keys would show
    step_peaks, kept = step_allocations(
        lambda position: forward.forward(token, position, cache, workspace, DISABLED_HOOKS,
                                         ExecutionPhase.DECODE), range(4, 30))
    assert typical(step_peaks) < smallest_activation, f"decode steps allocated {step_peaks} bytes at once"
    assert typical(step_peaks[-8:]) <= typical(step_peaks[:8]) + 512, f"the peak grew: {step_peaks}"
    # NumPy keeps ~100-byte entries in internal caches as the key count grows; nothing activation-sized.
    assert typical(kept) < 256, kept


def _write_gguf(path, architecture: str, *, drop: str | None = None, hidden: int = 8, ffn: int = 16,
                layers: int = 1, head_dim: int = 4) -> None:
    """A tiny random model with a 4-token vocabulary."""
    heads = hidden // head_dim
    writer = gguf.GGUFWriter(str(path), architecture)
    writer.add_context_length(32)
    writer.add_embedding_length(hidden)
    writer.add_block_count(layers)
    writer.add_feed_forward_length(ffn)
    writer.add_head_count(heads)
    writer.add_head_count_kv(heads // 2)
    writer.add_layer_norm_rms_eps(1e-5)
    if architecture == "qwen3":
        writer.add_key_length(head_dim)
        writer.add_value_length(head_dim)
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("default")
    writer.add_token_list(["a", "b", "c", "ab"])
    writer.add_token_types([1, 1, 1, 1])
    writer.add_token_merges(["a b"])
    kv = heads // 2 * head_dim
    shapes = {"token_embd.weight": (4, hidden), "output_norm.weight": (hidden,)}
    for i in range(layers):
        shapes |= {f"blk.{i}.attn_norm.weight": (hidden,), f"blk.{i}.attn_q.weight": (hidden, hidden),
                   f"blk.{i}.attn_k.weight": (kv, hidden), f"blk.{i}.attn_v.weight": (kv, hidden),
                   f"blk.{i}.attn_output.weight": (hidden, hidden), f"blk.{i}.ffn_norm.weight": (hidden,),
                   f"blk.{i}.ffn_gate.weight": (ffn, hidden), f"blk.{i}.ffn_up.weight": (ffn, hidden),
                   f"blk.{i}.ffn_down.weight": (hidden, ffn)}
        if architecture == "qwen3":
            shapes |= {f"blk.{i}.attn_q_norm.weight": (head_dim,), f"blk.{i}.attn_k_norm.weight": (head_dim,)}
    rng = np.random.default_rng(0)
    for name, shape in shapes.items():
        if name != drop:
            writer.add_tensor(name, rng.standard_normal(shape).astype(np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def test_a_tiny_llama_file_loads_and_generates(tmp_path):
    path = tmp_path / "tiny.gguf"
    _write_gguf(path, "llama")
    model = ember.load_model(path)
    assert model.config.layer_count == 1 and model.config.tied_embeddings
    generation = model.generate([0, 1], max_new_tokens=3, stop_at_eog=False)
    assert len(generation.token_ids) == 3


def test_unknown_architecture_names_the_supported_ones(tmp_path):
    path = tmp_path / "other.gguf"
    _write_gguf(path, "gpt2")
    with pytest.raises(UnsupportedArchitectureError, match="'gpt2' is not supported.*llama.*qwen3"):
        ember.load_model(path)


def test_a_missing_tensor_is_named(tmp_path):
    path = tmp_path / "broken.gguf"
    _write_gguf(path, "llama", drop="blk.0.ffn_up.weight")
    with pytest.raises(GGUFError, match="blk.0.ffn_up.weight"):
        ember.load_model(path)
