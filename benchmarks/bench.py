"""ember against llama.cpp and transformers: same GGUF, same token ids, same thread count, same run.

    python -m benchmarks.bench                               # SmolLM2-135M, all three engines
    python -m benchmarks.bench --repeats 5 --threads 2 --json out.json
    python -m benchmarks.bench --model gemma3-270m --engines llama.cpp,transformers
    python -m benchmarks.bench --model ladder                # the model-size ladder (benchmarks/ladder.py)
    python -m benchmarks.bench --model families              # one synthetic shape per later family
    python -m benchmarks.bench --model llama-3.2-1b --engines ember,ember:float32,llama.cpp

Models are ember's known names (smollm2-135m, gemma3-270m), the synthetic shapes of
benchmarks/synthetic.py (written into the ember cache on first use), `ladder` (all of them, smallest
first), `families` (benchmarks/ladder.py FAMILIES: Qwen2.5-7B, Phi-4-mini, Gemma-2-9B, OLMo-2-7B,
SmolLM3-3B, gpt-oss-20b, Granite-3.3-2B, Ministral-3-3B shapes) or `--gguf PATH`. Engines: `ember` (its
default weights), `ember:float32` / `ember:quantized` / `ember:quantized-q8` (`ember.load_model(...,
weights=...)`, passed only when this ember has the option; quantized-q8 rounds decode's K-quant
activations to 8 bits as llama.cpp does), `llama.cpp`, `transformers`.

Every measurement runs in its own fresh subprocess, so load times start with nothing warm in memory and
each peak RSS belongs to one engine. For every repeat and engine there are two processes:

* cold: loads the model and exits. For ember every cache is empty: EMBER_CACHE and NUMBA_CACHE_DIR
  point at new temporary directories, so the load includes writing the weight cache or compiling the
  kernels. llama.cpp and transformers keep no cache, so their cold and warm loads differ only by what
  the OS page cache holds (it is not dropped: the machine is shared).
* warm: loads again (ember: from the caches the cold process filled), warms up on a short prompt, then
  times prefill at each prompt length and greedy decode of the new tokens after the first prompt length.

The engines take turns within a repeat so that a change in the machine's load hits all of them alike.
Printed figures are medians over the repeats; the JSON file holds every run. A worker is started only
when its estimated resident memory fits the machine's available memory less a reserve, runs under an
address-space limit and a watchdog, and is reported as failed (with its signal) if it dies
(benchmarks/memory_guard.py).

Prefill is timed from the first prompt token to the logits of the last one (only the last position's
logits are computed by every engine). Decode is timed per step: one token in, next greedy token out;
`--new-tokens` tokens are produced, the first by the prefill, so there are `new_tokens - 1` decode steps.
"""

from __future__ import annotations

import argparse
import inspect
import json
import os
import platform
import resource
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from benchmarks.machine_load import (
    LoadMeter,
    process_cpu_seconds,
    self_and_children_cpu_seconds,
    wait_for_quiet,
)
from benchmarks.memory_guard import (
    ADDRESS_SPACE_SLACK,
    GIB,
    directory_bytes,
    mem_available,
    run_watched,
)

ENGINES = ("ember", "llama.cpp", "transformers")
EMBER_WEIGHTS = ("quantized", "float32", "quantized-q8")
REPO_ROOT = Path(__file__).resolve().parents[1]
OPENBLAS_VARIABLES = ("OPENBLAS_CORETYPE", "OPENBLAS_L2_SIZE")

# Issue 2's targets for a single model, as ember / llama.cpp throughput (the ladder has its own,
# per model: benchmarks/ladder.py).
TARGETS = {"prefill": 1.5, "decode": 0.4}

# A fixed English text; its token ids, repeated and cut, are every engine's prompt.
PROMPT_TEXT = (
    "The old lighthouse keeper climbed the spiral stairs every evening at dusk. He counted the steps "
    "out of habit, one hundred and twelve of them, and at the top he wiped the salt from the great "
    "glass lens before lighting the lamp. Ships passed far out on the grey water, and he wrote their "
    "names in a worn leather book: the colour of their sails, the hour they went by, and the direction "
    "of the wind. In winter the storms came in from the north and the whole tower hummed like a bell. "
)


# llama.cpp's variants: `no-repack` keeps every weight in the mapped file (use_extra_bufts off). By
# default its CPU backend copies the weights it can interleave into buffers of its own, on top of the
# mapped file: Qwen3-30B-A3B (18.6 GB) went past 22.4 GiB resident that way and was stopped (2026-12-04),
# where without the copies it ran in 17.4 GiB.
LLAMA_CPP_VARIANTS = ("no-repack",)


