"""Mixture-of-experts files in llama.cpp's Q4_K_M mix (benchmarks/synthetic.py, reduced shapes):
each expert of a 3-D tensor read from its own blocks, bit-identical to gguf-py's dequantization, in every
type the real files use (Q4_K, Q6_K; Gemma 4's 704-wide experts fall back to Q5_0 and Q8_0); the memory
estimate and fit check count the expert weights as mapped, not resident (the real Qwen3-30B-A3B plan:
an 18.6 GB file whose resident part fits a few GiB)."""

from __future__ import annotations

import dataclasses
from types import SimpleNamespace

import gguf
import numpy as np
import pytest
from gguf import GGMLQuantizationType as Q

import ember
from benchmarks import synthetic
from benchmarks.synthetic import SHAPES, tensor_plan, write_synthetic
from ember.families import FAMILIES, config_from_gguf
from ember.gguf_file import GGUFFile, TensorInfo
from ember.memory import GIB, LIMIT_ENV, MemoryLimitError, check_memory, estimate_memory, is_expert_tensor
from ember.quant.matrix import QuantizedMatrix
from ember.weights import WeightStore

SLIDING, FULL = synthetic.SLIDING, synthetic.FULL
REDUCED = {
    "qwen3moe": dataclasses.replace(
        SHAPES["qwen3-30b-a3b"],
        name="qwen3moe-reduced",
        hidden_size=256,
        layer_count=4,
        head_count=4,
        head_count_kv=2,
        head_dim=64,
        experts=16,
        experts_used=4,
        expert_ffn=256,
    ),
    # expert width 96 (the real 704) does not split into 256-blocks: Q4_K falls back to Q5_0, Q6_K to Q8_0
    "gemma4-26b": dataclasses.replace(
        SHAPES["gemma-4-26b-a4b"],
        name="gemma4-26b-reduced",
        hidden_size=256,
        layer_count=4,
        head_count=2,
        head_count_kv=1,
        head_dim=64,
        head_dim_full=128,
        head_count_kv_full=1,
        ffn=160,
        layer_types=(SLIDING, FULL, SLIDING, FULL),
        sliding_window=16,
        experts=8,
        experts_used=2,
        expert_ffn=96,
    ),
}
TYPES = {"qwen3moe": {Q.Q4_K, Q.Q6_K}, "gemma4-26b": {Q.Q4_K, Q.Q5_0, Q.Q8_0}}


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    folder = tmp_path_factory.mktemp("moe-synthetic")
    paths = {name: folder / shape.file_name(seed=3) for name, shape in REDUCED.items()}
    for name, shape in REDUCED.items():
        write_synthetic(shape, paths[name], seed=3)
    return paths


@pytest.mark.parametrize("name", sorted(REDUCED))
def test_each_expert_decodes_from_its_blocks_as_gguf_py_in_the_q4_k_m_types(name, files) -> None:
    gguf_file = GGUFFile.open(files[name])  # (gguf.GGUFReader parses the 262k-token vocabulary: minutes)
    store = WeightStore(gguf_file)
    seen = set()
    rng = np.random.default_rng(0)
    for tensor in gguf_file.tensors.values():
        if not is_expert_tensor(tensor.name, tensor.shape):
            continue
        data = gguf_file.raw(tensor.name).view(np.uint8).reshape(*tensor.shape[:2], -1)  # the file's bytes
        expected = gguf.dequantize(data, tensor.ggml_type)  # [experts, out, in]
        assert expected.shape == tensor.shape
        experts = store.experts(tensor.name)
        assert len(experts) == expected.shape[0] == REDUCED[name].experts
        for e, matrix in enumerate(experts):
            assert isinstance(matrix, QuantizedMatrix) and matrix.shape == expected.shape[1:]
            assert np.array_equal(matrix.dequantize(), expected[e]), (tensor.name, e)
        if tensor.ggml_type not in seen:  # each type's products: one row (decode) and a few
            for rows in (1, 7):
                x = rng.standard_normal((rows, expected.shape[2])).astype(np.float32)
                out = experts[-1].matmul(x, np.empty((rows, expected.shape[1]), np.float32))
                reference = x @ expected[-1].T
                assert np.abs(out - reference).max() <= 1e-5 * np.abs(reference).max(), (tensor.name, rows)
        seen.add(tensor.ggml_type)
    assert seen == TYPES[name]
    assert not store.full_dequantizations  # no expert tensor was dequantized whole


