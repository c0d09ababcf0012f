"""Write a tiny Gemma 4 text model as GGUF the way llama.cpp's converter writes it (no torch needed).

Facts mirrored from llama.cpp's converter (`conversion/gemma.py::Gemma4Model` and its bases
`Gemma3Model`, `TextModel`, `ModelBase.prepare_tensors` in the copy vendored in llama-cpp-python 0.3.36)
and docs/families.md §3:

* metadata: block_count, context_length, embedding_length, feed_forward_length (an array of one value per
  layer, doubled from the first KV-shared layer on, when `use_double_wide_mlp`), head_count,
  head_count_kv (a per-layer array only when full layers have their own KV head count, i.e.
  `num_global_key_value_heads` with `attention_k_eq_v`), rope.freq_base (full layers) and
  rope.freq_base_swa, layer_norm_rms_epsilon, key_length/value_length = the FULL layers' head dim,
  key_length_swa/value_length_swa = the sliding head dim, final_logit_softcapping, sliding_window,
  shared_kv_layers, embedding_length_per_layer_input, sliding_window_pattern (one bool per layer, true =
  sliding), rope.dimension_count = full head dim, rope.dimension_count_swa = sliding head dim. The
  "proportional" rope type is no GGUF scaling type: no rope.scaling key is written.
* `rope_freqs.weight` is generated: 1.0 for the first int(hd_full·partial_rotary_factor/2) entries and
  1e30 for the rest of hd_full/2 (used by every full layer).
* tensors keep HF values (no norm shift for Gemma 4); `layer_scalar` becomes `layer_output_scale.weight`;
  KV-shared layers have no k_proj / v_proj / k_norm in HF, so none is written; full layers with
  `attention_k_eq_v` have no v_proj, so no `attn_v`; a tied LM head writes no `output.weight`.
* types: 1-D tensors and `*_norm.weight` are F32; every other weight takes the file type (F32, F16, Q8_0),
  with an F16 fallback for rows that do not split into Q8_0 blocks.
* vocabulary: `tokenizer.ggml.model = "gemma4"` (no `pre`), tokens, scores, token types, merges, special
  ids, add_space_prefix false, add_bos_token true, and a chat template.
* mixture of experts (`enable_moe_block`, 26B-A4B): metadata expert_count, expert_used_count
  (`TextModel.set_gguf_parameters` reads num_experts / top_k_experts) and expert_feed_forward_length
  (moe_intermediate_size); `router.proj` → `ffn_gate_inp.weight` (kept F32, as `prepare_tensors` keeps
  every FFN_GATE_INP), `router.scale` → `ffn_gate_inp.scale`, `router.per_expert_scale` →
  `ffn_down_exps.scale` (`Gemma4Model.modify_tensors`), `experts.gate_up_proj` [E, 2F, H] →
  `ffn_gate_up_exps.weight` as it is (F gate rows, then F up rows) and `experts.down_proj` →
  `ffn_down_exps.weight` (`filter_tensors` adds the `.weight`), the three extra norms by gguf-py's map.
  `split_gate_up_exps` writes the other layout llama.cpp loads: `ffn_gate_exps` and `ffn_up_exps`.

Weights are given as a dict of HF state-dict names to float32 numpy arrays, from transformers
(`gemma4_reference.hf_state`) or from `random_state` here (for tests that do not need transformers).
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import gguf
import numpy as np
from gguf import GGMLQuantizationType

from reference.names import gguf_tensor_name

__all__ = ["Gemma4Spec", "TinyGemma4Vocab", "gguf_tensors", "random_state", "tiny_gemma4_vocab", "write_gguf"]

SLIDING, FULL = "sliding_attention", "full_attention"

_FILE_TYPES = {
    GGMLQuantizationType.F32: gguf.LlamaFileType.ALL_F32,
    GGMLQuantizationType.F16: gguf.LlamaFileType.MOSTLY_F16,
    GGMLQuantizationType.Q8_0: gguf.LlamaFileType.MOSTLY_Q8_0,
}


@dataclass(frozen=True)
class Gemma4Spec:
    """The Gemma4TextConfig fields the converter reads (names as in HF's config)."""

    vocab_size: int
    hidden_size: int = 64
    intermediate_size: int = 96
    num_attention_heads: int = 4
    num_key_value_heads: int = 2
    head_dim: int = 16  # sliding layers
    global_head_dim: int = 32  # full layers
    num_global_key_value_heads: int | None = None  # full layers' KV heads (HF applies it with k_eq_v)
    layer_types: tuple[str, ...] = (SLIDING, FULL, SLIDING, FULL, SLIDING, SLIDING, FULL)
    sliding_window: int = 6
    hidden_size_per_layer_input: int = 32
    num_kv_shared_layers: int = 3
    use_double_wide_mlp: bool = True
    attention_k_eq_v: bool = False
    final_logit_softcapping: float | None = 30.0
    rms_norm_eps: float = 1e-6
    max_position_embeddings: int = 128
    rope_theta: float = 1_000_000.0  # full layers
    rope_theta_swa: float = 10_000.0
    partial_rotary_factor: float = 0.25  # full layers ("proportional")
    tie_word_embeddings: bool = True
    enable_moe_block: bool = False  # every layer: the dense FFN plus a mixture of experts
    num_experts: int = 8
    top_k_experts: int = 2
    moe_intermediate_size: int = 32
    split_gate_up_exps: bool = False  # write ffn_gate_exps + ffn_up_exps instead of ffn_gate_up_exps

    @property
    def num_hidden_layers(self) -> int:
        return len(self.layer_types)

    @property
    def first_shared_layer(self) -> int:
        return self.num_hidden_layers - self.num_kv_shared_layers

    def is_sliding(self, layer: int) -> bool:
        return self.layer_types[layer] == SLIDING

    def owns_kv(self, layer: int) -> bool:
        return layer < self.first_shared_layer

    def layer_head_dim(self, layer: int) -> int:
        return self.head_dim if self.is_sliding(layer) else self.global_head_dim

    def layer_kv_heads(self, layer: int) -> int:
        if not self.is_sliding(layer) and self.attention_k_eq_v and self.num_global_key_value_heads:
            return self.num_global_key_value_heads
        return self.num_key_value_heads

    def layer_ffn(self, layer: int) -> int:
        wide = self.use_double_wide_mlp and not self.owns_kv(layer)
        return self.intermediate_size * (2 if wide else 1)

    def has_v_proj(self, layer: int) -> bool:
        return self.owns_kv(layer) and not (self.attention_k_eq_v and not self.is_sliding(layer))

    def hf_kwargs(self) -> dict:
        """Keyword arguments for transformers' Gemma4TextConfig."""
        kwargs = dict(
            vocab_size=self.vocab_size, hidden_size=self.hidden_size,
            intermediate_size=self.intermediate_size,
            num_hidden_layers=self.num_hidden_layers, num_attention_heads=self.num_attention_heads,
            num_key_value_heads=self.num_key_value_heads, head_dim=self.head_dim,
            global_head_dim=self.global_head_dim, layer_types=list(self.layer_types),
            sliding_window=self.sliding_window, hidden_size_per_layer_input=self.hidden_size_per_layer_input,
            vocab_size_per_layer_input=self.vocab_size, num_kv_shared_layers=self.num_kv_shared_layers,
            use_double_wide_mlp=self.use_double_wide_mlp, attention_k_eq_v=self.attention_k_eq_v,
            final_logit_softcapping=self.final_logit_softcapping, rms_norm_eps=self.rms_norm_eps,
            max_position_embeddings=self.max_position_embeddings,
            tie_word_embeddings=self.tie_word_embeddings,
            rope_parameters={
                SLIDING: {"rope_type": "default", "rope_theta": self.rope_theta_swa},
                FULL: {"rope_type": "proportional", "partial_rotary_factor": self.partial_rotary_factor,
                       "rope_theta": self.rope_theta},
            },
            pad_token_id=0, eos_token_id=1, bos_token_id=2,
        )
        if self.num_global_key_value_heads is not None:
            kwargs["num_global_key_value_heads"] = self.num_global_key_value_heads
        if self.enable_moe_block:
            kwargs.update(enable_moe_block=True, num_experts=self.num_experts,
                          top_k_experts=self.top_k_experts, moe_intermediate_size=self.moe_intermediate_size)
        return kwargs


# --------------------------------------------------------------------------- vocabulary


@dataclass(frozen=True)
class TinyGemma4Vocab:
    tokens: list[str]
    scores: list[float]
    token_types: list[int]
    merges: list[str]
    chat_template: str
    special: dict[str, int] = field(default_factory=dict)


_SPACE = "\u2581"
_MERGES = [
    (_SPACE, "t"), ("h", "e"), (_SPACE + "t", "he"), ("i", "n"), ("e", "r"), (_SPACE, "a"), ("o", "n"),
    ("r", "e"), (_SPACE, "s"), ("a", "t"), ("e", "n"), (_SPACE, "o"), ("o", "r"), (_SPACE, "w"), ("i", "s"),
]

CHAT_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}<|turn>{{ 'model' if message['role'] == 'assistant' "
    "else message['role'] }}\n{{ message['content'] | trim }}<turn|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|turn>model\n{% endif %}"
)


def tiny_gemma4_vocab() -> TinyGemma4Vocab:
    """Gemma 4's special layout (pad 0, eos 1, bos 2, unk 3, mask 4), turn markers, 256 byte tokens,
    `▁`, letters, newline runs and a few merges; llama.cpp and ember both load it."""
    T = gguf.TokenType
    entries: list[tuple[str, float, int]] = [
        ("<pad>", -1000.0, T.CONTROL), ("<eos>", -1000.0, T.CONTROL), ("<bos>", -1000.0, T.CONTROL),
        ("<unk>", -1000.0, T.UNKNOWN), ("<mask>", -1000.0, T.CONTROL),
        ("<|turn>", -1000.0, T.CONTROL), ("<turn|>", -1000.0, T.CONTROL),
    ]
    entries += [(f"<0x{b:02X}>", 0.0, T.BYTE) for b in range(256)]
    pieces = [_SPACE, "\n", "\n\n", ".", ","] + [chr(c) for c in range(ord("a"), ord("z") + 1)]
    merges = []
    for left, right in _MERGES:
        merges.append(f"{left} {right}")
        pieces.append(left + right)
    entries += [(p, -float(i), T.NORMAL) for i, p in enumerate(pieces)]
    tokens = [e[0] for e in entries]
    assert len(set(tokens)) == len(tokens)
    return TinyGemma4Vocab(
        tokens=tokens, scores=[e[1] for e in entries], token_types=[int(e[2]) for e in entries],
        merges=merges, chat_template=CHAT_TEMPLATE,
        special={"pad": 0, "eos": 1, "bos": 2, "unk": 3},
    )


# --------------------------------------------------------------------------- tensors

# Gemma4Model.modify_tensors renames these two itself (gguf-py's map has no entry for them)
_ROUTER_SCALES = {"router.scale": "ffn_gate_inp.scale", "router.per_expert_scale": "ffn_down_exps.scale"}


def gguf_name(spec: Gemma4Spec, hf_name: str) -> str:
    for suffix, name in _ROUTER_SCALES.items():
        if hf_name.endswith("." + suffix):
            return f"blk.{hf_name.split('.')[2]}.{name}"
    name = gguf_tensor_name("gemma4", spec.num_hidden_layers, hf_name)
    if ".experts." in hf_name and not name.endswith(".weight"):
        name += ".weight"  # Gemma4Model.filter_tensors: the 3-D expert parameters have no suffix in HF
    return name


def rope_freqs(spec: Gemma4Spec) -> np.ndarray:
    """The converter's generated factors for the full layers' proportional rope."""
    rotated = int(spec.global_head_dim * spec.partial_rotary_factor / 2)
    return np.array([1.0] * rotated + [1e30] * (spec.global_head_dim // 2 - rotated), dtype=np.float32)


def hf_shapes(spec: Gemma4Spec) -> dict[str, tuple[int, ...]]:
    """Every HF parameter/buffer of Gemma4ForCausalLM's state dict with its shape (the tied head excluded)."""
    H, P, L, V = spec.hidden_size, spec.hidden_size_per_layer_input, spec.num_hidden_layers, spec.vocab_size
    n_head = spec.num_attention_heads
    shapes: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (V, H)}
    for i in range(L):
        p = f"model.layers.{i}."
        hd, n_kv, F = spec.layer_head_dim(i), spec.layer_kv_heads(i), spec.layer_ffn(i)
        shapes[p + "layer_scalar"] = (1,)
        shapes[p + "self_attn.q_proj.weight"] = (n_head * hd, H)
        shapes[p + "self_attn.q_norm.weight"] = (hd,)
        if spec.owns_kv(i):
            shapes[p + "self_attn.k_norm.weight"] = (hd,)
            shapes[p + "self_attn.k_proj.weight"] = (n_kv * hd, H)
            if spec.has_v_proj(i):
                shapes[p + "self_attn.v_proj.weight"] = (n_kv * hd, H)
        shapes[p + "self_attn.o_proj.weight"] = (H, n_head * hd)
        shapes[p + "mlp.gate_proj.weight"] = (F, H)
        shapes[p + "mlp.up_proj.weight"] = (F, H)
        shapes[p + "mlp.down_proj.weight"] = (H, F)
        for norm in ("input_layernorm", "post_attention_layernorm", "pre_feedforward_layernorm",
                     "post_feedforward_layernorm"):
            shapes[p + norm + ".weight"] = (H,)
        if spec.enable_moe_block:
            E, Fe = spec.num_experts, spec.moe_intermediate_size
            shapes[p + "router.scale"] = (H,)
            shapes[p + "router.per_expert_scale"] = (E,)
            shapes[p + "router.proj.weight"] = (E, H)
            shapes[p + "experts.gate_up_proj"] = (E, 2 * Fe, H)
            shapes[p + "experts.down_proj"] = (E, H, Fe)
            for norm in ("post_feedforward_layernorm_1", "post_feedforward_layernorm_2",
                         "pre_feedforward_layernorm_2"):
                shapes[p + norm + ".weight"] = (H,)
        if P:
            shapes[p + "per_layer_input_gate.weight"] = (P, H)
            shapes[p + "per_layer_projection.weight"] = (H, P)
            shapes[p + "post_per_layer_input_norm.weight"] = (H,)
    shapes["model.norm.weight"] = (H,)
    if P:
        shapes["model.embed_tokens_per_layer.weight"] = (V, L * P)
        shapes["model.per_layer_model_projection.weight"] = (L * P, H)
        shapes["model.per_layer_projection_norm.weight"] = (P,)
    if not spec.tie_word_embeddings:
        shapes["lm_head.weight"] = (V, H)
    return shapes


def random_state(spec: Gemma4Spec, seed: int = 0) -> dict[str, np.ndarray]:
    """Random float32 weights under HF names: linear weights N(0, 0.05²) (embeddings N(0, 0.5²)), norm
    weights 1 + N(0, 0.2²), layer scalars uniform in [0.5, 1.5]. A mixture's router: its projection N(0, 1)
    (logits of spread ~1, so the top-k choice is clear of ties), its input scale 1 + N(0, 0.2²), the
    per-expert scales uniform in [0.5, 1.5]."""
    rng = np.random.default_rng(seed)
    state = {}
    for name, shape in hf_shapes(spec).items():
        if name.endswith(("layer_scalar", "per_expert_scale")):
            values = rng.uniform(0.5, 1.5, shape)
        elif name.endswith(("norm.weight", "router.scale")):
            values = 1.0 + 0.2 * rng.standard_normal(shape)
        elif "embed_tokens" in name:
            values = 0.5 * rng.standard_normal(shape)
        elif name.endswith("router.proj.weight"):
            values = rng.standard_normal(shape)
        else:
            values = 0.05 * rng.standard_normal(shape)
        state[name] = values.astype(np.float32)
    return state


def gguf_tensors(spec: Gemma4Spec, state: dict[str, np.ndarray]) -> Iterator[tuple[str, np.ndarray]]:
    """(GGUF name, float32 array) in the converter's order: generated tensors, then the model's."""
    if any(not spec.is_sliding(i) for i in range(spec.num_hidden_layers)):
        yield "rope_freqs.weight", rope_freqs(spec)
    for hf_name, data in state.items():
        tied_head = spec.tie_word_embeddings and hf_name == "lm_head.weight"
        if hf_name.endswith("rotary_emb.inv_freq") or tied_head:
            continue
        name = gguf_name(spec, hf_name)
        if spec.split_gate_up_exps and name.endswith("ffn_gate_up_exps.weight"):
            F = spec.moe_intermediate_size
            yield name.replace("gate_up", "gate"), np.ascontiguousarray(data[:, :F], dtype=np.float32)
            yield name.replace("gate_up", "up"), np.ascontiguousarray(data[:, F:], dtype=np.float32)
            continue
        yield name, np.ascontiguousarray(data, dtype=np.float32)


def tensor_type(name: str, data: np.ndarray, qtype: GGMLQuantizationType) -> GGMLQuantizationType:
    if data.ndim <= 1 or name.endswith(("_norm.weight", "ffn_gate_inp.weight")):  # the router stays F32
        return GGMLQuantizationType.F32
    if qtype == GGMLQuantizationType.Q8_0 and data.shape[-1] % gguf.GGML_QUANT_SIZES[qtype][0]:
        return GGMLQuantizationType.F16
    return qtype


# --------------------------------------------------------------------------- metadata and file


def _write_metadata(writer: gguf.GGUFWriter, spec: Gemma4Spec, qtype: GGMLQuantizationType,
                    vocab: TinyGemma4Vocab, name: str) -> None:
    L = spec.num_hidden_layers
    writer.add_type(gguf.GGUFType.MODEL)
    writer.add_name(name)
    # TextModel.set_gguf_parameters
    writer.add_block_count(L)
    writer.add_context_length(spec.max_position_embeddings)
    writer.add_embedding_length(spec.hidden_size)
    if spec.use_double_wide_mlp:
        writer.add_feed_forward_length([spec.layer_ffn(i) for i in range(L)])
    else:
        writer.add_feed_forward_length(spec.intermediate_size)
    writer.add_head_count(spec.num_attention_heads)
    if spec.attention_k_eq_v and spec.num_global_key_value_heads is not None:
        writer.add_head_count_kv([spec.layer_kv_heads(i) for i in range(L)])
    else:
        writer.add_head_count_kv(spec.num_key_value_heads)
    writer.add_rope_freq_base(spec.rope_theta)
    writer.add_rope_freq_base_swa(spec.rope_theta_swa)
    writer.add_layer_norm_rms_eps(spec.rms_norm_eps)
    writer.add_key_length(spec.global_head_dim)
    writer.add_value_length(spec.global_head_dim)
    writer.add_file_type(int(_FILE_TYPES[qtype]))
    # Gemma3Model.set_gguf_parameters
    if spec.final_logit_softcapping:
        writer.add_final_logit_softcapping(spec.final_logit_softcapping)
    writer.add_sliding_window(spec.sliding_window)
    # Gemma4Model.set_gguf_parameters
    writer.add_shared_kv_layers(spec.num_kv_shared_layers)
    writer.add_embedding_length_per_layer_input(spec.hidden_size_per_layer_input)
    writer.add_sliding_window_pattern([spec.is_sliding(i) for i in range(L)])
    writer.add_key_length_swa(spec.head_dim)
    writer.add_value_length_swa(spec.head_dim)
    writer.add_rope_dimension_count(spec.global_head_dim)
    writer.add_rope_dimension_count_swa(spec.head_dim)
    if spec.enable_moe_block:  # TextModel and Gemma4Model.set_gguf_parameters
        writer.add_expert_count(spec.num_experts)
        writer.add_expert_used_count(spec.top_k_experts)
        writer.add_expert_feed_forward_length(spec.moe_intermediate_size)
    # Gemma4Model.set_vocab
    if len(vocab.tokens) != spec.vocab_size:
        raise ValueError(f"vocabulary has {len(vocab.tokens)} tokens, the model {spec.vocab_size}")
    writer.add_tokenizer_model("gemma4")
    writer.add_token_list(vocab.tokens)
    writer.add_token_scores(vocab.scores)
    writer.add_token_types(vocab.token_types)
    writer.add_token_merges(vocab.merges)
    writer.add_bos_token_id(vocab.special["bos"])
    writer.add_eos_token_id(vocab.special["eos"])
    writer.add_unk_token_id(vocab.special["unk"])
    writer.add_pad_token_id(vocab.special["pad"])
    writer.add_chat_template(vocab.chat_template)
    writer.add_add_space_prefix(False)
    writer.add_add_bos_token(True)
    writer.add_quantization_version(gguf.GGML_QUANT_VERSION)


def write_gguf(path: str | Path, spec: Gemma4Spec, state: dict[str, np.ndarray], *,
               qtype: GGMLQuantizationType = GGMLQuantizationType.F32,
               vocab: TinyGemma4Vocab | None = None, name: str = "tiny-random-gemma4") -> Path:
    """Write the model (HF-named float32 weights) to `path` as a gemma4 GGUF."""
    if qtype not in _FILE_TYPES:
        raise ValueError(f"file type {qtype!r} is not one the converter writes here")
    vocab = vocab or tiny_gemma4_vocab()
    path = Path(path)
    writer = gguf.GGUFWriter(path, "gemma4")
    _write_metadata(writer, spec, qtype, vocab, name)
    for tensor_name, data in gguf_tensors(spec, state):
        kind = tensor_type(tensor_name, data, qtype)
        if kind == GGMLQuantizationType.F32:
            writer.add_tensor(tensor_name, data, raw_dtype=kind)
        elif kind == GGMLQuantizationType.F16:
            writer.add_tensor(tensor_name, data.astype(np.float16), raw_dtype=kind)
        else:
            writer.add_tensor(tensor_name, gguf.quants.quantize(data, kind), raw_dtype=kind)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def dequantized_state(path: str | Path, spec: Gemma4Spec) -> dict[str, np.ndarray]:
    """Read back the file's weights under HF names (to give HF exactly what a quantized file holds)."""
    reverse = {}
    for hf_name in hf_shapes(spec):
        reverse[gguf_name(spec, hf_name)] = hf_name
    reader = gguf.GGUFReader(path)
    state, parts = {}, {}
    for tensor in reader.tensors:
        if tensor.name == "rope_freqs.weight":
            continue
        data = gguf.dequantize(tensor.data, tensor.tensor_type).astype(np.float32)
        if tensor.name.endswith(("ffn_gate_exps.weight", "ffn_up_exps.weight")):  # split_gate_up_exps
            parts[tensor.name] = data
            continue
        hf_name = reverse[tensor.name]
        state[hf_name] = data.reshape(hf_shapes(spec)[hf_name])
    for name, gate in parts.items():
        if name.endswith("ffn_gate_exps.weight"):
            fused = name.replace("ffn_gate_exps", "ffn_gate_up_exps")
            up = parts[name.replace("ffn_gate_exps", "ffn_up_exps")]
            state[reverse[fused]] = np.concatenate([gate, up], axis=1)
    return state
