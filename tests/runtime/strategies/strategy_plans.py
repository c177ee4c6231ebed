"""Plans the strategy tests share: an 8B shape on a gpu and a cpu stage, a Mixtral one, the committed bench runs."""
import json
from pathlib import Path

from vllm_hybrid.plan import plan_from_dict
from vllm_hybrid.planner import model_shape, split_layers
from vllm_hybrid.tinymodel import LLAMA_3_1_8B

SHAPE = model_shape(LLAMA_3_1_8B, "bfloat16")


GPU = {"name": "gpu", "device": "gpu", "layers": 16}


CPU = {"name": "cpu", "device": "cpu", "layers": 16, "cpus": 15, "memory": "32Gi"}


def bench_run(name: str) -> dict:
    """A committed benchmark result the cost model is checked against."""
    return json.loads((Path(__file__).parents[3] / "bench/results" / name).read_text())


def planned(stages, **over):
    plan = plan_from_dict({"model": "/m", "dtype": "bfloat16", "max_model_len": 8192, "stages": stages, **over})
    return plan, split_layers(plan, SHAPE)


MIXTRAL_GPU = {"name": "gpu", "device": "gpu", "memory": "80Gi"}


MIXTRAL_CPU = {"name": "cpu", "device": "cpu", "cpus": 15, "memory": "100Gi"}


def mixtral_plan(stages=(MIXTRAL_GPU, MIXTRAL_CPU), **over):
    from vllm_hybrid.tinymodel import MIXTRAL_8X7B
    plan = plan_from_dict({"model": "/m", "dtype": "bfloat16", "max_model_len": 8192, "strategy": "experts",
                           "stages": list(stages), **over})
    return plan, model_shape(MIXTRAL_8X7B, "bfloat16")
