"""The model-size ladder's synthetic GGUF files (benchmarks/synthetic.py): llama.cpp's Q4_K_M type mix,
block scales that give the intended spread, deterministic bytes, and files both engines load (slow test).
"""

from __future__ import annotations

import dataclasses
import math

import gguf
import numpy as np
import pytest
from gguf import GGMLQuantizationType as Q

import ember
from benchmarks import synthetic
from benchmarks.synthetic import SHAPES, TensorPlan, tensor_plan, write_synthetic
from ember.experiments import Experiment

SLIDING, FULL = synthetic.SLIDING, synthetic.FULL

# Shapes small enough to write in a second, with the real vocabularies, each family's features (Llama 3
# rope_freqs, Qwen3 QK-norm, Gemma 4 sliding/full layers, KV sharing, per-layer embeddings) and some
# fallback types (Gemma's 32-wide `proj` is Q5_0).
REDUCED = {
    "llama": dataclasses.replace(
        SHAPES["llama-3.2-1b"], name="llama-reduced", hidden_size=256, layer_count=4, head_count=4,
        head_count_kv=2, head_dim=64, ffn=512),
    "qwen3": dataclasses.replace(
        SHAPES["qwen3-0.6b"], name="qwen3-reduced", hidden_size=256, layer_count=4, head_count=4,
        head_count_kv=2, head_dim=64, ffn=512),
    # llama.cpp's KV-sharing rule needs the two layers before the first shared one to be (sliding, full).
    "gemma4": dataclasses.replace(
        SHAPES["gemma-4-e2b"], name="gemma4-reduced", hidden_size=256, layer_count=8, head_count=2,
        head_count_kv=1, head_dim=64, head_dim_full=128, ffn=512, per_layer_dim=32, shared_kv_layers=4,
        layer_types=(SLIDING, SLIDING, SLIDING, FULL) * 2, sliding_window=16),
    "qwen3moe": dataclasses.replace(
        SHAPES["qwen3-30b-a3b"], name="qwen3moe-reduced", hidden_size=256, layer_count=4, head_count=4,
        head_count_kv=2, head_dim=64, experts=16, experts_used=4, expert_ffn=256),
    # Gemma 4 26B-A4B's layout: experts beside the dense FFN, K = V on the full layers (no attn_v there).
    "gemma4moe": dataclasses.replace(
        SHAPES["gemma-4-26b-a4b"], name="gemma4moe-reduced", hidden_size=256, layer_count=6, head_count=2,
        head_count_kv=1, head_count_kv_full=1, head_dim=64, head_dim_full=128, ffn=512, sliding_window=16,
        layer_types=(SLIDING, SLIDING, FULL) * 2, experts=16, experts_used=4, expert_ffn=128),
}


def types_of(shape: synthetic.Shape) -> dict[str, Q]:
    return {plan.name: plan.qtype for plan in tensor_plan(shape)}


def test_llama_8b_has_the_q4_k_m_mix_of_a_real_file() -> None:
    # A real Llama-3.1-8B Q4_K_M file: untied, token_embd Q4_K, output Q6_K, attn_v and ffn_down Q6_K in
    # 16 of 32 layers each (use_more_bits), every other matrix Q4_K, norms and rope_freqs F32.
    types = types_of(SHAPES["llama-3.1-8b"])
    assert types["token_embd.weight"] == Q.Q4_K
    assert types["output.weight"] == Q.Q6_K
    assert types["rope_freqs.weight"] == types["blk.0.attn_norm.weight"] == Q.F32
    more_bits = [i for i in range(32) if i < 4 or i >= 28 or (i - 4) % 3 == 2]
    assert len(more_bits) == 16
    for i in range(32):
        expected = Q.Q6_K if i in more_bits else Q.Q4_K
        assert types[f"blk.{i}.attn_v.weight"] == types[f"blk.{i}.ffn_down.weight"] == expected
        assert types[f"blk.{i}.attn_q.weight"] == types[f"blk.{i}.ffn_up.weight"] == Q.Q4_K
    counts = {t: list(types.values()).count(t) for t in set(types.values())}
    assert counts == {Q.Q4_K: 193, Q.Q6_K: 33, Q.F32: 66}


def test_tied_gemma4_puts_both_embedding_tables_in_q6_k_and_counts_only_its_own_attn_v() -> None:
    shape = SHAPES["gemma-4-e2b"]
    types = types_of(shape)
    assert types["token_embd.weight"] == types["per_layer_token_embd.weight"] == Q.Q6_K
    assert types["per_layer_model_proj.weight"] == Q.BF16
    assert "output.weight" not in types
    # 15 layers own their KV; the more-bits rule runs over those 15 attn_v tensors.
    owners = [i for i in range(35) if f"blk.{i}.attn_v.weight" in types]
    assert owners == list(range(15))
    assert [i for i in owners if types[f"blk.{i}.attn_v.weight"] == Q.Q6_K] == [0, 3, 6, 9, 12, 13, 14]
    plans = {plan.name: plan for plan in tensor_plan(shape)}
    assert plans["blk.14.ffn_up.weight"].shape == (6144, 1536)
    assert plans["blk.15.ffn_up.weight"].shape == (12288, 1536)  # double-wide from the first shared layer
    assert plans["blk.4.attn_q.weight"].shape == (8 * 512, 1536)  # full layer, head dim 512
    assert plans["per_layer_token_embd.weight"].shape == (262144, 35 * 256)


