"""Synthetic GGUF files of real model shapes: random quantized blocks in llama.cpp's Q4_K_M type mix.

    python -m benchmarks.synthetic --shape llama-3.2-1b              # into <ember cache>/synthetic/
    python -m benchmarks.synthetic --shape all --out /some/dir
    python -m benchmarks.synthetic --list
    python -m benchmarks.synthetic --check               # llama.cpp loads each file and generates

The files measure speed and memory at sizes no PyPI wheel ships: every tensor has the real name, shape
and type a `llama-quantize ... Q4_K_M` file of that model has, and the vocabulary is a real one, but the
weights are random. They are written straight as quantized blocks (random bytes with every block's f16
scale fields overwritten by one small finite value), streamed to disk a chunk at a time, so an 8B file
takes seconds and little memory and no float32 copy of a matrix ever exists.

Scales: each matrix gets the block scale that gives its dequantized values a standard deviation of
1/sqrt(columns) (columns = the input width, GGUF `ne0`), so every product keeps activations near unit
size and both engines produce finite logits. Norm weights are 1; Gemma 4's Q/K norm weights are
head_dim^-1/4 because its attention applies no 1/sqrt(head_dim) scale.

Generation is deterministic (a seeded stream per tensor). A sidecar `<file>.json` records the generator
version, the shape, the seed, the size and the sha256; a file whose sidecar matches is not written
again (`--verify` re-hashes it).

Facts and where they come from:

* Shapes: the models' Hugging Face config.json files (meta-llama/Llama-3.2-1B, meta-llama/Llama-3.1-8B,
  Qwen/Qwen3-0.6B, Qwen/Qwen3-4B, Qwen/Qwen3-30B-A3B, google/gemma-4-E2B text_config), read as copies in
  public repositories. The Qwen3-30B-A3B plan comes to 18.55 GB of tensors, the size of the released
  Q4_K_M file (18.6 GB).
* Metadata keys and generated tensors (`rope_freqs.weight` for Llama 3 rope scaling and for Gemma 4's
  proportional rope): llama.cpp's converter (`conversion/llama.py`, `qwen.py`, `gemma.py`), as written
  up in docs/families.md (§1.3, §3.4) and mirrored by tests/reference/gguf_writer.py and gemma4_gguf.py.
* Types: llama.cpp `src/llama-quant.cpp` (the copy vendored in llama-cpp-python 0.3.36), for
  LLAMA_FTYPE_MOSTLY_Q4_K_M: default Q4_K; `output.weight`, and the token embeddings (both
  `token_embd` and `per_layer_token_embd`) when the head is tied, Q6_K (Q8_0 if a row does not split
  into 256-blocks); `attn_v` Q6_K where use_more_bits(i, n) holds over the attn_v tensors in file order,
  `ffn_down` where it holds over the layer index; use_more_bits(i, n) = i < n/8 or i >= 7n/8 or
  (i - n/8) % 3 == 2; a row that does not split into 256-blocks falls back Q4_K -> Q5_0, Q6_K -> Q8_0;
  1-D tensors, `*_norm.weight` and the routers `ffn_gate_inp` stay F32, `ffn_down_exps` follows the
  ffn_down rule by its layer (every expert alike), and `per_layer_model_proj` is not quantized (it stays
  in the converted file's type, BF16 for Gemma 4's bf16 checkpoint). Tensors are written in the order
  llama-quantize writes them: by layer (non-layer tensors first), then by name.
* Vocabulary: llama.cpp's vocab-only GGUFs in tests/data/vocab/ (tokens, scores, types, merges,
  pre-tokenizer, special ids, chat template): `llama-bpe` for Llama 3, `qwen2` (151936 rows, Qwen3's
  pre-tokenizer) for Qwen3 with Qwen3's end-of-turn id 151645, `gemma-4` for Gemma 4.

The families added later (one real shape each; docs/families.md §7-§14 for their tensors and keys):

* Shapes: Qwen/Qwen2.5-7B, microsoft/Phi-4-mini-instruct (its LongRoPE factors copied), google/gemma-2-9b-it,
  allenai/OLMo-2-1124-7B, HuggingFaceTB/SmolLM3-3B, openai/gpt-oss-20b, ibm-granite/granite-3.3-2b-instruct,
  mistralai/Ministral-3-3B-Instruct-2512 (text_config), config.json files read as copies in public
  repositories (OLMo-2-1124-7B's from memory of the model card's config, its family's vocabulary size, rope
  base and epsilon checked against OLMo-2-0425-1B's verbatim copy). The plans of Qwen2.5-7B, Phi-4-mini,
  Gemma-2-9B, SmolLM3-3B, Granite-3.3-2B and Ministral-3-3B come within 2-9 MB (their vocabulary's metadata)
  below the sizes of the released Q4_K_M files (tests/test_synthetic.py).
* Keys and tensors as the converter writes them (mirrored from tests/reference/gguf_writer.py and the
  families' tiny tests): qwen2 `attn_{q,k,v}.bias`; phi3 fused `attn_qkv` and `ffn_up` (gate rows first),
  `rope.dimension_count` = int(0.75 * 3072) // 24 = 96, `rope_factors_long/short.weight`,
  `rope.scaling.original_context_length` and `attn_factor` (sqrt(1 + ln s / ln L0)),
  `attention.sliding_window` (262144: llama.cpp switches it off), no key_length; gemma2 the two softcaps, the
  window, key_length, post-norms (norm weights of 1 in the file, which holds w + 1), no rope base key; olmo2
  no pre-norms, q/k norms over all heads, post-norms, an untied head; smollm3 a plain llama layout: which
  layers skip rope is in no key (llama.cpp: every 4th, `n_no_rope_layer_step = 4`); granite the four
  multipliers (embedding, residual, attention, logit); mistral3 the YaRN keys (factor, original context,
  betas, `yarn_log_multiplier`) and `attention.temperature_scale`; gpt-oss biases on every projection,
  `attn_sinks`, a biased router, biased experts, YaRN (factor 32 over 4096), a 128 window. Biases and sinks
  are random vectors (spread 1/sqrt(length)), F32.
* gpt-oss's experts are MXFP4 in the released checkpoint and the converter writes them so. llama.cpp's
  llama-quant.cpp (the vendored copy has `llama_quant_compute_types`, the categorized rules) would choose
  Q4_K/Q6_K for them but refuses to requantize an MXFP4 tensor ("requantizing from type mxfp4 is disabled")
  unless told `--allow-requantize`, and the published GGUF files keep the experts in MXFP4 (ggml-org's MXFP4
  file is 12.11 GB; this plan, with Q4_K_M elsewhere, 11.61 GB); so the experts stay MXFP4 here, every other
  tensor follows the Q4_K_M rules (2880-wide rows fall back to Q5_0 / Q8_0). MXFP4 blocks: random codes, one
  exponent byte per block chosen so the spread is 1/sqrt(columns) within a factor of sqrt(2).
* `attn_qkv` takes attn_v's more-bits rule (llama-quant.cpp's `category_is_attn_v`; older llama.cpp gave it
  Q5_K).
* Vocabularies: tests/data/vocab/ has only some of the real ones. Qwen2.5 uses `qwen2` (its own, padded to
  152064 rows) and SmolLM3 `llama-bpe` (Llama 3's, of which SmolLM3's renames a few reserved tokens; eos
  128012); the others use the closest available, which the benchmark only needs to load and run: Phi-4-mini
  and gpt-oss `qwen2` (for o200k), Gemma 2 `llama-spm` (for Gemma's 256000-token SentencePiece), OLMo 2
  `gpt-2` (for its cl100k-derived BPE), Granite `llama-spm` (its own BPE has 49159 rows; `refact`, the
  nearest, has 49216 tokens, more than the model's rows), Ministral 3 `llama-bpe` (for Tekken).
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import json
import math
import os
import sys
import time
import zlib
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import gguf
import numpy as np
from gguf import GGMLQuantizationType as Q
from gguf import GGUFValueType as V

# Bump when the bytes a shape and seed produce change.
GENERATOR_VERSION = "1"
DEFAULT_SEED = 0
REPO_ROOT = Path(__file__).resolve().parents[1]
VOCAB_DIR = REPO_ROOT / "tests" / "data" / "vocab"
_CHUNK_BYTES = 64 << 20
_QK_K = 256

SLIDING, FULL = "sliding", "full"
RANDOM = "random"  # a vector (bias, sink) of random values instead of a constant


@dataclass(frozen=True)
class Shape:
    """One model's architecture facts, as its config.json gives them (HF names in comments)."""

    name: str
    title: str
    architecture: str  # GGUF general.architecture: llama, qwen3, qwen3moe, gemma4, qwen2, phi3, ...
    hidden_size: int
    layer_count: int  # num_hidden_layers
    head_count: int  # num_attention_heads
    head_count_kv: int  # num_key_value_heads
    head_dim: int  # head_dim (Gemma 4: sliding layers)
    ffn: int  # intermediate_size
    vocab: str  # vocab-only GGUF in tests/data/vocab/ (ggml-vocab-<vocab>.gguf)
    vocab_size: int
    tied: bool  # tie_word_embeddings
    context_length: int  # max_position_embeddings
    rope_base: float  # rope_theta (Gemma 4: full layers)
    rms_eps: float
    config_has_head_dim: bool = True  # the converter writes attention.key_length only then
    llama3_rope: tuple[float, float, float, int] | None = None  # factor, low_freq, high_freq, original ctx
    special_ids: tuple[tuple[str, int], ...] = ()  # overrides of the vocab file's special ids
    source: str = ""
    # Gemma 4
    head_dim_full: int = 0  # global_head_dim
    layer_types: tuple[str, ...] = ()
    sliding_window: int = 0
    per_layer_dim: int = 0  # hidden_size_per_layer_input
    shared_kv_layers: int = 0  # num_kv_shared_layers
    double_wide_mlp: bool = False  # use_double_wide_mlp: KV-shared layers have 2x the FFN width
    rope_base_swa: float = 10_000.0
    partial_rotary: float = 1.0  # full layers' partial_rotary_factor ("proportional" rope)
    softcap: float = 0.0  # final_logit_softcapping
    head_count_kv_full: int = 0  # num_global_key_value_heads (0: head_count_kv on every layer)
    k_eq_v: bool = False  # attention_k_eq_v: full layers have no attn_v (V is the raw K projection)
    # Mixtures of experts (qwen3moe): every layer's FFN is `experts` experts of width `expert_ffn`
    experts: int = 0  # num_experts
    experts_used: int = 0  # num_experts_per_tok
    expert_ffn: int = 0  # moe_intermediate_size
    # Fields added after generator version 1 (see _LATER_FIELDS: left out of the digest at their defaults,
    # so the files of the shapes above keep their digests).
    attn_softcap: float = 0.0  # Gemma 2: attn_logit_softcapping
    original_context: int = 0  # rope.scaling.original_context_length (Phi-3 LongRoPE, YaRN)
    long_factors: tuple[float, ...] = ()  # Phi-3 LongRoPE: rope_scaling.long_factor
    short_factors: tuple[float, ...] = ()  # rope_scaling.short_factor
    rope_scaling_factor: float = 0.0  # YaRN: rope_scaling.factor
    yarn_betas: tuple[float, float] | None = None  # YaRN: beta_fast, beta_slow (written only if given)
    yarn_log_multiplier: float = 0.0  # Ministral 3: mscale_all_dim
    temperature_scale: float = 0.0  # Ministral 3: llama_4_scaling_beta
    # Granite: embedding_multiplier, residual_multiplier, attention_multiplier, logits_scaling
    embedding_scale: float = 0.0
    residual_scale: float = 0.0
    attention_scale: float = 0.0
    logit_scale: float = 0.0
    expert_qtype: str = ""  # a type name the experts keep (gpt-oss: "MXFP4"); "" = the Q4_K_M rules

    @property
    def rope_dim(self) -> int:
        """Phi-3's rope.dimension_count: int(partial_rotary_factor * hidden) // heads."""
        return int(self.partial_rotary * self.hidden_size) // self.head_count

    @property
    def first_shared_layer(self) -> int:
        return self.layer_count - self.shared_kv_layers

    def is_full(self, layer: int) -> bool:
        return bool(self.layer_types) and self.layer_types[layer] == FULL

    def layer_head_dim(self, layer: int) -> int:
        return self.head_dim_full if self.is_full(layer) else self.head_dim

    def layer_kv_heads(self, layer: int) -> int:
        full = self.head_count_kv_full and self.is_full(layer)
        return self.head_count_kv_full if full else self.head_count_kv

    def owns_kv(self, layer: int) -> bool:
        return layer < self.first_shared_layer

    def layer_ffn(self, layer: int) -> int:
        return self.ffn * (2 if self.double_wide_mlp and not self.owns_kv(layer) else 1)

    def file_name(self, seed: int = DEFAULT_SEED) -> str:
        return f"{self.name}-synthetic-Q4_K_M-seed{seed}.gguf"


