"""The stages inside attention (queries, keys, values, pattern, per-head outputs) against transformers
float32 with eager attention, on every family: tiny Qwen3, Qwen2, OLMo 2, Granite, SmolLM3 and Gemma 4
(random weights, GQA, QK-norm, biases, multipliers, no-rope layers, sliding windows, shared KV), real
SmolLM2 (llama: permuted Q/K rows) and Gemma 3 270M. Compared per evaluation (a prefill, then decode
steps) and layer: HF's eager attention function's query, key (the evaluated rows'), value and
probabilities, and its output projection's input. Relative error of a tensor = max |ember − hf| /
max |hf|; every one must be ≤ 1e-4. Then what writing each stage means.
"""

from __future__ import annotations

import sys
from contextlib import contextmanager

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from ember.experiments.context import ExecutionPhase  # noqa: E402
from ember.families import FAMILIES  # noqa: E402
from ember.gguf_file import GGUFFile  # noqa: E402
from ember.inspection import BoundaryRecorder  # noqa: E402
from ember.stages import BY_NAME, STAGES  # noqa: E402
from ember.weights import WeightStore  # noqa: E402

pytestmark = pytest.mark.reference

TOLERANCE = 1e-4
INSIDE = tuple(s.name for s in STAGES[STAGES.index(BY_NAME["attention_queries"]):
                                      STAGES.index(BY_NAME["attention_heads"]) + 1])


# -- ember ------------------------------------------------------------------------------------------

def load_forward(path, context: int = 64):
    gguf = GGUFFile.open(path)
    family = FAMILIES[gguf.architecture]
    config = family.build_config(gguf)
    return family.build_forward(config, WeightStore(gguf), context), config


class Adapter:
    """A hooks adapter around the recorder that may also change a stage (`change(stage, layer, array)`)."""

    def __init__(self, inner, change=None) -> None:
        self.inner, self.change = inner, change
        self.listening = inner.listening

    def begin_evaluation(self, *args) -> None:
        self.inner.begin_evaluation(*args)
        self.listening = self.inner.listening

    def __getattr__(self, name):
        method = getattr(self.inner, name)
        if name not in BY_NAME or BY_NAME[name].scope.value != "layer":
            return method

        def stage(layer, array):
            assert array.dtype == np.float32 and array.ndim == 2 and array.flags.c_contiguous, name
            if self.change is not None:
                self.change(name, layer, array)
            method(layer, array)
        return stage


def run_ember(path, prompt, decode, stages=INSIDE + ("after_attention",), change=None, context=64):
    """Records of `stages` per evaluation: {(stage, layer): array}, and each evaluation's logits."""
    forward, _ = load_forward(path, context)
    recorder = BoundaryRecorder(stages=[*stages, "after_logits"])
    hooks = Adapter(recorder, change)
    cache = forward.new_cache(context)
    forward.forward(np.array(prompt), 0, cache, forward.new_workspace(len(prompt), context), hooks,
                    ExecutionPhase.PREFILL)
    workspace = forward.new_workspace(1, context)
    for step, token in enumerate(decode):
        forward.forward(np.array([token]), len(prompt) + step, cache, workspace, hooks, ExecutionPhase.DECODE)
    evaluations = [{} for _ in range(1 + len(decode))]
    for record in recorder.records:
        evaluations[record.evaluation][(record.stage, record.layer)] = record.array
    return evaluations


# -- transformers -----------------------------------------------------------------------------------

@contextmanager
def hf_attention(model):
    """Records, per forward call, {(stage, layer): array} from HF's eager attention function (query,
    key and value as it reads them, its probabilities) and the output projection's input."""
    module = sys.modules[type(model.model.layers[0].self_attn).__module__]
    original = module.eager_attention_forward
    calls: list[dict] = []

    def eager(attention, query, key, value, *args, **kwargs):
        output, weights = original(attention, query, key, value, *args, **kwargs)
        i, T = attention.layer_idx, query.shape[2]
        rows = {"attention_queries": query[0], "attention_keys": key[0, :, -T:],
                "attention_values": value[0, :, -T:]}
        for stage, tensor in rows.items():
            calls[-1][(stage, i)] = tensor.transpose(0, 1).reshape(T, -1).numpy().copy()
        calls[-1][("attention_pattern", i)] = weights[0].numpy().copy()
        return output, weights

    def heads_of(i):
        def hook(projection, args):
            calls[-1][("attention_heads", i)] = args[0][0].numpy().copy()
        return hook

    handles = [layer.self_attn.o_proj.register_forward_pre_hook(heads_of(i))
               for i, layer in enumerate(model.model.layers)]
    module.eager_attention_forward = eager
    try:
        yield calls
    finally:
        module.eager_attention_forward = original
        for handle in handles:
            handle.remove()


