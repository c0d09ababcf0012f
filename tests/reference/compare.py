"""Compare ember's recorded evaluations with HF's, boundary by boundary.

Relative error of one tensor: max |ember − hf| / max |hf|, both over the whole tensor (every row and
column of one boundary of one layer of one evaluation). The worst case per boundary is kept with where
it happened (evaluation start, layer, absolute position, column).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from .hf_capture import BOUNDARIES, Evaluation

__all__ = ["Worst", "compare_evaluations", "relative_error"]


@dataclass
class Worst:
    boundary: str
    relative: float = 0.0
    absolute: float = 0.0
    where: str = "-"

    def __str__(self) -> str:
        return f"{self.boundary}: rel {self.relative:.2e} (abs {self.absolute:.2e}) at {self.where}"


def relative_error(ours: np.ndarray, reference: np.ndarray) -> tuple[float, float, tuple[int, int]]:
    """(max|Δ|/max|ref|, max|Δ|, (row, column) of the largest |Δ|)."""
    if ours.shape != reference.shape:
        raise AssertionError(f"shape {ours.shape} != reference shape {reference.shape}")
    delta = np.abs(ours.astype(np.float64) - reference.astype(np.float64))
    index = np.unravel_index(int(np.argmax(delta)), delta.shape)
    scale = float(np.abs(reference).max())
    biggest = float(delta[index])
    return (biggest / scale if scale > 0 else biggest), biggest, (int(index[0]), int(index[1]))


def _update(worst: Worst, ours: np.ndarray, reference: np.ndarray, start: int, label: str,
            row_offset: int) -> None:
    relative, absolute, (row, column) = relative_error(ours, reference)
    if relative > worst.relative or worst.where == "-":
        worst.relative, worst.absolute = relative, absolute
        worst.where = f"evaluation@{start} {label} position {start + row_offset + row} column {column}"


def compare_evaluations(ours: list[Evaluation], reference: list[Evaluation]) -> dict[str, Worst]:
    """Worst relative error per boundary (per-layer boundaries, final_norm, logits) over all evaluations.

    `ours` carries only the last row for final_norm and logits; the reference's last row is used.
    """
    if len(ours) != len(reference):
        raise AssertionError(f"{len(ours)} evaluations vs {len(reference)} in the reference")
    worst = {name: Worst(name) for name in (*BOUNDARIES, "final_norm", "logits")}
    for mine, theirs in zip(ours, reference, strict=True):
        if (mine.start_position, mine.token_ids) != (theirs.start_position, theirs.token_ids):
            raise AssertionError(f"evaluation mismatch: ember {mine.start_position} {mine.token_ids} vs "
                                 f"reference {theirs.start_position} {theirs.token_ids}")
        start = mine.start_position
        for boundary in BOUNDARIES:
            for layer, (a, b) in enumerate(zip(getattr(mine, boundary), getattr(theirs, boundary),
                                               strict=True)):
                _update(worst[boundary], a, b, start, f"layer {layer}", 0)
        last = len(theirs.token_ids) - 1
        _update(worst["final_norm"], mine.final_norm, theirs.final_norm[last:], start, "final norm", last)
        _update(worst["logits"], mine.logits, theirs.logits[last:], start, "logits", last)
    return worst


def cosines(ours: np.ndarray, theirs: np.ndarray) -> np.ndarray:
    """Cosine similarity of each row (one position's logits) of two [positions, vocab] arrays."""
    return np.sum(ours * theirs, axis=1) / np.linalg.norm(ours, axis=1) / np.linalg.norm(theirs, axis=1)


def check_against_llama_cpp(ours: np.ndarray, theirs: np.ndarray, theirs_dequantized: np.ndarray, *,
                            min_cosine: float = 0.9999) -> str:
    """ember's logits on a file against llama.cpp's on the same file and on its dequantized F32 copy.

    llama.cpp quantizes the activations that meet a quantized weight (Q8_0 blocks for Q8_0 and MXFP4
    weights), ember does not, so on a quantized file the two differ by llama.cpp's rounding (measured on
    the tiny gpt-oss: cosine 0.93 at worst with Q8_0 weights, 0.9995 with MXFP4 experts only) while on the
    F32 copy holding the same weights they agree to 0.999999. So: ember on the file equals llama.cpp on
    the F32 copy (cosine ≥ `min_cosine`, every argmax the same), and is no further from llama.cpp on the
    file than llama.cpp's own two runs are from each other (twice that distance, plus 1e-5). Returns the
    figures, for the test's output."""
    exact = cosines(ours, theirs_dequantized)
    rounding = 1.0 - cosines(theirs, theirs_dequantized)
    distance = 1.0 - cosines(ours, theirs)
    figures = (f"ember vs llama.cpp on the F32 copy: min cosine {exact.min():.7f}; on the file: "
               f"{1 - distance.max():.7f}, llama.cpp's own rounding {1 - rounding.max():.7f}")
    assert exact.min() >= min_cosine, figures
    assert (ours.argmax(axis=1) == theirs_dequantized.argmax(axis=1)).all(), figures
    assert distance.max() <= 2.0 * rounding.max() + 1e-5, figures
    return figures