def parse_engine(spec: str) -> tuple[str, str | None]:
    """'ember:float32' -> ('ember', 'float32'); 'llama.cpp' -> ('llama.cpp', None);
    'llama.cpp:no-repack' -> ('llama.cpp', 'no-repack')."""
    kind, _, weights = spec.partition(":")
    variants = {"ember": EMBER_WEIGHTS, "llama.cpp": LLAMA_CPP_VARIANTS}.get(kind, ())
    if kind not in ENGINES or (weights and weights not in variants):
        raise ValueError(f"unknown engine {spec!r}; choose from {', '.join(ENGINES)}, "
                         + ", ".join(f"ember:{w}" for w in EMBER_WEIGHTS)
                         + ", ".join(f", llama.cpp:{v}" for v in LLAMA_CPP_VARIANTS))
    return kind, weights or None


# ----------------------------------------------------------------------------------------------------
# Engines, as seen from a worker process. Each one loads in __init__ and offers prefill and decode.


def ember_has_weights_option() -> bool:
    """Whether this ember's load_model takes weights="quantized" | "float32" (issue 11)."""
    import ember

    return "weights" in inspect.signature(ember.load_model).parameters


class EmberEngine:
    def __init__(self, job: dict[str, Any]) -> None:
        import ember

        kwargs: dict[str, Any] = {}
        weights = job.get("ember_weights")
        supported = ember_has_weights_option()
        if weights is not None and supported:
            kwargs["weights"] = weights
        elif weights not in (None, "float32"):
            raise RuntimeError(f"this ember's load_model has no weights= option, so weights={weights!r} "
                               "cannot be asked for (it keeps float32 weights)")
        start = time.perf_counter()
        self.model = ember.load_model(
            job["gguf"], context_length=job["context_length"], threads=job["threads"], **kwargs
        )
        self.load_seconds = time.perf_counter() - start
        self.details: dict[str, Any] = {
            "version": ember.__version__,
            "reported_load_seconds": self.model.load_seconds,
            "threads": self.model.threads,
            "weights_option": supported,
            "weights": weights or ("default" if supported else "float32"),
        }

    def prefill(self, ids: list[int]) -> float:
        generation = self.model.generate(ids, max_new_tokens=1, temperature=0.0, add_bos=False)
        return generation.timings.prefill_seconds

    def decode(self, ids: list[int], new_tokens: int) -> tuple[float, int]:
        generation = self.model.generate(
            ids, max_new_tokens=new_tokens, temperature=0.0, add_bos=False, stop_at_eog=False
        )
        timings = generation.timings
        return timings.decode_seconds, timings.decode_evaluations


class LlamaCppEngine:
    def __init__(self, job: dict[str, Any]) -> None:
        import llama_cpp
        import numpy

        self._numpy = numpy
        batch = max(512, max(job["prompt_lengths"]))
        repack = job.get("ember_weights") != "no-repack"  # the variant travels in the weights field
        if not repack:
            default_params = llama_cpp.llama_model_default_params

            def without_repacking() -> Any:
                params = default_params()
                params.use_extra_bufts = False
                return params

            llama_cpp.llama_model_default_params = without_repacking
            llama_cpp.llama.llama_cpp.llama_model_default_params = without_repacking
        start = time.perf_counter()
        self.llm = llama_cpp.Llama(
            model_path=job["gguf"],
            n_ctx=job["context_length"],
            n_batch=batch,
            n_ubatch=batch,
            n_threads=job["threads"],
            n_threads_batch=job["threads"],
            verbose=False,
        )
        self.load_seconds = time.perf_counter() - start
        self.vocab_size = self.llm.n_vocab()
        self.details = {"version": llama_cpp.__version__, "n_batch": batch, "flash_attn": False,
                        "repack": repack,
                        "system_info": llama_cpp.llama_print_system_info().decode(errors="replace")}

    def _next_token(self) -> int:
        pointer = self.llm._ctx.get_logits_ith(-1)
        logits = self._numpy.ctypeslib.as_array(pointer, shape=(self.vocab_size,))
        return int(logits.argmax())

    def prefill(self, ids: list[int]) -> float:
        self.llm.reset()
        start = time.perf_counter()
        self.llm.eval(ids)
        self._next_token()
        return time.perf_counter() - start

    def decode(self, ids: list[int], new_tokens: int) -> tuple[float, int]:
        self.llm.reset()
        self.llm.eval(ids)
        token = self._next_token()
        total = 0.0
        for _ in range(new_tokens - 1):
            start = time.perf_counter()
            self.llm.eval([token])
            token = self._next_token()
            total += time.perf_counter() - start
        return total, new_tokens - 1


