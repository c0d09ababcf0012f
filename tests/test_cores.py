"""The default thread count: the cores this process may run on that other processes leave free."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from ember import cores

REPO = Path(__file__).resolve().parent.parent


def stat(*cpus: tuple[int, int]) -> dict[int, tuple[int, int]]:
    return dict(enumerate(cpus))


def test_proc_stat_text_gives_busy_and_total_jiffies_per_cpu():
    text = ("cpu  300 0 100 1000 20 0 5 0 0 0\n"
            "cpu0 100 0 50 400 10 0 2 0 0 0\n"
            "cpu1 200 0 50 600 10 0 3 0 0 0\n"
            "intr 12345 0 0\nctxt 999\n")
    assert cores.cpu_times(text) == {0: (152, 562), 1: (253, 863)}


def test_an_idle_machine_gives_every_core():
    before = stat((100, 1000), (100, 1000))
    after = stat((101, 1020), (100, 1020))
    assert cores.choose(2, cores.others_load(before, after, [0, 1])) == cores.ThreadChoice(
        2, "all 2 cores free at load")


def test_a_core_another_process_keeps_busy_is_taken():
    before = stat((100, 1000), (100, 1000))
    after = stat((119, 1020), (101, 1020))  # cpu0 95 % busy
    choice = cores.choose(2, cores.others_load(before, after, [0, 1]))
    assert choice == cores.ThreadChoice(1, "1 of 2 cores free at load (other processes kept 1.0 cores busy)",
                                        taken=1)


def test_a_busy_process_moved_between_cores_still_takes_one():
    before = stat((0, 0), (0, 0), (0, 0), (0, 0))
    after = stat((10, 20), (10, 20), (0, 20), (0, 20))  # one process, half the window on each
    assert cores.choose(4, cores.others_load(before, after, [0, 1, 2, 3])).threads == 3


def test_a_core_half_used_by_others_is_not_taken():
    before = stat((0, 0), (0, 0))
    after = stat((10, 20), (0, 20))
    assert cores.choose(2, cores.others_load(before, after, [0, 1])).threads == 2


def test_this_process_s_own_use_is_not_counted_and_other_cpus_are_ignored():
    before = stat((0, 0), (0, 0), (0, 0))
    after = stat((20, 20), (0, 20), (20, 20))  # cpu2 is not ours to run on
    assert cores.others_load(before, after, [0, 1], own_cores=1.0) == 0.0
    assert cores.others_load(before, after, [0, 1]) == pytest.approx(1.0)


def test_at_least_one_thread_when_every_core_is_taken():
    assert cores.choose(2, 2.0).threads == 1 and cores.choose(1, 1.0).threads == 1


def test_threads_asked_for_are_obeyed_without_looking():
    assert cores.thread_choice(3) == cores.ThreadChoice(3, "asked for")


def _cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _busy_loop_on(cpu: int) -> subprocess.Popen:
    """A process spinning on `cpu` (once this returns, it has started spinning)."""
    spinner = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    os.sched_setaffinity(spinner.pid, {cpu})
    deadline = time.monotonic() + 60
    while _cpu_seconds(spinner.pid) < 0.1 and time.monotonic() < deadline:
        time.sleep(0.05)
    return spinner


CHOOSE = """
import os
os.sched_setaffinity(0, {cpus})
from ember.cores import announce, thread_choice
choice = thread_choice({asked})
announce(choice)
announce(choice)  # said once
print(choice.threads)
"""


@pytest.mark.skipif(not hasattr(os, "sched_setaffinity") or len(os.sched_getaffinity(0)) < 2,
                    reason="needs two CPUs this process may run on")
def test_a_real_busy_core_makes_the_default_one_thread_and_says_so_unless_threads_are_asked():
    first, second = sorted(os.sched_getaffinity(0))[:2]
    spinner = _busy_loop_on(first)
    try:
        chosen = {}
        for asked in (None, 2):
            done = subprocess.run([sys.executable, "-c", CHOOSE.format(cpus={first, second}, asked=asked)],
                                  capture_output=True, text=True, timeout=120, cwd=REPO)
            assert done.returncode == 0, done.stderr
            chosen[asked] = (done.stdout.strip(), done.stderr)
    finally:
        spinner.kill()
        spinner.wait()
    threads, said = chosen[None]
    assert threads == "1"
    assert said.startswith("ember: 1 thread, not 2: ") and "cores free at load" in said
    assert len(said.splitlines()) == 1
    assert chosen[2] == ("2", "")
