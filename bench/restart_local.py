"""How fast a compiled 2-stage CPU pipeline of SmolLM2 comes back with its compile cache kept (issue: restarts).

The real node's group restart, without Kubernetes: the same plan shape (15 + 15 layers, bf16, compiled, one core
each), VLLM_CACHE_ROOT kept between RUNS starts; prints seconds to ready and to the first answer per start
(the first start is cold unless CACHE already holds it). ENV: JSON of extra stage env (e.g. '{"VLLM_USE_AOT_COMPILE": "0"}').
    python bench/restart_local.py [ENV] [CACHE] [RUNS]
"""
import json
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests" / "runtime"))
from pipelines import plan_for  # noqa: E402
from vllm_hybrid.local import LocalPipeline, post_json  # noqa: E402
from vllm_hybrid.realmodel import DEFAULT_DIR, prepare_model  # noqa: E402


def main(variant: dict, cache: str, runs: int) -> None:
    model = prepare_model(ROOT / DEFAULT_DIR)
    for run in range(runs):
        plan = plan_for(model, served_model_name="smol", extra_args=[], dtype="bfloat16", max_model_len=2048,
                        max_num_batched_tokens=2048)
        plan["stages"] = [{"name": n, "device": "cpu", "layers": 15, "cpus": 1, "memory": "4Gi"} for n in ("head", "tail")]
        envs = [{"HYBRID_CPUS": cpu, "VLLM_CACHE_ROOT": cache, **variant} for cpu in ("0", "1")]
        t0 = time.monotonic()
        with LocalPipeline(plan, tempfile.mkdtemp(prefix="restart-"), envs) as pipe:
            ready = pipe.wait_ready(900)
            body = {"model": "smol", "prompt": "The capital of France is", "max_tokens": 8, "temperature": 0}
            text = post_json(pipe.url + "/v1/completions", body)["choices"][0]["text"]
            print(json.dumps({"run": run, "env": variant, "ready_s": round(ready, 1),
                              "answer_s": round(time.monotonic() - t0, 1), "text": text}), flush=True)


if __name__ == "__main__":
    main(json.loads(sys.argv[1]) if len(sys.argv) > 1 else {}, sys.argv[2] if len(sys.argv) > 2 else
         tempfile.mkdtemp(prefix="vllm-cache-"), int(sys.argv[3]) if len(sys.argv) > 3 else 2)
