"""Tiny random gpt-oss models written as GGUF the way llama.cpp's converter writes them, against transformers.

Each of gpt-oss's own parts is switched on so that an engine without it fails: attention sinks (random
logits of about ±2, each head's), a sliding window of 4 tokens on the even layers (prompts of 11 tokens
need it in the prefill and every decode step crosses it), Q/K/V/O biases, the router's bias, the experts'
biases, YaRN, the clamped SwiGLU (gate and up weights large enough that |g|, |u| pass the limit 7), 8
experts of which each token takes 2. `test_each_part_shows` proves each one matters: transformers without
it is far from ember.

Converter facts mirrored (llama.cpp `convert_hf_to_gguf.py` GptOssModel, docs/families.md §14): metadata
`context_length`, `embedding_length`, `block_count`, `feed_forward_length`, `expert_feed_forward_length`,
`expert_count`, `expert_used_count`, `attention.head_count(_kv)`, `attention.key_length`/`value_length`,
`attention.layer_norm_rms_epsilon`, `attention.sliding_window`, `rope.freq_base`; HF's interleaved
`gate_up_proj` [E, H, 2F] split into `ffn_gate_exps` (columns 0, 2, …) and `ffn_up_exps` (1, 3, …),
transposed to [E, F, H], and their biases alike; `down_proj` [E, F, H] transposed to [E, H, F]; `sinks` as
`attn_sinks.weight`; the experts' input norm as `post_attention_norm`. The experts are MXFP4 (what the
released files hold), the other matrices F32 or Q8_0; transformers gets gguf-py's dequantization of the
file, so the comparison is exact up to float32 rounding.

YaRN is on (factor 4 over 32 positions, base 150000: the released models' shape scaled down), read by
`ember.config.read_rope_scaling` from the converter's `rope.scaling.*` keys.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import gguf
import numpy as np
import pytest
from gguf import GGMLQuantizationType

import ember
from ember.errors import GGUFError
from ember.families.gptoss import GptOssConfig, build_config
from ember.gguf_file import GGUFFile
from ember.phases import ModelFamily

pytestmark = pytest.mark.reference

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from reference.compare import compare_evaluations  # noqa: E402
from reference.ember_recorder import BoundaryRecorder, record_generation  # noqa: E402
from reference.gguf_writer import tiny_vocab  # noqa: E402
from reference.hf_capture import capture  # noqa: E402

TOLERANCE = 1e-4
WINDOW = 4
HEAD_DIM = 16
EXPERTS, TOP_K = 8, 2
DECODE_STEPS = 5
PROMPT = [40, 71, 100, 33, 259, 120, 87, 66, 200, 5, 44]
# YaRN as the released models have it (factor 32 over 4096), scaled down: factor 4 over 32 positions.
# truncate: llama.cpp always floors / ceils the ramp's ends (ggml_rope_yarn_corr_dims), whatever the
# checkpoint's `truncate: false` says; transformers does so with truncate on (docs/families.md §14).
YARN = {"rope_type": "yarn", "rope_theta": 150000.0, "factor": 4.0, "original_max_position_embeddings": 32,
        "beta_fast": 32.0, "beta_slow": 1.0, "truncate": True}
F32, Q8_0, MXFP4 = GGMLQuantizationType.F32, GGMLQuantizationType.Q8_0, GGMLQuantizationType.MXFP4


def tiny_gptoss(seed: int = 0, **overrides: Any) -> Any:
    """4 layers (0 and 2 slide), hidden 64, 4 query heads over 2 KV heads of 16 dims, 8 experts of width
    64 (MXFP4 blocks of 32 along both), top 2, YaRN (`YARN`)."""
    from transformers import GptOssConfig as HFConfig
    from transformers import GptOssForCausalLM

    settings = dict(vocab_size=len(tiny_vocab().tokens), hidden_size=64, intermediate_size=64,
                    num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2, head_dim=HEAD_DIM,
                    num_local_experts=EXPERTS, num_experts_per_tok=TOP_K, sliding_window=WINDOW,
                    max_position_embeddings=64, rms_norm_eps=1e-5,
                    rope_parameters=YARN,
                    pad_token_id=2, eos_token_id=2, bos_token_id=1, tie_word_embeddings=False,
                    attn_implementation="eager") | overrides
    model = GptOssForCausalLM(HFConfig(**settings)).to(torch.float32)
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("norm.weight"):
                param.copy_(1.0 + 0.5 * (torch.rand(param.shape, generator=generator) - 0.5))
            elif name.endswith("sinks"):
                param.copy_(2.0 * torch.randn(param.shape, generator=generator))
            elif name.endswith("bias"):
                param.copy_(0.5 * torch.randn(param.shape, generator=generator))
            elif name.endswith("gate_up_proj"):  # [E, H, 2F]: gates and ups well past ±7
                param.copy_(torch.randn(param.shape, generator=generator) * 6.0 / param.shape[1] ** 0.5)
            elif name.endswith("down_proj"):  # [E, F, H]
                param.copy_(torch.randn(param.shape, generator=generator) * 0.3 / param.shape[1] ** 0.5)
            elif name.endswith("embed_tokens.weight"):
                param.copy_(torch.randn(param.shape, generator=generator))
            else:
                param.copy_(torch.randn(param.shape, generator=generator) / param.shape[-1] ** 0.5)
    return model.eval()


def gguf_tensors(model: Any) -> dict[str, np.ndarray]:
    """GGUF name → float32 array (NumPy order), as the converter lays them out."""
    state = {name: t.detach().to(torch.float32).numpy() for name, t in model.state_dict().items()}
    out = {"token_embd.weight": state["model.embed_tokens.weight"],
           "output_norm.weight": state["model.norm.weight"], "output.weight": state["lm_head.weight"]}
    for i in range(model.config.num_hidden_layers):
        hf, block = f"model.layers.{i}.", f"blk.{i}."
        out[block + "attn_norm.weight"] = state[hf + "input_layernorm.weight"]
        out[block + "post_attention_norm.weight"] = state[hf + "post_attention_layernorm.weight"]
        for ours, theirs in (("attn_q", "q_proj"), ("attn_k", "k_proj"), ("attn_v", "v_proj"),
                             ("attn_output", "o_proj")):
            out[f"{block}{ours}.weight"] = state[f"{hf}self_attn.{theirs}.weight"]
            out[f"{block}{ours}.bias"] = state[f"{hf}self_attn.{theirs}.bias"]
        out[block + "attn_sinks.weight"] = state[hf + "self_attn.sinks"]
        out[block + "ffn_gate_inp.weight"] = state[hf + "mlp.router.weight"]
        out[block + "ffn_gate_inp.bias"] = state[hf + "mlp.router.bias"]
        gate_up = state[hf + "mlp.experts.gate_up_proj"]
        gate_up_bias = state[hf + "mlp.experts.gate_up_proj_bias"]
        out[block + "ffn_gate_exps.weight"] = gate_up[:, :, 0::2].transpose(0, 2, 1)
        out[block + "ffn_up_exps.weight"] = gate_up[:, :, 1::2].transpose(0, 2, 1)
        out[block + "ffn_gate_exps.bias"] = gate_up_bias[:, 0::2]
        out[block + "ffn_up_exps.bias"] = gate_up_bias[:, 1::2]
        out[block + "ffn_down_exps.weight"] = state[hf + "mlp.experts.down_proj"].transpose(0, 2, 1)
        out[block + "ffn_down_exps.bias"] = state[hf + "mlp.experts.down_proj_bias"]
    return {name: np.ascontiguousarray(data, dtype=np.float32) for name, data in out.items()}


def _stored(name: str, data: np.ndarray, qtype: GGMLQuantizationType) -> tuple[np.ndarray, Any]:
    if data.ndim == 1 or name.endswith(".bias"):
        return data, F32
    if "_exps.weight" in name:
        return gguf.quants.quantize(data, MXFP4), MXFP4
    if qtype == F32:
        return data, F32
    return gguf.quants.quantize(data, qtype), qtype


def write_gptoss_gguf(model: Any, path: Path, qtype: GGMLQuantizationType = F32, *,
                      drop_key: str | None = None, keys: dict[str, Any] | None = None,
                      drop_tensor: str | None = None) -> Path:
    """The file llama.cpp's converter (then llama-quantize for the experts) writes for `model`."""
    config = model.config
    writer = gguf.GGUFWriter(path, "gpt-oss")
    values: dict[str, Any] = {
        "context_length": config.max_position_embeddings, "embedding_length": config.hidden_size,
        "block_count": config.num_hidden_layers, "feed_forward_length": config.intermediate_size,
        "expert_feed_forward_length": config.intermediate_size, "expert_count": config.num_local_experts,
        "expert_used_count": config.num_experts_per_tok, "attention.head_count": config.num_attention_heads,
        "attention.head_count_kv": config.num_key_value_heads, "attention.key_length": config.head_dim,
        "attention.value_length": config.head_dim,
        "attention.layer_norm_rms_epsilon": float(config.rms_norm_eps),
        "attention.sliding_window": config.sliding_window,
        "rope.freq_base": float(config.rope_parameters["rope_theta"]),
    }
    rope = config.rope_parameters
    if rope.get("rope_type") == "yarn":  # the converter's YaRN keys
        values |= {"rope.scaling.type": "yarn", "rope.scaling.factor": float(rope["factor"]),
                   "rope.scaling.original_context_length": int(rope["original_max_position_embeddings"])}
    values |= keys or {}
    writer.add_type(gguf.GGUFType.MODEL)
    writer.add_name("tiny-gpt-oss")
    for key, value in values.items():
        if key == drop_key:
            continue
        if isinstance(value, str):
            writer.add_string(f"gpt-oss.{key}", value)
        elif isinstance(value, float):
            writer.add_float32(f"gpt-oss.{key}", value)
        else:
            writer.add_uint32(f"gpt-oss.{key}", int(value))
    writer.add_file_type(int(gguf.LlamaFileType.ALL_F32 if qtype == F32 else gguf.LlamaFileType.MOSTLY_Q8_0))
    vocab = tiny_vocab()
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("default")
    writer.add_token_list(vocab.tokens)
    writer.add_token_types(vocab.token_types)
    writer.add_token_merges(vocab.merges)
    writer.add_bos_token_id(vocab.bos_token_id)
    writer.add_eos_token_id(vocab.eos_token_id)
    writer.add_pad_token_id(vocab.pad_token_id)
    writer.add_add_bos_token(False)
    writer.add_quantization_version(gguf.GGML_QUANT_VERSION)
    for name, data in gguf_tensors(model).items():
        if name == drop_tensor:
            continue
        stored, kind = _stored(name, data, qtype)
        writer.add_tensor(name, stored, raw_dtype=kind)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def load_file_weights_into_hf(model: Any, path: Path) -> None:
    """Give `model` the weights `path` holds (gguf-py's dequantization): what ember reads."""
    file = {t.name: gguf.dequantize(t.data, t.tensor_type).astype(np.float32)
            for t in gguf.GGUFReader(path).tensors}
    expected = gguf_tensors(model)
    state = model.state_dict()

    def put(hf_name: str, value: np.ndarray) -> None:
        state[hf_name].copy_(torch.from_numpy(np.ascontiguousarray(value).reshape(state[hf_name].shape)))

    with torch.no_grad():
        put("model.embed_tokens.weight", file["token_embd.weight"])
        put("model.norm.weight", file["output_norm.weight"])
        put("lm_head.weight", file["output.weight"])
        for i in range(model.config.num_hidden_layers):
            hf, block = f"model.layers.{i}.", f"blk.{i}."
            for ours, theirs in (("attn_q", "q_proj"), ("attn_k", "k_proj"), ("attn_v", "v_proj"),
                                 ("attn_output", "o_proj")):
                put(f"{hf}self_attn.{theirs}.weight", file[f"{block}{ours}.weight"].reshape(
                    expected[f"{block}{ours}.weight"].shape))
            E, F, H = expected[block + "ffn_gate_exps.weight"].shape
            gate = file[block + "ffn_gate_exps.weight"].reshape(E, F, H).transpose(0, 2, 1)
            up = file[block + "ffn_up_exps.weight"].reshape(E, F, H).transpose(0, 2, 1)
            gate_up = state[hf + "mlp.experts.gate_up_proj"].numpy().copy()
            gate_up[:, :, 0::2], gate_up[:, :, 1::2] = gate, up
            put(hf + "mlp.experts.gate_up_proj", gate_up)
            put(hf + "mlp.experts.down_proj", file[block + "ffn_down_exps.weight"].reshape(E, H, F)
                .transpose(0, 2, 1))
            put(hf + "mlp.router.weight", file[block + "ffn_gate_inp.weight"].reshape(EXPERTS, H))


