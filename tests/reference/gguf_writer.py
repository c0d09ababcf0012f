"""Write a tiny HF llama-block model (`LlamaForCausalLM`, `Qwen3ForCausalLM`, `Qwen2ForCausalLM`,
`Olmo2ForCausalLM`, `GraniteForCausalLM`, `SmolLM3ForCausalLM`, `Ministral3ForCausalLM`) or
`Qwen3MoeForCausalLM` as GGUF the way llama.cpp's converter does.

Facts mirrored from llama.cpp's `convert_hf_to_gguf.py` (the copy vendored in llama-cpp-python 0.3.36,
`conversion/base.py`, `conversion/llama.py`, `conversion/qwen.py`, `conversion/olmo.py`,
`conversion/granite.py`); see also docs/families.md §1–§2, §7–§10:

* tensor names: `token_embd`, `output_norm`, `output` (only when the head is not tied), and per block
  `attn_norm`, `attn_q`, `attn_k`, `attn_v`, `attn_output`, `attn_q_norm`/`attn_k_norm` (qwen3),
  `ffn_norm`, `ffn_gate`, `ffn_up`, `ffn_down`;
* qwen3moe (`conversion/qwen.py` Qwen2MoeModel/Qwen3MoeModel): the router `mlp.gate` is
  `ffn_gate_inp` (always F32), HF's stacked `mlp.experts.gate_up_proj` [E, 2F, H] is split into
  `ffn_gate_exps` (first F rows of each expert) and `ffn_up_exps`, `mlp.experts.down_proj` [E, H, F] is
  `ffn_down_exps`; metadata adds `expert_count`, `expert_used_count`, `expert_feed_forward_length`;
* numpy arrays keep PyTorch's (out, in) order; GGUFWriter stores the reversed ne = [in, out];
* arch `llama` (and `granite`, `smollm3`: their converters are `LlamaModel`'s) reorders the rows of q_proj
  (with n_head) and k_proj (with n_head_kv), weights and biases, so that NORM rope on the stored weights
  equals HF's NEOX rope; `qwen3`, `qwen2`, `olmo2` store HF weights unchanged (biases as `attn_q.bias`…;
  olmo2's norms as `attn_q_norm`, `post_attention_norm`, `post_ffw_norm`);
* granite writes `attention.scale`, `embedding_scale`, `residual_scale`, `logit_scale` from the
  config's multipliers (each only when non-zero) and never `attention.key_length` (it drops `head_dim`);
* 1-D tensors and `*_norm.weight` are always F32; every other weight takes the file type (F32, F16, Q8_0);
  a weight whose rows do not split into quantization blocks falls back to F16, as the converter does;
* Llama-3 rope scaling becomes a generated `rope_freqs.weight` (no scaling keys); linear scaling becomes
  `rope.scaling.type = "linear"` plus `rope.scaling.factor`; YaRN (`conversion/base.py`) becomes
  `rope.scaling.type = "yarn"`, `.factor`, `.original_context_length`, and `.yarn_beta_fast`/`_slow`,
  `.yarn_attn_factor` (from `attention_factor`) when the config has them;
* `mistral3` (`conversion/mistral3.py` Ministral3Model, a `LlamaModel`: Q/K permuted) adds
  `rope.scaling.yarn_log_multiplier` (`mscale_all_dim`) and `attention.temperature_scale`
  (`llama_4_scaling_beta`); its config.json carries `head_dim`, so `attention.key_length` is written;
* `llama`, `granite`, `smollm3` also get `vocab_size` and `rope.dimension_count`;
  `attention.key_length/value_length` are written when the HF config.json carries `head_dim` (always for
  qwen3; for the others only when head_dim differs from hidden/heads, like a config.json without
  `head_dim` such as SmolLM2's).

The tokenizer is a small byte-level BPE vocabulary ("gpt2" model): three control tokens, the 256 GPT-2
byte symbols and a few merges. Tests feed exact token ids, so the vocabulary only has to load.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import gguf
import numpy as np
import torch
from gguf import GGMLQuantizationType

from reference.names import gguf_tensor_name

__all__ = [
    "TinyVocab",
    "gguf_arch",
    "gguf_tensors",
    "llama3_rope_factors",
    "load_gguf_weights_into_hf",
    "permute_rows",
    "rewrite_gguf",
    "tiny_vocab",
    "unpermute_rows",
    "write_gguf",
]

_FILE_TYPES = {
    GGMLQuantizationType.F32: gguf.LlamaFileType.ALL_F32,
    GGMLQuantizationType.F16: gguf.LlamaFileType.MOSTLY_F16,
    GGMLQuantizationType.Q8_0: gguf.LlamaFileType.MOSTLY_Q8_0,
}

# --------------------------------------------------------------------------- tokenizer


@dataclass(frozen=True)
class TinyVocab:
    tokens: list[str]
    token_types: list[int]
    merges: list[str]
    bos_token_id: int
    eos_token_id: int
    pad_token_id: int

    @property
    def special_ids(self) -> list[int]:
        return [i for i, t in enumerate(self.token_types) if t == gguf.TokenType.CONTROL]


def _byte_symbols() -> list[str]:
    """GPT-2's byte-to-unicode table: printable Latin-1 bytes stay, the rest map to U+0100 onwards."""
    printable = set(range(ord("!"), ord("~") + 1))
    printable |= set(range(ord("¡"), ord("¬") + 1))
    printable |= set(range(ord("®"), ord("ÿ") + 1))
    symbols = []
    shifted = 0
    for byte in range(256):
        if byte in printable:
            symbols.append(chr(byte))
        else:
            symbols.append(chr(256 + shifted))
            shifted += 1
    return symbols


