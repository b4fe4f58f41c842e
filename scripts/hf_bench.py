#!/usr/bin/env python3
"""Hugging Face transformers' decode step, the peer tandem is measured
against (scripts/gpu-check.sh), in three forms on the same random bf16 model:

  eager    the model's forward with a DynamicCache, one call per step;
  graph    a StaticCache and the decode step captured in a torch.cuda.CUDAGraph,
           replayed each step (inputs copied into its static tensors);
  compile  a StaticCache and the step under torch.compile(mode="reduce-overhead")
           (inductor kernels, CUDA graphs): what transformers' docs recommend
           for fast decoding.

For each batch size: a random prompt of --prompt tokens is prefilled, then
--steps greedy decode steps run; the figure is the wall time of the steps
over their number (the host's part included, as tandem's figures do),
median of --runs runs. Each form is tried on its own: one that fails prints
why and is left out. Writes JSON to --out after each figure.
"""
import argparse
import inspect
import json
import statistics
import sys
import time
import traceback

import torch
import transformers

sys.path.insert(0, __file__.rsplit("/", 1)[0])
import hf_ref  # noqa: E402


def static_cache(model, batch, length):
    """A StaticCache for batch sequences of length positions, whatever the
    constructor's signature in this transformers version."""
    cls = transformers.StaticCache
    params = inspect.signature(cls.__init__).parameters
    want = {"config": model.config, "max_cache_len": length, "max_batch_size": batch, "batch_size": batch,
            "device": "cuda", "dtype": torch.bfloat16}
    return cls(**{k: v for k, v in want.items() if k in params})


def decode_eager(model, ids, steps):
    with torch.no_grad():
        out = model(input_ids=ids, use_cache=True)
        past = out.past_key_values
        tok = out.logits[:, -1:].argmax(-1)
        for _ in range(8):  # warm-up: first calls set up kernels and handles
            out = model(input_ids=tok, past_key_values=past, use_cache=True)
            past = out.past_key_values
            tok = out.logits[:, -1:].argmax(-1)
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(steps):
            out = model(input_ids=tok, past_key_values=past, use_cache=True)
            past = out.past_key_values
            tok = out.logits[:, -1:].argmax(-1)
        torch.cuda.synchronize()
        return (time.perf_counter() - t0) / steps


def prefill_static(model, ids, cache):
    n = ids.shape[1]
    out = model(input_ids=ids, past_key_values=cache, cache_position=torch.arange(n, device="cuda"), use_cache=True)
    return out.logits[:, -1:].argmax(-1)


def decode_graph(model, ids, steps):
    batch, n = ids.shape
    with torch.no_grad():
        cache = static_cache(model, batch, n + steps + 8)
        tok = prefill_static(model, ids, cache)
        tok_buf = tok.clone()
        pos_buf = torch.tensor([n], device="cuda")

        def step():
            return model(input_ids=tok_buf, past_key_values=cache, cache_position=pos_buf, use_cache=True).logits

        s = torch.cuda.Stream()
        s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s):
            for _ in range(3):
                step()
        torch.cuda.current_stream().wait_stream(s)
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            logits = step()
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for i in range(steps):
            pos_buf.fill_(n + i)
            g.replay()
            tok_buf.copy_(logits[:, -1:].argmax(-1))
        torch.cuda.synchronize()
        return (time.perf_counter() - t0) / steps


def compile_cache_len(prompt, steps):
    """The static cache of decode_compile: the prompt, its warm-up steps and
    steps, and room to spare. transformers' step reads all of it each step,
    so its time follows this length, not the context reached."""
    return prompt + steps + 16


def decode_compile(model, ids, steps):
    batch, n = ids.shape
    with torch.no_grad():
        cache = static_cache(model, batch, compile_cache_len(n, steps))
        tok = prefill_static(model, ids, cache)

        def step(tok, pos):
            return model(input_ids=tok, past_key_values=cache, cache_position=pos, use_cache=True).logits

        cstep = torch.compile(step, mode="reduce-overhead", fullgraph=False, dynamic=False)
        pos = torch.tensor([n], device="cuda")
        for i in range(6):  # compile, record the CUDA graphs, warm up
            tok = cstep(tok, pos + i)[:, -1:].argmax(-1).clone()
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for i in range(steps):
            tok = cstep(tok, pos + 6 + i)[:, -1:].argmax(-1).clone()
        torch.cuda.synchronize()
        return (time.perf_counter() - t0) / steps


FORMS = {"eager": decode_eager, "graph": decode_graph, "compile": decode_compile}


def main():
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--shape", choices=sorted(hf_ref.SHAPES), required=True)
    ap.add_argument("--batches", default="1,32")
    ap.add_argument("--forms", default="compile,graph,eager")
    ap.add_argument("--prompt", type=int, default=64)
    ap.add_argument("--steps", type=int, default=128)
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    torch.backends.cuda.matmul.allow_tf32 = False
    t0 = time.time()
    model, _ = hf_ref.build(args.shape, 0.02, 1234)
    res = {"shape": args.shape, "transformers": transformers.__version__, "torch": torch.__version__,
           "device": torch.cuda.get_device_name(), "params": sum(p.numel() for p in model.parameters()),
           "prompt": args.prompt, "steps": args.steps, "compile_cache_len": compile_cache_len(args.prompt, args.steps), "build_s": round(time.time() - t0, 1), "decode_ms": {}, "errors": {}}
    g = torch.Generator(device="cuda").manual_seed(7)
    for form in args.forms.split(","):
        for b in [int(x) for x in args.batches.split(",")]:
            key = f"{form}_{b}"
            ids = torch.randint(0, model.config.vocab_size, (b, args.prompt), device="cuda", generator=g)
            t1 = time.time()
            try:
                ms = [FORMS[form](model, ids, args.steps) * 1e3 for _ in range(args.runs)]
                res["decode_ms"][key] = statistics.median(ms)
                print(f"{args.shape} {form} batch {b}: {statistics.median(ms):.3f} ms/step ({ms}), {time.time() - t1:.0f} s", flush=True)
            except Exception as e:  # a form that fails is reported, not fatal
                res["errors"][key] = f"{type(e).__name__}: {e}"
                traceback.print_exc()
            torch._dynamo.reset()
            torch.cuda.empty_cache()
            with open(args.out, "w") as f:  # after each figure: a time limit may end the run
                json.dump(res, f, indent=1)
    print(json.dumps(res))


if __name__ == "__main__":
    main()