class TransformersEngine:
    def __init__(self, job: dict[str, Any]) -> None:
        import torch
        import transformers

        self._torch = torch
        torch.set_num_threads(job["threads"])
        path = Path(job["gguf"])
        start = time.perf_counter()
        self.model = transformers.AutoModelForCausalLM.from_pretrained(
            str(path.parent), gguf_file=path.name, dtype=torch.float32
        )
        self.model.eval()
        self.load_seconds = time.perf_counter() - start
        self.details = {
            "version": transformers.__version__,
            "torch": torch.__version__,
            "torch_threads": torch.get_num_threads(),
            "attention": self.model.config._attn_implementation,
        }

    def _forward(self, ids: list[int], cache: Any) -> tuple[int, Any]:
        with self._torch.inference_mode():
            output = self.model(
                input_ids=self._torch.tensor([ids]), past_key_values=cache, use_cache=True, logits_to_keep=1
            )
        return int(output.logits[0, -1].argmax()), output.past_key_values

    def prefill(self, ids: list[int]) -> float:
        start = time.perf_counter()
        self._forward(ids, None)
        return time.perf_counter() - start

    def decode(self, ids: list[int], new_tokens: int) -> tuple[float, int]:
        token, cache = self._forward(ids, None)
        total = 0.0
        for _ in range(new_tokens - 1):
            start = time.perf_counter()
            token, cache = self._forward([token], cache)
            total += time.perf_counter() - start
        return total, new_tokens - 1


ENGINE_CLASSES = {"ember": EmberEngine, "llama.cpp": LlamaCppEngine, "transformers": TransformersEngine}


