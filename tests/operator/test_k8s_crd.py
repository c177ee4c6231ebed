"""CRD: schema, defaults, pruning and every CEL rule, as the real API server applies them (tests/kube_cluster.py)."""
from __future__ import annotations

import pytest
import yaml
from crd_validation import PATH, ensure_namespace, server_spec, validate
from hi_fixtures import CHART, CPU, CRD_PATH, GPU, ROOT, make_body, stages
from hybrid_operator import defaults
from hybrid_operator.plan import plan_yaml
from hybrid_operator.render import render_children


@pytest.fixture(scope="module")
def server(kube, chart):
    """The API server with the chart's CRD installed."""
    ensure_namespace(kube)
    return kube


def body_with(mutate=None, name="llama", **spec):
    body = make_body(name=name, **spec)
    if mutate:
        mutate(body["spec"])
    return body


def set_in(path, value):
    def mutate(spec):
        node = spec
        for key in path[:-1]:
            node = node[key]
        node[path[-1]] = value
    return mutate


def both_gpu(spec):
    spec["stages"][1] = dict(spec["stages"][0])


# (case id, body, text that must appear in the message: the field it names)
INVALID = [
    ("no-stages", body_with(stages=[]), "spec.stages must list at least one stage"),
    ("duplicate-stage-names", body_with(both_gpu), "spec.stages[].name must be unique"),
    ("unequal-tensor-parallel", body_with(set_in(["stages", 1, "tensorParallel"], 2)),
     "spec.stages[].tensorParallel"),
    ("layers-on-some-stages", body_with(set_in(["stages", 0, "layers"], 16)), "spec.stages[].layers"),
    ("block-size-not-multiple-of-32", body_with(serving={"blockSize": 48}), "spec.serving.blockSize"),
    ("api-port-equals-metrics-port", body_with(serving={"port": 9100}), "spec.serving.port"),
    ("api-port-is-rendezvous-port", body_with(serving={"port": 29500}), "spec.serving.port"),
    ("metrics-port-is-supervisor-port", body_with(monitoring={"port": 29501}), "spec.monitoring.port"),
    ("model-path-and-repo", body_with(set_in(["model", "repo"], "org/model")), "spec.model: set exactly one"),
    ("model-neither-path-nor-repo", body_with(model={"dtype": "bfloat16"}), "spec.model: set exactly one"),
    ("model-path-without-volume", body_with(model={"path": "m"}), "spec.model.volume"),
    ("revision-with-path", body_with(set_in(["model", "revision"], "main")), "spec.model.revision"),
    ("token-with-path", body_with(set_in(["model", "tokenSecretRef"], {"name": "hf"})), "spec.model.tokenSecretRef"),
    ("path-escapes-volume", body_with(set_in(["model", "path"], "a/../../etc")), "spec.model.path"),
    ("gpu-stage-without-gpus", body_with(stages=[{"name": "gpu", "device": "gpu"}]), "spec.stages[].gpus"),
    ("gpus-differ-from-tensor-parallel",
     body_with(stages=[{"name": "gpu", "device": "gpu", "gpus": 2}]), "spec.stages[].gpus must equal"),
    ("cpu-stage-without-memory", body_with(stages=[{"name": "cpu", "device": "cpu", "cpus": 8}]),
     "spec.stages[].cpus and spec.stages[].memory"),
    ("cpu-stage-without-cpus", body_with(stages=[{"name": "cpu", "device": "cpu", "memory": "8Gi"}]),
     "spec.stages[].cpus and spec.stages[].memory"),
    ("cpu-stage-with-gpus", body_with(set_in(["stages", 1, "gpus"], 1)), "spec.stages[].gpus is not allowed"),
    ("gpu-util-on-cpu-stage", body_with(set_in(["stages", 1, "gpuMemoryUtilization"], 0.5)),
     "spec.stages[].gpuMemoryUtilization"),
    ("gpu-memory-on-cpu-stage", body_with(set_in(["stages", 1, "gpuMemory"], "80Gi")), "spec.stages[].gpuMemory"),
    ("cpu-in-extra-resources", body_with(set_in(["stages", 1, "resources"], {"limits": {"cpu": "2"}})),
     "spec.stages[].resources"),
    ("gpu-in-extra-requests", body_with(set_in(["stages", 0, "resources"], {"requests": {"nvidia.com/gpu": 1}})),
     "spec.stages[].resources"),
    ("batched-tokens-below-seqs", body_with(serving={"maxNumSeqs": 128, "maxNumBatchedTokens": 64}),
     "spec.serving.maxNumBatchedTokens"),
    ("api-key-in-extra-args", body_with(serving={"extraArgs": ["--api-key=secret"]}), "spec.serving.extraArgs"),
    ("port-in-extra-args", body_with(serving={"extraArgs": ["--port", "1"]}), "spec.serving.extraArgs"),
    # what the planner sized against, in the forms vLLM's parser takes (the stage refuses abbreviations at start)
    ("max-model-len-in-extra-args", body_with(serving={"extraArgs": ["--max-model-len=100"]}), "spec.serving.extraArgs"),
    ("underscored-flag-in-extra-args", body_with(serving={"extraArgs": ["--max_num_seqs", "3"]}),
     "spec.serving.extraArgs"),
    ("short-tp-in-extra-args", body_with(serving={"extraArgs": ["--enforce-eager", "-tp", "2"]}),
     "spec.serving.extraArgs"),
    ("pipeline-wiring-in-extra-args", body_with(serving={"extraArgs": ["--pipeline-parallel-size=3"]}),
     "spec.serving.extraArgs"),
    ("name-too-long-for-statefulsets", body_with(name="x" * 50), "metadata.name plus spec.stages[].name"),
    ("offload-without-gpu-stage", body_with(strategy="offload", stages=[CPU], sharedMemory={"mode": "none"}),
     "spec.strategy offload, balanced, coprocessor and experts need a gpu stage"),
    ("balanced-without-cpu-stage", body_with(strategy="balanced", stages=stages(1)),
     "spec.strategy offload, balanced, coprocessor and experts need a gpu stage and a cpu stage"),
    ("coprocessor-without-cpu-stage", body_with(strategy="coprocessor", stages=stages(1)),
     "spec.strategy offload, balanced, coprocessor and experts need a gpu stage and a cpu stage"),
    ("coprocessor-only-gpu-stages", body_with(strategy="coprocessor", stages=[GPU, dict(GPU, name="gpu2")]),
     "spec.strategy offload, balanced, coprocessor and experts need a gpu stage and a cpu stage"),
    ("coprocessor-without-gpu-stage", body_with(strategy="coprocessor", stages=[CPU]),
     "spec.strategy offload, balanced, coprocessor and experts need a gpu stage and a cpu stage"),
    ("balanced-without-shared-dev-shm", body_with(strategy="balanced", sharedMemory={"mode": "none"}),
     "spec.strategy balanced needs spec.sharedMemory.mode hostPath"),
    ("coprocessor-without-shared-dev-shm", body_with(strategy="coprocessor", sharedMemory={"mode": "none"}),
     "spec.strategy coprocessor needs spec.sharedMemory.mode hostPath"),
    ("coprocessor-tensor-parallel-2", body_with(strategy="coprocessor", stages=stages(2, tp=2)),
     "spec.strategy coprocessor needs spec.stages[].tensorParallel 1"),
    ("offload-cpu-stage-first", body_with(strategy="offload", stages=[CPU, GPU]),
     "spec.strategy offload, coprocessor and experts need spec.stages[0] to be a gpu stage"),
    ("coprocessor-two-cpu-stages", body_with(strategy="coprocessor", stages=stages(3)),
     "spec.strategy coprocessor runs one gpu stage and one cpu stage"),
    ("coprocessor-cpu-stage-first", body_with(strategy="coprocessor", stages=[CPU, GPU]),
     "spec.strategy offload, coprocessor and experts need spec.stages[0] to be a gpu stage"),
    ("experts-without-cpu-stage", body_with(strategy="experts", stages=stages(1)),
     "spec.strategy offload, balanced, coprocessor and experts need a gpu stage and a cpu stage"),
    ("experts-only-gpu-stages", body_with(strategy="experts", stages=[GPU, dict(GPU, name="gpu2")]),
     "spec.strategy offload, balanced, coprocessor and experts need a gpu stage and a cpu stage"),
    ("experts-without-gpu-stage", body_with(strategy="experts", stages=[CPU]),
     "spec.strategy offload, balanced, coprocessor and experts need a gpu stage and a cpu stage"),
    ("experts-without-shared-dev-shm", body_with(strategy="experts", sharedMemory={"mode": "none"}),
     "spec.strategy experts needs spec.sharedMemory.mode hostPath"),
    ("experts-tensor-parallel-2", body_with(strategy="experts", stages=stages(2, tp=2)),
     "spec.strategy experts needs spec.stages[].tensorParallel 1"),
    ("experts-two-cpu-stages", body_with(strategy="experts", stages=stages(3)),
     "spec.strategy experts runs exactly one gpu stage and one cpu stage"),
    ("experts-cpu-stage-first", body_with(strategy="experts", stages=[CPU, GPU]),
     "spec.strategy offload, coprocessor and experts need spec.stages[0] to be a gpu stage"),
    ("workload-longer-than-max-model-len", body_with(workload={"promptTokens": 4000, "outputTokens": 97}),
     "spec.workload.promptTokens + spec.workload.outputTokens must not exceed spec.model.maxModelLen"),
    ("workload-prompt-alone-longer-than-max-model-len",
     body_with(set_in(["model", "maxModelLen"], 2048), workload={"promptTokens": 2049}),
     "spec.model.maxModelLen"),
    # Schema (OpenAPI) rejections name the field path.
    ("unknown-device", body_with(set_in(["stages", 0, "device"], "tpu")), "spec.stages[0].device"),
    ("fractional-cpus", body_with(set_in(["stages", 1, "cpus"], 1.5)), "spec.stages[1].cpus"),
    ("string-cpus", body_with(set_in(["stages", 1, "cpus"], "16")), "spec.stages[1].cpus"),
    ("negative-replicas", body_with(replicas=-1), "spec.replicas"),
    ("bad-memory-quantity", body_with(set_in(["stages", 1, "memory"], "64GB")), "spec.stages[1].memory"),
    ("bad-stage-name", body_with(set_in(["stages", 0, "name"], "GPU_0")), "spec.stages[0].name"),
    ("unknown-shm-mode", body_with(sharedMemory={"mode": "tmpfs"}), "spec.sharedMemory.mode"),
    ("unknown-dtype", body_with(set_in(["model", "dtype"], "int8")), "spec.model.dtype"),
    ("unknown-strategy", body_with(strategy="fastest"), "spec.strategy"),
    ("negative-stall-timeout", body_with(serving={"stallTimeoutSeconds": -1}), "spec.serving.stallTimeoutSeconds"),
    ("workload-zero-concurrency", body_with(workload={"concurrency": 0}), "spec.workload.concurrency"),
    ("workload-concurrency-too-high", body_with(workload={"concurrency": 4097}), "spec.workload.concurrency"),
    ("workload-string-tokens", body_with(workload={"outputTokens": "256"}), "spec.workload.outputTokens"),
    ("workload-unknown-field", body_with(workload={"requestsPerSecond": 3}), "requestsPerSecond"),
    ("hardware-zero-dram", body_with(hardware={"dramGBs": 0}), "spec.hardware.dramGBs"),
    ("hardware-string-speed", body_with(hardware={"cpuTokenSpeed": "slow"}), "spec.hardware.cpuTokenSpeed"),
    ("hardware-unknown-field", body_with(hardware={"pcieGBs": 50}), "pcieGBs"),
    ("unknown-field", body_with(serving={"maxTokens": 5}), "maxTokens"),
    ("too-many-stages", body_with(stages=stages(2) + [dict(stages(3)[2], name=f"c{i}") for i in range(7)]),
     "spec.stages"),
    ("env-duplicate-names",
     body_with(set_in(["stages", 1, "env"], [{"name": "OMP_NUM_THREADS", "value": "8"},
                                             {"name": "OMP_NUM_THREADS", "value": "16"}])),
     "spec.stages[].env names must be unique within a stage"),
    ("env-shadows-operator-identity", body_with(set_in(["stages", 1, "env"], [{"name": "HYBRID_STAGE", "value": "0"}])),
     "spec.stages[].env must not set a variable the operator sets"),
    ("env-api-key-in-plain-text", body_with(set_in(["stages", 0, "env"], [{"name": "VLLM_API_KEY", "value": "s"}])),
     "use spec.serving.apiKeySecretRef"),
    ("env-name-not-identifier", body_with(set_in(["stages", 1, "env"], [{"name": "MY-VAR", "value": "1"}])),
     "spec.stages[1].env[0].name"),
    ("env-name-starts-with-digit", body_with(set_in(["stages", 1, "env"], [{"name": "1VAR"}])),
     "spec.stages[1].env[0].name"),
    ("env-without-name", body_with(set_in(["stages", 1, "env"], [{"value": "1"}])),
     "spec.stages[1].env[0].name: Required value"),
    ("env-unquoted-number-value", body_with(set_in(["stages", 1, "env"], [{"name": "N", "value": 2}])),
     "spec.stages[1].env[0].value"),
    ("env-value-from", body_with(set_in(["stages", 1, "env"], [{"name": "N", "valueFrom": {"fieldRef": {}}}])),
     "valueFrom"),
    ("env-value-too-long", body_with(set_in(["stages", 1, "env"], [{"name": "N", "value": "x" * 4097}])),
     "spec.stages[1].env[0].value"),
    ("too-many-env", body_with(set_in(["stages", 1, "env"], [{"name": f"V{i}"} for i in range(33)])),
     "spec.stages[1].env"),
    ("cache-claim-and-host-path", body_with(cache={"claimName": "c", "hostPath": "/var/cache/x"}), "spec.cache"),
    ("cache-empty", body_with(cache={}), "spec.cache: set exactly one"),
    ("cache-relative-host-path", body_with(cache={"hostPath": "cache"}), "spec.cache.hostPath"),
]