_MERGE_PAIRS = [
    ("Ġ", "t"), ("h", "e"), ("Ġt", "he"), ("i", "n"), ("e", "r"), ("Ġ", "a"), ("o", "n"), ("r", "e"),
    ("Ġ", "s"), ("a", "t"), ("e", "n"), ("Ġ", "o"), ("o", "r"), ("Ġ", "w"), ("i", "s"), ("Ġ", "b"),
]


def tiny_vocab() -> TinyVocab:
    """Control tokens 0-2 (`<|endoftext|>`, `<|im_start|>` = bos, `<|im_end|>` = eos), bytes, merges."""
    tokens = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    types = [int(gguf.TokenType.CONTROL)] * 3
    tokens += _byte_symbols()
    merges = []
    for left, right in _MERGE_PAIRS:
        merges.append(f"{left} {right}")
        tokens.append(left + right)
    types += [int(gguf.TokenType.NORMAL)] * (len(tokens) - len(types))
    assert len(set(tokens)) == len(tokens)
    return TinyVocab(tokens, types, merges, bos_token_id=1, eos_token_id=2, pad_token_id=2)


# --------------------------------------------------------------------------- tensors


ARCHITECTURES = {"llama": "llama", "qwen3": "qwen3", "qwen2": "qwen2", "olmo2": "olmo2", "granite": "granite",
                 "smollm3": "smollm3", "qwen3_moe": "qwen3moe",
                 "ministral3": "mistral3"}  # HF model_type → GGUF architecture
PERMUTED = ("llama", "granite", "smollm3", "mistral3")  # written by llama.cpp's `LlamaModel` (undo_permute)


def gguf_arch(model: torch.nn.Module) -> str:
    model_type = model.config.model_type
    if model_type not in ARCHITECTURES:
        raise ValueError(f"only {', '.join(ARCHITECTURES)} HF models are supported, not {model_type!r}")
    return ARCHITECTURES[model_type]


GATE_UP_EXPERTS, DOWN_EXPERTS = "mlp.experts.gate_up_proj", "mlp.experts.down_proj"


