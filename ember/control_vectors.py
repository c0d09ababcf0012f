"""llama.cpp control-vector files: GGUF with architecture `controlvector` and one F32 tensor
`direction.<N>` of `hidden_size` values per steered layer.

The layer convention is llama.cpp's, read from its loader and graph code: `direction.N` is added to
the output of block N (0-based; the residual stream leaving the block, where ember's `after_layer`
hook sits), at every position, times the strength the user gives; N >= 1, so block 0 cannot be
steered. Several tensors for one layer add up. Metadata written: `general.architecture`,
`controlvector.model_hint` (the model's architecture) and `controlvector.layer_count` (how many
directions the file holds); the loader reads only the tensors.

(llama.cpp's own generator, cvector-generator, names the difference it measured at the output of block
i `direction.{i+1}`, so its vectors act one block later than they were measured; a file loads here
with the loader's meaning, so it steers ember as it steers llama.cpp.)
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path

import numpy as np

from ember.errors import ConfigError, GGUFError

ARCHITECTURE = "controlvector"
PREFIX = "direction."


def write_control_vector(path: str | os.PathLike[str], directions: Mapping[int, np.ndarray],
                         model_hint: str = "") -> Path:
    """Write {layer: [hidden] direction} as a llama.cpp control-vector GGUF file."""
    import gguf

    if not directions:
        raise ConfigError("a control vector needs at least one layer's direction")
    if 0 in directions:
        raise ConfigError("llama.cpp control vectors cannot steer layer 0 (direction.0 is invalid there); "
                          "choose layers from 1")
    widths = {np.asarray(v).size for v in directions.values()}
    if len(widths) != 1:
        raise ConfigError(f"control vector directions have different widths {sorted(widths)}")
    target = Path(path)
    target.parent.mkdir(parents=True, exist_ok=True)
    writer = gguf.GGUFWriter(str(target), ARCHITECTURE)
    writer.add_string(f"{ARCHITECTURE}.model_hint", model_hint)
    writer.add_int32(f"{ARCHITECTURE}.layer_count", len(directions))
    for layer in sorted(directions):
        values = np.ascontiguousarray(directions[layer], dtype=np.float32).reshape(-1)
        writer.add_tensor(f"{PREFIX}{layer}", values)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return target


def read_control_vector(path: str | os.PathLike[str]) -> dict[int, np.ndarray]:
    """{layer: direction} from a control-vector GGUF file, with llama.cpp's loader rules."""
    from ember.gguf_file import GGUFFile

    gguf_file = GGUFFile.open(path)
    arch = gguf_file.metadata.get("general.architecture")
    if arch is not None and arch != ARCHITECTURE:
        raise GGUFError(f"{path}: general.architecture is {arch!r}, not a control vector ({ARCHITECTURE!r})")
    directions: dict[int, np.ndarray] = {}
    width = None
    for name, info in gguf_file.tensors.items():
        head, _, index = name.partition(".")
        if head != "direction" or not index.isdigit():
            raise GGUFError(f"{path}: tensor {name!r} is not a direction.<layer> tensor")
        layer = int(index)
        if layer == 0:
            raise GGUFError(f"{path}: direction.0 is invalid (llama.cpp cannot steer layer 0)")
        values = np.asarray(gguf_file.raw(name))
        if values.dtype != np.float32 or len(info.shape) != 1:
            raise GGUFError(f"{path}: {name} must be a 1-D F32 tensor, got {values.dtype} {info.shape}")
        if width is not None and values.size != width:
            raise GGUFError(f"{path}: {name} has {values.size} values, other directions {width}")
        width = values.size
        directions[layer] = directions.get(layer, 0) + values.astype(np.float32)
    if not directions:
        raise GGUFError(f"{path}: no direction tensors")
    return directions


def llama_cpp_buffer(directions: Mapping[int, np.ndarray], layer_count: int) -> np.ndarray:
    """The flat buffer llama.cpp's `llama_set_adapter_cvec` takes: [layer_count - 1, hidden] from block 1."""
    width = next(iter(directions.values())).size
    out = np.zeros((layer_count - 1, width), np.float32)
    for layer, values in directions.items():
        if not 1 <= layer < layer_count:
            raise ConfigError(f"control vector layer {layer} is outside 1..{layer_count - 1}")
        out[layer - 1] = values
    return out
