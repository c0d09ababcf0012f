"""The model-size ladder: issue 11's targets, the combined results file, the figure and the tables.

    python -m benchmarks.bench --model ladder                 # measure (see benchmarks/README.md)
    python -m benchmarks.bench --model ladder --engines ember:float32,llama.cpp --label before-float32
    python -m benchmarks.ladder results/ladder-before-float32.json   # tables and figure again, no measuring

The ladder is SmolLM2-135M and Gemma 3 270M (real files) and five synthetic shapes of real models
(benchmarks/synthetic.py), smallest first. A run writes `results/ladder-<label>.json` (every run of
every engine), `results/ladder-<label>.png` (decode and prefill throughput and peak RSS against the
parameter count) and prints the targets with a pass/fail column and the README's markdown table.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path
from typing import Any

REPO_ROOT = Path(__file__).resolve().parents[1]
RESULTS = REPO_ROOT / "benchmarks" / "results"

LADDER = ("smollm2-135m", "gemma3-270m", "qwen3-0.6b", "llama-3.2-1b", "qwen3-4b", "gemma-4-e2b",
          "llama-3.1-8b")
TITLES = {"smollm2-135m": "SmolLM2-135M Q4_1", "gemma3-270m": "Gemma 3 270M Q4_K_M",
          "qwen3-0.6b": "Qwen3-0.6B", "llama-3.2-1b": "Llama-3.2-1B", "qwen3-4b": "Qwen3-4B",
          "gemma-4-e2b": "Gemma-4-E2B", "llama-3.1-8b": "Llama-3.1-8B"}
# One synthetic shape of a real model per family ember runs beyond the ladder's (issue 30), smallest first:
# `python -m benchmarks.bench --model families` runs them all against llama.cpp in one run, as rows of the
# same tables and figure, judged by issue 30's targets (below).
FAMILIES = ("granite-3.3-2b", "smollm3-3b", "ministral-3-3b", "phi-4-mini", "olmo-2-7b", "qwen2.5-7b",
            "gemma-2-9b", "gpt-oss-20b")
TITLES |= {"granite-3.3-2b": "Granite-3.3-2B", "smollm3-3b": "SmolLM3-3B", "ministral-3-3b": "Ministral-3-3B",
           "phi-4-mini": "Phi-4-mini", "olmo-2-7b": "OLMo-2-7B", "qwen2.5-7b": "Qwen2.5-7B",
           "gemma-2-9b": "Gemma-2-9B", "gpt-oss-20b": "gpt-oss-20b"}

# Targets, ember / llama.cpp in the same run (throughput: at least; RSS: at most), and warm load in
# seconds (at most). Issue 11 for the ladder (every model: peak RSS <= 1.3x llama.cpp's; the goal for
# decode is 1x), issue 30 for every later family's shape, issue 26 for the two MoE shapes
# (`--model qwen3-30b-a3b`).
MOE = ("qwen3-30b-a3b", "gemma-4-26b-a4b")
RSS_RATIO = 1.3
RSS_RATIO_OF = {model: 1.1 for model in FAMILIES + MOE}
DECODE_RATIO = ({"smollm2-135m": 0.6, "gemma3-270m": 0.6, "qwen3-0.6b": 0.5, "llama-3.2-1b": 0.5,
                 "qwen3-4b": 0.5, "gemma-4-e2b": 0.4, "llama-3.1-8b": 0.4}
                | {model: 0.5 for model in FAMILIES + MOE})
PREFILL_RATIO = ({"smollm2-135m": {"512": 1.5}, "llama-3.2-1b": {"128": 0.8, "512": 0.8}}
                 | {model: {"128": 0.8} for model in FAMILIES} | {model: {"128": 0.7} for model in MOE})
WARM_LOAD_SECONDS = {"smollm2-135m": 1.0, "llama-3.1-8b": 5.0} | {model: 2.0 for model in MOE}


def ember_engine(engines: list[str]) -> str | None:
    """The ember engine the targets judge: the quantized one if measured, else plain `ember`."""
    for name in ("ember:quantized", "ember"):
        if name in engines:
            return name
    return next((engine for engine in engines if engine.startswith("ember")), None)


def has_targets(model: str) -> bool:
    """Whether the tables above set targets of `model`'s own (else a single run has issue 2's)."""
    return any(model in table for table in (DECODE_RATIO, PREFILL_RATIO, WARM_LOAD_SECONDS, RSS_RATIO_OF))


def target_checks(model: str, report: dict[str, Any]) -> list[dict[str, Any]]:
    """Every target that applies to `model`: what, the measured value, the bound, and pass/fail/None."""
    ours_name = ember_engine(list(report["engines"]))
    ours = report["engines"].get(ours_name or "", {})
    # against llama.cpp, or its one variant measured (`llama.cpp:no-repack` for the MoE shapes)
    against = sorted(name for name in report["ratios"] if name.startswith(f"{ours_name}/llama.cpp"))
    ratios = report["ratios"][against[0]] if against else {}
    checks = []

    def add(what: str, value: float | None, bound: float, at_least: bool) -> None:
        passed = None if value is None else (value >= bound if at_least else value <= bound)
        checks.append({"model": model, "engine": ours_name, "check": what, "value": value,
                       "target": f"{'>=' if at_least else '<='} {bound:g}", "pass": passed})

    add("peak RSS / llama.cpp", ratios.get("peak_rss_mib"), RSS_RATIO_OF.get(model, RSS_RATIO),
        at_least=False)
    if model in DECODE_RATIO:
        add("decode / llama.cpp", ratios.get("decode_tokens_per_second"), DECODE_RATIO[model], at_least=True)
    for length, bound in PREFILL_RATIO.get(model, {}).items():
        value = ratios.get("prefill_tokens_per_second", {}).get(length)
        add(f"prefill {length} / llama.cpp", value, bound, at_least=True)
    if model in WARM_LOAD_SECONDS:
        add("warm load (s)", ours.get("warm_load_seconds"), WARM_LOAD_SECONDS[model], at_least=False)
    if model == "llama-3.1-8b":
        generated = bool(ours.get("successful_runs", {}).get("warm"))
        checks.append({"model": model, "engine": ours_name, "check": "loads and generates here",
                       "value": generated, "target": "yes", "pass": generated})
    return checks


def parameter_count(gguf: str) -> int:
    from ember.gguf_file import GGUFFile

    return sum(math.prod(int(n) for n in info.shape) for info in GGUFFile.open(gguf).tensors.values())


def finish(reports: dict[str, dict[str, Any]], args: argparse.Namespace, engines: list[str]) -> None:
    """After a multi-model run: combined JSON, figure, targets and tables."""
    label = args.label or time.strftime("%Y-%m-%d-%H%M")
    for model, report in reports.items():
        report["parameters"] = parameter_count(report["gguf"])
        report["targets"] = target_checks(model, report)
    ladder = {"label": label, "engines": engines, "threads": args.threads, "repeats": args.repeats,
              "date_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "models": reports}
    json_path = Path(args.json) if args.json else RESULTS / f"ladder-{label}.json"
    json_path.parent.mkdir(parents=True, exist_ok=True)
    json_path.write_text(json.dumps(ladder, indent=1) + "\n")
    render(ladder, json_path.with_suffix(".png"))
    print(f"results written to {json_path} and {json_path.with_suffix('.png')}")


def render(ladder: dict[str, Any], figure_path: Path | None) -> None:
    print()
    print_targets(ladder)
    print()
    print(markdown_table(ladder))
    if figure_path is not None:
        plot(ladder, figure_path)


def print_targets(ladder: dict[str, Any]) -> None:
    rows = [check for report in ladder["models"].values() for check in report.get("targets", [])]
    engine = rows[0]["engine"] if rows else "ember"
    print(f"targets of issues 11 (ladder), 26 (MoE), 30 (families): {engine} / llama.cpp, same run, medians")
    print(f"{'model':16}{'check':28}{'value':>10}{'target':>10}  result")
    for row in rows:
        value = row["value"]
        text = "-" if value is None else (str(value) if isinstance(value, bool) else f"{value:.2f}")
        result = {True: "pass", False: "FAIL", None: "not measured"}[row["pass"]]
        print(f"{row['model']:16}{row['check']:28}{text:>10}{row['target']:>10}  {result}")


def _pair(ours: float | None, theirs: float | None, digits: int, ratio_digits: int = 2) -> str:
    if ours is None and theirs is None:
        return "-"
    a = "-" if ours is None else f"{ours:.{digits}f}"
    b = "-" if theirs is None else f"{theirs:.{digits}f}"
    if ours is None or not theirs:
        return f"{a} / {b}"
    return f"{a} / {b} = {ours / theirs:.{ratio_digits}f}"


def markdown_table(ladder: dict[str, Any]) -> str:
    """One row per model and ember engine: `ember / llama.cpp = ratio` per figure."""
    lines = ["| model (parameters, file) | engine | peak RSS MiB | prefill 128 tok/s | prefill 512 tok/s "
             "| decode tok/s | warm load s | cold load s (ember) |",
             "|---|---|---|---|---|---|---|---|"]
    for model, report in ladder["models"].items():
        engines = report["engines"]
        theirs = engines.get("llama.cpp", {})
        head = (f"{TITLES.get(model, model)} ({report.get('parameters', 0) / 1e9:.2f} B, "
                f"{report.get('file_bytes', 0) / 1e9:.2f} GB)")
        for name, ours in engines.items():
            if not name.startswith("ember"):
                continue
            if ours.get("skipped") or not ours["successful_runs"]["warm"]:
                why = ours.get("skipped") or "; ".join(ours.get("errors", [])) or "no successful run"
                lines.append(f"| {head} | {name} | {why} | | | | | |")
                continue
            p, q = ours["prefill_tokens_per_second"], theirs.get("prefill_tokens_per_second", {})
            lines.append(
                f"| {head} | {name} | {_pair(ours['peak_rss_mib'], theirs.get('peak_rss_mib'), 0)} "
                f"| {_pair(p.get('128'), q.get('128'), 0)} | {_pair(p.get('512'), q.get('512'), 0)} "
                f"| {_pair(ours['decode_tokens_per_second'], theirs.get('decode_tokens_per_second'), 1)} "
                f"| {_pair(ours['warm_load_seconds'], theirs.get('warm_load_seconds'), 2)} "
                f"| {_cell(ours['cold_load_seconds'], 1)} |")
    return "\n".join(lines)


def _cell(value: float | None, digits: int) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


def plot(ladder: dict[str, Any], path: Path) -> None:
    """Decode and prefill-512 tokens/s and peak RSS against parameters, one line per engine."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import NullFormatter

    models = list(ladder["models"].values())
    engines = list(models[0]["engines"]) if models else []
    panels = [("decode tokens/s", lambda s: s["decode_tokens_per_second"]),
              ("prefill 512 tokens/s", lambda s: s["prefill_tokens_per_second"].get("512")),
              ("peak RSS (MiB)", lambda s: s["peak_rss_mib"])]
    figure, axes = plt.subplots(1, len(panels), figsize=(15, 4.6))
    for axis, (title, value) in zip(axes, panels, strict=True):
        for engine in engines:
            points = [(report["parameters"], value(report["engines"][engine]), report["model"])
                      for report in models if engine in report["engines"]
                      and report["engines"][engine]["successful_runs"]["warm"]]
            points = [(x, y, m) for x, y, m in points if y is not None]
            if points:
                axis.plot([p[0] for p in points], [p[1] for p in points], marker="o", label=engine)
            missing = [report for report in models if engine in report["engines"]
                       and not report["engines"][engine]["successful_runs"]["warm"]]
            for report in missing:
                axis.axvline(report["parameters"], color="grey", linestyle=":", linewidth=0.8)
        for report in models:
            axis.annotate(TITLES.get(report["model"], report["model"]).split(" Q")[0],
                          (report["parameters"], 0), xycoords=("data", "axes fraction"),
                          rotation=90, fontsize=7, va="bottom", ha="right", color="grey")
        axis.set_xscale("log")
        axis.set_yscale("log")
        axis.xaxis.set_minor_formatter(NullFormatter())  # 2×10^8, 3×10^8, ... overlap
        axis.set_xlabel("parameters")
        axis.set_title(title)
        axis.grid(True, which="both", alpha=0.3)
        if axis.get_legend_handles_labels()[0]:
            axis.legend(fontsize=8)
    figure.suptitle(f"ember vs llama.cpp, {ladder['threads']} threads, medians of {ladder['repeats']} "
                    f"({ladder['label']}); dotted: engine did not run")
    figure.tight_layout()
    figure.savefig(path, dpi=110)
    plt.close(figure)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.ladder",
                                     description=__doc__.splitlines()[0])
    parser.add_argument("results", help="a ladder-*.json from python -m benchmarks.bench --model ladder, or "
                                        "one model's results (its targets only)")
    parser.add_argument("--no-figure", action="store_true")
    args = parser.parse_args(argv)
    path = Path(args.results)
    try:
        ladder = json.loads(path.read_text())
    except (OSError, ValueError) as error:
        sys.exit(f"cannot read {path}: {error}")
    if "models" not in ladder:  # one model's report (`--model granite-3.3-2b`): its targets only
        from benchmarks.bench import ratios  # bench imports this module: here, not at the top

        report = ladder
        report["ratios"] = ratios(report["engines"], report["prompt_lengths"])  # files from before variants
        report["targets"] = target_checks(report["model"], report)
        print_targets({"models": {report["model"]: report}})
        return
    render(ladder, None if args.no_figure else path.with_suffix(".png"))


if __name__ == "__main__":
    main()