def test_rows_that_do_not_split_into_256_blocks_fall_back_like_llama_quantize() -> None:
    types = types_of(REDUCED["gemma4"])
    assert types["blk.0.proj.weight"] == Q.Q5_0  # 32 columns: Q4_K -> Q5_0
    plain = {"tied": False, "attn_v": None, "layer": None}
    assert synthetic.q4_k_m_type("output.weight", (10, 96), **plain) == Q.Q8_0
    assert synthetic.q4_k_m_type("blk.0.attn_q.weight", (10, 40), **plain) == Q.F16


@pytest.mark.parametrize("qtype", [Q.Q4_K, Q.Q6_K, Q.Q5_0, Q.Q8_0])
def test_random_blocks_dequantize_to_the_intended_spread(qtype) -> None:
    columns = 2048
    plan = TensorPlan("blk.0.ffn_up.weight", (64, columns), qtype, "random")
    raw = np.concatenate(list(synthetic.tensor_chunks(plan, seed=3)))
    assert raw.nbytes == plan.nbytes
    values = gguf.dequantize(raw.reshape(64, -1), qtype)
    assert values.shape == (64, columns) and np.isfinite(values).all()
    target = 1 / math.sqrt(columns)
    assert values.std() == pytest.approx(target, rel=0.05)
    # Centred up to small biases: Q5_0's codes -16..15 average -1/2 (5% of the spread); Q4_K's
    # sub-block offsets d*7.5*(sc - m) make its grand mean vary by about 1.2% of the spread here.
    assert abs(values.mean()) < 0.06 * target


def test_bf16_values_round_to_nearest_even() -> None:
    # 1 + 2^-8 and 1 + 3*2^-8 lie halfway between bf16 neighbours (7 mantissa bits): ties go to even.
    data = np.array([1.0, 1 + 2**-8, 1 + 3 * 2**-8, -1.5, 1 + 2**-7 + 2**-9], dtype=np.float32)
    values = gguf.dequantize(synthetic._encode_float(data, Q.BF16), Q.BF16)
    assert values.tolist() == [1.0, 1.0, 1 + 2**-6, -1.5, 1 + 2**-7]


def test_the_file_matches_its_plan_and_is_written_once(tmp_path) -> None:
    shape = REDUCED["qwen3"]
    path = tmp_path / shape.file_name()
    record = write_synthetic(shape, path, seed=5)
    reader = gguf.GGUFReader(path)
    plans = tensor_plan(shape)
    assert [t.name for t in reader.tensors] == [p.name for p in plans]
    for tensor, plan in zip(reader.tensors, plans, strict=True):
        assert tensor.tensor_type == plan.qtype
        assert tuple(int(n) for n in tensor.shape) == tuple(reversed(plan.shape))
    tokens = reader.fields["tokenizer.ggml.tokens"]
    assert len(tokens.data) == shape.vocab_size == 151936
    assert reader.fields["tokenizer.ggml.eos_token_id"].contents() == 151645
    assert reader.fields["tokenizer.ggml.pre"].contents() == "qwen2"
    assert reader.fields["qwen3.attention.key_length"].contents() == 64
    assert record["size"] == path.stat().st_size
    assert synthetic.is_current(path, shape, 5, verify=True)
    assert not synthetic.is_current(path, shape, 6)
    again = write_synthetic(shape, tmp_path / "again.gguf", seed=5)
    assert again["sha256"] == record["sha256"]  # deterministic
    plan = next(p for p in plans if p.name == "blk.0.ffn_up.weight")
    chunks = [np.concatenate(list(synthetic.tensor_chunks(plan, seed))) for seed in (5, 5, 6)]
    assert np.array_equal(chunks[0], chunks[1]) and not np.array_equal(chunks[0], chunks[2])


def test_llama3_rope_factors_follow_the_converter() -> None:
    factors = np.array(synthetic.llama3_rope_factors(SHAPES["llama-3.1-8b"]))
    assert factors.shape == (64,)
    assert factors[0] == 1.0 and factors[-1] == 8.0  # high frequencies kept, low ones divided by 8
    assert np.all(np.diff(factors) >= 0)


