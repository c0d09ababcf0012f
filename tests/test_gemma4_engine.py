"""Gemma 4 in the engine, without torch: config from metadata, errors, memory (the PLE table and the
embedding are never dequantized whole), proportional rope pairing, prefill/decode consistency across the
sliding window, the hook boundaries through `Model.generate`, the tokenizer and chat template.

Models are tiny random Gemma 4 files written the way llama.cpp's converter writes them
(tests/reference/gemma4_gguf.py); the comparison with transformers is in test_gemma4_fidelity.py.
"""

from __future__ import annotations

import dataclasses
import tracemalloc

import gguf
import numpy as np
import pytest
from gguf import GGMLQuantizationType
from reference.gemma4_gguf import Gemma4Spec, random_state, tiny_gemma4_vocab, write_gguf

import ember
from ember.config import RopeLayout
from ember.errors import GGUFError
from ember.experiments import (
    ActivationStats,
    Experiment,
    ExperimentError,
    ExperimentFailure,
    ModelFamily,
    ZeroLayerOutput,
)
from ember.experiments.adapters import DISABLED_HOOKS
from ember.experiments.context import ExecutionPhase
from ember.families import gemma4
from ember.gguf_file import GGUFFile
from ember.ops import apply_rope
from ember.stages import layer_names

VOCAB = len(tiny_gemma4_vocab().tokens)
PROMPT = [2, 280, 281, 282, 283, 290, 291, 292, 293, 294]  # longer than the window (6)
ROW_TABLES = ("token_embd.weight", "per_layer_token_embd.weight")


def tiny_file(tmp_path, name: str = "tiny.gguf", qtype=GGMLQuantizationType.F32, **changes):
    spec = Gemma4Spec(vocab_size=VOCAB, **changes)
    return spec, write_gguf(tmp_path / name, spec, random_state(spec, seed=3), qtype=qtype)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    spec, path = tiny_file(tmp_path_factory.mktemp("gemma4"))
    return spec, ember.load_model(path, context_length=64)


# --------------------------------------------------------------------------- config


def test_config_reads_the_per_layer_geometry(tmp_path) -> None:
    spec, path = tiny_file(tmp_path, attention_k_eq_v=True, num_global_key_value_heads=1)
    config = gemma4.build_config(GGUFFile.open(path))
    assert isinstance(config, gemma4.Gemma4Config) and config.family is ModelFamily.GEMMA4
    assert config.sliding == (True, False, True, False, True, True, False)
    assert config.layer_head_dims == (16, 32, 16, 32, 16, 16, 32)
    assert config.layer_kv_heads == (2, 1, 2, 1, 2, 2, 1)  # a per-layer array in the file
    assert config.layer_ffn_lengths == (96, 96, 96, 96, 192, 192, 192)  # double-wide on shared layers
    assert (config.head_dim, config.head_dim_swa, config.rope_dim, config.rope_dim_swa) == (32, 16, 32, 16)
    assert (config.rope_base, config.rope_base_swa, config.sliding_window) == (1e6, 1e4, 6)
    assert config.shared_kv_layers == 3 and config.first_shared_layer == 4
    assert config.kv_source == (0, 1, 2, 3, 2, 2, 3)  # llama.cpp: sliding → f−2, full → f−1
    assert (config.per_layer_input_dim, config.final_logit_softcap) == (32, 30.0)
    assert config.tied_embeddings and config.vocab_size == VOCAB and config.rope_layout is RopeLayout.NEOX
    weights = gemma4.load_weights(ember.weights.WeightStore(GGUFFile.open(path)), config)
    assert [layer.has_v for layer in weights.layers] == [True, False, True, False, False, False, False]
    assert [layer.k_norm is None for layer in weights.layers] == [False] * 4 + [True] * 3
    assert weights.rope_freqs.tolist() == np.array([1.0] * 4 + [1e30] * 12, np.float32).tolist()


