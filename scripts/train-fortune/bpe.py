"""Byte-level BPE in the GPT-2 / Llama 3 style, trained and applied the way
the Hugging Face tokenizers library applies it, written out so that the
tokenizer of the fortune model is trained without that library (it is not
installable where the corpus is prepared) and is checked against it where it
is (train.py compares every id).

The vocabulary starts with the 256 byte symbols (id = byte value), then one
token per learned merge; the special tokens come last, as added tokens.
Training is deterministic: each step merges the most frequent adjacent pair,
ties going to the pair with the smaller ids.
"""

import heapq
import json

import regex

# The pre-tokenization pattern of the ByteLevel pre-tokenizer with
# use_regex: contractions, runs of letters, digits or other symbols with an
# optional leading space, and whitespace.
SPLIT = regex.compile(r"""'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+""")

BOS = "<|begin_of_text|>"
EOS = "<|end_of_text|>"


def byte_symbols():
    """GPT-2's printable spelling of each byte: printable Latin-1 bytes
    stand for themselves, the others for chr(256), chr(257), ... in byte
    order."""
    keep = [b for b in range(256) if ord("!") <= b <= ord("~") or 0xA1 <= b <= 0xAC or b >= 0xAE]
    out, n = {}, 0
    for b in range(256):
        if b in keep:
            out[b] = chr(b)
        else:
            out[b] = chr(256 + n)
            n += 1
    return [out[b] for b in range(256)]


SYMBOLS = byte_symbols()


def pretokenize(text):
    return SPLIT.findall(text)


def train(texts, size):
    """Learns merges on texts until the BPE vocabulary has size tokens (or
    no pair is left). Returns (tokens, merges): tokens[id] in the byte-level
    spelling, merges as (left id, right id) in rank order."""
    counts = {}
    for t in texts:
        for p in pretokenize(t):
            counts[p] = counts.get(p, 0) + 1
    keys = sorted(counts)
    words = [list(k.encode("utf-8")) for k in keys]
    freq = [counts[k] for k in keys]
    tokens = list(SYMBOLS)
    ids = {s: i for i, s in enumerate(tokens)}
    pair_count, where = {}, {}
    for i, syms in enumerate(words):
        for p in zip(syms, syms[1:]):
            pair_count[p] = pair_count.get(p, 0) + freq[i]
            where.setdefault(p, set()).add(i)
    heap = [(-c, p[0], p[1]) for p, c in pair_count.items()]
    heapq.heapify(heap)
    merges = []
    while len(tokens) < size and heap:
        negc, a, b = heapq.heappop(heap)
        if pair_count.get((a, b), 0) != -negc or negc == 0:
            continue  # stale entry
        merged = tokens[a] + tokens[b]
        new = ids.get(merged)
        if new is None:
            new = len(tokens)
            ids[merged] = new
            tokens.append(merged)
        merges.append((a, b))
        changed = set()
        for i in sorted(where.pop((a, b), ())):
            syms, c = words[i], freq[i]
            for p in zip(syms, syms[1:]):
                pair_count[p] -= c
                changed.add(p)
            out, j = [], 0
            while j < len(syms):
                if j + 1 < len(syms) and syms[j] == a and syms[j + 1] == b:
                    out.append(new)
                    j += 2
                else:
                    out.append(syms[j])
                    j += 1
            for p in zip(out, out[1:]):
                pair_count[p] = pair_count.get(p, 0) + c
                where.setdefault(p, set()).add(i)
                changed.add(p)
            words[i] = out
        for p in changed:
            if pair_count.get(p, 0) > 0:
                heapq.heappush(heap, (-pair_count[p], p[0], p[1]))
            else:
                pair_count.pop(p, None)
    return tokens, merges


