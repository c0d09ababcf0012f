"""WeightStore: matrices kept in the file's encoding (quantized) or dequantized (float32), vectors, rows."""

from __future__ import annotations

from pathlib import Path

import gguf
import numpy as np
import pytest
from gguf import GGMLQuantizationType as Q

from ember.errors import GGUFError
from ember.gguf_file import GGUFFile
from ember.ops import gather_rows, linear
from ember.paths import ember_cache_dir
from ember.quant.matrix import QuantizedMatrix, StackedMatrix
from ember.weights import FileRows, WeightStore

RNG = np.random.default_rng(7)


@pytest.fixture
def model_file(tmp_path) -> Path:
    writer = gguf.GGUFWriter(str(tmp_path / "tiny.gguf"), "llama")
    writer.add_block_count(1)
    tensors = {
        "token_embd.weight": (RNG.standard_normal((100, 64)), Q.Q8_0),
        "blk.0.attn_q.weight": (RNG.standard_normal((64, 64)), Q.Q4_1),
        "blk.0.attn_k.weight": (RNG.standard_normal((32, 64)), Q.Q4_1),
        "blk.0.attn_v.weight": (RNG.standard_normal((32, 64)), Q.Q8_0),
        "blk.0.ffn_down.weight": (RNG.standard_normal((64, 128)), Q.Q5_0),
        "blk.0.ffn_gate.weight": (RNG.standard_normal((128, 64)), Q.Q2_K),
    }
    for name, (x, qtype) in tensors.items():
        if qtype == Q.Q2_K:  # gguf-py cannot quantize K-quants: random blocks with small scales
            blocks = RNG.integers(0, 256, size=(x.shape[0], x.shape[1] // 256 or 1, 84), dtype=np.uint8)
            blocks[..., 80:84] = np.frombuffer(np.array([0.01, 0.01], np.float16).tobytes(), np.uint8)
            data = blocks.reshape(x.shape[0], -1)
            writer.add_tensor(name, data, raw_dtype=qtype)
            continue
        writer.add_tensor(name, gguf.quants.quantize(x.astype(np.float32), qtype), raw_dtype=qtype)
    writer.add_tensor("blk.0.attn_norm.weight", RNG.standard_normal(64).astype(np.float32))
    writer.add_tensor("blk.0.attn_output.weight", RNG.standard_normal((64, 64)).astype(np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return tmp_path / "tiny.gguf"


def test_quantized_matrices_stay_in_the_file_encoding_and_multiply_like_float32(model_file):
    f = GGUFFile.open(model_file)
    store = WeightStore(f)
    w = store.matrix("blk.0.attn_q.weight")
    assert isinstance(w, QuantizedMatrix) and w.shape == (64, 64)
    assert np.shares_memory(w.data, f.raw("blk.0.attn_q.weight"))  # a view of the mapped file, no copy
    assert not w.data.flags.writeable
    np.testing.assert_array_equal(w.dequantize(), f.dequantize("blk.0.attn_q.weight"))
    for tokens in (1, 3):
        x = RNG.standard_normal((tokens, 64)).astype(np.float32)
        expected = x @ f.dequantize("blk.0.attn_q.weight").T
        np.testing.assert_allclose(linear(x, w, np.zeros((tokens, 64), np.float32)), expected,
                                   rtol=0, atol=1e-5 * np.abs(expected).max())
    assert store.full_dequantizations.total() == 0


def test_f32_matrices_are_views_of_the_file(model_file):
    f = GGUFFile.open(model_file)
    w = WeightStore(f).matrix("blk.0.attn_output.weight")
    assert isinstance(w, np.ndarray) and w.dtype == np.float32
    assert np.shares_memory(w, f.raw("blk.0.attn_output.weight"))


def test_float32_mode_dequantizes_at_load(model_file):
    f = GGUFFile.open(model_file)
    store = WeightStore(f, "float32")
    a = store.matrix("blk.0.attn_q.weight")
    assert type(a) is np.ndarray and a.dtype == np.float32 and not a.flags.writeable
    np.testing.assert_array_equal(a, f.dequantize("blk.0.attn_q.weight"))
    assert store.full_dequantizations["blk.0.attn_q.weight"] == 1
    with pytest.raises(ValueError, match="weights must be one of quantized, float32, quantized-q8"):
        WeightStore(f, "float16")


def test_stacked_parts_of_different_types(model_file):
    f = GGUFFile.open(model_file)
    names = ["blk.0.attn_q.weight", "blk.0.attn_k.weight", "blk.0.attn_v.weight"]
    expected_weight = np.concatenate([f.dequantize(n) for n in names])
    quantized = WeightStore(f).stacked(names)
    assert isinstance(quantized, StackedMatrix) and quantized.shape == (128, 64)
    assert [type(p) for p in quantized.parts] == [QuantizedMatrix] * 3
    dequantized = WeightStore(f, "float32").stacked(names)
    np.testing.assert_array_equal(dequantized, expected_weight)
    for tokens in (1, 5):
        x = RNG.standard_normal((tokens, 64)).astype(np.float32)
        expected = x @ expected_weight.T
        got = linear(x, quantized, np.zeros((len(x), 128), np.float32))
        np.testing.assert_allclose(got, expected, rtol=0, atol=1e-5 * np.abs(expected).max())
    with pytest.raises(GGUFError, match="cannot stack tensors of shapes"):
        WeightStore(f).stacked(["blk.0.attn_q.weight", "blk.0.ffn_down.weight"])


def test_unsupported_block_type_names_the_type_and_the_way_out(model_file):
    f = GGUFFile.open(model_file)
    with pytest.raises(GGUFError, match=r"tensor 'blk.0.ffn_gate.weight' has block type Q2_K, which ember's "
                                        r"kernels do not multiply .*weights='float32'"):
        WeightStore(f).matrix("blk.0.ffn_gate.weight")
    values = WeightStore(f, "float32").matrix("blk.0.ffn_gate.weight")  # gguf-py dequantizes it
    np.testing.assert_array_equal(values, f.dequantize("blk.0.ffn_gate.weight"))


def test_tables_decode_only_the_requested_rows(model_file):
    f = GGUFFile.open(model_file)
    ids = np.array([3, 99, 0, 3])
    expected = f.dequantize("token_embd.weight")[ids]
    for mode in ("quantized", "float32"):
        store = WeightStore(f, mode)
        table = store.table("token_embd.weight")
        out = gather_rows(table, ids, np.zeros((4, 64), np.float32))
        np.testing.assert_array_equal(out, expected)
        assert store.full_dequantizations.total() == 0
    assert isinstance(WeightStore(f, "float32").table("token_embd.weight"), FileRows)


def test_vector(model_file):
    f = GGUFFile.open(model_file)
    store = WeightStore(f)
    v = store.vector("blk.0.attn_norm.weight")
    assert v.shape == (64,) and v.dtype == np.float32
    np.testing.assert_array_equal(v, f.raw("blk.0.attn_norm.weight"))
    with pytest.raises(
        GGUFError, match=r"tensor 'token_embd.weight' has shape \(100, 64\), expected a vector"
    ):
        store.vector("token_embd.weight")


def test_has_and_missing(model_file):
    store = WeightStore(GGUFFile.open(model_file))
    assert store.has("token_embd.weight") and not store.has("output.weight")
    with pytest.raises(GGUFError, match=r"tensor 'output.weight' is missing"):
        store.matrix("output.weight")


def test_xdg_cache_home_is_honoured(tmp_path, monkeypatch):
    monkeypatch.delenv("EMBER_CACHE", raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert ember_cache_dir() == tmp_path / "xdg" / "ember"
    monkeypatch.delenv("XDG_CACHE_HOME")
    assert ember_cache_dir() == Path.home() / ".cache" / "ember"


def test_the_old_float32_cache_is_removed_at_load(model_file, tmp_path, monkeypatch, capsys):
    from ember.weights import remove_old_weight_cache

    monkeypatch.setenv("EMBER_CACHE", str(tmp_path / "cache"))
    old = tmp_path / "cache" / "weights" / "SmolLM2-0123456789abcdef"
    old.mkdir(parents=True)
    (old / "blk.0.attn_q.weight.npy").write_bytes(b"\0" * (3 << 20))
    remove_old_weight_cache()
    assert not (tmp_path / "cache" / "weights").exists()
    assert "removed the float32 weight cache of ember 0.1 (3 MiB" in capsys.readouterr().err
    remove_old_weight_cache()  # nothing left: silent
    assert capsys.readouterr().err == ""
