#!/usr/bin/env python3
"""Summary of tandem's GPU check: merges the JSON figures of scripts/hf_ref.py
(<work>/*.hf.json) and of the stage/cuda GPU tests (<results>/*.json) into
one summary.json and prints a table."""
import glob
import json
import os
import sys


def load(pattern, suffix):
    out = {}
    for f in sorted(glob.glob(pattern)):
        with open(f) as fh:
            out[os.path.basename(f)[:-len(suffix)]] = json.load(fh)
    return out


def fmt(v, spec=".3f"):
    return "-" if v is None else format(v, spec)


# Issue 15's targets for the GPU step against transformers' compile step
# (shape, batch): the ratio asked for.
RATIO_TARGETS = {("llama1b", "1"): 1.8, ("llama1b", "32"): 2, ("llama8b", "1"): 1.3, ("llama8b", "32"): 2}


def load_bench(work, name):
    """scripts/hf_bench.py's figures in work/name, or {}."""
    path = os.path.join(work, name)
    if not os.path.exists(path):
        return {}
    with open(path) as f:
        return json.load(f)


def decode_tables(work, res):
    """Decode steps of tandem (FULL_AND_PIECEWISE graphs), the baseline
    revision and transformers side by side; per-kernel breakdowns; skinny
    product bandwidth; prefill; the API."""
    base = res.get("baseline_decode", {})
    for name in ("llama1b", "llama8b"):
        dec = res.get("decode_" + name)
        if not dec:
            continue
        hb = load_bench(work, name + ".bench.json")
        bench = hb.get("decode_ms", {})
        floor = dec["floor_ms"]
        print(f"-- decode step, {name} shape ({dec['weight_bytes']} weight bytes), {dec['device']}: copy bandwidth "
              f"{dec['copy_bw_bytes_per_s'] / 1e12:.2f} TB/s -> HBM floor {floor:.3f} ms; skinny kernels up to "
              f"{dec.get('skinny_tokens')} tokens, dependent launches {dec.get('dependent_launch')}")
        print(f"   graphs: {dec['graph_keys']} keys, {dec['graphs']} graphs, captured in {dec['capture_s']:.3f} s, "
              f"{dec['graph_bytes'] / 2**20:.1f} MiB")
        print(f"   gemvt kernels (9-32 rows) compiled: {dec.get('gemvt')}; measured at New (a pass replayed as a graph, device time):")
        for tr in dec.get("skinny_tried") or []:
            print(f"     {tr['tokens']:>3} rows: skinny {tr['skinny_ms']:.3f} ms, cuBLAS {tr['cublas_ms']:.3f} ms, outputs {tr['rel_diff']:.2g} apart")
        if dec.get("o_splits_tried"):
            tried = ", ".join(f"{tr['splits']}: {tr['ms']:.3f} ms" for tr in dec["o_splits_tried"])
            print(f"     warps a unit of the o product, one-row pass: {tried}; chosen {dec.get('o_splits')}")
        # The targets are the GPU step's (events around a replayed
        # step): HF/GPU and GPU x floor; HF/wall adds the host's share of
        # a step that Forward waits for (hidden in the daemon, whose
        # scheduling is asynchronous: the API rows below).
        print(f"{'batch':>6} {'tandem wall':>12} {'GPU':>7} {'GPU/floor':>9} {'before':>8} {'HF eager':>9} {'HF graph':>9} "
              f"{'HF compile':>11} {'HF/GPU':>7} {'HF/wall':>8} {'tok/s':>8}")
        steps = sorted(int(k.split("_")[1]) for k in dec if k.startswith("batch_") and k.endswith("_FULL_AND_PIECEWISE"))
        for b in map(str, steps):
            d = dec.get(f"batch_{b}_FULL_AND_PIECEWISE")
            if not d:
                continue
            before = base.get(f"batch_{b}_FULL_AND_PIECEWISE", {}).get("wall_ms") if name == "llama1b" else None
            hc = bench.get(f"compile_{b}")
            rgpu = f"{hc / d['gpu_ms']:.2f}x" if hc else "-"
            rwall = f"{hc / d['wall_ms']:.2f}x" if hc else "-"
            print(f"{b:>6} {d['wall_ms']:>12.3f} {d['gpu_ms']:>7.3f} {d['gpu_ms'] / floor:>9.2f} {fmt(before):>8} "
                  f"{fmt(bench.get(f'eager_{b}')):>9} {fmt(bench.get(f'graph_{b}')):>9} {fmt(hc):>11} {rgpu:>7} {rwall:>8} "
                  f"{int(b) / d['wall_ms'] * 1e3:>8.0f}")
        if hb.get("compile_cache_len"):
            print(f"   transformers' compile step: a static cache of {hb['compile_cache_len']} positions, all read "
                  f"each step")
        # A ratio target that the weights' reads alone rule out: one that
        # needs a step shorter than the floor.
        for b in map(str, steps):
            hc, want = bench.get(f"compile_{b}"), RATIO_TARGETS.get((name, b))
            if hc and want and hc / want < floor:
                print(f"   batch {b}: {want:g}x transformers' compile step is {hc / want:.3f} ms a step, under the "
                      f"{floor:.3f} ms floor: no step that reads the weights once can meet it")
        for key, what in (("8x64", "512 tokens (8 x 64)"), ("32x64", "2048 tokens (32 x 64, the API bench's prompts)"),
                          ("2048", "2048 tokens (4 x 512)")):
            if f"prefill_{key}_gpu_ms" in dec:
                print(f"   eager prefill of {what}: {dec[f'prefill_{key}_gpu_ms']:.3f} ms GPU, "
                      f"{dec[f'prefill_{key}_tflops']:.0f} TFLOP/s ({100 * dec[f'prefill_{key}_tflops'] / 790:.0f}% of 790)")
        for b in ("1", "32"):
            cb, sk = dec.get(f"profile_batch_{b}_cublas"), dec.get(f"profile_batch_{b}_skinny")
            if not cb or not sk:
                continue
            print(f"   per-kernel GPU time of one eager decode step at batch {b} (CUDA events around each kernel):")
            print(f"   {'cuBLAS path (unfused)':<28} {'ms':>7}   {'this path at batch ' + b:<28} {'ms':>7}")
            left = sorted(cb["kernels"].items(), key=lambda kv: -kv[1]["ms"])
            right = sorted(sk["kernels"].items(), key=lambda kv: -kv[1]["ms"])
            for i in range(max(len(left), len(right))):
                l = f"{left[i][0]} x{left[i][1]['count']}" if i < len(left) else ""
                lm = f"{left[i][1]['ms']:.3f}" if i < len(left) else ""
                r = f"{right[i][0]} x{right[i][1]['count']}" if i < len(right) else ""
                rm = f"{right[i][1]['ms']:.3f}" if i < len(right) else ""
                print(f"   {l:<28} {lm:>7}   {r:<28} {rm:>7}")
            print(f"   {'sum':<28} {cb['sum_ms']:>7.3f}   {'sum':<28} {sk['sum_ms']:>7.3f}")
    sk = res.get("skinny")
    if sk:
        print(f"-- skinny products: fraction of the copy bandwidth ({sk['copy_bw'] / 1e12:.2f} TB/s), CUDA graphs of "
              "dependent launches; cuBLAS (compensated: twice the rows) alongside")
        for key in sorted(k for k in sk if isinstance(sk[k], dict)):
            v = sk[key]
            print(f"   {key:<28} {v['dep_us']:>8.2f} us {100 * v['dep_frac']:>4.0f}%   cuBLAS {v['cublas_us']:>8.2f} us "
                  f"{100 * v['cublas_frac']:>4.0f}%")
        for key in sorted(k for k in sk if "attention" in k):
            print(f"   {key:<28} {sk[key]:>8.2f} us")
    api = [res[k] for k in sorted(res, key=lambda k: int(k[5:]) if k.startswith("api_c") else 0) if k.startswith("api_c")]
    if api:
        dec = res.get("decode_llama1b", {})
        step = dec.get("batch_1_FULL_AND_PIECEWISE", {})

        def peer(name):
            """transformers' compile step of batch 32 in work/name and the
            length of its static cache."""
            b = load_bench(work, name)
            return b.get("decode_ms", {}).get("compile_32"), b.get("compile_cache_len")

        hc32, c32 = peer("llama1b.bench.json")
        # On the bench's sequences: a cache of the positions they reach
        # (gpu-check.sh's hf_api_peer).
        hca, ca = peer("llama1b.bench-api.json")
        print("-- tandemctl bench through the gRPC API (leader + one CUDA stage, llama1b checkpoint, 64-token prompts, 256 tokens);"
              " before: the baseline revision's tandemd, same run")
        for b in api:
            c = b["concurrency"]
            old = res.get(f"api_base_c{c}")
            line = (f"   concurrency {c:>3}: {b['tokens_per_s']:>8.0f} tokens/s, ITL p50 {b['itl_p50_ms']:.3f} ms, "
                    f"p99 {b['itl_p99_ms']:.3f} ms, TTFT p50 {b['ttft_p50_ms']:.1f} ms")
            if old:
                line += f" | before {old['tokens_per_s']:.0f} tokens/s, ITL p50 {old['itl_p50_ms']:.3f} ms"
            if c == 1 and step:
                line += (f" | ITL p50 / stage step {b['itl_p50_ms'] / step['wall_ms']:.3f} (wall {step['wall_ms']:.3f} ms), "
                         f"/ GPU step {b['itl_p50_ms'] / step['gpu_ms']:.3f}")
            if c > 1 and hc32:
                line += f" | x{b['tokens_per_s'] / (32 / hc32 * 1e3):.2f} HF compile batch 32 (cache {c32})"
            if c > 1 and hca:
                line += f", x{b['tokens_per_s'] / (32 / hca * 1e3):.2f} on the bench's sequences (cache {ca}: {hca:.3f} ms)"
            print(line)


