"""Prompt sets: the `data` config section, files, inline lists, limit/shuffle/seed, digests, and the
bundled sets (the clean/corrupted pairs have equal token counts with SmolLM2's tokenizer)."""

from __future__ import annotations

import json

import pytest

from ember.data import BUNDLED_DIR, load_prompt_set, parse_data_spec
from ember.errors import ConfigError


def spec(**values):
    base = {"name": None, "path": None, "items": None, "limit": None, "shuffle": False, "seed": 0}
    base.update(values)
    return parse_data_spec(base)


def test_inline_items_strings_and_objects():
    prompts = load_prompt_set(spec(items=["Hello", {"prompt": "Paris is in", "answer": " France",
                                                    "label": 3}]))
    assert [i.prompt for i in prompts.items] == ["Hello", "Paris is in"]
    assert prompts.items[1].answer == " France" and prompts.items[1].label == "3"
    assert prompts.source == "inline" and prompts.source_type == "code" and prompts.name == "inline"
    assert prompts.fields() == ["prompt", "label", "answer"]


def test_txt_and_jsonl_files(tmp_path):
    text = tmp_path / "p.txt"
    text.write_text("# a comment\nfirst prompt\n\nsecond prompt\n")
    prompts = load_prompt_set(spec(path=str(text)))
    assert [i.prompt for i in prompts.items] == ["first prompt", "second prompt"]
    assert prompts.name == "p" and prompts.source == str(text.resolve()) and prompts.source_type == "local"
    lines = [{"prompt": "A", "answer": " x", "wrong_answer": " y", "corrupted": "B"},
             {"messages": [{"role": "user", "content": "Hi"}], "label": "chat"}]
    jsonl = tmp_path / "p.jsonl"
    jsonl.write_text("\n".join(json.dumps(line) for line in lines) + "\n")
    items = load_prompt_set(spec(path=str(jsonl), name="mine")).items
    assert items[0].corrupted == "B" and items[0].wrong_answer == " y"
    assert items[1].messages == ({"role": "user", "content": "Hi"},) and items[1].prompt is None


def test_limit_shuffle_seed_and_digest():
    items = [f"prompt {i}" for i in range(20)]
    plain = load_prompt_set(spec(items=items))
    assert len(plain) == 20 and plain.total == 20
    first = load_prompt_set(spec(items=items, shuffle=True, seed=1, limit=5))
    again = load_prompt_set(spec(items=items, shuffle=True, seed=1, limit=5))
    other = load_prompt_set(spec(items=items, shuffle=True, seed=2, limit=5))
    assert [i.prompt for i in first.items] == [i.prompt for i in again.items]
    assert first.digest == again.digest
    assert [i.prompt for i in first.items] != [i.prompt for i in other.items]
    assert first.digest != other.digest != plain.digest
    assert len(first) == 5 and first.total == 20
    limited = load_prompt_set(spec(items=items, limit=3))
    assert [i.prompt for i in limited.items] == items[:3]


@pytest.mark.parametrize(("values", "message"), [
    ({"path": "a.txt", "items": ["x"]}, "exactly one of data.path"),
    ({}, "exactly one of data.path"),
    ({"items": ["x"], "limit": 0}, "data.limit must be a positive integer"),
    ({"items": ["x"], "shuffle": "yes"}, "data.shuffle must be true or false"),
    ({"items": ["x"], "seed": -1}, "data.seed"),
    ({"items": []}, "data.items must be a non-empty list"),
])
def test_spec_mistakes_name_the_key(values, message):
    with pytest.raises(ConfigError, match=message):
        spec(**values)


def test_unknown_key_and_bad_items(tmp_path):
    with pytest.raises(ConfigError, match="unknown key data.size"):
        parse_data_spec({"items": ["x"], "size": 3})
    with pytest.raises(ConfigError, match=r"data.items\[1\].*unknown field 'anwser'"):
        load_prompt_set(spec(items=["ok", {"prompt": "x", "anwser": "y"}]))
    with pytest.raises(ConfigError, match="wrong_answer.*needs an \"answer\""):
        load_prompt_set(spec(items=[{"prompt": "x", "wrong_answer": " y"}]))
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"prompt": "ok"}\n{not json\n')
    with pytest.raises(ConfigError, match=r"bad.jsonl:2: not valid JSON"):
        load_prompt_set(spec(path=str(bad)))
    with pytest.raises(ConfigError, match="does not exist"):
        load_prompt_set(spec(path=str(tmp_path / "missing.jsonl")))
    with pytest.raises(ConfigError, match="no such bundled prompt set; bundled: ember:capitals.jsonl"):
        load_prompt_set(spec(path="ember:capital.jsonl"))


def test_bundled_sets_have_what_their_experiments_need():
    capitals = load_prompt_set(spec(path="ember:capitals.jsonl"))
    assert len(capitals) >= 40 and capitals.name == "capitals"
    for item in capitals.items:
        assert item.answer and item.wrong_answer and item.corrupted and item.answer != item.wrong_answer
        assert item.prompt.startswith("The capital of ") and item.prompt.endswith(" is")
    ioi = load_prompt_set(spec(path="ember:ioi.jsonl"))
    assert len(ioi) >= 40
    sentiment = load_prompt_set(spec(path="ember:sentiment.jsonl"))
    assert len(sentiment) >= 16 and all(i.corrupted and i.corrupted != i.prompt for i in sentiment.items)
    assert {p.name for p in BUNDLED_DIR.iterdir()} >= {"capitals.jsonl", "ioi.jsonl", "sentiment.jsonl"}


def test_pairs_have_equal_token_lengths_with_smollm2(smollm2_path):
    """Activation patching swaps activations position by position: clean and corrupted prompts must
    tokenize to the same count (checked with ember's tokenizer, which gives llama.cpp's ids)."""
    from ember.gguf_file import GGUFFile
    from ember.tokenizer import Tokenizer

    tokenizer = Tokenizer.from_gguf(GGUFFile.open(smollm2_path))
    for name in ("ioi", "capitals"):
        for item in load_prompt_set(spec(path=f"ember:{name}.jsonl")).items:
            clean, corrupted = tokenizer.encode(item.prompt), tokenizer.encode(item.corrupted)
            assert len(clean) == len(corrupted), (name, item.prompt, item.corrupted)
            assert clean != corrupted
            answer = tokenizer.encode(item.answer, add_bos=False)
            wrong = tokenizer.encode(item.wrong_answer, add_bos=False)
            assert answer[0] != wrong[0], (item.answer, item.wrong_answer)
    for item in load_prompt_set(spec(path="ember:ioi.jsonl")).items:  # names are one token each
        assert len(tokenizer.encode(item.answer, add_bos=False)) == 1
