"""Fuzzing chat templates: hostile ones end in one clean TokenizerError line, stopped by a limit.

Every template goes through the real path of `Model.chat` and `ember generate --chat`: a `Tokenizer`
built from SmolLM2's GGUF metadata with `tokenizer.chat_template` replaced, then `encode_chat`.
Generated systematically: sandbox escapes (every dunder chain on every object a template can name,
through `.`, `[]`, `|attr`, `str.format`, plus imports and includes, with a canary file a successful
escape would create), endless loops, huge output, deep and exponential recursion, huge ranges and
numbers, memory bombs, and sources hostile to the compiler. The bulk runs with the time limit set
to 1 s (`ember.tokenizer.chat.TIME_LIMIT_SECONDS`, read at each render); a sample runs with the
real 10 s, through `ember generate --chat` and `Model.chat` on a GGUF file whose template was
rewritten in place.

No verdict here depends on how fast this machine or a library is: a bomb meant for the time limit is
work no machine finishes within it (billions of loop steps; markupsafe 3.0.4's `striptags` is linear where
3.0.3's is quadratic, so one call is no bomb but 100,000 calls are), a bomb meant for another limit
reaches it whatever the speed, and the seconds each case took are printed, not judged. Each limit's own
test, by construction, is in tests/test_chat_template_limits.py.
"""

from __future__ import annotations

import re
import shutil
import struct
import time
from collections import Counter
from pathlib import Path

import pytest

from ember.errors import TokenizerError
from ember.gguf_file import GGUFFile
from ember.tokenizer import Tokenizer, chat

CONVERSATION = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hello"},
                {"role": "assistant", "content": "Hi!"}, {"role": "user", "content": "What is 2+2?"}]
BULK_LIMIT = 1.0
# What a template that reached Python's internals would print: classes, modules, frames, code, a namespace.
LEAKS = re.compile(r"<(class|module|frame|code|cell|code object) |mappingproxy|'__name__'|'__doc__'")

OBJECTS = ["''", "messages", "messages[0]", "messages[0].content", "raise_exception", "strftime_now",
           "namespace", "cycler", "joiner", "lipsum", "range", "dict", "self", "tools", "bos_token", "[]",
           "{}", "(1)", "1.0", "namespace()", "cycler(1, 2)", "messages.pop", "''.join", "loop", "caller",
           "add_generation_prompt", "messages|first", "range(3)"]
CHAINS = ["__class__", "__class__.__mro__", "__class__.__mro__[1].__subclasses__()",
          "__class__.__base__.__subclasses__()", "__globals__", "__globals__['os']", "__init__.__globals__",
          "__init__.__globals__.os.popen('touch CANARY')", "__builtins__", "__dict__", "__code__",
          "__closure__", "__self__", "__func__", "__reduce_ex__(2)", "mro()", "_TemplateReference__context",
          "__getattribute__('__class__')", "func_globals", "gi_frame.f_back", "__import__('os')",
          "environment", "_environment", "__call__.__globals__", "__wrapped__", "__loader__"]
ESCAPES_BY_HAND = [
    "{% import 'os' as os %}{{ os.system('touch CANARY') }}",
    "{% from 'os' import system %}",
    "{% include '/etc/passwd' %}",
    "{% extends '/etc/passwd' %}",
    "{% include 'CANARY' ignore missing %}",
    "{{ lipsum.__globals__['os'].popen('touch CANARY').read() }}",
    "{{ cycler.__init__.__globals__.os.popen('touch CANARY').read() }}",
    "{{ self._TemplateReference__context.cycler.__init__.__globals__.os.popen('touch CANARY') }}",
    "{{ namespace.__init__.__globals__['__builtins__']['open']('/etc/passwd').read() }}",
    "{{ lipsum.__globals__.__builtins__.__import__('os').system('touch CANARY') }}",
    "{{ ''|attr('\\x5f\\x5fclass\\x5f\\x5f') }}",
    "{{ ''['\\x5f\\x5fclass\\x5f\\x5f'] }}",
    "{{ ''|attr('__cla' ~ 'ss__') }}",
    "{{ messages|map(attribute='__class__')|list }}",
    "{{ messages|selectattr('__class__')|list }}",
    "{{ messages|sort(attribute='__class__') }}",
    "{% set x = namespace() %}{% set x.__class__ = 1 %}{{ x }}",
    "{{ '{a.__class__}'.format_map({'a': ''}) }}",
    "{{ '%s'|format(messages.__class__) }}",
    "{{ ''.format.__self__ }}",
    "{{ (''|attr('format'))('{0.__class__}', '') }}",
    "{{ '{0.__class__.__mro__}'.format(messages) }}",
    "{{ '{0.__init__.__globals__}'.format(cycler) }}",
    "{{ '{0[__class__]}'.format({'__class__': 1}) }}",
    "{% set l = [1] %}{{ l.append(2) }}{{ l }}",
    "{% set d = {} %}{{ d.update({'a': 1}) }}",
    "{{ messages.clear() }}",
    "{{ messages[0].update(role='x') }}",
    "{{ dict.fromkeys }}",
    "{{ (1).__class__.__base__ }}",
    "{{ range.__init__ }}",
]


