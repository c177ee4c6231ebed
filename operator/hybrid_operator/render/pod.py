"""Pod template of one stage: identity env, resources, /dev/shm, probes, hardening."""
from __future__ import annotations

import copy
from typing import Any

from vllm_hybrid.quantity import from_bytes, to_bytes

from .. import names
from ..plan import MODEL_MOUNT
from ..settings import MASTER_PORT, SUPERVISOR_PORT, Settings
from ..strategy import offloaded_stages

PLAN_DIR = "/etc/hybrid"
CACHE_DIR = "/cache"
RUNTIME_UID = 1000  # the runtime images' non-root user
SHM_VOLUME = "dshm"


def master_addr(body: dict[str, Any], settings: Settings) -> str:
    """Stage 0 pod of this replica; `{replica}` is filled in by the runtime from HYBRID_REPLICA."""
    meta, stage0 = body["metadata"], body["spec"]["stages"][0]["name"]
    sts = names.statefulset(meta["name"], stage0)
    return f"{sts}-{{replica}}.{names.peers_service(meta['name'])}.{meta['namespace']}.svc.{settings.cluster_domain}"


def shm_host_dir(body: dict[str, Any], settings: Settings) -> str:
    """Per-instance host directory; the uid keeps a re-created instance off stale segments."""
    meta = body["metadata"]
    return f"{settings.shm_host_root}/{meta['namespace']}.{meta['name']}.{meta['uid'][:8]}"


def _field_env(name: str, path: str) -> dict[str, Any]:
    return {"name": name, "valueFrom": {"fieldRef": {"fieldPath": path}}}


def _secret_env(name: str, ref: dict[str, str]) -> dict[str, Any]:
    return {"name": name, "valueFrom": {"secretKeyRef": {"name": ref["name"], "key": ref["key"]}}}


def _env(body: dict[str, Any], index: int, settings: Settings) -> list[dict[str, Any]]:
    spec, stage = body["spec"], body["spec"]["stages"][index]
    model = spec["model"]
    hf_home = f"{MODEL_MOUNT}/huggingface" if "repo" in model and "volume" in model else f"{CACHE_DIR}/huggingface"
    env = [
        # `pipeline` label of the stage metrics (hybrid_stage_*): the HybridInference's name
        {"name": "HYBRID_INSTANCE", "value": body["metadata"]["name"]},
        {"name": "HYBRID_STAGE", "value": str(index)},
        _field_env("HYBRID_REPLICA", f"metadata.labels['{names.POD_INDEX_LABEL}']"),
        {"name": "HYBRID_MASTER_ADDR", "value": master_addr(body, settings)},
        # the client Service sends requests to stage 0's pods: `auto` must keep that stage serving
        {"name": "HYBRID_API_STAGE", "value": "0"},
        # the replica's pods share /dev/shm (hostPath): balanced, coprocessor and experts need it, auto checks it
        {"name": "HYBRID_SHM_SHARED", "value": "1" if spec["sharedMemory"]["mode"] == "hostPath" else "0"},
        _field_env("HYBRID_HOST_IP", "status.podIP"),
        {"name": "HOME", "value": "/tmp"},  # read-only root fs: every tool's dotfiles go to /tmp
        {"name": "XDG_CACHE_HOME", "value": CACHE_DIR},
        {"name": "VLLM_CACHE_ROOT", "value": f"{CACHE_DIR}/vllm"},
        {"name": "HF_HOME", "value": hf_home},
    ]
    if "numaNode" in stage:
        env.append({"name": "HYBRID_NUMA_NODE", "value": str(stage["numaNode"])})
    if "tokenSecretRef" in model:
        env.append(_secret_env("HF_TOKEN", model["tokenSecretRef"]))
    if "apiKeySecretRef" in spec["serving"]:
        env.append(_secret_env("VLLM_API_KEY", spec["serving"]["apiKeySecretRef"]))  # never in args
    # after the operator's own, so a later $(VAR) reference can use them; the CRD forbids shadowing them
    env.extend(_user_env(var) for var in stage.get("env", []))
    return env


def _user_env(var: dict[str, str]) -> dict[str, str]:
    # the apiserver drops an empty value; rendering it would never match the live object and patch forever
    return {"name": var["name"], "value": var["value"]} if var["value"] else {"name": var["name"]}


# host RAM of a gpu stage's processes (vLLM's API server, engine and worker; balanced's GEMM helper,
# coprocessor's and experts' clients): peak RssAnon 2.0-3.4 GB in every H100 and H200 run (bench/results,
# stage_peak_rss_gb; experts on Mixtral 2.97 GB)
GPU_POD_HOST_MEMORY = 4 << 30


