"""`Model`: a loaded GGUF model with its KV cache and decode workspace, and `generate()`.

Generation runs the whole prompt as one batch (prefill), then one token at a time (decode) on a
workspace preallocated for a single row, so decode allocates no activation per token.

Besides experiments, `generate` takes an internal `observer` (a hooks adapter that records boundaries for
dumps and extraction; never together with experiments), a `tracer` (ember.tracing) and `reuse_cache`
(multi-turn chat: keep the cached prefix shared with the previous evaluation and prefill only the rest).
"""

from __future__ import annotations

import os
import sys
import time
from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np

from ember.config import ModelConfig
from ember.cores import allowed_cores, announce, thread_choice
from ember.errors import ConfigError, ContextLengthError
from ember.experiments.adapters import DISABLED_HOOKS
from ember.experiments.context import ExecutionPhase, ModelContext, TracingState
from ember.experiments.failure import ExperimentFailure
from ember.experiments.readout import Readout
from ember.experiments.results import ExperimentResult
from ember.experiments.runner import ExperimentRunner
from ember.families import FAMILIES, config_from_gguf
from ember.gguf_file import GGUFFile
from ember.kv_cache import SlidingWindowKV
from ember.memory import available_memory, estimate_memory
from ember.memory import check_memory as memory_check
from ember.quant import compute_threads, jit_unavailable, q8_available
from ember.rows import BatchEntry, BatchRows, SavedState, check_entry
from ember.sampling import Sampler, SamplingSettings
from ember.sources import ModelFile, resolve_model
from ember.tokenizer import Tokenizer
from ember.tracing import Tracer, TracingHooks
from ember.weights import FLOAT32, QUANTIZED, QUANTIZED_Q8, WEIGHT_MODES, WeightStore, remove_old_weight_cache


@dataclass(frozen=True, slots=True)
class Timings:
    prefill_seconds: float
    decode_seconds: float
    prompt_tokens: int  # prompt tokens the prefill evaluated (without the reused cached prefix)
    decode_evaluations: int
    reused_prompt_tokens: int = 0  # prompt tokens whose keys/values were already cached (reuse_cache)

    @property
    def prefill_tokens_per_second(self) -> float:
        return self.prompt_tokens / self.prefill_seconds if self.prefill_seconds > 0 else 0.0

    @property
    def decode_tokens_per_second(self) -> float:
        return self.decode_evaluations / self.decode_seconds if self.decode_seconds > 0 else 0.0


@dataclass(slots=True)
class BatchResult:
    """What `Model.evaluate_batch` returns, in the order the sequences were given: each sequence's
    logits (its last position's [V], or with all_logits those of its evaluated positions [rows, V]) and
    the saved state of each sequence asked to be saved (`BatchEntry.save`), by index."""

    logits: list[np.ndarray]
    saved: dict[int, SavedState]


# The memory a batch's activations may take (`Model.batch_memory`), unless EMBER_BATCH_MEMORY (bytes,
# or with a unit: 512M, 2G) says: an eighth of the memory available at load, between these bounds. A
# larger batch is split into several. Measured on SmolLM2 (2 threads, residual patching of 6 pairs): the
# rate no longer grows past ~300 rows (the products' tiles are full), ~6 MB of activations.
BATCH_MEMORY_BOUNDS = (64 << 20, 1 << 30)


