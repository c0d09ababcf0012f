"""GGUFFile: parsing, dequantization and validation, on small files written with gguf.GGUFWriter."""

from __future__ import annotations

import hashlib
import struct
from pathlib import Path

import gguf
import numpy as np
import pytest
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, GGUFValueType

from ember.errors import GGUFError
from ember.gguf_file import GGUFFile, TensorInfo, dequantize_raw

Q = GGMLQuantizationType
RNG = np.random.default_rng(1234)

# Types gguf-py can quantize (round trip) and types it can only dequantize (fed random valid bytes).
ROUND_TRIP_TYPES = [Q.Q4_0, Q.Q4_1, Q.Q5_0, Q.Q5_1, Q.Q8_0, Q.BF16]
DEQUANT_ONLY_TYPES = [
    Q.Q2_K, Q.Q3_K, Q.Q4_K, Q.Q5_K, Q.Q6_K,
    Q.IQ1_S, Q.IQ1_M, Q.IQ2_XXS, Q.IQ2_XS, Q.IQ2_S, Q.IQ3_XXS, Q.IQ3_S, Q.IQ4_NL, Q.IQ4_XS,
    Q.TQ1_0, Q.TQ2_0, Q.MXFP4,
]  # fmt: skip
# Worst-case absolute error of a round trip for values of magnitude <= ~4 (normal data, fixed seed).
ROUND_TRIP_ATOL = {Q.Q4_0: 0.6, Q.Q4_1: 0.35, Q.Q5_0: 0.3, Q.Q5_1: 0.2, Q.Q8_0: 0.03, Q.BF16: 0.02}


def write_gguf(path: Path, tensors: dict[str, np.ndarray | tuple[np.ndarray, Q]], **kv) -> Path:
    """Write a GGUF file; a tensor given as (uint8 bytes, type) is stored raw with that type."""
    writer = gguf.GGUFWriter(str(path), "llama")
    for key, (value, vtype) in kv.items():
        writer.add_key_value(key.replace("__", "."), value, vtype)
    for name, tensor in tensors.items():
        if isinstance(tensor, tuple):
            writer.add_tensor(name, tensor[0], raw_dtype=tensor[1])
        else:
            writer.add_tensor(name, tensor)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def random_valid_bytes(qtype: Q, rows: int, blocks_per_row: int) -> np.ndarray:
    # Bytes below 0x3C keep every fp16/fp8 scale field finite and small.
    _, type_size = GGML_QUANT_SIZES[qtype]
    return RNG.integers(0, 0x3C, size=(rows, blocks_per_row * type_size), dtype=np.uint8)


@pytest.fixture(scope="module")
def small(tmp_path_factory) -> tuple[Path, dict[str, np.ndarray]]:
    """A file with one tensor per supported type, plus the float32 originals of the round-trip ones."""
    originals: dict[str, np.ndarray] = {}
    tensors: dict[str, np.ndarray | tuple[np.ndarray, Q]] = {}
    tensors["f32"] = originals["f32"] = RNG.standard_normal((5, 64)).astype(np.float32)
    f16 = RNG.standard_normal((3, 32)).astype(np.float16)
    tensors["f16"] = f16
    originals["f16"] = f16.astype(np.float32)
    tensors["vec"] = originals["vec"] = RNG.standard_normal(48).astype(np.float32)
    tensors["cube"] = originals["cube"] = RNG.standard_normal((2, 3, 32)).astype(np.float32)
    tensors["i32"] = np.arange(12, dtype=np.int32).reshape(3, 4)
    for qtype in ROUND_TRIP_TYPES:
        block = GGML_QUANT_SIZES[qtype][0]
        x = RNG.standard_normal((7, 4 * max(block, 32))).astype(np.float32)
        originals[qtype.name] = x
        tensors[qtype.name] = (gguf.quants.quantize(x, qtype), qtype)
    for qtype in DEQUANT_ONLY_TYPES:
        tensors[qtype.name] = (random_valid_bytes(qtype, 6, 2), qtype)
    x = RNG.standard_normal((2, 4, 64)).astype(np.float32)
    originals["q8_cube"] = x
    tensors["q8_cube"] = (gguf.quants.quantize(x, Q.Q8_0), Q.Q8_0)
    path = write_gguf(tmp_path_factory.mktemp("gguf") / "small.gguf", tensors)
    return path, originals