def escapes(canary: Path) -> list[str]:
    out = []
    for obj in OBJECTS:
        for chain in CHAINS:
            first = chain.split(".")[0].split("(")[0].split("[")[0]
            for source in (f"{{{{ {obj}.{chain} }}}}", f"{{{{ ({obj})|attr('{first}') }}}}",
                           f"{{{{ ({obj})['{first}'] }}}}", f"{{{{ '{{0.{first}}}'.format({obj}) }}}}"):
                out.append(source)
    out = [f"{{% for item in messages %}}{s}{{% endfor %}}" if "loop" in s else
           f"{{% macro m() %}}{s}{{% endmacro %}}{{% call m() %}}x{{% endcall %}}" if "caller" in s else s
           for s in out]
    return [s.replace("CANARY", str(canary)) for s in [*out, *ESCAPES_BY_HAND]]


NS = "{% set ns = namespace(x=7, s='x', l=[1], a=[1, 2]) %}"
NEST = NS + "{% for i in range(40) %}{% set ns.a = [ns.a, ns.a] %}{% endfor %}"
BOMBS = [  # each stops at the time limit, or fails at once
    "{% macro f(n) %}{{ f(n + 1) }}{% endmacro %}{{ f(0) }}",
    "{% macro f(n) %}{{ g(n) }}{% endmacro %}{% macro g(n) %}{{ f(n) }}{% endmacro %}{{ f(0) }}",
    "{% macro f() %}{% call f() %}x{% endcall %}{% endmacro %}{{ f() }}",
    "{% for i in range(3) recursive %}{{ loop(range(3)) }}{% endfor %}",
    "{% for i in range(100000) recursive %}{{ loop(range(100000)) }}{% endfor %}",
    "{% for i in range(100000) %}{% if ('<a>' * 300000)|striptags %}{% endif %}{% endfor %}",
    "{{ ('x ' * 600000)|wordwrap(1) }}",
    "{{ ('www.a.com ' * 90000)|urlize }}",
    "{{ lipsum(n=99999, min=900, max=1000) }}",
    NS + "{% for i in range(100000) %}{% for j in range(100000) %}{% set ns.x = ns.x + 1 %}{% endfor %}"
         "{% endfor %}",
    "{% set c = cycler(1, 2) %}{% for i in range(100000) %}{% for j in range(100000) %}{{ c.next() and '' }}"
    "{% endfor %}{% endfor %}",
    "{{ range(100000)|list|map('string')|map('center', 100)|join|length }}"
    "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}",
    "{% for i in range(100000) %}{% for j in range(100) %}x{% endfor %}{% endfor %}",
    "{{ 'x' * 10**10 }}",
    "{{ [0] * 10**9 }}",
    "{{ 'x' * 1000001 }}",
    "{{ 'x'.ljust(10**10) }}",
    "{{ 'x'|center(10000000000) }}",
    "{{ ('x\\n' * 500000)|indent(1000000) }}",
    "{{ '%999999999s'|format('x') }}",
    "{{ '{:>999999999}'.format('x') }}",
    "{{ ('x' * 100000).replace('x', 'y' * 100000) }}",
    "{{ ('\\t' * 100000).expandtabs(100000) }}",
    "{{ ('x' * 1000000).join(['a'] * 1000000) }}",
    "{% for i in range(10**9) %}{% endfor %}",
    "{% for i in range(0, 10**18) %}{% endfor %}",
    "{{ range(10**6)|list }}",
    "{{ 10 ** (10 ** 8) }}",
    "{{ 10 ** (10 ** 6) }}",
    NS + "{% for i in range(64) %}{% set ns.x = ns.x * ns.x %}{% endfor %}",
    NS + "{% for i in range(64) %}{% set ns.x = ns.x ** 2 %}{% endfor %}",
    NS + "{% for i in range(64) %}{% set ns.s = ns.s ~ ns.s %}{% endfor %}",
    NS + "{% for i in range(64) %}{% set ns.s = ns.s + ns.s %}{% endfor %}",
    NS + "{% for i in range(64) %}{% set ns.l = ns.l + ns.l %}{% endfor %}",
    NS + "{% for i in range(100000) %}{% set ns.l = ns.l + [('y' * 1000000) ~ i] %}{% endfor %}",
    "{% set x %}{% for i in range(100000) %}{{ ('x' * 900000) ~ i }}{% endfor %}{% endset %}",
    "{% macro m() %}{% for i in range(100000) %}{{ 'x' * 100000 }}{% endfor %}{% endmacro %}"
    "{% set y = m() %}",
    "{{ raise_exception('x' * 10**6) }}",
    "{{ 1 / 0 }}",
    "{{ 'a' + 1 }}",
    "{{ 10.0 ** 1000 }}",
    "{{ {}['missing'].attribute }}",
    "{{ strftime_now('%Y' * 1000000) }}",
    "{{ undefined_name.attribute }}",
    NEST + "{{ ns.a|tojson|length }}",
    NEST + "{{ ns.a|pprint }}",
    "{{ " + "(" * 100000 + "1" + ")" * 100000 + " }}",
    "{% if true %}" * 10000 + "x" + "{% endif %}" * 10000,
    "{{ x }}" * 300000,
    "{% for %}",
    "{{ 'unterminated }}",
    "{% macro %}",
    "{% endfor %}",
    "{{ }}" * 10,
]
C_LEVEL_BOMBS = [NEST + "{{ ns.a }}", NEST + "{{ ns.a|string|length }}", NEST + "{{ ns.a|join }}",
                 NEST + "{{ ns.a ~ '' }}"]  # printed by C until the memory limit


