"""`kubectl apply --dry-run=client` accepts the examples, against kmock as the API server.

kubectl needs a server for discovery (kind -> resource mapping) even in client dry-run; kmock
serves it. Schema validation of the examples is done by crd_validation (test_k8s_crd.py):
kubectl's own --validate needs the server's OpenAPI documents, which kmock does not emulate.
"""
from __future__ import annotations

import asyncio

import kmock as kmock_lib
import yaml
from hi_fixtures import BIN, ROOT

CORE_V1 = {"apiVersion": "v1", "kind": "APIResourceList", "groupVersion": "v1", "resources": [
    {"name": "namespaces", "singularName": "namespace", "kind": "Namespace", "namespaced": False,
     "verbs": ["get", "list", "create", "patch"]},
    {"name": "secrets", "singularName": "secret", "kind": "Secret", "namespaced": True,
     "verbs": ["get", "list", "create", "patch"]},
]}


async def kubectl(kubeconfig, *args):
    proc = await asyncio.create_subprocess_exec(str(BIN / "kubectl"), "--kubeconfig", str(kubeconfig), *args,
                                                stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE)
    out, err = await asyncio.wait_for(proc.communicate(), 60)  # async: kmock serves from this loop
    return proc.returncode, out.decode(), err.decode()


async def test_examples_accepted_by_kubectl_client_dry_run(kmock, tmp_path):
    kmock.resources["hybrid.inference.dev/v1alpha1/hybridinferences"] = kmock_lib.ResourceInfo(
        namespaced=True, kind="HybridInference", singular="hybridinference", shortnames={"hi"},
        verbs={"get", "list", "create", "patch"}, subresources={"status", "scale"})
    kmock["get /api/v1"] << CORE_V1  # kmock's built-in core discovery names the group "/v1"
    kubeconfig = tmp_path / "kubeconfig"
    kubeconfig.write_text(yaml.safe_dump({
        "apiVersion": "v1", "kind": "Config", "current-context": "kmock",
        "clusters": [{"name": "kmock", "cluster": {"server": str(kmock.url)}}],
        "users": [{"name": "u", "user": {"token": "t"}}],
        "contexts": [{"name": "kmock", "context": {"cluster": "kmock", "user": "u"}}]}))
    examples = sorted((ROOT / "examples").glob("*.yaml"))
    assert len(examples) >= 2
    for path in examples:
        rc, out, err = await kubectl(kubeconfig, "apply", "--dry-run=client", "--validate=false", "-f", str(path))
        assert rc == 0, err
        names = [d["metadata"]["name"] for d in yaml.safe_load_all(path.read_text()) if d]
        for name in names:
            assert f"/{name} created (dry run)" in out, out
    # Client dry-run never writes to the server.
    assert not [r for r in kmock if r.method.value in ("POST", "PATCH", "PUT", "DELETE")]


async def test_unknown_kind_is_rejected(kmock, tmp_path):
    """Guards the test above: kubectl really does consult the server's discovery."""
    kmock["get /api/v1"] << CORE_V1
    kubeconfig = tmp_path / "kubeconfig"
    kubeconfig.write_text(yaml.safe_dump({
        "apiVersion": "v1", "kind": "Config", "current-context": "kmock",
        "clusters": [{"name": "kmock", "cluster": {"server": str(kmock.url)}}],
        "users": [{"name": "u", "user": {"token": "t"}}],
        "contexts": [{"name": "kmock", "context": {"cluster": "kmock", "user": "u"}}]}))
    rc, _, err = await kubectl(kubeconfig, "apply", "--dry-run=client", "--validate=false",
                               "-f", str(ROOT / "examples" / "hybrid.yaml"))
    assert rc != 0 and "HybridInference" in err
