"""Record llama.cpp's token ids for ember's tokenizer corpus (run once; the output is committed).

    pip install llama-cpp-python==0.3.36      # the `bench` extra; builds llama.cpp from source
    python scripts/record_tokenizer_ids.py --smollm2 PATH --gemma3 PATH

It writes tests/data/tokenizer/corpus.json (the strings) and one `<vocab>.json` per vocabulary with,
for every string, what real llama.cpp (through llama-cpp-python's low-level bindings, `vocab_only`)
returns:

* `plain`:   llama_tokenize(text, add_special=False, parse_special=False)
* `special`: llama_tokenize(text, add_special=False, parse_special=True)
* `server`:  llama_tokenize(text, add_special=True,  parse_special=True)  (what llama-server does)
* `detok_plain`:   llama_detokenize(plain,   remove_special=False, unparse_special=False)
* `detok_special`: llama_detokenize(special, remove_special=False, unparse_special=True)
* `pieces`: the concatenated llama_token_to_piece(t, lstrip=0, special=False) of `special`

and, per vocabulary, `vocab_facts`: the special ids, add_bos/add_eos, the EOG set and the attribute of
every token that is not plain NORMAL (after llama.cpp's load-time rules); and `whole_vocab`: every
NORMAL token's printed text tokenized alone (add_special=False, parse_special=False), keeping only the
tokens whose result is not just themselves.

Byte strings are stored as text when they are valid UTF-8, else as {"hex": ...}. The vocabularies are
SmolLM2-135M-Instruct and Gemma 3 270M (real files, given by path), llama.cpp's own vocab fixtures
in tests/data/vocab/, and `gpt-2-default`: GPT-2's fixture rewritten with `tokenizer.ggml.pre =
"default"` (llama.cpp's fallback pre-tokenizer; its `sha256` is of that temporary copy).
"""

from __future__ import annotations

import argparse
import ctypes
import hashlib
import json
import random
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
OUT_DIR = ROOT / "tests" / "data" / "tokenizer"
VOCAB_DIR = ROOT / "tests" / "data" / "vocab"
FIXTURE_VOCABS = ["gpt-2", "refact", "qwen2", "qwen35", "llama-bpe", "llama-spm", "gemma-4"]

PROSE = (
    "The lighthouse keeper counted the ships each evening, writing their names in a ledger that had "
    "outlived three of his predecessors. On calm nights the harbour smelled of tar and rope; on stormy "
    "ones, of nothing at all, because the wind took every smell away before it could settle. He liked "
    "numbers: 1,204 ships in 1987, 998 in 1988, and only 17 during the week the fog never lifted. "
    '"Why count them?" his niece asked once. "Because someone should," he said, and didn\'t explain. '
    "She thought he'd been lonely; he thought she'd misunderstood what a ledger is for. It's a promise "
    "that the past happened in a particular order, and that the order matters.\n\n"
    "Years later she kept the ledger on a shelf between a cookbook and a dictionary of tides. Sometimes "
    "she opened it at random - 3 March, 14:05, 'Marguerite', outbound - and tried to imagine the weather."
)

CODE = (
    "def merge(a: list[int], b: list[int]) -> list[int]:\n"
    '    """Merge two sorted lists."""\n'
    "    i = j = 0\n"
    "    out = []\n"
    "    while i < len(a) and j < len(b):\n"
    "        if a[i] <= b[j]:\n"
    "            out.append(a[i]); i += 1\n"
    "        else:\n"
    "            out.append(b[j]); j += 1\n"
    "    return out + a[i:] + b[j:]\n"
    "\n"
    '\tif (x != 0x7fff && y >= -1e-9) { return {"k": [1, 2, 3]}; }  // C-ish\n'
    "SELECT name, COUNT(*) FROM users WHERE id IN (1,2,3) GROUP BY name;\n"
)