def _rewrite(path, out, *, drop_key: str | None = None, drop_tensor: str | None = None,
             replace: dict | None = None, extra: dict | None = None):
    """Copy a GGUF file with one metadata key or tensor removed or replaced."""
    reader = gguf.GGUFReader(path)
    writer = gguf.GGUFWriter(out, "gemma4")
    for field in reader.fields.values():
        if field.name.startswith("GGUF.") or field.name == "general.architecture" or field.name == drop_key:
            continue
        value = (replace or {}).get(field.name, field.contents())
        kind = field.types[0]
        sub = field.types[-1] if kind == gguf.GGUFValueType.ARRAY else None
        writer.add_key_value(field.name, value, kind, sub_type=sub)
    for key, value in (extra or {}).items():
        writer.add_uint32(key, value)
    for tensor in reader.tensors:
        if tensor.name != drop_tensor:
            shape = tuple(reversed(tensor.shape.tolist()))
            kind = tensor.tensor_type
            writer.add_tensor(tensor.name, np.array(tensor.data), raw_shape=shape, raw_dtype=kind)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return out


def test_errors_name_what_is_wrong(tmp_path) -> None:
    spec, path = tiny_file(tmp_path)
    bad = _rewrite(path, tmp_path / "a.gguf", drop_key="gemma4.attention.sliding_window_pattern")
    with pytest.raises(GGUFError, match="sliding_window_pattern"):
        ember.load_model(bad)
    bad = _rewrite(path, tmp_path / "b.gguf", drop_tensor="rope_freqs.weight")
    with pytest.raises(GGUFError, match="rope_freqs.weight"):
        ember.load_model(bad)
    # layers f−2 / f−1 must be (sliding, full) for llama.cpp's reuse rule
    pattern = [True, False, True, True, False, True, False]
    bad = _rewrite(path, tmp_path / "c.gguf", replace={"gemma4.attention.sliding_window_pattern": pattern})
    with pytest.raises(GGUFError, match="KV-shared layer"):
        ember.load_model(bad)
    # a file that says it has experts must say how many each token takes (tests/test_gemma4_moe.py)
    bad = _rewrite(path, tmp_path / "d.gguf", extra={"gemma4.expert_count": 128})
    with pytest.raises(GGUFError, match="'gemma4.expert_used_count' is missing"):
        ember.load_model(bad)


# --------------------------------------------------------------------------- rope


def test_full_layer_rope_pairs_dims_0_63_with_256_319_for_a_512_head() -> None:
    """E2B's full layers: rope_freqs = 1 for 64 entries then 1e30 (docs/families.md §3.4)."""
    factors = np.array([1.0] * 64 + [1e30] * 192, dtype=np.float32)
    inverse = gemma4._inverse_frequencies(512, 1e6, factors)
    theta = np.float32(7.0) * inverse[None, :]
    x = np.random.default_rng(0).standard_normal((1, 2, 512)).astype(np.float32)
    rotated = x.copy()
    apply_rope(rotated, np.cos(theta), np.sin(theta), RopeLayout.NEOX, 512,
               np.zeros((1, 2, 256), np.float32), np.zeros((1, 2, 256), np.float32))
    changed = set(np.nonzero(np.any(rotated != x, axis=(0, 1)))[0].tolist())
    assert changed == set(range(64)) | set(range(256, 320))
    # and pair i is an ordinary rotation of (x[i], x[i+256]) by 7·1e6^(−2i/512)
    angle = 7.0 * 1e6 ** (-2 * 5 / 512)
    u, v = x[0, 0, 5], x[0, 0, 261]
    assert rotated[0, 0, 5] == pytest.approx(u * np.cos(angle) - v * np.sin(angle), rel=1e-5)
    assert rotated[0, 0, 261] == pytest.approx(u * np.sin(angle) + v * np.cos(angle), rel=1e-5)


# --------------------------------------------------------------------------- memory