def resource_bombs() -> list[tuple[str, str]]:
    """(kind, source): kind "python" stops at the time limit; "c" runs in C until the memory limit."""
    cases: list[tuple[str, str]] = []
    for depth, size in ((2, 100000), (3, 10000), (4, 1000), (2, 50000)):
        loops = "".join(f"{{% for i{d} in range({size}) %}}" for d in range(depth))
        for body in ("", "{% set x = i0 %}", "{{ '' }}", "{% if i0 > 10**9 %}x{% endif %}"):
            cases.append(("python", loops + body + "{% endfor %}" * depth))
    big = "{% set s = 'ab' * 50000 %}"
    cases += [("python", big + "{% for a in s %}{% for b in s %}{% endfor %}{% endfor %}"),
              ("python", big + "{% for a in s %}{{ s|length }}{% endfor %}"
                               "{% for a in s %}{% for b in s %}{% endfor %}{% endfor %}")]
    for branches, depth in ((2, 40), (2, 60), (3, 30), (10, 20)):
        calls = "".join("{{ f(n - 1) }}" for _ in range(branches))
        macro = f"{{% macro f(n) %}}{{% if n > 0 %}}{calls}{{% endif %}}{{% endmacro %}}"
        cases.append(("python", macro + f"{{{{ f({depth}) }}}}"))
    for count, width in ((100000, 100000), (10, 1000000), (100000, 11), (2, 500001)):
        cases.append(("python", f"{{% for i in range({count}) %}}{{{{ 'x' * {width} }}}}{{% endfor %}}"))
    return cases + [("python", s) for s in BOMBS] + [("c", s) for s in C_LEVEL_BOMBS]


def tokenizer_with(metadata, source: str) -> Tokenizer:
    return Tokenizer.from_metadata({**metadata, "tokenizer.chat_template": source})


def outcome(metadata, source: str) -> tuple[str, float]:
    """'rendered: text' or 'error: message', and the seconds it took (compile and render)."""
    started = time.perf_counter()
    try:
        text = tokenizer_with(metadata, source).apply_chat_template(CONVERSATION)
        result = f"rendered: {text}"
    except TokenizerError as error:
        assert "\n" not in str(error) and len(str(error)) <= 400, str(error)[:500]
        result = f"error: {error}"
    return result, time.perf_counter() - started


def kind_of(result: str) -> str:
    for kind, marker in (("time", "time limit"), ("memory", "memory limit"), ("output", "output passed"),
                         ("numbers", "bits with"), ("repeat", "repeats a value"), ("recursion", "recursed"),
                         ("sandbox", "sandbox forbids"), ("parse", "does not parse"),
                         ("rendered", "rendered:")):
        if marker in result:
            return kind
    return "other error"