HANDWRITTEN = [
    "",
    " ",
    "  ",
    "   ",
    "\t",
    "\n",
    "\n\n",
    "\n\n\n",
    "\t\n",
    "\r\n",
    "\r\n\r\n",
    "\n \n\n \n\n\n \t \t\t \t\n  \n   \n",
    "Hello",
    " Hello",
    "  Hello",
    "   Hello",
    "    Hello\n    Hello",
    "Hello world",
    " Hello world",
    "Hello World",
    "HELLO WORLD",
    "Hello, world!",
    " Hello, world!",
    "Hello , world ?",
    "!!!!!!",
    "a ?",
    " (",
    "\n =",
    "' era",
    '"`',
    "I 'm here , ok ?",
    " ' ",
    " 's",
    " 't",
    "x 've y 're z 'll",
    "I've been 'told he's there, 'RE you sure? 'M not sure I'll make it, 'D you like some tea? We'Ve a'lL",
    "don't won't can't shouldn't y'all o'clock",
    "It's 5 o'clock somewhere.",
    "3",
    "33",
    "333",
    "3333",
    "33333",
    "333333",
    "3333333",
    "33333333",
    "333333333",
    "12345678901",
    "3.3 3..3 3...3",
    "1,234.5",
    "-42",
    "+1 (555) 010-9999",
    "2026-11-29T22:15:00Z",
    "0x1F600",
    "1e-9",
    "½ ¼ ¾ ² ³ Ⅻ 〇 ① ٣ ３",
    "ied 4 ½ months",
    "¼-a",
    "Ⅵ-a",
    "a 〇b",
    "Ⅻ2023",
    "v2.0.1-rc3",
    "Äpfel",
    "Ärger über Öl",
    "Cửa Việt",
    "nguyễn",
    "我想在apple工作1314151天～",
    "你好，世界！",
    "日本語のテキスト、カタカナとひらがな。",
    "нещо на Български",
    "Привет, мир!",
    "Γειά σου Κόσμε",
    "שלום עולם",
    "مرحبا بالعالم ١٢٣",
    "नमस्ते दुनिया",
    "กรุงเทพมหานคร",
    "안녕하세요 세계",
    "កាន់តែពិសេសអាចខលចេញ",
    "ᄀᄁᄂ 한글 자모",
    "e\u0301",
    "re\u0301sume\u0301",
    "résumé",
    "n\u0303",
    "a\u0300\u0301\u0302\u0303",
    "\u0301start",
    "🦙",
    "😁",
    "🦙🦙🦙",
    "😶‍🌫️",
    "👨‍👩‍👧",
    "👍🏽",
    "❤️",
    "🇺🇳",
    "emoji 🎉 in text 🎉!",
    "☺\ufe0f",
    "\u00a0",
    "a\u00a0b",
    "\u1680x",
    "a\u2000b\u2001c\u200ad",
    "line\u2028sep\u2029para",
    "\u3000全角",
    "x\u0085y",
    "\u001c\u001d\u001e\u001f",
    "\x1f-a",
    "zero\u200bwidth",
    "\ufeff//",
    "\ufeffBOM",
    "\u0378",
    "\ue000\uf8ff",
    "\U000f0000",
    "\U00010d40",
    "\U000116d0",
    "\U0001e4f0",
    "\U00011f50",
    "\U000ac517\U000522f4",
    "\u2581",
    "a\u2581b",
    "\u2581\u2581x",
    "Ġ",
    "Ċ",
    "ĠĠhello",
    "\ufffd",
    "tab\there",
    "\ttab\t\ttabs",
    "   leading and trailing   ",
    "multiple   spaces    between     words",
    "trailing newline\n",
    "\n\nleading newlines",
    "a\n\n\n\nb",
    "<|im_start|>user\nHi<|im_end|>",
    "<|im_start|>assistant\n",
    "<|endoftext|>",
    "text<|endoftext|>more",
    "<|im_start|><|im_end|>",
    "<|im_start",
    "im_start|>",
    "<think>x</think>",
    "<bos>",
    "<eos>",
    "<pad>",
    "<unk>",
    "<start_of_turn>user\nHi<end_of_turn>\n<start_of_turn>model\n",
    "<end_of_turn>",
    "<start_of_image>",
    "<unused0>",
    "<unused98>",
    "[multimodal]",
    "<table><tr><td>1</td></tr></table>",
    "<b>bold</b> and <i>it</i>",
    "<s>",
    "</s>",
    "a </s> b",
    "<s><s><unk><s>a<s>b<s>c<unk>d<unk></s>",
    "a<s>b",
    "<s>Hello",
    "<|turn>user\nHi<turn|>",
    "<|channel>thought\n<channel|>",
    "<|tool_call>call<tool_call|>",
    '<|"|>',
    "<|begin_of_text|>Hello",
    "<|eot_id|>",
    "<repo_name>x<file_sep>y",
    "<|fim_prefix|>a<|fim_suffix|>b<|fim_middle|>",
    "https://example.com/path?q=1&r=two#frag",
    "user@example.org",
    "C:\\Users\\name\\file.txt",
    "/usr/local/bin",
    '<html><body><p class="x">Hi</p></body></html>',
    '{"key": [1, 2.5, null, true], "nested": {"a": "b"}}',
    "$$E = mc^2$$ and \\frac{a}{b}",
    "```python\nprint('hi')\n```",
    "| a | b |\n|---|---|\n| 1 | 2 |",
    "- item one\n- item two\n  - nested",
    "# Title\n\n## Subtitle\n",
    "**bold** _italic_ `code`",
    "aGVsbG8gd29ybGQgdGhpcyBpcyBiYXNlNjQ=",
    "QUJDREVGR0hJSktMTU5PUFFSU1RVVldYWVo0MTIzNDU2Nzg5Kys=",
    "The quick brown fox jumps over the lazy dog.",
    "THE QUICK BROWN FOX",
    "tHe QuIcK bRoWn FoX",
    "supercalifragilisticexpialidocious",
    "antidisestablishmentarianism",
    "pneumonoultramicroscopicsilicovolcanoconiosis",
    "......",
    "---",
    "___",
    "***",
    "~~~",
    "?!?!",
    "…",
    "—",
    "–",
    "«guillemets»",
    "„Anführungszeichen“",
    "“curly” ‘quotes’",
    "©®™",
    "§¶†‡",
    "€£¥₹₿",
    "°C ±5",
    "→ ← ↑ ↓ ⇒",
    "∀x∈ℝ: x²≥0",
    "αβγδε",
    "ℵ₀",
    "𝔘𝔫𝔦𝔠𝔬𝔡𝔢",
    "𝟘𝟙𝟚",
    PROSE,
    CODE,
]