def test_row_tables_are_never_dequantized_whole(tmp_path, monkeypatch) -> None:
    """The embedding and PLE tables are only ever asked for the evaluated tokens' rows (prefill, then
    one per decode step), never decoded whole; the tied LM head multiplies the table in its own
    encoding (quantized weights, the default) (Q8_0 file)."""
    from ember.quant.matrix import QuantizedMatrix

    whole_requests: list[str] = []
    row_requests: dict[str, list[list[int]]] = {name: [] for name in ROW_TABLES}
    whole, rows = GGUFFile.dequantize, QuantizedMatrix.rows

    def counting_whole(self, name):
        whole_requests.append(name)
        return whole(self, name)

    def counting_rows(self, ids, out):
        row_requests[self.name].append(list(np.asarray(ids)))
        return rows(self, ids, out)

    monkeypatch.setattr(GGUFFile, "dequantize", counting_whole)
    monkeypatch.setattr(QuantizedMatrix, "rows", counting_rows)
    spec, path = tiny_file(tmp_path, qtype=GGMLQuantizationType.Q8_0)
    model = ember.load_model(path, context_length=64)
    generation = model.generate(PROMPT, max_new_tokens=4, stop_at_eog=False)

    assert not [name for name in whole_requests if name in ROW_TABLES]
    evaluated = [PROMPT] + [[t] for t in generation.token_ids[:-1]]
    assert row_requests == {name: evaluated for name in ROW_TABLES}
    weights = model._forward.weights
    assert isinstance(weights.output, QuantizedMatrix) and weights.output is weights.token_embd


def test_float32_weights_still_read_the_ple_table_by_rows(tmp_path, monkeypatch) -> None:
    requests: list[tuple[str, int]] = []
    rows = GGUFFile.dequantize_rows

    def counting_rows(self, name, ids):
        requests.append((name, len(ids)))
        return rows(self, name, ids)

    monkeypatch.setattr(GGUFFile, "dequantize_rows", counting_rows)
    spec, path = tiny_file(tmp_path, qtype=GGMLQuantizationType.Q8_0)
    model = ember.load_model(path, context_length=64, weights="float32")
    generation = model.generate(PROMPT, max_new_tokens=3, stop_at_eog=False)
    assert [n for name, n in requests if name == "per_layer_token_embd.weight"] == [len(PROMPT), 1, 1]
    assert model._forward.store.full_dequantizations["per_layer_token_embd.weight"] == 0
    assert generation.token_ids == ember.load_model(path, context_length=64).generate(
        PROMPT, max_new_tokens=3, stop_at_eog=False).token_ids


def test_decode_never_holds_a_table_as_float32(tmp_path) -> None:
    """After warm-up a decode step's traced allocations stay far below the LM head's float32 size (the
    quantized head is multiplied in place)."""
    spec = Gemma4Spec(vocab_size=VOCAB, hidden_size=256, intermediate_size=512)
    path = write_gguf(tmp_path / "wide.gguf", spec, random_state(spec, seed=5))
    model = ember.load_model(path, context_length=32)
    forward = model._forward
    cache = forward.new_cache(32)
    workspace = forward.new_workspace(1, 32)
    forward.forward(np.array(PROMPT), 0, cache, forward.new_workspace(len(PROMPT), 32), DISABLED_HOOKS,
                    ExecutionPhase.PREFILL)
    token = np.array([290])
    forward.forward(token, len(PROMPT), cache, workspace, DISABLED_HOOKS, ExecutionPhase.DECODE)
    table_bytes = VOCAB * spec.hidden_size * 4
    tracemalloc.start()
    try:
        for position in range(len(PROMPT) + 1, len(PROMPT) + 8):
            forward.forward(token, position, cache, workspace, DISABLED_HOOKS, ExecutionPhase.DECODE)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    print(f"\ndecode peak {peak} bytes; the table as float32 {table_bytes}")
    assert peak < table_bytes / 8


# --------------------------------------------------------------------------- forward