def run_hf(model, prompt, decode):
    from reference.hf_capture import _cache_kwarg
    from transformers import DynamicCache

    cache = DynamicCache(config=model.config)
    with hf_attention(model) as calls, torch.no_grad():
        for ids in [list(prompt)] + [[int(t)] for t in decode]:
            calls.append({})
            model(input_ids=torch.tensor([ids]), use_cache=True, **{_cache_kwarg(model): cache})
    return calls


# -- the comparison ---------------------------------------------------------------------------------

def relative_error(ours: np.ndarray, reference: np.ndarray) -> float:
    return float(np.max(np.abs(ours - reference)) / max(float(np.max(np.abs(reference))), 1e-30))


def compare(ours: list[dict], theirs: list[dict], layers: int) -> dict:
    """Worst relative error per stage; every stage of every layer and evaluation must be recorded."""
    worst: dict[str, float] = {}
    for evaluation, (mine, reference) in enumerate(zip(ours, theirs, strict=True)):
        for stage in INSIDE:
            for i in range(layers):
                value, expected = mine[(stage, i)], reference[(stage, i)]
                if stage == "attention_pattern":
                    heads, T, S = expected.shape
                    value = value.reshape(heads, T, -1)
                    # HF's sliding caches keep the last S positions; the earlier ones are outside the window
                    assert not value[:, :, :value.shape[2] - S].any(), (evaluation, i)
                    value = value[:, :, value.shape[2] - S:]
                error = relative_error(value, expected)
                worst[stage] = max(worst.get(stage, 0.0), error)
                assert error <= TOLERANCE, (stage, i, evaluation, error)
    return worst


def check_family(path, hf_model, prompt, decode, context=64):
    ours = run_ember(path, prompt, decode, context=context)
    theirs = run_hf(hf_model, prompt, decode)
    worst = compare(ours, theirs, len(hf_model.model.layers))
    print("\nworst relative error: " + ", ".join(f"{k} {v:.1e}" for k, v in worst.items()))
    return ours


# -- the families -----------------------------------------------------------------------------------

TINY_PROMPT = [2, 280, 281, 282, 283, 290, 291, 292, 293, 294]  # 10 tokens: past Gemma 4's window of 6
TINY_DECODE = [285, 286, 287, 300, 301]


@pytest.fixture(scope="module")
def tiny_qwen3(tmp_path_factory):
    from reference.gguf_writer import write_gguf
    from reference.tiny_models import tiny_qwen3

    hf = tiny_qwen3()
    return write_gguf(hf, tmp_path_factory.mktemp("qwen3") / "qwen3.gguf"), hf


@pytest.fixture(scope="module")
def tiny_gemma4(tmp_path_factory):
    from reference.gemma4_gguf import Gemma4Spec, random_state, tiny_gemma4_vocab, write_gguf
    from reference.gemma4_reference import build_hf

    spec = Gemma4Spec(vocab_size=len(tiny_gemma4_vocab().tokens))
    state = random_state(spec, seed=7)
    path = write_gguf(tmp_path_factory.mktemp("gemma4") / "gemma4.gguf", spec, state)
    return path, build_hf(spec, state), spec


QWEN3_PROMPT = [40, 71, 100, 33, 259, 120, 87, 66, 200, 5, 44, 45, 46, 47]  # its vocabulary: 271 tokens


def test_tiny_qwen3_matches_transformers(tiny_qwen3) -> None:
    path, hf = tiny_qwen3
    check_family(path, hf, QWEN3_PROMPT, [48, 49, 50])


@pytest.mark.parametrize("family", ["qwen2", "olmo2", "granite", "smollm3"])
def test_tiny_llama_variants_match_transformers(family, tmp_path) -> None:
    """q/k/v biases (qwen2); QK-norm over all heads at once (olmo2); the attention multiplier and permuted
    Q/K rows (granite); a layer without rope (smollm3, layer 3)."""
    from reference import tiny_models
    from reference.gguf_writer import write_gguf

    hf = getattr(tiny_models, f"tiny_{family}")()
    check_family(write_gguf(hf, tmp_path / f"{family}.gguf"), hf, QWEN3_PROMPT, [48, 49, 50])