def peak_rss_mib() -> float:
    """This process's peak resident set size (Linux reports ru_maxrss in KiB)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def blas_info() -> list[dict[str, Any]]:
    try:
        import threadpoolctl
    except ImportError:
        return []
    keys = ("internal_api", "num_threads", "version", "architecture", "threading_layer")
    return [{key: pool.get(key) for key in keys} for pool in threadpoolctl.threadpool_info()]


def run_worker(job_path: str) -> None:
    """Measure one engine in this (fresh) process and write the result where the job says."""
    job = json.loads(Path(job_path).read_text())
    result: dict[str, Any] = {"engine": job["engine"], "phase": job["phase"]}
    try:
        engine = ENGINE_CLASSES[job["kind"]](job)
        result["load_seconds"] = engine.load_seconds
        if job["phase"] == "warm":
            prompts = {int(length): ids for length, ids in job["prompts"].items()}
            warmup = prompts[min(prompts)][:16]
            engine.prefill(warmup)
            engine.decode(warmup, 4)
            result["prefill_tokens_per_second"] = {}
            for length, ids in sorted(prompts.items()):
                result["prefill_tokens_per_second"][str(length)] = length / engine.prefill(ids)
            seconds, steps = engine.decode(prompts[job["decode_prompt_length"]], job["new_tokens"])
            result["decode_steps"] = steps
            result["decode_tokens_per_second"] = steps / seconds if seconds > 0 else None
        result["details"] = engine.details
    except Exception as error:  # noqa: BLE001 - any failure is reported, not raised, to the parent
        result["error"] = f"{type(error).__name__}: {error}"
    result["peak_rss_mib"] = peak_rss_mib()
    result["blas"] = blas_info()
    Path(job["result_path"]).write_text(json.dumps(result))


# ----------------------------------------------------------------------------------------------------
# Memory: what each worker will hold, so one that cannot fit is not started.


def estimate_resident_bytes(kind: str, weights: str | None, gguf: Path) -> int:
    """A generous estimate of a worker's peak resident memory, from the file's tensors.

    llama.cpp and quantized ember hold about the file (mapped) plus buffers. ember's float32 path holds
    every tensor as float32 except per-layer embedding tables (read by rows), plus the mapped file it
    dequantizes from (measured: Llama-3.2-1B-shaped 4.2 GB against an estimate of 5.4 GB).
    transformers dequantizes everything to float32 and keeps a copy while converting.
    """
    from ember.gguf_file import GGUFFile

    file_bytes = gguf.stat().st_size
    base = GIB // 2
    if kind == "llama.cpp" or (kind == "ember" and _ember_quantized(weights)):
        return int(file_bytes * 1.2) + base
    elements = 0
    for name, info in GGUFFile.open(gguf).tensors.items():
        if name != "per_layer_token_embd.weight":
            count = 1
            for n in info.shape:
                count *= int(n)
            elements += count
    if kind == "ember":
        return 4 * elements + file_bytes + base
    return 8 * elements + 2 * GIB  # transformers, torch included


def _ember_quantized(weights: str | None) -> bool:
    """Whether an `ember[:weights]` worker keeps quantized weights (the default once ember has them)."""
    if weights is not None:
        return weights != "float32"
    return ember_has_weights_option()


# ----------------------------------------------------------------------------------------------------
# Prompt token ids, computed once in the parent and handed to every engine.


def _encoder(gguf: Path) -> tuple[str, Any]:
    """A function encode(text, add_special) -> ids from the first tokenizer that can be had."""
    errors = []
    try:
        from ember.tokenizer import Tokenizer

        tokenizer = Tokenizer.from_gguf(gguf)
        # add_bos=None follows the model's rule, False adds nothing.
        return "ember", lambda text, special: tokenizer.encode(text, add_bos=None if special else False)
    except Exception as error:  # noqa: BLE001
        errors.append(f"ember: {type(error).__name__}: {error}")
    try:
        import llama_cpp

        vocab = llama_cpp.Llama(model_path=str(gguf), vocab_only=True, verbose=False)
        return "llama.cpp", lambda text, special: vocab.tokenize(text.encode(), add_bos=special)
    except Exception as error:  # noqa: BLE001
        errors.append(f"llama.cpp: {type(error).__name__}: {error}")
    try:
        import transformers

        tokenizer = transformers.AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
        return "transformers", lambda text, special: tokenizer.encode(text, add_special_tokens=special)
    except Exception as error:  # noqa: BLE001
        errors.append(f"transformers: {type(error).__name__}: {error}")
    sys.exit("No tokenizer could encode the prompt:\n  " + "\n  ".join(errors))


def prompt_ids(gguf: Path, lengths: list[int]) -> tuple[str, dict[int, list[int]]]:
    """The fixed text's ids repeated and cut to each length, after the model's special prefix (BOS)."""
    name, encode = _encoder(gguf)
    body = list(encode(PROMPT_TEXT, False))
    with_specials = list(encode(PROMPT_TEXT, True))
    head = with_specials[: len(with_specials) - len(body)] if with_specials[-len(body):] == body else []
    prompts = {}
    for length in lengths:
        repeats = (length - len(head)) // len(body) + 1
        prompts[length] = (head + body * repeats)[:length]
    return name, prompts


# ----------------------------------------------------------------------------------------------------
# The parent: spawn workers, gather, summarise, print, write JSON.


def resolve_gguf(model: str, gguf: str | None = None) -> Path:
    """A local file for --gguf, a synthetic shape (written on first use) or one of ember's known names."""
    if gguf:
        return Path(gguf).resolve()
    from benchmarks import synthetic

    if model in synthetic.SHAPES:
        return synthetic.ensure(model).resolve()
    if model.endswith(".gguf"):
        return Path(model).resolve()
    try:
        from ember.sources import resolve_model
    except ImportError as error:
        sys.exit(f"ember.sources is not available ({error}); pass --gguf PATH to a local file.")
    return Path(resolve_model(model).path).resolve()