def test_tensor_index_shapes_types_and_offsets(small):
    path, _ = small
    f = GGUFFile.open(path)
    reader = gguf.GGUFReader(path)
    assert f.version == 3
    assert len(f.tensors) == len(reader.tensors)
    for t in reader.tensors:
        info = f.tensor(t.name)
        assert isinstance(info, TensorInfo)
        assert info.shape == tuple(int(d) for d in reversed(t.shape))
        assert info.ggml_type == t.tensor_type
        assert info.offset == t.data_offset
        assert info.nbytes == t.n_bytes
    assert f.tensor("f32").shape == (5, 64)
    assert f.tensor("cube").shape == (2, 3, 32)
    assert f.tensor("Q4_K").shape == (6, 512)
    assert f.quantization_mix()["F32"] == 3  # f32, vec, cube
    assert f.quantization_mix()["Q8_0"] == 2
    assert sum(f.quantization_mix().values()) == len(f.tensors)


@pytest.mark.parametrize("name", ["f32", "f16", "vec", "cube"])
def test_unquantized_tensors_are_exact(small, name):
    path, originals = small
    f = GGUFFile.open(path)
    out = f.dequantize(name)
    assert out.dtype == np.float32
    np.testing.assert_array_equal(out, originals[name])
    assert f.raw(name).shape == originals[name].shape


def test_integer_tensor_raw_is_typed(small):
    f = GGUFFile.open(small[0])
    raw = f.raw("i32")
    assert raw.dtype == np.int32 and raw.shape == (3, 4)
    np.testing.assert_array_equal(raw, np.arange(12).reshape(3, 4))
    np.testing.assert_array_equal(f.dequantize("i32"), np.arange(12, dtype=np.float32).reshape(3, 4))


def test_raw_views_are_read_only(small):
    f = GGUFFile.open(small[0])
    with pytest.raises(ValueError):
        f.raw("f32")[0, 0] = 1.0