def test_tiny_gemma4_matches_transformers(tiny_gemma4) -> None:
    """Its KV-sharing layers' keys and values are the source layer's, as HF's shared layers read them."""
    path, hf, spec = tiny_gemma4
    assert spec.first_shared_layer < spec.num_hidden_layers
    ours = check_family(path, hf, TINY_PROMPT, TINY_DECODE)
    for evaluation in ours:
        for i, source in zip(range(spec.first_shared_layer, spec.num_hidden_layers), (2, 2, 3), strict=True):
            for stage in ("attention_keys", "attention_values"):
                assert np.array_equal(evaluation[(stage, i)], evaluation[(stage, source)])


def test_a_shared_layer_s_written_keys_reach_that_layer_only(tiny_gemma4) -> None:
    path, _, spec = tiny_gemma4
    first = spec.first_shared_layer  # layers first, first+1 read layer 2's keys (sliding)

    def doubled(stage, i, array):
        if stage == "attention_keys" and i == first:
            array *= 2.0
    clean = run_ember(path, TINY_PROMPT, TINY_DECODE)
    changed = run_ember(path, TINY_PROMPT, TINY_DECODE, change=doubled)
    for before, after in zip(clean, changed, strict=True):
        assert np.array_equal(after[("attention_keys", 2)], before[("attention_keys", 2)])  # the source's
        assert np.array_equal(after[("attention_heads", 2)], before[("attention_heads", 2)])
        pattern = ("attention_pattern", first)
        assert relative_error(after[pattern], before[pattern]) > 1e-3
        # the next layer sharing them reads the source's keys, not the written ones
        assert np.array_equal(after[("attention_keys", first + 1)], after[("attention_keys", 2)])


def test_tiny_gemma2_matches_transformers(tmp_path) -> None:
    """The pattern after the attention-logit softcap (5, on scores of tens), before the mask; the even
    layers' window (4) shorter than the prompt."""
    from test_gemma2_tiny import PROMPT, tiny_gemma2, write_gemma2_gguf

    hf = tiny_gemma2()
    check_family(write_gemma2_gguf(hf, tmp_path / "gemma2.gguf"), hf, PROMPT, [285, 286, 287])


def test_tiny_phi3_matches_transformers(tmp_path) -> None:
    """Queries and keys split from the fused qkv, rotated over half of each head with LongRoPE's long
    factors (the prompt is past the original context of 8) and the attention factor on cos and sin."""
    from test_phi3_tiny import PROMPT, tiny_phi3, write_phi3_gguf

    hf = tiny_phi3()
    check_family(write_phi3_gguf(hf, tmp_path / "phi3.gguf"), hf, PROMPT, [285, 286, 287])


REAL_PROMPT = [1, 504, 3458, 282, 4649, 314, 2114, 28, 30, 1032, 1073, 9213, 30, 2]
REAL_DECODE = [260, 1113, 354]


def test_smollm2_matches_transformers(smollm2_path) -> None:
    from reference.hf_capture import load_hf_from_gguf

    check_family(smollm2_path, load_hf_from_gguf(smollm2_path), REAL_PROMPT, REAL_DECODE)


def test_gemma3_matches_transformers(gemma3_path) -> None:
    from test_gemma3_reference import load_hf

    # 600 tokens: past the sliding window (512) in the prefill and the decode steps
    prompt = [2] + [int(t) for t in np.random.default_rng(3).integers(300, 20000, 599)]
    check_family(gemma3_path, load_hf(gemma3_path), prompt, REAL_DECODE, context=1024)


# -- what writing means (tiny Qwen3: 4 query heads over 2 KV heads) --------------------------------