def spawn(
    job: dict[str, Any], env: dict[str, str], workdir: Path, args: argparse.Namespace,
    before_attempt: Callable[[], None] | None = None,
) -> dict[str, Any]:
    """Run one worker process; its result carries the load the rest of the machine put on it.
    `before_attempt` runs before every attempt (a cold load empties its caches again)."""
    name = f"{job['engine'].replace(':', '-')}-{job['phase']}-{job['repeat']}"
    job_path = workdir / f"{name}.job.json"
    job["result_path"] = str(workdir / f"{name}.result.json")
    job_path.write_text(json.dumps(job))
    command = [sys.executable, "-m", "benchmarks.bench", "--worker", str(job_path)]
    failure = {"engine": job["engine"], "phase": job["phase"]}
    budget = job["memory_budget_bytes"]
    address_space = budget + Path(job["gguf"]).stat().st_size + ADDRESS_SPACE_SLACK

    def own_seconds() -> float:  # this process, its finished workers and the --busy-core spinner
        spinner = args.spinner_pid
        return self_and_children_cpu_seconds() + (process_cpu_seconds(spinner) if spinner else 0.0)

    best: dict[str, Any] | None = None
    for attempt in range(1, args.attempts + 1):
        wait_for_quiet(args.quiet_limit, args.max_wait, own_seconds)
        result_path = Path(job["result_path"])
        result_path.unlink(missing_ok=True)
        if before_attempt is not None:
            before_attempt()
        with LoadMeter(own_seconds) as meter:
            outcome = run_watched(
                command, cwd=REPO_ROOT, env=env, timeout=args.timeout, budget_bytes=budget,
                reserve_bytes=int(args.memory_reserve * GIB), address_space_bytes=address_space,
                stdout_path=workdir / f"{name}.stdout", stderr_path=workdir / f"{name}.stderr",
            )
        problem = outcome.failure()
        if problem is not None or not result_path.exists():
            tail = (workdir / f"{name}.stderr").read_text(errors="replace").strip().splitlines()[-3:]
            detail = problem or f"worker exited {outcome.returncode} without a result"
            return failure | {"error": detail + (": " + " | ".join(tail) if tail else ""),
                              "peak_rss_seen_mib": outcome.peak_rss_seen / 2**20,
                              "memory_budget_mib": budget / 2**20}
        result = json.loads(result_path.read_text()) | {"foreign_cores": meter.foreign_cores}
        result["attempt"] = attempt
        result["memory_budget_mib"] = budget / 2**20
        if best is None or result["foreign_cores"] < best["foreign_cores"]:
            best = result
        if "error" in result or result["foreign_cores"] <= args.quiet_limit:
            break
        print(f"  {name}: others used {result['foreign_cores']:.2f} cores meanwhile; measuring again",
              file=sys.stderr, flush=True)
    assert best is not None
    return best


def median(values: list[float]) -> float | None:
    values = [value for value in values if value is not None]
    return statistics.median(values) if values else None


def summarise(runs: list[dict[str, Any]], lengths: list[int]) -> dict[str, Any]:
    cold = [run for run in runs if run["phase"] == "cold" and "error" not in run]
    warm = [run for run in runs if run["phase"] == "warm" and "error" not in run]
    summary: dict[str, Any] = {
        "cold_load_seconds": median([run["load_seconds"] for run in cold]),
        "warm_load_seconds": median([run["load_seconds"] for run in warm]),
        "prefill_tokens_per_second": {
            str(length): median([run["prefill_tokens_per_second"][str(length)] for run in warm])
            for length in lengths
        },
        "decode_tokens_per_second": median([run["decode_tokens_per_second"] for run in warm]),
        "peak_rss_mib": median([run["peak_rss_mib"] for run in warm]),
        "cold_peak_rss_mib": median([run["peak_rss_mib"] for run in cold]),
        "cache_mib": median([run["cache_mib"] for run in cold if "cache_mib" in run]),
        "successful_runs": {"cold": len(cold), "warm": len(warm)},
        "foreign_cores_max": max([run.get("foreign_cores", 0.0) for run in runs], default=None),
    }
    errors = sorted({run["error"] for run in runs if "error" in run and not run.get("skipped")})
    if errors:
        summary["errors"] = errors
    skipped = sorted({run["error"] for run in runs if run.get("skipped")})
    if skipped:
        summary["skipped"] = skipped[0]
    return summary


def ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a is not None and b else None


def ratios(summaries: dict[str, dict[str, Any]], lengths: list[int]) -> dict[str, dict[str, Any]]:
    """ember / reference for every figure (throughputs: higher is better; seconds and RSS: lower is)."""
    out: dict[str, dict[str, Any]] = {}
    for ours_name, ours in summaries.items():
        if parse_engine(ours_name)[0] != "ember":
            continue
        # every reference measured, llama.cpp's variants (`llama.cpp:no-repack`) included
        for reference in [name for name in summaries if parse_engine(name)[0] != "ember"]:
            theirs = summaries[reference]
            out[f"{ours_name}/{reference}"] = {
                "cold_load_seconds": ratio(ours["cold_load_seconds"], theirs["cold_load_seconds"]),
                "warm_load_seconds": ratio(ours["warm_load_seconds"], theirs["warm_load_seconds"]),
                "prefill_tokens_per_second": {
                    str(n): ratio(ours["prefill_tokens_per_second"][str(n)],
                                  theirs["prefill_tokens_per_second"][str(n)])
                    for n in lengths
                },
                "decode_tokens_per_second": ratio(
                    ours["decode_tokens_per_second"], theirs["decode_tokens_per_second"]
                ),
                "peak_rss_mib": ratio(ours["peak_rss_mib"], theirs["peak_rss_mib"]),
            }
    return out


def _cell(value: float | None, digits: int = 1) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


