"""Check `gemma4_gguf.write_gguf` against llama.cpp's own converter (a manual check, not a test).

    PYTHONPATH=tests python -m reference.gemma4_converter_check /path/to/llama.cpp [workdir]

For both tiny variants (base and attention_k_eq_v) and the F32/F16/Q8_0 file types it saves the HF
model (plus a HF tokenizer for the tiny vocabulary), runs llama.cpp's `convert_hf_to_gguf.py` on it and
compares with our writer's file: metadata keys and values, tensor names, shapes, types and bytes.
The llama.cpp tree is the one vendored in the llama-cpp-python 0.3.36 sdist
(`pip download --no-deps --no-binary :all: llama-cpp-python==0.3.36`, then `vendor/llama.cpp`).

Expected differences are only in tokenizer data that come from the hand-built HF tokenizer here rather
than from the writer (token scores/types, unknown_token_id) and in naming (general.name/size_label).
Last run (2026-11-29): every tensor byte-identical, every model metadata key equal, in all six files.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import gguf
import numpy as np

from reference.gemma4_gguf import Gemma4Spec, random_state, tiny_gemma4_vocab, write_gguf
from reference.gemma4_reference import build_hf

VARIANTS = {"base": {}, "k_eq_v": {"attention_k_eq_v": True, "num_global_key_value_heads": 1}}
FILE_TYPES = {"f32": gguf.GGMLQuantizationType.F32, "f16": gguf.GGMLQuantizationType.F16,
              "q8_0": gguf.GGMLQuantizationType.Q8_0}
TOKENIZER_KEYS = ("tokenizer.ggml.scores", "tokenizer.ggml.token_type", "tokenizer.ggml.unknown_token_id")
NAMING_KEYS = ("general.name", "general.size_label")


def save_hf(spec: Gemma4Spec, directory: Path) -> None:
    from tokenizers import AddedToken, Tokenizer, decoders, normalizers
    from tokenizers.models import BPE

    vocab = tiny_gemma4_vocab()
    build_hf(spec, random_state(spec, seed=7)).save_pretrained(directory, safe_serialization=True)
    model = BPE({t: i for i, t in enumerate(vocab.tokens)}, [tuple(m.split(" ")) for m in vocab.merges],
                unk_token="<unk>", byte_fallback=True, fuse_unk=True)
    tokenizer = Tokenizer(model)
    tokenizer.normalizer = normalizers.Replace(" ", "\u2581")
    tokenizer.decoder = decoders.Sequence([decoders.Replace("\u2581", " "), decoders.ByteFallback(),
                                           decoders.Fuse()])
    tokenizer.add_special_tokens([AddedToken(t, special=True, normalized=False)
                                  for t, kind in zip(vocab.tokens, vocab.token_types, strict=True)
                                  if kind == gguf.TokenType.CONTROL])
    tokenizer.save(str(directory / "tokenizer.json"))
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<bos>", "eos_token": "<eos>",
              "unk_token": "<unk>", "pad_token": "<pad>", "add_bos_token": True,
              "chat_template": vocab.chat_template}
    (directory / "tokenizer_config.json").write_text(json.dumps(config))


def differences(converted: Path, ours: Path) -> list[str]:
    a, b = gguf.GGUFReader(converted), gguf.GGUFReader(ours)
    fa = {f.name: f.contents() for f in a.fields.values() if not f.name.startswith("GGUF.")}
    fb = {f.name: f.contents() for f in b.fields.values() if not f.name.startswith("GGUF.")}
    found = []
    for key in sorted(set(fa) | set(fb)):
        if key in TOKENIZER_KEYS or key in NAMING_KEYS:
            continue
        if fa.get(key) != fb.get(key):
            found.append(f"metadata {key}: converter {fa.get(key)!r}, ours {fb.get(key)!r}")
    ta, tb = {t.name: t for t in a.tensors}, {t.name: t for t in b.tensors}
    for name in sorted(set(ta) | set(tb)):
        x, y = ta.get(name), tb.get(name)
        if x is None or y is None:
            found.append(f"tensor {name} only in {'ours' if x is None else 'the converter'}")
        elif (list(x.shape) != list(y.shape) or x.tensor_type != y.tensor_type
              or not np.array_equal(np.asarray(x.data), np.asarray(y.data))):
            found.append(f"tensor {name}: {x.shape} {x.tensor_type.name} vs {y.shape} {y.tensor_type.name}")
    return found


def main(llama_cpp: Path, workdir: Path) -> int:
    failures = 0
    for variant, changes in VARIANTS.items():
        spec = Gemma4Spec(vocab_size=len(tiny_gemma4_vocab().tokens), **changes)
        hf_dir = workdir / variant
        save_hf(spec, hf_dir)
        for type_name, qtype in FILE_TYPES.items():
            converted = workdir / f"{variant}-{type_name}-converter.gguf"
            subprocess.run([sys.executable, str(llama_cpp / "convert_hf_to_gguf.py"), str(hf_dir),
                            "--outtype", type_name, "--outfile", str(converted)], check=True,
                           capture_output=True)
            ours = write_gguf(workdir / f"{variant}-{type_name}-ours.gguf", spec, random_state(spec, seed=7),
                              qtype=qtype)
            found = differences(converted, ours)
            failures += bool(found)
            print(f"{variant} {type_name}: {'identical' if not found else 'DIFFERENT'}")
            for line in found:
                print("   ", line)
    return failures


if __name__ == "__main__":
    work = Path(sys.argv[2]) if len(sys.argv) > 2 else Path("gemma4-converter-check")
    work.mkdir(parents=True, exist_ok=True)
    sys.exit(main(Path(sys.argv[1]), work))