def _expert_bytes(gguf_file: GGUFFile) -> tuple[int, int]:
    """(bytes of the expert tensors, bytes of all tensors)."""
    infos = gguf_file.tensors.values()
    return sum(i.nbytes for i in infos if i.name.endswith("_exps.weight")), sum(i.nbytes for i in infos)


def test_the_estimate_counts_the_experts_as_mapped_and_the_fit_check_leaves_them_out(files, monkeypatch):
    gguf_file = GGUFFile.open(files["qwen3moe"])
    config = config_from_gguf(gguf_file)
    specs = FAMILIES[config.architecture].cache_specs(config)
    experts, everything = _expert_bytes(gguf_file)
    assert experts > 0
    estimate = estimate_memory(gguf_file, config, specs, 512, "quantized")
    assert estimate.mapped == experts and estimate.weights == everything - experts
    assert "of expert weights mapped from the file" in estimate.describe()
    check_memory(estimate, "moe", "quantized", available=estimate.total)  # fits without the mapped bytes
    with pytest.raises(MemoryLimitError, match="moe needs about .* expert weights mapped from the file"):
        check_memory(estimate, "moe", "quantized", available=estimate.total - 1)
    dense = estimate_memory(gguf_file, config, specs, 512, "float32")  # dequantized: resident
    assert dense.mapped == 0
    values = sum(int(np.prod(i.shape)) for i in gguf_file.tensors.values() if i.name.endswith("_exps.weight"))
    assert dense.weights >= 4 * values
    # the activations count the mixture's scratch: k (row, expert) pairs a row
    assert (
        estimate.activations
        > estimate_memory(
            gguf_file, dataclasses.replace(config, expert_used_count=0), specs, 512, "quantized"
        ).activations
    )

    # ember.load_model's fit check (the `ember` CLI's and the runner's): room for the resident part only
    monkeypatch.setenv(LIMIT_ENV, str(estimate.total + (1 << 20)))
    model = ember.load_model(files["qwen3moe"], context_length=512)
    assert len(model.generate("The capital", max_new_tokens=2, stop_at_eog=False).token_ids) == 2
    monkeypatch.setenv(LIMIT_ENV, str(estimate.total - (1 << 20)))
    with pytest.raises(MemoryLimitError):
        ember.load_model(files["qwen3moe"], context_length=512)


def test_the_real_qwen3_30b_a3b_file_fits_a_24_gib_machine_by_its_estimate() -> None:
    """The released Q4_K_M file's tensors (the synthetic plan of the real shape, 18.6 GB): 17 GiB of it
    are experts, mapped; what stays resident fits in a few GiB at a 4096-token context."""
    shape = SHAPES["qwen3-30b-a3b"]
    tensors = {p.name: TensorInfo(p.name, p.shape, p.qtype, 0, p.nbytes) for p in tensor_plan(shape)}
    config = SimpleNamespace(
        hidden_size=shape.hidden_size,
        feed_forward_length=shape.expert_ffn,
        head_count=shape.head_count,
        head_dim=shape.head_dim,
        vocab_size=shape.vocab_size,
        tied_embeddings=False,
        expert_count=shape.experts,
        expert_used_count=shape.experts_used,
    )
    specs = [(shape.head_count_kv, shape.head_dim, 0)] * shape.layer_count
    estimate = estimate_memory(SimpleNamespace(tensors=tensors), config, specs, 4096, "quantized")
    assert 18.5e9 < estimate.weights + estimate.mapped < 18.6e9
    assert estimate.mapped > 16 * GIB and estimate.total < 3 * GIB
    check_memory(estimate, "Qwen3-30B-A3B-Q4_K_M.gguf", "quantized", available=20 * GIB)