def test_writes(tiny_qwen3) -> None:
    path, _ = tiny_qwen3
    prompt, decode = QWEN3_PROMPT, [48, 49]
    clean = run_ember(path, prompt, decode)
    heads, head_dim, layer = 4, 32, 1

    # every stage written back as shown changes no bit (an unchanged pattern: the kernels' own output)
    rewritten = run_ember(path, prompt, decode, change=lambda s, i, a: a.__setitem__(..., a.copy()))
    for mine, theirs in zip(rewritten, clean, strict=True):
        for key, value in theirs.items():
            assert np.array_equal(mine[key], value), key

    # a pattern written with its own values rounded differently: the outputs are formed from it
    def nudged(stage, i, array):
        if stage == "attention_pattern" and i == layer:
            array *= np.float32(1 + 1e-6)
    formed = run_ember(path, prompt, decode, change=nudged)
    for mine, theirs in zip(formed, clean, strict=True):
        heads_output = ("attention_heads", layer)
        assert 0 < relative_error(mine[heads_output], theirs[heads_output]) <= 1e-5

    # a one-hot pattern: every head of the layer reads only position 0's value (its KV head's)
    def one_hot(stage, i, array):
        if stage == "attention_pattern" and i == layer:
            array[...] = 0.0
            array[:, 0] = 1.0
    hot = run_ember(path, prompt, decode, change=one_hot)
    first_values = clean[0][("attention_values", layer)][0].reshape(2, head_dim)
    for evaluation in hot:
        expected = np.repeat(first_values, heads // 2, axis=0).reshape(-1)
        assert np.allclose(evaluation[("attention_heads", layer)], expected, atol=1e-6)

    # zero queries: every head's pattern is uniform over the keys its row sees
    def no_queries(stage, i, array):
        if stage == "attention_queries" and i == layer:
            array[...] = 0.0
    uniform = run_ember(path, prompt, decode, change=no_queries)
    T = len(prompt)
    pattern = uniform[0][("attention_pattern", layer)].reshape(heads, T, T)
    assert np.allclose(pattern, np.tril(np.ones((T, T))) / np.arange(1, T + 1)[:, None], atol=1e-6)

    # zeroing one head's output: the attention output loses exactly that head's share, and the head
    # written in a decode step shows in the keys and values the later steps read
    def no_head(stage, i, array):
        if stage == "attention_heads" and i == layer:
            array[:, head_dim:2 * head_dim] = 0.0
    ablated = run_ember(path, prompt, decode, change=no_head)
    assert not ablated[0][("attention_heads", layer)][:, head_dim:2 * head_dim].any()
    assert relative_error(ablated[0][("after_attention", layer)], clean[0][("after_attention", layer)]) > 1e-3
    assert np.array_equal(ablated[0][("after_attention", 0)], clean[0][("after_attention", 0)])

    # written keys are what attention reads, and what the cache keeps for the later steps
    def doubled_keys(stage, i, array):
        if stage == "attention_keys" and i == layer:
            array *= 2.0
    doubled = run_ember(path, prompt, decode, change=doubled_keys)
    keys = ("attention_keys", layer)
    assert relative_error(doubled[0][keys], 2 * clean[0][keys]) < 1e-6
    assert relative_error(doubled[-1][("attention_pattern", layer)],
                          clean[-1][("attention_pattern", layer)]) > 1e-3


# -- a batch (ember.rows.BatchRows) ------------------------------------------------------------------

@pytest.mark.parametrize("which", ["smollm2", "gemma4"])
def test_a_batch_shows_each_sequence_s_stages(which, request) -> None:
    """Three sequences of different lengths, one reusing the first's saved positions, one joining at a
    late layer (Gemma 4: a KV-sharing layer, its keys all the saved run's): each one's rows of the
    batch's stages (`Record.sequence_rows`; a pattern's columns: its own positions) equal its own
    evaluation's."""
    import ember
    from ember.rows import BatchEntry

    if which == "smollm2":
        model, first, reuse, extra, late = request.getfixturevalue("smollm2"), REAL_PROMPT, 9, [4649, 314], 20
    else:
        path, _, spec = request.getfixturevalue("tiny_gemma4")
        model = ember.load_model(path, context_length=64)
        first, reuse, extra, late = TINY_PROMPT, 6, [300, 301], spec.first_shared_layer + 1
    saved = model.evaluate_batch([BatchEntry(np.array(first), save=True)]).saved[0]
    second = first[:reuse] + extra
    recorder = BoundaryRecorder(stages=INSIDE)
    entries = [BatchEntry(np.array(first)), BatchEntry(np.array(second), start=reuse, prefix=saved),
               BatchEntry(np.array(first), first_layer=late, prefix=saved)]
    model.evaluate_batch(entries, observer=recorder)
    heads = model.config.head_count
    for index, (ids, start, first_layer) in enumerate([(first, 0, 0), (second, reuse, 0), (first, 0, late)]):
        alone = BoundaryRecorder(stages=INSIDE)
        model.evaluate(list(ids), add_bos=False, observer=alone)
        expected = {(r.stage, r.layer): r.array for r in alone.records}
        compared = 0
        for record in recorder.records:
            rows = record.sequence_rows(index)
            if record.layer < first_layer:
                assert rows is None
                continue
            reference = expected[(record.stage, record.layer)]
            if record.stage == "attention_pattern":  # rows of every head from the sequence's start
                reference = reference.reshape(heads, len(ids), -1)[:, start:].reshape(-1, len(ids))
            else:
                reference = reference[start:]
            error = relative_error(rows, reference)
            assert error <= 1e-5, (index, record.stage, record.layer, error)
            compared += 1
        assert compared == len(INSIDE) * (model.config.layer_count - first_layer)
