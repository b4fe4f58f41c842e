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
        for mode in ("whole_prefill", "chunked_prefill"):
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
    dec = res.get("decode")
    if dec:
        hft = hf.get("llama1b", {}).get("hf_eager_decode_ms", {})
        floor = dec["floor_ms"]
        print(f"-- decode step, Llama-3.2-1B shape ({dec['weight_bytes']} weight bytes), {dec['device']}")
        print(f"   copy bandwidth {dec['copy_bw_bytes_per_s'] / 1e12:.2f} TB/s -> HBM floor {floor:.3f} ms")
        print(f"   CUDA graphs (FULL_AND_PIECEWISE keys, 1-512 tokens, full decode 1-32): {dec['graph_keys']} keys, "
              f"{dec['graphs']} graphs, {dec['graph_nodes']} nodes, captured in {dec['capture_s']:.3f} s, "
              f"{dec['graph_bytes'] / 2**20:.1f} MiB (full decode graphs {dec['full_graph_bytes'] / 2**20:.1f} MiB, "
              f"{dec['piecewise_graphs']} piecewise graphs {dec['piecewise_graph_bytes'] / 2**20:.1f} MiB)")
        print(f"{'batch':>6} {'mode':<19} {'wall ms':>8} {'GPU ms':>8} {'wall/GPU':>9} {'x floor':>8} {'HF eager ms':>12}")
        for b in ("1", "8", "32"):
            h = hft.get(b)
            hs = f"{h:.3f}" if h is not None else "-"
            for mode in ("NONE", "PIECEWISE", "FULL", "FULL_AND_PIECEWISE"):
                d = dec.get(f"batch_{b}_{mode}")
                if not d:
                    continue
                print(f"{b:>6} {mode:<19} {d['wall_ms']:>8.3f} {d['gpu_ms']:>8.3f} {d['wall_ms'] / d['gpu_ms']:>9.3f} "
                      f"{d['wall_ms'] / floor:>8.2f} {hs:>12}")
        print(f"   eager prefill of 512 tokens: {dec['prefill_512_gpu_ms']:.3f} ms GPU")
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