@pytest.fixture(scope="module", params=["f32", "q8_0"])
def pair(request: Any, tmp_path_factory: Any) -> tuple[Any, Any]:
    hf = tiny_gptoss()
    qtype = F32 if request.param == "f32" else Q8_0
    path = write_gptoss_gguf(hf, tmp_path_factory.mktemp("gptoss") / f"tiny-{request.param}.gguf", qtype)
    load_file_weights_into_hf(hf, path)  # the experts are MXFP4 in both files
    return ember.load_model(path), hf


def compare_with_transformers(model: Any, hf: Any, prompt: list[int], steps: int) -> dict[str, float]:
    ours, generated = record_generation(model, prompt, steps)
    reference = capture(hf, prompt, generated[:steps])
    return {name: worst.relative for name, worst in compare_evaluations(ours, reference).items()}


def test_config_read_from_the_file(pair: tuple[Any, Any]) -> None:
    model, hf = pair
    c = model.config
    assert isinstance(c, GptOssConfig) and c.family is ModelFamily.GPT_OSS
    assert (c.expert_count, c.expert_used_count, c.feed_forward_length) == (EXPERTS, TOP_K, 64)
    assert c.sliding_window == WINDOW and c.sliding_layers == (True, False, True, False)
    assert list(c.sliding_layers) == [t == "sliding_attention" for t in hf.config.layer_types]
    assert c.attention_scale == pytest.approx(HEAD_DIM ** -0.5, rel=1e-12)
    assert not c.tied_embeddings
    assert (c.rope_scaling.kind, c.rope_scaling.factor, c.rope_scaling.original_context_length) == (
        "yarn", 4.0, 32)