def _gemma4_e2b_layers() -> tuple[str, ...]:
    return tuple(FULL if i % 5 == 4 else SLIDING for i in range(35))  # full at 4, 9, ..., 34


def _gemma4_26b_layers() -> tuple[str, ...]:
    return tuple(FULL if i % 6 == 5 else SLIDING for i in range(30))  # (s x 5, F) x 5


# microsoft/Phi-4-mini-instruct config.json rope_scaling (LongRoPE, 48 = 96 rotated dims / 2 each).
_PHI4_MINI_LONG = (
    1.0, 1.118320672, 1.250641126, 1.398617824, 1.564103225, 1.74916897, 1.956131817, 2.187582649,
    2.446418898, 2.735880826, 3.059592084, 3.421605075, 3.826451687, 4.279200023, 4.785517845, 5.351743533,
    5.984965424, 6.693110555, 7.485043894, 8.370679318, 9.36110372, 10.4687158, 11.70738129, 13.09260651,
    14.64173252, 16.37415215, 18.31155283, 20.47818807, 22.90118105, 25.61086418, 28.64115884, 32.03,
    32.1, 32.13, 32.23, 32.6, 32.61, 32.64, 32.66, 32.7, 32.71, 32.93, 32.97, 33.28, 33.49, 33.5, 44.16,
    47.77)
_PHI4_MINI_SHORT = (1.0,) * 48


