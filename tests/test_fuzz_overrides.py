"""Fuzzing the front doors: every malformed command line is one `ember:` line on stderr and exit 2.

Cases are generated from a fixed seed, systematically: each key of the runner's config with values of
the wrong type or out of range, misspelt keys (top level and nested), misspelt and empty group options,
malformed override syntax, bad experiment parameters; and `ember generate` with bad options. Each
goes through the real entry point: `ember.run.main(argv)` / `ember.cli.main(argv)` in this process
(what `python -m ember.run` and `ember` call; Hydra composes the config as it does in a process of
its own), and a seeded sample also as real subprocesses, whose stderr and status must be the same.
"""

from __future__ import annotations

import os
import random
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from ember import cli
from ember import run as runner
from ember.runconfig import _MLFLOW_KEYS, _MODEL_KEYS, _SAMPLING_KEYS, _TOP_LEVEL_KEYS

REPO = Path(__file__).resolve().parent.parent
CONF = REPO / "conf"
SEED = 13
SUBPROCESS_SAMPLE = 12

# Values each key refuses (the runner's own rules: runconfig.py), with a valid context when one is needed.
BAD_VALUES: dict[str, list[str]] = {
    "max_new_tokens": ["-1", "-100", "abc", "1.5", "[1,2]", "{a:1}", "true", "null", "''", "100000"],
    "threads": ["0", "-2", "abc", "2.5", "[1]", "true", "{}"],
    "layer": ["abc", "1.5", "[1]", "true", "{a:1}"],
    "intervention_effect": ["maybe", "2", "[]", "1.0", "null", "yes"],
    "tracing": ["maybe", "3", "[true]", "null"],
    "trace_layers": ["maybe", "true", "7"],  # true without tracing=true is refused too
    "stop_at_eog": ["maybe", "0.5", "[]", "null"],
    "prompt": ["[1,2]", "{a:1}", "''", "null"],
    "messages": ["[1,2]", "abc", "[{role:robot,content:hi}]", "[{role:user}]", "[]", "{role:user}", "[[]]",
                 "[{role:user,content:[1]}]"],
    "sampling.temperature": ["-1", "abc", "inf", "nan", "[1]", "-0.5"],
    "sampling.top_k": ["-1", "1.5", "abc", "[]"],
    "sampling.top_p": ["0", "1.5", "-0.1", "abc", "nan", "2"],
    "sampling.min_p": ["1", "-0.1", "2", "abc", "nan"],
    "sampling.seed": ["-1", "abc", "1.5", "[0]"],
    "model.context_length": ["0", "-5", "abc", "100000", "1.5", "[]"],
    "model.weights": ["float16", "abc", "1", "null", "[quantized]"],
    "model.source": ["no-such-model", "/nonexistent/model.gguf", "''", "[1]", "null", "42"],
    "model.family": ["gemma3", "[1]", "qwen3", "{a:b}"],
    "mlflow.enabled": ["maybe", "2", "[]"],
    "mlflow.experiment_name": ["[1]", "null", "{a:1}"],
    "mlflow.tracking_uri": ["[1]", "{a:1}", "bogus://nowhere"],
    "data": ["nosuchset", "capitalz", "file"],  # file needs data.path
}
# Valid settings mixed into cases: a mistake must be found whatever else the line says.
CONTEXTS = [[], ["sampling=default"], ["experiment=zero_layer", "layer=3"], ["max_new_tokens=4"],
            ["mlflow.experiment_name=t_fuzz"], ["experiment=activation_stats"], ["prompt=Hello"]]
GROUPS = {"experiment": sorted(p.stem for p in (CONF / "experiment").glob("*.yaml")),
          "model": sorted(p.stem for p in (CONF / "model").glob("*.yaml")),
          "sampling": sorted(p.stem for p in (CONF / "sampling").glob("*.yaml")),
          "data": sorted(p.stem for p in (CONF / "data").glob("*.yaml")),
          "mlflow": sorted(p.stem for p in (CONF / "mlflow").glob("*.yaml")),
          "hydra/launcher": ["basic", "joblib", "ray", "submitit_local"]}
SYNTAX = ["layer=[1,2", "layer=]", "=5", "max_new_tokens", "prompt=${nothing}", "prompt=${", "layer=1,2",
          "+max_new_tokens=3", "~nothing", "prompt='unterminated", "layer={", "--bogus", "-x",
          "experiments.0.layer=3", "sampling.top_k=1,2", "layer=range(0,3)", "layer==1", "a b=1",
          "prompt=\"half", "model.=1", ".=1", "messages=[{role:user,content:hi}", "layer=[1,[2]",
          "--config-name", "experiment=", "sampling=", "++", "-m layer=1"]