def test_qwen3_30b_a3b_experts_follow_the_layer_rules_of_llama_quantize() -> None:
    # llama-quant.cpp reads an expert tensor's layer from its name: ffn_down_exps is Q6_K in the
    # use_more_bits layers (24 of 48), gate/up experts Q4_K, the routers are never quantized.
    shape = SHAPES["qwen3-30b-a3b"]
    types = types_of(shape)
    more_bits = [i for i in range(48) if i < 6 or i >= 42 or (i - 6) % 3 == 2]
    assert len(more_bits) == 24
    for i in range(48):
        assert types[f"blk.{i}.ffn_down_exps.weight"] == (Q.Q6_K if i in more_bits else Q.Q4_K)
        assert types[f"blk.{i}.ffn_gate_exps.weight"] == types[f"blk.{i}.ffn_up_exps.weight"] == Q.Q4_K
        assert types[f"blk.{i}.ffn_gate_inp.weight"] == Q.F32
        assert f"blk.{i}.ffn_gate.weight" not in types
    plans = {plan.name: plan for plan in tensor_plan(shape)}
    assert plans["blk.0.ffn_down_exps.weight"].shape == (128, 2048, 768)
    assert plans["output.weight"].qtype == Q.Q6_K and plans["token_embd.weight"].qtype == Q.Q4_K
    assert 18.5e9 < sum(plan.nbytes for plan in plans.values()) < 18.6e9  # the released file: 18.6 GB


def test_gemma4_26b_a4b_has_experts_beside_the_dense_ffn_and_no_v_on_full_layers() -> None:
    # attention_k_eq_v: the 5 full layers have no attn_v (and 2 KV heads of 512); the 704- and 2112-wide
    # down projections do not split into 256-blocks, so Q4_K/Q6_K fall back to Q5_0/Q8_0 by layer.
    shape = SHAPES["gemma-4-26b-a4b"]
    plans = {plan.name: plan for plan in tensor_plan(shape)}
    full = [i for i in range(30) if shape.is_full(i)]
    assert full == [5, 11, 17, 23, 29]
    more_bits = [i for i in range(30) if i < 3 or i >= 26 or (i - 3) % 3 == 2]
    for i in range(30):
        assert (f"blk.{i}.attn_v.weight" in plans) == (i not in full)
        kv, hd = (2, 512) if i in full else (8, 256)
        assert plans[f"blk.{i}.attn_k.weight"].shape == (kv * hd, 2816)
        down = Q.Q8_0 if i in more_bits else Q.Q5_0
        assert plans[f"blk.{i}.ffn_down_exps.weight"].qtype == plans[f"blk.{i}.ffn_down.weight"].qtype == down
        assert plans[f"blk.{i}.ffn_gate_up_exps.weight"].shape == (128, 2 * 704, 2816)
        assert plans[f"blk.{i}.ffn_gate_up_exps.weight"].qtype == Q.Q4_K
        assert plans[f"blk.{i}.ffn_down_exps.scale"].qtype == Q.F32
        assert plans[f"blk.{i}.ffn_gate_inp.weight"].qtype == Q.F32


# ----------------------------------------------------------------------------------------------------
# Both engines load the files and agree on them.


class CaptureLogits(Experiment):
    name = "capture-logits"

    def __init__(self) -> None:
        self.rows: list[np.ndarray] = []

    def after_logits(self, ctx, logits) -> None:
        self.rows.append(logits.values()[-1].copy())


@pytest.mark.slow
@pytest.mark.parametrize("family", sorted(REDUCED))
def test_llama_cpp_and_ember_load_the_file_and_agree(tmp_path, family) -> None:
    llama_cpp = pytest.importorskip("llama_cpp")

    shape = REDUCED[family]
    path = tmp_path / shape.file_name()
    write_synthetic(shape, path)
    text = "The old lighthouse keeper climbed the spiral stairs every evening at dusk."

    model = ember.load_model(path, context_length=128, threads=1)
    capture = CaptureLogits()
    prompt = model.tokenize(text, add_bos=None)
    generation = model.generate(prompt, max_new_tokens=4, temperature=0.0, add_bos=False, stop_at_eog=False,
                                experiments=[capture])
    ours = np.stack(capture.rows)

    llm = llama_cpp.Llama(model_path=str(path), n_ctx=128, n_batch=128, n_threads=1, logits_all=True,
                          verbose=False)
    try:
        assert llm.tokenize(text.encode(), add_bos=True) == prompt  # the real vocabulary, both engines
        sequence = prompt + list(generation.token_ids[:-1])
        llm.eval(sequence)
        theirs = np.array(llm.scores[len(prompt) - 1:len(sequence)], dtype=np.float32)
    finally:
        llm.close()

    assert ours.shape == theirs.shape == (4, shape.vocab_size)
    assert np.isfinite(ours).all() and np.isfinite(theirs).all()
    # llama.cpp quantizes activations (Q8_K) and keeps an F16 KV cache, so the logits agree closely
    # but not exactly (measured: cosine 0.9994-0.9995 for the dense three); random weights make the logits
    # nearly flat, so argmax is not compared.
    cosine = np.sum(ours * theirs, axis=1) / np.linalg.norm(ours, axis=1) / np.linalg.norm(theirs, axis=1)
    print(f"\n{family}: cosine {cosine.min():.5f}, logit std {theirs.std():.3f}")
    assert cosine.min() > 0.998