@pytest.mark.parametrize("case,body,field", INVALID, ids=[c[0] for c in INVALID])
def test_invalid_spec_rejected_naming_the_field(server, case, body, field):
    errors = validate(server, body)
    assert errors, f"{case} was accepted"
    assert any(field in e for e in errors), errors


def test_at_least_twenty_invalid_specs():
    assert len(INVALID) >= 20


VALID = {
    "two-stage": make_body(),
    "gpu-only": make_body(stages=stages(1)),
    "three-stage-tp2-layers": make_body(stages=stages(3, tp=2, layers=True)),
    "cpu-only": make_body(stages=[{"name": "cpu", "device": "cpu", "cpus": 8, "memory": "32Gi"}],
                          sharedMemory={"mode": "none", "sizeLimit": "8Gi"}),
    "offload-three-stages": make_body(stages=stages(3), strategy="offload"),
    "offload-two-gpu-stages": make_body(stages=[GPU, CPU, dict(GPU, name="gpu2"), dict(CPU, name="cpu2")],
                                        strategy="offload"),
    "auto-with-workload-at-max-model-len": make_body(
        strategy="auto", workload={"concurrency": 4096, "promptTokens": 4000, "outputTokens": 96}),
    "auto-partial-workload": make_body(strategy="auto", workload={"concurrency": 1}),
    "auto-with-hardware": make_body(strategy="auto", hardware={"dramGBs": 94.1, "cpuTokenSpeed": 0.45}),
    "auto-gpu-only": make_body(strategy="auto", stages=stages(1), workload={}),
    "balanced-shared-memory-defaulted": make_body(strategy="balanced"),  # sharedMemory {} -> mode hostPath
    "balanced-cpu-stage-first": make_body(strategy="balanced", stages=[CPU, GPU], sharedMemory={"sizeLimit": "1Gi"}),
    "coprocessor-shared-memory-defaulted": make_body(strategy="coprocessor"),  # sharedMemory {} -> mode hostPath
    "coprocessor-layers-hugepages": make_body(
        strategy="coprocessor", sharedMemory={"mode": "hostPath"}, stages=[
            dict(GPU, layers=8), dict(CPU, layers=24, numaNode=1,
                                      resources={"limits": {"hugepages-2Mi": "8Gi"}, "requests": {"hugepages-2Mi": "8Gi"}})]),
    "experts-shared-memory-defaulted": make_body(strategy="experts"),  # sharedMemory {} -> mode hostPath
    "experts-mixtral-workload-layers": make_body(
        strategy="experts", sharedMemory={"mode": "hostPath"}, workload={"concurrency": 16, "promptTokens": 1024},
        stages=[dict(GPU, gpuMemory="80Gi", cpus=2, layers=25),
                dict(CPU, cpus=15, memory="24Gi", numaNode=0, layers=7)]),
    "stage-env": make_body(stages=[
        dict(GPU, env=[{"name": "HYBRID_BATCHES_IN_FLIGHT", "value": "2"}, {"name": "http_proxy", "value": ""}]),
        dict(CPU, env=[{"name": "VLLM_CPU_SGL_KERNEL", "value": "0"}, {"name": "_FLAG"},  # value defaults to ""
                       {"name": "HYBRID_BATCHES_IN_FLIGHT", "value": "x" * 4096}]
             + [{"name": f"V{i}"} for i in range(29)])]),  # 32 entries; a name may repeat across stages
    "hf-repo": make_body(model={"repo": "meta-llama/Llama-3.1-8B-Instruct", "revision": "main",
                                "tokenSecretRef": {"name": "hf"}}),
    "everything": make_body(
        replicas=3, strategy="balanced", workload={"concurrency": 32, "promptTokens": 2048, "outputTokens": 512},
        model={"path": ".", "volume": {"claimName": "m", "subPath": "llama", "readOnly": True},
               "servedModelName": "llama", "dtype": "float16", "maxModelLen": 8192, "loadFormat": "safetensors"},
        stages=[dict(stages(2)[0], gpuMemory="80Gi", gpuMemoryUtilization=0.85, cpus=8, memory="32Gi",
                     layers=20, numaNode=0),
                dict(stages(2)[1], layers=12, numaNode=1, nodeSelector={"pool": "cpu"},
                     tolerations=[{"key": "cpu", "operator": "Exists", "effect": "NoSchedule"}],
                     resources={"limits": {"hugepages-2Mi": "2Gi"}, "requests": {"hugepages-2Mi": "2Gi"}})],
        sharedMemory={"mode": "hostPath"},
        serving={"port": 8080, "maxNumSeqs": 32, "maxNumBatchedTokens": 8192, "blockSize": 64,
                 "apiKeySecretRef": {"name": "api"}, "extraArgs": ["--enforce-eager"], "stallTimeoutSeconds": 600},
        images={"gpu": "r/gpu:1", "cpu": "r/cpu:1", "pullPolicy": "Always", "pullSecrets": ["reg"]},
        monitoring={"port": 9200, "scrapeAnnotations": False}),
    # flags the launcher leaves open, and names that only begin like pinned ones (--model-impl, --portfolio-x)
    "open-extra-args": make_body(serving={"extraArgs": ["--enforce-eager", "--kv-cache-dtype=fp8", "--model-impl",
                                                        "vllm", "--max-num-partial-prefills", "2", "--seed=7"]}),
    "cache-claim": make_body(cache={"claimName": "vllm-cache"}),
    "cache-host-path": make_body(cache={"hostPath": "/var/cache/hybrid/llama"}),
}