def _expert_names(arch: str, layers: int, hf_name: str) -> tuple[str, ...]:
    """The GGUF names of an HF stacked-experts tensor: (gate, up) for gate_up_proj, (down,)."""
    base = hf_name.removesuffix("gate_up_proj").removesuffix("down_proj")
    if hf_name.endswith(GATE_UP_EXPERTS):
        return (gguf_tensor_name(arch, layers, base + "gate_proj.weight"),
                gguf_tensor_name(arch, layers, base + "up_proj.weight"))
    return (gguf_tensor_name(arch, layers, base + "down_proj.weight"),)


def _permuted(arch: str, hf_name: str, config) -> int | None:
    """The head count the converter permutes this tensor's rows with, or None."""
    if arch not in PERMUTED:
        return None
    if hf_name.endswith(("self_attn.q_proj.weight", "self_attn.q_proj.bias")):
        return config.num_attention_heads
    if hf_name.endswith(("self_attn.k_proj.weight", "self_attn.k_proj.bias")):
        return config.num_key_value_heads
    return None


def _qk_row_order(rows: int, n_head: int) -> np.ndarray:
    """GGUF row r takes HF row order[r]: within each head the two halves are interleaved."""
    head_dim = rows // n_head
    half = head_dim // 2
    order = np.empty(rows, dtype=np.int64)
    for head in range(n_head):
        for i in range(half):
            for t in range(2):
                order[head * head_dim + 2 * i + t] = head * head_dim + t * half + i
    return order


def permute_rows(weight: np.ndarray, n_head: int) -> np.ndarray:
    """HF q_proj/k_proj rows (NEOX halves) to the GGUF `llama` layout (NORM adjacent pairs)."""
    return weight[_qk_row_order(weight.shape[0], n_head)]


def unpermute_rows(weight: np.ndarray, n_head: int) -> np.ndarray:
    """Inverse of `permute_rows`."""
    out = np.empty_like(weight)
    out[_qk_row_order(weight.shape[0], n_head)] = weight
    return out


def _rope_parameters(config) -> dict:
    params = getattr(config, "rope_parameters", None) or {}
    return dict(params.get("full_attention", params))


def _head_dim(config) -> int:
    head_dim = getattr(config, "head_dim", None)
    return int(head_dim) if head_dim else config.hidden_size // config.num_attention_heads


def llama3_rope_factors(config) -> np.ndarray | None:
    """The converter's generated `rope_freqs.weight` for HF rope_type "llama3", else None."""
    params = _rope_parameters(config)
    if str(params.get("rope_type", "")).lower() != "llama3":
        return None
    base = float(params.get("rope_theta", 10000.0))
    dim = _head_dim(config)
    factor = float(params.get("factor", 8.0))
    low = float(params.get("low_freq_factor", 1.0))
    high = float(params.get("high_freq_factor", 4.0))
    old_context = float(params.get("original_max_position_embeddings", 8192))
    inv_freq = 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim))
    factors = []
    for freq in inv_freq.tolist():
        wavelength = 2 * math.pi / freq
        if wavelength < old_context / high:
            factors.append(1.0)
        elif wavelength > old_context / low:
            factors.append(factor)
        else:
            smooth = (old_context / wavelength - low) / (high - low)
            factors.append(1.0 / ((1.0 - smooth) / factor + smooth))
    return np.asarray(factors, dtype=np.float32)


