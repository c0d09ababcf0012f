"""Fuzzing the GGUF loader: mutated headers of both real models load, or raise EmberError, never hang.

Each case mutates the header region (metadata, tensor index) of SmolLM2-135M Q4_1 or Gemma 3 270M:
byte flips anywhere in it, and targeted changes of the fields a parser trusts (lengths and counts set
huge, value and tensor type ids changed, dimensions, data offsets, metadata numbers set to 0, -1,
NaN, the maximum, key names and the architecture changed), or truncates the file. Cases are generated
from a fixed seed. Two worker processes each keep a copy of both files, write a case's bytes over the
copy, fork a child that calls `ember.load_model` (and, when that works, generates 2 tokens), and
restore the bytes; the child is killed at `HANG_SECONDS`, a guard against a hang (a case takes about a
second), not a judgement of speed: the seconds are reported. A case passes when the child loaded (and
generated or raised EmberError) or raised EmberError: never another exception, never a hang.

The workers are spawned (not forked from pytest) and use numba's `workqueue` threading layer: GNU
OpenMP, numba's default here, terminates a child forked after it ran ("fork() called from a process
already using GNU OpenMP"); the children compute with one thread either way.
"""

from __future__ import annotations

import json
import math
import multiprocessing
import os
import random
import shutil
import struct
import time
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

import pytest

CASES_PER_MODEL = 520
SEED = 20260413
HANG_SECONDS = 120.0
WORKERS = 2

# GGUF value type -> struct format of a scalar (4..7 and 10..12; 8 string, 9 array)
SCALARS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<B", 10: "<Q", 11: "<q",
           12: "<d"}
STRING, ARRAY = 8, 9


@dataclass(frozen=True)
class Field:
    kind: str  # header, key_len, key, vtype, value, str_len, str, item_type, count, elem_len,
    #            name_len, ndims, dim, ggml_type, offset
    pos: int
    size: int
    vtype: int = -1  # for `value`: its GGUF type
    label: str = ""


def header_fields(path: Path) -> tuple[list[Field], int]:
    """Every field of the header region, and where tensor data starts (the region's end)."""
    with open(path, "rb") as f:
        data = f.read(16 << 20)
    fields: list[Field] = []
    pos = 0

    def take(kind: str, size: int, **extra) -> int:
        nonlocal pos
        fields.append(Field(kind, pos, size, **extra))
        pos += size
        return pos - size

    def u32(kind: str, **extra) -> int:
        return struct.unpack_from("<I", data, take(kind, 4, **extra))[0]

    def u64(kind: str, **extra) -> int:
        return struct.unpack_from("<Q", data, take(kind, 8, **extra))[0]

    def string(len_kind: str, kind: str, label: str = "", record: bool = True) -> str:
        nonlocal pos
        if not record:
            (n,) = struct.unpack_from("<Q", data, pos)
            pos += 8 + n
            return ""
        n = u64(len_kind, label=label)
        return data[take(kind, n, label=label): pos].decode("utf-8", "replace")

    take("header", 4, label="magic")
    u32("header", label="version")
    n_tensors = u64("header", label="tensor count")
    n_kv = u64("header", label="metadata count")
    alignment = 32
    for _ in range(n_kv):
        key = string("key_len", "key")
        vtype = u32("vtype", label=key)
        if vtype == STRING:
            string("str_len", "str", label=key)
        elif vtype in SCALARS:
            size = struct.calcsize(SCALARS[vtype])
            value = struct.unpack_from(SCALARS[vtype], data, pos)[0]
            take("value", size, vtype=vtype, label=key)
            if key == "general.alignment":
                alignment = value
        else:
            item_type = u32("item_type", label=key)
            count = u64("count", label=key)
            if item_type == STRING:
                for i in range(count):  # only some element lengths are fields (49k..262k tokens)
                    string("elem_len", "str", label=f"{key}[{i}]", record=i < 50 or i % 997 == 0)
            else:
                take("array", count * struct.calcsize(SCALARS[item_type]), label=key)
    for _ in range(n_tensors):
        name = string("name_len", "name")
        n_dims = u32("ndims", label=name)
        for _ in range(n_dims):
            u64("dim", label=name)
        u32("ggml_type", label=name)
        u64("offset", label=name)
    return fields, (pos + alignment - 1) // alignment * alignment