# Code points whose class differs between llama.cpp's Unicode 15.1 tables and newer (16.0/17.0) ones, or
# that Unicode 15.0 added (Kawi, Nag Mundari, CJK extension H); each is probed in context.
PROBE_CODE_POINTS = [
    0x88F,
    0x897,
    0x1ADD,
    0x1B4E,
    0x1B7F,
    0x10D40,
    0x10D6B,
    0x10ED0,
    0x113C2,
    0x113D5,
    0x113D8,
    0x116D5,
    0x11B61,
    0x11BF0,
    0x11DE5,
    0x1391A,
    0x13EED,
    0x16125,
    0x16D6D,
    0x16D70,
    0x18DA7,
    0x1CCF2,
    0x328D4,
    0x32EA7,
    0xCF3,
    0x13444,
    0x1E058,
    0x1E4F0,
    0x11F50,
    0x31350,
    0x2EC04,
    0x0378,
    0xE000,
    0xF0000,
    0x2FFFF,
]


def probes() -> list[str]:
    out = []
    for cp in PROBE_CODE_POINTS:
        char = chr(cp)
        out += ["a " + char + char + "1", "x" + char + "y 1" + char]
    return out


def random_strings(count: int, seed: int) -> list[str]:
    """Strings from a hostile character pool: spaces, newlines, digits, marks, CJK, emoji, specials."""
    pool = list("abcXYZ019 \t\n\r.,;:'\"!?-_()[]{}<>|/\\@#$%^&*+=~`") + [
        "  ",
        "\n\n",
        "'s",
        "'ll",
        "é",
        "e\u0301",
        "ß",
        "ı",
        "ſ",
        "K",
        "中",
        "文",
        "語",
        "한",
        "ก",
        "ा",
        "ि",
        "٣",
        "½",
        "²",
        "①",
        "🦙",
        "😀",
        "\u200d",
        "\ufe0f",
        "\u00a0",
        "\u3000",
        "\u2581",
        "Ġ",
        "▁▁",
        "<s>",
        "</s>",
        "<|im_end|>",
        "<|endoftext|>",
        "<eos>",
        "<start_of_turn>",
        "<end_of_turn>",
        "<b>",
        "\n\n\n",
        "    ",
    ]
    rng = random.Random(seed)
    return ["".join(rng.choice(pool) for _ in range(rng.randint(1, 40))) for _ in range(count)]