@pytest.mark.parametrize("name", VALID)
def test_valid_specs_accepted(server, name):
    assert validate(server, VALID[name]) == []


def test_examples_accepted(server):
    docs = [d for p in sorted((ROOT / "examples").glob("*.yaml")) for d in yaml.safe_load_all(p.read_text())]
    his = [d for d in docs if d and d.get("kind") == "HybridInference"]
    assert len(his) >= 2
    for doc in his:
        assert validate(server, doc) == [], doc["metadata"]["name"]


def crd_rules():
    def walk(node):
        if isinstance(node, dict):
            yield from node.get("x-kubernetes-validations", [])
            for v in node.values():
                yield from walk(v)
        elif isinstance(node, list):
            for v in node:
                yield from walk(v)
    return list(walk(yaml.safe_load(CRD_PATH.read_text())))


def test_every_cel_rule_fires_on_some_invalid_spec(server):
    """Coverage: the server answers each rule's message for at least one INVALID case."""
    said = "\n".join(e for _, body, _ in INVALID for e in validate(server, body))
    assert [r["message"] for r in crd_rules() if r["message"] not in said] == []


def test_balanced_needs_hostpath_shared_memory_and_says_why(server):
    """The cpu stages and the GEMM helper in the gpu pod exchange work through the replica's /dev/shm."""
    errors = validate(server, make_body(strategy="balanced", sharedMemory={"mode": "none", "sizeLimit": "1Gi"}))
    assert len(errors) == 2, errors  # the whole message and its one cause
    assert errors[1].endswith("spec.strategy balanced needs spec.sharedMemory.mode hostPath (the cpu stages and the "
                              "GEMM helper in the gpu pod share /dev/shm)")
    for strategy in ("pipeline", "offload", "auto"):  # only balanced needs the shared /dev/shm
        assert validate(server, make_body(strategy=strategy, sharedMemory={"mode": "none"})) == [], strategy
    for shared_memory in ({}, {"mode": "hostPath"}):  # the defaulted mode is hostPath
        assert validate(server, make_body(strategy="balanced", sharedMemory=shared_memory)) == []


