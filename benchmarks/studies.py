"""Issue 25's studies benchmark: the interpretability studies ember runs, timed against their targets and,
for residual patching, against a batched PyTorch peer in the same run.

    python -m benchmarks.studies                          # every part but --big, 2 threads, medians of 3
    python -m benchmarks.studies --quick                  # fewer items (scaled up where a target needs all)
    python -m benchmarks.studies --only patching,lens     # some of: patching tracing lens extract big busy
    python -m benchmarks.studies --big                    # also the Llama-3.2-1B-shaped file (slow today)
    python -m benchmarks.studies --busy-core              # patching at 1 and 2 threads, one core kept busy
    python -m benchmarks.studies --repeats 5 --json out.json

Parts (SmolLM2-135M Q4_1 unless said):

* patching: residual patching of capital pairs, every layer and every position from the first changed
  token (what `activation_patching` runs; earlier positions are identical in both prompts and score 0).
  ember runs the ActivationPatching experiment item by item (`ember_patching`); the peer is transformers
  float32 (eager attention) on the same GGUF with `torch.set_num_threads(threads)`, in a subprocess of its
  own (its OpenMP threads would otherwise spin beside numba's), per pair a clean forward with every decoder
  layer's input recorded, then ONE batched forward of the corrupted prompt with a row per patch (plus one
  unpatched row, the baseline), a forward pre-hook on each decoder layer writing the clean residual into
  the rows that patch that layer, logits of the last position only. Their scores must agree (max |Δ|
  printed). Target: ember >= 4x faster than the peer.
* tracing: the worked causal-tracing study (`ember.run data=capitals experiment=activation_patching`,
  3 sites, all 54 facts) in-process with a fresh SQLite store in a temporary folder. Target: the study
  (`study.total_seconds`: everything after the model is loaded) <= 60 s.
* lens: `ember.run data=capitals experiment=logit_lens` over the 54 facts. Target <= 5 s (same measure).
  For both studies also the runner's share: `study.runner_seconds` (records, figures, intervals, the
  page, MLflow writes) / `study.engine_seconds`, target <= 10%, judged on the items run.
* extract: `ember extract`'s function (every layer, after_layer, last token) over 1,000 short prompts,
  tokens/s against the model's own prefill of 128 tokens (the ladder's "prefill 128"). Target >= 0.8x.
* big (`--big`): a Llama-3.2-1B-shaped synthetic Q4_K_M file (benchmarks/synthetic.py, written on first
  use, 0.8 GB): residual patching of 40 token-id pairs of 5-8 tokens differing at one position. Target
  <= 10 min.
* busy (`--busy-core`): the patching part's ember side at 1 and at 2 threads, each in a child process,
  while one core is kept busy (benchmarks/busy_threads.busy_core). Target: 2 threads at least as fast.

`--quick` runs 6 pairs, 3 tracing facts, 100 prompts to extract and 4 big pairs, one repeat; where a
target is stated for more items the figure is scaled up linearly and marked "est.". Timings on a shared
machine are noisy: say what else ran.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

MODEL = "smollm2-135m"
PARTS = ("patching", "tracing", "lens", "extract", "big", "busy")
CAPITALS = 54
# Issue 25's targets.
TARGETS = {
    "patching_speedup": 4.0,   # peer seconds / ember seconds
    "tracing_seconds": 60.0,   # 54 facts, 3 sites
    "lens_seconds": 5.0,       # 54 facts
    "extract_ratio": 0.8,      # extraction tokens/s / prefill-128 tokens/s
    "big_seconds": 600.0,      # 40 pairs
    "busy_ratio": 1.0,         # 1-thread seconds / 2-thread seconds, one core busy
    "runner_share": 0.10,      # a study's runner seconds / its engine seconds (tracing, lens)
}
FULL = {"pairs": 54, "tracing_items": CAPITALS, "prompts": 1000, "big_pairs": 40}
# --quick: 6 pairs as in the measurements of 2026-12-03 (design/measured-2026-12-03.md).
QUICK = {"pairs": 6, "tracing_items": 3, "prompts": 100, "big_pairs": 4}
PREFILL_TOKENS = 128
BIG_SHAPE = "llama-3.2-1b"
AGREEMENT = 1e-3  # max |Δ restored share| between ember and the peer


# ----------------------------------------------------------------------------------------------------
# Items


def capital_items(model: Any, limit: int | None = None) -> list[Any]:
    """The bundled capitals pairs, tokenized as a study tokenizes them."""
    from ember.data import load_prompt_set, parse_data_spec
    from ember.runs.study_plan import study_item

    prompts = load_prompt_set(parse_data_spec({"path": "ember:capitals.jsonl", "limit": limit}))
    return [study_item(i, item, model.tokenizer) for i, item in enumerate(prompts.items)]


def token_pairs(count: int, vocabulary: int, seed: int = 0) -> list[Any]:
    """`count` pairs of 5-8 arbitrary token ids differing at one position, with arbitrary answer ids."""
    from ember.experiments.study import StudyItem

    rng = np.random.default_rng(seed)
    items = []
    for index in range(count):
        length = int(rng.integers(5, 9))
        clean = [int(t) for t in rng.integers(1000, vocabulary, length)]
        corrupted = list(clean)
        position = int(rng.integers(1, length))
        corrupted[position] = (clean[position] + 1 + int(rng.integers(0, 5000))) % vocabulary
        answer, wrong = (int(t) for t in rng.choice(vocabulary, 2, replace=False))
        items.append(StudyItem(index, tuple(clean), "", tuple(corrupted), (answer,), (wrong,)))
    return items


def plain_items(items: Sequence[Any]) -> list[dict[str, Any]]:
    return [{"clean": list(i.token_ids), "corrupted": list(i.corrupted_ids), "answer": i.answer_id,
             "wrong": i.wrong_answer_id} for i in items]


# ----------------------------------------------------------------------------------------------------
# ember's side (kept small: it is the function the batched evaluation will replace)


def ember_patching(model: Any, items: Sequence[Any], sites: Sequence[str], threads: int) -> list[np.ndarray]:
    """ActivationPatching over `items` as a study runs it (`ITEMS_TOGETHER` items side by side, their
    patches batched with prefix reuse); per item its scores [sites, layers, positions]."""
    from ember.experiments.activation_patching import ActivationPatching
    from ember.runs.study import ITEMS_TOGETHER, run_items

    saved, model.threads = model.threads, threads
    try:
        experiment = ActivationPatching(sites=list(sites), figure_items=len(items))
        for first in range(0, len(items), ITEMS_TOGETHER):
            run_items(model, experiment, items[first:first + ITEMS_TOGETHER])
    finally:
        model.threads = saved
    arrays = experiment.results().arrays
    return [arrays[f"item{item.index}_restored"] for item in items]


# ----------------------------------------------------------------------------------------------------
# The peer: transformers float32, one batched forward per pair


def load_peer(gguf: str | os.PathLike[str], threads: int) -> Any:
    """transformers' float32 import of the GGUF, eager attention, on `threads` torch threads."""
    import torch
    from transformers import AutoModelForCausalLM

    torch.set_num_threads(threads)
    path = Path(gguf)
    model = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=torch.float32,
                                                 attn_implementation="eager")
    model.eval()
    return model