def test_decode_matches_a_prefill_across_the_window(tiny) -> None:
    spec, model = tiny
    generation = model.generate(PROMPT, max_new_tokens=8, stop_at_eog=False)
    sequence = PROMPT + generation.token_ids
    every = model.logits(sequence)
    assert every[len(PROMPT) - 1:-1].argmax(axis=1).tolist() == generation.token_ids
    forward = model._forward
    cache = forward.new_cache(64)
    forward.forward(np.array(sequence[:-1]), 0, cache, forward.new_workspace(len(sequence) - 1, 64),
                    DISABLED_HOOKS, ExecutionPhase.PREFILL)
    decoded = forward.forward(np.array(sequence[-1:]), len(sequence) - 1, cache, forward.new_workspace(1, 64),
                              DISABLED_HOOKS, ExecutionPhase.DECODE)
    assert np.abs(decoded[0] - every[-1]).max() <= 1e-5 * np.abs(every[-1]).max()


def test_softcap_bounds_the_logits(tmp_path) -> None:
    spec, path = tiny_file(tmp_path, "cap.gguf", final_logit_softcapping=2.0)
    capped = ember.load_model(path).logits(PROMPT)
    spec, path = tiny_file(tmp_path, "nocap.gguf", final_logit_softcapping=None)
    raw = ember.load_model(path).logits(PROMPT)
    assert np.abs(capped).max() <= 2.0 < np.abs(raw).max()
    np.testing.assert_allclose(capped, 2.0 * np.tanh(raw / 2.0), rtol=1e-5, atol=1e-6)


# --------------------------------------------------------------------------- hooks


class Recording(Experiment):
    """Keeps (hook, phase, layer, copy) of every tensor hook call."""

    name = "recording"

    def __init__(self) -> None:
        self.calls: list[tuple[str, ExecutionPhase, int | None, np.ndarray]] = []
        self.families: set = set()

    def _keep(self, hook, ctx, access, layer=None):
        execution = getattr(ctx, "execution", ctx)
        self.families.add(execution.model.family)
        self.calls.append((hook, execution.phase, layer, access.values().copy()))

    def before_layer(self, ctx, hidden):
        self._keep("before_layer", ctx, hidden, ctx.layer_index)

    def after_attention(self, ctx, value):
        self._keep("after_attention", ctx, value, ctx.layer_index)

    def after_mlp(self, ctx, value):
        self._keep("after_mlp", ctx, value, ctx.layer_index)

    def after_layer(self, ctx, hidden):
        self._keep("after_layer", ctx, hidden, ctx.layer_index)

    def before_logits(self, ctx, hidden):
        self._keep("before_logits", ctx, hidden)

    def after_logits(self, ctx, logits):
        self._keep("after_logits", ctx, logits)


def _rms_normalised(values: np.ndarray, weight: np.ndarray) -> np.ndarray:
    """RMS of values / weight per row: 1 when `values` is an RMSNorm output with that weight."""
    unweighted = values / weight
    return np.sqrt(np.mean(unweighted.astype(np.float64) ** 2, axis=-1))


def test_hook_order_shapes_and_family(tiny) -> None:
    spec, model = tiny
    recording = Recording()
    generation = model.generate(PROMPT, max_new_tokens=3, stop_at_eog=False, experiments=[recording])
    L, H, V = spec.num_hidden_layers, spec.hidden_size, VOCAB
    per_evaluation = [(h, i) for i in range(L) for h in ("before_layer", "after_attention", "after_mlp",
                                                           "after_layer")]
    per_evaluation += [("before_logits", None), ("after_logits", None)]
    evaluations = 1 + len(generation.token_ids) - 1
    assert [(h, i) for h, _, i, _ in recording.calls] == per_evaluation * evaluations
    phases = [p for _, p, _, _ in recording.calls]
    assert phases[:len(per_evaluation)] == [ExecutionPhase.PREFILL] * len(per_evaluation)
    assert set(phases[len(per_evaluation):]) == {ExecutionPhase.DECODE}
    for hook, phase, _, value in recording.calls:
        rows = len(PROMPT) if phase is ExecutionPhase.PREFILL and hook.endswith(("layer", "attention",
                                                                               "mlp")) else 1
        assert value.shape == (rows, V if hook == "after_logits" else H)
    assert recording.families == {ModelFamily.GEMMA4}