@pytest.fixture(scope="module")
def metadata(smollm2_path):
    return dict(GGUFFile.open(smollm2_path).metadata)


@pytest.mark.slow
def test_sandbox_escapes_fail_or_read_nothing(metadata, tmp_path) -> None:
    canary = tmp_path / "pwned"
    cases = escapes(canary)
    results = [(source, *outcome(metadata, source)) for source in cases]
    kinds = Counter(kind_of(result) for _, result, _ in results)
    slowest = max(seconds for *_, seconds in results)
    print(f"\n{len(cases)} sandbox escapes: " + ", ".join(f"{k} {v}" for k, v in kinds.most_common())
          + f"; slowest {slowest:.2f} s")
    leaked = [(source, result[:200]) for source, result, _ in results
              if result.startswith("rendered:") and LEAKS.search(result)]
    assert not leaked, leaked[:5]
    assert not canary.exists(), "a template ran a shell command"
    assert len(cases) >= 2000


@pytest.mark.slow
def test_resource_bombs_stop_at_the_limits(metadata, monkeypatch) -> None:
    monkeypatch.setattr(chat, "TIME_LIMIT_SECONDS", BULK_LIMIT)
    cases = resource_bombs()
    results = [(kind, source, *outcome(metadata, source)) for kind, source in cases]
    rendered = [(source[:120], result[:80]) for _, source, result, _ in results
                if result.startswith("rendered:")]
    kinds = Counter(kind_of(result) for _, _, result, _ in results)
    slowest = {kind: max(seconds for k, *_, seconds in results if k == kind) for kind in ("python", "c")}
    print(f"\n{len(cases)} resource bombs, time limit {BULK_LIMIT:g} s: "
          + ", ".join(f"{k} {v}" for k, v in kinds.most_common())
          + f"; slowest {slowest['python']:.2f} s (Python), {slowest['c']:.2f} s (in C)")
    assert not rendered, rendered


@pytest.mark.slow
def test_the_real_limit_through_the_real_front_doors(metadata, smollm2_path, tmp_path, capsys) -> None:
    """With the default 10 s: the Tokenizer path, `ember generate --chat` and `Model.chat` on a file
    whose template was rewritten in place (same length, so the rest of the file is untouched)."""
    import ember
    from ember import cli

    limit = chat.TIME_LIMIT_SECONDS
    endless = "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}"
    exponential = "{% macro f(n) %}{% if n %}{{ f(n - 1) }}{{ f(n - 1) }}{% endif %}{% endmacro %}{{ f(60) }}"
    filtering = ("{% set s = '<a>' * 333333 %}{% for i in range(100000) %}{% if (s ~ s ~ s)|striptags %}"
                 "{% endif %}{% endfor %}")  # markupsafe's Python loop, 100,000 times over a million tags
    for source in (endless, filtering, exponential):
        result, seconds = outcome(metadata, source)
        with capsys.disabled():
            print(f"\n  default limit: {result[:70]}... after {seconds:.2f} s")
        assert "time limit of 10 s" in result and seconds >= limit

    original = metadata["tokenizer.chat_template"].encode()
    hostile = (endless + "{#").encode().ljust(len(original) - 2, b" ") + b"#}"
    path = tmp_path / "hostile.gguf"
    shutil.copyfile(smollm2_path, path)
    data = path.read_bytes()[: 4 << 20]
    at = data.index(struct.pack("<Q", len(original)) + original) + 8
    with open(path, "r+b") as f:
        f.seek(at)
        f.write(hostile)
    assert GGUFFile.open(path).metadata["tokenizer.chat_template"] == hostile.decode()

    started = time.perf_counter()
    code = cli.main(["generate", "Hi", "--chat", "--model", str(path), "--no-mlflow", "--quiet"])
    seconds = time.perf_counter() - started
    out, err = capsys.readouterr()
    with capsys.disabled():
        print(f"  ember generate --chat: exit {code} after {seconds:.2f} s: {err.strip()[:90]}")
    assert code == 2 and out == "" and err.count("\n") == 1 and err.startswith("ember: the chat template ran")
    assert seconds >= limit

    model = ember.load_model(path, context_length=256, threads=1)
    started = time.perf_counter()
    with pytest.raises(TokenizerError, match="time limit of 10 s"):
        model.chat([{"role": "user", "content": "Hi"}], max_new_tokens=2)
    seconds = time.perf_counter() - started
    with capsys.disabled():
        print(f"  Model.chat: TokenizerError after {seconds:.2f} s")
    assert seconds >= limit