class Encoder:
    """Applies a trained BPE as the tokenizers library does: pre-tokenize,
    spell bytes, then repeatedly merge the adjacent pair of lowest rank."""

    def __init__(self, tokens, merges, bos_id):
        self.tokens = tokens
        self.ids = {s: i for i, s in enumerate(tokens)}
        self.rank = {(tokens[a], tokens[b]): r for r, (a, b) in enumerate(merges)}
        self.bos_id = bos_id
        self.cache = {}

    def word(self, piece):
        got = self.cache.get(piece)
        if got is not None:
            return got
        syms = [SYMBOLS[b] for b in piece.encode("utf-8")]
        while len(syms) > 1:
            best, at = None, -1
            for j in range(len(syms) - 1):
                r = self.rank.get((syms[j], syms[j + 1]))
                if r is not None and (best is None or r < best):
                    best, at = r, j
            if best is None:
                break
            pair = (syms[at], syms[at + 1])
            out, j = [], 0
            while j < len(syms):
                if j + 1 < len(syms) and (syms[j], syms[j + 1]) == pair:
                    out.append(syms[j] + syms[j + 1])
                    j += 2
                else:
                    out.append(syms[j])
                    j += 1
            syms = out
        got = [self.ids[s] for s in syms]
        self.cache[piece] = got
        return got

    def encode(self, text, bos=True):
        out = [self.bos_id] if bos else []
        for p in pretokenize(text):
            out.extend(self.word(p))
        return out


def tokenizer_json(tokens, merges):
    """tokenizer.json in the layout of the tokenizers library: the BPE
    model, the ByteLevel pre-tokenizer and decoder, BOS and EOS as special
    added tokens after the BPE ids, and a post-processor that prepends
    BOS."""
    bos_id, eos_id = len(tokens), len(tokens) + 1

    def added(i, s):
        return {"id": i, "content": s, "single_word": False, "lstrip": False, "rstrip": False, "normalized": False, "special": True}

    return {
        "version": "1.0",
        "truncation": None,
        "padding": None,
        "added_tokens": [added(bos_id, BOS), added(eos_id, EOS)],
        "normalizer": None,
        "pre_tokenizer": {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True, "use_regex": True},
        "post_processor": {
            "type": "TemplateProcessing",
            "single": [{"SpecialToken": {"id": BOS, "type_id": 0}}, {"Sequence": {"id": "A", "type_id": 0}}],
            "pair": [
                {"SpecialToken": {"id": BOS, "type_id": 0}},
                {"Sequence": {"id": "A", "type_id": 0}},
                {"SpecialToken": {"id": BOS, "type_id": 1}},
                {"Sequence": {"id": "B", "type_id": 1}},
            ],
            "special_tokens": {BOS: {"id": BOS, "ids": [bos_id], "tokens": [BOS]}},
        },
        "decoder": {"type": "ByteLevel", "add_prefix_space": True, "trim_offsets": True, "use_regex": True},
        "model": {
            "type": "BPE",
            "dropout": None,
            "unk_token": None,
            "continuing_subword_prefix": None,
            "end_of_word_suffix": None,
            "fuse_unk": False,
            "byte_fallback": False,
            "ignore_merges": False,
            "vocab": {s: i for i, s in enumerate(tokens)},
            "merges": [tokens[a] + " " + tokens[b] for a, b in merges],
        },
    }


# A plain chat template: each message as "role: content" on its own lines,
# then "assistant:" for the reply. The model was trained on fortunes, not
# conversations: the template lets chat APIs serve it, nothing more.
CHAT_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}"
    "{{ message['role'] + ': ' + message['content'] + '\\n' }}"
    "{% endfor %}{% if add_generation_prompt %}{{ 'assistant:' }}{% endif %}"
)


def tokenizer_config_json(tokens, max_positions):
    bos_id, eos_id = len(tokens), len(tokens) + 1

    def dec(s):
        return {"content": s, "lstrip": False, "normalized": False, "rstrip": False, "single_word": False, "special": True}

    return {
        "added_tokens_decoder": {str(bos_id): dec(BOS), str(eos_id): dec(EOS)},
        "bos_token": BOS,
        "eos_token": EOS,
        "chat_template": CHAT_TEMPLATE,
        "clean_up_tokenization_spaces": False,
        "model_max_length": max_positions,
        "tokenizer_class": "PreTrainedTokenizerFast",
    }


def dump(obj, path):
    with open(path, "w", encoding="utf-8") as f:
        json.dump(obj, f, ensure_ascii=False, indent=2)
        f.write("\n")