def interesting_ints(original: int, size: int, file_size: int) -> list[int]:
    top = (1 << (8 * size)) - 1
    values = [0, 1, 2, 3, top, top >> 1, (top >> 1) + 1, original + 1, max(original - 1, 0), original * 2,
              original // 2, file_size, file_size + 1, 1 << 31, (1 << 32) - 1, 1 << 32, 255, 65535]
    return [v & top for v in values]


def mutation(rng: random.Random, fields: list[Field], original: bytes, data_end: int,
             file_size: int) -> tuple[str, list[tuple[int, bytes]]]:
    """One case: (what it is, [(position, new bytes)]); a truncation is ("truncate", [(length, b"")])."""
    kind = rng.choices(["flip", "field", "field2", "truncate"], weights=[30, 55, 10, 5])[0]
    if kind == "flip":
        n = rng.choice([1, 1, 2, 4, 8])
        patches = []
        for _ in range(n):
            at = rng.randrange(data_end)
            patches.append((at, bytes([original[at] ^ rng.randrange(1, 256)])))
        return f"flip{n}", patches
    if kind == "truncate":
        if rng.random() < 0.15:
            return "truncate-data", [(rng.randrange(data_end, file_size), b"")]
        return "truncate-header", [(rng.randrange(data_end + 64), b"")]
    patches = []
    names = []
    by_kind: dict[str, list[Field]] = {}
    for field in fields:
        by_kind.setdefault(field.kind, []).append(field)
    for _ in range(1 if kind == "field" else 2):
        field = rng.choice(by_kind[rng.choice(sorted(by_kind))])  # every kind of field as often
        names.append(field.kind)
        patches.append((field.pos, field_value(rng, field, original, file_size, fields)))
    return "field:" + "+".join(names), patches


def field_value(rng: random.Random, field: Field, original: bytes, file_size: int,
                fields: list[Field]) -> bytes:
    raw = original[field.pos: field.pos + field.size]
    if field.kind in ("key", "str", "name") and field.size or field.label == "magic":
        if field.label == "general.architecture" and rng.random() < 0.5:
            swap = {"llama": ["qwen3", "gemm3", "bert\0"], "gemma3": ["gemma4", "llama\0", "qwen3 "]}
            options = swap.get(raw.decode(errors="replace"), ["x" * field.size])
            return rng.choice(options).encode()[: field.size].ljust(field.size, b"\0")
        at = rng.randrange(field.size)
        if rng.random() < 0.3:  # invalid UTF-8
            return raw[:at] + b"\xff" + raw[at + 1:]
        return raw[:at] + bytes([raw[at] ^ rng.randrange(1, 256)]) + raw[at + 1:]
    if field.kind == "value":
        fmt = SCALARS[field.vtype]
        if fmt in ("<f", "<d"):
            return struct.pack(fmt, rng.choice([math.nan, math.inf, -math.inf, 0.0, -1.0, 1e30, 1e-30, -0.0]))
        unsigned = {1: "<B", 2: "<H", 4: "<I", 8: "<Q"}[field.size]  # negative values wrap, as in C
        return struct.pack(unsigned, rng.choice(interesting_ints(int.from_bytes(raw, "little"), field.size,
                                                                 file_size)))
    if field.kind in ("vtype", "item_type"):
        return struct.pack("<I", rng.choice([*range(14), 1 << 31, (1 << 32) - 1]))
    if field.kind == "ggml_type":
        return struct.pack("<I", rng.choice([*range(42), 1 << 31, (1 << 32) - 1]))
    if field.kind == "ndims":
        return struct.pack("<I", rng.choice([0, 1, 2, 3, 4, 5, 255, (1 << 32) - 1]))
    if field.kind == "offset" and rng.random() < 0.3:
        other = rng.choice([f for f in fields if f.kind == "offset"])
        return original[other.pos: other.pos + 8]  # two tensors on the same bytes
    if field.kind == "array":
        at = field.pos + rng.randrange(max(field.size, 1))
        return original[field.pos: at] + bytes([original[at] ^ 0xFF])
    original_value = int.from_bytes(raw, "little")
    fmt = "<I" if field.size == 4 else "<Q"
    return struct.pack(fmt, rng.choice(interesting_ints(original_value, field.size, file_size)))


def cases_for(path: Path, count: int, seed: int) -> list[tuple[str, list[tuple[int, bytes]]]]:
    fields, data_end = header_fields(path)
    with open(path, "rb") as f:
        original = f.read(data_end + 64)
    size = path.stat().st_size
    rng = random.Random(seed)
    return [mutation(rng, fields, original, data_end, size) for _ in range(count)]


# ------------------------------------------------------------------------------------ the workers


def run_child(path: str) -> dict:
    """In a forked child: load the file; when that works, generate 2 tokens."""
    import ember
    from ember.errors import EmberError

    started = time.perf_counter()
    try:
        model = ember.load_model(path, context_length=64, threads=1)
    except EmberError as error:
        return {"outcome": "ember_error", "error": type(error).__name__, "message": str(error)[:300]}
    try:
        model.generate("Hi", max_new_tokens=2)
        outcome = "generated"
    except EmberError as error:
        outcome = "generate_ember_error"
        return {"outcome": outcome, "error": type(error).__name__, "message": str(error)[:300],
                "load_seconds": time.perf_counter() - started}
    return {"outcome": outcome, "load_seconds": time.perf_counter() - started}


def one_case(path: str) -> dict:
    """Fork a child for one case; its outcome, or a timeout after HANG_SECONDS."""
    read, write = os.pipe()
    started = time.perf_counter()
    pid = os.fork()
    if pid == 0:
        os.close(read)
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, 1)
        os.dup2(devnull, 2)
        try:
            result = run_child(path)
        except BaseException as error:  # the finding: not an EmberError
            import traceback

            result = {"outcome": "raw", "error": type(error).__name__, "message": str(error)[:300],
                      "traceback": traceback.format_exc()[-3000:]}
        os.write(write, json.dumps(result).encode())
        os._exit(0)
    os.close(write)
    chunks = []
    deadline = started + HANG_SECONDS
    import select

    while True:
        left = deadline - time.perf_counter()
        ready, _, _ = select.select([read], [], [], max(left, 0))
        if not ready:
            os.kill(pid, 9)
            os.waitpid(pid, 0)
            os.close(read)
            return {"outcome": "timeout", "seconds": time.perf_counter() - started}
        chunk = os.read(read, 1 << 16)
        if not chunk:
            break
        chunks.append(chunk)
    os.close(read)
    _, status = os.waitpid(pid, 0)
    seconds = time.perf_counter() - started
    if not chunks:
        return {"outcome": "died", "status": os.waitstatus_to_exitcode(status), "seconds": seconds}
    result = json.loads(b"".join(chunks))
    result["seconds"] = seconds
    return result


