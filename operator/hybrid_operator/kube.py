"""Kubernetes access for the operator: kubernetes_asyncio's config and transport, our retry policy.

Why kubernetes_asyncio: it is the asyncio port of the official Python client, so it loads every
kubeconfig the official client loads (CA and client certificates embedded or as files, tokens
and token files, exec credential plugins as EKS and GKE write them, several files in KUBECONFIG)
and the in-cluster service account with token rotation; it runs on aiohttp like kopf, and it is
maintained release by release with Kubernetes. lightkube and kr8s load the same forms, but carry
their own model layers we would not use: the operator's children are plain dicts, so this module
keeps a small path-based facade (get, list, create, merge-patch, delete) over its ApiClient.
Transient failures (409 on writes, 429, 5xx, connection errors) are retried with backoff; a 401
reloads the credentials once (rotated token files, expired exec tokens) and retries.
"""
from __future__ import annotations

import asyncio
import json as json_lib
import logging
import os
from collections.abc import Awaitable, Callable
from typing import Any

import aiohttp
import kopf
from kubernetes_asyncio import client as k8s
from kubernetes_asyncio import config as k8s_config

log = logging.getLogger(__name__)

PLURALS = {"ConfigMap": "configmaps", "Service": "services", "StatefulSet": "statefulsets", "Pod": "pods",
           "NetworkPolicy": "networkpolicies", "Event": "events", "HybridInference": "hybridinferences",
           "Job": "jobs"}
RETRYABLE = {409, 429, 500, 502, 503, 504}


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


def in_cluster() -> bool:
    return bool(os.environ.get("KUBERNETES_SERVICE_HOST")) and os.path.isfile(
        k8s_config.incluster_config.SERVICE_TOKEN_FILENAME)


async def load_configuration(kubeconfig: str | None = None, context: str | None = None) -> k8s.Configuration:
    """The service account inside a pod, else the kubeconfig ($KUBECONFIG or ~/.kube/config)."""
    cfg = k8s.Configuration()
    if kubeconfig is None and in_cluster():
        k8s_config.load_incluster_config(client_configuration=cfg)  # re-reads the rotated token every minute
    else:
        await k8s_config.load_kube_config(config_file=kubeconfig, context=context, client_configuration=cfg,
                                          persist_config=False)
    return cfg


async def bearer_token(cfg: k8s.Configuration) -> str | None:
    """The token the configuration sends now (runs the refresh hooks: in-cluster file, exec plugin)."""
    value = await cfg.get_api_key_with_prefix("BearerToken")
    return value.split(" ", 1)[1] if value and value.startswith("Bearer ") else value


async def connection_info(cfg: k8s.Configuration) -> kopf.ConnectionInfo:
    """The same credentials as a kopf ConnectionInfo, for kopf's own watches."""
    return kopf.ConnectionInfo(
        server=cfg.host, ca_path=cfg.ssl_ca_cert, insecure=not cfg.verify_ssl,
        certificate_path=cfg.cert_file, private_key_path=cfg.key_file,
        scheme="Bearer", token=await bearer_token(cfg))


class KubeApi:
    def __init__(self, cfg: k8s.Configuration, *, reload: Callable[[], Awaitable[k8s.Configuration]] | None = None,
                 retries: int = 5, backoff_s: float = 0.2):
        self._client = k8s.ApiClient(cfg)
        self._reload = reload
        self.retries, self.backoff_s = retries, backoff_s

    @classmethod
    async def connect(cls, kubeconfig: str | None = None, context: str | None = None, **kw: Any) -> KubeApi:
        async def reload() -> k8s.Configuration:
            return await load_configuration(kubeconfig, context)
        return cls(await reload(), reload=reload, **kw)

    @classmethod
    def for_server(cls, server: str, **kw: Any) -> KubeApi:
        """A plain server URL (tests against kmock)."""
        return cls(k8s.Configuration(host=server.rstrip("/")), **kw)

    async def close(self) -> None:
        await self._client.close()

    async def _send(self, method: str, path: str, json: Any, params: dict[str, str] | None,
                    content_type: str) -> tuple[int, Any]:
        resp = await self._client.call_api(
            path, method, query_params=list((params or {}).items()), body=json,
            header_params={"Content-Type": content_type, "Accept": "application/json"},
            auth_settings=["BearerToken"], _preload_content=False, _request_timeout=30)
        async with resp:
            raw = await resp.read()
        try:
            body = json_lib.loads(raw) if raw else None
        except ValueError:
            body = raw.decode(errors="replace")
        return resp.status, body

    async def request(self, method: str, path: str, *, json: Any = None, params: dict[str, str] | None = None,
                      content_type: str = "application/json") -> Any:
        reloaded, attempt = False, 0
        while True:
            try:
                status, body = await self._send(method, path, json, params, content_type)
                if status < 400:
                    return body
                if status == 401 and self._reload and not reloaded:
                    reloaded = True  # a rotated token file or an expired exec credential: not an attempt
                    log.info("HTTP 401 on %s %s: reloading credentials", method, path)
                    await self._swap_configuration(await self._reload())
                    continue
                if method == "POST" and status == 409:
                    raise AlreadyExists(status, body)
                if status not in RETRYABLE or attempt == self.retries:
                    raise ApiError(status, body)
                log.info("retrying %s %s after HTTP %s", method, path, status)
            except (TimeoutError, aiohttp.ClientConnectionError) as exc:
                if attempt == self.retries:
                    raise
                log.info("retrying %s %s after %r", method, path, exc)
            await asyncio.sleep(self.backoff_s * 2 ** attempt)
            attempt += 1

    async def _swap_configuration(self, cfg: k8s.Configuration) -> None:
        old, self._client = self._client, k8s.ApiClient(cfg)
        await old.close()

    async def get(self, path: str) -> dict[str, Any] | None:
        try:
            return await self.request("GET", path)
        except ApiError as exc:
            if exc.status == 404:
                return None
            raise

    async def list(self, path: str, selector: dict[str, str] | None = None,
                   fields: dict[str, str] | None = None) -> list[dict[str, Any]]:
        params = {}
        if selector:
            params["labelSelector"] = ",".join(f"{k}={v}" for k, v in selector.items())
        if fields:
            params["fieldSelector"] = ",".join(f"{k}={v}" for k, v in fields.items())
        body = await self.request("GET", path, params=params)
        # Filter again locally: cheap, and keeps the logic right on servers that ignore the selector.
        return [item for item in (body or {}).get("items", []) if labels_match(item, selector or {})]

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