def test_experts_are_multiplied_from_their_mxfp4_blocks(pair: tuple[Any, Any]) -> None:
    from ember.quant.matrix import QuantizedMatrix

    model, _ = pair
    down = model._forward.weights.layers[0].expert_down[3]
    assert isinstance(down, QuantizedMatrix) and down.ggml_type == int(MXFP4)


def test_every_boundary_matches_transformers(pair: tuple[Any, Any]) -> None:
    """Prefill of 11 tokens (window 4), then 5 decode steps: all boundaries, final norm and logits."""
    model, hf = pair
    worst = compare_with_transformers(model, hf, PROMPT, DECODE_STEPS)
    print("\nworst relative error: " + ", ".join(f"{k} {v:.1e}" for k, v in worst.items()))
    assert all(error <= TOLERANCE for error in worst.values()), worst


def test_greedy_tokens_match_transformers(pair: tuple[Any, Any]) -> None:
    model, hf = pair
    prompt = PROMPT[:5]
    ours = model.generate(prompt, max_new_tokens=10, stop_at_eog=False).token_ids
    theirs: list[int] = []
    with torch.no_grad():  # greedy by hand: HF's generate would suppress <eos> under min_new_tokens
        for _ in range(10):
            logits = hf(input_ids=torch.tensor([prompt + theirs])).logits[0, -1]
            theirs.append(int(torch.argmax(logits)))
    assert list(ours) == theirs


