"""SentencePiece-style BPE vocabularies (Llama 2, Mistral, TinyLlama) through `baton tokenize`,
against Hugging Face `tokenizers` on the same vocabulary.

No such vocabulary comes with the package registries, so each run trains one: `tokenizers`' BPE
trainer, with byte fallback, on a corpus of this module's texts and fresh random ones (a seed,
printed; BATON_TOKENIZER_SEED replays it), laid out as Llama's (<unk>, <s>, </s>, the 256 byte
tokens, then the learned ones), with a character alphabet cut short so that rarer characters
fall back to bytes. That vocabulary is then served in the layouts models ship:

- tokenizer.json, legacy (Llama 2, TinyLlama, Mistral 7B v0.1): Prepend("▁") + Replace(" ", "▁")
  normalizers, no pre-tokenizer;
- tokenizer.json, Metaspace (transformers' LlamaTokenizer): prepend_scheme "first", no split; and
  prepend_scheme "always" with split;
- GGUF, tokenizer.ggml.model "llama": tokens, scores and token types, no merges. The oracle here
  follows llama.cpp and SentencePiece (a space in front of the text and after each added token):
  the legacy normalizer, with the merges transformers derives from the scores (generate_merges).

Each layout's oracle is the `tokenizers` object that wrote (or, for GGUF, reads) that layout:
encode(text, add_special_tokens=False) ids and decode(ids, skip_special_tokens=False) text must be
equal, on whitespace runs, digits, emoji, CJK, special-token text and random texts; decode also
on random id sequences, whose byte tokens often form invalid UTF-8.
"""

import json
import os
import random
import subprocess

import pytest

from test_tokenizer import BATON_BIN, CORPUS
from test_tokenizer import random_text as byte_level_random_text

tokenizers = pytest.importorskip("tokenizers")
from tokenizers import AddedToken, Tokenizer, decoders, models, normalizers, pre_tokenizers, processors  # noqa: E402

MARK = "\u2581"
SPECIALS = ["<unk>", "<s>", "</s>"]
FRAGMENTS = ["<s>", "</s>", "<unk>", "<s", "s>", "  ", "123", "0.5", "😀", "日本", "\u00e9", "x<s>y", " <s> "]


def random_text(rng):
    return byte_level_random_text(rng, FRAGMENTS)


@pytest.fixture(scope="module")
def rng():
    seed = int(os.environ.get("BATON_TOKENIZER_SEED", random.randrange(2**32)))
    print(f"SentencePiece vocabularies: BATON_TOKENIZER_SEED={seed}")
    return random.Random(seed)


def legacy_text(tok):
    tok.normalizer = normalizers.Sequence([normalizers.Prepend(MARK), normalizers.Replace(" ", MARK)])
    tok.pre_tokenizer = None


def llama_decoder(tok):
    tok.decoder = decoders.Sequence([decoders.Replace(MARK, " "), decoders.ByteFallback(), decoders.Fuse(),
                                     decoders.Strip(" ", 1, 0)])


@pytest.fixture(scope="module")
def learned(rng):
    """(vocab text -> id in Llama's layout, merges, the training corpus)."""
    corpus = CORPUS + [random_text(rng) for _ in range(400)]
    trainer_tok = Tokenizer(models.BPE(unk_token="<unk>", byte_fallback=True, fuse_unk=True))
    legacy_text(trainer_tok)
    trainer = tokenizers.trainers.BpeTrainer(vocab_size=rng.randint(700, 1400), special_tokens=SPECIALS,
                                             limit_alphabet=rng.randint(90, 160), show_progress=False)
    trainer_tok.train_from_iterator(corpus, trainer)
    model = json.loads(trainer_tok.to_str())["model"]
    vocab = {t: i for i, t in enumerate(SPECIALS)}
    for b in range(256):
        vocab[f"<0x{b:02X}>"] = len(vocab)
    for text, _ in sorted(model["vocab"].items(), key=lambda kv: kv[1]):
        vocab.setdefault(text, len(vocab))
    merges = [tuple(m) if isinstance(m, list) else tuple(m.split(" ", 1)) for m in model["merges"]]
    return vocab, merges, corpus


def with_specials(tok):
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in SPECIALS])
    tok.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 1)])
    return tok


def layout_json(learned, layout):
    vocab, merges, _ = learned
    tok = Tokenizer(models.BPE(vocab=dict(vocab), merges=list(merges), unk_token="<unk>", byte_fallback=True,
                               fuse_unk=True))
    if layout == "legacy":
        legacy_text(tok)
    elif layout == "metaspace-first":
        tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement=MARK, prepend_scheme="first", split=False)
    elif layout == "metaspace-always-split":
        tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement=MARK, prepend_scheme="always", split=True)
    llama_decoder(tok)
    return with_specials(tok)


