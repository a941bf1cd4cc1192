"""`baton tokenize` against Hugging Face `tokenizers` on the same vocabulary.

The oracle is the model's real tokenizer: transformers rebuilds it from the GGUF metadata, and we
fix its pre-tokenizer (see `hf_tokenizer`). Every text must give exactly the oracle's ids for
`encode(text, add_special_tokens=False)`. Random texts are drawn fresh each run; the seed is
printed (pytest shows it on failure) and BATON_TOKENIZER_SEED replays a run.

Environment: BATON_BIN (default <repo>/build/baton), BATON_MODEL (default: the path
scripts/fetch-model.sh prints).
"""

import os
import pathlib
import random
import subprocess

import pytest

REPO = pathlib.Path(__file__).resolve().parents[2]
BATON_BIN = os.environ.get("BATON_BIN", str(REPO / "build" / "baton"))

# No text starts with "-", so none can be taken for a flag by the CLI's argument parser.
CORPUS = [
    "",
    " ",
    "   ",
    "\t",
    "\n",
    "\n\n\n",
    " \n \n",
    "trailing spaces   ",
    "  leading spaces",
    "tabs\tand\t\ttabs",
    "mixed \t\n whitespace \r\n runs",
    "Hello, world!",
    "12345",
    "3.14159",
    "1,000,000",
    "a1b22c333",
    # Whitespace before a digit: SmolLM2 isolates the digit first, which changes how the spaces split.
    "in  42 days,\n\n2024 was\t\t7 years",
    "version 2.0\n\n3 items  5",
    "x = 42 + 7*6; y=0.5e-3",
    "don't",
    "I'M sure we'll see; they've said you'd go",
    "It's JOHN'S book",
    "café naïve résumé Ångström Ærøskøbing",
    "日本語のテキストと漢字",
    "中文分词测试：你好，世界！",
    "Привет, как дела? Ёжик",
    "مرحبا بالعالم",
    "नमस्ते दुनिया",
    "e\u0301 a\u0308 n\u0303 combining marks",
    "한국어 문장입니다",
    "Ελληνικά γράμματα",
    "emoji 😀🎉👍🏽",
    "family 👨‍👩‍👧‍👦 and rainbow 🏳️‍🌈",
    "flags 🇫🇷🇯🇵🇺🇸",
    "superscripts x² y³ ½ Ⅻ ٣٤٥ ①②",
    "def fib(n):\n    if n < 2:\n        return n\n    return fib(n - 1) + fib(n - 2)\n",
    "#include <vector>\nint main() {\n  std::vector<int> v{1, 2, 3};\n  return v.size();\n}\n",
    '{"name": "baton", "tokens": [1, 2, 3], "nested": {"ok": true, "pi": 3.14}}',
    "<|im_start|>user\nWhat is 2+2?<|im_end|>\n<|im_start|>assistant\n",
    "text<|im_end|>more<|endoftext|>",
    "<|im_start|><|im_start|>  <|im_end|>",
    "not special: <|im_start |> <im_start> <|im_end",
    "URL https://example.com/path?q=1&r=two#frag and email a.b@c.org",
    "!!!???...,,,;;;:::---___",
    "\u00a0non-breaking\u00a0spaces\u3000and ideographic\u2028line sep",
    "zero\u200bwidth\u200djoiner\ufeffbom",
    (
        "The quick brown fox jumps over the lazy dog. In 1969, Apollo 11 landed on the Moon; "
        "Neil Armstrong said: \"That's one small step for [a] man, one giant leap for mankind.\" "
        "Since then, more than 500 people have flown to space — and some of them, like Valentina "
        "Tereshkova (1963), were pioneers.\n\nThe end.  "
    )
    * 8,
]

# Code point blocks the random texts draw from, so that every regex class is exercised.
RANDOM_BLOCKS = [
    (0x20, 0x7E),      # printable ASCII
    (0xA0, 0x24F),     # Latin-1 supplement, Latin extended
    (0x300, 0x36F),    # combining marks
    (0x370, 0x3FF),    # Greek
    (0x400, 0x4FF),    # Cyrillic
    (0x600, 0x6FF),    # Arabic (with Arabic-Indic digits)
    (0x900, 0x97F),    # Devanagari
    (0x2000, 0x206F),  # general punctuation, odd spaces
    (0x2150, 0x218F),  # number forms (Nl, No)
    (0x3000, 0x30FF),  # CJK punctuation, kana
    (0x4E00, 0x4FFF),  # CJK ideographs
    (0xAC00, 0xAD00),  # Hangul
    (0x1F300, 0x1F64F),  # emoji
]
WHITESPACE = [" ", "  ", "\t", "\n", "\r\n", "\n\n", "\u00a0", "\u3000", "\u2028", "\u0085", "\x0b", "\x0c"]
FRAGMENTS = ["<|im_start|>", "<|im_end|>", "<|endoftext|>", "'s", "'LL", "123", "0.5", "  ", "😀"]


def random_text(rng: random.Random, fragments=FRAGMENTS) -> str:
    """Printable ASCII, runs of a random script's characters, whitespace and `fragments`."""
    parts = []
    for _ in range(rng.randint(1, 24)):
        kind = rng.random()
        if kind < 0.35:
            parts.append("".join(chr(rng.randint(0x20, 0x7E)) for _ in range(rng.randint(1, 8))))
        elif kind < 0.65:
            lo, hi = rng.choice(RANDOM_BLOCKS)
            parts.append("".join(chr(rng.randint(lo, hi)) for _ in range(rng.randint(1, 6))))
        elif kind < 0.85:
            parts.append(rng.choice(WHITESPACE))
        else:
            parts.append(rng.choice(fragments))
    return "".join(parts).lstrip("-")


