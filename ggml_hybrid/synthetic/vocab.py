"""Vocabularies for synthetic models, trained on a fixed corpus (the same spec always gives the same file).

Byte-level BPE (``tokenizer.ggml.model = "gpt2"``) is trained by the ``tokenizers``
package with the pre-tokenizer of the family's real files; a SentencePiece-style
vocabulary (``"llama"``) is built the way llama.cpp's converter lays one out:
``<unk>``, ``<s>``, ``</s>``, the 256 byte tokens, then pieces by decreasing score,
every longer piece the concatenation of two earlier ones (here: BPE merges learned
on the corpus with spaces written as "▁").
"""

from __future__ import annotations

import json
from dataclasses import dataclass

from ..text.tokenizer import PRE_TOKENIZERS

CORPUS = """\
The quick brown fox jumps over the lazy dog. A mixture of experts routes every token to a few experts.
Only the experts a token needs are read from memory, so a large model can run on a small GPU.
Once upon a time there was a little model that lived on a disk and dreamed of the cache.
It's the hits that run first; the misses are loaded into slots, and some of them run on the CPU.
We don't copy weights we do not need. They'll be there when we're ready, and I'd say that's fine.
Numbers like 12345, 3.14159 and 2026 appear in text too, as do dates such as 2026-11-29.
def forward(x): return x + attention(norm(x))  # code is text as well
Hello, world! Hello again, world. How are you today? I am fine, thank you.
Ünïcödé letters, naïve café, façade, 東京 and Москва are words in other scripts.
    Indented lines, tabs\tand trailing spaces   are whitespace the tokenizer must keep.
"""

# per pre-tokenizer: the special tokens (control), and which of them are BOS and EOS (None: not written)
SPECIALS = {
    "qwen2": (["<|endoftext|>", "<|im_start|>", "<|im_end|>"], "<|endoftext|>", "<|endoftext|>"),
    "qwen35": (["<|endoftext|>", "<|im_start|>", "<|im_end|>"], "<|endoftext|>", "<|endoftext|>"),
    "llama-bpe": (["<|begin_of_text|>", "<|end_of_text|>"], "<|begin_of_text|>", "<|end_of_text|>"),
    "olmo": (["<|endoftext|>", "<|padding|>"], None, "<|endoftext|>"),
    "glm4": (["<|endoftext|>", "[gMASK]", "<sop>", "<|user|>", "<|assistant|>"], None, "<|endoftext|>"),
    "deepseek-v3": (["<\uff5cbegin\u2581of\u2581sentence\uff5c>", "<\uff5cend\u2581of\u2581sentence\uff5c>",
                     "<\uff5cUser\uff5c>", "<\uff5cAssistant\uff5c>"],
                    "<\uff5cbegin\u2581of\u2581sentence\uff5c>", "<\uff5cend\u2581of\u2581sentence\uff5c>"),
    # gpt-oss's harmony tokens: <|channel|> and friends are plain-text markers to llama.cpp
    "gpt-4o": (["<|startoftext|>", "<|endoftext|>", "<|return|>", "<|start|>", "<|channel|>", "<|message|>",
                "<|end|>", "<|call|>", "<|constrain|>"], "<|startoftext|>", "<|return|>"),
}


@dataclass(frozen=True)
class Vocab:
    tokens: list[str]
    types: list[int]
    merges: list[str]         # BPE only
    scores: list[float]       # SentencePiece only
    bos: int | None
    eos: int | None


def train_vocab(pre: str, vocab_size: int) -> tuple[list[str], list[int], list[str]]:
    """(tokens, token types, merges) of a byte-level BPE trained on the fixed corpus."""
    from tokenizers import Regex, Tokenizer, models, pre_tokenizers, trainers

    specials = SPECIALS[pre][0]
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.Split(Regex(r), behavior="isolated") for r in PRE_TOKENIZERS[pre].regexes]
        + [pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    trainer = trainers.BpeTrainer(vocab_size=vocab_size - len(specials), show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), min_frequency=1)
    tok.train_from_iterator([CORPUS] * 4, trainer)
    model = json.loads(tok.to_str())["model"]
    vocab = sorted(model["vocab"].items(), key=lambda kv: kv[1])
    tokens = [t for t, _ in vocab]
    merges = [m if isinstance(m, str) else " ".join(m) for m in model["merges"]]
    # pad with unused tokens so the vocabulary has exactly the requested size
    while len(tokens) < vocab_size - len(specials):
        tokens.append(f"<unused{len(tokens)}>")
    types = [1] * len(tokens) + [3] * len(specials)
    return tokens + specials, types, merges


def bpe_vocab(pre: str, vocab_size: int) -> Vocab:
    tokens, types, merges = train_vocab(pre, vocab_size)
    _, bos, eos = SPECIALS[pre]
    return Vocab(tokens, types, merges, [], tokens.index(bos) if bos else None, tokens.index(eos) if eos else None)


SPM_SPACE = "\u2581"
SPM_USER = ["<tool>"]  # a user-defined token: llama.cpp cuts it out of text before merging


def spm_vocab(vocab_size: int) -> Vocab:
    """A SentencePiece-style vocabulary of exactly ``vocab_size`` tokens (types as llama.cpp's converter writes)."""
    from tokenizers import Tokenizer, models, normalizers, pre_tokenizers, trainers

    head = ["<unk>", "<s>", "</s>"] + [f"<0x{b:02X}>" for b in range(256)]
    types = [2, 3, 3] + [6] * 256
    n_pieces = vocab_size - len(head) - len(SPM_USER)
    tok = Tokenizer(models.BPE())
    # SentencePiece's view of text: a leading space, spaces as "▁", words split before each "▁"
    tok.normalizer = normalizers.Sequence([normalizers.Prepend(" "), normalizers.Replace(" ", SPM_SPACE)])
    tok.pre_tokenizer = pre_tokenizers.Split(SPM_SPACE, behavior="merged_with_next")
    alphabet = sorted(set(CORPUS.replace(" ", SPM_SPACE).replace("\n", "").replace("\t", "")) | {SPM_SPACE})
    trainer = trainers.BpeTrainer(vocab_size=n_pieces, show_progress=False, initial_alphabet=alphabet,
                                  min_frequency=2, limit_alphabet=len(alphabet))
    tok.train_from_iterator([line for line in CORPUS.split("\n") if line] * 4, trainer)
    model = json.loads(tok.to_str())["model"]
    merged = ["".join(m.split(" ") if isinstance(m, str) else m) for m in model["merges"]]
    singles = [t for t, _ in sorted(model["vocab"].items(), key=lambda kv: kv[1]) if len(t) == 1]
    pieces = []
    for t in merged + singles:  # merges first (by rank), then the single characters
        if t not in pieces and t not in head:
            pieces.append(t)
    pieces = pieces[:n_pieces]
    while len(pieces) < n_pieces:
        pieces.append(f"<unused{len(pieces)}>")
    tokens = head + pieces + SPM_USER
    scores = [0.0] * len(head) + [-float(i) for i in range(len(pieces))] + [-1000.0] * len(SPM_USER)
    types += [5 if p.startswith("<unused") else 1 for p in pieces] + [4] * len(SPM_USER)
    return Vocab(tokens, types, [], scores, 1, 2)


__all__ = ["CORPUS", "SPECIALS", "SPM_USER", "Vocab", "bpe_vocab", "spm_vocab", "train_vocab"]
