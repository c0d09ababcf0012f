"""The limits chat templates compile and render under: time, output, memory, numbers; one-line errors.

The hostile-template fuzzing (many more shapes, through the real `Tokenizer`) is in
tests/test_fuzz_templates.py (slow); these are the fast checks of each limit.

Each limit is provoked by construction, never by how fast this machine or a library is: the tests of
the time limit run work that cannot end (an endless loop, a Python function that never returns) under
a short limit; every other test runs under a limit no render here comes near (`NOT_ABOUT_TIME`), so
that a busy machine cannot turn its expected error into a time-limit one.
"""

from __future__ import annotations

import os
import sys
import threading
import time

import jinja2
import pytest
from jinja2.sandbox import ImmutableSandboxedEnvironment

from ember.errors import TokenizerError
from ember.tokenizer import ChatTemplate, chat

HI = [{"role": "user", "content": "hi"}]
NOT_ABOUT_TIME = 300.0  # seconds: a limit for the tests of anything but time (each render takes milliseconds)
HANG_GUARD = 300.0  # seconds to wait for work that a short limit stops, before calling it a hang
ENDLESS = "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}"
linux_only = pytest.mark.skipif(not sys.platform.startswith("linux"),
                                reason="the memory limit is Linux's RLIMIT_DATA")


def refused(source: str, match: str, *, time_limit: float = NOT_ABOUT_TIME, **variables: object) -> float:
    """Render `source`; it must fail with one TokenizerError line matching `match`. The seconds it took
    (on the watchdog's clock)."""
    started = time.monotonic()
    with pytest.raises(TokenizerError, match=match) as caught:
        ChatTemplate(source, time_limit=time_limit).render(HI, **variables)
    assert "\n" not in str(caught.value)
    return time.monotonic() - started


def never_returns() -> None:
    """Python code that no speed of machine finishes: only the watchdog's interrupt ends it."""
    while True:
        pass


def test_an_endless_loop_stops_at_the_time_limit() -> None:
    took = refused(ENDLESS, "ran past ember's time limit of 0.5 s while rendering", time_limit=0.5)
    assert took >= 0.5, took  # not before the deadline; that it ends at all is the watchdog's doing


def test_python_code_outside_the_template_stops_at_the_time_limit() -> None:
    """A filter or a function the template calls is a Python loop, not template code (markupsafe 3.0.3's
    striptags is quadratic: 15 s for `('<a>' * 300000) | striptags`, 0.2 s with 3.0.4): the watchdog
    stops it too. Here the loop never ends, so the render can only end by the limit."""
    took = refused("{{ spin() }}", "ran past ember's time limit of 0.5 s while rendering", time_limit=0.5,
                   spin=never_returns)
    assert took >= 0.5, took


def test_the_interrupt_never_reaches_the_caller_afterwards() -> None:
    refused(ENDLESS, "time limit", time_limit=0.5)
    assert chat._WATCHDOG._watched is None  # nothing watched: the watchdog has nobody left to interrupt
    deadline = time.monotonic() + chat._REFIRE_SECONDS * 1.5
    while time.monotonic() < deadline:  # a late interrupt would land in this loop
        pass
    assert ChatTemplate("{{ messages[0].content }}").render(HI) == "hi"


def test_output_is_counted_as_it_is_produced() -> None:
    # 10 GB if it were built first: the memory limit (64 MiB) would stop it, with another message
    refused("{% for i in range(100000) %}{{ 'x' * 100000 }}{% endfor %}", "output passed 1,000,000")
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
    refused(source, "more than ember's memory limit of 64 MiB while rendering")


@linux_only
def test_the_memory_limit_is_lifted_after_each_render() -> None:
    import resource

    before = resource.getrlimit(resource.RLIMIT_DATA)
    ChatTemplate("{{ messages[0].content }}").render(HI)
    refused("{{ 'x'.ljust(10**10) }}", "memory limit")
    refused(ENDLESS, "time limit", time_limit=0.5)
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
    # none of these is about time: on a busy machine a deep recursion must reach the recursion limit
    # before the clock (seen: 0.5 s ran out first with both cores busy)
    refused(source, match)


def test_error_text_from_the_template_is_cut_short() -> None:
    with pytest.raises(TokenizerError) as caught:
        ChatTemplate("{{ raise_exception('x' * 100000) }}", time_limit=NOT_ABOUT_TIME).render(HI)
    assert len(str(caught.value)) <= chat._MESSAGE_CHARS


def test_compiling_is_limited_too() -> None:
    with pytest.raises(TokenizerError, match="recursed too deeply while compiling"):
        ChatTemplate("{{ " + "(" * 5000 + "1" + ")" * 5000 + " }}", time_limit=NOT_ABOUT_TIME)
    with pytest.raises(TokenizerError, match=r"does not parse: .* \(line 1\)$"):
        ChatTemplate("{% for %}", time_limit=NOT_ABOUT_TIME)


def test_constant_expressions_wait_for_the_render(monkeypatch: pytest.MonkeyPatch) -> None:
    """Jinja's optimizer folds constants at compile time, running their filters there; ember turns it off,
    so such work happens in the render. Seen by counting the filter's calls, not by a clock.

    (Jinja's code generator still folds a constant expression printed as it is, `{{ 'a' | upper }}`,
    optimizer or not; that runs under the compile's limits.)"""
    calls: list[str] = []

    def striptags(value: str) -> str:
        calls.append(value)
        return jinja2.filters.do_striptags(value)

    monkeypatch.setitem(jinja2.defaults.DEFAULT_FILTERS, "striptags", striptags)  # each environment copies it
    source = "{% set text = '<b>bold</b> text' | striptags %}{{ text }}"
    ImmutableSandboxedEnvironment().from_string(source)
    assert calls == ["<b>bold</b> text"]  # the control: Jinja's optimizer folds this expression
    calls.clear()
    template = ChatTemplate(source, time_limit=NOT_ABOUT_TIME)
    assert calls == []
    assert template.render(HI) == "bold text" and calls == ["<b>bold</b> text"]


def test_renders_from_other_threads_are_limited_and_serialized() -> None:
    results: list[str] = []

    def work(source: str, time_limit: float) -> None:
        try:
            results.append(ChatTemplate(source, time_limit=time_limit).render(HI))
        except TokenizerError as error:
            results.append(f"error: {error}")

    threads = [threading.Thread(target=work, args=args)
               for args in ((ENDLESS, 0.5), ("{{ messages[0].content }}", NOT_ABOUT_TIME), (ENDLESS, 0.5))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(HANG_GUARD)
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
    deadline = time.monotonic() + HANG_GUARD
    while time.monotonic() < deadline:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            assert os.waitstatus_to_exitcode(status) == 0
            return
        time.sleep(0.05)
    os.kill(pid, 9)
    pytest.fail("the forked child's render was never stopped")
