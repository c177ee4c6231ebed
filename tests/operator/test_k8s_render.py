"""Render tests: every child, every mode (hostPath/none), 1-3 stages, TP 1/2, replicas 0-3."""
from __future__ import annotations

import itertools

import pytest
import yaml
from hi_fixtures import make_body, stages
from hybrid_operator import names
from hybrid_operator.render import render_children
from hybrid_operator.settings import MASTER_PORT, SUPERVISOR_PORT, Settings
from vllm_hybrid.quantity import from_bytes, to_bytes

MATRIX = list(itertools.product(["hostPath", "none"], [1, 2, 3], [1, 2], [0, 1, 2, 3]))


def by_kind(children, kind):
    return [c for c in children if c["kind"] == kind]


def env_of(container):
    return {e["name"]: e for e in container["env"]}


@pytest.mark.parametrize("mode,n_stages,tp,replicas", MATRIX)
def test_children_for_every_shape(mode, n_stages, tp, replicas):
    body = make_body(stages=stages(n_stages, tp), replicas=replicas, sharedMemory={"mode": mode})
    children = render_children(body)
    kinds = [c["kind"] for c in children]
    assert kinds == ["ConfigMap", "Service", "Service"] + ["StatefulSet"] * n_stages

    for child in children:  # every child is owned by the instance (GC on delete)
        ref = child["metadata"]["ownerReferences"][0]
        assert ref["uid"] == body["metadata"]["uid"] and ref["controller"] is True
        assert child["metadata"]["namespace"] == "ml"

    plan = yaml.safe_load(by_kind(children, "ConfigMap")[0]["data"]["plan.yaml"])
    assert [s["name"] for s in plan["stages"]] == [s["name"] for s in body["spec"]["stages"]]
    assert all(s["tensor_parallel"] == tp for s in plan["stages"])

    for index, sts in enumerate(by_kind(children, "StatefulSet")):
        stage = body["spec"]["stages"][index]
        assert sts["metadata"]["name"] == f"llama-{stage['name']}"
        assert sts["spec"]["replicas"] == replicas
        assert sts["spec"]["podManagementPolicy"] == "Parallel"
        assert sts["spec"]["serviceName"] == "llama-peers"
        tmpl = sts["spec"]["template"]
        assert sts["spec"]["selector"]["matchLabels"].items() <= tmpl["metadata"]["labels"].items()
        pod = tmpl["spec"]
        (c,) = pod["containers"]
        env = env_of(c)
        assert env["HYBRID_STAGE"]["value"] == str(index)
        assert env["HYBRID_INSTANCE"]["value"] == "llama"  # `pipeline` label of the stage metrics
        ports = {p["name"]: p["containerPort"] for p in c["ports"]}
        assert ports["metrics"] == body["spec"].get("monitoring", {}).get("port", 9100)
        assert ("http" in ports) == (index == 0)  # vLLM's /metrics lives on stage 0's API port
        assert env["HYBRID_REPLICA"]["valueFrom"]["fieldRef"]["fieldPath"] == \
            "metadata.labels['apps.kubernetes.io/pod-index']"
        assert env["HYBRID_MASTER_ADDR"]["value"] == "llama-gpu-{replica}.llama-peers.ml.svc.cluster.local"
        assert env["HYBRID_API_STAGE"]["value"] == "0"  # what the client Service selects
        assert env["HYBRID_SHM_SHARED"]["value"] == ("1" if mode == "hostPath" else "0")  # balanced needs 1
        assert env["HYBRID_HOST_IP"]["valueFrom"]["fieldRef"]["fieldPath"] == "status.podIP"
        assert c["command"] == ["vllm-hybrid"] and c["args"] == ["serve", "--plan", "/etc/hybrid/plan.yaml"]
        res = c["resources"]
        if stage["device"] == "cpu":  # Guaranteed QoS with integer CPUs
            assert res["requests"] == res["limits"] == {"cpu": "16", "memory": "64Gi"}
            assert plan["stages"][index]["cpus"] == int(res["limits"]["cpu"])
            assert plan["stages"][index]["memory"] == res["limits"]["memory"]
        else:
            assert res["limits"]["nvidia.com/gpu"] == str(tp) == res["requests"]["nvidia.com/gpu"]
        shm = next(v for v in pod["volumes"] if v["name"] == "dshm")
        mount = next(m for m in c["volumeMounts"] if m["mountPath"] == "/dev/shm")
        affinity = pod.get("affinity")
        if mode == "hostPath":
            assert shm["hostPath"] == {"path": "/dev/shm/hybrid-inference/ml.llama.01234567",
                                       "type": "DirectoryOrCreate"}
            assert mount["subPathExpr"] == "replica-$(HYBRID_REPLICA)"
            assert pod["initContainers"][0]["command"] == ["chmod", "1777", "/dev/shm"]
            if index == 0:
                assert affinity is None
            else:
                (term,) = affinity["podAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]
                assert term["matchLabelKeys"] == ["apps.kubernetes.io/pod-index"]
                assert term["topologyKey"] == "kubernetes.io/hostname"
                assert term["labelSelector"]["matchLabels"] == {names.INSTANCE_LABEL: "llama",
                                                                names.STAGE_INDEX_LABEL: "0"}
        else:
            assert shm["emptyDir"]["medium"] == "Memory" and "hostPath" not in shm
            assert "subPathExpr" not in mount and "initContainers" not in pod and affinity is None


def test_stage0_serves_api_with_probes_and_other_stages_only_metrics():
    sts = by_kind(render_children(make_body(stages=stages(3))), "StatefulSet")
    head = sts[0]["spec"]["template"]["spec"]["containers"][0]
    assert {p["name"]: p["containerPort"] for p in head["ports"]} == {"http": 8000, "master": MASTER_PORT,
                                                                      "supervisor": SUPERVISOR_PORT, "metrics": 9100}
    assert head["readinessProbe"]["httpGet"] == {"path": "/health", "port": "http"}
    assert head["startupProbe"]["failureThreshold"] * head["startupProbe"]["periodSeconds"] >= 1800
    for tail in sts[1:]:
        c = tail["spec"]["template"]["spec"]["containers"][0]
        assert [p["name"] for p in c["ports"]] == ["metrics"]
        assert "httpGet" not in c["readinessProbe"]


def test_services():
    _, peers, client, *_ = render_children(make_body())
    assert peers["spec"]["clusterIP"] == "None" and peers["spec"]["publishNotReadyAddresses"] is True
    assert peers["spec"]["selector"] == {names.INSTANCE_LABEL: "llama"}
    assert client["metadata"]["name"] == "llama"
    assert client["spec"]["selector"] == {names.INSTANCE_LABEL: "llama", names.STAGE_INDEX_LABEL: "0"}
    assert client["spec"]["ports"] == [{"name": "http", "port": 8000, "targetPort": "http", "protocol": "TCP"}]


def test_api_key_and_hf_token_come_from_secrets_never_args():
    body = make_body(model={"repo": "meta-llama/Llama-3.1-8B", "revision": "main",
                            "tokenSecretRef": {"name": "hf"}},
                     serving={"apiKeySecretRef": {"name": "api", "key": "k"}})
    for sts in by_kind(render_children(body), "StatefulSet"):
        c = sts["spec"]["template"]["spec"]["containers"][0]
        env = env_of(c)
        assert env["VLLM_API_KEY"]["valueFrom"]["secretKeyRef"] == {"name": "api", "key": "k"}
        assert env["HF_TOKEN"]["valueFrom"]["secretKeyRef"] == {"name": "hf", "key": "token"}
        assert not any("api-key" in a or "token" in a for a in c["args"])
    plan = yaml.safe_load(render_children(body)[0]["data"]["plan.yaml"])
    assert plan["model"] == "meta-llama/Llama-3.1-8B" and plan["revision"] == "main"


def test_spec_change_changes_plan_hash_so_every_stage_rolls():
    a = by_kind(render_children(make_body()), "StatefulSet")
    b = by_kind(render_children(make_body(serving={"maxNumSeqs": 8})), "StatefulSet")
    for x, y in zip(a, b):
        ha = x["spec"]["template"]["metadata"]["annotations"][names.PLAN_HASH]
        hb = y["spec"]["template"]["metadata"]["annotations"][names.PLAN_HASH]
        assert ha != hb


def test_stage_extras_nodeselector_tolerations_resources_numa_and_images():
    st = stages(2)
    st[1].update(nodeSelector={"node.kubernetes.io/instance-type": "c7i"}, numaNode=1,
                 tolerations=[{"key": "cpu-only", "operator": "Exists", "effect": "NoSchedule"}],
                 resources={"limits": {"hugepages-2Mi": "1Gi"}, "requests": {"hugepages-2Mi": "1Gi"}})
    body = make_body(stages=st, images={"cpu": "my/cpu:1", "pullSecrets": ["regcred"]})
    gpu, cpu = by_kind(render_children(body, Settings(gpu_image="def/gpu:2")), "StatefulSet")
    pod = cpu["spec"]["template"]["spec"]
    c = pod["containers"][0]
    assert pod["nodeSelector"] == {"node.kubernetes.io/instance-type": "c7i"}
    assert pod["tolerations"][0]["key"] == "cpu-only"
    assert pod["imagePullSecrets"] == [{"name": "regcred"}]
    assert c["resources"]["limits"] == {"hugepages-2Mi": "1Gi", "cpu": "16", "memory": "64Gi"}
    assert c["resources"]["requests"] == c["resources"]["limits"]
    assert env_of(c)["HYBRID_NUMA_NODE"]["value"] == "1"
    assert c["image"] == "my/cpu:1"
    assert gpu["spec"]["template"]["spec"]["containers"][0]["image"] == "def/gpu:2"


def test_stage_env_follows_the_operators_own_on_that_stage_only():
    plain = by_kind(render_children(make_body()), "StatefulSet")
    st = stages(2)
    st[1]["env"] = [{"name": "VLLM_CPU_SGL_KERNEL", "value": "0"}, {"name": "HYBRID_BATCHES_IN_FLIGHT", "value": "2"},
                    {"name": "EMPTY"}]
    gpu, cpu = by_kind(render_children(make_body(stages=st)), "StatefulSet")
    containers = [sts["spec"]["template"]["spec"]["containers"][0] for sts in (plain[0], plain[1], gpu, cpu)]
    assert containers[3]["env"] == containers[1]["env"] + [
        {"name": "VLLM_CPU_SGL_KERNEL", "value": "0"}, {"name": "HYBRID_BATCHES_IN_FLIGHT", "value": "2"},
        {"name": "EMPTY"}]  # no `value: ""`: the apiserver drops it, and apply would then never converge
    assert containers[2]["env"] == containers[0]["env"]


def test_changing_stage_env_rolls_that_stage():
    def stateful_sets(value):
        st = stages(2)
        st[1]["env"] = [{"name": "HYBRID_BATCHES_IN_FLIGHT", "value": value}]
        return by_kind(render_children(make_body(stages=st)), "StatefulSet")
    (gpu_a, cpu_a), (gpu_b, cpu_b) = stateful_sets("1"), stateful_sets("2")
    assert cpu_a["spec"]["template"] != cpu_b["spec"]["template"]  # a new pod template: the StatefulSet rolls
    assert gpu_a == gpu_b  # the other stage's pods re-form by group restart, not by a template change


def test_network_policy_only_when_enabled():
    assert not by_kind(render_children(make_body()), "NetworkPolicy")
    (np,) = by_kind(render_children(make_body(), Settings(network_policy=True)), "NetworkPolicy")
    own, public = np["spec"]["ingress"]
    assert own == {"from": [{"podSelector": {"matchLabels": {names.INSTANCE_LABEL: "llama"}}}]}
    assert sorted(p["port"] for p in public["ports"]) == [8000, 9100]  # never the rendezvous port
    assert np["spec"]["podSelector"]["matchLabels"] == {names.INSTANCE_LABEL: "llama"}


def test_runtime_containers_hardened():
    for mode in ("hostPath", "none"):
        for sts in by_kind(render_children(make_body(sharedMemory={"mode": mode})), "StatefulSet"):
            pod = sts["spec"]["template"]["spec"]
            sc = pod["containers"][0]["securityContext"]
            assert sc["runAsNonRoot"] and sc["capabilities"] == {"drop": ["ALL"]}
            assert sc["allowPrivilegeEscalation"] is False and sc["readOnlyRootFilesystem"] is True
            assert pod["automountServiceAccountToken"] is False


def test_render_is_pure_and_deterministic():
    body = make_body()
    snapshot = yaml.safe_dump(body)
    assert render_children(body) == render_children(body)
    assert yaml.safe_dump(body) == snapshot  # the input is not mutated


def memory_of(sts):
    res = sts["spec"]["template"]["spec"]["containers"][0]["resources"]
    return res["requests"].get("memory"), res["limits"].get("memory")


def test_offload_runs_only_gpu_stages_with_host_ram_for_the_streamed_layers():
    st = stages(3)
    st[0]["memory"] = "32Gi"
    body = make_body(strategy="offload", stages=st)
    children = render_children(body)
    assert [c["kind"] for c in children] == ["ConfigMap", "Service", "Service", "StatefulSet"]
    (gpu,) = by_kind(children, "StatefulSet")
    assert gpu["metadata"]["name"] == "llama-gpu"
    assert memory_of(gpu) == ("160Gi", "160Gi")  # 32Gi of its own + 2 x 64Gi of cpu-stage weights
    res = gpu["spec"]["template"]["spec"]["containers"][0]["resources"]
    assert res["requests"]["nvidia.com/gpu"] == res["limits"]["nvidia.com/gpu"] == "1"
    plan = yaml.safe_load(children[0]["data"]["plan.yaml"])
    assert plan["strategy"] == "offload" and len(plan["stages"]) == 3  # the runtime still plans every stage


def test_offload_without_gpu_memory_reserves_the_streamed_ram_without_a_limit():
    (gpu,) = by_kind(render_children(make_body(strategy="offload", stages=stages(3))), "StatefulSet")
    assert memory_of(gpu) == ("132Gi", None)  # 2 x 64Gi streamed + 4Gi for its processes


@pytest.mark.parametrize("strategy", ["pipeline", "balanced", "coprocessor", "experts", "auto"])
def test_a_gpu_pod_without_memory_requests_what_its_processes_were_measured_to_use(strategy):
    """The node must count the gpu pod's host RAM (vLLM's processes: 2.0-3.4 GB measured): a request, no limit."""
    for sts in by_kind(render_children(make_body(strategy=strategy, stages=stages(2))), "StatefulSet"):
        gpu = sts["metadata"]["name"] == "llama-gpu"
        assert memory_of(sts) == (("4Gi", None) if gpu else ("64Gi", "64Gi")), sts["metadata"]["name"]


def test_offload_each_gpu_stage_holds_the_cpu_stages_after_it():
    st = stages(4)
    st[0]["memory"] = "1.5Gi"
    st[2] = dict(st[0], name="gpu2", memory="16G")
    st[3]["memory"] = "1000Mi"
    gpu, gpu2 = by_kind(render_children(make_body(strategy="offload", stages=st)), "StatefulSet")
    assert memory_of(gpu) == ("67072Mi", "67072Mi")  # 1.5Gi + 64Gi
    assert [to_bytes(m) for m in memory_of(gpu2)] == [16 * 10**9 + 1000 * 2**20] * 2  # decimal + binary units
    assert env_of(gpu2["spec"]["template"]["spec"]["containers"][0])["HYBRID_STAGE"]["value"] == "2"


def test_auto_runs_every_stage_like_pipeline():
    """auto: the runtime may still pick offload, then the cpu pods idle; the operator cannot know."""
    st = stages(3)
    st[0]["memory"] = "32Gi"
    pipeline = render_children(make_body(stages=st))
    auto = render_children(make_body(stages=st, strategy="auto", workload={"concurrency": 4}))
    assert [c["metadata"]["name"] for c in auto] == [c["metadata"]["name"] for c in pipeline]
    for a, b in zip(by_kind(pipeline, "StatefulSet"), by_kind(auto, "StatefulSet")):
        assert memory_of(a) == memory_of(b)  # auto adds no RAM: the operator cannot know what it picks
        ha = a["spec"]["template"]["metadata"]["annotations"].pop(names.PLAN_HASH)
        hb = b["spec"]["template"]["metadata"]["annotations"].pop(names.PLAN_HASH)
        assert ha != hb and a == b  # only the plan differs


def test_balanced_runs_every_stage_and_keeps_one_copy_of_the_weights_in_the_cpu_pods():
    """The GEMM helper streams from the cpu stages' own weight regions: no pod grows, only the plan differs."""
    for st, gpu_memory in ((stages(3), ("4Gi", None)), ([*stages(3)[1:], dict(stages(1)[0], memory="32Gi")], ("32Gi",) * 2)):
        pipeline = by_kind(render_children(make_body(stages=st)), "StatefulSet")
        children = render_children(make_body(stages=st, strategy="balanced"))
        balanced = by_kind(children, "StatefulSet")
        assert [s["metadata"]["name"] for s in balanced] == [s["metadata"]["name"] for s in pipeline]
        gpu = next(s for s in balanced if s["metadata"]["name"] == "llama-gpu")
        assert memory_of(gpu) == gpu_memory
        res = gpu["spec"]["template"]["spec"]["containers"][0]["resources"]
        assert res["requests"]["nvidia.com/gpu"] == res["limits"]["nvidia.com/gpu"] == "1"
        for a, b in zip(pipeline, balanced):
            a["spec"]["template"]["metadata"]["annotations"].pop(names.PLAN_HASH)
            b["spec"]["template"]["metadata"]["annotations"].pop(names.PLAN_HASH)
            assert a == b  # the pods differ from pipeline's in the plan only
        plan = yaml.safe_load(children[0]["data"]["plan.yaml"])
        assert plan["strategy"] == "balanced" and len(plan["stages"]) == 3


@pytest.mark.parametrize("strategy", ["coprocessor", "experts"])
def test_coprocessor_and_experts_run_every_stage_and_keep_the_weights_in_the_cpu_pods(strategy):
    """The gpu stage computes every layer, but the cpu stage's layers (coprocessor) or the experts the gpu leaves
    out (experts) live in the cpu pod's own weight region (handed over the shared /dev/shm), whose server computes
    from it: every stage gets its pods, none grows, only the plan differs."""
    for st, gpu_memory in ((stages(2), ("4Gi", None)), ([dict(stages(1)[0], memory="32Gi"), stages(2)[1]], ("32Gi",) * 2)):
        st[1] = dict(st[1], memory="24Gi", resources={"limits": {"hugepages-2Mi": "8Gi"},
                                                      "requests": {"hugepages-2Mi": "8Gi"}})
        pipeline = by_kind(render_children(make_body(stages=st)), "StatefulSet")
        children = render_children(make_body(stages=st, strategy=strategy))
        coprocessor = by_kind(children, "StatefulSet")
        assert [s["metadata"]["name"] for s in coprocessor] == ["llama-gpu", "llama-cpu"]
        gpu, cpu = coprocessor
        assert memory_of(gpu) == gpu_memory  # not the cpu stage's weights, unlike offload
        assert memory_of(cpu) == ("24Gi", "24Gi")  # as stated
        res = cpu["spec"]["template"]["spec"]["containers"][0]["resources"]
        assert res["requests"]["hugepages-2Mi"] == res["limits"]["hugepages-2Mi"] == "8Gi"
        for sts in coprocessor:  # the product (or expert) server runs from the same container and command
            pod = sts["spec"]["template"]["spec"]
            (container,) = pod["containers"]
            assert container["command"] == ["vllm-hybrid"] and container["args"][0] == "serve"
            assert env_of(container)["HYBRID_SHM_SHARED"]["value"] == "1"
            assert any("hostPath" in v for v in pod["volumes"])
        assert cpu["spec"]["template"]["spec"]["affinity"]["podAffinity"]  # beside stage 0's pod of its replica
        for a, b in zip(pipeline, coprocessor):
            ha = a["spec"]["template"]["metadata"]["annotations"].pop(names.PLAN_HASH)
            hb = b["spec"]["template"]["metadata"]["annotations"].pop(names.PLAN_HASH)
            assert ha != hb and a == b  # the pods differ from pipeline's in the plan only
        plan = yaml.safe_load(children[0]["data"]["plan.yaml"])
        assert plan["strategy"] == strategy and len(plan["stages"]) == 2
        assert [s.get("memory") for s in plan["stages"]] == [None, "24Gi"]


def test_only_offload_gives_the_gpu_pod_the_cpu_stages_ram_and_drops_the_cpu_pods():
    st = stages(3)
    st[0]["memory"] = "32Gi"
    offload = by_kind(render_children(make_body(strategy="offload", stages=st)), "StatefulSet")
    for strategy in ("balanced", "coprocessor"):
        kept = by_kind(render_children(make_body(strategy=strategy, stages=st)), "StatefulSet")
        assert [s["metadata"]["name"] for s in kept] == ["llama-gpu", "llama-cpu", "llama-cpu2"], strategy
        assert memory_of(kept[0]) == ("32Gi", "32Gi"), strategy
    assert [s["metadata"]["name"] for s in offload] == ["llama-gpu"]
    assert memory_of(offload[0]) == ("160Gi", "160Gi")  # 32Gi of its own + 2 x 64Gi of offloaded weights


def test_shm_shared_env_follows_the_shared_memory_mode_on_every_stage():
    for mode, shared in (("hostPath", "1"), ("none", "0")):
        body = make_body(strategy="auto", stages=stages(3), sharedMemory={"mode": mode})
        for sts in by_kind(render_children(body), "StatefulSet"):
            assert env_of(sts["spec"]["template"]["spec"]["containers"][0])["HYBRID_SHM_SHARED"] == \
                {"name": "HYBRID_SHM_SHARED", "value": shared}
    # the CRD default (hostPath) applies when sharedMemory is left out
    for sts in by_kind(render_children(make_body()), "StatefulSet"):
        assert env_of(sts["spec"]["template"]["spec"]["containers"][0])["HYBRID_SHM_SHARED"]["value"] == "1"


def test_workload_reaches_the_plan_and_rolls_the_pods():
    a = render_children(make_body(strategy="auto"))
    b = render_children(make_body(strategy="auto", workload={"concurrency": 64, "promptTokens": 2048}))
    plan = yaml.safe_load(b[0]["data"]["plan.yaml"])
    assert plan["expected_concurrency"] == 64 and plan["expected_prompt_tokens"] == 2048
    assert "expected_output_tokens" not in plan
    sts_a, sts_b = by_kind(a, "StatefulSet")[0], by_kind(b, "StatefulSet")[0]
    assert sts_a["spec"]["template"]["metadata"]["annotations"][names.PLAN_HASH] != \
        sts_b["spec"]["template"]["metadata"]["annotations"][names.PLAN_HASH]


def test_memory_quantities_add_exactly():
    assert to_bytes("64Gi") == 64 * 2**30 and to_bytes("1.1Gi") == 1181116007 and to_bytes("2k") == 2000
    assert from_bytes(to_bytes("64Gi") + to_bytes("32Gi")) == "96Gi"
    assert from_bytes(to_bytes("512Mi") + to_bytes("512Mi")) == "1Gi"
    assert from_bytes(1000) == "1000" and from_bytes(16 * 10**9) == "15625000Ki"
    with pytest.raises(ValueError):
        to_bytes("64GB")


@pytest.mark.parametrize("mode", ["hostPath", "none"])
def test_cache_outlives_the_pod_only_where_the_spec_names_a_volume(mode):
    """/cache (vLLM's compile cache) is an emptyDir unless spec.cache names a claim or a host directory;
    a host directory is opened to uid 1000 by the root init container, as /dev/shm's is."""
    def pods(**spec):
        body = make_body(sharedMemory={"mode": mode, **({"sizeLimit": "1Gi"} if mode == "none" else {})}, **spec)
        return [s["spec"]["template"]["spec"] for s in by_kind(render_children(body), "StatefulSet")]

    def cache(pod):
        return next(v for v in pod["volumes"] if v["name"] == "cache")

    for pod in pods():
        assert cache(pod) == {"name": "cache", "emptyDir": {}}
        assert [c["name"] for c in pod.get("initContainers", [])] == (["host-dir-permissions"] if mode == "hostPath"
                                                                      else [])
    for pod in pods(cache={"claimName": "vllm-cache"}):
        assert cache(pod) == {"name": "cache", "persistentVolumeClaim": {"claimName": "vllm-cache"}}
        assert {"name": "cache", "mountPath": "/cache"} in pod["containers"][0]["volumeMounts"]
    for pod in pods(cache={"hostPath": "/var/cache/llama"}):
        assert cache(pod) == {"name": "cache", "hostPath": {"path": "/var/cache/llama", "type": "DirectoryOrCreate"}}
        init = pod["initContainers"][0]
        assert init["command"] == ["chmod", "1777", *(["/dev/shm"] if mode == "hostPath" else []), "/cache"]
        assert init["securityContext"]["runAsUser"] == 0
