"""Trains the fortune model on a GPU with PyTorch and Hugging Face
transformers, from what prepare.py built:

    python3 train.py BUILD OUT

It first runs the whole recipe for a few steps into a scratch folder (so a
broken step fails in seconds, not after the training), then:

  1. checks that the tokenizers library gives, for every document, the ids
     of bpe.py's own encoder (which trained the tokenizer);
  2. trains a LlamaForCausalLM from scratch for each schedule in SCHEDULES
     (seeded; random windows of the concatenated training documents, each
     document BOS + text + EOS), and keeps the one whose bf16 weights have
     the lowest validation loss;
  3. saves it with save_pretrained in bf16 (config.json,
     generation_config.json, model.safetensors), adds tokenizer.json and
     tokenizer_config.json, and loads the folder back with AutoTokenizer and
     AutoModelForCausalLM, failing on any missing or unexpected tensor;
  4. reports validation and test perplexity of the loaded model (float32);
  5. records, on the CPU in float32, the greedy continuations of a few
     prompts and the tokenizer's ids of a few texts: golden.json.

OUT gets fortune.tar (checkpoint/, golden.json, training.json) and
train.log.
"""

import inspect
import json
import math
import os
import shutil
import sys
import tarfile
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import bpe  # noqa: E402

SEED = 1234
SEQ = 512
BATCH = 32
LR = 2e-3
MIN_LR_FRAC = 0.1
WARMUP_FRAC = 0.05
WEIGHT_DECAY = 0.1
EVAL_EVERY = 50
ROPE_THETA = 10000.0
# Total steps of each schedule tried (about 44 steps an epoch).
SCHEDULES = [250, 500, 1000, 2000]
# Training stops starting schedules once this many seconds have gone.
TRAIN_BUDGET_S = 200
ARCH = dict(
    hidden_size=256,
    intermediate_size=704,
    num_hidden_layers=6,
    num_attention_heads=8,
    num_key_value_heads=4,
    max_position_embeddings=512,
    rms_norm_eps=1e-5,
    tie_word_embeddings=True,
    hidden_act="silu",
    attention_bias=False,
    mlp_bias=False,
    initializer_range=0.02,
)
PROMPTS = [
    "The quick brown fox",
    "Once upon a time",
    "A wise man",
    "The meaning of life is",
    "Q: Why did the chicken cross the road?\nA:",
    "Computers are",
]
NEW_TOKENS = 40
TOKENIZER_TEXTS = [
    "Hello world!  It's 3.14, naive cafe.\n\n\tTabbed line",
    "na\u00efve caf\u00e9, \u65e5\u672c\u8a9e and an emoji \U0001F642",
    "   leading spaces and trailing   ",
    "<|begin_of_text|>special tokens inside<|end_of_text|> text",
    "",
]

t0 = time.time()


def log(*a):
    print(f"[{time.time() - t0:7.1f}s]", *a, flush=True)


import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
import transformers  # noqa: E402
from tokenizers import Tokenizer  # noqa: E402
from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaConfig, LlamaForCausalLM  # noqa: E402


def load_bpe(build):
    tj = json.load(open(os.path.join(build, "tokenizer.json"), encoding="utf-8"))
    vocab = tj["model"]["vocab"]
    tokens = [None] * len(vocab)
    for s, i in vocab.items():
        tokens[i] = s
    ids = {s: i for i, s in enumerate(tokens)}
    merges = [tuple(ids[x] for x in m.split(" ")) for m in tj["model"]["merges"]]
    return tokens, bpe.Encoder(tokens, merges, len(tokens))


def encode_docs(build, corpus):
    """Every split as a list of documents' ids (BOS + text + EOS), checked
    against bpe.py's encoder."""
    tokens, enc = load_bpe(build)
    bos, eos = len(tokens), len(tokens) + 1
    tk = Tokenizer.from_file(os.path.join(build, "tokenizer.json"))
    out = {}
    for split in ("train", "val", "test"):
        docs = corpus[split]
        hf = [e.ids for e in tk.encode_batch(docs)]
        for d, ids in zip(docs, hf):
            mine = enc.encode(d)
            if ids != mine:
                raise SystemExit(f"tokenizers and bpe.py disagree on {d!r}:\n  tokenizers {ids}\n  bpe.py     {mine}")
            if tk.decode(ids, skip_special_tokens=True) != d:
                raise SystemExit(f"tokenizers does not round-trip {d!r}")
        out[split] = [ids + [eos] for ids in hf]
        log(f"{split}: {len(docs)} documents, {sum(map(len, out[split]))} tokens; tokenizers == bpe.py on every one")
    return out, len(tokens) + 2, bos, eos


