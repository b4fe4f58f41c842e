#!/usr/bin/env python3
"""Reference side of tandem's GPU check (scripts/gpu-check.sh).

For one model shape it: builds a random-init checkpoint with Hugging Face
transformers (fixed torch seed) and saves it in bf16 with save_pretrained;
computes the float32 reference on exactly those bf16-rounded weights, with
the rotary inverse frequencies in float32 as from_pretrained computes them (a
prefill of a random prompt, then teacher-forced greedy decode steps through
the KV cache), saving every position's logits as raw little-endian float32
plus the token sequence; measures how far transformers' own bf16 forward on
the same tokens lands from that reference (the error bf16 inference brings
on this model); and optionally times transformers' eager bf16 decode step
(generate) at several batch sizes.

Outputs in --out: <name>/ (the checkpoint), <name>.tokens.json,
<name>.logits.f32 ([positions x vocab] float32), <name>.hf.json (figures).

With --from DIR it makes no checkpoint: it loads DIR (one written by
`tandemctl model init`) with from_pretrained, fails if transformers finds a
tensor missing, unexpected or of another shape, and computes the same
reference on it; with --texts and --tandem-ids it also loads DIR's tokenizer
with AutoTokenizer and checks that it encodes each text to the ids tandem
gave. This is how the check proves that tandem's checkpoints are in the
Hugging Face layout.
"""
import argparse
import inspect
import json
import os
import shutil
import statistics
import time

import torch
import transformers
from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

LLAMA3_ROPE = {
    "rope_type": "llama3",
    "factor": 32.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 8192,
}

LLAMA31_ROPE = {
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 8192,
}

SHAPES = {
    # Llama-3.2-1B.
    "llama1b": dict(
        arch="llama", hidden_size=2048, num_hidden_layers=16, num_attention_heads=32,
        num_key_value_heads=8, head_dim=64, intermediate_size=8192, vocab_size=128256,
        max_position_embeddings=131072, rope_theta=500000.0, rope=LLAMA3_ROPE,
        tie_word_embeddings=True, rms_norm_eps=1e-5, bos_token_id=128000,
        eos_token_id=128001),
    # Llama-3.1-8B (timings only: scripts/hf_bench.py).
    "llama8b": dict(
        arch="llama", hidden_size=4096, num_hidden_layers=32, num_attention_heads=32,
        num_key_value_heads=8, head_dim=128, intermediate_size=14336, vocab_size=128256,
        max_position_embeddings=131072, rope_theta=500000.0, rope=LLAMA31_ROPE,
        tie_word_embeddings=False, rms_norm_eps=1e-5, bos_token_id=128000,
        eos_token_id=128001),
    # A few layers of Qwen2.5-0.5B: q/k/v bias, GQA ratio 7, untied LM head.
    "qwen2": dict(
        arch="qwen2", hidden_size=896, num_hidden_layers=4, num_attention_heads=14,
        num_key_value_heads=2, intermediate_size=4864, vocab_size=151936,
        max_position_embeddings=32768, rope_theta=1000000.0, rope=None,
        tie_word_embeddings=False, rms_norm_eps=1e-6, bos_token_id=151643,
        eos_token_id=151645),
}


def make_config(shape, std):
    s = dict(shape)
    arch = s.pop("arch")
    rope = s.pop("rope")
    theta = s.pop("rope_theta")
    cls = LlamaConfig if arch == "llama" else Qwen2Config
    params = inspect.signature(cls.__init__).parameters
    if "rope_parameters" in params:
        rp = {"rope_type": "default", "rope_theta": theta}
        if rope:
            rp.update(rope)
        s["rope_parameters"] = rp
    else:
        s["rope_theta"] = theta
        s["rope_scaling"] = rope
    if arch == "qwen2":
        s["use_sliding_window"] = False
    s["initializer_range"] = std
    return cls(**s), (LlamaForCausalLM if arch == "llama" else Qwen2ForCausalLM)


def rotary_modules(model):
    """The modules holding rotary inverse frequencies (the inv_freq buffer)."""
    return [m for m in model.modules() if "inv_freq" in m._buffers]


def cast(model, dtype, inv_freq):
    """model.to(dtype), keeping the rotary inverse frequencies in float32.

    nn.Module.to(dtype) casts every floating-point buffer, the non-persistent
    inv_freq included: cast to bf16 and back, a "float32" model would rotate
    by angles pos * inv_freq with inv_freq rounded to bf16, an error growing
    with the position that no checkpoint carries (the buffer is not saved;
    from_pretrained computes it in float32)."""
    model = model.to(dtype)
    for m, f in zip(rotary_modules(model), inv_freq):
        m.inv_freq = f.clone()
    return model