def _hf_without(part: str) -> Any:
    overrides: dict[str, Any] = {
        "sliding_window": {"layer_types": ["full_attention"] * 4},
        "yarn": {"rope_parameters": {"rope_type": "default", "rope_theta": YARN["rope_theta"]}},
    }.get(part, {})
    hf = tiny_gptoss(**overrides)
    with torch.no_grad():
        for layer in hf.model.layers:
            if part == "sinks":
                layer.self_attn.sinks.fill_(-1e4)  # a sink of weight e^−10000: none
            elif part == "router_bias":
                layer.mlp.router.bias.zero_()
            elif part == "expert_biases":
                layer.mlp.experts.gate_up_proj_bias.zero_()
                layer.mlp.experts.down_proj_bias.zero_()
            elif part == "attention_biases":
                for projection in ("q_proj", "k_proj", "v_proj", "o_proj"):
                    getattr(layer.self_attn, projection).bias.zero_()
            elif part == "clamp":
                layer.mlp.experts.limit = 1e9
            elif part == "alpha":
                layer.mlp.experts.alpha = 1.0
    return hf


# gpt-oss's parts switched off on the transformers side (same weights), and the boundary an engine
# without the part first goes wrong at
WITHOUT = {"sinks": "after_attention", "sliding_window": "after_attention", "yarn": "after_attention",
           "attention_biases": "after_attention", "router_bias": "after_mlp", "expert_biases": "after_mlp",
           "clamp": "after_mlp", "alpha": "after_mlp"}


