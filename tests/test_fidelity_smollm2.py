"""ember against transformers on SmolLM2-135M-Instruct (Q4_1 GGUF), both reading the same file.

transformers imports the GGUF itself (`gguf_file=`, float32, eager attention): it dequantizes with
gguf-py and undoes the converter's Q/K permutation. Prompts are exact token ids (HF's GGUF tokenizer for
`smollm` lacks llama.cpp's digit split, so text would not tokenize the same).

Checked per prompt, over the prefill and DECODE_STEPS greedy decode steps (HF replays ember's tokens):
* logits: max |Δ| ≤ 1e-3, for every prompt position (`Model.logits`) and every decode step;
* every boundary of every layer (residual in, attention output, MLP output, layer output), and the
  final-norm state and the last-token logits: relative error max |Δ| / max |hf| over the tensor ≤ 1e-4.
"""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")
pytest.importorskip("accelerate")

from reference.compare import compare_evaluations  # noqa: E402
from reference.ember_recorder import record_generation  # noqa: E402
from reference.hf_capture import capture, load_hf_from_gguf  # noqa: E402

pytestmark = [pytest.mark.reference, pytest.mark.slow]

LOGITS_ABS_TOLERANCE = 1e-3
RELATIVE_TOLERANCE = 1e-4
DECODE_STEPS = 4

PROMPTS = {
    # "The capital of France is"
    "france": [504, 3575, 282, 4649, 314],
    # <|im_start|>user\nWhat is 12 times 34?<|im_end|>\n<|im_start|>assistant\n  (llama.cpp digit split)
    "chat": [1, 4093, 198, 1780, 314, 216, 33, 34, 1711, 216, 35, 36, 47, 2, 198, 1, 520, 9531, 198],
    # "def fibonacci(n):\n    if n < 2:\n        return n\n"
    "code": [1604, 3987, 46477, 24, 94, 727, 472, 585, 304, 2067, 216, 34, 42, 448, 1003, 304, 198],
    # "Once upon a time, in a small village by the sea, there lived"
    "story": [6403, 1980, 253, 655, 28, 281, 253, 1165, 6560, 411, 260, 3426, 28, 665, 4161],
}


@pytest.fixture(scope="module")
def hf_smollm2(smollm2_path):
    return load_hf_from_gguf(smollm2_path)


@pytest.mark.parametrize("prompt", list(PROMPTS))
def test_smollm2_matches_transformers(prompt, smollm2, hf_smollm2):
    ids = PROMPTS[prompt]
    ours, generated = record_generation(smollm2, ids, DECODE_STEPS)
    reference = capture(hf_smollm2, ids, generated[:DECODE_STEPS])

    prefill_logits = smollm2.logits(ids)
    logit_errors = [float(np.abs(prefill_logits - reference[0].logits).max())]
    logit_errors += [float(np.abs(e.logits - r.logits[-1:]).max()) for e, r in zip(ours[1:], reference[1:],
                                                                                     strict=True)]
    worst = compare_evaluations(ours, reference)
    print(f"\n  smollm2 {prompt}: logits max|Δ| {max(logit_errors):.2e} "
          f"(max|logit| {np.abs(reference[0].logits).max():.1f})")
    for w in worst.values():
        print(f"  smollm2 {prompt} {w}")

    assert max(logit_errors) <= LOGITS_ABS_TOLERANCE, f"{prompt}: logits max|Δ| per evaluation {logit_errors}"
    failures = [str(w) for w in worst.values() if not w.relative <= RELATIVE_TOLERANCE]
    assert not failures, f"{prompt}: relative error above {RELATIVE_TOLERANCE}:\n" + "\n".join(failures)