def test_coprocessor_needs_hostpath_shared_memory_and_says_why(server):
    """The cpu pods hand their weight and io regions to the gpu pod over a socket in the replica's /dev/shm."""
    errors = validate(server, make_body(strategy="coprocessor", sharedMemory={"mode": "none", "sizeLimit": "1Gi"}))
    assert len(errors) == 2, errors  # the whole message and its one cause
    assert errors[1].startswith("spec.sharedMemory.mode: ") and errors[1].endswith(
        "spec.strategy coprocessor needs spec.sharedMemory.mode hostPath (the cpu stages hand their weights to the "
        "gpu pod over a socket in the shared /dev/shm)"), errors
    for strategy in ("pipeline", "offload", "auto"):  # balanced and coprocessor need the shared /dev/shm
        assert validate(server, make_body(strategy=strategy, sharedMemory={"mode": "none"})) == [], strategy
    for shared_memory in ({}, {"mode": "hostPath"}):  # the defaulted mode is hostPath
        assert validate(server, make_body(strategy="coprocessor", sharedMemory=shared_memory)) == []


def test_coprocessor_needs_a_gpu_stage_0_with_a_cpu_stage_and_one_gpu_per_stage(server):
    """Only gpu stages run vLLM's layers under coprocessor; stage 0 serves the API; products split on one GPU."""
    assert validate(server, make_body(strategy="coprocessor", stages=stages(2))) == []
    errors = validate(server, make_body(strategy="coprocessor", stages=stages(3)))
    assert len(errors) == 2 and errors[1].endswith(
        "spec.strategy coprocessor runs one gpu stage and one cpu stage (for now): merge the cpu stages"), errors
    errors = validate(server, make_body(strategy="coprocessor", stages=[CPU, GPU]))
    assert [e for e in errors[1:] if e.startswith("spec.strategy:")] == [
        "spec.strategy: Invalid value: spec.strategy offload, coprocessor and experts need spec.stages[0] to be a "
        "gpu stage (stage 0 serves the API, and only gpu stages run vLLM's layers)"], errors
    errors = validate(server, make_body(strategy="coprocessor", stages=stages(1)))
    assert "need a gpu stage and a cpu stage" in errors[1] and "runs one gpu stage and one cpu stage" in errors[2], errors
    errors = validate(server, make_body(strategy="coprocessor", stages=stages(2, tp=2)))
    assert len(errors) == 2 and errors[1].startswith("spec.stages: ") and errors[1].endswith(
        "spec.strategy coprocessor needs spec.stages[].tensorParallel 1 on the gpu stages (for now)"), errors
    for strategy in ("pipeline", "offload", "balanced", "auto"):  # only coprocessor limits tensorParallel
        assert validate(server, make_body(strategy=strategy, stages=stages(3, tp=2))) == [], strategy