EXPERIMENTS = [
    ["experiments=[{name:nosuch}]"], ["experiments=[{name:zero_layer_output}]"],
    ["experiments=[{name:zero_layer_output,layer:3,strength:2}]"], ["experiments=[{_target_:no.such.Thing}]"],
    ["experiments=[{_target_:os.path.join}]"], ["experiments=[5]"], ["experiments=5"], ["experiments={a:1}"],
    ["experiments=[{name:zero_layer_output,layer:3,_target_:x.Y}]"], ["experiments=[{layer:3}]"],
    ["experiment=zero_layer", "layer=30"], ["experiment=zero_layer", "layer=-31"],
    ["experiment=zero_layer", "layer=abc"], ["experiment=zero_layer"],
    ["experiment=stats_and_zero", "layer=99"],
    ["experiment=ablation", "layer=3", "experiments.0.mode=bogus"],
    ["experiment=ablation", "layer=3", "experiments.0.target=bogus"],
    ["experiment=ablation", "layer=[]"], ["experiment=ablation", "layer=[3,abc]"],
    ["experiment=logit_lens", "experiments.0.top_k=0"],
    ["experiment=logit_lens", "experiments.0.figure_items=-1"],
    ["experiment=logit_lens", "experiments.0.top_k=abc"],
    ["experiment=steering", "experiments.0.scale=nan"], ["experiment=steering", "experiments.0.method=bogus"],
    ["experiment=steering", "experiments.0.vector=/nonexistent.gguf"],
    ["experiment=steering", "experiments.0.layers=null"], ["experiment=steering", "experiments.0.pool=max"],
    ["experiment=steering", "layer=40"],
    ["experiment=activation_patching", "data=capitals", "experiments.0.sites=[bogus]"],
    ["experiment=activation_patching", "data=capitals", "experiments.0.span=bogus"],
    ["experiment=head_patching", "data=ioi", "experiments.0.heads=[99]"],
    ["experiment=head_patching", "data=ioi", "experiments.0.positions=[bogus]"],
    ["experiment=head_patching", "data=ioi", "experiments.0.together=maybe"],
    ["experiment=custom_steering", "experiments.0.scale=abc"], ["experiment=custom_steering", "layer=31"],
    ["experiment=custom_steering", "experiments.0.seed=1.5"],
    ["experiment=zero_layer", "layer=3", "experiments.0.target=nothing"],
    ["experiment=zero_layer", "layer=3", "experiments.0.phases=sometimes"],
]


def typo(rng: random.Random, word: str, known: set[str]) -> str:
    """A misspelling of `word` that is not a known name (a deletion, swap, doubling or replacement)."""
    letters = "abcdefghijklmnopqrstuvwxyz_"
    for _ in range(100):
        at = rng.randrange(len(word))
        how = rng.randrange(4)
        if how == 0 and len(word) > 1:
            candidate = word[:at] + word[at + 1:]
        elif how == 1 and at + 1 < len(word):
            candidate = word[:at] + word[at + 1] + word[at] + word[at + 2:]
        elif how == 2:
            candidate = word[:at] + word[at] + word[at:]
        else:
            candidate = word[:at] + rng.choice(letters) + word[at + 1:]
        if candidate not in known and candidate != word and candidate[0].isalpha():
            return candidate
    raise AssertionError(f"no typo of {word!r}")


def runner_cases() -> list[list[str]]:
    rng = random.Random(SEED)
    cases: list[list[str]] = []
    for key, values in BAD_VALUES.items():  # wrong types and ranges, in a random valid context
        for value in values:
            context = [c for c in rng.choice(CONTEXTS) if not c.startswith(key.split(".")[0] + "=")]
            cases.append([*context, f"{key}={value}"])
    nested = {"": _TOP_LEVEL_KEYS, "model": _MODEL_KEYS, "sampling": _SAMPLING_KEYS, "mlflow": _MLFLOW_KEYS}
    for parent, keys in nested.items():  # misspelt keys, two typos of each
        for key in sorted(keys):
            for _ in range(2):
                name = typo(rng, key, set(keys) | set(GROUPS))
                cases.append([*rng.choice(CONTEXTS), f"{parent + '.' if parent else ''}{name}=1"])
    for group, options in GROUPS.items():  # misspelt options, and junk
        for option in options:
            cases.append([f"{group}={typo(rng, option, set(options))}"])
        cases.append([f"{group}={rng.choice(['x', 'nothing', 'NONE', '42', 'a-b'])}"])
    for text in SYNTAX:
        cases.append([*rng.choice(CONTEXTS), text])
    cases.extend(EXPERIMENTS)
    return cases


