"""The limits chat templates compile and render under: time, output, memory, numbers; one-line errors.

The hostile-template fuzzing (many more shapes, through the real `Tokenizer`) is in
tests/test_fuzz_templates.py (slow); these are the fast checks of each limit.
"""

from __future__ import annotations

import os
import sys
import threading
import time

import pytest

from ember.errors import TokenizerError
from ember.tokenizer import ChatTemplate, chat

HI = [{"role": "user", "content": "hi"}]
ENDLESS = "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}"
linux_only = pytest.mark.skipif(not sys.platform.startswith("linux"),
                                reason="the memory limit is Linux's RLIMIT_DATA")


def refused(source: str, match: str, *, time_limit: float = 0.5) -> float:
    """Render `source`; it must fail with one TokenizerError line matching `match`. The seconds it took."""
    started = time.perf_counter()
    with pytest.raises(TokenizerError, match=match) as caught:
        ChatTemplate(source, time_limit=time_limit).render(HI)
    assert "\n" not in str(caught.value)
    return time.perf_counter() - started


def test_an_endless_loop_stops_at_the_time_limit() -> None:
    took = refused(ENDLESS, "ran past ember's time limit of 0.5 s while rendering")
    assert 0.5 <= took < 2.0, took


def test_a_quadratic_filter_stops_at_the_time_limit() -> None:
    """markupsafe's striptags is a Python loop, not template code: the watchdog stops it too."""
    took = refused("{{ ('<a>' * 300000) | striptags }}", "time limit of 0.5 s")
    assert took < 2.0, took


def test_the_interrupt_never_reaches_the_caller_afterwards() -> None:
    refused(ENDLESS, "time limit")
    deadline = time.monotonic() + chat._REFIRE_SECONDS * 1.5
    while time.monotonic() < deadline:  # a late interrupt would land in this loop
        pass
    assert ChatTemplate("{{ messages[0].content }}").render(HI) == "hi"


def test_output_is_counted_as_it_is_produced() -> None:
    took = refused("{% for i in range(100000) %}{{ 'x' * 100000 }}{% endfor %}", "output passed 1,000,000")
    assert took < 1.0, took
    assert len(ChatTemplate("{{ 'x' * 1000000 }}").render(HI)) == chat.MAX_OUTPUT_CHARS


def test_repeating_and_powers_are_checked_before_they_are_computed() -> None:
    refused("{{ 'x' * 10**10 }}", "repeats a value of length 1 10,000,000,000 times")
    refused("{{ [0] * 10**9 }}", "repeats a value of length 1")
    refused("{{ 10 ** (10 ** 8) }}", "a number of about 300,000,000 bits")
    refused("{% set ns = namespace(x=3) %}{% for i in range(40) %}{% set ns.x = ns.x * ns.x %}{% endfor %}",
            "bits with \\*")
    small = ChatTemplate("{{ 2 ** 64 }} {{ 'ab' * 3 }} {{ 3 * [1] }}").render(HI)
    assert small == "18446744073709551616 ababab [1, 1, 1]"


@linux_only
@pytest.mark.parametrize("source", [
    "{{ 'x'.ljust(10**10) }}",
    "{{ 'x' | center(10000000000) }}",
    "{{ '%999999999s' | format('x') }}",
    "{{ ('x' * 100000).replace('x', 'y' * 100000) }}",
    "{% set ns = namespace(s='x') %}{% for i in range(60) %}{% set ns.s = ns.s ~ ns.s %}{% endfor %}",
])
def test_one_huge_allocation_fails_at_the_memory_limit(source: str) -> None:
    took = refused(source, "more than ember's memory limit of 64 MiB while rendering", time_limit=10)
    assert took < 3.0, took


@linux_only
def test_the_memory_limit_is_lifted_after_each_render() -> None:
    import resource

    before = resource.getrlimit(resource.RLIMIT_DATA)
    ChatTemplate("{{ messages[0].content }}").render(HI)
    refused("{{ 'x'.ljust(10**10) }}", "memory limit")
    refused(ENDLESS, "time limit")
    assert resource.getrlimit(resource.RLIMIT_DATA) == before
    assert len(bytearray(200 << 20)) == 200 << 20  # more than a render may take


@pytest.mark.parametrize(("source", "match"), [
    ("{% for i in range(10**9) %}{% endfor %}", "OverflowError: Range too big"),
    ("{% macro f(n) %}{{ f(n + 1) }}{% endmacro %}{{ f(0) }}", "recursed too deeply while rendering"),
    ("{{ 1 / 0 }}", "ZeroDivisionError: division by zero"),
    ("{{ 'a' + 1 }}", "TypeError"),
    ("{% include 'x.html' %}", "no loader"),
    ("{{ ''.__class__.__mro__ }}", "sandbox forbids"),
    ("{{ raise_exception('line one\nline two ' + 'x' * 10000) }}", "failed: line one line two xxx"),
])
def test_every_failure_is_one_tokenizer_error_line(source: str, match: str) -> None:
    # none of these is about time: a generous limit, so that on a busy machine a deep recursion reaches
    # the recursion limit before the clock (seen: 0.5 s ran out first with both cores busy)
    refused(source, match, time_limit=10)


def test_error_text_from_the_template_is_cut_short() -> None:
    with pytest.raises(TokenizerError) as caught:
        ChatTemplate("{{ raise_exception('x' * 100000) }}").render(HI)
    assert len(str(caught.value)) <= chat._MESSAGE_CHARS


def test_compiling_is_limited_too() -> None:
    with pytest.raises(TokenizerError, match="recursed too deeply while compiling"):
        ChatTemplate("{{ " + "(" * 5000 + "1" + ")" * 5000 + " }}")
    with pytest.raises(TokenizerError, match=r"does not parse: .* \(line 1\)$"):
        ChatTemplate("{% for %}")


def test_constant_expressions_wait_for_the_render() -> None:
    """Jinja folds constants at compile time, outside any limit; ember turns folding off."""
    started = time.perf_counter()
    template = ChatTemplate("{{ ('<a>' * 300000) | striptags }}", time_limit=0.5)
    assert time.perf_counter() - started < 0.5
    with pytest.raises(TokenizerError, match="time limit"):
        template.render(HI)


def test_renders_from_other_threads_are_limited_and_serialized() -> None:
    results: list[str] = []

    def work(source: str) -> None:
        try:
            results.append(ChatTemplate(source, time_limit=0.5).render(HI))
        except TokenizerError as error:
            results.append(f"error: {error}")

    threads = [threading.Thread(target=work, args=(source,))
               for source in (ENDLESS, "{{ messages[0].content }}", ENDLESS)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(10)
    assert sorted(r[:35] for r in results) == ["error: the chat template ran past e"] * 2 + ["hi"]


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs fork")
def test_a_forked_child_renders_under_its_own_watchdog() -> None:
    ChatTemplate("{{ 1 }}").render(HI)  # the parent's watchdog thread exists
    pid = os.fork()
    if pid == 0:  # the child: an endless loop must still stop
        try:
            ChatTemplate(ENDLESS, time_limit=0.3).render(HI)
            os._exit(1)
        except TokenizerError:
            os._exit(0)
        except BaseException:
            os._exit(2)
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            assert os.waitstatus_to_exitcode(status) == 0
            return
        time.sleep(0.05)
    os.kill(pid, 9)
    pytest.fail("the forked child's render was never stopped")
