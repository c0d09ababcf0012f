"""One record per GGUF block type, registered once, and the numba dispatch generated from the table.

A block type is declared by subclassing `BlockType` with its ggml type (the way gguf-py's `quants.py`
registers its types): the subclass gives the type's kernels, its block size comes from gguf's
`GGML_QUANT_SIZES`, and `__init_subclass__` enters it in `BLOCK_TYPES` (ggml type id → record):

    class Q8_0(BlockType, qtype=GGMLQuantizationType.Q8_0):
        @njit(fastmath=EXACT)
        def decode(src, first, blocks, dst, table, half): ...  # blocks of one row → float32

        @njit(inline="always")
        def dot(src, columns, x, sums16, sums32, scales, acc, table): ...  # one row · x

numba cannot look a kernel up in a Python dict at run time, so `switch` writes the dispatch as Python
source with one branch per record (`if qtype == 8: …`, the type ids as literals), compiles it and jits
it: the same code as a hand-written if-chain, inlined into the callers (`ember.quant.kernels`), whose
on-disk cache it shares. numba keys that cache on the callers' file, so the records are declared in that
same file: changing or adding one recompiles the callers. Adding a block type is one subclass there;
nothing else names it.
"""

from __future__ import annotations

import linecache
from collections.abc import Callable, Iterable
from typing import Any, ClassVar

from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

from ember.quant.jit import njit

# ggml type id → record, in the order the records were declared
BLOCK_TYPES: dict[int, type[BlockType]] = {}
KERNELS = ("decode", "dot")


class BlockType:
    """A block type the kernels read. Subclass with `qtype=`; give `decode` and `dot` (numba kernels).

    `decode(src, first, blocks, dst, table, half)` writes the float32 values of `blocks` blocks of one
    row's bytes `src`, from block `first`, into dst[: blocks · values] (for the float types a block is
    one value), as gguf-py dequantizes them. `dot(src, columns, x, sums16, sums32, scales, acc, table)`
    multiplies one row by x [columns]: it adds products into the lanes of `acc` and returns the part of
    the total it kept outside them (`ember.quant.kernels`). Each uses what it needs of its arguments.
    """

    qtype: ClassVar[GGMLQuantizationType]
    type_id: ClassVar[int]  # the ggml type id, as the kernels test it
    name: ClassVar[str]  # "Q8_0"
    values: ClassVar[int]  # values a block
    nbytes: ClassVar[int]  # bytes a block
    f16_fields: ClassVar[tuple[int, ...]] = ()  # byte offsets of a block's f16 scales (test data)
    decode: ClassVar[Any]
    dot: ClassVar[Any]
    # Set by `seal()` once `ember.quant.kernels` has generated its dispatch from the table: a type declared
    # after that would be listed as supported with no branch to run it, so it is refused.
    _sealed: ClassVar[bool] = False

    def __init_subclass__(cls, *, qtype: GGMLQuantizationType, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        missing = [kernel for kernel in KERNELS if kernel not in cls.__dict__]
        if missing:
            raise TypeError(f"block type {qtype.name} has no {' or '.join(missing)} kernel")
        if int(qtype) in BLOCK_TYPES:
            raise TypeError(f"block type {qtype.name} is declared twice")
        if BlockType._sealed:
            raise TypeError(f"block type {qtype.name} is declared after the kernels' dispatch was generated: "
                            "declare it in ember/quant/kernels.py")
        cls.qtype, cls.type_id, cls.name = qtype, int(qtype), qtype.name
        cls.values, cls.nbytes = GGML_QUANT_SIZES[qtype]
        BLOCK_TYPES[cls.type_id] = cls


def seal() -> None:
    """No more block types: `ember.quant.kernels` calls this after generating its dispatch."""
    BlockType._sealed = True


def switch(name: str, params: str, branch: str, records: Iterable[Any], default: str = "",
           namespace: dict[str, Any] | None = None) -> Callable[..., Any]:
    """`@njit(inline="always") def <name>(qtype, <params>)` running `branch` for the record whose
    `type_id` is qtype, and `default` (a statement, or nothing) for any other type.

    `branch` is the body of one branch, formatted per record: `{decode}` and `{dot}` name that record's
    kernels, `{values}` and `{nbytes}` are its block size. `namespace` holds the other names the
    branches call. The generated source is readable with `inspect.getsource(<result>.py_func)`.
    """
    records = list(records)
    scope: dict[str, Any] = dict(namespace or {})
    lines = [f"def {name}(qtype{', ' if params else ''}{params}):"]
    for index, record in enumerate(records):
        fields = {"values": record.values, "nbytes": record.nbytes}
        for kernel in KERNELS:
            fields[kernel] = f"_{kernel}_{record.type_id}"
            scope[fields[kernel]] = getattr(record, kernel)
        lines.append(f"    {'elif' if index else 'if'} qtype == {record.type_id}:  # {record.name}")
        lines += [f"        {line}" for line in branch.format(**fields).strip().splitlines()]
    if default:
        lines.append(f"    {default}")
    source = "\n".join(lines) + "\n"
    filename = f"<ember.quant.blocks: {name}, generated from {len(records)} block types>"
    linecache.cache[filename] = (len(source), None, source.splitlines(keepends=True), filename)
    exec(compile(source, filename, "exec"), scope)  # noqa: S102  (our own text, from the records)
    return njit(inline="always")(scope[name])