def _hidden(args: tuple, kwargs: dict) -> Any:
    return args[0] if args else kwargs["hidden_states"]


def peer_patching(hf: Any, pair: dict[str, Any]) -> np.ndarray:
    """Residual patching of one pair: scores [layers, positions] (0 before the first changed token)."""
    import torch

    clean_ids, corrupted_ids = pair["clean"], pair["corrupted"]
    layers = hf.model.layers
    T = len(clean_ids)
    first = int(np.flatnonzero(np.array(clean_ids) != np.array(corrupted_ids))[0])
    patches = [(layer, position) for layer in range(len(layers)) for position in range(first, T)]
    recorded: list[Any] = [None] * len(layers)
    by_layer: dict[int, tuple[list[int], list[int]]] = {}
    for row, (layer, position) in enumerate(patches, start=1):  # row 0: the corrupted baseline
        rows, positions = by_layer.setdefault(layer, ([], []))
        rows.append(row)
        positions.append(position)

    def record(index: int) -> Any:
        def hook(module: Any, args: tuple, kwargs: dict) -> None:
            recorded[index] = _hidden(args, kwargs)[0].clone()
        return hook

    def patch(index: int) -> Any:
        rows, positions = by_layer.get(index, ([], []))

        def hook(module: Any, args: tuple, kwargs: dict) -> None:
            if rows:
                _hidden(args, kwargs)[rows, positions] = recorded[index][positions]
        return hook

    with torch.inference_mode():
        handles = [layer.register_forward_pre_hook(record(i), with_kwargs=True)
                   for i, layer in enumerate(layers)]
        try:
            clean = hf(input_ids=torch.tensor([clean_ids]), use_cache=False, logits_to_keep=1).logits[0, -1]
        finally:
            for handle in handles:
                handle.remove()
        handles = [layer.register_forward_pre_hook(patch(i), with_kwargs=True)
                   for i, layer in enumerate(layers)]
        try:
            batch = torch.tensor([corrupted_ids] * (len(patches) + 1))
            logits = hf(input_ids=batch, use_cache=False, logits_to_keep=1).logits[:, -1].double()
        finally:
            for handle in handles:
                handle.remove()
    answer, wrong = pair["answer"], pair["wrong"]
    ld_clean = float(clean[answer] - clean[wrong])
    ld = (logits[:, answer] - logits[:, wrong]).numpy()
    scores = np.zeros((len(layers), T))
    for (layer, position), value in zip(patches, ld[1:], strict=True):
        scores[layer, position] = (value - ld[0]) / (ld_clean - ld[0])
    return scores


