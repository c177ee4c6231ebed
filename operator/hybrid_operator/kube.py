"""A small async Kubernetes REST client (aiohttp, already a kopf dependency) with retries.

Only what the operator needs: get, list, create, merge-patch, delete. Transient failures
(409 conflicts on writes, 429, 5xx, connection errors) are retried with backoff.
"""
from __future__ import annotations

import asyncio
import base64
import logging
import ssl
import tempfile
from typing import Any

import aiohttp

log = logging.getLogger(__name__)

PLURALS = {"ConfigMap": "configmaps", "Service": "services", "StatefulSet": "statefulsets", "Pod": "pods",
           "NetworkPolicy": "networkpolicies", "Event": "events", "HybridInference": "hybridinferences"}
RETRYABLE = {409, 429, 500, 502, 503, 504}
SA_TOKEN = "/var/run/secrets/kubernetes.io/serviceaccount/token"


class ApiError(Exception):
    def __init__(self, status: int, body: Any):
        self.status, self.body = status, body
        message = body.get("message") if isinstance(body, dict) else body
        super().__init__(f"HTTP {status}: {message}")


class AlreadyExists(ApiError):
    pass


def path_for(api_version: str, kind: str, namespace: str | None, name: str | None = None,
             subresource: str | None = None) -> str:
    base = f"/api/{api_version}" if "/" not in api_version else f"/apis/{api_version}"
    path = f"{base}/namespaces/{namespace}/{PLURALS[kind]}" if namespace else f"{base}/{PLURALS[kind]}"
    if name:
        path += f"/{name}"
    if subresource:
        path += f"/{subresource}"
    return path


def object_path(obj: dict[str, Any], subresource: str | None = None) -> str:
    meta = obj["metadata"]
    return path_for(obj["apiVersion"], obj["kind"], meta.get("namespace"), meta["name"], subresource)


def labels_match(obj: dict[str, Any], selector: dict[str, str]) -> bool:
    labels = obj.get("metadata", {}).get("labels") or {}
    return all(labels.get(k) == v for k, v in selector.items())


class KubeApi:
    def __init__(self, server: str, *, token: str | None = None, token_path: str | None = None,
                 ssl_context: ssl.SSLContext | bool | None = None, retries: int = 5, backoff_s: float = 0.2):
        self.server = server.rstrip("/")
        self._token, self._token_path = token, token_path
        self._ssl = ssl_context
        self.retries, self.backoff_s = retries, backoff_s
        self._session: aiohttp.ClientSession | None = None

    @classmethod
    def from_connection_info(cls, info: Any) -> KubeApi:
        """From a kopf ConnectionInfo (kopf.login_with_service_account / login_with_kubeconfig)."""
        ctx: ssl.SSLContext | bool | None = None
        if info.insecure:
            ctx = False
        elif info.ca_path or info.ca_data or info.certificate_path or info.certificate_data:
            cadata = info.ca_data.decode() if isinstance(info.ca_data, bytes) else info.ca_data
            ctx = ssl.create_default_context(cafile=info.ca_path, cadata=cadata)
            if info.certificate_path or info.certificate_data:
                ctx.load_cert_chain(*_cert_files(info))
        # In-cluster tokens rotate (bound SA tokens): re-read the file on every request.
        in_cluster = info.server == "https://kubernetes.default.svc" and info.token
        return cls(info.server, token=None if in_cluster else info.token,
                   token_path=SA_TOKEN if in_cluster else None, ssl_context=ctx)

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None

    def _headers(self) -> dict[str, str]:
        token = self._token
        if self._token_path:
            with open(self._token_path, encoding="utf-8") as f:
                token = f.read().strip()
        return {"Authorization": f"Bearer {token}"} if token else {}

    async def request(self, method: str, path: str, *, json: Any = None, params: dict[str, str] | None = None,
                      content_type: str = "application/json") -> Any:
        if self._session is None:
            self._session = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=30))
        for attempt in range(self.retries + 1):
            try:
                async with self._session.request(
                        method, self.server + path, json=json, params=params, ssl=self._ssl,
                        headers={**self._headers(), "Content-Type": content_type}) as resp:
                    body = await resp.json(content_type=None) if resp.content_length != 0 else None
                    if resp.status < 400:
                        return body
                    if method == "POST" and resp.status == 409:
                        raise AlreadyExists(resp.status, body)
                    if resp.status not in RETRYABLE or attempt == self.retries:
                        raise ApiError(resp.status, body)
                    log.info("retrying %s %s after HTTP %s", method, path, resp.status)
            except (TimeoutError, aiohttp.ClientConnectionError) as exc:
                if attempt == self.retries:
                    raise
                log.info("retrying %s %s after %r", method, path, exc)
            await asyncio.sleep(self.backoff_s * 2 ** attempt)
        raise AssertionError("unreachable")

    async def get(self, path: str) -> dict[str, Any] | None:
        try:
            return await self.request("GET", path)
        except ApiError as exc:
            if exc.status == 404:
                return None
            raise

    async def list(self, path: str, selector: dict[str, str]) -> list[dict[str, Any]]:
        params = {"labelSelector": ",".join(f"{k}={v}" for k, v in selector.items())}
        body = await self.request("GET", path, params=params)
        # Filter again locally: cheap, and keeps the logic right on servers that ignore the selector.
        return [item for item in (body or {}).get("items", []) if labels_match(item, selector)]

    async def create(self, path: str, obj: dict[str, Any]) -> dict[str, Any]:
        return await self.request("POST", path, json=obj)

    async def patch(self, path: str, patch: dict[str, Any]) -> dict[str, Any]:
        return await self.request("PATCH", path, json=patch, content_type="application/merge-patch+json")

    async def delete(self, path: str) -> bool:
        """True if deleted now, False if it was already gone."""
        try:
            await self.request("DELETE", path)
            return True
        except ApiError as exc:
            if exc.status == 404:
                return False
            raise


def _cert_files(info: Any) -> tuple[str, str | None]:
    def materialise(path: Any, data: Any) -> str | None:
        if path or not data:
            return path
        raw = data if isinstance(data, bytes) else data.encode()
        if not raw.lstrip().startswith(b"-----"):
            raw = base64.b64decode(raw)
        with tempfile.NamedTemporaryFile(delete=False, suffix=".pem") as f:
            f.write(raw)
        return f.name
    cert = materialise(info.certificate_path, info.certificate_data)
    assert cert is not None
    return cert, materialise(info.private_key_path, info.private_key_data)