def worker(originals: dict[str, str], jobs: list[tuple[str, int, str, list]], scratch: str, out) -> None:
    """Copy each model once, then for each job write its bytes, run it, put the bytes back."""
    os.environ["NUMBA_THREADING_LAYER"] = "workqueue"  # fork-safe, unlike GNU OpenMP (see above)
    import ember

    copies = {}
    for model, original in originals.items():
        copy = Path(scratch) / f"{model}.gguf"
        shutil.copyfile(original, copy)
        copies[model] = copy
        ember.load_model(copy, context_length=64, threads=1).generate("Hi", max_new_tokens=2)  # warm
    results = []
    for model, number, what, patches in jobs:
        copy = copies[model]
        if what.startswith("truncate"):
            length = patches[0][0]
            target = Path(scratch) / "truncated.gguf"
            with open(originals[model], "rb") as src, open(target, "wb") as dst:
                left = length
                while left:
                    block = src.read(min(left, 1 << 22))
                    dst.write(block)
                    left -= len(block)
            result = one_case(str(target))
            target.unlink()
        else:
            fd = os.open(copy, os.O_RDWR)
            saved = [(at, os.pread(fd, len(new), at)) for at, new in patches]
            for at, new in patches:
                os.pwrite(fd, bytes(new), at)
            result = one_case(str(copy))
            for at, old in reversed(saved):
                os.pwrite(fd, old, at)
            os.close(fd)
        result.update(model=model, case=number, what=what)
        results.append(result)
    out.put(results)


@pytest.mark.slow
def test_mutated_headers_load_or_raise_ember_error(smollm2_path, gemma3_path, tmp_path) -> None:
    originals = {"smollm2": str(smollm2_path), "gemma3": str(gemma3_path)}
    jobs = []
    for index, (model, path) in enumerate(originals.items()):
        for number, (what, patches) in enumerate(cases_for(Path(path), CASES_PER_MODEL, SEED + index)):
            jobs.append((model, number, what, [(at, new) for at, new in patches]))
    random.Random(SEED).shuffle(jobs)  # the workers share both models' cases evenly

    context = multiprocessing.get_context("spawn")
    queue = context.Queue()
    processes = []
    started = time.perf_counter()
    for w in range(WORKERS):
        scratch = tmp_path / f"worker{w}"
        scratch.mkdir()
        process = context.Process(target=worker, args=(originals, jobs[w::WORKERS], str(scratch), queue))
        process.start()
        processes.append(process)
    results = [r for _ in processes for r in queue.get(timeout=3000)]
    for process in processes:
        process.join(60)
    wall = time.perf_counter() - started

    assert len(results) == len(jobs) >= 1000
    report(results, wall)
    bad = [r for r in results if r["outcome"] not in ("generated", "generate_ember_error", "ember_error")]
    assert not bad, json.dumps(bad[:5], indent=1)