def print_report(report: dict[str, Any], single_model_targets: bool = True) -> None:
    lengths = report["prompt_lengths"]
    engines = list(report["engines"])
    rows = [
        ("cold load (s)", lambda s: _cell(s["cold_load_seconds"], 2)),
        ("warm load (s)", lambda s: _cell(s["warm_load_seconds"], 2)),
        *[
            (f"prefill {n} (tok/s)", lambda s, n=n: _cell(s["prefill_tokens_per_second"][str(n)]))
            for n in lengths
        ],
        (f"decode {report['new_tokens']} (tok/s)", lambda s: _cell(s["decode_tokens_per_second"])),
        ("peak RSS (MiB)", lambda s: _cell(s["peak_rss_mib"], 0)),
        ("cold-load peak RSS (MiB)", lambda s: _cell(s["cold_peak_rss_mib"], 0)),
        ("cache after cold (MiB)", lambda s: _cell(s.get("cache_mib"), 0)),
        ("others' load, max (cores)", lambda s: _cell(s["foreign_cores_max"], 2)),
    ]
    print(
        f"\n{report['model']} ({Path(report['gguf']).name}), threads={report['threads']}"
        f"{', one core kept busy' if report['busy_core'] else ''}, "
        f"median of {report['repeats']} repeats, prompt ids from the {report['tokenizer']} tokenizer"
    )
    width = max(15, *(len(engine) + 2 for engine in engines))
    print(f"{'':26}" + "".join(f"{engine:>{width}}" for engine in engines))
    for label, cell in rows:
        print(f"{label:26}" + "".join(f"{cell(report['engines'][engine]):>{width}}" for engine in engines))
    for name, values in report["ratios"].items():
        parts = [f"cold load {_cell(values['cold_load_seconds'], 2)}x"]
        parts.append(f"warm load {_cell(values['warm_load_seconds'], 2)}x")
        for n in lengths:
            value = values["prefill_tokens_per_second"][str(n)]
            mark = _target_mark(name, "prefill", value) if single_model_targets else ""
            parts.append(f"prefill {n} {_cell(value, 2)}x{mark}")
        value = values["decode_tokens_per_second"]
        mark = _target_mark(name, "decode", value) if single_model_targets else ""
        parts.append(f"decode {_cell(value, 2)}x{mark}")
        parts.append(f"RSS {_cell(values['peak_rss_mib'], 2)}x")
        print(f"{name}: " + ", ".join(parts))
    for engine, summary in report["engines"].items():
        if summary.get("skipped"):
            print(f"{engine}: not run: {summary['skipped']}")
        for error in summary.get("errors", []):
            print(f"{engine}: {error}")
    if single_model_targets:
        print(f"targets (ember/llama.cpp): prefill >= {TARGETS['prefill']}, decode >= {TARGETS['decode']}")


def _target_mark(name: str, figure: str, value: float | None) -> str:
    if not name.endswith("/llama.cpp") or value is None:
        return ""
    return " (meets target)" if value >= TARGETS[figure] else f" (below target {TARGETS[figure]})"


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.bench", description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2-135m",
                        help="model name(s), comma-separated: ember's known names, synthetic shapes "
                        "(python -m benchmarks.synthetic --list), 'ladder' for the ladder or 'families' "
                        "for one synthetic shape per later family")
    parser.add_argument("--gguf", help="use this local GGUF file instead of resolving --model")
    parser.add_argument("--engines", default=None,
                        help="comma-separated: ember, ember:quantized, ember:float32, llama.cpp, "
                        "transformers (default: all three engines; for several models ember and llama.cpp)")
    parser.add_argument("--ember-weights", choices=EMBER_WEIGHTS,
                        help="what plain 'ember' in --engines means (default: ember's own default)")
    parser.add_argument("--repeats", type=int, default=3, help="processes per engine and phase")
    parser.add_argument("--threads", type=int, default=os.cpu_count() or 1, help="threads for every engine")
    parser.add_argument("--prompt-lengths", default="128,512", help="prefill prompt lengths in tokens")
    parser.add_argument("--new-tokens", type=int, default=128, help="tokens generated for decode")
    parser.add_argument("--json", help="write results here (default: under benchmarks/results/)")
    parser.add_argument("--label", help="name of a multi-model run's results (default: the date)")
    # This machine sets OPENBLAS_CORETYPE/OPENBLAS_L2_SIZE for old OpenBLAS builds; they force slower
    # kernels on a current NumPy, so by default the workers run without them (what a user's machine has).
    parser.add_argument("--openblas-env", choices=("inherit", "unset"), default="unset",
                        help=f"'unset' (default) removes {' and '.join(OPENBLAS_VARIABLES)} from the "
                        "workers' env; 'inherit' keeps them")
    parser.add_argument("--timeout", type=float, default=1800, help="seconds allowed per worker process")
    parser.add_argument("--memory-reserve", type=float, default=3.0,
                        help="GiB of available memory left to everyone else: a worker whose estimate does "
                        "not fit in MemAvailable minus this is not started, one that grows past it is killed")
    parser.add_argument("--quiet-limit", type=float, default=0.3,
                        help="before each process, wait until other processes use fewer cores than this")
    parser.add_argument("--max-wait", type=float, default=300, help="longest wait for a quiet machine (s)")
    parser.add_argument("--attempts", type=int, default=3,
                        help="runs of a process whose machine was not quiet; the quietest is kept")
    parser.add_argument("--busy-core", action="store_true",
                        help="keep one core busy (a spinning process) throughout, to see the threading trap")
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    return parser.parse_args(argv)


