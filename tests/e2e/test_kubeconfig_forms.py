"""The operator's client (hybrid_operator.kube) against the real API server with every kubeconfig form
users have: CA and client certificate embedded or as files, a token, a token file, an exec credential
plugin, the in-cluster service account; and token rotation (the old token revoked mid-run)."""
from __future__ import annotations

import base64

import pytest
import yaml
from hybrid_operator import kube as kube_client
from kubernetes_asyncio.config import incluster_config

NS = "kubeconfig-forms"
SA = "reader"
LIST_PATH = f"/api/v1/namespaces/{NS}/configmaps"


@pytest.fixture(scope="module")
def cluster(kube):
    kube.create_namespace(NS)
    kube.apply({"apiVersion": "v1", "kind": "ServiceAccount", "metadata": {"name": SA, "namespace": NS}},
               {"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "Role", "metadata": {"name": SA, "namespace": NS},
                "rules": [{"apiGroups": [""], "resources": ["configmaps"], "verbs": ["list"]}]},
               {"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "RoleBinding",
                "metadata": {"name": SA, "namespace": NS},
                "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": SA},
                "subjects": [{"kind": "ServiceAccount", "name": SA, "namespace": NS}]})
    return kube


def revocable_token(kube, name: str) -> str:
    """A token of the reader bound to a Secret: deleting the Secret revokes it."""
    kube.apply({"apiVersion": "v1", "kind": "Secret", "metadata": {"name": name, "namespace": NS}})
    return kube.kubectl("create", "token", SA, "-n", NS, "--bound-object-kind=Secret",
                        f"--bound-object-name={name}").stdout.strip()


async def lists_configmaps(kubeconfig=None) -> bool:
    api = await kube_client.KubeApi.connect(str(kubeconfig) if kubeconfig else None, retries=0)
    try:
        return isinstance(await api.list(LIST_PATH), list)
    finally:
        await api.close()


def files_of(kube, tmp_path):
    cfg = yaml.safe_load(kube.kubeconfig.read_text())
    cluster, user = cfg["clusters"][0]["cluster"], cfg["users"][0]["user"]
    out = {}
    for name, key, src in (("ca.crt", "certificate-authority", cluster), ("admin.crt", "client-certificate", user),
                           ("admin.key", "client-key", user)):
        (tmp_path / name).write_bytes(base64.b64decode(src[f"{key}-data"]))
        out[key] = str(tmp_path / name)
    return out


async def test_embedded_ca_and_client_certificate(cluster):
    assert await lists_configmaps(cluster.kubeconfig)  # kube-up's admin: *-data fields, as kind writes them


async def test_ca_and_client_certificate_files(cluster, tmp_path):
    f = files_of(cluster, tmp_path)
    path = tmp_path / "kubeconfig"
    path.write_text(yaml.safe_dump({
        "apiVersion": "v1", "kind": "Config", "current-context": "c",
        "clusters": [{"name": "c", "cluster": {"server": cluster.server, "certificate-authority": f["certificate-authority"]}}],
        "users": [{"name": "u", "user": {"client-certificate": f["client-certificate"], "client-key": f["client-key"]}}],
        "contexts": [{"name": "c", "context": {"cluster": "c", "user": "u"}}]}))
    assert await lists_configmaps(path)


async def test_token_with_embedded_ca(cluster, tmp_path):
    token = revocable_token(cluster, "plain-token")
    assert await lists_configmaps(cluster.token_kubeconfig(tmp_path / "kubeconfig", token))


async def test_wrong_token_is_refused_not_retried_forever(cluster, tmp_path):
    with pytest.raises(kube_client.ApiError) as err:
        await lists_configmaps(cluster.token_kubeconfig(tmp_path / "kubeconfig", "not-a-token"))
    assert err.value.status == 401


async def survives_rotation(cluster, token_file, kubeconfig, name: str) -> None:
    """The client lists, the token in token_file is replaced and the old one revoked (a kubelet rotating a
    projected token, an exec plugin's credential expiring), and the next list still succeeds: a 401, a
    reload of the credentials, a retry."""
    token_file.write_text(revocable_token(cluster, f"{name}-1"))
    api = await kube_client.KubeApi.connect(str(kubeconfig) if kubeconfig else None, retries=0)
    try:
        assert isinstance(await api.list(LIST_PATH), list)
        token_file.write_text(revocable_token(cluster, f"{name}-2"))
        cluster.kubectl("delete", "secret", f"{name}-1", "-n", NS)
        assert isinstance(await api.list(LIST_PATH), list)
    finally:
        await api.close()


async def test_token_file_rotation(cluster, tmp_path):
    token_file = tmp_path / "token"
    await survives_rotation(cluster, token_file, cluster.token_kubeconfig(tmp_path / "kubeconfig", tokenFile=str(token_file)),
                            "file-token")


async def test_exec_credential_plugin_rerun_after_revocation(cluster, tmp_path):
    """EKS (`aws eks get-token`) and GKE (`gke-gcloud-auth-plugin`) kubeconfigs run a plugin for the token."""
    token_file = tmp_path / "current-token"
    plugin = tmp_path / "plugin"
    plugin.write_text('#!/bin/sh\nprintf \'{"apiVersion":"client.authentication.k8s.io/v1","kind":"ExecCredential",'
                      f'"status":{{"token":"%s"}}}}\' "$(cat {token_file})"\n')
    plugin.chmod(0o755)
    kubeconfig = cluster.token_kubeconfig(tmp_path / "kubeconfig", exec={
        "apiVersion": "client.authentication.k8s.io/v1", "command": str(plugin), "interactiveMode": "Never"})
    await survives_rotation(cluster, token_file, kubeconfig, "exec-token")
    # kopf's own watches log in with the same credentials
    info = await kube_client.connection_info(await kube_client.load_configuration(str(kubeconfig)))
    assert info.token == token_file.read_text() and info.ca_path and not info.insecure


async def test_in_cluster_service_account_with_rotation(cluster, tmp_path, monkeypatch):
    token_file, ca_file = tmp_path / "token", tmp_path / "ca.crt"
    ca_file.write_bytes(base64.b64decode(cluster.ca_data))
    host, port = cluster.server.removeprefix("https://").rsplit(":", 1)
    monkeypatch.setenv("KUBERNETES_SERVICE_HOST", host)
    monkeypatch.setenv("KUBERNETES_SERVICE_PORT", port)
    monkeypatch.setenv("KUBECONFIG", "/nonexistent")  # in a pod there is none: the service account wins
    monkeypatch.setattr(incluster_config, "SERVICE_TOKEN_FILENAME", str(token_file))
    monkeypatch.setattr(incluster_config, "SERVICE_CERT_FILENAME", str(ca_file))
    token_file.write_text("placeholder")  # the file a pod has from its start
    assert kube_client.in_cluster()
    await survives_rotation(cluster, token_file, None, "pod-token")
