"""Prompt sets: an inline list, a `.txt` file (one prompt a line) or `.jsonl` (one item a line).

A JSONL item has `prompt` (text used as given) or `messages` (a chat, rendered with the model's
template), and optionally `label`, `answer` (the expected continuation, e.g. " Paris"), `wrong_answer`
(a contrasting continuation) and `corrupted` (a paired prompt: the corrupted run of activation patching,
the negative side of a steering pair). In a `.txt` file blank lines and lines starting with `#` are
skipped. `limit` keeps the first N items (after `shuffle`, which uses `seed`).

Every problem is a `ConfigError` naming the key, or the file and line.
"""

from __future__ import annotations

import hashlib
import json
import os
import random
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ember.errors import ConfigError

BUNDLED_DIR = Path(__file__).resolve().parent / "sets"
BUNDLED_PREFIX = "ember:"
FIELDS = ("prompt", "messages", "label", "answer", "wrong_answer", "corrupted")
_SPEC_KEYS = {"name", "path", "items", "limit", "shuffle", "seed"}
_ROLES = {"system", "user", "assistant"}


@dataclass(frozen=True, slots=True)
class DataSpec:
    """The `data` section of a run config."""

    name: str | None
    path: str | None
    items: tuple[Any, ...] | None
    limit: int | None
    shuffle: bool
    seed: int


@dataclass(frozen=True, slots=True)
class PromptItem:
    """One item: a prompt (or chat messages) and its optional companions."""

    where: str                    # where it came from (`file:line` or `data.items[i]`), for messages
    prompt: str | None
    messages: tuple[dict[str, str], ...] | None = None
    label: str | None = None
    answer: str | None = None
    wrong_answer: str | None = None
    corrupted: str | None = None

    def record(self) -> dict[str, Any]:
        """The item's fields that are set, as plain JSON values."""
        out: dict[str, Any] = {}
        for key in FIELDS:
            value = getattr(self, key)
            if value is not None:
                out[key] = list(value) if key == "messages" else value
        return out


@dataclass(frozen=True, slots=True)
class PromptSet:
    name: str
    items: tuple[PromptItem, ...]
    source: str          # absolute file path, or "inline"
    source_type: str     # "local" (a file) or "code" (inline in the config)
    digest: str          # sha256 prefix of the evaluated items, in order
    total: int           # items in the source before limit

    def __len__(self) -> int:
        return len(self.items)

    def fields(self) -> list[str]:
        """The fields some item has, in FIELDS order."""
        present = {key for item in self.items for key in item.record()}
        return [key for key in FIELDS if key in present]


# ---------------------------------------------------------------------------------------- spec


def parse_data_spec(value: Any) -> DataSpec | None:
    """The `data` config section (None: no prompt set, the job uses `prompt`)."""
    if value is None:
        return None
    if not isinstance(value, Mapping):
        raise ConfigError(f"data must be a mapping (name, path or items, limit, shuffle, seed), "
                          f"got {value!r}")
    unknown = sorted(set(value) - _SPEC_KEYS)
    if unknown:
        raise ConfigError(f"unknown key data.{unknown[0]}; data takes: {', '.join(sorted(_SPEC_KEYS))}")
    path, items = value.get("path"), value.get("items")
    if (path is None) == (items is None):
        raise ConfigError("data needs exactly one of data.path (a .txt or .jsonl file) or data.items "
                          "(an inline list)")
    if path is not None and (not isinstance(path, str) or not path.strip()):
        raise ConfigError(f"data.path must be a file path, got {path!r}")
    if items is not None and (isinstance(items, str | bytes) or not isinstance(items, Sequence) or not items):
        raise ConfigError(f"data.items must be a non-empty list of prompts or items, got {items!r}")
    name = value.get("name")
    if name is not None and (not isinstance(name, str) or not name.strip()):
        raise ConfigError(f"data.name must be a non-empty string, got {name!r}")
    limit = value.get("limit")
    if limit is not None and (isinstance(limit, bool) or not isinstance(limit, int) or limit < 1):
        raise ConfigError(f"data.limit must be a positive integer or null, got {limit!r}")
    shuffle = value.get("shuffle", False)
    if not isinstance(shuffle, bool):
        raise ConfigError(f"data.shuffle must be true or false, got {shuffle!r}")
    seed = value.get("seed", 0)
    if isinstance(seed, bool) or not isinstance(seed, int) or seed < 0:
        raise ConfigError(f"data.seed must be a non-negative integer, got {seed!r}")
    return DataSpec(name, path, tuple(items) if items is not None else None, limit, shuffle, seed)


# ---------------------------------------------------------------------------------------- reading