def gguf_tensors(model: torch.nn.Module, *, permute_qk: bool = True) -> Iterator[tuple[str, np.ndarray]]:
    """(GGUF name, float32 numpy array in the GGUF layout) in the converter's order.

    `permute_qk=False` skips the llama Q/K row permutation: a deliberately wrong file, for tests that
    show the permutation matters.
    """
    arch = gguf_arch(model)
    config = model.config
    factors = llama3_rope_factors(config) if arch == "llama" else None
    if factors is not None:
        yield "rope_freqs.weight", factors
    tied = bool(getattr(config, "tie_word_embeddings", False))
    for hf_name, tensor in model.state_dict().items():
        if hf_name.endswith("rotary_emb.inv_freq") or (tied and hf_name == "lm_head.weight"):
            continue
        data = tensor.detach().to(torch.float32).cpu().numpy()
        if hf_name.endswith(GATE_UP_EXPERTS):  # [E, 2F, H]: each expert's gate rows, then its up rows
            gate, up = _expert_names(arch, config.num_hidden_layers, hf_name)
            half = data.shape[1] // 2
            yield gate, np.ascontiguousarray(data[:, :half])
            yield up, np.ascontiguousarray(data[:, half:])
            continue
        if hf_name.endswith(DOWN_EXPERTS):
            yield _expert_names(arch, config.num_hidden_layers, hf_name)[0], np.ascontiguousarray(data)
            continue
        heads = _permuted(arch, hf_name, config)
        if heads is not None and permute_qk:
            data = permute_rows(data, heads)
        yield gguf_tensor_name(arch, config.num_hidden_layers, hf_name), np.ascontiguousarray(data)


def _tensor_type(name: str, data: np.ndarray, qtype: GGMLQuantizationType) -> GGMLQuantizationType:
    if data.ndim <= 1 or name.endswith(("_norm.weight", "ffn_gate_inp.weight")):  # the router stays F32
        return GGMLQuantizationType.F32
    if qtype in gguf.GGML_QUANT_SIZES and qtype not in (GGMLQuantizationType.F32, GGMLQuantizationType.F16):
        block = gguf.GGML_QUANT_SIZES[qtype][0]
        if data.shape[-1] % block:
            return GGMLQuantizationType.F16
    return qtype


# --------------------------------------------------------------------------- metadata


def _write_metadata(writer: gguf.GGUFWriter, model: torch.nn.Module, qtype: GGMLQuantizationType,
                    vocab: TinyVocab, pre: str, name: str) -> None:
    arch = gguf_arch(model)
    config = model.config
    writer.add_type(gguf.GGUFType.MODEL)
    writer.add_name(name)
    writer.add_block_count(config.num_hidden_layers)
    writer.add_context_length(config.max_position_embeddings)
    writer.add_embedding_length(config.hidden_size)
    writer.add_feed_forward_length(config.intermediate_size)
    if arch == "qwen3moe":
        writer.add_expert_count(config.num_experts)
        writer.add_expert_used_count(config.num_experts_per_tok)
        writer.add_expert_feed_forward_length(config.moe_intermediate_size)
    writer.add_head_count(config.num_attention_heads)
    writer.add_head_count_kv(config.num_key_value_heads)
    params = _rope_parameters(config)
    if params.get("rope_type") == "linear" and params.get("factor") is not None:
        writer.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
        writer.add_rope_scaling_factor(float(params["factor"]))
    elif params.get("rope_type") == "yarn" and params.get("factor") is not None:
        writer.add_rope_scaling_type(gguf.RopeScalingType.YARN)
        writer.add_rope_scaling_factor(float(params["factor"]))
        writer.add_rope_scaling_orig_ctx_len(int(params["original_max_position_embeddings"]))
        if params.get("attention_factor") is not None:
            writer.add_rope_scaling_yarn_attn_factor(float(params["attention_factor"]))
        if params.get("beta_fast") is not None:
            writer.add_rope_scaling_yarn_beta_fast(float(params["beta_fast"]))
        if params.get("beta_slow") is not None:
            writer.add_rope_scaling_yarn_beta_slow(float(params["beta_slow"]))
        if arch == "mistral3":
            writer.add_rope_scaling_yarn_log_mul(float(params["mscale_all_dim"]))
            writer.add_attn_temperature_scale(float(params["llama_4_scaling_beta"]))
    elif params.get("rope_type") not in (None, "default", "llama3"):
        raise ValueError(f"rope_type {params.get('rope_type')!r} is not written by this helper")
    if params.get("rope_theta") is not None:
        writer.add_rope_freq_base(float(params["rope_theta"]))
    writer.add_layer_norm_rms_eps(float(config.rms_norm_eps))
    head_dim = _head_dim(config)
    own_head_dim = head_dim != config.hidden_size // config.num_attention_heads
    if arch != "granite" and (arch in ("qwen3", "qwen3moe", "mistral3") or own_head_dim):
        writer.add_key_length(head_dim)
        writer.add_value_length(head_dim)
    if arch == "granite":
        for add, value in ((writer.add_attention_scale, config.attention_multiplier),
                           (writer.add_embedding_scale, config.embedding_multiplier),
                           (writer.add_residual_scale, config.residual_multiplier),
                           (writer.add_logit_scale, config.logits_scaling)):
            if value:
                add(float(value))
    writer.add_file_type(int(_FILE_TYPES[qtype]))
    if arch in PERMUTED:
        writer.add_vocab_size(config.vocab_size)
        writer.add_rope_dimension_count(head_dim)

    if len(vocab.tokens) != config.vocab_size:
        raise ValueError(f"vocabulary has {len(vocab.tokens)} tokens, the model {config.vocab_size}")
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre(pre)
    writer.add_token_list(vocab.tokens)
    writer.add_token_types(vocab.token_types)
    writer.add_token_merges(vocab.merges)
    writer.add_bos_token_id(vocab.bos_token_id)
    writer.add_eos_token_id(vocab.eos_token_id)
    writer.add_pad_token_id(vocab.pad_token_id)
    writer.add_add_bos_token(False)
    writer.add_quantization_version(gguf.GGML_QUANT_VERSION)