def run_all(args: argparse.Namespace, engines: list[str], base_job: dict[str, Any], env: dict[str, str],
            runs: dict[str, list[dict[str, Any]]]) -> None:
    """Per repeat, each engine in turn: a cold process (fresh caches), then a warm one."""
    gguf = Path(base_job["gguf"])
    estimates = {engine: estimate_resident_bytes(*parse_engine(engine), gguf) for engine in engines}
    with tempfile.TemporaryDirectory(prefix="ember-bench-") as workdir:
        for repeat in range(args.repeats):
            for engine in engines:
                kind, weights = parse_engine(engine)
                budget = int(mem_available() - args.memory_reserve * GIB)
                if estimates[engine] > budget:
                    reason = (f"needs about {estimates[engine] / GIB:.1f} GiB, "
                              f"{max(budget, 0) / GIB:.1f} GiB available after the "
                              f"{args.memory_reserve:.1f} GiB reserve")
                    runs[engine].append({"engine": engine, "phase": "cold", "repeat": repeat,
                                         "skipped": True, "error": f"not started: {reason}"})
                    print(f"[{time.strftime('%H:%M:%S')}] repeat {repeat + 1}/{args.repeats} {engine}: "
                          f"skipped, {reason}", flush=True)
                    continue
                cache = Path(workdir) / f"cache-{engine.replace(':', '-')}-{repeat}"
                numba_cache = cache / "numba"
                numba_cache.mkdir(parents=True)
                worker_env = dict(env, EMBER_CACHE=str(cache), NUMBA_CACHE_DIR=str(numba_cache))
                def empty_caches(cache: Path = cache, numba_cache: Path = numba_cache) -> None:
                    shutil.rmtree(cache, ignore_errors=True)  # a retried cold load starts empty again
                    numba_cache.mkdir(parents=True)

                for phase in ("cold", "warm"):
                    job = dict(base_job, engine=engine, kind=kind, ember_weights=weights, phase=phase,
                               repeat=repeat, memory_budget_bytes=budget)
                    result = spawn(job, worker_env, Path(workdir), args,
                                   empty_caches if phase == "cold" else None)
                    result["repeat"] = repeat
                    if phase == "cold" and kind == "ember":
                        result["cache_mib"] = directory_bytes(cache) / 2**20
                    runs[engine].append(result)
                    print(f"[{time.strftime('%H:%M:%S')}] repeat {repeat + 1}/{args.repeats} {engine} "
                          f"{phase}: {_one_line(result)}", flush=True)
                    if "error" in result and phase == "cold":
                        break  # a warm process would only fail the same way
                shutil.rmtree(cache, ignore_errors=True)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    if args.worker:
        run_worker(args.worker)
        return
    from benchmarks import ladder

    models = [m.strip() for m in args.model.split(",") if m.strip()] if not args.gguf else [args.model]
    if models == ["ladder"]:
        models = list(ladder.LADDER)
    elif models == ["families"]:
        models = list(ladder.FAMILIES)
    default_engines = "ember,llama.cpp" if len(models) > 1 else ",".join(ENGINES)
    engines = [engine.strip() for engine in (args.engines or default_engines).split(",") if engine.strip()]
    if args.ember_weights:
        engines = [f"ember:{args.ember_weights}" if engine == "ember" else engine for engine in engines]
    for engine in engines:
        try:
            parse_engine(engine)
        except ValueError as error:
            sys.exit(str(error))
    reports = {}
    for model in models:  # several models: one after the other, each against the references
        args.model = model
        reports[model] = bench_model(args, engines, single=len(models) == 1)
    if len(models) == 1:
        report = reports[models[0]]
        if ladder.has_targets(report["model"]):  # judged as in the ladder's run, not by issue 2's
            report["targets"] = ladder.target_checks(report["model"], report)
            ladder.print_targets({"models": {report["model"]: report}})
        json_path = Path(args.json) if args.json else default_json_path(args, report["model"])
        json_path.parent.mkdir(parents=True, exist_ok=True)
        json_path.write_text(json.dumps(report, indent=1) + "\n")
        print(f"results written to {json_path}")
        return
    ladder.finish(reports, args, engines)