def peer_worker(job: dict[str, Any]) -> dict[str, Any]:
    """The peer's repeats over the pairs, in this (child) process: seconds per repeat and the scores."""
    hf = load_peer(job["gguf"], job["threads"])
    peer_patching(hf, job["pairs"][0])  # warm-up
    seconds, scores = [], []
    for _ in range(job["repeats"]):
        started = time.perf_counter()
        scores = [peer_patching(hf, pair) for pair in job["pairs"]]
        seconds.append(time.perf_counter() - started)
    import torch

    return {"seconds": seconds, "scores": [s.tolist() for s in scores],
            "torch_threads": torch.get_num_threads()}


def run_child(arguments: list[str], timeout: float = 3600) -> dict[str, Any]:
    """`python -m benchmarks.studies <arguments>`; its last stdout line, parsed as JSON."""
    done = subprocess.run([sys.executable, "-m", "benchmarks.studies", *arguments], capture_output=True,
                          text=True, timeout=timeout)
    if done.returncode != 0:
        raise RuntimeError(f"child {arguments} failed: {done.stderr.strip()[-2000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


# ----------------------------------------------------------------------------------------------------
# Parts. Each returns rows for the table: (measure, ember, peer/target, ratio, pass) and its figures.


Row = tuple[str, str, str, str, str]


def verdict(ok: bool, estimated: bool = False) -> str:
    return ("pass" if ok else "FAIL") + (" (est.)" if estimated else "")


def load(threads: int, gguf: str | None = None) -> Any:
    import ember

    return ember.load_model(gguf or MODEL, context_length=256, threads=threads)


def part_patching(args: argparse.Namespace, sizes: dict[str, int]) -> tuple[list[Row], dict[str, Any]]:
    model = load(args.threads)
    items = capital_items(model, sizes["pairs"])
    patches = sum(model.config.layer_count * (len(i.token_ids) - _first_changed(i)) for i in items)
    model.evaluate(list(items[0].token_ids))  # warm-up
    seconds, scores = [], []
    for _ in range(args.repeats):
        started = time.perf_counter()
        scores = ember_patching(model, items, ("residual",), args.threads)
        seconds.append(time.perf_counter() - started)
    ember_s = statistics.median(seconds)
    figures: dict[str, Any] = {"pairs": len(items), "patches": patches, "ember_seconds": seconds}
    rows: list[Row] = []
    label = f"residual patching, {len(items)} pairs ({patches} patches)"
    if args.no_peer:
        rows.append((label, f"{ember_s:.2f} s", "-", "-", "-"))
        return rows, figures
    with tempfile.TemporaryDirectory(prefix="ember_studies_") as folder:
        job = Path(folder) / "peer.json"
        job.write_text(json.dumps({"gguf": str(model.source.path), "threads": args.threads,
                                   "repeats": args.repeats, "pairs": plain_items(items)}))
        peer = run_child(["--peer-worker", str(job)])
    peer_s = statistics.median(peer["seconds"])
    difference = max(float(np.abs(ours[0] - np.array(theirs)).max())
                     for ours, theirs in zip(scores, peer["scores"], strict=True))
    speedup = peer_s / ember_s
    figures.update(peer_seconds=peer["seconds"], torch_threads=peer["torch_threads"],
                   max_abs_difference=difference)
    target = TARGETS["patching_speedup"]
    rows.append((label, f"{ember_s:.2f} s", f"peer {peer_s:.2f} s", f"{speedup:.2f}x faster",
                 verdict(speedup >= target) + f" (>= {target:.0f}x)"))
    rows.append(("  scores, ember vs peer: max |Δ|", f"{difference:.1e}", f"<= {AGREEMENT:.0e}", "-",
                 verdict(difference <= AGREEMENT)))
    return rows, figures


def _first_changed(item: Any) -> int:
    return int(np.flatnonzero(np.array(item.token_ids) != np.array(item.corrupted_ids))[0])


def run_study(name: str, overrides: list[str], items: int, threads: int, repeats: int) -> dict[str, Any]:
    """A study through `ember.run` in a temporary folder (its own SQLite store); medians of its timings."""
    from benchmarks.bench_study import run_job
    from ember.records.store import quiet_mlflow_logging

    quiet_mlflow_logging()
    saved = os.getcwd()
    runs = []
    with tempfile.TemporaryDirectory(prefix="ember_studies_") as folder:
        os.chdir(folder)
        try:
            for _ in range(repeats):
                runs.append(run_job(Path(folder), name, overrides, items, threads, Counter()))
        finally:
            os.chdir(saved)
    keys = ("engine_seconds", "experiment_seconds", "runner_seconds", "total_seconds", "job_wall_seconds")
    return {**{key: statistics.median(r[key] for r in runs) for key in keys}, "runs": runs}


def part_study(args: argparse.Namespace, measure: str, overrides: list[str], items: int,
               target: float) -> tuple[list[Row], dict[str, Any]]:
    figures = run_study(measure, overrides, items, args.threads, args.repeats)
    total = figures["total_seconds"] * CAPITALS / items
    estimated = items != CAPITALS
    label = f"{measure}, {CAPITALS} facts" + (f" (from {items}, scaled)" if estimated else "")
    engine = figures["engine_seconds"] * CAPITALS / items
    # The runner's share is judged on the items run (its costs are mostly fixed per study: not scaled).
    share, most = figures["runner_seconds"] / figures["engine_seconds"], TARGETS["runner_share"]
    return [(label, f"{total:.1f} s (engine {engine:.1f})", f"<= {target:.0f} s", f"{total / target:.2f}",
             verdict(total <= target, estimated)),
            (f"{measure}: study runner / engine ({items} items)",
             f"{figures['runner_seconds']:.2f} s / {figures['engine_seconds']:.2f} s", f"<= {most:.0%}",
             f"{share:.1%}", verdict(share <= most))], figures


def part_tracing(args: argparse.Namespace, sizes: dict[str, int]) -> tuple[list[Row], dict[str, Any]]:
    return part_study(args, "causal tracing", ["experiment=activation_patching"], sizes["tracing_items"],
                      TARGETS["tracing_seconds"])


def part_lens(args: argparse.Namespace, sizes: dict[str, int]) -> tuple[list[Row], dict[str, Any]]:
    return part_study(args, "logit lens", ["experiment=logit_lens"], CAPITALS, TARGETS["lens_seconds"])


def short_prompts(count: int) -> list[str]:
    """`count` distinct short prompts: sentence frames around the capitals set's countries."""
    from ember.data import load_prompt_set, parse_data_spec

    capitals = load_prompt_set(parse_data_spec({"path": "ember:capitals.jsonl"}))
    countries = [item.label for item in capitals.items]
    frames = ["The capital of {} is", "{} is a country in", "The people of {} speak", "The flag of {} has",
              "In {}, the weather is", "The currency of {} is the", "A famous dish from {} is",
              "The largest city in {} is", "{} borders", "The population of {} is about",
              "Tourists in {} often visit", "The national sport of {} is", "{} became independent in",
              "The longest river in {} is", "Children in {} learn", "The president of {} lives in",
              "Trains in {} are", "The coast of {} faces", "Farmers in {} grow", "Music from {} sounds"]
    prompts = [frame.format(country) for frame in frames for country in countries]
    if count > len(prompts):
        raise ValueError(f"only {len(prompts)} short prompts")
    return prompts[:count]


def part_extract(args: argparse.Namespace, sizes: dict[str, int]) -> tuple[list[Row], dict[str, Any]]:
    from ember.inspection.extraction import extract_hidden_states

    model = load(args.threads)
    prompts = short_prompts(sizes["prompts"])
    tokens = sum(len(model.tokenize(p)) for p in prompts)
    long = (model.tokenize(" ".join(prompts)) * 2)[:PREFILL_TOKENS]
    model.evaluate(long)  # warm-up
    extract_hidden_states(model, prompts[:20], progress=False)
    prefill, extract = [], []
    for _ in range(args.repeats):
        for _ in range(3):
            started = time.perf_counter()
            model.evaluate(long)
            prefill.append(PREFILL_TOKENS / (time.perf_counter() - started))
        started = time.perf_counter()
        extract_hidden_states(model, prompts, progress=False)
        extract.append(tokens / (time.perf_counter() - started))
    prefill_tps, extract_tps = statistics.median(prefill), statistics.median(extract)
    ratio = extract_tps / prefill_tps
    figures = {"prompts": len(prompts), "tokens": tokens, "extract_tps": extract, "prefill_tps": prefill}
    return [(f"extract {len(prompts)} prompts ({tokens} tokens)", f"{extract_tps:.1f} tok/s",
             f"prefill {PREFILL_TOKENS}: {prefill_tps:.1f} tok/s", f"{ratio:.2f}",
             verdict(ratio >= TARGETS["extract_ratio"]) + f" (>= {TARGETS['extract_ratio']})")], figures


def part_big(args: argparse.Namespace, sizes: dict[str, int]) -> tuple[list[Row], dict[str, Any]]:
    from benchmarks.synthetic import ensure

    path = ensure(BIG_SHAPE)
    model = load(args.threads, str(path))
    items = token_pairs(sizes["big_pairs"], model.config.vocab_size)
    model.evaluate(list(items[0].token_ids))  # warm-up
    started = time.perf_counter()
    ember_patching(model, items, ("residual",), args.threads)
    seconds = time.perf_counter() - started
    full = seconds * FULL["big_pairs"] / len(items)
    estimated = len(items) != FULL["big_pairs"]
    label = f"{BIG_SHAPE} residual patching, 40 pairs"
    label += f" (from {len(items)}, scaled)" if estimated else ""
    target = TARGETS["big_seconds"]
    return [(label, f"{full:.0f} s", f"<= {target:.0f} s", f"{full / target:.2f}",
             verdict(full <= target, estimated))], {"pairs": len(items), "seconds": seconds}


def part_busy(args: argparse.Namespace, sizes: dict[str, int]) -> tuple[list[Row], dict[str, Any]]:
    from benchmarks.busy_threads import busy_core

    seconds: dict[int, float] = {}
    with busy_core():
        for threads in (1, 2):
            child = run_child(["--only", "patching", "--no-peer", "--threads", str(threads), "--repeats",
                               str(args.repeats), "--pairs", str(sizes["pairs"]), "--print-json"])
            seconds[threads] = statistics.median(child["parts"]["patching"]["ember_seconds"])
    ratio = seconds[1] / seconds[2]
    return [(f"busy core: patching {sizes['pairs']} pairs, 2 threads vs 1", f"{seconds[2]:.2f} s",
             f"1 thread {seconds[1]:.2f} s", f"{ratio:.2f}", verdict(ratio >= TARGETS["busy_ratio"]))], \
        {"seconds": seconds}


RUNNERS = {"patching": part_patching, "tracing": part_tracing, "lens": part_lens, "extract": part_extract,
           "big": part_big, "busy": part_busy}


def print_table(rows: list[Row]) -> None:
    header = ("measure", "ember", "peer / target", "ratio", "pass/fail")
    widths = [max(len(r[i]) for r in [header, *rows]) for i in range(5)]
    for row in [header, tuple("-" * w for w in widths), *rows]:
        print("  ".join(cell.ljust(width) for cell, width in zip(row, widths, strict=True)).rstrip())


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.studies",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="fewer items, one repeat (figures scaled up)")
    parser.add_argument("--only", default=None, help=f"comma-separated parts: {', '.join(PARTS)}")
    parser.add_argument("--big", action="store_true", help="also the Llama-3.2-1B-shaped file")
    parser.add_argument("--busy-core", action="store_true", help="patching at 1 and 2 threads, one core busy")
    parser.add_argument("--repeats", type=int, default=None, help="medians over N (default 3; --quick 1)")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--pairs", type=int, default=None, help="capital pairs for the patching part")
    parser.add_argument("--no-peer", action="store_true", help="patching: ember's side only")
    parser.add_argument("--json", default=None, help="write every figure here")
    parser.add_argument("--print-json", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--peer-worker", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.peer_worker:
        print(json.dumps(peer_worker(json.loads(Path(args.peer_worker).read_text()))))
        return
    args.repeats = args.repeats or (1 if args.quick else 3)
    sizes = dict(QUICK if args.quick else FULL)
    if args.pairs:
        sizes["pairs"] = args.pairs
    if args.only:
        parts = [p.strip() for p in args.only.split(",") if p.strip()]
        unknown = [p for p in parts if p not in PARTS]
        if unknown:
            parser.error(f"unknown parts {unknown}; choose from {', '.join(PARTS)}")
    else:
        parts = [p for p in PARTS if p not in ("big", "busy")] + ["big"] * args.big
    if args.busy_core and "busy" not in parts:
        parts.append("busy")
    runners = {p: RUNNERS[p] for p in parts}
    started = time.time()
    rows: list[Row] = []
    figures: dict[str, Any] = {}
    for name, runner in runners.items():
        part_rows, figures[name] = runner(args, sizes)
        rows += part_rows
        print(f"[{time.time() - started:.0f} s] {name}: {part_rows}", file=sys.stderr, flush=True)
    result = {"threads": args.threads, "repeats": args.repeats, "quick": args.quick, "sizes": sizes,
              "targets": TARGETS, "seconds": time.time() - started, "load_average": os.getloadavg(),
              "rows": rows, "parts": figures}
    if args.print_json:
        print(json.dumps(result, default=str))
        return
    print(f"\n{MODEL} unless said, {args.threads} threads, medians of {args.repeats}"
          f"{', --quick' if args.quick else ''} ({result['seconds']:.0f} s, load average "
          f"{os.getloadavg()[0]:.1f} at the end)")
    print_table(rows)
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1, default=str))


if __name__ == "__main__":
    main()