@pytest.mark.parametrize("qtype", ROUND_TRIP_TYPES, ids=lambda q: q.name)
def test_round_trip_types_match_gguf_and_original(small, qtype):
    path, originals = small
    f = GGUFFile.open(path)
    x = originals[qtype.name]
    out = f.dequantize(qtype.name)
    assert out.shape == x.shape and out.dtype == np.float32
    reference = gguf.quants.dequantize(gguf.quants.quantize(x, qtype), qtype)
    np.testing.assert_array_equal(out, reference)
    assert np.abs(out - x).max() <= ROUND_TRIP_ATOL[qtype]
    raw = f.raw(qtype.name)
    if qtype == Q.BF16:
        assert raw.dtype == np.uint16 and raw.shape == x.shape
    else:
        block, type_size = GGML_QUANT_SIZES[qtype]
        assert raw.dtype == np.uint8 and raw.shape == (x.shape[0], x.shape[1] // block * type_size)


@pytest.mark.parametrize("qtype", DEQUANT_ONLY_TYPES, ids=lambda q: q.name)
def test_dequant_only_types_match_gguf(small, qtype):
    f = GGUFFile.open(small[0])
    raw = np.array(f.raw(qtype.name))
    with np.errstate(all="ignore"):
        reference = gguf.quants.dequantize(raw, qtype)
    out = f.dequantize(qtype.name)
    assert out.shape == f.tensor(qtype.name).shape == reference.shape
    np.testing.assert_array_equal(out, reference)


@pytest.mark.parametrize(
    "name", ["f32", "f16", "i32", "q8_cube"] + [q.name for q in ROUND_TRIP_TYPES + DEQUANT_ONLY_TYPES]
)
def test_dequantize_rows_equals_whole_tensor_rows(small, name):
    f = GGUFFile.open(small[0])
    info = f.tensor(name)
    with np.errstate(all="ignore"):
        whole = f.dequantize(name).reshape(info.n_rows, info.row_length)
        rows = np.array([info.n_rows - 1, 0, 1, 0])
        out = f.dequantize_rows(name, rows)
    assert out.shape == (4, info.row_length) and out.dtype == np.float32
    np.testing.assert_array_equal(out, whole[rows])
    assert f.dequantize_rows(name, np.array([], dtype=np.int64)).shape == (0, info.row_length)


def test_dequantize_rows_rejects_out_of_range(small):
    f = GGUFFile.open(small[0])
    with pytest.raises(GGUFError, match=r"row 7 is out of range for tensor 'Q8_0' \(7 rows\)"):
        f.dequantize_rows("Q8_0", np.array([0, 7]))
    with pytest.raises(GGUFError, match="out of range"):
        f.dequantize_rows("Q8_0", [-1])


def test_missing_tensor_and_key_name_them_and_the_file(small):
    path, _ = small
    f = GGUFFile.open(path)
    with pytest.raises(GGUFError, match=r"tensor 'nope\.weight' is missing") as e:
        f.dequantize("nope.weight")
    assert str(path) in str(e.value)
    with pytest.raises(GGUFError, match=r"required metadata key 'llama\.block_count' is missing") as e:
        f.require("llama.block_count")
    assert str(path) in str(e.value)
    assert f.get("llama.block_count", 7) == 7
    assert f.architecture == "llama"


def test_sha256_is_the_file_hash_and_cached(small):
    path, _ = small
    f = GGUFFile.open(path)
    assert f.sha256() == hashlib.sha256(path.read_bytes()).hexdigest()
    assert f.sha256() is f.sha256()


# ---------------------------------------------------------------------- fast paths


@pytest.mark.parametrize("qtype", [Q.Q8_0, Q.Q4_1], ids=lambda q: q.name)
def test_fast_dequant_equals_gguf_exactly(qtype):
    # More blocks than one chunk of the fast path, and a final partial chunk.
    x = (RNG.standard_normal((70_007, 32)) * RNG.uniform(0.01, 10, (70_007, 1))).astype(np.float32)
    raw = gguf.quants.quantize(x, qtype)
    info = TensorInfo("t", x.shape, qtype, 0, raw.nbytes)
    np.testing.assert_array_equal(dequantize_raw(raw, info), gguf.quants.dequantize(raw, qtype))
    raw3 = raw.reshape(7, 10_001, -1)
    info3 = TensorInfo("t", (7, 10_001, 32), qtype, 0, raw.nbytes)
    assert dequantize_raw(raw3, info3).shape == (7, 10_001, 32)


# ---------------------------------------------------------------------- metadata


def test_metadata_of_every_value_type(tmp_path):
    V = GGUFValueType
    kv = {
        "t__u8": (200, V.UINT8),
        "t__i8": (-100, V.INT8),
        "t__u16": (60000, V.UINT16),
        "t__i16": (-30000, V.INT16),
        "t__u32": (4_000_000_000, V.UINT32),
        "t__i32": (-2_000_000_000, V.INT32),
        "t__u64": (2**63 + 5, V.UINT64),
        "t__i64": (-(2**62), V.INT64),
        "t__f32": (0.1, V.FLOAT32),
        "t__f64": (0.1, V.FLOAT64),
        "t__bool_t": (True, V.BOOL),
        "t__bool_f": (False, V.BOOL),
        "t__str": ("héllo ✓ <|im_end|>", V.STRING),
        "t__empty_str": ("", V.STRING),
        "t__strs": (["a", "", "Ġt", "日本", "\n"], V.ARRAY),
        "t__ints": ([1, -2, 3], V.ARRAY),
        "t__floats": ([0.5, -1.25], V.ARRAY),
        "t__bools": ([True, False, True], V.ARRAY),
    }
    path = write_gguf(tmp_path / "meta.gguf", {"x": np.zeros(4, np.float32)}, **kv)
    f = GGUFFile.open(path)
    m = f.metadata
    assert m["t.u8"] == 200 and m["t.i8"] == -100 and m["t.u16"] == 60000 and m["t.i16"] == -30000
    assert m["t.u32"] == 4_000_000_000 and m["t.i32"] == -2_000_000_000
    assert m["t.u64"] == 2**63 + 5 and m["t.i64"] == -(2**62)
    assert m["t.f32"] == float(np.float32(0.1)) and m["t.f64"] == 0.1
    assert m["t.bool_t"] is True and m["t.bool_f"] is False
    assert m["t.str"] == "héllo ✓ <|im_end|>" and m["t.empty_str"] == ""
    assert m["t.strs"] == ["a", "", "Ġt", "日本", "\n"]
    for key, dtype, values in [
        ("t.ints", np.int32, [1, -2, 3]),
        ("t.floats", np.float32, [0.5, -1.25]),
        ("t.bools", np.bool_, [True, False, True]),
    ]:
        assert isinstance(m[key], np.ndarray) and m[key].dtype == dtype and m[key].ndim == 1
        assert m[key].tolist() == values
    for key in kv:
        assert type(m[key.replace("__", ".")]) in (int, float, bool, str, list, np.ndarray)
    # Same values as gguf-py's reader.
    reader = gguf.GGUFReader(path)
    for key, field in reader.fields.items():
        if key.startswith("GGUF."):
            continue
        ours = m[key]
        assert (ours.tolist() if isinstance(ours, np.ndarray) else ours) == field.contents(), key
    with pytest.raises(TypeError):
        m["t.u8"] = 1  # type: ignore[index]


def test_numeric_array_types(tmp_path):
    writer_path = tmp_path / "arrays.gguf"
    writer = gguf.GGUFWriter(str(writer_path), "llama")
    dtypes = {
        GGUFValueType.UINT8: np.uint8, GGUFValueType.INT8: np.int8, GGUFValueType.UINT16: np.uint16,
        GGUFValueType.INT16: np.int16, GGUFValueType.UINT32: np.uint32, GGUFValueType.INT32: np.int32,
        GGUFValueType.UINT64: np.uint64, GGUFValueType.INT64: np.int64, GGUFValueType.FLOAT32: np.float32,
        GGUFValueType.FLOAT64: np.float64,
    }  # fmt: skip
    for vtype in dtypes:
        writer.add_key_value(f"a.{vtype.name}", [1, 2, 3], GGUFValueType.ARRAY, sub_type=vtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    f = GGUFFile.open(writer_path)
    for vtype, dtype in dtypes.items():
        value = f.metadata[f"a.{vtype.name}"]
        assert value.dtype == dtype and value.tolist() == [1, 2, 3]
    assert f.tensors == {}


def test_large_string_array_reads_back(tmp_path):
    # Its speed is measured in benchmarks/, not asserted here.
    tokens = [f"tok{i}" for i in range(60_000)]
    path = write_gguf(tmp_path / "vocab.gguf", {}, tokenizer__ggml__tokens=(tokens, GGUFValueType.ARRAY))
    f = GGUFFile.open(path)
    assert f.metadata["tokenizer.ggml.tokens"] == tokens


def test_custom_alignment(tmp_path):
    writer = gguf.GGUFWriter(str(tmp_path / "a.gguf"), "llama")
    writer.add_custom_alignment(64)
    x = RNG.standard_normal((3, 32)).astype(np.float32)
    writer.add_tensor("a", x[:1])
    writer.add_tensor("b", x)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    f = GGUFFile.open(tmp_path / "a.gguf")
    assert f.metadata["general.alignment"] == 64
    assert f.data_offset % 64 == 0 and (f.tensor("b").offset - f.data_offset) % 64 == 0
    np.testing.assert_array_equal(f.dequantize("b"), x)


# ---------------------------------------------------------------------- corruption


@pytest.fixture
def good_file(tmp_path) -> Path:
    x = RNG.standard_normal((4, 64)).astype(np.float32)
    return write_gguf(
        tmp_path / "good.gguf",
        {"blk.0.w": (gguf.quants.quantize(x, Q.Q8_0), Q.Q8_0), "norm": x[0]},
        tokenizer__ggml__tokens=(["a", "bb", "ccc"], GGUFValueType.ARRAY),
        llama__block_count=(1, GGUFValueType.UINT32),
    )


def patched(path: Path, offset: int, new: bytes) -> Path:
    data = bytearray(path.read_bytes())
    data[offset : offset + len(new)] = new
    out = path.with_name("patched.gguf")
    out.write_bytes(bytes(data))
    return out


def tensor_info_position(path: Path, name: str) -> int:
    """Byte position just after tensor `name`'s name string in the tensor index."""
    data = path.read_bytes()
    encoded = struct.pack("<Q", len(name)) + name.encode()
    return data.index(encoded) + len(encoded)


def expect_error(path: Path, pattern: str) -> GGUFError:
    with pytest.raises(GGUFError, match=pattern) as e:
        GGUFFile.open(path)
    assert str(path) in str(e.value)
    return e.value


def test_bad_magic(good_file):
    expect_error(patched(good_file, 0, b"GGML"), r"not a GGUF file: bad magic b'GGML'")


@pytest.mark.parametrize("version", [1, 4, 99])
def test_unsupported_version(good_file, version):
    expect_error(patched(good_file, 4, struct.pack("<I", version)), rf"unsupported GGUF version {version} ")


def test_version_2_is_read(good_file):
    f = GGUFFile.open(patched(good_file, 4, struct.pack("<I", 2)))
    assert f.version == 2 and f.metadata["llama.block_count"] == 1


def test_big_endian_is_named(good_file):
    expect_error(patched(good_file, 4, struct.pack(">I", 3)), "big-endian")


def test_truncation_anywhere_gives_a_readable_error(good_file, tmp_path):
    data = good_file.read_bytes()
    f = GGUFFile.open(good_file)
    cut_points = sorted(set(range(0, f.data_offset, 7)) | {f.data_offset - 1, len(data) - 1})
    for cut in cut_points:
        short = tmp_path / "short.gguf"
        short.write_bytes(data[:cut])
        with pytest.raises(GGUFError) as e:
            GGUFFile.open(short)
        message = str(e.value)
        assert str(short) in message
        assert any(w in message for w in ("truncated", "not a GGUF file", "past the end")), (cut, message)


def test_tensor_data_past_end_of_file(good_file):
    pos = tensor_info_position(good_file, "norm")
    offset_pos = pos + 4 + 8 * 1 + 4  # n_dims, ne[0], type, then the offset
    broken = patched(good_file, offset_pos, struct.pack("<Q", 1 << 20))
    expect_error(broken, r"tensor 'norm' data \(bytes \d+\.\.\d+\) runs past the end of the file")


def test_unknown_type_id(good_file):
    pos = tensor_info_position(good_file, "blk.0.w")
    type_pos = pos + 4 + 8 * 2
    expect_error(
        patched(good_file, type_pos, struct.pack("<I", 99)), r"unknown ggml type id 99 for tensor 'blk.0.w'"
    )


def test_misaligned_offset(good_file):
    pos = tensor_info_position(good_file, "norm")
    offset_pos = pos + 4 + 8 + 4
    current = struct.unpack_from("<Q", good_file.read_bytes(), offset_pos)[0]
    expect_error(
        patched(good_file, offset_pos, struct.pack("<Q", current + 4)), "not a multiple of the alignment"
    )


def test_absurd_counts(good_file):
    expect_error(patched(good_file, 8, struct.pack("<Q", 1 << 60)), "corrupt GGUF header")


def test_absurd_string_length(good_file):
    # The first metadata key's length field sits right after the header.
    expect_error(patched(good_file, 24, struct.pack("<Q", 1 << 40)), "truncated or corrupt")


@pytest.mark.parametrize("alignment", [0, 3, 48])
def test_bad_alignment(tmp_path, alignment):
    path = write_gguf(tmp_path / "al.gguf", {}, general__alignment=(alignment, GGUFValueType.UINT32))
    expect_error(path, rf"invalid general.alignment {alignment}")


def test_unknown_metadata_value_type(good_file):
    data = good_file.read_bytes()
    key = b"llama.block_count"
    vtype_pos = data.index(key) + len(key)
    expect_error(patched(good_file, vtype_pos, struct.pack("<I", 77)), "unknown metadata value type 77")


def test_unsupported_tensor_type_on_dequantize(tmp_path):
    path = write_gguf(tmp_path / "q8k.gguf", {"act": (random_valid_bytes(Q.Q8_K, 2, 1), Q.Q8_K)})
    f = GGUFFile.open(path)
    assert f.tensor("act").ggml_type == Q.Q8_K
    with pytest.raises(GGUFError, match=r"unsupported tensor type Q8_K for tensor 'act'"):
        f.dequantize("act")
    with pytest.raises(GGUFError, match=r"unsupported tensor type Q8_K"):
        f.dequantize_rows("act", [0])


def test_not_a_file(tmp_path):
    with pytest.raises(GGUFError, match="no such GGUF file"):
        GGUFFile.open(tmp_path / "missing.gguf")
    with pytest.raises(GGUFError, match="is a directory"):
        GGUFFile.open(tmp_path)
    empty = tmp_path / "empty.gguf"
    empty.write_bytes(b"")
    with pytest.raises(GGUFError, match="only 0 bytes"):
        GGUFFile.open(empty)


# ---------------------------------------------------------------------- the real SmolLM2 file


def test_smollm2_file_matches_gguf_reader(smollm2_path):
    f = GGUFFile.open(smollm2_path)

    assert f.architecture == "llama" and f.version == 3
    assert f.require("llama.block_count") == 30
    assert f.require("llama.embedding_length") == 576
    assert len(f.require("tokenizer.ggml.tokens")) == 49152
    assert len(f.require("tokenizer.ggml.merges")) == 48900
    assert f.require("tokenizer.ggml.token_type").dtype == np.int32
    embd = f.tensor("token_embd.weight")
    assert embd.shape == (49152, 576) and embd.ggml_type == Q.Q8_0
    assert f.tensor("blk.0.attn_q.weight").shape == (576, 576)
    assert f.tensor("blk.0.attn_k.weight").shape == (192, 576)
    assert f.tensor("blk.0.ffn_down.weight").shape == (576, 1536)
    assert f.quantization_mix() == {"Q4_1": 210, "F32": 61, "Q8_0": 1}
    assert len(f.tensors) == 272

    reader = gguf.GGUFReader(smollm2_path)
    fields = {k: v for k, v in reader.fields.items() if not k.startswith("GGUF.")}
    assert set(fields) == set(f.metadata)
    for key, field in fields.items():
        ours = f.metadata[key]
        assert (ours.tolist() if isinstance(ours, np.ndarray) else ours) == field.contents(), key
    assert [t.name for t in reader.tensors] == list(f.tensors)
    for t in reader.tensors:
        info = f.tensors[t.name]
        assert info.shape == tuple(int(d) for d in reversed(t.shape)), t.name
        assert (info.ggml_type, info.offset, info.nbytes) == (t.tensor_type, t.data_offset, t.n_bytes)
    by_name = {t.name: t for t in reader.tensors}
    for name in ["token_embd.weight", "blk.0.attn_q.weight", "blk.29.ffn_down.weight", "output_norm.weight"]:
        reference = gguf.quants.dequantize(by_name[name].data, by_name[name].tensor_type)
        np.testing.assert_array_equal(f.dequantize(name), reference)
    rows = np.array([1, 2, 49151, 100])
    np.testing.assert_array_equal(
        f.dequantize_rows("token_embd.weight", rows),
        gguf.quants.dequantize(by_name["token_embd.weight"].data[rows], Q.Q8_0),
    )