def corpus() -> list[str]:
    words = PROSE.replace("\n", " ").split()
    rng = random.Random(7)
    long_text = " ".join(rng.choice(words) for _ in range(3000))
    return [
        *HANDWRITTEN,
        *probes(),
        *random_strings(90, seed=1),
        long_text,
        "a" * 5000,
        "7" * 3000,
        " " * 1000 + "z",
        "\n" * 500,
        "x" * 2000 + " " + "😀" * 300,
    ]


def stored(data: bytes) -> str | dict[str, str]:
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError:
        return {"hex": data.hex()}


class Oracle:
    """llama.cpp's tokenizer through llama-cpp-python's low-level bindings."""

    def __init__(self, path: Path) -> None:
        import llama_cpp

        self.lib = llama_cpp
        params = llama_cpp.llama_model_default_params()
        params.vocab_only = True
        self.model = llama_cpp.llama_model_load_from_file(str(path).encode(), params)
        if not self.model:
            raise SystemExit(f"llama.cpp could not load {path}")
        self.vocab = llama_cpp.llama_model_get_vocab(self.model)

    def tokenize(self, text: str, add_special: bool, parse_special: bool) -> list[int]:
        data = text.encode("utf-8")
        size = len(data) + 16
        buffer = (self.lib.llama_token * size)()
        n = self.lib.llama_tokenize(self.vocab, data, len(data), buffer, size, add_special, parse_special)
        if n < 0:
            size = -n
            buffer = (self.lib.llama_token * size)()
            n = self.lib.llama_tokenize(self.vocab, data, len(data), buffer, size, add_special, parse_special)
        return list(buffer[:n])

    def detokenize(self, ids: list[int], remove_special: bool, unparse_special: bool) -> bytes:
        tokens = (self.lib.llama_token * max(len(ids), 1))(*ids)
        size = 64 + 64 * len(ids)
        while True:
            buffer = ctypes.create_string_buffer(size)
            n = self.lib.llama_detokenize(
                self.vocab, tokens, len(ids), buffer, size, remove_special, unparse_special
            )
            if n >= 0:
                return buffer.raw[:n]
            size = -n + 1

    def vocab_facts(self) -> dict:
        """Special ids, add_bos/add_eos, the EOG set and every non-NORMAL token attribute."""
        lib, vocab = self.lib, self.vocab
        n = lib.llama_vocab_n_tokens(vocab)
        roles = [
            "bos",
            "eos",
            "eot",
            "sep",
            "pad",
            "fim_pre",
            "fim_suf",
            "fim_mid",
            "fim_pad",
            "fim_rep",
            "fim_sep",
        ]
        special = {role: getattr(lib, f"llama_vocab_{role}")(vocab) for role in roles}
        attrs = {}
        for token in range(n):
            attr = int(lib.llama_vocab_get_attr(vocab, token))
            if attr != 4:  # LLAMA_TOKEN_ATTR_NORMAL
                attrs[str(token)] = attr
        return {
            "n_tokens": n,
            "special": {role: (None if value < 0 else value) for role, value in special.items()},
            "add_bos": bool(lib.llama_vocab_get_add_bos(vocab)),
            "add_eos": bool(lib.llama_vocab_get_add_eos(vocab)),
            "eog": [t for t in range(n) if lib.llama_vocab_is_eog(vocab, t)],
            "attrs": attrs,
        }

    def whole_vocab(self) -> dict:
        """Each NORMAL token's printed text tokenized on its own; only results other than [id] are kept."""
        lib, vocab = self.lib, self.vocab
        checked, other = 0, {}
        for token in range(lib.llama_vocab_n_tokens(vocab)):
            if int(lib.llama_vocab_get_attr(vocab, token)) != 4:
                continue
            try:
                text = self.pieces([token]).decode("utf-8")
            except UnicodeDecodeError:
                continue
            if not text:
                continue
            checked += 1
            ids = self.tokenize(text, False, False)
            if ids != [token]:
                other[str(token)] = ids
        return {"checked": checked, "other": other}

    def pieces(self, ids: list[int]) -> bytes:
        out = bytearray()
        for token in ids:
            buffer = ctypes.create_string_buffer(256)
            n = self.lib.llama_token_to_piece(self.vocab, token, buffer, 256, 0, False)
            if n < 0:
                buffer = ctypes.create_string_buffer(-n)
                n = self.lib.llama_token_to_piece(self.vocab, token, buffer, -n, 0, False)
            out += buffer.raw[:n]
        return bytes(out)