def resolve_path(path: str, base_dir: str | os.PathLike[str] | None = None) -> Path:
    """`ember:<file>` names a bundled set; anything else is a path (relative to `base_dir` or cwd)."""
    if path.startswith(BUNDLED_PREFIX):
        bundled = BUNDLED_DIR / path[len(BUNDLED_PREFIX):]
        if not bundled.is_file():
            known = ", ".join(sorted(f"{BUNDLED_PREFIX}{p.name}" for p in BUNDLED_DIR.iterdir()
                                     if p.suffix in (".jsonl", ".txt")))
            raise ConfigError(f"data.path={path}: no such bundled prompt set; bundled: {known}")
        return bundled
    file = Path(path).expanduser()
    if not file.is_absolute():
        file = Path(base_dir or os.getcwd()) / file
    if not file.is_file():
        raise ConfigError(f"data.path={path}: {file} does not exist or is not a file")
    return file.resolve()


def load_prompt_set(spec: DataSpec, base_dir: str | os.PathLike[str] | None = None) -> PromptSet:
    """Read, shuffle and limit the prompt set a spec names."""
    if spec.path is not None:
        file = resolve_path(spec.path, base_dir)
        items = read_items(file)
        source, source_type = str(file), "local"
        name = spec.name or file.stem
    else:
        assert spec.items is not None
        items = [_item(entry, f"data.items[{i}]") for i, entry in enumerate(spec.items)]
        source, source_type, name = "inline", "code", spec.name or "inline"
    if not items:
        raise ConfigError(f"the prompt set {source} has no items")
    total = len(items)
    if spec.shuffle:
        random.Random(spec.seed).shuffle(items)
    if spec.limit is not None:
        items = items[: spec.limit]
    return PromptSet(name, tuple(items), source, source_type, digest(items), total)


def read_items(file: Path) -> list[PromptItem]:
    try:
        lines = file.read_text(encoding="utf-8").splitlines()
    except (OSError, UnicodeDecodeError) as error:
        raise ConfigError(f"cannot read the prompt set {file}: {error}") from None
    if file.suffix.lower() in (".jsonl", ".ndjson"):
        items = []
        for number, line in enumerate(lines, 1):
            if not line.strip():
                continue
            try:
                entry = json.loads(line)
            except ValueError as error:
                raise ConfigError(f"{file}:{number}: not valid JSON ({error})") from None
            items.append(_item(entry, f"{file.name}:{number}", jsonl=True))
        return items
    return [PromptItem(f"{file.name}:{number}", line) for number, line in enumerate(lines, 1)
            if line.strip() and not line.lstrip().startswith("#")]


def _item(entry: Any, where: str, jsonl: bool = False) -> PromptItem:
    if isinstance(entry, str) and not jsonl:
        if not entry.strip():
            raise ConfigError(f"{where}: the prompt is empty")
        return PromptItem(where, entry)
    if not isinstance(entry, Mapping):
        raise ConfigError(f"{where}: an item must be an object with \"prompt\" or \"messages\", "
                          f"got {entry!r}")
    unknown = sorted(set(entry) - set(FIELDS))
    if unknown:
        raise ConfigError(f"{where}: unknown field {unknown[0]!r}; an item has {', '.join(FIELDS)}")
    prompt, messages = entry.get("prompt"), entry.get("messages")
    if (prompt is None) == (messages is None):
        raise ConfigError(f"{where}: an item needs exactly one of \"prompt\" or \"messages\"")
    if prompt is not None and (not isinstance(prompt, str) or not prompt):
        raise ConfigError(f"{where}: \"prompt\" must be a non-empty string, got {prompt!r}")
    texts = {}
    for key in ("label", "answer", "wrong_answer", "corrupted"):
        value = entry.get(key)
        if value is not None and (not isinstance(value, str | int | float) or isinstance(value, bool)
                                  or (key != "label" and (not isinstance(value, str) or not value))):
            raise ConfigError(f"{where}: \"{key}\" must be a non-empty string, got {value!r}")
        texts[key] = None if value is None else str(value)
    if texts["wrong_answer"] is not None and texts["answer"] is None:
        raise ConfigError(f"{where}: \"wrong_answer\" needs an \"answer\" to contrast with")
    return PromptItem(where, prompt, _messages(messages, where), **texts)


def _messages(value: Any, where: str) -> tuple[dict[str, str], ...] | None:
    if value is None:
        return None
    if isinstance(value, str | bytes) or not isinstance(value, Sequence) or not value:
        raise ConfigError(f"{where}: \"messages\" must be a non-empty list of {{role, content}}")
    out = []
    for i, message in enumerate(value):
        if (not isinstance(message, Mapping) or set(message) != {"role", "content"}
                or message["role"] not in _ROLES or not isinstance(message["content"], str)):
            raise ConfigError(f"{where}: messages[{i}] must be "
                              f"{{role: system|user|assistant, content: text}}, "
                              f"got {message!r}")
        out.append({"role": str(message["role"]), "content": str(message["content"])})
    return tuple(out)


def digest(items: Sequence[PromptItem]) -> str:
    """A short content hash of the items as evaluated (order included): same items, same digest."""
    text = json.dumps([item.record() for item in items], sort_keys=True, ensure_ascii=False)
    return hashlib.sha256(text.encode("utf-8")).hexdigest()[:12]