def test_hook_boundaries_are_gemma4s(tiny) -> None:
    """after_attention / after_mlp come after the post norms; after_layer after the residual adds, PLE
    and the layer scalar; before_logits after the final norm; after_logits after the softcap."""
    spec, model = tiny
    recording = Recording()
    model.generate(PROMPT, max_new_tokens=2, stop_at_eog=False, experiments=[recording])
    weights = model._forward.weights
    prefill = {}
    for hook, phase, layer, value in recording.calls:
        if phase is ExecutionPhase.PREFILL:
            prefill[(hook, layer)] = value
    for i, layer in enumerate(weights.layers):
        attention = prefill[("after_attention", i)]
        mlp = prefill[("after_mlp", i)]
        # unit RMS up to eps (1e-6) against the small pre-norm mean squares of a random model
        np.testing.assert_allclose(_rms_normalised(attention, layer.post_attention_norm), 1.0, rtol=2e-3)
        np.testing.assert_allclose(_rms_normalised(mlp, layer.post_ffw_norm), 1.0, rtol=2e-3)
        # what is left of after_layer / scalar after both residual adds is the PLE term: RMSNorm(·, post_norm)
        unscaled = prefill[("after_layer", i)] / layer.output_scale
        ple_term = unscaled - prefill[("before_layer", i)] - attention - mlp
        np.testing.assert_allclose(_rms_normalised(ple_term, layer.ple_post_norm), 1.0, rtol=2e-3)
        if i + 1 < spec.num_hidden_layers:
            np.testing.assert_array_equal(prefill[("before_layer", i + 1)], prefill[("after_layer", i)])
    assert {round(layer.output_scale, 6) for layer in weights.layers} != {1.0}  # the scalars are exercised
    hidden = prefill[("before_logits", None)]
    np.testing.assert_allclose(_rms_normalised(hidden, weights.output_norm), 1.0, rtol=1e-4)
    embedding = model.gguf.dequantize("token_embd.weight")
    expected = 30.0 * np.tanh(hidden @ embedding.T / 30.0)
    np.testing.assert_allclose(prefill[("after_logits", None)], expected, rtol=1e-4, atol=1e-5)


class Overwrite(Experiment):
    """Writes a constant into one boundary of one layer, in the chosen phase."""

    name = "overwrite"

    def __init__(self, hook: str, layer: int | None, phase: ExecutionPhase, value: float = 0.0) -> None:
        self.hook, self.layer, self.phase, self.value = hook, layer, phase, value
        setattr(self, hook, self._write)

    def _write(self, ctx, access):
        execution = getattr(ctx, "execution", ctx)
        if execution.phase is self.phase and getattr(ctx, "layer_index", None) == self.layer:
            access.values_mut()[...] = self.value


