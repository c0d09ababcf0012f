"""llama.cpp control-vector files: written and read by ember, with llama.cpp's loader rules."""

from __future__ import annotations

import gguf
import numpy as np
import pytest

from ember.control_vectors import llama_cpp_buffer, read_control_vector, write_control_vector
from ember.errors import ConfigError, GGUFError
from ember.experiments.steering import Steering, load_directions


def test_round_trip_and_metadata(tmp_path):
    directions = {3: np.arange(8, dtype=np.float32), 7: -np.ones(8, np.float32)}
    path = write_control_vector(tmp_path / "v.gguf", directions, model_hint="llama")
    back = read_control_vector(path)
    assert sorted(back) == [3, 7]
    for layer in directions:
        np.testing.assert_array_equal(back[layer], directions[layer])
    reader = gguf.GGUFReader(str(path))   # llama.cpp's own reader sees the layout its loader expects
    fields = {name: field for name, field in reader.fields.items()}
    assert bytes(fields["general.architecture"].parts[-1]).decode() == "controlvector"
    assert bytes(fields["controlvector.model_hint"].parts[-1]).decode() == "llama"
    assert int(fields["controlvector.layer_count"].parts[-1][0]) == 2
    assert sorted(t.name for t in reader.tensors) == ["direction.3", "direction.7"]
    assert all(t.tensor_type == gguf.GGMLQuantizationType.F32 and len(t.shape) == 1 for t in reader.tensors)


def test_llama_cpp_buffer_starts_at_layer_one():
    buffer = llama_cpp_buffer({1: np.full(4, 1.0), 3: np.full(4, 3.0)}, layer_count=5)
    assert buffer.shape == (4, 4)
    np.testing.assert_array_equal(buffer[:, 0], [1.0, 0.0, 3.0, 0.0])


def test_loader_rules(tmp_path):
    with pytest.raises(ConfigError, match="cannot steer layer 0"):
        write_control_vector(tmp_path / "zero.gguf", {0: np.ones(4)})
    writer = gguf.GGUFWriter(str(tmp_path / "bad.gguf"), "controlvector")
    writer.add_tensor("direction.0", np.ones(4, np.float32))
    for step in (writer.write_header_to_file, writer.write_kv_data_to_file, writer.write_tensors_to_file,
                 writer.close):
        step()
    with pytest.raises(GGUFError, match="direction.0 is invalid"):
        read_control_vector(tmp_path / "bad.gguf")
    writer = gguf.GGUFWriter(str(tmp_path / "twice.gguf"), "llama")
    writer.add_tensor("token_embd.weight", np.ones((2, 4), np.float32))
    for step in (writer.write_header_to_file, writer.write_kv_data_to_file, writer.write_tensors_to_file,
                 writer.close):
        step()
    with pytest.raises(GGUFError, match="not a control vector"):
        read_control_vector(tmp_path / "twice.gguf")


def test_steering_reads_files_and_npy(tmp_path):
    write_control_vector(tmp_path / "v.gguf", {2: np.ones(6, np.float32), 5: np.zeros(6, np.float32)})
    assert Steering(vector=str(tmp_path / "v.gguf")).layers == (2, 5)
    assert Steering(vector=str(tmp_path / "v.gguf"), layers=[5]).layers == (5,)
    with pytest.raises(ConfigError, match="no direction for layers"):
        Steering(vector=str(tmp_path / "v.gguf"), layers=[3])
    np.save(tmp_path / "one.npy", np.ones(6, np.float32))
    assert set(load_directions(str(tmp_path / "one.npy"), [1, 4])) == {1, 4}
    with pytest.raises(ConfigError, match="say which layers"):
        Steering(vector=str(tmp_path / "one.npy"))
    with pytest.raises(ConfigError, match="give `layers`"):
        Steering()