def bench_model(args: argparse.Namespace, engines: list[str], single: bool = True) -> dict[str, Any]:
    """Measure one model with every engine and print its table."""
    lengths = sorted(int(length) for length in args.prompt_lengths.split(","))
    gguf = resolve_gguf(args.model, args.gguf)
    tokenizer, prompts = prompt_ids(gguf, lengths)
    context_length = max(1024, max(lengths) + args.new_tokens)

    env = dict(os.environ, HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", TOKENIZERS_PARALLELISM="false")
    if args.openblas_env == "unset":
        for variable in OPENBLAS_VARIABLES:
            env.pop(variable, None)
    base_job = {
        "gguf": str(gguf),
        "threads": args.threads,
        "context_length": context_length,
        "prompt_lengths": lengths,
        "prompts": {str(length): ids for length, ids in prompts.items()},
        "decode_prompt_length": lengths[0],
        "new_tokens": args.new_tokens,
    }
    runs: dict[str, list[dict[str, Any]]] = {engine: [] for engine in engines}
    load_average_start = os.getloadavg()
    spinner = None
    if args.busy_core:
        import subprocess

        spinner = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    args.spinner_pid = spinner.pid if spinner else None
    try:
        run_all(args, engines, base_job, env, runs)
    finally:
        if spinner is not None:
            spinner.kill()
            spinner.wait()

    summaries = {engine: summarise(runs[engine], lengths) for engine in engines}
    report = {
        "model": args.model if not args.gguf else Path(args.gguf).name,
        "gguf": str(gguf),
        "file_bytes": gguf.stat().st_size,
        "threads": args.threads,
        "busy_core": args.busy_core,
        "repeats": args.repeats,
        "prompt_lengths": lengths,
        "new_tokens": args.new_tokens,
        "context_length": context_length,
        "tokenizer": tokenizer,
        "prompt_ids": {str(length): ids for length, ids in prompts.items()},
        "machine": {
            "cpu_count": os.cpu_count(),
            "cpu": _cpu_name(),
            "platform": platform.platform(),
            "python": platform.python_version(),
            "load_average_start": load_average_start,
            "load_average_end": os.getloadavg(),
            "mem_available_gib_end": mem_available() / GIB,
            "openblas_env": {variable: env.get(variable) for variable in OPENBLAS_VARIABLES},
            "date_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        },
        "targets": TARGETS if single and not _has_ladder_targets(args.model) else None,
        "engines": summaries,
        "ratios": ratios(summaries, lengths),
        "runs": runs,
    }
    print_report(report, single_model_targets=single and not _has_ladder_targets(args.model))
    return report


def _has_ladder_targets(model: str) -> bool:
    from benchmarks import ladder

    return ladder.has_targets(model)


def _cpu_name() -> str:
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return platform.processor()


def default_json_path(args: argparse.Namespace, model: str) -> Path:
    name = f"{Path(model).stem}-threads{args.threads}"
    name += "-busy-core" if args.busy_core else ""
    name += "-openblas-env-unset" if args.openblas_env == "unset" else ""
    return REPO_ROOT / "benchmarks" / "results" / f"{name}.json"


def _one_line(result: dict[str, Any]) -> str:
    if "error" in result:
        return "error: " + result["error"]
    parts = [f"load {result['load_seconds']:.2f} s"]
    for length, value in result.get("prefill_tokens_per_second", {}).items():
        parts.append(f"prefill {length} {value:.1f} tok/s")
    if result.get("decode_tokens_per_second"):
        parts.append(f"decode {result['decode_tokens_per_second']:.1f} tok/s")
    parts.append(f"peak RSS {result['peak_rss_mib']:.0f} MiB")
    if "cache_mib" in result:
        parts.append(f"cache {result['cache_mib']:.0f} MiB")
    parts.append(f"others used {result['foreign_cores']:.2f} cores")
    return ", ".join(parts)


if __name__ == "__main__":
    main()