def report(results: list[dict], wall: float) -> None:
    print(f"\n{len(results)} mutated GGUF files in {wall:.0f} s ({WORKERS} workers)")
    for model in ("smollm2", "gemma3"):
        mine = [r for r in results if r["model"] == model]
        outcomes = Counter(r["outcome"] for r in mine)
        seconds = sorted(r["seconds"] for r in mine)
        print(f"  {model}: {len(mine)} cases: " + ", ".join(f"{k} {v}" for k, v in sorted(outcomes.items()))
              + f"; seconds median {seconds[len(seconds) // 2]:.2f}, max {seconds[-1]:.2f}")
        errors = Counter(r.get("error", "") for r in mine if r["outcome"] == "ember_error")
        print("    errors: " + ", ".join(f"{k} {v}" for k, v in errors.most_common()))
        kinds = Counter(r["what"].split(":")[0] for r in mine)
        print("    kinds: " + ", ".join(f"{k} {v}" for k, v in kinds.most_common()))


# ------------------------------------------------------------------------------------ what it found
# Each was a raw exception, a crash or a hang before; now a GGUFError naming the problem, at once.


def patched_copy(original: Path, tmp_path: Path, kind: str, label: str, new: bytes, nth: int = 0) -> Path:
    fields, _ = header_fields(original)
    field = [f for f in fields if f.kind == kind and f.label == label][nth]
    copy = tmp_path / "patched.gguf"
    shutil.copyfile(original, copy)
    with open(copy, "r+b") as f:
        f.seek(field.pos)
        f.write(new)
    return copy


def refused_at_load(path: Path, match: str) -> None:
    import ember
    from ember.errors import GGUFError

    with pytest.raises(GGUFError, match=match):
        ember.load_model(path, context_length=64, threads=1)


def test_a_tensor_shape_the_metadata_does_not_imply_is_refused(smollm2_path, tmp_path) -> None:
    """attn_output 576 -> 1152 columns: the kernels read past the activations (glibc aborted)."""
    wide = struct.pack("<Q", 1152)
    path = patched_copy(Path(smollm2_path), tmp_path, "dim", "blk.18.attn_output.weight", wide)
    refused_at_load(path, r"tensor 'blk.18.attn_output.weight' has shape \(576, 1152\), but the metadata .* "
                          r"implies \(576, 576\)")


def test_a_huge_block_count_is_refused(gemma3_path, tmp_path) -> None:
    """block_count 2**31: loops over the layers hung the load."""
    huge = struct.pack("<I", 1 << 31)
    path = patched_copy(Path(gemma3_path), tmp_path, "value", "gemma3.block_count", huge)
    refused_at_load(path, "'gemma3.block_count' is 2147483648; it must be at most 236")


def test_a_head_count_of_zero_is_refused(smollm2_path, tmp_path) -> None:
    zero = struct.pack("<I", 0)
    path = patched_copy(Path(smollm2_path), tmp_path, "value", "llama.attention.head_count", zero)
    refused_at_load(path, "'llama.attention.head_count' is 0; it must be at least 1")


def test_a_huge_key_length_is_refused(gemma3_path, tmp_path) -> None:
    """general.license's length 2: the parse went on from the middle of a string and read a 200 MB key,
    whose repr in a message took minutes."""
    path = patched_copy(Path(gemma3_path), tmp_path, "str_len", "general.license", struct.pack("<Q", 2))
    refused_at_load(path, "key of metadata entry .* bytes long \\(at most 65535\\)")


def test_deeply_nested_arrays_are_refused(tmp_path) -> None:
    from ember.errors import GGUFError
    from ember.gguf_file import GGUFFile

    nested = b"".join(struct.pack("<IQ", ARRAY, 1) for _ in range(5000))  # 5000 arrays in arrays
    data = b"GGUF" + struct.pack("<IQQ", 3, 0, 1) + struct.pack("<Q", 1) + b"a" + struct.pack("<I", ARRAY)
    path = tmp_path / "nested.gguf"
    path.write_bytes(data + nested + struct.pack("<IQ", 4, 0))
    with pytest.raises(GGUFError, match="nests arrays more than 8 deep"):  # was a RecursionError
        GGUFFile.open(path)


def test_a_token_of_invalid_utf8_still_loads(smollm2_path, tmp_path) -> None:
    """An invalid byte in a control token: building the special-token splitter raised UnicodeEncodeError."""
    import ember

    fields, _ = header_fields(Path(smollm2_path))
    token = next(f for f in fields if f.kind == "str" and f.label == "tokenizer.ggml.tokens[0]")
    path = patched_copy(Path(smollm2_path), tmp_path, "str", token.label, b"\xff")
    model = ember.load_model(path, context_length=64, threads=1)
    assert model.tokenizer.vocab.tokens[0].encode("utf-8", "surrogateescape")[:1] == b"\xff"