def record(name: str, path: Path, texts: list[str]) -> None:
    oracle = Oracle(path)
    cases = []
    for text in texts:
        plain = oracle.tokenize(text, False, False)
        special = oracle.tokenize(text, False, True)
        cases.append(
            {
                "plain": plain,
                "special": special,
                "server": oracle.tokenize(text, True, True),
                "detok_plain": stored(oracle.detokenize(plain, False, False)),
                "detok_special": stored(oracle.detokenize(special, False, True)),
                "pieces": stored(oracle.pieces(special)),
            }
        )
    sha = hashlib.sha256(path.read_bytes()).hexdigest()
    result = {
        "vocab": name,
        "file": path.name,
        "sha256": sha,
        "llama_cpp_python": oracle.lib.__version__,
        "vocab_facts": oracle.vocab_facts(),
        "whole_vocab": oracle.whole_vocab(),
        "cases": cases,
    }
    (OUT_DIR / f"{name}.json").write_text(
        json.dumps(result, ensure_ascii=False, separators=(",", ":")) + "\n", encoding="utf-8"
    )
    print(f"{name}: {len(cases)} cases")


def gguf_variant(source: Path, target: Path, overrides: dict[str, str]) -> Path:
    """A vocab-only copy of `source` with some string keys replaced (e.g. another pre-tokenizer)."""
    import gguf

    reader = gguf.GGUFReader(source)
    arch = str(reader.fields["general.architecture"].contents())
    writer = gguf.GGUFWriter(target, arch)
    for name, field in reader.fields.items():
        if name.startswith("GGUF.") or name == "general.architecture":
            continue
        value = overrides.get(name, field.contents())
        sub_type = field.types[1] if len(field.types) > 1 else None
        writer.add_key_value(name, value, field.types[0], sub_type=sub_type)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return target


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--smollm2", type=Path, required=True, help="SmolLM2-135M-Instruct.Q4_1.gguf")
    parser.add_argument("--gemma3", type=Path, required=True, help="gemma-3-270m-q4_k_m.gguf")
    args = parser.parse_args()
    OUT_DIR.mkdir(parents=True, exist_ok=True)
    texts = corpus()
    (OUT_DIR / "corpus.json").write_text(
        json.dumps(texts, ensure_ascii=False, indent=0) + "\n", encoding="utf-8"
    )
    print(f"corpus: {len(texts)} strings")
    record("smollm2", args.smollm2, texts)
    record("gemma3", args.gemma3, texts)
    for name in FIXTURE_VOCABS:
        record(name, VOCAB_DIR / f"ggml-vocab-{name}.gguf", texts)
    with tempfile.TemporaryDirectory() as tmp:  # the `default` pre-tokenizer, on GPT-2's vocabulary
        variant = gguf_variant(
            VOCAB_DIR / "ggml-vocab-gpt-2.gguf",
            Path(tmp) / "gpt-2-default.gguf",
            {"tokenizer.ggml.pre": "default"},
        )
        record("gpt-2-default", variant, texts)


if __name__ == "__main__":
    main()
