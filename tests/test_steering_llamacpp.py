"""Control vectors between ember and llama.cpp (llama-cpp-python 0.3.36, the `bench` extra).

* A vector made in ember (mean difference of the sentiment pairs at two layers, saved as a control-vector
  GGUF) and applied by llama.cpp (`llama_set_adapter_cvec`, fed the buffer llama.cpp's loader fills from
  the file, read with gguf-py's reader)
  moves llama.cpp's next-token logits the way it moves ember's: the two changes agree (cosine ≥ 0.95 on
  each prompt, ≥ 0.98 on average;
  llama.cpp multiplies with 8-bit quantized activations, ember in float32),
  and agree better with ember applying it at the named layers than one layer later (the layer
  convention).
* A file laid out as llama.cpp's cvector-generator writes it, written with llama.cpp's gguf-py, loads in
  ember and steers ember as it steers llama.cpp (the same agreement).

The fast checks of the file format are in test_control_vectors.py.
"""

from __future__ import annotations

import ctypes

import numpy as np
import pytest

llama_cpp = pytest.importorskip("llama_cpp")

from ember.control_vectors import read_control_vector  # noqa: E402
from ember.data import load_prompt_set, parse_data_spec  # noqa: E402
from ember.experiments.steering import Steering  # noqa: E402
from ember.experiments.study import Evaluation  # noqa: E402
from ember.runs.study import evaluate_request, run_prepare  # noqa: E402
from ember.runs.study_plan import study_item  # noqa: E402

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def llm(smollm2_path):
    return llama_cpp.Llama(model_path=str(smollm2_path), n_ctx=256, n_batch=256, n_threads=1,
                           verbose=False, seed=0)


def loader_buffer(path, width: int, layer_count: int) -> np.ndarray:
    """The buffer llama.cpp's control-vector loader (common.cpp, `llama_control_vector_load_one`) fills
    from a file, read here with gguf-py's reader, not ember's: every `direction.<n>` tensor (n ≥ 1) at
    row n − 1 of a [layer_count − 1, width] buffer; other tensors are ignored."""
    import gguf

    out = np.zeros((layer_count - 1, width), np.float32)
    for tensor in gguf.GGUFReader(str(path)).tensors:
        name, _, index = tensor.name.partition(".")
        if name == "direction" and index.isdigit() and 1 <= int(index) < layer_count:
            out[int(index) - 1] += np.asarray(tensor.data, np.float32).reshape(width)
    return out


def llama_logits(llm, ids: list[int], buffer: np.ndarray | None, strength: float,
                 layer_count: int) -> np.ndarray:
    """llama.cpp's last-position logits of `ids`, with a control vector applied as its loader applies a
    file (data starting at layer 1, scaled by the strength, every layer from 1 to the last enabled)."""
    if buffer is None:
        llama_cpp.llama_set_adapter_cvec(llm.ctx, None, 0, llm.n_embd(), -1, -1)
    else:
        buffer = np.ascontiguousarray(buffer * np.float32(strength))
        pointer = buffer.ctypes.data_as(ctypes.POINTER(ctypes.c_float))
        status = llama_cpp.llama_set_adapter_cvec(llm.ctx, pointer, buffer.size, buffer.shape[1], 1,
                                                  layer_count - 1)
        assert status == 0
    llm.reset()
    llm.eval(ids)
    logits = np.ctypeslib.as_array(llm._ctx.get_logits_ith(-1), shape=(llm.n_vocab(),))
    return logits.astype(np.float64)


def ember_logits(model, steering: Steering | None, ids: list[int]) -> np.ndarray:
    if steering is None:
        return model.logits(ids)[-1].astype(np.float64)
    return evaluate_request(model, steering, Evaluation(ids)).astype(np.float64)


def cosine(a: np.ndarray, b: np.ndarray) -> float:
    return float(a @ b / (np.linalg.norm(a) * np.linalg.norm(b)))


def prompts(model) -> list[list[int]]:
    items = load_prompt_set(parse_data_spec({"path": "ember:sentiment.jsonl", "limit": 4})).items
    return [list(study_item(i, item, model.tokenizer).corrupted_ids) for i, item in enumerate(items)]


