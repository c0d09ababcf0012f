"""How ember reads the metadata of the llama block's variants (`qwen2`, `olmo2`, `granite`, `smollm3`;
docs/families.md §7–§10), on metadata-only files, and that each family's own bad metadata ends in one
line naming the key. (Their numerics: tests/test_fidelity_tiny.py, tests/test_attention_stages.py.)"""

from __future__ import annotations

import math
from pathlib import Path

import gguf
import pytest

from ember.config import RopeLayout
from ember.errors import GGUFError
from ember.families import config_from_gguf
from ember.gguf_file import GGUFFile
from ember.phases import ModelFamily

HIDDEN, HEADS, HEAD_DIM = 64, 4, 16


def metadata_only(path: Path, arch: str, *, layers: int = 8, **extra) -> GGUFFile:
    """A file of metadata only; `extra` maps a key (without the architecture prefix) to its value."""
    writer = gguf.GGUFWriter(path, arch)
    writer.add_context_length(128)
    writer.add_embedding_length(HIDDEN)
    writer.add_block_count(layers)
    writer.add_feed_forward_length(2 * HIDDEN)
    writer.add_head_count(HEADS)
    writer.add_head_count_kv(2)
    writer.add_layer_norm_rms_eps(1e-6)
    writer.add_rope_freq_base(1e6)
    for key, value in extra.items():
        name = f"{arch}.{key}"
        if isinstance(value, bool):
            writer.add_bool(name, value)
        elif isinstance(value, str):
            writer.add_string(name, value)
        elif isinstance(value, int):
            writer.add_uint32(name, value)
        else:
            writer.add_float32(name, value)
    writer.add_token_list(["<a>", "<b>", "<c>"])
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return GGUFFile.open(path)


def test_qwen2_is_the_plain_block_with_neox_rope(tmp_path: Path) -> None:
    c = config_from_gguf(metadata_only(tmp_path / "q.gguf", "qwen2"))
    assert c.family is ModelFamily.QWEN2 and c.rope_layout is RopeLayout.NEOX and not c.has_qk_norm
    assert all(c.rope_layers) and (c.embedding_scale, c.residual_scale, c.logit_scale) == (1.0, 1.0, 1.0)
    assert c.attention_scale == 1.0 / math.sqrt(HEAD_DIM)


def test_olmo2_has_qk_norm_and_neox_rope(tmp_path: Path) -> None:
    c = config_from_gguf(metadata_only(tmp_path / "o.gguf", "olmo2"))
    assert c.family is ModelFamily.OLMO2 and c.rope_layout is RopeLayout.NEOX and c.has_qk_norm


def test_smollm3_skips_rope_on_every_fourth_layer(tmp_path: Path) -> None:
    c = config_from_gguf(metadata_only(tmp_path / "s.gguf", "smollm3", layers=9))
    assert c.family is ModelFamily.SMOLLM3 and c.rope_layout is RopeLayout.NORM
    assert [i for i, roped in enumerate(c.rope_layers) if not roped] == [3, 7]


def test_granite_reads_its_multipliers(tmp_path: Path) -> None:
    c = config_from_gguf(metadata_only(tmp_path / "g.gguf", "granite", **{
        "embedding_scale": 12.0, "residual_scale": 0.25, "attention.scale": 0.0078125, "logit_scale": 8.0}))
    assert c.family is ModelFamily.GRANITE and c.rope_layout is RopeLayout.NORM and all(c.rope_layers)
    scales = (c.embedding_scale, c.residual_scale, c.attention_scale, c.logit_scale)
    assert scales == (12.0, 0.25, 0.0078125, 8.0)


def test_granite_without_the_optional_multipliers_uses_none_as_llama_cpp_does(tmp_path: Path) -> None:
    """llama.cpp reads `residual_scale`, `embedding_scale`, `attention.scale` as optional (absent or 0:
    no multiplier, 1/√head_dim for attention); `rope.scaling.finetuned` false turns rope off everywhere."""
    c = config_from_gguf(metadata_only(tmp_path / "g.gguf", "granite", **{
        "logit_scale": 2.0, "residual_scale": 0.0, "rope.scaling.finetuned": False}))
    assert (c.embedding_scale, c.residual_scale, c.logit_scale) == (1.0, 1.0, 2.0)
    assert c.attention_scale == 1.0 / math.sqrt(HEAD_DIM) and not any(c.rope_layers)


BAD = {
    "qwen2-longrope": ("qwen2", {"rope.scaling.type": "longrope", "rope.scaling.factor": 4.0},
                       "qwen2.rope.scaling.type"),
    "olmo2-sliding": ("olmo2", {"attention.sliding_window": 4096}, "olmo2.attention.sliding_window"),
    "granite-no-logit-scale": ("granite", {"residual_scale": 0.25}, "granite.logit_scale"),
    "granite-zero-logit-scale": ("granite", {"logit_scale": 0.0}, "granite.logit_scale"),
    "granite-residual-text": ("granite", {"logit_scale": 8.0, "residual_scale": "quarter"},
                              "granite.residual_scale"),
    "granite-negative-embedding": ("granite", {"logit_scale": 8.0, "embedding_scale": -12.0},
                                   "granite.embedding_scale"),
    "granite-finetuned-text": ("granite", {"logit_scale": 8.0, "rope.scaling.finetuned": "yes"},
                               "granite.rope.scaling.finetuned"),
    "smollm3-partial-rope": ("smollm3", {"rope.dimension_count": HEAD_DIM // 2},
                             "smollm3.rope.dimension_count"),
}


@pytest.mark.parametrize("case", list(BAD))
def test_bad_metadata_ends_in_one_line_naming_the_key(case: str, tmp_path: Path) -> None:
    arch, extra, key = BAD[case]
    with pytest.raises(GGUFError) as caught:
        config_from_gguf(metadata_only(tmp_path / f"{case}.gguf", arch, **extra))
    message = str(caught.value)
    assert key in message and "\n" not in message, message