def default_batch_memory() -> int:
    from ember.memory import parse_size

    if os.environ.get("EMBER_BATCH_MEMORY"):
        return parse_size(os.environ["EMBER_BATCH_MEMORY"])
    low, high = BATCH_MEMORY_BOUNDS
    return int(min(high, max(low, available_memory() // 8)))


@dataclass(slots=True)
class Generation:
    """The result of `Model.generate`. `complete` is False when an experiment stopped it."""

    text: str
    prompt_token_ids: list[int]
    token_ids: list[int]
    stop_reason: str  # "eog" | "length" | "failure"
    timings: Timings
    experiment_results: dict[str, ExperimentResult] = field(default_factory=dict)
    trace: Tracer | None = None  # the tracer that recorded this generation, when tracing was on

    @property
    def complete(self) -> bool:
        return self.stop_reason != "failure"


def _logit_columns(entries: Sequence[BatchEntry], hooks: Any, all_logits: bool) -> np.ndarray | None:
    """The vocabulary entries a batch's LM head forms (`BatchRows.columns`): when every sequence reads
    only some logits (`BatchEntry.logit_ids`) and no hook listens at after_logits (it is shown every
    logit), the union of theirs; otherwise None, every logit."""
    if all_logits or any(entry.logit_ids is None for entry in entries):
        return None
    if "after_logits" in getattr(hooks, "listening", ("after_logits",)):
        return None
    return np.unique(np.concatenate([entry.logit_ids for entry in entries]))


def default_threads() -> int:
    """The cores this process may run on (what a scheduler's share is taken of)."""
    return len(allowed_cores())


class Model:
    """A loaded model. Not thread-safe: one generation at a time."""

    def __init__(self, source: ModelFile, gguf: GGUFFile, config: ModelConfig, tokenizer: Tokenizer,
                 forward: Any, context_length: int, threads: int, load_seconds: float,
                 weights: str = QUANTIZED) -> None:
        self.source = source
        self.weights = weights  # "quantized" or "float32": how the weights are held
        self.gguf = gguf
        self.config = config
        self.tokenizer = tokenizer
        self.context_length = context_length
        self.threads = threads
        self.threads_reason = "asked for"  # why this many (`ember.cores`): set by load_model
        self.load_seconds = load_seconds
        self._forward = forward
        self._cache = forward.new_cache(context_length)
        self._cached_ids: list[int] = []  # the tokens whose keys/values the cache holds, in order
        self._decode_workspace = forward.new_workspace(1, context_length)
        self._batch_workspace: Any = None
        self._bytes_per_row = 0  # a batch row's activations (`_row_bytes`), measured on first use
        self.batch_memory = default_batch_memory()  # bytes a batch's activations may take; more is split
        self.model_context = ModelContext.from_config(config, model_id=source.name, readout=self._readout())

    def _compute_threads(self) -> AbstractContextManager[None]:
        """ember's threads for a forward; BLAS's own only where it runs the products (float32 weights)."""
        return compute_threads(self.threads, self.threads if self.weights == FLOAT32 else 1)

    def _readout(self) -> Readout | None:
        """The contract's read-only final norm + unembedding (v0.2), when the family offers one."""
        project = getattr(self._forward, "readout", None)
        if project is None:
            return None

        def piece(token_id: int) -> str:
            return self.tokenizer.token_to_piece(token_id, special=True).decode("utf-8", errors="replace")

        forward, config = self._forward, self.config
        return Readout(project, config.vocab_size, config.hidden_size, piece,
                       heads=getattr(forward, "head_contributions", None),
                       difference=getattr(forward, "logit_difference", None),
                       carried=getattr(forward, "carried", None), layer_count=config.layer_count,
                       head_count=config.head_count, eps=config.rms_norm_eps)

    def __repr__(self) -> str:
        return f"Model({self.source.name!r}, {self.config.architecture}, {self.config.layer_count} layers)"

    def tokenize(self, prompt: str | Sequence[int], add_bos: bool | None = None) -> list[int]:
        if isinstance(prompt, str):
            return self.tokenizer.encode(prompt, add_bos=add_bos)
        ids = [int(t) for t in prompt]
        bad = [t for t in ids if not 0 <= t < self.config.vocab_size]
        if bad:
            last = self.config.vocab_size - 1
            raise ConfigError(f"token ids {bad[:5]} are outside the vocabulary (0…{last})")
        return ids

    def generate(
        self,
        prompt: str | Sequence[int],
        *,
        max_new_tokens: int = 64,
        temperature: float = 0.0,
        top_k: int = 0,
        top_p: float = 1.0,
        min_p: float = 0.0,
        seed: int = 0,
        add_bos: bool | None = None,
        experiments: Sequence[Any] = (),
        tracing: TracingState = TracingState.DISABLED,
        on_text: Callable[[str], None] | None = None,
        on_token: Callable[[int], None] | None = None,
        stop_at_eog: bool = True,
        observer: Any = None,
        tracer: Tracer | None = None,
        reuse_cache: bool = False,
    ) -> Generation:
        """Generate up to max_new_tokens after the prompt (text, or exact token ids used as given);
        max_new_tokens=0 evaluates the prompt only (one prefill, experiments see it) and samples no token.

        observer: a hooks adapter (ember.experiments.HooksAdapter) called at every boundary instead of
        the disabled one; internal to the inspection surfaces, refused together with experiments.
        tracer: record spans (tokenize, prefill, each decode step; each layer when `tracer.layers`);
        `tracing=TracingState.ENABLED` without a tracer makes one (`generation.trace`).
        on_token: called with each generated token id, after its text went to `on_text`.
        reuse_cache: keep the longest cached prefix this prompt shares with the tokens already in the
        KV cache (the previous prompt and the generated tokens that were evaluated) and prefill only the
        rest; `generation.timings.reused_prompt_tokens` says how many were kept.
        """
        if observer is not None and experiments:
            raise ConfigError(
                "an observer (layer dumps, extraction) cannot run together with experiments: recorded "
                "values would mix before- and after-intervention meanings"
            )
        if tracer is None and TracingState(tracing) is TracingState.ENABLED:
            tracer = Tracer()
        if tracer is not None:
            tracing = TracingState.ENABLED
            generate_started = time.perf_counter()
        sampler = Sampler(SamplingSettings(temperature, top_k, top_p, min_p, seed))
        if tracer is not None:
            with tracer.span("tokenize", cat="tokenize") as details:
                prompt_ids = self.tokenize(prompt, add_bos)
                details["tokens"] = len(prompt_ids)
        else:
            prompt_ids = self.tokenize(prompt, add_bos)
        self.check_fits(len(prompt_ids), max_new_tokens)
        runner = ExperimentRunner(experiments, self.model_context, tracing) if experiments else None
        hooks = runner.hooks if runner is not None else observer if observer is not None else DISABLED_HOOKS
        if tracer is not None and tracer.layers:
            hooks = TracingHooks(hooks, tracer)
        reused = self._reusable_prefix(prompt_ids) if reuse_cache else 0
        self._cached_ids = []  # unknown until this generation ends well

        generated: list[int] = []
        pieces: list[str] = []
        decoder = self.tokenizer.stream_decoder()
        prefill_seconds = decode_seconds = 0.0
        decode_evaluations = 0
        stop_reason = "length"

        def emit(token_id: int) -> None:
            piece = decoder.push(token_id)
            if piece:
                pieces.append(piece)
                if on_text is not None:
                    on_text(piece)

        def result(reason: str) -> Generation:
            tail = decoder.flush()
            if tail:
                pieces.append(tail)
                if on_text is not None:
                    on_text(tail)
            timings = Timings(prefill_seconds, decode_seconds, len(prompt_ids) - reused, decode_evaluations,
                              reused)
            results = runner.results() if runner is not None else {}
            if tracer is not None:
                tracer.complete("generate", generate_started, time.perf_counter(), cat="generate",
                                args={"prompt_tokens": len(prompt_ids), "reused_prompt_tokens": reused,
                                      "generated_tokens": len(generated), "stop_reason": reason})
            return Generation("".join(pieces), prompt_ids, generated, reason, timings, results, tracer)

        try:
            if runner is not None:
                runner.on_model_loaded()
                runner.before_prefill(reused, len(prompt_ids) - reused)
            with self._compute_threads():
                started = time.perf_counter()
                logits = self._prefill(prompt_ids, hooks, start=reused)
                token = sampler(logits[0]) if max_new_tokens > 0 else -1  # 0: prefill only, no token
                finished = time.perf_counter()
                prefill_seconds = finished - started
                if tracer is not None:
                    tracer.complete("prefill", started, finished, cat="prefill",
                                    args={"start_position": reused, "tokens": len(prompt_ids) - reused})
                position = len(prompt_ids)
                while max_new_tokens > 0:
                    if stop_at_eog and token in self.tokenizer.eog_ids:
                        stop_reason = "eog"
                        break
                    generated.append(token)
                    emit(token)
                    if on_token is not None:
                        on_token(token)
                    if len(generated) >= max_new_tokens:
                        break
                    started = time.perf_counter()
                    logits = self._decode(token, position, hooks)
                    token = sampler(logits[0])
                    finished = time.perf_counter()
                    decode_seconds += finished - started
                    if tracer is not None:
                        tracer.complete("decode", started, finished, cat="decode",
                                        args={"position": position})
                    decode_evaluations += 1
                    position += 1
            if runner is not None:
                runner.on_generation_complete(len(prompt_ids), len(generated), decode_evaluations)
        except ExperimentFailure as failure:
            failure.generation = result("failure")
            raise
        self._cached_ids = prompt_ids + generated[:decode_evaluations]
        return result(stop_reason)

    def chat(self, messages: Sequence[dict[str, Any]], **generate_options: Any) -> Generation:
        """Generate the assistant's reply to `messages` ([{"role": ..., "content": ...}, ...]),
        formatted with the model's chat template and tokenized as llama-server does."""
        prompt_ids = self.tokenizer.encode_chat(list(messages))
        return self.generate(prompt_ids, **generate_options)

    @property
    def cached_token_ids(self) -> list[int]:
        """The tokens whose keys/values the KV cache holds (what `reuse_cache` can keep)."""
        return list(self._cached_ids)

    def logits(self, token_ids: Sequence[int]) -> np.ndarray:
        """Logits [T, V] of every position, from one clean prefill (no hooks) over a fresh cache."""
        ids = self.tokenize(token_ids)
        self.check_fits(len(ids), 0)
        self._cached_ids = []
        with self._compute_threads():
            return self._prefill(ids, DISABLED_HOOKS, all_logits=True)

    def evaluate(self, prompt: str | Sequence[int], *, add_bos: bool | None = None, observer: Any = None,
                 tracer: Tracer | None = None) -> np.ndarray:
        """One prefill over a fresh cache, `observer` (a hooks adapter) seeing every boundary; returns
        a copy of the last position's logits [V]. For extraction over prompt sets: nothing is sampled."""
        prompt_ids = self.tokenize(prompt, add_bos)
        self.check_fits(len(prompt_ids), 0)
        hooks = observer if observer is not None else DISABLED_HOOKS
        if tracer is not None and tracer.layers:
            hooks = TracingHooks(hooks, tracer)
        self._cached_ids = []
        with self._compute_threads():
            started = time.perf_counter()
            logits = self._prefill(prompt_ids, hooks)[0].copy()
            if tracer is not None:
                tracer.complete("prefill", started, time.perf_counter(), cat="prefill",
                                args={"start_position": 0, "tokens": len(prompt_ids)})
        self._cached_ids = prompt_ids
        return logits

    def evaluate_batch(self, entries: Sequence[BatchEntry], *, observer: Any = None,
                       all_logits: bool = False) -> BatchResult:
        """Evaluate several sequences of any lengths together (`ember.rows`): their rows stacked, every
        matrix product run once over all of them, each row attending over its own sequence. A sequence
        may start from a saved evaluation (`BatchEntry.prefix`, `start`, `first_layer`: prefix reuse).
        `observer`: a hooks adapter that sees the whole batch (`begin_batch`). A batch larger than
        `batch_memory` is evaluated in several parts. Nothing is cached for generation afterwards."""
        layer_count = self.config.layer_count
        entries = [replace(entry, token_ids=np.asarray(entry.token_ids, np.int64), logit_ids=None
                           if entry.logit_ids is None else np.asarray(entry.logit_ids, np.int64))
                   for entry in entries]
        for index, entry in enumerate(entries):
            try:
                check_entry(entry, layer_count, self.config.vocab_size)
            except ValueError as error:
                raise ConfigError(f"batch sequence {index}: {error}") from None
            self.tokenize(entry.token_ids)  # ids inside the vocabulary
            if len(entry.token_ids) > self.context_length:
                raise ContextLengthError(f"batch sequence {index} has {len(entry.token_ids)} tokens; the "
                                         f"context holds {self.context_length}")
        hooks = observer if observer is not None else DISABLED_HOOKS
        logits: list[np.ndarray | None] = [None] * len(entries)
        saved: dict[int, SavedState] = {}
        self._cached_ids = []
        with self._compute_threads():
            for part in self._batch_parts(entries, all_logits):
                count = sum(entries[i].rows for i in part)
                columns = _logit_columns([entries[i] for i in part], hooks, all_logits)
                rows = BatchRows([entries[i] for i in part], self._batch_rows(count), layer_count, part,
                                 columns)
                out = self._forward.evaluate(rows, hooks, ExecutionPhase.PREFILL, all_logits=all_logits)
                for k, index in enumerate(rows.order):
                    value = out[rows.offsets[k]:rows.offsets[k + 1]] if all_logits else out[k]
                    wanted = entries[index].logit_ids
                    if wanted is not None:  # those entries alone, in the order asked
                        value = value[..., wanted if columns is None else np.searchsorted(columns, wanted)]
                    logits[index] = value
                saved.update(rows.saved)
        return BatchResult(logits, saved)  # type: ignore[arg-type]

    def _batch_rows(self, count: int) -> Any:
        """A workspace of `count` rows: the first rows of one kept for batches, grown when needed."""
        if self._batch_workspace is None or self._batch_workspace.rows < count:
            self._batch_workspace = self._forward.new_workspace(max(count, 2), self.context_length)
        workspace = self._batch_workspace
        return workspace if workspace.rows == count else workspace.head(count)

    def _batch_parts(self, entries: Sequence[BatchEntry], all_logits: bool) -> list[list[int]]:
        """The entries in consecutive parts whose activations fit `batch_memory` (an entry is never
        split; one larger than the budget is a part of its own)."""
        per_row = self._row_bytes() + (self.config.vocab_size * 4 if all_logits else 0)
        per_sequence = self.config.vocab_size * 4
        parts: list[list[int]] = [[]]
        used = 0
        for index, entry in enumerate(entries):
            size = entry.rows * per_row + per_sequence
            if parts[-1] and used + size > self.batch_memory:
                parts.append([])
                used = 0
            parts[-1].append(index)
            used += size
        return [part for part in parts if part]

    def _row_bytes(self) -> int:
        """The activation bytes one more row of a batch takes (a 2-row workspace, measured once)."""
        if not self._bytes_per_row:
            probe = self._forward.new_workspace(2, 2)
            arrays = [a for a in vars(probe).values() if isinstance(a, np.ndarray)]
            self._bytes_per_row = max(1, sum(a.nbytes for a in arrays) // 2)
        return self._bytes_per_row

    def check_fits(self, prompt_tokens: int, max_new_tokens: int) -> None:
        if prompt_tokens == 0:
            raise ConfigError("the prompt is empty: give at least one token")
        if max_new_tokens < 0:
            raise ConfigError(f"max_new_tokens must be at least 0 (0: prefill only), got {max_new_tokens}")
        if prompt_tokens + max_new_tokens > self.context_length:
            raise ContextLengthError(
                f"the prompt ({prompt_tokens} tokens) plus max_new_tokens ({max_new_tokens}) does not fit "
                f"the context of {self.context_length} tokens"
            )

    def _reusable_prefix(self, prompt_ids: list[int]) -> int:
        """How many leading prompt tokens the cache already holds (at least one token is left to
        evaluate); 0 when the cache cannot be cut back to that length (a sliding-window ring)."""
        cached = self._cached_ids
        limit = min(len(cached), len(prompt_ids) - 1)
        shared = 0
        while shared < limit and cached[shared] == prompt_ids[shared]:
            shared += 1
        if shared < len(cached) and any(isinstance(layer, SlidingWindowKV)
                                        for layer in getattr(self._cache, "layers", ())):
            return 0
        return shared

    def _prefill(self, prompt_ids: list[int], hooks: Any, *, all_logits: bool = False,
                 start: int = 0) -> np.ndarray:
        """Evaluate prompt_ids[start:] at positions start…, keeping the cache's first `start` positions."""
        workspace = self._forward.new_workspace(len(prompt_ids) - start, self.context_length)
        self._cache.length = start
        tokens = np.asarray(prompt_ids[start:], dtype=np.int64)
        return self._forward.forward(tokens, start, self._cache, workspace, hooks, ExecutionPhase.PREFILL,
                                     all_logits=all_logits)

    def _decode(self, token: int, position: int, hooks: Any) -> np.ndarray:
        tokens = np.array([token], dtype=np.int64)
        return self._forward.forward(tokens, position, self._cache, self._decode_workspace, hooks,
                                     ExecutionPhase.DECODE)


def load_model(
    source: str | os.PathLike[str] | ModelFile,
    *,
    context_length: int | None = None,
    threads: int | None = None,
    weights: str = QUANTIZED,
    check_memory: bool = True,
    tracer: Tracer | None = None,
) -> Model:
    """Resolve `source` (a known name, a .gguf path or a ModelFile), read it and build the engine.

    context_length: positions the KV cache holds (default: the model's trained context).
    threads: BLAS and kernel threads (default: the cores this process may run on that other processes
    leave free, looked at once a process (`ember.cores`); one line on stderr when that is fewer).
    weights: "quantized" (default: the file's own encoding, mapped, multiplied by numba kernels) or
    "float32" (dequantized at load, BLAS everywhere: 4–8× the memory), or "quantized-q8" (as
    "quantized", but the Q4_K/Q6_K/Q8_0/Q5_0 products round activations to 8 bits as llama.cpp does: faster,
    no longer float32-exact; `ember.quant.q8`). Where numba cannot run, the quantized modes fall back to
    "float32" with a one-line notice on stderr.
    check_memory: refuse (`ember.memory.MemoryLimitError`) a model that would not fit in the memory
    available, before allocating anything.
    With a tracer: spans `load` around `resolve`, `gguf` (header and config), `tokenizer`, `weights`."""
    if weights not in WEIGHT_MODES:
        raise ConfigError(f"weights must be one of {', '.join(WEIGHT_MODES)}, got {weights!r}")
    if tracer is not None:
        with tracer.span("load", cat="load") as details:
            model = _load_model(source, context_length, threads, weights, check_memory, tracer)
            details.update(model=model.source.name, context_length=model.context_length)
        return model
    return _load_model(source, context_length, threads, weights, check_memory, None)


def _load_model(source: str | os.PathLike[str] | ModelFile, context_length: int | None, threads: int | None,
                weights: str, check_memory: bool, tracer: Tracer | None) -> Model:
    def step(name: str) -> Any:
        return tracer.span(name, cat="load") if tracer is not None else nullcontext()

    started = time.perf_counter()
    with step("resolve"):
        model_file = source if isinstance(source, ModelFile) else resolve_model(source)
    with step("gguf"):
        gguf = GGUFFile.open(model_file.path)
        config = config_from_gguf(gguf)
    if context_length is None:
        context_length = config.context_length
    if not 0 < context_length <= config.context_length:
        raise ConfigError(
            f"context_length must be between 1 and the model's {config.context_length}, got {context_length}"
        )
    choice = thread_choice(threads)  # the cores others leave free, unless asked
    announce(choice)
    if weights != FLOAT32 and (reason := jit_unavailable()) is not None:
        print(f"ember: {reason}; weights are dequantized to float32 instead (more memory, slower decode)",
              file=sys.stderr, flush=True)
        weights = FLOAT32
    if weights == QUANTIZED_Q8 and not q8_available():
        print("ember: 8-bit activation products need a CPU with AVX2; activations stay float32",
              file=sys.stderr, flush=True)
    family = FAMILIES[config.architecture]
    if check_memory:
        needed = estimate_memory(gguf, config, family.cache_specs(config), context_length, weights)
        memory_check(needed, model_file.name or gguf.path.name, weights)
    with step("tokenizer"):
        tokenizer = Tokenizer.from_gguf(gguf)
    remove_old_weight_cache()
    store = WeightStore(gguf, weights)
    with compute_threads(choice.threads, choice.threads if weights == FLOAT32 else 1), step("weights"):
        forward = family.build_forward(config, store, context_length)
        if weights != FLOAT32:
            from ember.quant.jit import release_compiler_pages
            from ember.quant.matrix import warm_up

            warm_up()  # compile the kernels now (or load them from the JIT cache), not at the first token
            release_compiler_pages()  # LLVM is not needed again unless something new compiles
    model = Model(model_file, gguf, config, tokenizer, forward, context_length, choice.threads,
                  time.perf_counter() - started, weights)
    model.threads_reason = choice.reason
    return model