def build(name, std, seed):
    """Returns the bf16 model and the float32 rotary inverse frequencies."""
    config, cls = make_config(SHAPES[name], std)
    torch.manual_seed(seed)
    with torch.device("cuda"):
        model = cls(config)
    # Norm weights 1 + N(0, 0.1^2) and biases N(0, 0.1^2), so that a kernel
    # that ignored either would fail the comparison (HF initialises them to
    # exactly 1 and 0).
    g = torch.Generator(device="cuda").manual_seed(seed + 1)
    with torch.no_grad():
        for pname, p in model.named_parameters():
            if pname.endswith("norm.weight"):
                p.copy_(1 + 0.1 * torch.randn(p.shape, generator=g, device="cuda"))
            elif pname.endswith(".bias"):
                p.copy_(0.1 * torch.randn(p.shape, generator=g, device="cuda"))
    inv_freq = [m.inv_freq.detach().float().clone() for m in rotary_modules(model)]
    return cast(model, torch.bfloat16, inv_freq).eval(), inv_freq


def load(path):
    """Loads a checkpoint directory as transformers reads it. Returns the
    bf16 model (weights as stored) and the float32 rotary inverse
    frequencies, as build does; exits when transformers reports a tensor
    missing, unexpected or of another shape."""
    model, info = transformers.AutoModelForCausalLM.from_pretrained(
        path, dtype=torch.float32, output_loading_info=True)
    problems = {k: sorted(str(x) for x in v) for k, v in info.items() if v}
    if problems:
        raise SystemExit(f"transformers loading {path}: {problems}")
    model = model.to("cuda")
    inv_freq = [m.inv_freq.detach().float().clone() for m in rotary_modules(model)]
    return cast(model, torch.bfloat16, inv_freq).eval(), inv_freq


def check_tokenizer(path, texts_file, ids_file):
    """Encodes each text of texts_file (a JSON array) with transformers'
    AutoTokenizer on path and compares with tandem's ids (ids_file, a JSON
    array of id arrays, as `tandemctl tokenize` prints). Returns the number
    of texts and of those that agree; prints each disagreement."""
    from transformers import AutoTokenizer
    tok = AutoTokenizer.from_pretrained(path)
    with open(texts_file) as f:
        texts = json.load(f)
    with open(ids_file) as f:
        want = json.load(f)
    agree = 0
    for text, ids in zip(texts, want, strict=True):
        got = tok(text)["input_ids"]
        if got == ids:
            agree += 1
        else:
            print(f"tokenizer of {path}: {text!r}: transformers {got}, tandem {ids}")
    return len(texts), agree


def inv_freq_rounding(inv_freq):
    """Largest relative change bf16 rounding makes to the inverse frequencies
    (what a plain .to(bfloat16) would have done to them)."""
    return max(float(((f.bfloat16().float() - f).abs() / f).max()) for f in inv_freq)


def reference(model, prompt, steps, inv_freq):
    """Prefill then `steps` greedy decode steps in float32; returns (tokens, logits)."""
    model = cast(model, torch.float32, inv_freq)
    ids = torch.tensor(prompt, device="cuda")[None]
    rows = []
    with torch.no_grad():
        out = model(input_ids=ids, use_cache=True)
        past = out.past_key_values
        rows.append(out.logits[0].float())
        tokens = list(prompt)
        nxt = int(out.logits[0, -1].argmax())
        for _ in range(steps):
            tokens.append(nxt)
            out = model(input_ids=torch.tensor([[nxt]], device="cuda"), past_key_values=past,
                        use_cache=True)
            past = out.past_key_values
            rows.append(out.logits[0].float())
            nxt = int(out.logits[0, -1].argmax())
    return tokens, torch.cat(rows, 0)


def bf16_baseline(model, tokens, ref, inv_freq):
    """Relative L2 error per position of transformers' bf16 logits against ref."""
    model = cast(model, torch.bfloat16, inv_freq)
    with torch.no_grad():
        out = model(input_ids=torch.tensor(tokens, device="cuda")[None]).logits[0].float()
    return ((out - ref).norm(dim=-1) / ref.norm(dim=-1)).tolist()


