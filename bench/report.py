"""gpu_bench.json -> markdown table + PNG plot (tokens/s by concurrency, each configuration)."""
import json
import sys
from pathlib import Path


def main(path="bench/results/gpu_bench.json"):
    path = Path(path)
    r = json.loads(path.read_text())
    configs = [k for k in ("a-all-gpu", "b-offload", "c-gpu-first", "c-cpu-first") if k in r and "waves" in r[k]]
    conc = [w["concurrency"] for w in r[configs[0]]["waves"]]
    rows = ["| concurrency | " + " | ".join(f"{c} tok/s" for c in configs) + " | best c / b |",
            "|---" * (len(configs) + 2) + "|"]
    for i, c in enumerate(conc):
        vals = {k: r[k]["waves"][i]["tok_per_s"] for k in configs}
        best_c = max((v for k, v in vals.items() if k.startswith("c-")), default=None)
        ratio = f"{best_c / vals['b-offload']:.2f}x" if best_c and "b-offload" in vals else "-"
        rows.append(f"| {c} | " + " | ".join(str(vals[k]) for k in configs) + f" | {ratio} |")
    for n in ("1024", "4096"):
        rows.append(f"| TTFT {n}-token prompt (s) | " + " | ".join(str(r[k]["ttft_s"].get(n)) for k in configs) + " | |")
    rows.append("| ready (s) | " + " | ".join(str(r[k]["ready_s"]) for k in configs) + " | |")
    md = "\n".join(rows) + f"\n\nDRAM read bandwidth: {r.get('dram_read_gbs')} GB/s\n"
    path.with_suffix(".md").write_text(md)
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        fig, ax = plt.subplots(figsize=(6, 4))
        for k in configs:
            ax.plot(conc, [w["tok_per_s"] for w in r[k]["waves"]], marker="o", label=k)
        ax.set(xscale="log", yscale="log", xlabel="concurrency", ylabel="output tokens/s",
               title="Llama-3.1-8B shape, 128 in / 128 out")
        ax.legend()
        fig.savefig(path.with_suffix(".png"), dpi=120, bbox_inches="tight")
    except ImportError:
        pass
    print(md)


if __name__ == "__main__":
    main(*sys.argv[1:])