def _resources(spec: dict[str, Any], index: int) -> dict[str, Any]:
    stage = spec["stages"][index]
    extra = stage.get("resources", {})
    fixed: dict[str, Any] = {}
    if "cpus" in stage:
        fixed["cpu"] = str(stage["cpus"])
    if "memory" in stage:
        fixed["memory"] = stage["memory"]
    if stage["device"] == "gpu":
        fixed["nvidia.com/gpu"] = str(stage["gpus"])
    # requests == limits for everything we set: Guaranteed QoS, so the static CPU manager pins cores.
    limits = {**{k: str(v) for k, v in extra.get("limits", {}).items()}, **fixed}
    requests = {**{k: str(v) for k, v in extra.get("requests", {}).items()}, **fixed}
    # offload: this pod's host RAM also holds the cpu stages' weights (pinned, streamed to the GPU);
    # balanced's helper and coprocessor's and experts' gpu stage stream from the cpu pod's own region, charged to it.
    streamed = sum(to_bytes(spec["stages"][i]["memory"]) for i in offloaded_stages(spec, index))
    if "memory" in stage:
        if streamed:
            limits["memory"] = requests["memory"] = from_bytes(to_bytes(stage["memory"]) + streamed)
    elif stage["device"] == "gpu":  # reserve what it was measured to use on the node; no limit to outgrow
        requests["memory"] = from_bytes(GPU_POD_HOST_MEMORY + streamed)
    return {"requests": requests, "limits": limits}


def _ports(spec: dict[str, Any], index: int) -> list[dict[str, Any]]:
    ports = [{"name": "metrics", "containerPort": spec["monitoring"]["port"], "protocol": "TCP"}]
    if index == 0:
        ports = [{"name": "http", "containerPort": spec["serving"]["port"], "protocol": "TCP"},
                 {"name": "master", "containerPort": MASTER_PORT, "protocol": "TCP"},
                 {"name": "supervisor", "containerPort": SUPERVISOR_PORT, "protocol": "TCP"}, *ports]
    return ports


def _probes(index: int) -> dict[str, Any]:
    if index == 0:
        check: dict[str, Any] = {"httpGet": {"path": "/health", "port": "http"}}
    else:
        check = {"tcpSocket": {"port": "metrics"}}
    return {
        # Loading weights (and a first torch.compile) can take an hour on big models over slow disks; probed
        # every 2 s so a restarted group serves as soon as it can. Readiness every 2 s too: its first probe comes a
        # period after the startup probe's success; 5 misses (10 s) before a busy stage counts as unready.
        "startupProbe": {**check, "periodSeconds": 2, "failureThreshold": 1800, "timeoutSeconds": 2},
        "readinessProbe": {**check, "periodSeconds": 2, "failureThreshold": 5, "timeoutSeconds": 5},
        "livenessProbe": {**check, "periodSeconds": 20, "failureThreshold": 6, "timeoutSeconds": 10},
    }


def _container_security() -> dict[str, Any]:
    return {"allowPrivilegeEscalation": False, "readOnlyRootFilesystem": True, "runAsNonRoot": True,
            "runAsUser": RUNTIME_UID, "capabilities": {"drop": ["ALL"]},
            "seccompProfile": {"type": "RuntimeDefault"}}


def _shm_mount(hostpath: bool) -> dict[str, Any]:
    mount: dict[str, Any] = {"name": SHM_VOLUME, "mountPath": "/dev/shm"}
    if hostpath:
        mount["subPathExpr"] = "replica-$(HYBRID_REPLICA)"  # one directory per pipeline replica
    return mount


def _volumes(body: dict[str, Any], settings: Settings) -> list[dict[str, Any]]:
    spec, name = body["spec"], body["metadata"]["name"]
    shm = spec["sharedMemory"]
    if shm["mode"] == "hostPath":
        shm_volume: dict[str, Any] = {"name": SHM_VOLUME, "hostPath": {"path": shm_host_dir(body, settings),
                                                                         "type": "DirectoryOrCreate"}}
    else:
        empty: dict[str, Any] = {"medium": "Memory"}
        if "sizeLimit" in shm:
            empty["sizeLimit"] = shm["sizeLimit"]
        shm_volume = {"name": SHM_VOLUME, "emptyDir": empty}
    volumes = [
        {"name": "plan", "configMap": {"name": names.plan_configmap(name)}},
        shm_volume,
        _cache_volume(spec),
        {"name": "tmp", "emptyDir": {}},
    ]
    if "volume" in spec["model"]:
        vol = spec["model"]["volume"]
        volumes.append({"name": "model", "persistentVolumeClaim": {"claimName": vol["claimName"],
                                                                   "readOnly": vol["readOnly"]}})
    return volumes


def _cache_volume(spec: dict[str, Any]) -> dict[str, Any]:
    """/cache: kept across pods where spec.cache names a volume, so a restart skips torch.compile."""
    cache = spec.get("cache", {})
    if "claimName" in cache:
        return {"name": "cache", "persistentVolumeClaim": {"claimName": cache["claimName"]}}
    if "hostPath" in cache:
        return {"name": "cache", "hostPath": {"path": cache["hostPath"], "type": "DirectoryOrCreate"}}
    return {"name": "cache", "emptyDir": {}}