def write_gguf(model: torch.nn.Module, path: str | Path, *,
               qtype: GGMLQuantizationType = GGMLQuantizationType.F32,
               vocab: TinyVocab | None = None, pre: str | None = None,
               name: str | None = None, permute_qk: bool = True) -> Path:
    """Write `model` (a tiny float32 model of one of `ARCHITECTURES`) to `path` as GGUF.

    `permute_qk=False` writes a deliberately wrong llama file (see `gguf_tensors`)."""
    if qtype not in _FILE_TYPES:
        raise ValueError(f"file type {qtype!r} is not one the converter writes here")
    arch = gguf_arch(model)
    vocab = vocab or tiny_vocab()
    pre = pre or ("smollm" if arch == "llama" else "qwen2")
    path = Path(path)
    writer = gguf.GGUFWriter(path, arch)
    _write_metadata(writer, model, qtype, vocab, pre, name or f"tiny-random-{arch}")
    for tensor_name, data in gguf_tensors(model, permute_qk=permute_qk):
        tensor_type = _tensor_type(tensor_name, data, qtype)
        if tensor_type == GGMLQuantizationType.F32:
            writer.add_tensor(tensor_name, data.astype(np.float32), raw_dtype=tensor_type)
        elif tensor_type == GGMLQuantizationType.F16:
            writer.add_tensor(tensor_name, data.astype(np.float16), raw_dtype=tensor_type)
        else:
            writer.add_tensor(tensor_name, gguf.quants.quantize(data, tensor_type), raw_dtype=tensor_type)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


# --------------------------------------------------------------------------- reading back