SHAPES: dict[str, Shape] = {
    "llama-3.2-1b": Shape(
        "llama-3.2-1b", "Llama-3.2-1B", "llama", hidden_size=2048, layer_count=16, head_count=32,
        head_count_kv=8, head_dim=64, ffn=8192, vocab="llama-bpe", vocab_size=128256, tied=True,
        context_length=131072, rope_base=500000.0, rms_eps=1e-5, llama3_rope=(32.0, 1.0, 4.0, 8192),
        source="meta-llama/Llama-3.2-1B config.json"),
    "llama-3.1-8b": Shape(
        "llama-3.1-8b", "Llama-3.1-8B", "llama", hidden_size=4096, layer_count=32, head_count=32,
        head_count_kv=8, head_dim=128, ffn=14336, vocab="llama-bpe", vocab_size=128256, tied=False,
        context_length=131072, rope_base=500000.0, rms_eps=1e-5, config_has_head_dim=False,
        llama3_rope=(8.0, 1.0, 4.0, 8192), source="meta-llama/Llama-3.1-8B config.json"),
    "qwen3-0.6b": Shape(
        "qwen3-0.6b", "Qwen3-0.6B", "qwen3", hidden_size=1024, layer_count=28, head_count=16,
        head_count_kv=8, head_dim=128, ffn=3072, vocab="qwen2", vocab_size=151936, tied=True,
        context_length=40960, rope_base=1_000_000.0, rms_eps=1e-6,
        special_ids=(("eos", 151645), ("bos", 151643), ("pad", 151643)),
        source="Qwen/Qwen3-0.6B config.json"),
    "qwen3-4b": Shape(
        "qwen3-4b", "Qwen3-4B", "qwen3", hidden_size=2560, layer_count=36, head_count=32,
        head_count_kv=8, head_dim=128, ffn=9728, vocab="qwen2", vocab_size=151936, tied=True,
        context_length=40960, rope_base=1_000_000.0, rms_eps=1e-6,
        special_ids=(("eos", 151645), ("bos", 151643), ("pad", 151643)),
        source="Qwen/Qwen3-4B config.json"),
    "gemma-4-e2b": Shape(
        "gemma-4-e2b", "Gemma-4-E2B", "gemma4", hidden_size=1536, layer_count=35, head_count=8,
        head_count_kv=1, head_dim=256, ffn=6144, vocab="gemma-4", vocab_size=262144, tied=True,
        context_length=131072, rope_base=1_000_000.0, rms_eps=1e-6, head_dim_full=512,
        layer_types=_gemma4_e2b_layers(), sliding_window=512, per_layer_dim=256, shared_kv_layers=20,
        double_wide_mlp=True, rope_base_swa=10_000.0, partial_rotary=0.25, softcap=30.0,
        source="google/gemma-4-E2B config.json text_config"),
    "gemma-4-26b-a4b": Shape(
        "gemma-4-26b-a4b", "Gemma-4-26B-A4B", "gemma4", hidden_size=2816, layer_count=30, head_count=16,
        head_count_kv=8, head_dim=256, ffn=2112, vocab="gemma-4", vocab_size=262144, tied=True,
        context_length=262144, rope_base=1_000_000.0, rms_eps=1e-6, head_dim_full=512,
        layer_types=_gemma4_26b_layers(), sliding_window=1024, rope_base_swa=10_000.0, partial_rotary=0.25,
        softcap=30.0, head_count_kv_full=2, k_eq_v=True, experts=128, experts_used=8, expert_ffn=704,
        source="google/gemma-4-26B-A4B config.json text_config; metadata as in llama.cpp's "
               "ggml-vocab-gemma-4.gguf (the 26B-A4B's own)"),
    "qwen3-30b-a3b": Shape(
        "qwen3-30b-a3b", "Qwen3-30B-A3B", "qwen3moe", hidden_size=2048, layer_count=48, head_count=32,
        head_count_kv=4, head_dim=128, ffn=6144, vocab="qwen2", vocab_size=151936, tied=False,
        context_length=40960, rope_base=1_000_000.0, rms_eps=1e-6, experts=128, experts_used=8,
        expert_ffn=768, special_ids=(("eos", 151645), ("bos", 151643), ("pad", 151643)),
        source="Qwen/Qwen3-30B-A3B config.json"),
    # The families added after the first ladder: one real shape each.
    "qwen2.5-7b": Shape(
        "qwen2.5-7b", "Qwen2.5-7B", "qwen2", hidden_size=3584, layer_count=28, head_count=28,
        head_count_kv=4, head_dim=128, ffn=18944, vocab="qwen2", vocab_size=152064, tied=False,
        context_length=131072, rope_base=1_000_000.0, rms_eps=1e-6, config_has_head_dim=False,
        source="Qwen/Qwen2.5-7B config.json (no head_dim: 3584 / 28)"),
    "phi-4-mini": Shape(
        "phi-4-mini", "Phi-4-mini", "phi3", hidden_size=3072, layer_count=32, head_count=24,
        head_count_kv=8, head_dim=128, ffn=8192, vocab="qwen2", vocab_size=200064, tied=True,
        context_length=131072, rope_base=10_000.0, rms_eps=1e-5, config_has_head_dim=False,
        partial_rotary=0.75, sliding_window=262144, original_context=4096, long_factors=_PHI4_MINI_LONG,
        short_factors=_PHI4_MINI_SHORT,
        source="microsoft/Phi-4-mini-instruct config.json; vocabulary: qwen2's in place of Phi-4-mini's "
               "gpt-4o (o200k) one, which tests/data/vocab/ has not"),
    "gemma-2-9b": Shape(
        "gemma-2-9b", "Gemma-2-9B", "gemma2", hidden_size=3584, layer_count=42, head_count=16,
        head_count_kv=8, head_dim=256, ffn=14336, vocab="llama-spm", vocab_size=256000, tied=True,
        context_length=8192, rope_base=10_000.0, rms_eps=1e-6, sliding_window=4096, softcap=30.0,
        attn_softcap=50.0,
        source="google/gemma-2-9b-it config.json; vocabulary: llama-spm's SentencePiece in place of "
               "Gemma's 256000-token one, which tests/data/vocab/ has not"),
    "olmo-2-7b": Shape(
        "olmo-2-7b", "OLMo-2-7B", "olmo2", hidden_size=4096, layer_count=32, head_count=32,
        head_count_kv=32, head_dim=128, ffn=11008, vocab="gpt-2", vocab_size=100352, tied=False,
        context_length=4096, rope_base=500_000.0, rms_eps=1e-6, config_has_head_dim=False,
        source="allenai/OLMo-2-1124-7B config.json; vocabulary: gpt-2's in place of OLMo 2's "
               "cl100k-derived one, which tests/data/vocab/ has not"),
    "smollm3-3b": Shape(
        "smollm3-3b", "SmolLM3-3B", "smollm3", hidden_size=2048, layer_count=36, head_count=16,
        head_count_kv=4, head_dim=128, ffn=11008, vocab="llama-bpe", vocab_size=128256, tied=True,
        context_length=65536, rope_base=5_000_000.0, rms_eps=1e-6, config_has_head_dim=False,
        special_ids=(("eos", 128012), ("pad", 128004)),
        source="HuggingFaceTB/SmolLM3-3B config.json (no_rope_layer_interval 4); vocabulary: llama-bpe "
               "(Llama 3's, which SmolLM3's extends by renaming reserved tokens)"),
    "gpt-oss-20b": Shape(
        "gpt-oss-20b", "gpt-oss-20b", "gpt-oss", hidden_size=2880, layer_count=24, head_count=64,
        head_count_kv=8, head_dim=64, ffn=2880, vocab="qwen2", vocab_size=201088, tied=False,
        context_length=131072, rope_base=150_000.0, rms_eps=1e-5, sliding_window=128, experts=32,
        experts_used=4, expert_ffn=2880, original_context=4096, rope_scaling_factor=32.0,
        expert_qtype="MXFP4",
        source="openai/gpt-oss-20b config.json; vocabulary: qwen2's in place of gpt-oss's o200k_harmony "
               "one, which tests/data/vocab/ has not"),
    "granite-3.3-2b": Shape(
        "granite-3.3-2b", "Granite-3.3-2B", "granite", hidden_size=2048, layer_count=40, head_count=32,
        head_count_kv=8, head_dim=64, ffn=8192, vocab="llama-spm", vocab_size=49159, tied=True,
        context_length=131072, rope_base=10_000_000.0, rms_eps=1e-5, config_has_head_dim=False,
        embedding_scale=12.0, residual_scale=0.22, attention_scale=0.015625, logit_scale=8.0,
        source="ibm-granite/granite-3.3-2b-instruct config.json; vocabulary: llama-spm's in place of "
               "Granite's 49159-token BPE (tests/data/vocab/'s refact, its closest, has 49216 tokens: more "
               "than the model's rows)"),
    "ministral-3-3b": Shape(
        "ministral-3-3b", "Ministral-3-3B", "mistral3", hidden_size=3072, layer_count=26, head_count=32,
        head_count_kv=8, head_dim=128, ffn=9216, vocab="llama-bpe", vocab_size=131072, tied=True,
        context_length=262144, rope_base=1_000_000.0, rms_eps=1e-5, original_context=16384,
        rope_scaling_factor=16.0, yarn_betas=(32.0, 1.0), yarn_log_multiplier=1.0, temperature_scale=0.1,
        source="mistralai/Ministral-3-3B-Instruct-2512 config.json text_config; vocabulary: llama-bpe in "
               "place of Tekken (131072 tokens), which tests/data/vocab/ has not"),
}