def test_experts_needs_hostpath_shared_memory_and_says_why(server):
    """The cpu pod hands its weight region (the experts the gpu stage leaves out) and its io region to the gpu pod
    over a socket in the replica's /dev/shm."""
    errors = validate(server, make_body(strategy="experts", sharedMemory={"mode": "none", "sizeLimit": "1Gi"}))
    assert len(errors) == 2, errors  # the whole message and its one cause
    assert errors[1] == ("spec.sharedMemory.mode: Invalid value: spec.strategy experts needs "
                         "spec.sharedMemory.mode hostPath (the cpu stage hands its experts to the gpu pod over a socket "
                         "in the shared /dev/shm)"), errors
    for shared_memory in ({}, {"mode": "hostPath"}):  # the defaulted mode is hostPath
        assert validate(server, make_body(strategy="experts", sharedMemory=shared_memory)) == []


def test_experts_needs_exactly_a_gpu_stage_0_and_a_cpu_stage_on_one_gpu(server):
    """The gpu stage runs every layer and serves the API; the one cpu stage holds the experts it leaves out."""
    assert validate(server, make_body(strategy="experts", stages=stages(2))) == []
    errors = validate(server, make_body(strategy="experts", stages=stages(3)))
    assert len(errors) == 2 and errors[1].startswith("spec.stages: ") and errors[1].endswith(
        "spec.strategy experts runs exactly one gpu stage and one cpu stage (the gpu stage runs every layer, the cpu "
        "stage holds the experts it leaves out)"), errors
    errors = validate(server, make_body(strategy="experts", stages=[CPU, GPU]))
    assert errors[1:] == [
        "spec.strategy: Invalid value: spec.strategy offload, coprocessor and experts need spec.stages[0] "
        "to be a gpu stage (stage 0 serves the API, and only gpu stages run vLLM's layers)"], errors
    errors = validate(server, make_body(strategy="experts", stages=stages(1)))
    assert len(errors) == 3 and "need a gpu stage and a cpu stage" in errors[1] and \
        "runs exactly one gpu stage and one cpu stage" in errors[2], errors
    errors = validate(server, make_body(strategy="experts", stages=[GPU, dict(GPU, name="gpu2")]))
    assert len(errors) == 2 and "need a gpu stage and a cpu stage" in errors[1], errors  # two stages, no cpu stage
    errors = validate(server, make_body(strategy="experts", stages=stages(2, tp=2)))
    assert len(errors) == 2 and errors[1].startswith("spec.stages: ") and errors[1].endswith(
        "spec.strategy experts needs spec.stages[].tensorParallel 1 on the gpu stage"), errors
    for strategy in ("pipeline", "offload", "balanced", "auto"):  # experts' limits are its own
        assert validate(server, make_body(strategy=strategy, stages=stages(3, tp=2))) == [], strategy