@pytest.fixture(scope="module")
def served(learned, tmp_path_factory):
    """{layout: (path baton loads, the HF oracle)}."""
    vocab, merges, _ = learned
    out = {}
    for layout in ("legacy", "metaspace-first", "metaspace-always-split"):
        folder = tmp_path_factory.mktemp(layout)
        tok = layout_json(learned, layout)
        tok.save(str(folder / "tokenizer.json"))
        (folder / "tokenizer_config.json").write_text(json.dumps({"bos_token": "<s>", "eos_token": "</s>"}))
        out[layout] = (str(folder), tok)

    # GGUF: tokens by id, a score per token (a learned token's is minus its merge's rank, so the
    # scores order the merges as training did), types (2 unknown, 3 control, 6 byte, 1 normal).
    gguf = pytest.importorskip("gguf")
    from transformers.tokenization_utils_base import generate_merges

    tokens = [t for t, _ in sorted(vocab.items(), key=lambda kv: kv[1])]
    rank = {a + b: i for i, (a, b) in enumerate(merges)}
    scores = [-float(rank[t]) if t in rank else 0.0 for t in tokens]
    types = [2 if t == "<unk>" else 3 if t in SPECIALS else 6 if t.startswith("<0x") and len(t) == 6 else 1
             for t in tokens]
    path = tmp_path_factory.mktemp("gguf") / "vocab.gguf"
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_tokenizer_model("llama")
    w.add_token_list(tokens)
    w.add_token_scores(scores)
    w.add_token_types(types)
    w.add_unk_token_id(0)
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    merged = {t: s for t, s, k in zip(tokens, scores, types) if k == 1}
    oracle = Tokenizer(models.BPE(vocab=dict(vocab), merges=generate_merges(dict(vocab), merged), unk_token="<unk>",
                                  byte_fallback=True, fuse_unk=True))
    legacy_text(oracle)
    llama_decoder(oracle)
    oracle.add_special_tokens([AddedToken(t, special=True, normalized=False) for t, k in zip(tokens, types) if k == 3])
    out["gguf"] = (str(path), oracle)
    return out


def baton(path, *args):
    proc = subprocess.run([BATON_BIN.encode(), b"tokenize", b"--model", path.encode(), *args], capture_output=True,
                          timeout=60)
    assert proc.returncode == 0, f"baton tokenize {args!r} on {path}: {proc.stderr.decode(errors='replace')}"
    return proc.stdout


def baton_ids(path, text):
    line = baton(path, text.encode("utf-8")).decode().strip()
    return [int(x) for x in line.split(",")] if line else []


def baton_decode(path, ids):
    return baton(path, b"--decode", ",".join(map(str, ids)).encode()).decode("utf-8")


LAYOUTS = ["legacy", "metaspace-first", "metaspace-always-split", "gguf"]


@pytest.fixture(scope="module", autouse=True)
def baton_binary():
    if not os.path.exists(BATON_BIN):
        pytest.skip(f"{BATON_BIN} is not built (set BATON_BIN)")


@pytest.mark.parametrize("layout", LAYOUTS)
def test_corpus_and_random_texts_encode_and_decode_as_hf(served, rng, layout):
    path, oracle = served[layout]
    texts = [t for t in CORPUS if t] + [random_text(rng) for _ in range(60)] + FRAGMENTS
    for text in texts:
        want = oracle.encode(text, add_special_tokens=False).ids
        assert baton_ids(path, text) == want, f"{layout}: text {text!r}, HF tokens {oracle.encode(text).tokens}"
        assert baton_decode(path, want) == oracle.decode(want, skip_special_tokens=False), f"{layout}: {text!r}"


@pytest.mark.parametrize("layout", LAYOUTS)
def test_random_ids_decode_as_hf(served, rng, layout):
    """Random id sequences, byte tokens drawn often: runs that are valid UTF-8 and runs that are
    not (one U+FFFD per byte token), spaces at the start, special tokens."""
    path, oracle = served[layout]
    n = oracle.get_vocab_size()
    for _ in range(40):
        ids = [rng.randrange(3, 259) if rng.random() < 0.5 else rng.randrange(n) for _ in range(rng.randint(1, 12))]
        assert baton_decode(path, ids) == oracle.decode(ids, skip_special_tokens=False), f"{layout}: ids {ids}"


def test_bytes_the_vocabulary_lacks_fall_back(served, learned):
    """Characters the cut alphabet left out are encoded as their bytes' tokens, as HF does."""
    vocab, _, corpus = learned
    missing = sorted({c for text in corpus for c in text if c not in vocab and c != " "})
    assert missing, "the alphabet was not cut: no byte fallback to test"
    path, oracle = served["legacy"]
    text = " ".join(missing[:40])
    ids = oracle.encode(text, add_special_tokens=False).ids
    assert any(3 <= i < 259 for i in ids)
    assert baton_ids(path, text) == ids