def compare(model, llm, directions: dict[int, np.ndarray], buffer: np.ndarray,
            strength: float) -> list[tuple[float, float]]:
    """(cosine of the logit changes at the named layers, the same with ember one layer later) per prompt:
    ember applying `directions`, llama.cpp the loader's `buffer` of the same file."""
    layers = model.config.layer_count
    here = Steering(vector=None, layers=sorted(directions), scale=strength)
    here.directions = dict(directions)
    later = Steering(vector=None, layers=[k + 1 for k in sorted(directions)], scale=strength)
    later.directions = {k + 1: v for k, v in directions.items()}
    out = []
    for ids in prompts(model):
        steered = llama_logits(llm, ids, buffer, strength, layers)
        theirs = steered - llama_logits(llm, ids, None, 0, layers)
        base = ember_logits(model, None, ids)
        ours = ember_logits(model, here, ids) - base
        shifted = ember_logits(model, later, ids) - base
        out.append((cosine(ours, theirs), cosine(shifted, theirs)))
    return out


def test_an_ember_vector_steers_llama_cpp_the_same_way(smollm2, llm, tmp_path):
    items = load_prompt_set(parse_data_spec({"path": "ember:sentiment.jsonl"})).items
    fit = Steering(layers=[6, 12], scale=1.0, save=str(tmp_path / "sentiment.gguf"))
    study = [study_item(i, item, smollm2.tokenizer) for i, item in enumerate(items)]
    run_prepare(smollm2, fit, study)
    directions = read_control_vector(tmp_path / "sentiment.gguf")   # ember's reading of its file
    assert sorted(directions) == [6, 12]
    config = smollm2.config
    buffer = loader_buffer(tmp_path / "sentiment.gguf", config.hidden_size, config.layer_count)
    assert np.count_nonzero(buffer.any(axis=1)) == 2                 # llama.cpp's: the same two layers
    agreement = compare(smollm2, llm, directions, buffer, strength=4.0)
    print("\n  ember vector in llama.cpp: cosine of logit changes (named layers, one later):", agreement)
    assert all(same >= 0.95 for same, _ in agreement)
    assert np.mean([same for same, _ in agreement]) >= 0.98
    assert all(same > shifted for same, shifted in agreement)


def test_a_file_in_cvector_generator_layout_steers_ember_as_llama_cpp(smollm2, llm, tmp_path):
    """A file laid out as llama.cpp's cvector-generator writes it (unit directions for blocks 1..n-1,
    `controlvector.model_hint`, `controlvector.layer_count`), written with llama.cpp's own gguf-py rather
    than ember's writer, loads in ember and steers ember as it steers llama.cpp."""
    import gguf

    rng = np.random.default_rng(0)
    layers = smollm2.config.layer_count
    writer = gguf.GGUFWriter(str(tmp_path / "generated.gguf"), "controlvector")
    writer.add_string("controlvector.model_hint", "llama")
    writer.add_int32("controlvector.layer_count", layers - 1)
    raw = rng.normal(size=(layers - 1, smollm2.config.hidden_size)).astype(np.float32)
    for i, values in enumerate(raw):
        writer.add_tensor(f"direction.{i + 1}", values / np.linalg.norm(values))
    for step in (writer.write_header_to_file, writer.write_kv_data_to_file, writer.write_tensors_to_file,
                 writer.close):
        step()
    directions = read_control_vector(tmp_path / "generated.gguf")
    assert sorted(directions) == list(range(1, layers))
    chosen = {layer: directions[layer] for layer in (8, 14)}  # two layers (--control-vector-layer-range);
    buffer = loader_buffer(tmp_path / "generated.gguf", smollm2.config.hidden_size, layers)
    buffer[[i for i in range(layers - 1) if i + 1 not in chosen]] = 0.0
    # unit directions need a strength near the residual norm to move the logits beyond quantization noise
    agreement = compare(smollm2, llm, chosen, buffer, strength=40.0)
    print("\n  generator-layout file: cosine of logit changes (named layers, one later):", agreement)
    assert all(same >= 0.95 for same, _ in agreement)
    assert np.mean([same for same, _ in agreement]) >= 0.98
    assert all(same > shifted for same, shifted in agreement)