EXPERTS_SHAPES = {  # spec.strategy experts on a Mixtral-8x7B shape: what the runtime (and so the CRD) must refuse
    "gpu-then-cpu": {},
    "gpu-then-cpu-explicit-layers": {"stages": [dict(GPU, gpuMemory="80Gi", layers=25), dict(CPU, layers=7)]},
    "cpu-then-gpu": {"stages": [CPU, dict(GPU, gpuMemory="80Gi")]},
    "two-cpu-stages": {"stages": [dict(GPU, gpuMemory="80Gi"), CPU, dict(CPU, name="cpu2")]},
    "tensor-parallel-2": {"stages": [dict(GPU, gpuMemory="80Gi", gpus=2, tensorParallel=2),
                                     dict(CPU, tensorParallel=2)]},
    "private-dev-shm": {"sharedMemory": {"mode": "none"}},
    "gpu-only": {"stages": [dict(GPU, gpuMemory="80Gi")]},
    "two-gpu-stages": {"stages": [dict(GPU, gpuMemory="80Gi"), dict(GPU, name="gpu2", gpuMemory="80Gi")]},
    "cpu-only": {"stages": [CPU]},
}


@pytest.mark.parametrize("shape", EXPERTS_SHAPES)
def test_the_crd_refuses_exactly_the_experts_layouts_the_runtime_refuses(server, shape):
    """Admission mirrors the runtime: the launcher's own choice on the plan and env the operator renders (a dense
    model's refusal is the runtime's alone: the operator never reads the model)."""
    from vllm_hybrid.plan import PlanError, plan_from_dict
    from vllm_hybrid.planner import model_shape
    from vllm_hybrid.strategies import resolve_split
    from vllm_hybrid.tinymodel import MIXTRAL_8X7B

    spec = {"strategy": "experts", "stages": [dict(GPU, gpuMemory="80Gi"), CPU], **EXPERTS_SHAPES[shape]}
    body = make_body(**spec)
    sts = next(c for c in render_children(body) if c["kind"] == "StatefulSet")
    env = {e["name"]: e.get("value") for e in sts["spec"]["template"]["spec"]["containers"][0]["env"]}
    plan = plan_from_dict(yaml.safe_load(plan_yaml(body["spec"])))
    try:
        _, lay, _ = resolve_split(plan, model_shape(MIXTRAL_8X7B, plan.dtype), api_stage=int(env["HYBRID_API_STAGE"]),
                                  shared_shm=env["HYBRID_SHM_SHARED"] == "1")
        refused = None
        assert lay.strategy == "experts" and lay.stages == (0,) and lay.servers == ((1, 0),)
    except PlanError as e:
        refused = str(e)
    errors = validate(server, body)
    assert (errors == []) == (refused is None), (errors, refused)
    assert (shape in ("gpu-then-cpu", "gpu-then-cpu-explicit-layers")) == (refused is None), refused