def stream(docs):
    return torch.tensor([t for d in docs for t in d], dtype=torch.long)


def make_model(vocab, bos, eos):
    kw = dict(ARCH)
    # transformers 5 takes rope_parameters, 4 rope_theta.
    if "rope_parameters" in inspect.signature(LlamaConfig.__init__).parameters:
        kw["rope_parameters"] = {"rope_type": "default", "rope_theta": ROPE_THETA}
    else:
        kw["rope_theta"] = ROPE_THETA
    cfg = LlamaConfig(vocab_size=vocab, bos_token_id=bos, eos_token_id=eos, **kw)
    return LlamaForCausalLM(cfg)


@torch.no_grad()
def evaluate(model, data, device):
    """Mean loss (nats per token) over data cut into consecutive windows of
    SEQ tokens, each token predicted once, in float32."""
    model.eval()
    total, n = 0.0, 0
    full = (len(data) - 1) // SEQ
    xs = data[: full * SEQ].view(full, SEQ)
    ys = data[1 : full * SEQ + 1].view(full, SEQ)
    batches = [(xs[i : i + BATCH], ys[i : i + BATCH]) for i in range(0, full, BATCH)]
    if full * SEQ < len(data) - 1:
        batches.append((data[full * SEQ : -1].unsqueeze(0), data[full * SEQ + 1 :].unsqueeze(0)))
    for x, y in batches:
        logits = model(input_ids=x.to(device)).logits.float()
        total += F.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.to(device).reshape(-1), reduction="sum").item()
        n += y.numel()
    model.train()
    return total / n


def bf16_copy(model, vocab, bos, eos, device):
    """The model as it will be stored: weights rounded to bf16, computed in
    float32."""
    m = make_model(vocab, bos, eos).to(device)
    m.load_state_dict({k: v.to(torch.bfloat16).float() for k, v in model.state_dict().items()})
    return m


def train(steps, data, val, vocab, bos, eos, device, curve):
    torch.manual_seed(SEED)
    model = make_model(vocab, bos, eos).to(device)
    decay = [p for n, p in model.named_parameters() if p.dim() >= 2]
    rest = [p for n, p in model.named_parameters() if p.dim() < 2]
    opt = torch.optim.AdamW(
        [{"params": decay, "weight_decay": WEIGHT_DECAY}, {"params": rest, "weight_decay": 0.0}],
        lr=LR, betas=(0.9, 0.95), eps=1e-8, fused=device == "cuda",
    )
    warm = max(1, int(steps * WARMUP_FRAC))

    def lr_at(s):
        if s < warm:
            return LR * (s + 1) / warm
        p = (s - warm) / max(1, steps - warm)
        return LR * (MIN_LR_FRAC + (1 - MIN_LR_FRAC) * 0.5 * (1 + math.cos(math.pi * p)))

    g = torch.Generator().manual_seed(SEED)
    model.train()
    start = time.time()
    acc, nacc = 0.0, 0
    for s in range(steps):
        for grp in opt.param_groups:
            grp["lr"] = lr_at(s)
        ix = torch.randint(0, len(data) - SEQ - 1, (BATCH,), generator=g)
        x = torch.stack([data[i : i + SEQ] for i in ix]).to(device, non_blocking=True)
        y = torch.stack([data[i + 1 : i + 1 + SEQ] for i in ix]).to(device, non_blocking=True)
        with torch.autocast(device_type=device, dtype=torch.bfloat16, enabled=device == "cuda"):
            logits = model(input_ids=x).logits
        loss = F.cross_entropy(logits.float().view(-1, vocab), y.view(-1))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        acc += loss.item()
        nacc += 1
        if (s + 1) % EVAL_EVERY == 0 or s + 1 == steps:
            v = evaluate(model, val, device)
            curve.append({"step": s + 1, "train_loss": acc / nacc, "val_loss": v, "lr": lr_at(s)})
            log(f"  steps {steps}: step {s + 1:5d}  train {acc / nacc:.4f}  val {v:.4f}  ppl {math.exp(v):8.2f}  lr {lr_at(s):.2e}  {(time.time() - start) / (s + 1) * 1000:.1f} ms/step")
            acc, nacc = 0.0, 0
    return model, (time.time() - start) / steps