def _mounts(spec: dict[str, Any]) -> list[dict[str, Any]]:
    mounts = [
        {"name": "plan", "mountPath": PLAN_DIR, "readOnly": True},
        _shm_mount(spec["sharedMemory"]["mode"] == "hostPath"),
        {"name": "cache", "mountPath": CACHE_DIR},
        {"name": "tmp", "mountPath": "/tmp"},
    ]
    if "volume" in spec["model"]:
        vol = spec["model"]["volume"]
        mount = {"name": "model", "mountPath": MODEL_MOUNT, "readOnly": vol["readOnly"]}
        if vol.get("subPath"):
            mount["subPath"] = vol["subPath"]
        mounts.append(mount)
    return mounts


def _host_dirs_init(spec: dict[str, Any], image: str, env: list[dict[str, Any]]) -> dict[str, Any] | None:
    """kubelet creates hostPath/subPath dirs root-owned 0755; open them to the non-root runtime."""
    mounts = []
    if spec["sharedMemory"]["mode"] == "hostPath":
        mounts.append(_shm_mount(True))
    if "hostPath" in spec.get("cache", {}):
        mounts.append({"name": "cache", "mountPath": CACHE_DIR})
    if not mounts:
        return None
    return {
        "name": "host-dir-permissions",
        "image": image,
        "command": ["chmod", "1777", *(m["mountPath"] for m in mounts)],
        "env": [copy.deepcopy(e) for e in env if e["name"] == "HYBRID_REPLICA"],
        "volumeMounts": mounts,
        "resources": {"requests": {"cpu": "10m", "memory": "16Mi"}, "limits": {"cpu": "10m", "memory": "16Mi"}},
        # Root only to chmod its own directory; no capabilities needed for that.
        "securityContext": {"runAsUser": 0, "runAsNonRoot": False, "allowPrivilegeEscalation": False,
                            "readOnlyRootFilesystem": True, "capabilities": {"drop": ["ALL"]}},
    }


def _affinity(body: dict[str, Any], index: int) -> dict[str, Any] | None:
    """mode hostPath: pod i of every later stage must share a node with pod i of stage 0."""
    if index == 0 or body["spec"]["sharedMemory"]["mode"] != "hostPath":
        return None
    name = body["metadata"]["name"]
    return {"podAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": [{
        "labelSelector": {"matchLabels": {**names.instance_selector(name), names.STAGE_INDEX_LABEL: "0"}},
        "matchLabelKeys": [names.POD_INDEX_LABEL],
        "topologyKey": "kubernetes.io/hostname",
    }]}}


def image_for(spec: dict[str, Any], stage: dict[str, Any], settings: Settings) -> str:
    if stage["device"] == "gpu":
        return spec["images"].get("gpu", settings.gpu_image)
    return spec["images"].get("cpu", settings.cpu_image)


def render_pod_template(body: dict[str, Any], index: int, settings: Settings, plan_digest: str) -> dict[str, Any]:
    """`body["spec"]` must already carry defaults (see defaults.with_defaults)."""
    spec, name = body["spec"], body["metadata"]["name"]
    stage = spec["stages"][index]
    image = image_for(spec, stage, settings)
    env = _env(body, index, settings)
    annotations = {names.PLAN_HASH: plan_digest}
    if spec["monitoring"]["scrapeAnnotations"]:
        annotations.update({"prometheus.io/scrape": "true", "prometheus.io/port": str(spec["monitoring"]["port"]),
                            "prometheus.io/path": "/metrics"})
    container = {
        "name": "vllm",
        "image": image,
        "imagePullPolicy": spec["images"]["pullPolicy"],
        "command": ["vllm-hybrid"],
        "args": ["serve", "--plan", f"{PLAN_DIR}/plan.yaml"],
        "env": env,
        "ports": _ports(spec, index),
        "resources": _resources(spec, index),
        "volumeMounts": _mounts(spec),
        "securityContext": _container_security(),
        # the launcher writes a failure's one-line cause; a crash before it could is read from the log tail
        "terminationMessagePolicy": "FallbackToLogsOnError",
        **_probes(index),
    }
    pod_spec: dict[str, Any] = {
        "automountServiceAccountToken": False,  # the runtime never talks to the API server
        "enableServiceLinks": False,
        "terminationGracePeriodSeconds": 30,
        "securityContext": {"runAsNonRoot": True, "runAsUser": RUNTIME_UID, "runAsGroup": RUNTIME_UID,
                            "fsGroup": RUNTIME_UID, "seccompProfile": {"type": "RuntimeDefault"}},
        "containers": [container],
        "volumes": _volumes(body, settings),
    }
    if init := _host_dirs_init(spec, image, env):
        pod_spec["initContainers"] = [init]
    if affinity := _affinity(body, index):
        pod_spec["affinity"] = affinity
    if stage.get("nodeSelector"):
        pod_spec["nodeSelector"] = dict(stage["nodeSelector"])
    if stage.get("tolerations"):
        pod_spec["tolerations"] = list(stage["tolerations"])
    if spec["images"].get("pullSecrets"):
        pod_spec["imagePullSecrets"] = [{"name": s} for s in spec["images"]["pullSecrets"]]
    return {"metadata": {"labels": names.labels(name, stage["name"], index), "annotations": annotations},
            "spec": pod_spec}