def test_unknown_fields_are_pruned_when_the_client_does_not_ask_for_strict(server):
    body = make_body(serving={"maxTokens": 5, "port": 8080})
    body["metadata"] = {"name": "pruned", "namespace": "crd-checks"}
    resp = server.request("POST", PATH, json=body, params={"dryRun": "All", "fieldValidation": "Warn"})
    assert resp.status_code == 201, resp.text
    assert "maxTokens" not in resp.json()["spec"]["serving"] and resp.json()["spec"]["serving"]["port"] == 8080
    assert "unknown field" in resp.headers["warning"] and "spec.serving.maxTokens" in resp.headers["warning"]


def test_every_variable_the_operator_sets_is_refused_in_stage_env(server):
    """The CEL list follows render/pod.py: a variable the operator starts setting must be added to it."""
    body = make_body(model={"repo": "org/model", "tokenSecretRef": {"name": "hf"}},
                     serving={"apiKeySecretRef": {"name": "api"}},
                     stages=[dict(GPU, numaNode=0), dict(CPU, numaNode=1)])
    operator_set = {e["name"] for sts in render_children(body) if sts["kind"] == "StatefulSet"
                    for e in sts["spec"]["template"]["spec"]["containers"][0]["env"]}
    assert {"HYBRID_STAGE", "HYBRID_REPLICA", "HYBRID_SHM_SHARED", "HYBRID_NUMA_NODE", "HF_TOKEN",
            "VLLM_API_KEY"} <= operator_set
    for name in sorted(operator_set):
        errors = validate(server, body_with(set_in(["stages", 1, "env"], [{"name": name, "value": "x"}])))
        assert any("must not set a variable the operator sets" in e for e in errors), name