@pytest.mark.parametrize("part", list(WITHOUT))
def test_each_part_shows(part: str, tmp_path: Path) -> None:
    """The comparison above would catch an engine without each part: transformers without it differs
    from ember (which has it) by far more than the tolerance."""
    hf = _hf_without(part)
    path = write_gptoss_gguf(tiny_gptoss(), tmp_path / "tiny.gguf")
    load_file_weights_into_hf(hf, path)
    model = ember.load_model(path)
    worst = compare_with_transformers(model, hf, PROMPT, 2)
    assert worst[WITHOUT[part]] > 100 * TOLERANCE, (part, worst)


def test_the_pattern_stage_leaves_the_sink_s_share_out(pair: tuple[Any, Any]) -> None:
    """The pattern stage holds the probabilities over the real keys: each row sums to 1 − the sink's
    share, exp(sink) / (Σ exp(scores) + exp(sink)), from the queries and keys the stages show."""
    from ember.experiments import Experiment

    model, _ = pair

    class Patterns(Experiment):
        name = "patterns"

        def __init__(self) -> None:
            self.seen: dict[tuple[str, int], np.ndarray] = {}

        def begin(self, stage: str, ctx: Any, tensor: Any) -> None:
            if ctx.execution.phase.value == "prefill":
                self.seen[(stage, ctx.layer_index)] = tensor.values().copy()

        def attention_queries(self, ctx: Any, queries: Any) -> None:
            self.begin("q", ctx, queries)

        def attention_keys(self, ctx: Any, keys: Any) -> None:
            self.begin("k", ctx, keys)

        def attention_pattern(self, ctx: Any, pattern: Any) -> None:
            self.begin("p", ctx, pattern)

    c = model.config
    watcher = Patterns()
    plain = model.generate(PROMPT, max_new_tokens=3, stop_at_eog=False).token_ids
    watched = model.generate(PROMPT, max_new_tokens=3, stop_at_eog=False, experiments=[watcher]).token_ids
    assert list(plain) == list(watched)  # watching changes nothing
    T, group = len(PROMPT), c.head_count // c.head_count_kv
    for layer, weights in enumerate(model._forward.weights.layers):
        q = watcher.seen[("q", layer)].reshape(T, c.head_count, c.head_dim).astype(np.float64)
        k = watcher.seen[("k", layer)].reshape(T, c.head_count_kv, c.head_dim).astype(np.float64)
        pattern = watcher.seen[("p", layer)].reshape(c.head_count, T, -1)
        distance = np.arange(T)[:, None] - np.arange(T)[None, :]
        visible = (distance >= 0) & ((distance < c.sliding_window) if c.sliding_layers[layer] else True)
        for h in range(c.head_count):
            scores = q[:, h] @ k[:, h // group].T * c.attention_scale
            exp = np.where(visible, np.exp(scores), 0.0)
            sink = np.exp(float(weights.sinks[h]))
            share = sink / (exp.sum(axis=1) + sink)
            np.testing.assert_allclose(pattern[h].sum(axis=1), 1.0 - share, rtol=1e-5, atol=1e-6)
            np.testing.assert_allclose(pattern[h][:, :T], exp / (exp.sum(axis=1) + sink)[:, None],
                                       rtol=1e-4, atol=1e-6)
        assert (pattern.sum(axis=-1) < 1 - 1e-4).all()  # the sinks took a share of every row


# --------------------------------------------------------------------------- the config reader


@pytest.mark.parametrize(("change", "named"), [
    ({"drop_key": "attention.sliding_window"}, "'gpt-oss.attention.sliding_window'"),
    ({"keys": {"attention.sliding_window": 0}}, "'gpt-oss.attention.sliding_window' is 0"),
    ({"drop_key": "expert_feed_forward_length"}, "'gpt-oss.expert_feed_forward_length'"),
    ({"keys": {"expert_used_count": 9}}, "'gpt-oss.expert_used_count' is 9"),
    ({"keys": {"rope.scaling.type": "longrope", "rope.scaling.factor": 4.0}}, "'gpt-oss.rope.scaling.type'"),
    ({"drop_tensor": "blk.1.attn_sinks.weight"}, "blk.1.attn_sinks.weight"),
    ({"drop_tensor": "blk.0.ffn_down_exps.bias"}, "blk.0.ffn_down_exps.bias"),
], ids=["no_window", "window_0", "no_expert_width", "used_above_count", "rope_scaling", "no_sinks",
        "no_expert_bias"])
def test_bad_metadata_or_tensors_end_in_one_line_naming_the_key(change: dict, named: str,
                                                                tmp_path: Path) -> None:
    path = write_gptoss_gguf(tiny_gptoss(), tmp_path / "bad.gguf", **change)
    with pytest.raises(GGUFError) as error:
        ember.load_model(path)
    message = str(error.value)
    assert named in message and "\n" not in message, message


# --------------------------------------------------------------------------- the router stage


def test_the_router_stage_shows_the_biased_logits_and_a_ban_equals_transformers_without_the_expert(
        tmp_path: Path) -> None:
    """The `router` stage holds transformers' router logits (bias included); −inf written there for one
    expert gives what transformers computes with that expert's logit at −inf (never among the top k)."""
    from ember.experiments import Experiment

    banned = 3

    class Router(Experiment):
        name = "router"

        def __init__(self, ban: bool) -> None:
            self.ban = ban
            self.logits: list[np.ndarray] = []

        def router(self, ctx: Any, logits: Any) -> None:
            if ctx.execution.phase.value == "prefill":
                self.logits.append(logits.values().copy())
            if self.ban:
                logits.values_mut()[:, banned] = -np.inf

    hf = tiny_gptoss()
    path = write_gptoss_gguf(hf, tmp_path / "tiny.gguf")
    load_file_weights_into_hf(hf, path)
    model = ember.load_model(path)
    theirs: list[np.ndarray] = []
    handles = [layer.mlp.router.register_forward_hook(
        lambda module, args, output: theirs.append(output[0].detach().numpy().copy()))
        for layer in hf.model.layers]
    with torch.no_grad():
        hf(input_ids=torch.tensor([PROMPT]))
    for handle in handles:
        handle.remove()
    watcher = Router(ban=False)
    model.generate(PROMPT, max_new_tokens=1, experiments=[watcher])
    assert len(watcher.logits) == len(theirs) == model.config.layer_count
    for ours, reference in zip(watcher.logits, theirs, strict=True):
        assert np.abs(ours - reference).max() <= TOLERANCE * np.abs(reference).max()
    assert any((np.argsort(-logits, axis=1)[:, :TOP_K] == banned).any() for logits in theirs)

    with torch.no_grad():
        for layer in hf.model.layers:
            layer.mlp.router.bias[banned] = -float("inf")
    recorder = BoundaryRecorder()
    generation = model.generate(PROMPT, max_new_tokens=3, temperature=0.0, add_bos=False, stop_at_eog=False,
                                experiments=[Router(ban=True), recorder])
    sequence = PROMPT + list(generation.token_ids)
    for evaluation in recorder.evaluations:
        count = evaluation.before_layer[0].shape[0]
        evaluation.token_ids = sequence[evaluation.start_position:evaluation.start_position + count]
    reference = capture(hf, PROMPT, list(generation.token_ids)[:2])
    worst = compare_evaluations(recorder.evaluations, reference)
    assert all(w.relative <= TOLERANCE for w in worst.values()), worst


# --------------------------------------------------------------------------- the attention routes


def _sink_attention(q, keys, values, scale, sinks, window):
    """Float64, one row at a time (row t at position t over keys 0…t, the window's only): the
    probabilities over the keys [heads, T, L] and the heads' outputs [T, heads·hd]."""
    T, heads, hd = q.shape
    group = heads // keys.shape[0]
    probabilities = np.zeros((heads, T, keys.shape[1]))
    for t in range(T):
        seen = [p for p in range(t + 1) if not (window and t - p >= window)]
        for h in range(heads):
            scores = keys[h // group, seen].astype(np.float64) @ q[t, h] * scale
            top = max(scores.max(), float(sinks[h]))
            weights = np.exp(scores - top)
            probabilities[h, t, seen] = weights / (weights.sum() + np.exp(float(sinks[h]) - top))
    out = np.einsum("htl,hld->thd", probabilities, np.repeat(values, group, axis=0).astype(np.float64))
    return probabilities, out.reshape(T, -1)


@pytest.mark.parametrize("window", [0, 3])
def test_every_attention_route_gives_the_sinks_their_share(window: int, monkeypatch: Any) -> None:
    """Several rows, one row in NumPy and in numba (`ember.ops.attention`), a batch's rows in NumPy and in
    numba (`ember.rows`), and the pattern the hooks see: each the float64 softmax with the sink logits."""
    from reference.compare import relative_error

    from ember import ops
    from ember.quant import jit_unavailable
    from ember.rows import form_pattern, ragged_attention_numpy

    rng = np.random.default_rng(window)
    T, heads, kv, hd, scale = 9, 4, 2, 8, 0.35
    q = rng.standard_normal((T, heads, hd)).astype(np.float32)
    keys = rng.standard_normal((kv, T, hd)).astype(np.float32)
    values = rng.standard_normal((kv, T, hd)).astype(np.float32)
    sinks = np.array([-1.0, 0.5, 2.0, 4.0], np.float32)
    probabilities, expected = _sink_attention(q, keys, values, scale, sinks, window)
    assert relative_error(_sink_attention(q, keys, values, scale, sinks - 1e4, window)[1], expected)[0] > 0.05
    positions = np.arange(T)

    def close(ours: np.ndarray, reference: np.ndarray) -> bool:
        return relative_error(ours.reshape(reference.shape), reference)[0] <= 1e-5

    several = ops.attention(q, keys, values, start_position=0, scale=scale, out=np.empty((T, heads * hd),
                            np.float32), key_positions=positions if window else None, sliding_window=window,
                            sinks=sinks)
    assert close(several, expected)
    pattern = np.zeros((heads, T, T), np.float32)
    form_pattern(q, keys, positions, positions, scale, window, pattern, sinks=sinks)
    assert close(pattern.reshape(heads * T, T), probabilities.reshape(heads * T, T))

    def last_row() -> np.ndarray:
        return ops.attention(q[-1:], keys, values, start_position=T - 1, scale=scale,
                             out=np.empty((1, heads * hd), np.float32),
                             score_buffer=np.empty(heads * T, np.float32),
                             row_scratch=np.empty((kv, heads // kv, 1), np.float32),
                             spread_buffer=np.empty(heads * T, np.float32), key_positions=positions,
                             sliding_window=window, sinks=sinks)

    # the batch's route: one sequence of all T rows, nothing saved before it
    layout = (np.array([0, T]), np.zeros(1, np.int64), np.zeros(1, np.int64), np.zeros(1, np.int64),
              np.ones(1, np.int64), np.zeros(T, np.int64), positions)
    k_rows, v_rows = keys.transpose(1, 0, 2).copy(), values.transpose(1, 0, 2).copy()
    empty = np.zeros((1, kv, 0, hd), np.float32)
    ragged = np.empty((T, heads, hd), np.float32)
    ragged_attention_numpy(q, k_rows, v_rows, empty, empty, *layout, scale, window, ragged, sinks=sinks)
    assert close(ragged, expected)

    monkeypatch.setattr(ops, "_token_ops", None)
    assert close(last_row(), expected[-1:])
    if jit_unavailable() is None:
        from ember.quant import token_ops

        monkeypatch.setattr(ops, "_token_ops", token_ops)
        assert close(last_row(), expected[-1:])
        ragged[...] = np.nan
        token_ops.ragged_attention(q, k_rows, v_rows, empty, empty, *layout, np.float32(scale), window, 0.0,
                                   sinks, 0, T, ragged)
        assert close(ragged, expected)


def test_a_gpt_oss_20b_shaped_file_reads_as_llama_cpp_reads_it(tmp_path: Path) -> None:
    """gpt-oss-20b's metadata (no tensors): 24 layers, 64 query heads over 8 KV heads of 64, a window of
    128 on the even layers, YaRN 32 over 4096, 32 experts of width 2880, 4 used. The memory estimate
    keeps the full layers' keys and values for every position, the sliding ones' for 128."""
    from ember.families import FAMILIES
    from ember.memory import estimate_memory

    writer = gguf.GGUFWriter(tmp_path / "20b.gguf", "gpt-oss")
    for key, value in {"context_length": 131072, "embedding_length": 2880, "block_count": 24,
                       "feed_forward_length": 2880, "expert_feed_forward_length": 2880, "expert_count": 32,
                       "expert_used_count": 4, "attention.head_count": 64, "attention.head_count_kv": 8,
                       "attention.key_length": 64, "attention.value_length": 64,
                       "attention.sliding_window": 128, "rope.scaling.original_context_length": 4096}.items():
        writer.add_uint32(f"gpt-oss.{key}", value)
    for key, value in {"attention.layer_norm_rms_epsilon": 1e-5, "rope.freq_base": 150000.0,
                       "rope.scaling.factor": 32.0}.items():
        writer.add_float32(f"gpt-oss.{key}", value)
    writer.add_string("gpt-oss.rope.scaling.type", "yarn")
    writer.add_token_list(["<|endoftext|>", "a", "b"])
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    file = GGUFFile.open(tmp_path / "20b.gguf")
    config = build_config(file)
    assert config.sliding_layers == (True, False) * 12 and config.sliding_window == 128
    assert config.attention_scale == pytest.approx(1 / 8) and config.feed_forward_length == 2880
    assert (config.rope_scaling.kind, config.rope_scaling.factor) == ("yarn", 32.0)
    assert config.rope_scaling.original_context_length == 4096
    estimate = estimate_memory(file, config, FAMILIES["gpt-oss"].cache_specs(config), 8192, "quantized")
    per_position = 2 * 8 * 64 * 4  # one layer's float32 keys and values at one position
    assert estimate.kv_bytes_per_token == 12 * per_position
    assert estimate.kv_cache == 12 * per_position * (8192 + 128)
