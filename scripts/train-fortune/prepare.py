"""Builds the fortune model's corpus and tokenizer from Debian's fortunes
packages (already extracted; train-fortune.sh downloads and extracts them).

    python3 prepare.py ROOT BUILD

ROOT is where the packages were extracted (ROOT/usr/share/games/fortunes).
BUILD gets corpus.json (the fortunes split into train, val and test),
tokenizer.json and tokenizer_config.json.

Each cookie (the text between two '%' lines) is one document. Lines lose
their trailing spaces; cookies holding anything but printable ASCII, tab
and newline (a few dozen: mojibake, terminal escapes) are left out, so the
model only ever writes ASCII; exact duplicates are kept once. Three files
are left out: ascii-art (drawings, not text) and ethnic and men-women
(jokes at groups' expense, which a demo should not print). The documents
are shuffled with a fixed seed and split 90/5/5; the tokenizer is trained
on the train split only.
"""

import hashlib
import json
import os
import random
import sys

import bpe

SEED = 20261124
VOCAB = 4096  # BPE tokens, BOS and EOS
MAX_POSITIONS = 512
EXCLUDE = {"ascii-art", "ethnic", "men-women"}


def cookies(root):
    d = os.path.join(root, "usr/share/games/fortunes")
    files = sorted(f for f in os.listdir(d) if "." not in f and os.path.isfile(os.path.join(d, f)) and not os.path.islink(os.path.join(d, f)))
    kept, dropped, per_file = [], 0, {}
    for name in files:
        if name in EXCLUDE:
            continue
        with open(os.path.join(d, name), "rb") as f:
            raw = f.read()
        n = 0
        for chunk in raw.split(b"\n%\n"):
            try:
                text = chunk.decode("ascii")
            except UnicodeDecodeError:
                dropped += 1
                continue
            if any(not (c == "\n" or c == "\t" or " " <= c <= "~") for c in text):
                dropped += 1
                continue
            lines = [l.rstrip() for l in text.split("\n")]
            text = "\n".join(lines).strip("\n")
            if text.strip() and text != "%":
                kept.append(text)
                n += 1
        per_file[name] = n
    return kept, dropped, per_file


def main():
    root, build = sys.argv[1], sys.argv[2]
    os.makedirs(build, exist_ok=True)
    docs, dropped, per_file = cookies(root)
    seen, uniq = set(), []
    for t in docs:
        if t not in seen:
            seen.add(t)
            uniq.append(t)
    rng = random.Random(SEED)
    rng.shuffle(uniq)
    n = len(uniq)
    n_val = n_test = n // 20
    split = {"val": uniq[:n_val], "test": uniq[n_val : n_val + n_test], "train": uniq[n_val + n_test :]}
    print(f"{len(docs)} cookies from {len(per_file)} files ({dropped} left out: not printable ASCII), {n} after removing duplicates")
    for k, v in split.items():
        print(f"  {k}: {len(v)} cookies, {sum(len(t) for t in v)} characters")

    tokens, merges = bpe.train(split["train"], VOCAB - 2)
    print(f"tokenizer: {len(tokens)} BPE tokens from {len(merges)} merges + BOS, EOS")
    assert len(tokens) == VOCAB - 2, len(tokens)
    bpe.dump(bpe.tokenizer_json(tokens, merges), os.path.join(build, "tokenizer.json"))
    bpe.dump(bpe.tokenizer_config_json(tokens, MAX_POSITIONS), os.path.join(build, "tokenizer_config.json"))
    enc = bpe.Encoder(tokens, merges, len(tokens))
    for k, v in split.items():
        ntok = sum(len(enc.encode(t)) + 1 for t in v)  # with BOS and EOS
        print(f"  {k}: {ntok} tokens with BOS and EOS ({sum(len(t) for t in v) / ntok:.2f} characters a token)")
    corpus = {"seed": SEED, "files": per_file, "dropped": dropped, **split}
    with open(os.path.join(build, "corpus.json"), "w") as f:
        json.dump(corpus, f)
    for name in ("corpus.json", "tokenizer.json", "tokenizer_config.json"):
        with open(os.path.join(build, name), "rb") as f:
            print(f"  {name} sha256 {hashlib.sha256(f.read()).hexdigest()}")


if __name__ == "__main__":
    main()
