"""Tiny random Ministral 3 text models (GGUF arch `mistral3`) written as llama.cpp's converter writes
them, against transformers float32 boundary by boundary (docs/families.md §13).

Ministral 3's own parts are switched on so that an engine without one fails: YaRN with its ramp inside
the head's pairs and a cos/sin factor away from 1 (`MINISTRAL3_ROPE`: base 100, factor 4, betas 1 and
0.1 over an original context of 8, `mscale_all_dim` 0.5), and the attention temperature
1 + β·ln(1 + ⌊p / 8⌋) with β = 0.5, which steps at positions 8, 16 and 24 of the 22-token prompt and
its 6 decode steps. `test_each_part_shows` proves each matters: transformers without it is far from
ember. Also: the Tekken pre-tokenizer, the config read from metadata, and bad metadata in one line.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

import gguf  # noqa: E402
from reference.compare import compare_evaluations  # noqa: E402
from reference.ember_recorder import record_generation  # noqa: E402
from reference.gguf_writer import load_gguf_weights_into_hf, rewrite_gguf, write_gguf  # noqa: E402
from reference.hf_capture import capture  # noqa: E402
from reference.tiny_models import MINISTRAL3_ROPE, tiny_ministral3  # noqa: E402

import ember  # noqa: E402
from ember.config import RopeLayout  # noqa: E402
from ember.errors import GGUFError  # noqa: E402
from ember.phases import ModelFamily  # noqa: E402

pytestmark = pytest.mark.reference

TOLERANCE = 1e-4
DECODE_STEPS = 6
PROMPT = [40, 71, 100, 33, 259, 120, 87, 66, 200, 5, 44, 45, 46, 47, 48, 49, 50, 51, 52, 53, 262, 270]
F32, Q8_0 = gguf.GGMLQuantizationType.F32, gguf.GGMLQuantizationType.Q8_0


def run(hf_model: Any, path: Path, qtype: gguf.GGMLQuantizationType = F32) -> tuple[Any, Any, list[int]]:
    write_gguf(hf_model, path, qtype=qtype, pre="tekken")
    if qtype != F32:
        load_gguf_weights_into_hf(hf_model, path)
    ours, generated = record_generation(ember.load_model(path), PROMPT, DECODE_STEPS)
    return ours, capture(hf_model, PROMPT, generated[:DECODE_STEPS]), generated


def test_config_read_from_the_file(tmp_path: Path) -> None:
    path = write_gguf(tiny_ministral3(), tmp_path / "tiny.gguf", pre="tekken")
    c = ember.load_model(path).config
    assert c.family is ModelFamily.MISTRAL3 and c.rope_layout is RopeLayout.NORM and all(c.rope_layers)
    assert (c.temperature_scale, c.temperature_length) == (0.5, 8)
    scaling = c.rope_scaling
    assert (scaling.kind, scaling.factor, scaling.original_context_length) == ("yarn", 4.0, 8)
    assert (scaling.beta_fast, scaling.beta_slow, scaling.ext_factor) == (1.0, pytest.approx(0.1), 1.0)
    assert scaling.mscale == pytest.approx(tiny_ministral3().model.rotary_emb.attention_scaling, rel=1e-6)


@pytest.mark.parametrize("qtype", [F32, Q8_0], ids=["f32", "q8_0"])
def test_every_boundary_matches_transformers(qtype: gguf.GGMLQuantizationType, tmp_path: Path) -> None:
    """Prefill of 22 tokens, then 6 decode steps: every layer boundary, the final norm and the logits."""
    ours, reference, _ = run(tiny_ministral3(), tmp_path / "tiny.gguf", qtype)
    worst = compare_evaluations(ours, reference)
    print("\n" + "\n".join(f"  {w}" for w in worst.values()))
    failures = [str(w) for w in worst.values() if not w.relative <= TOLERANCE]
    assert not failures, "\n".join(failures)


def test_greedy_tokens_match_transformers(tmp_path: Path) -> None:
    hf = tiny_ministral3()
    model = ember.load_model(write_gguf(hf, tmp_path / "tiny.gguf", pre="tekken"))
    ours = model.generate(PROMPT[:12], max_new_tokens=12, stop_at_eog=False).token_ids
    with torch.no_grad():
        theirs = hf.generate(
            torch.tensor([PROMPT[:12]]), max_new_tokens=12, do_sample=False, min_new_tokens=12
        )[0, 12:].tolist()
    assert ours == theirs


def without_temperature() -> Any:
    return tiny_ministral3(llama_4_scaling_beta=0.0)


def without_yarn() -> Any:
    """The same weights with plain rope at the same base (no ramp, no factor); the temperature kept."""
    model = tiny_ministral3()
    plain = tiny_ministral3()
    plain.config.rope_parameters = {"rope_type": "default", "rope_theta": MINISTRAL3_ROPE["rope_theta"]}
    from transformers.models.ministral3.modeling_ministral3 import Ministral3RotaryEmbedding

    model.model.rotary_emb = Ministral3RotaryEmbedding(plain.config)
    model.config.rope_parameters = MINISTRAL3_ROPE  # the temperature still reads β and L from here
    return model


def without_mscale() -> Any:
    model = tiny_ministral3()
    model.model.rotary_emb.attention_scaling = 1.0
    return model


# Ministral 3's parts switched off on the transformers side (same weights), and the boundary an engine
# without the part first goes wrong at
WITHOUT = {
    "yarn": (without_yarn, "after_attention"),
    "mscale": (without_mscale, "after_attention"),
    "temperature": (without_temperature, "after_attention"),
}


@pytest.mark.parametrize("part", list(WITHOUT))
def test_each_part_shows(part: str, tmp_path: Path) -> None:
    """The comparison above would catch an engine without each part: transformers without it differs
    from ember (which has it) by far more than the tolerance."""
    build, boundary = WITHOUT[part]
    ours, _, generated = run(tiny_ministral3(), tmp_path / "tiny.gguf")
    worst = compare_evaluations(ours, capture(build(), PROMPT, generated[:DECODE_STEPS]))
    assert worst[boundary].relative > 100 * TOLERANCE, (part, worst[boundary])


def test_the_temperature_starts_at_the_original_context(tmp_path: Path) -> None:
    """Before position 8 the temperature is 1: a prompt of 8 tokens matches transformers without it."""
    path = write_gguf(tiny_ministral3(), tmp_path / "tiny.gguf", pre="tekken")
    ours, generated = record_generation(ember.load_model(path), PROMPT[:8], 0)
    worst = compare_evaluations(ours, capture(without_temperature(), PROMPT[:8], []))
    assert all(w.relative <= TOLERANCE for w in worst.values()), worst


# --------------------------------------------------------------------------- the tokenizer


def test_the_tekken_pre_tokenizer_splits_as_its_regex() -> None:
    """llama.cpp's rewrite of Tekken's tokenizer.json regex (upper-case runs: letters not a-z; lower:
    letters not A-Z), against the original regex on ASCII and on letters without case."""
    regex = pytest.importorskip("regex")
    from ember.tokenizer.pretokenize import pre_tokenizer, split

    original = regex.compile(
        r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+|[^\r\n\p{L}\p{N}]?"
        r"[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n/]*|"
        r"\s*[\r\n]+|\s+(?!\S)|\s+"
    )
    tekken = pre_tokenizer("tekken")
    assert not tekken.clean_spaces and tekken.ignore_merges and tekken.add_bos
    for text in (
        "Hello World's HTTPServer parseJSON 12345 a/b//c\n\n  x",
        "  CamelCaseWord, ALLCAPS lower!?/\r\n end  ",
        "日本語 テスト 3.14 ok",
    ):
        assert split(text, tekken.compiled()) == original.findall(text), text


# --------------------------------------------------------------------------- bad metadata


def with_key(path: Path, out: Path, key: str, value: Any) -> Path:
    """A copy of `path` with metadata `key` set to `value` (a string, a float32 or a uint32)."""
    bad = rewrite_gguf(path, out.with_suffix(".tmp"), drop_key=key)
    reader = gguf.GGUFReader(bad)
    writer = gguf.GGUFWriter(out, "mistral3")
    for field in reader.fields.values():
        if field.name.startswith("GGUF.") or field.name == "general.architecture":
            continue
        sub = field.types[-1] if field.types[0] == gguf.GGUFValueType.ARRAY else None
        writer.add_key_value(field.name, field.contents(), field.types[0], sub_type=sub)
    {str: writer.add_string, float: writer.add_float32, int: writer.add_uint32}[type(value)](key, value)
    for tensor in reader.tensors:
        shape = tuple(reversed(tensor.shape.tolist()))
        writer.add_tensor(tensor.name, tensor.data, raw_shape=shape, raw_dtype=tensor.tensor_type)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return out


@pytest.mark.parametrize(
    ("key", "value", "named"),
    [
        ("rope.scaling.type", "longrope", "'mistral3.rope.scaling.type' is 'longrope'"),
        ("attention.temperature_scale", "warm", "'mistral3.attention.temperature_scale' is 'warm'"),
        ("rope.scaling.original_context_length", 0, "'mistral3.rope.scaling.original_context_length' is 0"),
        (
            "rope.scaling.yarn_log_multiplier",
            float("nan"),
            "'mistral3.rope.scaling.yarn_log_multiplier' is nan",
        ),
    ],
    ids=["scaling_type", "temperature_text", "original_context_0", "log_multiplier_nan"],
)
def test_bad_metadata_is_refused_in_one_line(key: str, value: Any, named: str, tmp_path: Path) -> None:
    path = write_gguf(tiny_ministral3(), tmp_path / "tiny.gguf", pre="tekken")
    with pytest.raises(GGUFError) as caught:
        ember.load_model(with_key(path, tmp_path / "bad.gguf", f"mistral3.{key}", value))
    message = str(caught.value)
    assert named in message and "\n" not in message, message