# ----------------------------------------------------------------------------------------------------
# Tensor plan: names, shapes, types, initial values.


@dataclass(frozen=True)
class TensorPlan:
    name: str
    shape: tuple[int, ...]  # NumPy order: (rows, columns); GGUF ne is the reverse
    qtype: Q
    fill: str  # "random" (matrices), "const" (vectors of `value`), "values" (given)
    value: float = 1.0
    values: tuple[float, ...] = field(default=(), repr=False)

    @property
    def columns(self) -> int:
        return self.shape[-1]

    @property
    def elements(self) -> int:
        return math.prod(self.shape)

    @property
    def nbytes(self) -> int:
        block, size = gguf.GGML_QUANT_SIZES[self.qtype]
        return self.elements // block * size


def use_more_bits(i: int, n: int) -> bool:
    """llama-quant.cpp's rule for the layers that get more bits in the *_M mixes."""
    return i < n // 8 or i >= 7 * n // 8 or (i - n // 8) % 3 == 2


def _fallback(qtype: Q, columns: int) -> Q:
    """llama-quant.cpp's fallback for rows that do not split into the type's blocks."""
    if columns % gguf.GGML_QUANT_SIZES[qtype][0] == 0:
        return qtype
    smaller = {Q.Q4_K: Q.Q5_0, Q.Q6_K: Q.Q8_0}[qtype]
    return smaller if columns % gguf.GGML_QUANT_SIZES[smaller][0] == 0 else Q.F16


def q4_k_m_type(name: str, shape: tuple[int, ...], *, tied: bool, attn_v: tuple[int, int] | None,
                layer: tuple[int, int] | None) -> Q:
    """The type llama-quantize gives `name` in a Q4_K_M file (see the module docstring).

    `attn_v` is (index among the attn_v tensors, their count) for an attn_v tensor; `layer` is
    (layer index, layer count) for an ffn_down tensor (with experts, `ffn_down_exps`: llama-quant.cpp
    reads the layer from its name, so every expert of a layer gets the layer's type). `attn_qkv` counts
    as an attn_v tensor (llama-quant.cpp's category_is_attn_v)."""
    if len(shape) < 2 or name.endswith("_norm.weight") or name.endswith("ffn_gate_inp.weight"):
        return Q.F32  # vectors, norms and routers stay as converted (F32 here)
    if not name.endswith("weight"):
        return Q.F32  # biases (2-D for experts) are never quantized
    if "per_layer_model_proj" in name:
        return Q.BF16
    columns = shape[-1]
    if name == "output.weight" or (tied and name in ("token_embd.weight", "per_layer_token_embd.weight")):
        return Q.Q6_K if columns % _QK_K == 0 else Q.Q8_0
    qtype = Q.Q4_K
    if attn_v is not None and use_more_bits(*attn_v):
        qtype = Q.Q6_K
    if layer is not None and use_more_bits(*layer):
        qtype = Q.Q6_K
    return _fallback(qtype, columns)


def llama3_rope_factors(shape: Shape) -> tuple[float, ...]:
    """The converter's `rope_freqs.weight` for HF rope_type "llama3" (docs/families.md §1.3)."""
    assert shape.llama3_rope is not None
    factor, low, high, old_context = shape.llama3_rope
    factors = []
    for i in range(0, shape.head_dim, 2):
        wavelength = 2 * math.pi * shape.rope_base ** (i / shape.head_dim)
        if wavelength < old_context / high:
            factors.append(1.0)
        elif wavelength > old_context / low:
            factors.append(factor)
        else:
            smooth = (old_context / wavelength - low) / (high - low)
            factors.append(1.0 / ((1.0 - smooth) / factor + smooth))
    return tuple(factors)


def _layer_tensors(shape: Shape, i: int) -> Iterator[tuple[str, tuple[int, ...], float | str]]:
    """(name, NumPy shape, norm value or RANDOM) of layer i; the value only matters for vectors."""
    H, nh = shape.hidden_size, shape.head_count
    hd = shape.layer_head_dim(i)
    b = f"blk.{i}."
    qk_norm = hd ** -0.25 if shape.architecture == "gemma4" else 1.0
    arch = shape.architecture
    if arch in ("phi3", "olmo2", "gpt-oss"):
        yield from _layer_tensors_v2(shape, i)
        return
    yield b + "attn_norm.weight", (H,), 1.0
    yield b + "attn_q.weight", (nh * hd, H), 0.0
    own = shape.owns_kv(i)
    if own:
        kv = shape.layer_kv_heads(i)
        yield b + "attn_k.weight", (kv * hd, H), 0.0
        if not (shape.k_eq_v and shape.is_full(i)):
            yield b + "attn_v.weight", (kv * hd, H), 0.0
    if arch == "qwen2":  # Q/K/V biases (no other biases)
        kv = shape.layer_kv_heads(i)
        yield b + "attn_q.bias", (nh * hd,), RANDOM
        yield b + "attn_k.bias", (kv * hd,), RANDOM
        yield b + "attn_v.bias", (kv * hd,), RANDOM
    if arch in ("qwen3", "qwen3moe", "gemma4"):
        yield b + "attn_q_norm.weight", (hd,), qk_norm
        if own:
            yield b + "attn_k_norm.weight", (hd,), qk_norm
    yield b + "attn_output.weight", (H, nh * hd), 0.0
    yield b + "ffn_norm.weight", (H,), 1.0
    if arch == "gemma2":
        yield b + "post_attention_norm.weight", (H,), 1.0
        yield b + "post_ffw_norm.weight", (H,), 1.0
    E, Fe = shape.experts, shape.expert_ffn
    if shape.experts and shape.architecture == "gemma4":  # the dense FFN (below) beside the experts
        yield b + "ffn_gate_inp.weight", (E, H), 0.0
        yield b + "ffn_gate_inp.scale", (H,), 1.0
        yield b + "ffn_gate_up_exps.weight", (E, 2 * Fe, H), 0.0
        yield b + "ffn_down_exps.weight", (E, H, Fe), 0.0
        yield b + "ffn_down_exps.scale", (E,), 1.0
        yield b + "pre_ffw_norm_2.weight", (H,), 1.0
        yield b + "post_ffw_norm_1.weight", (H,), 1.0
        yield b + "post_ffw_norm_2.weight", (H,), 1.0
    if shape.experts and shape.architecture != "gemma4":  # 3-D experts, NumPy (experts, rows, columns)
        yield b + "ffn_gate_inp.weight", (E, H), 0.0
        yield b + "ffn_gate_exps.weight", (E, Fe, H), 0.0
        yield b + "ffn_up_exps.weight", (E, Fe, H), 0.0
        yield b + "ffn_down_exps.weight", (E, H, Fe), 0.0
    else:
        F = shape.layer_ffn(i)
        yield b + "ffn_gate.weight", (F, H), 0.0
        yield b + "ffn_up.weight", (F, H), 0.0
        yield b + "ffn_down.weight", (H, F), 0.0
    if shape.architecture == "gemma4":
        yield b + "post_attention_norm.weight", (H,), 1.0
        yield b + "post_ffw_norm.weight", (H,), 1.0
        yield b + "layer_output_scale.weight", (1,), 1.0
        if shape.per_layer_dim:
            yield b + "inp_gate.weight", (shape.per_layer_dim, H), 0.0
            yield b + "proj.weight", (H, shape.per_layer_dim), 0.0
            yield b + "post_norm.weight", (H,), 1.0


