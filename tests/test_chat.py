"""The chat session and REPL on SmolLM2: template, streaming, KV cache reused between turns."""

from __future__ import annotations

import io

import pytest

from ember.chat import ChatSession, run_repl
from ember.errors import TokenizerError


def test_second_turn_prefills_only_the_new_tokens(smollm2) -> None:
    session = ChatSession(smollm2, max_new_tokens=8)
    streamed: list[str] = []
    first = session.send("What is the capital of France?", on_text=streamed.append)
    assert "".join(streamed) == first.text and first.text
    assert first.timings.reused_prompt_tokens == 0
    assert first.timings.prompt_tokens == len(first.prompt_token_ids)
    cached = smollm2.cached_token_ids
    assert cached == first.prompt_token_ids + first.token_ids[: first.timings.decode_evaluations]

    second = session.send("And of Germany?")
    reused = second.timings.reused_prompt_tokens
    assert second.prompt_token_ids[:reused] == cached[:reused]
    # the whole first turn (prompt and evaluated reply) is kept; only the new turn's tokens are evaluated
    assert reused == len(cached)
    assert second.timings.prompt_tokens == len(second.prompt_token_ids) - len(cached)
    assert second.timings.prompt_tokens < 20
    assert [m["role"] for m in session.messages][-4:] == ["user", "assistant", "user", "assistant"]
    assert session.messages[-1]["content"] == second.text

    # the reused cache gives the same reply as a fresh prefill of the whole conversation
    fresh = smollm2.generate(second.prompt_token_ids, max_new_tokens=8)
    assert fresh.timings.reused_prompt_tokens == 0 and fresh.token_ids == second.token_ids


def test_reuse_cache_keeps_only_the_shared_prefix(smollm2) -> None:
    ids = smollm2.tokenize("One two three four five")
    smollm2.generate(ids, max_new_tokens=3)
    other = ids[:3] + smollm2.tokenize(" seven eight", add_bos=False)
    generation = smollm2.generate(other, max_new_tokens=3, reuse_cache=True)
    assert generation.timings.reused_prompt_tokens == 3
    assert generation.token_ids == smollm2.generate(other, max_new_tokens=3).token_ids
    # the same prompt again: everything but the last token is reused
    again = smollm2.generate(other, max_new_tokens=3, reuse_cache=True)
    assert again.timings.reused_prompt_tokens == len(other) - 1 and again.token_ids == generation.token_ids


def test_repl_through_stdin(smollm2) -> None:
    stdin = io.StringIO("Say hello.\n\n/what\nAnd again?\n/reset\nSay hello.\n/exit\nnever read\n")
    stdout = io.StringIO()
    session = run_repl(smollm2, stdin=stdin, stdout=stdout, max_new_tokens=6)
    text = stdout.getvalue()
    assert text.startswith("ember chat with smollm2-135m")
    assert "unknown command /what" in text and "(conversation reset)" in text
    assert text.count("reused from the cache") == 3
    # after /reset one turn is remembered: the repeated first question
    assert len(session.turns) == 1 and [m["role"] for m in session.messages][-2:] == ["user", "assistant"]
    assert session.messages[-2]["content"] == "Say hello."
    assert stdin.readline() == "never read\n"  # /exit stopped reading
    stats = [line for line in text.splitlines() if line.startswith("[")]
    assert "0 reused" in stats[0] and "0 reused" not in stats[1]


def test_context_full_is_reported_not_raised(smollm2) -> None:
    stdout = io.StringIO()
    session = run_repl(smollm2, stdin=io.StringIO("word " * 1100 + "\n"), stdout=stdout, max_new_tokens=4)
    assert "fills the context of 1024 tokens: /reset to start over" in stdout.getvalue()
    assert session.turns == []


def test_chat_refuses_experiments(smollm2) -> None:
    from ember.experiments import ActivationStats
    from ember.inspection import ExperimentConflictError

    expected = r"interactive command \(ember interactive\) cannot run with active experiments"
    with pytest.raises(ExperimentConflictError, match=expected):
        ChatSession(smollm2, experiments=[ActivationStats()])


def test_a_model_without_chat_template_is_refused() -> None:
    class NoTemplate:
        has_chat_template = False

    class Fake:
        tokenizer = NoTemplate()

        class source:
            name = "plain-model"

    with pytest.raises(TokenizerError, match="plain-model has no chat template"):
        ChatSession(Fake())


def test_a_sliding_window_cache_is_only_extended_never_cut_back() -> None:
    from ember.kv_cache import FullLayerKV, LayeredKVCache, SlidingWindowKV
    from ember.model import Model

    model = Model.__new__(Model)
    model._cache = LayeredKVCache([FullLayerKV(1, 16, 2), SlidingWindowKV(1, 4, 2)])
    model._cached_ids = [1, 2, 3, 4, 5]
    assert model._reusable_prefix([1, 2, 3, 4, 5, 6, 7]) == 5   # an extension keeps everything
    assert model._reusable_prefix([1, 2, 3, 9]) == 0            # cutting a ring back is not possible
    model._cache = LayeredKVCache([FullLayerKV(1, 16, 2)])
    assert model._reusable_prefix([1, 2, 3, 9]) == 3            # full caches can be cut back
    assert model._reusable_prefix([1, 2]) == 1                  # at least one token is evaluated
