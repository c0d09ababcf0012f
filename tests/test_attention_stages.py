"""The stages inside attention (queries, keys, values, per-head outputs) against transformers
float32 with eager attention, on every family: tiny Qwen3 and Gemma 4 (random weights, GQA, QK-norm,
sliding windows, shared KV), real SmolLM2 (llama: permuted Q/K rows) and Gemma 3 270M. Compared per
evaluation (a prefill, then decode steps) and layer: HF's eager attention function's query, key (the
evaluated rows') and value, and its output projection's input. Relative error of a tensor =
max |ember − hf| / max |hf|; every one must be ≤ 1e-4.
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


def compare(ours: list[dict], theirs: list[dict], layers: int, shared: tuple[int, ...] = ()) -> dict:
    """Worst relative error per stage; every stage of every layer and evaluation must be recorded
    (keys and values not on a layer reading another's: `shared`)."""
    worst: dict[str, float] = {}
    for evaluation, (mine, reference) in enumerate(zip(ours, theirs, strict=True)):
        for stage in INSIDE:
            for i in range(layers):
                if stage in ("attention_keys", "attention_values") and i in shared:
                    assert (stage, i) not in mine
                    continue
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


def check_family(path, hf_model, prompt, decode, shared=(), context=64):
    ours = run_ember(path, prompt, decode, context=context)
    theirs = run_hf(hf_model, prompt, decode)
    worst = compare(ours, theirs, len(hf_model.model.layers), shared)
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


def test_tiny_gemma4_matches_transformers(tiny_gemma4) -> None:
    path, hf, spec = tiny_gemma4
    shared = tuple(range(spec.first_shared_layer, spec.num_hidden_layers))
    assert shared  # the shared layers' queries, pattern and heads are compared
    check_family(path, hf, TINY_PROMPT, TINY_DECODE, shared)


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

