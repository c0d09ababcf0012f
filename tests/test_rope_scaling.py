"""Rope scaling read from the file and YaRN's rope tables (`ember.config.read_rope_scaling`,
`ember.ops.rope_tables`), against transformers' `_compute_yarn_parameters` and llama.cpp's reading.

llama.cpp (src/llama-model.cpp, llama-context.cpp, ggml-cpu rope_yarn) and transformers agree on YaRN's
frequencies (a ramp between interpolated and extrapolated ones over the pairs between the floor/ceil
correction dims) and on its cos/sin factor when transformers' `attention_factor` is derived from `factor`
and `mscale_all_dim` (llama.cpp's `yarn_log_multiplier`, with mscale 1); docs/families.md §0.3.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import gguf
import numpy as np
import pytest

from ember.config import MetadataReader, RopeScaling, read_rope_scaling
from ember.errors import GGUFError
from ember.gguf_file import GGUFFile
from ember.ops import rope_tables, yarn_correction_range

pytestmark = pytest.mark.reference

CONTEXT = 96

# (head dim, base, transformers' rope_parameters beyond rope_theta / rope_type): small and real shapes
YARN_CASES = {
    "tiny": (16, 10000.0, {"factor": 4.0, "original_max_position_embeddings": 32}),
    "ministral3-8b": (
        128,
        1e6,
        {
            "factor": 16.0,
            "original_max_position_embeddings": 16384,
            "beta_fast": 32.0,
            "beta_slow": 1.0,
            "mscale": 1.0,
            "mscale_all_dim": 1.0,
        },
    ),
    "gpt-oss": (
        64,
        150000.0,
        {"factor": 32.0, "original_max_position_embeddings": 4096, "beta_fast": 32.0, "beta_slow": 1.0},
    ),
    "narrow-betas": (
        32,
        500.0,
        {
            "factor": 2.0,
            "original_max_position_embeddings": 64,
            "beta_fast": 8.0,
            "beta_slow": 2.0,
            "mscale": 1.0,
            "mscale_all_dim": 0.5,
        },
    ),
}


def transformers_yarn(head_dim: int, base: float, parameters: dict[str, Any]) -> tuple[np.ndarray, float]:
    torch = pytest.importorskip("torch")
    from transformers import LlamaConfig
    from transformers.modeling_rope_utils import _compute_yarn_parameters

    config = LlamaConfig(
        hidden_size=head_dim * 2,
        num_attention_heads=2,
        head_dim=head_dim,
        max_position_embeddings=4 * CONTEXT,
        rope_parameters={"rope_type": "yarn", "rope_theta": base} | parameters,
    )
    inv_freq, attention_factor = _compute_yarn_parameters(config, torch.device("cpu"))
    return inv_freq.numpy(), float(attention_factor)


def ember_scaling(parameters: dict[str, Any]) -> RopeScaling:
    """What read_rope_scaling gives for the keys llama.cpp's converter writes from `parameters`."""
    return RopeScaling(
        kind="yarn",
        factor=parameters["factor"],
        original_context_length=parameters["original_max_position_embeddings"],
        beta_fast=parameters.get("beta_fast", 32.0),
        beta_slow=parameters.get("beta_slow", 1.0),
        ext_factor=1.0,
        yarn_log_multiplier=parameters.get("mscale_all_dim", 0.0),
    )


@pytest.mark.parametrize("case", list(YARN_CASES))
def test_yarn_tables_match_transformers(case: str) -> None:
    head_dim, base, parameters = YARN_CASES[case]
    inv_freq, attention_factor = transformers_yarn(head_dim, base, parameters)
    scaling = ember_scaling(parameters)
    assert scaling.mscale == pytest.approx(attention_factor, rel=1e-6)
    cos, sin = rope_tables(head_dim, base, CONTEXT, scaling=scaling)
    theta = np.arange(CONTEXT, dtype=np.float32)[:, None] * inv_freq.astype(np.float32)[None, :]
    np.testing.assert_allclose(cos, np.cos(theta) * np.float32(attention_factor), rtol=0, atol=2e-6)
    np.testing.assert_allclose(sin, np.sin(theta) * np.float32(attention_factor), rtol=0, atol=2e-6)
    # the ramp is inside the pairs: some pairs interpolate, some extrapolate (else the case tests little)
    plain = rope_tables(head_dim, base, CONTEXT)[0]
    low, high = yarn_correction_range(head_dim, base, scaling)
    if high < head_dim // 2 - 1:
        assert not np.allclose(cos, plain * np.float32(attention_factor), atol=1e-3)


def test_the_mscale_of_yarn_is_transformers_attention_factor() -> None:
    """0.1·ln(factor) + 1 without a log multiplier (transformers' default `attention_factor`)."""
    _, attention_factor = transformers_yarn(
        16, 10000.0, {"factor": 8.0, "original_max_position_embeddings": 16}
    )
    assert attention_factor == pytest.approx(0.1 * math.log(8.0) + 1)
    assert ember_scaling({"factor": 8.0, "original_max_position_embeddings": 16}).mscale == pytest.approx(
        attention_factor, rel=1e-12
    )


