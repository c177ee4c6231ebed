"""A real Kubernetes control plane for tests: ../shared/kube's etcd, kube-apiserver, controller-manager
and scheduler on loopback, with fake nodes and a fake kubelet (its README). One per test session.

Tests reach it three ways: `kubectl`/`helm` as a user would, `request()` (httpx with the admin's
client certificate) for fast checks of what the API server admits, and the kubeconfig for the operator.
"""
from __future__ import annotations

import base64
import json
import os
import socket
import ssl
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx
import yaml

ROOT = Path(__file__).resolve().parents[1]
VENV_BIN = ROOT / ".venv" / "bin"
KUBE_SCRIPTS = Path(os.environ.get("HYBRID_KUBE_DIR", ROOT.parent / "shared" / "kube"))
KUBE_BIN = ROOT / ".cache" / "kube-bin"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def unavailable_reason() -> str | None:
    if not (KUBE_SCRIPTS / "kube-up.sh").exists():
        return f"no control plane scripts at {KUBE_SCRIPTS} (set HYBRID_KUBE_DIR)"
    if not (VENV_BIN / "kubectl").exists() or not (VENV_BIN / "helm").exists():
        return "kubectl/helm missing from .venv/bin: run `make setup`"
    return None


class Cluster:
    def __init__(self, run_dir: Path, **env: str):
        """env: kube-up.sh's settings over these (a real node: KUBE_FAKE_NODES=0, KUBE_NODE_LIFECYCLE=1)."""
        self.run_dir = run_dir
        self.kubeconfig = run_dir / "kubeconfig"
        port = free_port
        self.env = {**os.environ, "KUBE_BIN": str(KUBE_BIN), "KUBE_CACHE": str(run_dir), "KUBE_RUN": str(run_dir / "run"),
                    "KUBECONFIG_OUT": str(self.kubeconfig), "KUBE_FAKE_NODES": "2", "KUBE_FAKE_KUBELET": "1",
                    # free ports: a developer's own control plane may hold the defaults
                    "KUBE_APISERVER_PORT": str(port()), "ETCD_CLIENT_PORT": str(port()),
                    "ETCD_PEER_PORT": str(port()), "KUBE_KCM_PORT": str(port()), "KUBE_SCHED_PORT": str(port()), **env}
        self.http: httpx.Client | None = None

    # ------------------------------------------------------------------ lifecycle
    def up(self) -> float:
        t0 = time.monotonic()
        subprocess.run(["bash", str(KUBE_SCRIPTS / "install.sh"), str(KUBE_BIN)], check=True, capture_output=True,
                       timeout=600)
        (KUBE_BIN / "kubectl").unlink(missing_ok=True)  # ours (.venv), not whatever kubectl is on PATH
        (KUBE_BIN / "kubectl").symlink_to(VENV_BIN / "kubectl")
        proc = subprocess.run(["bash", str(KUBE_SCRIPTS / "kube-up.sh")], env=self.env, capture_output=True,
                              text=True, timeout=600)
        if proc.returncode:
            raise RuntimeError(f"kube-up.sh failed ({proc.returncode}):\n{proc.stderr[-4000:]}")
        self.http = self._admin_client()
        return time.monotonic() - t0

    def down(self) -> None:
        if self.http:
            self.http.close()
        subprocess.run(["bash", str(KUBE_SCRIPTS / "kube-down.sh"), "--purge"], env=self.env, capture_output=True,
                       timeout=120)

    def _admin_client(self) -> httpx.Client:
        cfg = yaml.safe_load(self.kubeconfig.read_text())
        cluster, user = cfg["clusters"][0]["cluster"], cfg["users"][0]["user"]
        pem = self.run_dir / "admin-pem"
        pem.mkdir(exist_ok=True)
        for name, key in (("ca.crt", "certificate-authority-data"), ("admin.crt", "client-certificate-data"),
                          ("admin.key", "client-key-data")):
            (pem / name).write_bytes(base64.b64decode((cluster | user)[key]))
        self.server = cluster["server"]
        self.ca_data = cluster["certificate-authority-data"]
        tls = ssl.create_default_context(cafile=str(pem / "ca.crt"))
        tls.load_cert_chain(str(pem / "admin.crt"), str(pem / "admin.key"))
        return httpx.Client(base_url=self.server, verify=tls, timeout=30)

    # ------------------------------------------------------------------ clients
    def kubectl(self, *args: str, input: str | None = None, check: bool = True, kubeconfig: Path | None = None,
                timeout: float = 120) -> subprocess.CompletedProcess:
        return self._run([str(VENV_BIN / "kubectl"), *args], input, check, kubeconfig, timeout)

    def helm(self, *args: str, check: bool = True, timeout: float = 300) -> subprocess.CompletedProcess:
        return self._run([str(VENV_BIN / "helm"), *args], None, check, None, timeout)

    def _run(self, cmd: list[str], input: str | None, check: bool, kubeconfig: Path | None,
             timeout: float) -> subprocess.CompletedProcess:
        env = {**os.environ, "KUBECONFIG": str(kubeconfig or self.kubeconfig), "HELM_CACHE_HOME": str(self.run_dir / "helm"),
               "HELM_CONFIG_HOME": str(self.run_dir / "helm"), "HELM_DATA_HOME": str(self.run_dir / "helm")}
        proc = subprocess.run(cmd, input=input, env=env, capture_output=True, text=True, timeout=timeout)
        if check and proc.returncode:
            raise AssertionError(f"{' '.join(cmd[:4])}... failed ({proc.returncode}):\n{proc.stdout[-2000:]}\n{proc.stderr[-4000:]}")
        return proc

    def apply(self, *objs: dict[str, Any], namespace: str | None = None) -> str:
        args = ["apply", "-f", "-"] + (["-n", namespace] if namespace else [])
        return self.kubectl(*args, input=yaml.safe_dump_all(objs)).stdout

    def get(self, *args: str) -> Any:
        return json.loads(self.kubectl("get", *args, "-o", "json").stdout)

    def request(self, method: str, path: str, **kw: Any) -> httpx.Response:
        assert self.http is not None
        return self.http.request(method, path, **kw)

    def create_namespace(self, name: str, labels: dict[str, str] | None = None) -> str:
        self.apply({"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": name, "labels": labels or {}}})
        self.wait(lambda: self.request("GET", f"/api/v1/namespaces/{name}/serviceaccounts/default").status_code == 200,
                  30, f"default ServiceAccount in {name}")
        return name

    def add_gpus(self, gpus: int = 8, cpus: int = 64, memory: str = "512Gi") -> None:
        """Fake nodes become GPU nodes big enough for the examples (16 CPUs + 64Gi on one CPU stage)."""
        res = {"cpu": str(cpus), "memory": memory, "pods": "110", "ephemeral-storage": "100Gi",
               "nvidia.com/gpu": str(gpus)}
        for node in self.get("nodes")["items"]:
            self.kubectl("patch", "node", node["metadata"]["name"], "--subresource=status", "--type=merge",
                         "-p", json.dumps({"status": {"capacity": res, "allocatable": res}}))

    def token_kubeconfig(self, path: Path, token: str | None = None, **user: Any) -> Path:
        """A kubeconfig as kind/EKS/GKE write them: CA embedded (certificate-authority-data), a user entry."""
        path.write_text(yaml.safe_dump({
            "apiVersion": "v1", "kind": "Config", "current-context": "e2e",
            "clusters": [{"name": "e2e", "cluster": {"server": self.server, "certificate-authority-data": self.ca_data}}],
            "users": [{"name": "e2e", "user": {"token": token} if token else user}],
            "contexts": [{"name": "e2e", "context": {"cluster": "e2e", "user": "e2e"}}]}))
        return path

    @staticmethod
    def wait(predicate, timeout: float, what: str, interval: float = 0.5) -> float:
        """Seconds until predicate() is truthy; AssertionError naming `what` after timeout."""
        t0 = time.monotonic()
        while True:
            if predicate():
                return time.monotonic() - t0
            if time.monotonic() - t0 > timeout:
                raise AssertionError(f"timed out after {timeout:.0f} s waiting for {what}")
            time.sleep(interval)


def start(run_dir: Path | None = None, **env: str) -> Cluster:
    cluster = Cluster(run_dir or Path(tempfile.mkdtemp(prefix="kube-")), **env)
    try:
        cluster.up()
    except Exception:
        logs = cluster.run_dir / "run" / "logs"
        for log in sorted(logs.glob("*.log")) if logs.exists() else []:
            print(f"--- {log.name}\n{log.read_text()[-2000:]}")
        cluster.down()
        raise
    return cluster
