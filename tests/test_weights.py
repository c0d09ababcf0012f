"""WeightStore: dequantized matrices cached as read-only .npy memory maps, vectors, per-row reads."""

from __future__ import annotations

import os
import shutil
import sys
import time
from pathlib import Path

import gguf
import numpy as np
import pytest
from gguf import GGMLQuantizationType as Q

from ember.errors import GGUFError
from ember.gguf_file import GGUFFile
from ember.sources import ember_cache_dir
from ember.weights import WeightStore, file_fingerprint

RNG = np.random.default_rng(7)


@pytest.fixture
def model_file(tmp_path) -> Path:
    writer = gguf.GGUFWriter(str(tmp_path / "tiny.gguf"), "llama")
    writer.add_block_count(1)
    tensors = {
        "token_embd.weight": (RNG.standard_normal((100, 64)), Q.Q8_0),
        "blk.0.attn_q.weight": (RNG.standard_normal((64, 64)), Q.Q4_1),
        "blk.0.ffn_down.weight": (RNG.standard_normal((64, 128)), Q.Q5_0),
    }
    for name, (x, qtype) in tensors.items():
        writer.add_tensor(name, gguf.quants.quantize(x.astype(np.float32), qtype), raw_dtype=qtype)
    writer.add_tensor("blk.0.attn_norm.weight", RNG.standard_normal(64).astype(np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return tmp_path / "tiny.gguf"


def cache_files(root: Path) -> list[Path]:
    return sorted(p for p in root.rglob("*") if p.is_file())


def test_matrix_is_cached_as_read_only_memmap(model_file, tmp_path):
    f = GGUFFile.open(model_file)
    cache = tmp_path / "cache"
    store = WeightStore(f, cache)
    a = store.matrix("blk.0.attn_q.weight")
    np.testing.assert_array_equal(a, f.dequantize("blk.0.attn_q.weight"))
    assert isinstance(a, np.memmap) and a.dtype == np.float32 and a.shape == (64, 64)
    assert not a.flags.writeable
    expected = cache / "weights" / file_fingerprint(f) / "blk.0.attn_q.weight.npy"
    assert expected.is_file()
    assert store.full_dequantizations["blk.0.attn_q.weight"] == 1

    again = WeightStore(GGUFFile.open(model_file), cache)
    b = again.matrix("blk.0.attn_q.weight")
    np.testing.assert_array_equal(a, b)
    assert again.full_dequantizations.total() == 0 and again.cache_hits["blk.0.attn_q.weight"] == 1
    assert [p.name for p in cache_files(cache)] == ["blk.0.attn_q.weight.npy"]  # no temporaries left


def test_cache_off(model_file, tmp_path, monkeypatch):
    monkeypatch.setenv("EMBER_CACHE", str(tmp_path / "env-cache"))
    store = WeightStore(GGUFFile.open(model_file), cache_dir=False)
    a = store.matrix("blk.0.ffn_down.weight")
    assert type(a) is np.ndarray and a.shape == (64, 128)
    assert store.matrix("blk.0.ffn_down.weight") is not a
    assert store.full_dequantizations["blk.0.ffn_down.weight"] == 2
    assert not (tmp_path / "env-cache").exists()


def test_cache_root_from_environment(model_file, tmp_path, monkeypatch):
    monkeypatch.setenv("EMBER_CACHE", str(tmp_path / "env-cache"))
    store = WeightStore(GGUFFile.open(model_file))
    assert store.cache_dir is not None and store.cache_dir.parent == tmp_path / "env-cache" / "weights"
    store.matrix("blk.0.attn_q.weight")
    assert len(cache_files(tmp_path / "env-cache")) == 1


@pytest.mark.skipif(sys.platform in ("win32", "darwin"), reason="XDG applies to Linux and other Unixes")
def test_xdg_cache_home_is_honoured(tmp_path, monkeypatch):
    monkeypatch.delenv("EMBER_CACHE", raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert ember_cache_dir() == tmp_path / "xdg" / "ember"
    monkeypatch.delenv("XDG_CACHE_HOME")
    assert ember_cache_dir() == Path.home() / ".cache" / "ember"


def test_a_damaged_cache_file_is_rewritten(model_file, tmp_path):
    f = GGUFFile.open(model_file)
    cache = tmp_path / "cache"
    first = WeightStore(f, cache)
    reference = np.array(first.matrix("token_embd.weight"))
    path = first.cache_dir / "token_embd.weight.npy"
    path.write_bytes(path.read_bytes()[:1000])  # as if written by a careless, killed process
    second = WeightStore(f, cache)
    np.testing.assert_array_equal(second.matrix("token_embd.weight"), reference)
    assert second.full_dequantizations["token_embd.weight"] == 1
    assert path.stat().st_size > 1000


def test_a_failed_write_leaves_no_file(model_file, tmp_path, monkeypatch):
    f = GGUFFile.open(model_file)
    cache = tmp_path / "cache"
    real_save = np.save

    def save_then_die(file, array, **kwargs):
        real_save(file, array[: len(array) // 2], **kwargs)  # half the data reaches the disk
        raise KeyboardInterrupt

    monkeypatch.setattr(np, "save", save_then_die)
    with pytest.raises(KeyboardInterrupt):
        WeightStore(f, cache).matrix("blk.0.attn_q.weight")
    assert cache_files(cache) == []
    monkeypatch.setattr(np, "save", real_save)
    np.testing.assert_array_equal(
        WeightStore(f, cache).matrix("blk.0.attn_q.weight"), f.dequantize("blk.0.attn_q.weight")
    )


def test_stale_temporaries_are_swept(model_file, tmp_path):
    f = GGUFFile.open(model_file)
    store = WeightStore(f, tmp_path / "cache")
    store.cache_dir.mkdir(parents=True)
    stale = store.cache_dir / ".token_embd.weight.npy.abc.tmp"
    stale.write_bytes(b"half")
    old = time.time() - 3600
    os.utime(stale, (old, old))
    fresh = store.cache_dir / ".other.npy.def.tmp"  # maybe another process writing right now
    fresh.write_bytes(b"busy")
    store.matrix("token_embd.weight")
    assert not stale.exists() and fresh.exists()


def test_fingerprint_follows_the_file(model_file):
    before = file_fingerprint(GGUFFile.open(model_file))
    assert before == file_fingerprint(GGUFFile.open(model_file))
    stat = model_file.stat()
    os.utime(model_file, ns=(stat.st_atime_ns, stat.st_mtime_ns + 1_000_000_000))
    assert file_fingerprint(GGUFFile.open(model_file)) != before


def test_unwritable_cache_falls_back_with_a_warning(model_file, tmp_path):
    blocker = tmp_path / "not-a-dir"
    blocker.write_text("a file where the cache directory should be")
    store = WeightStore(GGUFFile.open(model_file), blocker)
    with pytest.warns(UserWarning, match="cannot write the weight cache"):
        a = store.matrix("blk.0.attn_q.weight")
    assert a.shape == (64, 64)
    b = store.matrix("blk.0.ffn_down.weight")  # warned once, then quietly uncached
    assert b.shape == (64, 128)


def test_concatenated_is_cached_as_one_file(model_file, tmp_path):
    f = GGUFFile.open(model_file)
    names = ["blk.0.attn_q.weight", "token_embd.weight"]
    expected = np.concatenate([f.dequantize(n) for n in names])
    cold = WeightStore(f, tmp_path / "cache")
    np.testing.assert_array_equal(cold.concatenated(names), expected)
    assert [p.name for p in cache_files(tmp_path / "cache")] == ["blk.0.attn_q.weight+token_embd.weight.npy"]
    warm = WeightStore(f, tmp_path / "cache")
    stacked = warm.concatenated(names)
    assert isinstance(stacked, np.memmap) and stacked.shape == (164, 64)
    np.testing.assert_array_equal(stacked, expected)
    assert warm.full_dequantizations.total() == 0
    np.testing.assert_array_equal(WeightStore(f, False).concatenated(names), expected)
    with pytest.raises(GGUFError, match="cannot stack tensors of shapes"):
        cold.concatenated(["blk.0.attn_q.weight", "blk.0.ffn_down.weight"])


def test_long_or_odd_names_get_safe_file_names():
    from ember.weights import _file_name

    assert _file_name("blk.0.attn_q.weight") == "blk.0.attn_q.weight.npy"
    odd = _file_name("../evil/name")
    assert "/" not in odd and not odd.startswith(".") and odd != _file_name("___evil_name")
    assert len(_file_name("x" * 1000)) < 200


def test_vector(model_file):
    f = GGUFFile.open(model_file)
    store = WeightStore(f, cache_dir=False)
    v = store.vector("blk.0.attn_norm.weight")
    assert v.shape == (64,) and v.dtype == np.float32
    np.testing.assert_array_equal(v, f.raw("blk.0.attn_norm.weight"))
    with pytest.raises(
        GGUFError, match=r"tensor 'token_embd.weight' has shape \(100, 64\), expected a vector"
    ):
        store.vector("token_embd.weight")


def test_rows_never_dequantize_the_whole_table(model_file, tmp_path):
    f = GGUFFile.open(model_file)
    store = WeightStore(f, tmp_path / "cache")
    ids = np.array([3, 99, 0, 3])
    out = store.rows("token_embd.weight", ids)
    assert out.shape == (4, 64) and out.dtype == np.float32
    np.testing.assert_array_equal(out, f.dequantize("token_embd.weight")[ids])
    assert store.row_requests["token_embd.weight"] == 1
    assert store.full_dequantizations.total() == 0
    assert cache_files(tmp_path / "cache") == []


def test_has_and_missing(model_file):
    store = WeightStore(GGUFFile.open(model_file), cache_dir=False)
    assert store.has("token_embd.weight") and not store.has("output.weight")
    with pytest.raises(GGUFError, match=r"tensor 'output.weight' is missing"):
        store.matrix("output.weight")


def test_smollm2_warm_load_reads_the_cache_only(smollm2_path, tmp_path):
    # Cold/warm seconds are measured by benchmarks/bench.py; here only what the warm load does.
    f = GGUFFile.open(smollm2_path)
    names = [n for n, info in f.tensors.items() if len(info.shape) == 2]
    cache = tmp_path / "cache"
    try:
        cold = WeightStore(f, cache)
        cold_arrays = [cold.matrix(n) for n in names]
        warm = WeightStore(GGUFFile.open(smollm2_path), cache)
        warm_arrays = [warm.matrix(n) for n in names]
        assert warm.full_dequantizations.total() == 0 and warm.cache_hits.total() == len(names) == 211
        for i in (0, 1, len(names) - 1):
            np.testing.assert_array_equal(cold_arrays[i], warm_arrays[i])
        np.testing.assert_array_equal(warm.matrix("blk.3.ffn_up.weight"), f.dequantize("blk.3.ffn_up.weight"))
    finally:
        shutil.rmtree(cache, ignore_errors=True)


def test_in_memory_weights_equal_the_mapped_ones_and_are_read_only(model_file, tmp_path):
    mapped = WeightStore(GGUFFile.open(model_file), tmp_path / "cache")
    names = [n for n, info in mapped.gguf.tensors.items() if len(info.shape) == 2]
    expected = {n: np.array(mapped.matrix(n)) for n in names}  # fills the cache
    resident = WeightStore(GGUFFile.open(model_file), tmp_path / "cache", in_memory=True)
    for name in names:
        array = resident.matrix(name)
        assert not isinstance(array, np.memmap) and not array.flags.writeable
        np.testing.assert_array_equal(array, expected[name])
    assert resident.cache_hits.total() == len(names) and resident.full_dequantizations.total() == 0