@pytest.fixture(scope="module")
def model_path() -> str:
    path = os.environ.get("BATON_MODEL")
    if not path:
        fetch = subprocess.run([str(REPO / "scripts" / "fetch-model.sh")], check=True, capture_output=True, text=True)
        path = fetch.stdout.strip().splitlines()[-1]
    return path


@pytest.fixture(scope="module")
def hf_tokenizer(model_path):
    gguf = pytest.importorskip("gguf")
    pre_tokenizers = pytest.importorskip("tokenizers").pre_tokenizers
    from transformers.integrations.gguf.gguf_tokenizer_mapping import convert_gguf_tokenizer

    reader = gguf.GGUFReader(model_path)

    def field(key):
        return reader.fields[key].contents()

    pre = field("tokenizer.ggml.pre")
    spec = {
        "tokenizer_type": field("tokenizer.ggml.model"),
        "pre_tokenizer_type": pre,
        "tokens": field("tokenizer.ggml.tokens"),
        "merges": field("tokenizer.ggml.merges"),
        "token_type": field("tokenizer.ggml.token_type"),
        "bos_token_id": field("tokenizer.ggml.bos_token_id"),
        "eos_token_id": field("tokenizer.ggml.eos_token_id"),
    }
    tok, _ = convert_gguf_tokenizer("llama", spec)
    if pre == "smollm":
        # transformers maps "smollm" to plain ByteLevel (the GPT-2 regex alone), but SmolLM2's own
        # tokenizer.json splits off every digit first: Sequence[Digits(individual_digits=True),
        # ByteLevel]. Without this the oracle would keep "123" in one piece and disagree with the
        # model's real tokenizer on every number.
        tok.pre_tokenizer = pre_tokenizers.Sequence(
            [
                pre_tokenizers.Digits(individual_digits=True),
                pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
            ]
        )
    return tok


def baton_tokenize(model_path, text):
    """Runs `baton tokenize`; `text` is str, or bytes to pass arbitrary (invalid) UTF-8."""
    arg = text if isinstance(text, bytes) else text.encode("utf-8")
    return subprocess.run(
        [BATON_BIN.encode(), b"tokenize", b"--model", model_path.encode(), arg], capture_output=True, timeout=60
    )


def baton_ids(model_path, text):
    proc = baton_tokenize(model_path, text)
    assert proc.returncode == 0, f"baton tokenize {text!r} failed: {proc.stderr.decode(errors='replace')}"
    line = proc.stdout.decode().strip()
    return [int(x) for x in line.split(",")] if line else []


def hf_ids(hf_tokenizer, text):
    return hf_tokenizer.encode(text, add_special_tokens=False).ids


@pytest.fixture(scope="module", autouse=True)
def baton_binary():
    if not os.path.exists(BATON_BIN):
        pytest.skip(f"{BATON_BIN} is not built (set BATON_BIN)")


@pytest.mark.parametrize("text", CORPUS, ids=[f"corpus{i}" for i in range(len(CORPUS))])
def test_corpus_matches_hf(model_path, hf_tokenizer, text):
    assert baton_ids(model_path, text) == hf_ids(hf_tokenizer, text), f"text {text!r}"


def test_random_texts_match_hf(model_path, hf_tokenizer):
    seed = int(os.environ.get("BATON_TOKENIZER_SEED", random.randrange(2**32)))
    print(f"random texts: BATON_TOKENIZER_SEED={seed}")
    rng = random.Random(seed)
    for _ in range(150):
        text = random_text(rng)
        assert baton_ids(model_path, text) == hf_ids(hf_tokenizer, text), f"seed {seed}, text {text!r}"


def test_special_tokens_are_single_ids(model_path, hf_tokenizer):
    ids = baton_ids(model_path, "<|im_start|>user<|im_end|>")
    assert ids[0] == hf_tokenizer.token_to_id("<|im_start|>")
    assert ids[-1] == hf_tokenizer.token_to_id("<|im_end|>")


@pytest.mark.parametrize(
    "raw, offset",
    [(b"ab\xffcd", 2), (b"\xc3", 0), (b"ok \xed\xa0\x80 surrogate", 3), (b"overlong \xc0\xaf", 9)],
)
def test_invalid_utf8_is_rejected(model_path, raw, offset):
    proc = baton_tokenize(model_path, raw)
    assert proc.returncode == 2
    assert proc.stdout == b""
    err = proc.stderr.decode(errors="replace").strip()
    assert len(err.splitlines()) == 1, err
    assert "UTF-8" in err
    assert f"offset {offset}" in err


def test_random_ids_decode_as_hf(model_path, hf_tokenizer):
    """decode() is HF's decode(ids, skip_special_tokens=False): token bytes joined, each invalid
    UTF-8 sequence one U+FFFD. Random ids cut characters apart often."""
    seed = int(os.environ.get("BATON_TOKENIZER_SEED", random.randrange(2**32)))
    rng = random.Random(seed)
    n = hf_tokenizer.get_vocab_size()
    for _ in range(40):
        ids = [rng.randrange(n) for _ in range(rng.randint(1, 10))]
        proc = subprocess.run([BATON_BIN, "tokenize", "--model", model_path, "--decode", ",".join(map(str, ids))],
                              capture_output=True, timeout=60)
        assert proc.returncode == 0, proc.stderr
        assert proc.stdout.decode("utf-8") == hf_tokenizer.decode(ids, skip_special_tokens=False), f"seed {seed}: {ids}"
