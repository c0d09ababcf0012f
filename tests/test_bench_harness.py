"""The benchmark harness survives workers that die or grow too large (benchmarks/memory_guard.py), and
judges the ladder's targets from a report (benchmarks/ladder.py). Real processes, no mocks."""

from __future__ import annotations

import signal
import sys

import pytest

from benchmarks import bench, ladder
from benchmarks.memory_guard import GIB, address_space_limiter, mem_available, run_watched

FOREVER = "import time\nwhile True:\n    time.sleep(1)"  # a worker that only ends when the harness kills it


def watched(tmp_path, code: str, **kwargs):
    """`code` run under the harness; the timeout is only a guard against a hang, unless a test sets it."""
    options = {"budget_bytes": None, "reserve_bytes": 0, "timeout": 300.0} | kwargs
    return run_watched([sys.executable, "-c", code], cwd=tmp_path, env={}, stdout_path=tmp_path / "out",
                       stderr_path=tmp_path / "err", **options)


def test_a_worker_over_its_budget_is_killed_and_reported(tmp_path) -> None:
    code = "blocks = [bytearray(64 << 20) for _ in range(8)]\n" + FOREVER
    outcome = watched(tmp_path, code, budget_bytes=200 << 20)
    assert outcome.returncode == -signal.SIGKILL and not outcome.timed_out
    assert outcome.failure().startswith("killed by the harness: resident")
    assert outcome.peak_rss_seen > 200 << 20


def test_a_worker_killed_by_a_signal_is_reported_by_name(tmp_path) -> None:
    outcome = watched(tmp_path, "import os, signal; os.kill(os.getpid(), signal.SIGILL)")
    assert outcome.failure() == "worker killed by SIGILL"
    outcome = watched(tmp_path, "import os, signal; os.kill(os.getpid(), signal.SIGKILL)")
    assert outcome.failure().startswith("worker killed by SIGKILL (the kernel's OOM killer")


def test_a_hung_worker_times_out(tmp_path) -> None:
    outcome = watched(tmp_path, FOREVER, timeout=0.5)
    assert outcome.timed_out and outcome.failure().startswith("timed out")


def test_a_worker_is_killed_when_the_machine_runs_short(tmp_path) -> None:
    # A reserve larger than what is available: the watchdog sees the machine "short" at once.
    outcome = watched(tmp_path, FOREVER, reserve_bytes=4 * mem_available())
    assert "available memory fell under" in outcome.failure()


def test_the_address_space_limit_makes_a_large_allocation_fail_inside_the_worker(tmp_path) -> None:
    code = "import sys\ntry:\n    bytearray(3 << 30)\nexcept MemoryError:\n    sys.exit(7)"
    outcome = watched(tmp_path, code, address_space_bytes=2 * GIB)
    assert outcome.returncode == 7
    assert address_space_limiter(None) is None


def test_engine_specs() -> None:
    assert bench.parse_engine("ember:float32") == ("ember", "float32")
    assert bench.parse_engine("llama.cpp") == ("llama.cpp", None)
    for bad in ("ember:float16", "llama.cpp:float32", "vllm"):
        with pytest.raises(ValueError):
            bench.parse_engine(bad)


def test_memory_estimates_follow_the_file_and_its_float32_size(tmp_path) -> None:
    import dataclasses

    from benchmarks import synthetic

    shape = dataclasses.replace(synthetic.SHAPES["qwen3-0.6b"], name="qwen3-one-layer", hidden_size=256,
                                layer_count=1, head_count=4, head_count_kv=2, head_dim=64, ffn=512)
    path = tmp_path / "one-layer.gguf"
    synthetic.write_synthetic(shape, path)
    size, elements = path.stat().st_size, synthetic.parameter_count(shape)
    assert bench.estimate_resident_bytes("llama.cpp", None, path) == int(1.2 * size) + GIB // 2
    assert bench.estimate_resident_bytes("ember", "quantized", path) == int(1.2 * size) + GIB // 2
    assert bench.estimate_resident_bytes("ember", "float32", path) == 4 * elements + size + GIB // 2
    # The 8B shape as float32 cannot fit a 24 GB machine, so the ladder will not start it there.
    assert 4 * synthetic.parameter_count(synthetic.SHAPES["llama-3.1-8b"]) > 29 * GIB


def _report(ours: dict, theirs: dict) -> dict:
    def summary(values: dict) -> dict:
        return {"peak_rss_mib": values.get("rss"), "decode_tokens_per_second": values.get("decode"),
                "prefill_tokens_per_second": {"128": values.get("p128"), "512": values.get("p512")},
                "warm_load_seconds": values.get("warm"), "cold_load_seconds": None,
                "successful_runs": {"cold": 1, "warm": 1}}
    engines = {"ember": summary(ours), "llama.cpp": summary(theirs)}
    return {"engines": engines, "ratios": bench.ratios(engines, [128, 512])}


def test_targets_pass_and_fail_from_the_ratios() -> None:
    report = _report({"rss": 260, "decode": 100, "p128": 900, "p512": 700, "warm": 0.8},
                     {"rss": 200, "decode": 160, "p128": 450, "p512": 440, "warm": 0.1})
    checks = {c["check"]: c for c in ladder.target_checks("smollm2-135m", report)}
    assert checks["peak RSS / llama.cpp"]["pass"] is True  # 1.3
    assert checks["decode / llama.cpp"]["pass"] is True  # 0.625 >= 0.6
    assert checks["prefill 512 / llama.cpp"]["pass"] is True  # 1.59 >= 1.5
    assert checks["warm load (s)"]["pass"] is True
    report = _report({"rss": 4200, "decode": 7}, {"rss": 1200, "decode": 43})
    checks = {c["check"]: c for c in ladder.target_checks("llama-3.2-1b", report)}
    assert checks["peak RSS / llama.cpp"]["pass"] is False
    assert checks["decode / llama.cpp"]["pass"] is False
    assert checks["prefill 512 / llama.cpp"]["pass"] is None  # not measured


def test_moe_targets_judge_the_llama_cpp_variant_measured() -> None:
    # the MoE shapes run against `llama.cpp:no-repack` (its repacked copies do not fit 24 GB); their
    # targets are judged against it, and a single run's report prints them (benchmarks.ladder)
    report = _report({"rss": 100, "decode": 10, "p128": 30, "warm": 1.5},
                     {"rss": 120, "decode": 16, "p128": 50, "warm": 3.0})
    report["engines"]["llama.cpp:no-repack"] = report["engines"].pop("llama.cpp")
    report["ratios"] = bench.ratios(report["engines"], [128, 512])
    assert list(report["ratios"]) == ["ember/llama.cpp:no-repack"]
    checks = {c["check"]: c for c in ladder.target_checks("qwen3-30b-a3b", report)}
    assert checks["decode / llama.cpp"]["pass"] is True  # 0.625 >= 0.5
    assert checks["prefill 128 / llama.cpp"]["pass"] is False  # 0.6 < 0.7
    assert checks["peak RSS / llama.cpp"]["pass"] is True
    assert checks["warm load (s)"]["pass"] is True
    assert ladder.has_targets("granite-3.3-2b") and not ladder.has_targets("my-own.gguf")