def test_writes_change_everything_downstream(tiny) -> None:
    spec, model = tiny
    clean = model.logits(PROMPT)[-1]

    changed = Recording()
    model.generate(PROMPT, max_new_tokens=1, stop_at_eog=False,
                   experiments=[Overwrite("after_attention", 1, ExecutionPhase.PREFILL), changed])
    logits = [v for h, p, _, v in changed.calls if h == "after_logits"][0][0]
    assert np.abs(logits - clean).max() > 1e-3

    # zeroing both blocks of a layer: the residual passes through, plus the PLE term, times the scalar
    recording = Recording()
    model.generate(PROMPT, max_new_tokens=1, stop_at_eog=False,
                   experiments=[ZeroLayerOutput(layer=2, target="both", phases="prefill"), recording])
    values = {(h, i): v for h, p, i, v in recording.calls if p is ExecutionPhase.PREFILL}
    layer = model._forward.weights.layers[2]
    ple_term = values[("after_layer", 2)] / layer.output_scale - values[("before_layer", 2)]
    np.testing.assert_allclose(_rms_normalised(ple_term, layer.ple_post_norm), 1.0, rtol=2e-3)

    # a prefill write reaches decode through the KV cache: the first decode step's attention output of
    # layer 1 (a full layer that owns its KV) changes although the decode evaluation itself is untouched
    plain = Recording()
    model.generate(PROMPT, max_new_tokens=2, stop_at_eog=False, experiments=[plain])
    touched = Recording()
    model.generate(PROMPT, max_new_tokens=2, stop_at_eog=False,
                   experiments=[Overwrite("after_layer", 0, ExecutionPhase.PREFILL, 0.5), touched])
    def first_decode_attention(recording):
        return next(v for h, p, i, v in recording.calls
                    if p is ExecutionPhase.DECODE and h == "after_attention" and i == 1)

    assert plain.calls[-1][3].shape == touched.calls[-1][3].shape
    assert np.abs(first_decode_attention(plain) - first_decode_attention(touched)).max() > 1e-4


# --------------------------------------------------------------------------- tokenizer


def test_gemma4_tokenizer_and_chat_template_from_the_file(tiny) -> None:
    spec, model = tiny
    tokenizer = model.tokenizer
    ids = tokenizer.encode(" the cat")
    assert ids[0] == 2  # BOS forced for gemma4
    assert tokenizer.token_text(ids[1]) == "\u2581the"  # spaces escaped to ▁, merges applied
    assert tokenizer.decode(ids[1:]) == " the cat"
    prompt = tokenizer.apply_chat_template([{"role": "user", "content": "hi"}])
    assert prompt == "<bos><|turn>user\nhi<turn|>\n<|turn>model\n"
    encoded = tokenizer.encode(prompt, add_bos=False, parse_special=True)
    assert encoded[:2] == [2, 5] and 6 in encoded
    assert 1 in tokenizer.eog_ids
    assert dataclasses.is_dataclass(model.config)


class FailAt(Experiment):
    name = "failing"

    def after_mlp(self, ctx, value):
        if ctx.execution.phase is ExecutionPhase.DECODE and ctx.layer_index == 5:
            raise ExperimentError("expected a finite activation")


def test_a_failing_hook_stops_generation(tiny) -> None:
    spec, model = tiny
    with pytest.raises(ExperimentFailure) as caught:
        model.generate(PROMPT, max_new_tokens=4, stop_at_eog=False, experiments=[FailAt()])
    assert str(caught.value) == ("experiment 'failing' failed in after_mlp (phase=decode, layer=5): "
                                 "expected a finite activation")
    generation = caught.value.generation
    assert not generation.complete and len(generation.token_ids) == 1


def test_observation_is_bit_identical(tiny, monkeypatch) -> None:
    spec, model = tiny

    def run(experiments) -> tuple[list[int], list[bytes]]:
        captured = []
        forward = model._forward.forward

        def capturing(*args, **kwargs):
            logits = forward(*args, **kwargs)
            captured.append(logits.tobytes())
            return logits

        monkeypatch.setattr(model._forward, "forward", capturing)
        try:
            generation = model.generate(PROMPT, max_new_tokens=5, stop_at_eog=False, temperature=0.8, seed=3,
                                        experiments=experiments)
        finally:
            monkeypatch.undo()
        return generation.token_ids, captured

    plain = run([])
    stats = ActivationStats()
    observed = run([stats, Recording()])
    assert observed == plain and len(plain[1]) == 5
    rows = stats.rows()
    assert len(rows) == 2 * (len(layer_names(ModelFamily.GEMMA4)) * spec.num_hidden_layers + 2)
    assert all(r["nonfinite"] == 0 for r in rows)