def _layer_tensors_v2(shape: Shape, i: int) -> Iterator[tuple[str, tuple[int, ...], float | str]]:
    """Layer i of the families whose layers are not Llama's (phi3, olmo2, gpt-oss): docs/families.md
    §8, §12, §14."""
    H, nh, hd, kv, F = shape.hidden_size, shape.head_count, shape.head_dim, shape.head_count_kv, shape.ffn
    b = f"blk.{i}."
    arch = shape.architecture
    if arch == "phi3":  # fused QKV rows (q, k, v) and fused gate+up rows (gate first)
        yield b + "attn_norm.weight", (H,), 1.0
        yield b + "attn_qkv.weight", ((nh + 2 * kv) * hd, H), 0.0
        yield b + "attn_output.weight", (H, nh * hd), 0.0
        yield b + "ffn_norm.weight", (H,), 1.0
        yield b + "ffn_up.weight", (2 * F, H), 0.0
        yield b + "ffn_down.weight", (H, F), 0.0
    elif arch == "olmo2":  # no pre-norms: q/k norms over all heads at once, post-norms on both branches
        yield b + "attn_q.weight", (nh * hd, H), 0.0
        yield b + "attn_k.weight", (kv * hd, H), 0.0
        yield b + "attn_v.weight", (kv * hd, H), 0.0
        yield b + "attn_q_norm.weight", (nh * hd,), 1.0
        yield b + "attn_k_norm.weight", (kv * hd,), 1.0
        yield b + "attn_output.weight", (H, nh * hd), 0.0
        yield b + "post_attention_norm.weight", (H,), 1.0
        yield b + "ffn_gate.weight", (F, H), 0.0
        yield b + "ffn_up.weight", (F, H), 0.0
        yield b + "ffn_down.weight", (H, F), 0.0
        yield b + "post_ffw_norm.weight", (H,), 1.0
    else:  # gpt-oss: biases everywhere, sinks, a biased router, experts with biases
        E, Fe = shape.experts, shape.expert_ffn
        yield b + "attn_norm.weight", (H,), 1.0
        for name, rows, columns in (("attn_q", nh * hd, H), ("attn_k", kv * hd, H), ("attn_v", kv * hd, H),
                                    ("attn_output", H, nh * hd)):
            yield b + name + ".weight", (rows, columns), 0.0
            yield b + name + ".bias", (rows,), RANDOM
        yield b + "attn_sinks.weight", (nh,), RANDOM
        yield b + "post_attention_norm.weight", (H,), 1.0
        yield b + "ffn_gate_inp.weight", (E, H), 0.0
        yield b + "ffn_gate_inp.bias", (E,), RANDOM
        yield b + "ffn_gate_exps.weight", (E, Fe, H), 0.0
        yield b + "ffn_gate_exps.bias", (E, Fe), RANDOM
        yield b + "ffn_up_exps.weight", (E, Fe, H), 0.0
        yield b + "ffn_up_exps.bias", (E, Fe), RANDOM
        yield b + "ffn_down_exps.weight", (E, H, Fe), 0.0
        yield b + "ffn_down_exps.bias", (E, H), RANDOM