def test_linear_scaling_and_none() -> None:
    linear = RopeScaling(kind="linear", factor=4.0, original_context_length=CONTEXT)
    ours = rope_tables(16, 10000.0, CONTEXT, scaling=linear)
    expected = rope_tables(16, 10000.0, CONTEXT, linear_factor=4.0)
    np.testing.assert_array_equal(ours[0], expected[0])
    none = RopeScaling(kind="none", factor=4.0, original_context_length=CONTEXT)
    np.testing.assert_array_equal(
        rope_tables(16, 10000.0, CONTEXT, scaling=none)[1], rope_tables(16, 10000.0, CONTEXT)[1]
    )


def metadata_only(path: Path, **keys: Any) -> GGUFFile:
    """A llama file of metadata only with the rope-scaling keys given ('.' written as '__')."""
    writer = gguf.GGUFWriter(path, "llama")
    writer.add_uint32("llama.context_length", 512)
    for key, value in keys.items():
        name = "llama." + key.replace("__", ".")
        if isinstance(value, str):
            writer.add_string(name, value)
        elif isinstance(value, float):
            writer.add_float32(name, value)
        else:
            writer.add_uint32(name, value)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return GGUFFile.open(path)


def read(path: Path, **keys: Any) -> RopeScaling:
    return read_rope_scaling(MetadataReader(metadata_only(path, **keys)), 512)


def test_llama_cpp_s_defaults(tmp_path: Path) -> None:
    """No keys: linear of factor 1 (nothing); yarn: ext_factor 1, betas 32 / 1, the ramp measured over the
    training context; the older `rope.scale_linear` key; factor 0 means none."""
    nothing = read(tmp_path / "a.gguf")
    assert (nothing.kind, nothing.frequency_scale, nothing.ext_factor, nothing.mscale) == (
        "linear",
        1.0,
        0.0,
        1.0,
    )
    yarn = read(tmp_path / "b.gguf", rope__scaling__type="yarn", rope__scaling__factor=4.0)
    assert (yarn.ext_factor, yarn.beta_fast, yarn.beta_slow, yarn.original_context_length) == (
        1.0,
        32.0,
        1.0,
        512,
    )
    assert yarn.frequency_scale == 0.25 and yarn.mscale == pytest.approx(1 + 0.1 * math.log(4.0), rel=1e-6)
    old = read(tmp_path / "c.gguf", rope__scale_linear=2.0)
    assert (old.kind, old.frequency_scale) == ("linear", 0.5)
    zero = read(tmp_path / "d.gguf", rope__scaling__factor=0.0)
    assert zero.frequency_scale == 1.0


def test_the_yarn_keys_are_read(tmp_path: Path) -> None:
    scaling = read(
        tmp_path / "a.gguf",
        rope__scaling__type="yarn",
        rope__scaling__factor=16.0,
        rope__scaling__original_context_length=64,
        rope__scaling__yarn_beta_fast=16.0,
        rope__scaling__yarn_beta_slow=2.0,
        rope__scaling__yarn_log_multiplier=1.0,
        rope__scaling__attn_factor=0.5,
    )
    assert (scaling.original_context_length, scaling.beta_fast, scaling.beta_slow) == (64, 16.0, 2.0)
    assert scaling.mscale == pytest.approx(0.5, rel=1e-6)  # get_mscale(16, 1) / get_mscale(16, 1) · 0.5
    off = read(
        tmp_path / "b.gguf",
        rope__scaling__type="yarn",
        rope__scaling__factor=16.0,
        rope__scaling__yarn_ext_factor=0.0,
        rope__scaling__yarn_attn_factor=2.0,
    )
    assert off.ext_factor == 0.0 and off.mscale == 2.0  # no ramp: plain interpolation, llama.cpp's factor


@pytest.mark.parametrize(
    ("keys", "named"),
    [
        ({"rope__scaling__type": "longrope"}, "'llama.rope.scaling.type' is 'longrope'"),
        ({"rope__scaling__type": "dynamic"}, "'llama.rope.scaling.type' is 'dynamic'"),
        ({"rope__scaling__factor": -2.0}, "'llama.rope.scaling.factor' is -2.0"),
        ({"rope__scaling__yarn_beta_fast": "fast"}, "'llama.rope.scaling.yarn_beta_fast' is 'fast'"),
        ({"rope__scaling__original_context_length": 0}, "'llama.rope.scaling.original_context_length' is 0"),
    ],
    ids=["longrope", "dynamic", "negative_factor", "beta_text", "original_context_0"],
)
def test_bad_metadata_is_refused_in_one_line(keys: dict[str, Any], named: str, tmp_path: Path) -> None:
    with pytest.raises(GGUFError) as caught:
        read(tmp_path / "bad.gguf", **keys)
    message = str(caught.value)
    assert named in message and "\n" not in message, message