def time_generate(model, batch, prompt_len, vocab):
    """Eager bf16 decode step of transformers' greedy generate, ms: the time of
    generating 160 tokens minus that of 32, over 128 (median of 3)."""
    g = torch.Generator(device="cuda").manual_seed(7)
    ids = torch.randint(0, vocab, (batch, prompt_len), device="cuda", generator=g)

    def run(n):
        torch.cuda.synchronize()
        t = time.perf_counter()
        model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n,
                       min_new_tokens=n, do_sample=False, pad_token_id=0)
        torch.cuda.synchronize()
        return time.perf_counter() - t

    with torch.no_grad():
        run(8)
        steps = [(run(160) - run(32)) / 128 * 1e3 for _ in range(3)]
    return statistics.median(steps)


def main():
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--shape", choices=sorted(SHAPES), help="the shape to build")
    ap.add_argument("--from", dest="src", help="a checkpoint directory to load instead of building one")
    ap.add_argument("--texts", help="with --from: JSON array of texts to tokenize")
    ap.add_argument("--tandem-ids", help="with --from: JSON array of tandem's ids for --texts")
    ap.add_argument("--name", help="output name (default: the shape)")
    ap.add_argument("--out", required=True)
    ap.add_argument("--std", type=float, default=0.02, help="init std (initializer_range)")
    ap.add_argument("--seed", type=int, default=1234)
    ap.add_argument("--prompt", type=int, default=48, help="prompt length")
    ap.add_argument("--steps", type=int, default=32, help="teacher-forced decode steps")
    ap.add_argument("--time-batches", default="", help="e.g. 1,32: time eager decode")
    ap.add_argument("--informational", action="store_true",
                    help="tandem reports its error on this case but is not held to the bounds")
    args = ap.parse_args()

    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    torch.set_float32_matmul_precision("highest")

    if (args.shape is None) == (args.src is None):
        ap.error("give one of --shape and --from")
    name = args.name or args.shape or os.path.basename(os.path.normpath(args.src))
    t0 = time.time()
    if args.src:
        model, inv_freq = load(args.src)
        shutil.copytree(args.src, os.path.join(args.out, name), dirs_exist_ok=True)
        std = model.config.initializer_range
    else:
        model, inv_freq = build(args.shape, args.std, args.seed)
        model.save_pretrained(os.path.join(args.out, name))
        std = args.std
    t1 = time.time()
    info = {"name": name, "shape": args.shape or "from " + args.src, "std": std, "seed": args.seed,
            "transformers": transformers.__version__, "torch": torch.__version__,
            "params": sum(p.numel() for p in model.parameters()),
            "build_save_s": round(t1 - t0, 1), "informational": args.informational}
    tokenizer_ok = True
    if args.src and args.texts:
        n, agree = check_tokenizer(args.src, args.texts, args.tandem_ids)
        info["tokenizer_texts"], info["tokenizer_agree"] = n, agree
        tokenizer_ok = n == agree

    vocab = model.config.vocab_size
    gen = torch.Generator().manual_seed(args.seed + 2)
    prompt = torch.randint(0, vocab, (args.prompt,), generator=gen).tolist()
    tokens, logits = reference(model, prompt, args.steps, inv_freq)
    top2 = logits.topk(2, dim=-1).values
    gap = (top2[:, 0] - top2[:, 1])
    info["positions"] = logits.shape[0]
    info["gap_gt_0.1"] = int((gap > 0.1).sum())
    info["gap_median"] = float(gap.median())
    info["logit_std"] = float(logits.std())
    base = bf16_baseline(model, tokens, logits, inv_freq)
    info["inv_freq_bf16_rounding"] = inv_freq_rounding(inv_freq)
    info["hf_bf16_max_rel_l2"] = max(base)
    info["hf_bf16_mean_rel_l2"] = sum(base) / len(base)
    info["hf_bf16_rel_l2"] = base
    info["reference_s"] = round(time.time() - t1, 1)
    logits.cpu().numpy().astype("<f4").tofile(os.path.join(args.out, name + ".logits.f32"))
    with open(os.path.join(args.out, name + ".tokens.json"), "w") as f:
        json.dump({"prompt_len": args.prompt, "tokens": tokens, "vocab": vocab,
                   "informational": args.informational}, f)

    timing = {}
    for b in [int(x) for x in args.time_batches.split(",") if x]:
        timing[str(b)] = time_generate(model, b, 64, vocab)
    info["hf_eager_decode_ms"] = timing
    with open(os.path.join(args.out, name + ".hf.json"), "w") as f:
        json.dump(info, f, indent=1)
    print(json.dumps({k: v for k, v in info.items() if k != "hf_bf16_rel_l2"}))
    if not tokenizer_ok:
        raise SystemExit(f"{name}: transformers' tokenizer disagrees with tandem's")


if __name__ == "__main__":
    main()