@torch.no_grad()
def greedy(model, ids, n):
    """Greedy continuation by full forward passes (no cache), with each
    step's margin between the best and second-best logit."""
    ids = list(ids)
    out, margins = [], []
    for _ in range(n):
        logits = model(input_ids=torch.tensor([ids])).logits[0, -1].float()
        top = torch.topk(logits, 2)
        out.append(int(top.indices[0]))
        margins.append(float(top.values[0] - top.values[1]))
        ids.append(out[-1])
    return out, margins


def run(build, corpus, dest, schedules, budget_s, device):
    docs, vocab, bos, eos = encode_docs(build, corpus)
    data, val, test = stream(docs["train"]), stream(docs["val"]), stream(docs["test"])
    chars = {k: sum(len(t) for t in corpus[k]) for k in ("val", "test")}

    results, best = [], None
    tstart = time.time()
    per_step = None
    for steps in schedules:
        if per_step is not None and time.time() - tstart + steps * per_step * 1.2 > budget_s:
            log(f"schedule of {steps} steps skipped: it would pass the {budget_s} s training budget")
            continue
        curve = []
        model, per_step = train(steps, data, val, vocab, bos, eos, device, curve)
        v = evaluate(bf16_copy(model, vocab, bos, eos, device), val, device)
        log(f"schedule {steps} steps: bf16 weights val loss {v:.4f} (ppl {math.exp(v):.2f})")
        results.append({"steps": steps, "val_loss_bf16": v, "curve": curve, "ms_per_step": per_step * 1000})
        if best is None or v < best[0]:
            best = (v, steps, model)
    v, steps, model = best
    log(f"chosen: {steps} steps (val loss {v:.4f})")

    ckpt = os.path.join(dest, "checkpoint")
    os.makedirs(ckpt, exist_ok=True)
    model.to(torch.bfloat16).save_pretrained(ckpt)
    for f in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(os.path.join(build, f), ckpt)
    log("saved:", sorted(os.listdir(ckpt)), os.path.getsize(os.path.join(ckpt, "model.safetensors")), "bytes of weights")
    for f in ("config.json", "generation_config.json"):
        log(f, open(os.path.join(ckpt, f)).read())

    # Loaded back unchanged by transformers.
    tok = AutoTokenizer.from_pretrained(ckpt)
    m32, info = AutoModelForCausalLM.from_pretrained(ckpt, dtype=torch.float32, output_loading_info=True)
    problems = {k: info.get(k) for k in ("missing_keys", "unexpected_keys", "mismatched_keys", "error_msgs") if info.get(k)}
    if problems:
        raise SystemExit(f"transformers loaded the checkpoint with problems: {problems}")
    m32.eval()
    nparams = sum(p.numel() for p in m32.parameters())
    log(f"transformers loads it: {type(m32).__name__}, {nparams} parameters, tokenizer {type(tok).__name__}")
    tk = Tokenizer.from_file(os.path.join(ckpt, "tokenizer.json"))
    auto_mismatch = []
    for t in TOKENIZER_TEXTS + PROMPTS + corpus["test"][:50]:
        a, b = tok(t)["input_ids"], tk.encode(t).ids
        if a != b:
            auto_mismatch.append({"text": t, "auto": a, "tokenizers": b})
    if auto_mismatch:
        log(f"WARNING: AutoTokenizer and tokenizers disagree on {len(auto_mismatch)} texts, e.g. {auto_mismatch[0]}")
    else:
        log("AutoTokenizer gives the tokenizers library's ids")

    gpu = m32.to(device)
    losses = {"val": evaluate(gpu, val, device), "test": evaluate(gpu, test, device)}
    m32 = gpu.to("cpu")
    ntok = {"val": len(val) - 1, "test": len(test) - 1}
    ev = {
        k: {"loss": l, "perplexity": math.exp(l), "tokens": ntok[k], "characters": chars[k], "bits_per_character": l * ntok[k] / chars[k] / math.log(2)}
        for k, l in losses.items()
    }
    for k, e in ev.items():
        log(f"{k}: loss {e['loss']:.4f}, perplexity {e['perplexity']:.2f}, {e['bits_per_character']:.3f} bits a character ({e['tokens']} tokens)")

    try:
        chat = tok.apply_chat_template([{"role": "user", "content": "Tell me a fortune."}], tokenize=False, add_generation_prompt=True)
    except Exception as e:  # recorded, not fatal: the template can be fixed without training
        chat = f"ERROR: {e!r}"
    log(f"chat template: {chat!r}")
    golden = {
        "about": "Greedy continuations by transformers in float32 on the CPU (full forward passes, no KV cache, EOS not stopping), and the tokenizer's ids (special tokens added) of a few texts, recorded by scripts/train-fortune/train.py.",
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "new_tokens": NEW_TOKENS,
        "greedy": [],
        "tokenizer": [],
        "auto_tokenizer_mismatches": auto_mismatch,
        "chat_template_example": {"messages": [{"role": "user", "content": "Tell me a fortune."}], "add_generation_prompt": True, "text": chat},
    }
    for p in PROMPTS:
        ids = tk.encode(p).ids
        out, margins = greedy(m32, ids, NEW_TOKENS)
        text = tok.decode(out, skip_special_tokens=False)
        golden["greedy"].append({"prompt": p, "prompt_ids": ids, "ids": out, "text": text, "min_margin": min(margins), "margins": margins})
        log(f"greedy {p!r} -> {text!r} (least margin {min(margins):.4f})")
    for t in TOKENIZER_TEXTS + PROMPTS + corpus["test"][:20]:
        ids = tk.encode(t).ids
        golden["tokenizer"].append({"text": t, "ids": ids, "decoded": tk.decode(ids, skip_special_tokens=True)})
    torch.manual_seed(SEED)
    for p in PROMPTS[:3]:
        try:
            ids = torch.tensor([tk.encode(p).ids])
            s = m32.generate(ids, attention_mask=torch.ones_like(ids), do_sample=True, temperature=0.8, top_k=40, max_new_tokens=NEW_TOKENS, pad_token_id=eos)
            log(f"sampled (T 0.8, top-k 40) {tk.decode(s[0].tolist(), skip_special_tokens=True)!r}")
        except Exception as e:
            log(f"WARNING: generate failed: {e!r}")

    training = {
        "seed": SEED, "seq": SEQ, "batch": BATCH, "lr": LR, "min_lr_frac": MIN_LR_FRAC, "warmup_frac": WARMUP_FRAC,
        "weight_decay": WEIGHT_DECAY, "arch": ARCH, "vocab": vocab, "parameters": nparams,
        "schedules": results, "chosen_steps": steps, "eval": ev, "device": torch.cuda.get_device_name() if device == "cuda" else "cpu",
        "torch": torch.__version__, "transformers": transformers.__version__,
    }
    bpe.dump(golden, os.path.join(dest, "golden.json"))
    bpe.dump(training, os.path.join(dest, "training.json"))
    return ckpt


def main():
    build, out = sys.argv[1], sys.argv[2]
    os.makedirs(out, exist_ok=True)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    log(f"torch {torch.__version__}, transformers {transformers.__version__}, device {device}"
        + (f" ({torch.cuda.get_device_name()})" if device == "cuda" else ""))
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    corpus = json.load(open(os.path.join(build, "corpus.json")))

    # The whole recipe in miniature first, so that a broken step fails now.
    with tempfile.TemporaryDirectory() as tmp:
        small = {k: (v[:300] if isinstance(v, list) else v) for k, v in corpus.items()}
        log("smoke run: 3 steps on 300 documents")
        run(build, small, tmp, [3], 1e9, device)
        log("smoke run passed")

    dest = os.path.join(out, "fortune")
    if os.environ.get("SMOKE_ONLY"):
        return
    run(build, corpus, dest, SCHEDULES, TRAIN_BUDGET_S, device)
    buf = os.path.join(out, "fortune.tar")
    with tarfile.open(buf, "w") as tf:
        tf.add(dest, arcname="fortune")
    shutil.rmtree(dest)
    log("wrote", buf, os.path.getsize(buf), "bytes")


if __name__ == "__main__":
    main()