def test_env_value_defaults_to_empty_like_the_crd(server):
    spec = {"model": {"path": "m", "volume": {"claimName": "c"}},
            "stages": [dict(CPU, env=[{"name": "A"}, {"name": "B", "value": "1"}])], "sharedMemory": {"mode": "none"}}
    from_crd = server_spec(server, make_body(**spec))
    assert from_crd["stages"][0]["env"] == [{"name": "A", "value": ""}, {"name": "B", "value": "1"}]
    assert defaults.with_defaults(spec) == from_crd


def test_cel_rules_have_messages_naming_fields():
    rules = crd_rules()
    assert len(rules) >= 20
    for r in rules:
        assert r["message"].startswith(("spec.", "metadata.")), r["message"]


def test_python_defaults_match_crd_defaults(server):
    """hybrid_operator.defaults fills what the API server fills (the operator reads specs either way)."""
    for model in ({"path": "m", "volume": {"claimName": "c"}}, {"repo": "org/m", "tokenSecretRef": {"name": "t"}}):
        spec = {"model": model, "stages": [{"name": "gpu", "device": "gpu", "gpus": 1}],
                "serving": {"apiKeySecretRef": {"name": "a"}}}
        assert defaults.with_defaults(spec) == server_spec(server, make_body(**spec)), model


def test_crd_names_columns_and_subresources():
    crd = yaml.safe_load(CRD_PATH.read_text())
    assert crd["spec"]["group"] == "hybrid.inference.dev"
    assert crd["spec"]["names"]["shortNames"] == ["hi"]
    (version,) = crd["spec"]["versions"]
    assert version["name"] == "v1alpha1"
    assert version["subresources"]["status"] == {}
    assert version["subresources"]["scale"] == {"specReplicasPath": ".spec.replicas",
                                                "statusReplicasPath": ".status.replicas",
                                                "labelSelectorPath": ".status.selector"}
    cols = [c["name"] for c in version["additionalPrinterColumns"]]
    for wanted in ("Ready", "Replicas", "Stages", "Strategy", "Endpoint", "Age"):
        assert wanted in cols
    strategy = next(c for c in version["additionalPrinterColumns"] if c["name"] == "Strategy")
    assert strategy["jsonPath"] == ".spec.strategy" and "priority" not in strategy  # shown by plain `kubectl get`


def test_chart_ships_the_same_crd():
    assert (CHART / "files" / "crd.yaml").read_bytes() == CRD_PATH.read_bytes()
