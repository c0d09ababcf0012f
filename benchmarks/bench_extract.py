"""`ember extract` beside the model's prefill: tokens/s of extracting 1,000 short prompts (batched, as
the command does) against tokens/s of one `ember benchmark`-style prefill of a typical prompt.

    python -m benchmarks.bench_extract                      # SmolLM2-135M, 1,000 prompts, 3 repeats
    python -m benchmarks.bench_extract --single 100         # also one prompt at a time (the old way)
    python -m benchmarks.bench_extract --group 256,1024,4096 --json extract.json

The prompts are made from a fixed list of sentence templates and words (5-12 tokens each). Each repeat
measures the prefill (`ember.measure.measure_generation`, 64 tokens, median of 3) and then the
extraction right after, so that both see the same load on a shared machine; figures are medians over
repeats. Issue 25's target: extraction ≥ 0.8× the prefill's tokens/s.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path
from typing import Any

TARGET = 0.8
SUBJECTS = ("The cat", "My neighbour", "A young scientist", "The old river", "Our new teacher", "Paris",
            "The committee", "A small boat", "Every morning the baker", "The quiet library")
VERBS = ("saw", "remembered", "painted", "carried", "explained", "followed", "opened", "described")
OBJECTS = ("the door", "a letter from home", "the mountain at dawn", "three green apples", "the answer",
           "an old map of the city", "the last train", "a song")


def short_prompts(count: int) -> list[str]:
    """`count` different short sentences (the same ones every run)."""
    prompts = []
    for i in range(count):
        subject = SUBJECTS[i % len(SUBJECTS)]
        verb = VERBS[(i // len(SUBJECTS)) % len(VERBS)]
        thing = OBJECTS[(i // (len(SUBJECTS) * len(VERBS))) % len(OBJECTS)]
        prompts.append(f"{subject} {verb} {thing}" + " again" * (i // 640))
    return prompts


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--prompts", type=int, default=1000)
    parser.add_argument("--prompt-tokens", type=int, default=64,
                        help="the prefill's prompt length (ember benchmark's default)")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--group", default="", help="GROUP_TOKENS values to compare (default: the module's)")
    parser.add_argument("--single", type=int, default=0, help="also time this many prompts one at a time")
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args(argv)

    from ember.inspection import extraction
    from ember.inspection.extraction import extract_hidden_states
    from ember.measure import measure_generation, prompt_ids
    from ember.model import load_model

    model = load_model(args.model, context_length=1024, threads=args.threads)
    prompts = short_prompts(args.prompts)
    tokens = sum(len(model.tokenize(p)) for p in prompts)
    ids = prompt_ids(model.tokenizer, args.prompt_tokens)
    groups = [int(g) for g in args.group.split(",")] if args.group else [extraction.GROUP_TOKENS]
    extract_hidden_states(model, prompts[:20], progress=False)  # warm-up
    prefill: list[float] = []
    rates: dict[int, list[float]] = {g: [] for g in groups}
    single: list[float] = []
    for _ in range(args.repeats):
        prefill.append(measure_generation(model, ids, 2, 3)["prefill_tokens_per_second"])
        for group in groups:
            extraction.GROUP_TOKENS = group
            started = time.perf_counter()
            extract_hidden_states(model, prompts, progress=False)
            rates[group].append(tokens / (time.perf_counter() - started))
        if args.single:
            subset = prompts[:args.single]
            started = time.perf_counter()
            for prompt in subset:
                extract_hidden_states(model, [prompt], progress=False)
            single.append(sum(len(model.tokenize(p)) for p in subset) / (time.perf_counter() - started))
    prefill_rate = statistics.median(prefill)
    figures: dict[str, Any] = {
        "model": args.model, "threads": model.threads, "prompts": len(prompts), "prompt_tokens": tokens,
        "prefill_tokens": len(ids), "prefill_tokens_per_second": prefill_rate, "prefill_all": prefill,
        "extract": {str(g): {"tokens_per_second": statistics.median(r), "all": r,
                             "ratio": statistics.median(r) / prefill_rate} for g, r in rates.items()},
    }
    if single:
        figures["single"] = {"prompts": args.single, "tokens_per_second": statistics.median(single),
                             "all": single, "ratio": statistics.median(single) / prefill_rate}
    print(f"{args.model}, {model.threads} threads: prefill of {len(ids)} tokens {prefill_rate:.0f} tok/s; "
          f"{len(prompts)} prompts ({tokens} tokens)")
    for group, row in figures["extract"].items():
        verdict = "pass" if row["ratio"] >= TARGET else "FAIL"
        print(f"  extract, groups of {group} tokens: {row['tokens_per_second']:.0f} tok/s = "
              f"{row['ratio']:.2f}x prefill ({verdict}, target {TARGET})")
    if single:
        print(f"  one prompt at a time ({args.single}): {figures['single']['tokens_per_second']:.0f} tok/s = "
              f"{figures['single']['ratio']:.2f}x prefill")
    if args.json:
        args.json.write_text(json.dumps(figures, indent=2) + "\n")
    return figures


if __name__ == "__main__":
    main()