def _global_tensors(shape: Shape) -> Iterator[tuple[str, tuple[int, ...], float, tuple[float, ...]]]:
    H, V_ = shape.hidden_size, shape.vocab_size
    yield "token_embd.weight", (V_, H), 0.0, ()
    yield "output_norm.weight", (H,), 1.0, ()
    if not shape.tied:
        yield "output.weight", (V_, H), 0.0, ()
    if shape.llama3_rope is not None:
        yield "rope_freqs.weight", (shape.head_dim // 2,), 0.0, llama3_rope_factors(shape)
    if shape.long_factors:  # Phi-3 LongRoPE: one factor per rotated pair
        yield "rope_factors_long.weight", (shape.rope_dim // 2,), 0.0, shape.long_factors
        yield "rope_factors_short.weight", (shape.rope_dim // 2,), 0.0, shape.short_factors
    if shape.architecture == "gemma4":
        if any(shape.is_full(i) for i in range(shape.layer_count)):
            rotated = int(shape.head_dim_full * shape.partial_rotary / 2)
            freqs = (1.0,) * rotated + (1e30,) * (shape.head_dim_full // 2 - rotated)
            yield "rope_freqs.weight", (shape.head_dim_full // 2,), 0.0, freqs
        if shape.per_layer_dim:
            LP = shape.layer_count * shape.per_layer_dim
            yield "per_layer_token_embd.weight", (V_, LP), 0.0, ()
            yield "per_layer_model_proj.weight", (LP, H), 0.0, ()
            yield "per_layer_proj_norm.weight", (shape.per_layer_dim,), 1.0, ()


def _order_key(name: str) -> tuple[int, str]:
    """llama.cpp's weight order (llama_model_loader::weight_name_comparer): by layer, then by name."""
    layer = int(name.split(".")[1]) if name.startswith("blk.") else -1
    return layer, name


def tensor_plan(shape: Shape) -> list[TensorPlan]:
    """Every tensor of the shape's Q4_K_M file, in file order."""
    entries: list[tuple[str, tuple[int, ...], float | str, tuple[float, ...]]] = list(_global_tensors(shape))
    for i in range(shape.layer_count):
        entries += [(name, dims, value, ()) for name, dims, value in _layer_tensors(shape, i)]
    entries.sort(key=lambda entry: _order_key(entry[0]))
    attn_v_names = [name for name, *_ in entries if name.endswith(("attn_v.weight", "attn_qkv.weight"))]
    plans = []
    for name, dims, value, values in entries:
        attn_v = (attn_v_names.index(name), len(attn_v_names)) if name in attn_v_names else None
        down = name.endswith(("ffn_down.weight", "ffn_down_exps.weight"))
        layer = (_order_key(name)[0], shape.layer_count) if down else None
        qtype = q4_k_m_type(name, dims, tied=shape.tied, attn_v=attn_v, layer=layer)
        if shape.expert_qtype and name.endswith("_exps.weight"):
            qtype = Q[shape.expert_qtype]  # kept as released (see the module docstring: gpt-oss)
        if value == RANDOM:
            plans.append(TensorPlan(name, dims, qtype, "random"))
            continue
        fill = "values" if values else ("const" if len(dims) == 1 else "random")
        plans.append(TensorPlan(name, dims, qtype, fill, float(value), values))
    return plans


def parameter_count(shape: Shape) -> int:
    return sum(plan.elements for plan in tensor_plan(shape))


# ----------------------------------------------------------------------------------------------------
# Random blocks.

# Standard deviation of the dequantized values of uniformly random block bytes when the f16 block scale
# is 1 (Q4_K: dmin = 7.5 d, which makes the expected value 0). Derived from the block formulas:
#   Q4_K  x = d*sc*q - dmin*m, sc, m uniform 0..63, q uniform 0..15 (sc*q - 7.5*m has variance 66727)
#   Q6_K  x = d*s*(q - 32), s int8 uniform -128..127, q uniform 0..63
#   Q5_0  x = d*(q - 16), q uniform 0..31;  Q8_0  x = d*q, q int8
# and checked against gguf-py's dequantize in tests/test_synthetic.py.
_Q4_K_DMIN_RATIO = 7.5
_UNIT_STD = {
    Q.Q4_K: math.sqrt((63 * 127 / 6) * (15 * 31 / 6) - (31.5 * 7.5) ** 2 + 7.5**2 * (64**2 - 1) / 12),
    Q.Q6_K: math.sqrt((128**2 * 2 + 1) / 6 * ((64**2 - 1) / 12 + 0.25)),
    Q.Q5_0: math.sqrt((32**2 - 1) / 12 + 0.25),
    Q.Q8_0: math.sqrt((256**2 - 1) / 12 + 0.25),
}
# Byte offset of the f16 scale(s) inside each block.
_SCALE_FIELDS = {Q.Q4_K: (0, 2), Q.Q6_K: (208,), Q.Q5_0: (0,), Q.Q8_0: (0,)}
# MXFP4 (gpt-oss experts): x = kvalues[q] * 2^(e - 128), kvalues the doubled e2m1 values 0, 1, 2, 3, 4, 6,
# 8, 12 and their negatives, q uniform over the 16 codes (E[x^2] = 274/8 at e = 128); the scale is one
# e8m0 exponent byte at the start of each block, so the spread is met to within a factor of 2^(1/2).
_MXFP4_UNIT_STD = math.sqrt(274 / 8)


def _tensor_rng(name: str, seed: int) -> np.random.Generator:
    return np.random.Generator(np.random.SFC64(np.random.SeedSequence([seed, zlib.crc32(name.encode())])))


def _random_bytes(rng: np.random.Generator, count: int) -> np.ndarray:
    words = rng.bit_generator.random_raw((count + 7) // 8)
    return words.view(np.uint8)[:count]


def quantized_chunks(plan: TensorPlan, seed: int, std: float) -> Iterator[np.ndarray]:
    """The tensor's bytes, a chunk of whole rows at a time: random blocks, every scale set to one value."""
    block, size = gguf.GGML_QUANT_SIZES[plan.qtype]
    rows, columns = plan.elements // plan.columns, plan.columns
    row_bytes = columns // block * size
    if plan.qtype == Q.MXFP4:
        yield from _mxfp4_chunks(plan, seed, std, rows, row_bytes, size)
        return
    d = np.float16(std / _UNIT_STD[plan.qtype])
    if not np.isfinite(d) or d == 0:
        raise ValueError(f"{plan.name}: block scale {float(d)} for std {std} is not a usable f16")
    scales = np.array([d, np.float16(d * _Q4_K_DMIN_RATIO)] if plan.qtype == Q.Q4_K else [d])
    scale_bytes = scales.view(np.uint8)
    rng = _tensor_rng(plan.name, seed)
    rows_per_chunk = max(1, _CHUNK_BYTES // row_bytes)
    for start in range(0, rows, rows_per_chunk):
        n = min(rows_per_chunk, rows - start)
        blocks = _random_bytes(rng, n * row_bytes).reshape(-1, size)
        for k, offset in enumerate(_SCALE_FIELDS[plan.qtype]):
            blocks[:, offset:offset + 2] = scale_bytes[2 * k:2 * k + 2]
        yield blocks.reshape(-1)


def _mxfp4_chunks(plan: TensorPlan, seed: int, std: float, rows: int, row_bytes: int,
                  size: int) -> Iterator[np.ndarray]:
    exponent = np.uint8(128 + round(math.log2(std / _MXFP4_UNIT_STD)))
    rng = _tensor_rng(plan.name, seed)
    rows_per_chunk = max(1, _CHUNK_BYTES // row_bytes)
    for start in range(0, rows, rows_per_chunk):
        n = min(rows_per_chunk, rows - start)
        blocks = _random_bytes(rng, n * row_bytes).reshape(-1, size)
        blocks[:, 0] = exponent
        yield blocks.reshape(-1)


def float_chunks(plan: TensorPlan, seed: int, std: float) -> Iterator[np.ndarray]:
    """F32/F16/BF16 tensors: constants, given values, or normal random values a chunk of rows at a time."""
    if plan.fill == "values":
        data = np.asarray(plan.values, dtype=np.float32).reshape(plan.shape)
        yield _encode_float(data, plan.qtype)
        return
    if plan.fill == "const":
        yield _encode_float(np.full(plan.shape, plan.value, dtype=np.float32), plan.qtype)
        return
    rng = _tensor_rng(plan.name, seed)
    rows, columns = plan.elements // plan.columns, plan.columns
    rows_per_chunk = max(1, (_CHUNK_BYTES // 4) // columns)
    for start in range(0, rows, rows_per_chunk):
        n = min(rows_per_chunk, rows - start)
        yield _encode_float(rng.standard_normal((n, columns), dtype=np.float32) * np.float32(std), plan.qtype)


def _encode_float(data: np.ndarray, qtype: Q) -> np.ndarray:
    if qtype == Q.F32:
        return data.astype(np.float32).reshape(-1).view(np.uint8)
    if qtype == Q.F16:
        return data.astype(np.float16).reshape(-1).view(np.uint8)
    if qtype == Q.BF16:  # round to nearest even on the upper 16 bits
        bits = np.ascontiguousarray(data, dtype=np.float32).reshape(-1).view(np.uint32)
        rounded = ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16).astype(np.uint16)
        return rounded.view(np.uint8)
    raise ValueError(f"no float encoding for {qtype.name}")


def tensor_chunks(plan: TensorPlan, seed: int) -> Iterator[np.ndarray]:
    std = 1.0 / math.sqrt(plan.columns)
    if plan.qtype in _UNIT_STD or plan.qtype == Q.MXFP4:
        return quantized_chunks(plan, seed, std)
    return float_chunks(plan, seed, std)


# ----------------------------------------------------------------------------------------------------
# Vocabulary and metadata.

_VOCAB_KEYS: dict[str, tuple[V, V | None]] = {
    "tokenizer.ggml.model": (V.STRING, None),
    "tokenizer.ggml.pre": (V.STRING, None),
    "tokenizer.ggml.tokens": (V.ARRAY, V.STRING),
    "tokenizer.ggml.scores": (V.ARRAY, V.FLOAT32),
    "tokenizer.ggml.token_type": (V.ARRAY, V.INT32),
    "tokenizer.ggml.merges": (V.ARRAY, V.STRING),
    "tokenizer.ggml.bos_token_id": (V.UINT32, None),
    "tokenizer.ggml.eos_token_id": (V.UINT32, None),
    "tokenizer.ggml.unknown_token_id": (V.UINT32, None),
    "tokenizer.ggml.padding_token_id": (V.UINT32, None),
    "tokenizer.ggml.mask_token_id": (V.UINT32, None),
    "tokenizer.ggml.add_bos_token": (V.BOOL, None),
    "tokenizer.ggml.add_eos_token": (V.BOOL, None),
    "tokenizer.ggml.add_space_prefix": (V.BOOL, None),
    "tokenizer.chat_template": (V.STRING, None),
}
_SPECIAL_KEYS = {"bos": "bos_token_id", "eos": "eos_token_id", "unk": "unknown_token_id",
                 "pad": "padding_token_id", "mask": "mask_token_id"}


def vocabulary(shape: Shape) -> dict[str, Any]:
    """The tokenizer keys of the shape's vocab file, padded to the model's rows, specials overridden."""
    from ember.gguf_file import GGUFFile

    path = VOCAB_DIR / f"ggml-vocab-{shape.vocab}.gguf"
    source = GGUFFile.open(path)
    values = {key: source.get(key) for key in _VOCAB_KEYS if source.get(key) is not None}
    tokens = list(values["tokenizer.ggml.tokens"])
    if len(tokens) > shape.vocab_size:
        raise ValueError(f"{path.name} has {len(tokens)} tokens, more than {shape.title}'s "
                         f"{shape.vocab_size}")
    # The converter pads a vocabulary shorter than the embedding with unused "[PAD<id>]" tokens.
    missing = range(len(tokens), shape.vocab_size)
    values["tokenizer.ggml.tokens"] = tokens + [f"[PAD{i}]" for i in missing]
    values["tokenizer.ggml.token_type"] = [int(t) for t in values["tokenizer.ggml.token_type"]] + [
        int(gguf.TokenType.UNUSED)] * len(missing)
    if "tokenizer.ggml.scores" in values:
        scores = [float(s) for s in values["tokenizer.ggml.scores"]]
        values["tokenizer.ggml.scores"] = scores + [0.0] * len(missing)
    values["tokenizer.ggml.merges"] = list(values.get("tokenizer.ggml.merges", []))
    for special, token_id in shape.special_ids:
        values["tokenizer.ggml." + _SPECIAL_KEYS[special]] = token_id
    return values


# The architectures whose converter writes attention.key_length/value_length when config.json has head_dim
# (Gemma 4 writes its own; Phi-3's and Granite's converters never do).
_KEY_LENGTH_ARCHS = ("llama", "qwen3", "qwen3moe", "qwen2", "smollm3", "olmo2", "mistral3", "gemma2",
                     "gpt-oss")


def _write_new_family_metadata(w: gguf.GGUFWriter, shape: Shape) -> None:
    """The keys of the families added after generator version 1 (docs/families.md §7-§14)."""
    arch = shape.architecture
    if arch == "phi3":
        w.add_rope_dimension_count(shape.rope_dim)
        w.add_sliding_window(shape.sliding_window)  # read, then switched off by llama.cpp
        if shape.original_context:
            w.add_rope_scaling_orig_ctx_len(shape.original_context)
        if shape.long_factors:  # the converter's attention factor: sqrt(1 + ln s / ln L0)
            scale = shape.context_length / shape.original_context
            factor = math.sqrt(1 + math.log(scale) / math.log(shape.original_context)) if scale > 1 else 1.0
            w.add_rope_scaling_attn_factors(factor)
    if arch == "gemma2":
        w.add_attn_logit_softcapping(shape.attn_softcap)
        w.add_final_logit_softcapping(shape.softcap)
        w.add_sliding_window(shape.sliding_window)
    if arch == "gpt-oss":
        w.add_sliding_window(shape.sliding_window)
    if arch == "granite":  # each only when non-zero, as the converter
        for add, value in ((w.add_attention_scale, shape.attention_scale),
                           (w.add_embedding_scale, shape.embedding_scale),
                           (w.add_residual_scale, shape.residual_scale),
                           (w.add_logit_scale, shape.logit_scale)):
            if value:
                add(value)
    if shape.rope_scaling_factor:  # YaRN (gpt-oss, mistral3)
        w.add_rope_scaling_type(gguf.RopeScalingType.YARN)
        w.add_rope_scaling_factor(shape.rope_scaling_factor)
        w.add_rope_scaling_orig_ctx_len(shape.original_context)
        if shape.yarn_betas is not None:
            w.add_rope_scaling_yarn_beta_fast(shape.yarn_betas[0])
            w.add_rope_scaling_yarn_beta_slow(shape.yarn_betas[1])
    if arch == "mistral3":
        w.add_rope_scaling_yarn_log_mul(shape.yarn_log_multiplier)
        w.add_attn_temperature_scale(shape.temperature_scale)


def _write_metadata(writer: gguf.GGUFWriter, shape: Shape, seed: int) -> None:
    w, L = writer, shape.layer_count
    w.add_type(gguf.GGUFType.MODEL)
    w.add_name(f"{shape.title} (synthetic: random Q4_K_M blocks)")
    w.add_string("ember.synthetic.shape", shape.name)
    w.add_string("ember.synthetic.source", shape.source)
    w.add_uint32("ember.synthetic.seed", seed)
    w.add_string("ember.synthetic.generator", GENERATOR_VERSION)
    w.add_block_count(L)
    w.add_context_length(shape.context_length)
    w.add_embedding_length(shape.hidden_size)
    if shape.double_wide_mlp:
        w.add_feed_forward_length([shape.layer_ffn(i) for i in range(L)])
    else:
        w.add_feed_forward_length(shape.ffn)
    w.add_head_count(shape.head_count)
    if shape.head_count_kv_full:
        w.add_head_count_kv([shape.layer_kv_heads(i) for i in range(L)])
    else:
        w.add_head_count_kv(shape.head_count_kv)
    arch = shape.architecture
    if arch != "gemma2":  # Gemma 2's converter writes no rope base (llama.cpp: 10000)
        w.add_rope_freq_base(shape.rope_base)
    w.add_layer_norm_rms_eps(shape.rms_eps)
    w.add_file_type(int(gguf.LlamaFileType.MOSTLY_Q4_K_M))
    if arch in ("llama", "granite", "smollm3", "mistral3"):  # the converter's LlamaModel
        w.add_vocab_size(shape.vocab_size)
        w.add_rope_dimension_count(shape.head_dim)
    if arch in _KEY_LENGTH_ARCHS and shape.config_has_head_dim:
        w.add_key_length(shape.head_dim)
        w.add_value_length(shape.head_dim)
    if shape.experts:
        w.add_expert_count(shape.experts)
        w.add_expert_used_count(shape.experts_used)
        w.add_expert_feed_forward_length(shape.expert_ffn)
    if shape.architecture == "gemma4":
        w.add_key_length(shape.head_dim_full)
        w.add_value_length(shape.head_dim_full)
        w.add_final_logit_softcapping(shape.softcap)
        w.add_sliding_window(shape.sliding_window)
        w.add_shared_kv_layers(shape.shared_kv_layers)
        w.add_embedding_length_per_layer_input(shape.per_layer_dim)
        w.add_sliding_window_pattern([not shape.is_full(i) for i in range(L)])
        w.add_key_length_swa(shape.head_dim)
        w.add_value_length_swa(shape.head_dim)
        w.add_rope_dimension_count(shape.head_dim_full)
        w.add_rope_dimension_count_swa(shape.head_dim)
        w.add_rope_freq_base_swa(shape.rope_base_swa)
    _write_new_family_metadata(w, shape)
    for key, value in vocabulary(shape).items():
        vtype, sub_type = _VOCAB_KEYS[key]
        if vtype == V.ARRAY and not value:
            continue
        w.add_key_value(key, value, vtype, sub_type=sub_type)
    w.add_quantization_version(gguf.GGML_QUANT_VERSION)


# ----------------------------------------------------------------------------------------------------
# Files.


# Shape fields added after generator version 1: at their defaults they change no byte, so they stay out of
# the digest (the files already written for the first shapes keep theirs).
_LATER_FIELDS = ("attn_softcap", "original_context", "long_factors", "short_factors", "rope_scaling_factor",
                 "yarn_betas", "yarn_log_multiplier", "temperature_scale", "embedding_scale",
                 "residual_scale", "attention_scale", "logit_scale", "expert_qtype")


def spec_digest(shape: Shape, seed: int) -> str:
    """What the file's bytes depend on: generator version, shape, seed."""
    defaults = {f.name: f.default for f in dataclasses.fields(Shape)}
    spec = {key: value for key, value in dataclasses.asdict(shape).items()
            if key not in _LATER_FIELDS or value != defaults[key]}
    text = json.dumps([GENERATOR_VERSION, spec, seed], sort_keys=True)
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def synthetic_dir() -> Path:
    from ember.paths import ember_cache_dir

    return ember_cache_dir() / "synthetic"


def default_path(shape: Shape, seed: int = DEFAULT_SEED) -> Path:
    return synthetic_dir() / shape.file_name(seed)


def _sidecar(path: Path) -> Path:
    return path.with_name(path.name + ".json")


def read_sidecar(path: Path) -> dict[str, Any] | None:
    try:
        return json.loads(_sidecar(path).read_text())
    except (OSError, ValueError):
        return None


def is_current(path: Path, shape: Shape, seed: int, verify: bool = False) -> bool:
    """The file exists and its sidecar says it is this shape and seed, with the right size (and hash)."""
    record = read_sidecar(path)
    if record is None or record.get("digest") != spec_digest(shape, seed) or not path.exists():
        return False
    if path.stat().st_size != record.get("size"):
        return False
    return not verify or _sha256_file(path) == record.get("sha256")


def _sha256_file(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        while chunk := handle.read(_CHUNK_BYTES):
            digest.update(chunk)
    return digest.hexdigest()


def write_synthetic(shape: Shape, path: str | os.PathLike[str], seed: int = DEFAULT_SEED) -> dict[str, Any]:
    """Write the file (atomically: a temporary name, then a rename) and its sidecar; return the record."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    started = time.perf_counter()
    plans = tensor_plan(shape)
    temporary = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        writer = gguf.GGUFWriter(temporary, shape.architecture)
        _write_metadata(writer, shape, seed)
        for plan in plans:  # GGUFWriter takes NumPy shapes and writes ne reversed
            writer.add_tensor_info(plan.name, plan.shape, np.dtype(np.float32), plan.nbytes,
                                   raw_dtype=plan.qtype)
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_ti_data_to_file()
        writer.close()
        alignment = writer.data_alignment
        digest = hashlib.sha256()
        with open(temporary, "r+b") as handle:
            digest.update(handle.read())
            _pad(handle, digest, alignment)
            for plan in plans:
                written = 0
                for chunk in tensor_chunks(plan, seed):
                    handle.write(chunk.data)
                    digest.update(chunk.data)
                    written += chunk.nbytes
                if written != plan.nbytes:
                    raise AssertionError(f"{plan.name}: wrote {written} bytes, expected {plan.nbytes}")
                _pad(handle, digest, alignment)
        os.replace(temporary, path)
    finally:
        temporary.unlink(missing_ok=True)
    record = {
        "shape": shape.name,
        "digest": spec_digest(shape, seed),
        "seed": seed,
        "generator": GENERATOR_VERSION,
        "size": path.stat().st_size,
        "sha256": digest.hexdigest(),
        "parameters": sum(plan.elements for plan in plans),
        "types": _type_counts(plans),
        "seconds": round(time.perf_counter() - started, 2),
    }
    _sidecar(path).write_text(json.dumps(record, indent=1) + "\n")
    return record


def _pad(handle: Any, digest: Any, alignment: int) -> None:
    padding = -handle.tell() % alignment
    if padding:
        handle.write(bytes(padding))
        digest.update(bytes(padding))


def _type_counts(plans: list[TensorPlan]) -> dict[str, int]:
    counts: dict[str, int] = {}
    for plan in plans:
        counts[plan.qtype.name] = counts.get(plan.qtype.name, 0) + 1
    return counts


def ensure(name: str, seed: int = DEFAULT_SEED, out_dir: str | os.PathLike[str] | None = None,
           verify: bool = False, quiet: bool = False) -> Path:
    """The path of the shape's file, written first unless a current one is there."""
    if name not in SHAPES:
        raise KeyError(f"unknown shape {name!r}; known: {', '.join(SHAPES)}")
    shape = SHAPES[name]
    path = (Path(out_dir) / shape.file_name(seed)) if out_dir else default_path(shape, seed)
    if is_current(path, shape, seed, verify):
        return path
    if not quiet:
        print(f"writing {path} ...", file=sys.stderr, flush=True)
    record = write_synthetic(shape, path, seed)
    if not quiet:
        print(f"  {record['size'] / 1e9:.2f} GB, {record['parameters'] / 1e9:.2f} B parameters, "
              f"{record['seconds']:.1f} s, types {record['types']}", file=sys.stderr, flush=True)
    return path


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.synthetic",
                                     description=__doc__.splitlines()[0])
    parser.add_argument("--shape", default="all", help=f"'all' or comma-separated of: {', '.join(SHAPES)}")
    parser.add_argument("--out", help="directory for the files (default: <ember cache>/synthetic)")
    parser.add_argument("--seed", type=int, default=DEFAULT_SEED)
    parser.add_argument("--verify", action="store_true", help="re-hash existing files before trusting them")
    parser.add_argument("--list", action="store_true",
                        help="print the shapes and their tensor types, write nothing")
    parser.add_argument("--check", action="store_true",
                        help="after writing, load each file in llama.cpp and generate a few tokens")
    args = parser.parse_args(argv)
    names = list(SHAPES) if args.shape == "all" else [n.strip() for n in args.shape.split(",") if n.strip()]
    unknown = [n for n in names if n not in SHAPES]
    if unknown:
        sys.exit(f"unknown shape(s) {unknown}; known: {', '.join(SHAPES)}")
    if args.list:
        for name in names:
            plans = tensor_plan(SHAPES[name])
            size = sum(p.nbytes for p in plans)
            print(f"{name}: {sum(p.elements for p in plans) / 1e9:.3f} B parameters, "
                  f"{size / 1e9:.2f} GB of tensor data, {_type_counts(plans)}")
        return
    for name in names:
        path = ensure(name, args.seed, args.out, args.verify)
        record = read_sidecar(path) or {}
        print(f"{name}: {path} ({record.get('size', 0) / 1e9:.2f} GB, "
              f"sha256 {record.get('sha256', '?')[:16]}, written in {record.get('seconds', '?')} s)")
        if args.check:
            print("  " + check_with_llama_cpp(path), flush=True)


def check_with_llama_cpp(path: Path, text: str = "The old lighthouse keeper climbed the stairs",
                         new_tokens: int = 8) -> str:
    """Load the file in llama.cpp, evaluate a prompt, generate greedily: proof that the file is real."""
    import llama_cpp

    started = time.perf_counter()
    llm = llama_cpp.Llama(model_path=str(path), n_ctx=128, n_threads=os.cpu_count() or 1,
                          logits_all=True, verbose=False)
    try:
        load = time.perf_counter() - started
        ids = llm.tokenize(text.encode(), add_bos=True)
        llm.eval(ids)
        logits = np.array(llm.scores[: len(ids)], dtype=np.float32)
        generated = []
        for _ in range(new_tokens):
            token = int(np.argmax(llm.scores[llm.n_tokens - 1]))
            generated.append(token)
            llm.eval([token])
        return (f"llama.cpp {llama_cpp.__version__}: loaded in {load:.1f} s, {llm.n_vocab()} tokens, prompt "
                f"{len(ids)} ids, logits finite: {bool(np.isfinite(logits).all())} (std {logits.std():.2f}), "
                f"generated {generated} = {llm.detokenize(generated).decode(errors='replace')!r}")
    finally:
        llm.close()


if __name__ == "__main__":
    main()