def load_gguf_weights_into_hf(model: torch.nn.Module, path: str | Path) -> list[str]:
    """Dequantize every tensor of `path`, undo the llama Q/K permutation and copy it into `model`.

    Used to give HF exactly the weights ember reads from an F16/Q8_0 file. Every HF parameter must be
    covered (the tied LM head through the embedding). Returns the GGUF tensor names that were loaded.
    """
    arch = gguf_arch(model)
    config = model.config
    reader = gguf.GGUFReader(path)
    state = model.state_dict()
    hf_names = {}
    for name in state:
        if name.endswith(GATE_UP_EXPERTS):
            gate, up = _expert_names(arch, config.num_hidden_layers, name)
            hf_names[gate], hf_names[up] = (name, 0), (name, 1)  # the halves of gate_up_proj's rows
        elif name.endswith(DOWN_EXPERTS):
            hf_names[_expert_names(arch, config.num_hidden_layers, name)[0]] = name
        elif not name.endswith("inv_freq"):
            hf_names[gguf_tensor_name(arch, config.num_hidden_layers, name)] = name
    covered = set()
    loaded = []
    with torch.no_grad():
        for tensor in reader.tensors:
            if tensor.name == "rope_freqs.weight":
                continue
            data = gguf.dequantize(tensor.data, tensor.tensor_type).astype(np.float32)
            hf_name = hf_names[tensor.name]
            if isinstance(hf_name, tuple):  # one half of a stacked gate_up_proj
                hf_name, half = hf_name
                rows = state[hf_name].shape[1] // 2
                state[hf_name][:, half * rows:(half + 1) * rows].copy_(torch.from_numpy(data))
                covered.add(hf_name)
                loaded.append(tensor.name)
                continue
            heads = _permuted(arch, hf_name, config)
            if heads is not None:
                data = unpermute_rows(data, heads)
            target = state[hf_name]
            if tuple(target.shape) != data.shape:
                raise ValueError(f"{tensor.name}: shape {data.shape} does not fit "
                                 f"{hf_name} {tuple(target.shape)}")
            target.copy_(torch.from_numpy(np.ascontiguousarray(data)))
            covered.add(hf_name)
            loaded.append(tensor.name)
    if getattr(config, "tie_word_embeddings", False):
        covered.add("lm_head.weight")
    missing = sorted(set(state) - covered - {n for n in state if n.endswith("inv_freq")})
    if missing:
        raise ValueError(f"GGUF {path} does not cover HF parameters {missing}")
    return loaded


# --------------------------------------------------------------------------- damaged copies


def rewrite_gguf(path: str | Path, out: str | Path, *, drop_key: str | None = None,
                 drop_tensor: str | None = None, replace: dict | None = None, extra: dict | None = None,
                 reshape: dict[str, tuple[int, ...]] | None = None, dequantize: bool = False) -> Path:
    """Copy a GGUF file with a metadata key or tensor removed, metadata values replaced or added (uint32),
    F32 tensors given another NumPy shape (`reshape`: the first values of the tensor, recycled), or every
    quantized tensor stored as the F32 values it stands for (`dequantize`, gguf-py's decoding)."""
    reader = gguf.GGUFReader(path)
    architecture = reader.fields["general.architecture"].contents()
    writer = gguf.GGUFWriter(out, architecture)
    for field in reader.fields.values():
        if field.name.startswith("GGUF.") or field.name in ("general.architecture", drop_key):
            continue
        value = (replace or {}).get(field.name, field.contents())
        kind = field.types[0]
        sub = field.types[-1] if kind == gguf.GGUFValueType.ARRAY else None
        writer.add_key_value(field.name, value, kind, sub_type=sub)
    for key, value in (extra or {}).items():
        writer.add_uint32(key, value)
    for tensor in reader.tensors:
        if tensor.name == drop_tensor:
            continue
        if tensor.name in (reshape or {}):
            shape = reshape[tensor.name]
            data = np.resize(np.array(tensor.data, np.float32).ravel(), shape)
            writer.add_tensor(tensor.name, data, raw_dtype=GGMLQuantizationType.F32)
            continue
        shape = tuple(reversed(tensor.shape.tolist()))
        if dequantize and tensor.tensor_type not in (GGMLQuantizationType.F32, GGMLQuantizationType.F16):
            values = gguf.quants.dequantize(np.array(tensor.data), tensor.tensor_type).reshape(shape)
            writer.add_tensor(tensor.name, values.astype(np.float32), raw_dtype=GGMLQuantizationType.F32)
            continue
        writer.add_tensor(tensor.name, np.array(tensor.data), raw_shape=shape, raw_dtype=tensor.tensor_type)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return Path(out)