def main():
    work, results, out, header = sys.argv[1:5]
    hf = load(os.path.join(work, "*.hf.json"), ".hf.json")
    res = load(os.path.join(results, "*.json"), ".json")
    summary = {"header": header, "hf": hf, "tandem": res}
    with open(os.path.join(out, "summary.json"), "w") as f:
        json.dump(summary, f, indent=1)

    print("=" * 78)
    print(header)
    print("-- tandem CUDA (bf16) vs transformers (fp32, same bf16 weights): logits per position")
    print("   (HF bf16: transformers' own bf16 forward against the same reference)")
    print(f"{'model/prefill':26} {'pos':>4} {'max relL2':>10} {'mean relL2':>10} {'>2e-2':>6} {'top1 agree':>11} "
          f"{'gap>0.1 bad':>12} {'HF bf16 max/mean':>17}")
    for name in sorted(k for k in res if k.startswith("hf_")):
        r = res[name]
        h = hf.get(name[3:], {})
        base = f"{h.get('hf_bf16_max_rel_l2', float('nan')):.3g}/{h.get('hf_bf16_mean_rel_l2', float('nan')):.3g}"
        for mode in ("whole_prefill", "chunked_prefill", "plain_prefill"):
            if mode not in r:
                continue
            s = r[mode]
            label = name[3:] + "/" + mode.split("_")[0] + ("*" if r.get("informational") else "")
            print(f"{label:26} {s['positions']:>4} {s['max_rel_l2']:>10.3g} "
                  f"{s['mean_rel_l2']:>10.3g} {s.get('over_2e-2', 0):>6} {str(s['top1_agree']) + '/' + str(s['positions']):>11} "
                  f"{str(s['decisive_disagree']) + '/' + str(s['decisive']):>12} {base:>17}")
    print("   * informational: reported, not held to the bounds")
    for name, h in sorted(hf.items()):
        print(f"   reference {name}: init std {h['std']}, {h['params']} params, logit std {h['logit_std']:.3g}, "
              f"median top1-top2 gap {h['gap_median']:.3g}, gap>0.1 at {h['gap_gt_0.1']}/{h['positions']}")
        if "tokenizer_texts" in h:
            print(f"   {name}: written by tandemctl model init, loaded by transformers; its tokenizer gave tandem's ids "
                  f"for {h['tokenizer_agree']} of {h['tokenizer_texts']} texts")
    cg = res.get("cpu_vs_gpu", {})
    if cg:
        print("-- CPU backend (fp32) vs CUDA backend (bf16), randinit checkpoints")
        for name, s in sorted(cg.items()):
            print(f"{name:24} {s['positions']:>4} {s['max_rel_l2']:>10.3g} {s['mean_rel_l2']:>10.3g} "
                  f"{str(s['top1_agree']) + '/' + str(s['positions']):>11}")
    decode_tables(work, res)
    lr = res.get("graphs_long_run")
    if lr:
        print(f"-- CUDA graphs, long run: {lr['requests']} requests in {lr['steps']} steps ({lr['full_steps']} FULL, "
              f"{lr['piecewise_steps']} PIECEWISE); device memory in use grew by {lr['growth_bytes']} bytes")
    tg = res.get("two_gpu")
    if tg:
        print(f"-- model split over two GPUs through NCCL vs one GPU: {tg['positions']} positions, "
              f"max relative logits difference {tg['max_rel_diff']:.3g}")
    print("=" * 78)


if __name__ == "__main__":
    main()