def cli_cases() -> list[list[str]]:
    rng = random.Random(SEED + 1)
    bad = [["--max-new-tokens", v] for v in ("abc", "1.5", "-1", "100000")]
    bad += [["--top-k", v] for v in ("abc", "-1", "2.5")] + [["--seed", v] for v in ("abc", "-3")]
    bad += [["--context-length", v] for v in ("0", "-1", "abc", "100000")]
    bad += [["--threads", v] for v in ("0", "-4", "x")]
    bad += [["--temperature", v] for v in ("-1", "abc", "nan", "inf")]
    bad += [["--top-p", v] for v in ("0", "1.5", "nan", "x")] + [["--min-p", v] for v in ("1", "-0.5", "nan")]
    bad += [["--weights", v] for v in ("f16", "")] + [["--model", v] for v in ("nosuch", "/nonexistent.gguf")]
    bad += [["--experiment", v] for v in ("", ":layer=3", "zero_layer_output:layer", "nosuch",
                                          "zero_layer_output:layer=99", "zero_layer_output:layer=abc",
                                          "zero_layer_output:layer=3,strength=2",
                                          "ablation:layer=3,mode=bogus",
                                          "zero_layer_output:=3", "logit_lens:top_k=0",
                                          "steering:scale=nan,layers=3", "zero_layer_output:layer=[1,")]
    bad += [["--trace-layers"], ["--bogus"], ["--dump-layers", "--experiment", "zero_layer_output:layer=3"],
            ["--mlflow-uri", "bogus://x"], ["-x"]]
    good = [["--no-mlflow"], ["--quiet"], ["--temperature", "0.5"], ["--seed", "3"],
            ["--max-new-tokens", "2"], ["--top-k", "5"], ["--chat"]]
    cases = []
    for option in bad:
        for _ in range(2):
            extra = [g for g in rng.sample(good, rng.randrange(3)) if g[0] != option[0]]
            cases.append(["generate", "Hello", *[a for g in extra for a in g], *option])
    cases += [["generate"], ["generate", "--no-mlflow"], ["bogus-command"], ["generate", ""],
              ["generate", "Hi", "extra-argument"]]
    return cases


@pytest.fixture(scope="module")
def workdir(workdir, gemma3_path):
    """conftest's folder to run from, with Gemma 3 fetched too."""
    return workdir


pytestmark = pytest.mark.usefixtures("no_outside_store")


def in_process(main, args: list[str], capsys) -> tuple[int | str, str, str, float]:
    started = time.perf_counter()
    try:
        code: int | str = main(list(args))
    except BaseException as error:  # a finding: recorded with the others, not the end of the test
        code = f"raised {type(error).__name__}: {error}"
    out, err = capsys.readouterr()
    return code, out, err, time.perf_counter() - started


def one_line(code: int | str, out: str, err: str) -> bool:
    lines = [line for line in err.splitlines() if line.strip()]
    return code == 2 and out == "" and len(lines) == 1 and lines[0].startswith("ember: ")


def subprocess_run(workdir: Path, front_door: list[str], args: list[str]) -> tuple[int, str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("MLFLOW_TRACKING_URI", "HYDRA_FULL_ERROR")}
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), str(REPO / "tests"), env.get("PYTHONPATH", "")])
    done = subprocess.run([sys.executable, *front_door, *args], cwd=workdir, env=env, capture_output=True,
                          text=True, timeout=300)
    return done.returncode, done.stdout, done.stderr


def check(label: str, main, front_door: list[str], cases: list[list[str]], workdir: Path, capsys) -> None:
    started = time.perf_counter()
    results = [(args, *in_process(main, args, capsys)) for args in cases]
    failures = [(args, code, err) for args, code, out, err, _ in results if not one_line(code, out, err)]
    seconds = sorted(r[-1] for r in results)
    sample = random.Random(SEED).sample(cases, SUBPROCESS_SAMPLE)
    with ThreadPoolExecutor(2) as pool:
        real = list(pool.map(lambda args: subprocess_run(workdir, front_door, args), sample))
    by_args = {tuple(args): (code, out, err) for args, code, out, err, _ in results}
    differ = [(args, got, by_args[tuple(args)]) for args, got in zip(sample, real, strict=True)
              if got != by_args[tuple(args)]]
    messages = {err.split(":", 2)[1].strip()[:28] for *_, err, _ in results if err.startswith("ember:")}
    print(f"\n{label}: {len(cases)} malformed command lines in {time.perf_counter() - started:.0f} s; "
          f"one line and exit 2: {len(cases) - len(failures)}; in-process seconds median "
          f"{seconds[len(seconds) // 2]:.2f}, max {seconds[-1]:.2f}; {SUBPROCESS_SAMPLE} also as "
          f"subprocesses, identical: {SUBPROCESS_SAMPLE - len(differ)}; {len(messages)} distinct openings")
    assert not failures, "\n".join(f"{args}: exit {code}: {err[-600:]}" for args, code, err in failures[:8])
    assert not differ, differ[:3]


@pytest.mark.slow
def test_malformed_runner_overrides_are_one_line_and_exit_2(workdir, capsys) -> None:
    cases = runner_cases()
    assert len(cases) >= 200
    check("python -m ember.run", runner.main, ["-m", "ember.run"], cases, workdir, capsys)
    from mlflow.tracking import MlflowClient

    store = MlflowClient(f"sqlite:///{workdir / 'outputs' / 'mlflow.db'}")
    assert [e.name for e in store.search_experiments()] == ["Default"], "a mistake recorded a run"


@pytest.mark.slow
def test_malformed_cli_options_are_one_line_and_exit_2(workdir, capsys) -> None:
    cases = cli_cases()
    assert len(cases) >= 60
    check("ember generate", cli.main, ["-m", "ember.cli"], cases, workdir, capsys)
