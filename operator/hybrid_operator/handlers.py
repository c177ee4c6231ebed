"""Thin kopf wiring. All logic lives in reconcile.py (side effects) and render/ (pure).

Run: kopf run --standalone --all-namespaces -m hybrid_operator.handlers
"""
from __future__ import annotations

import asyncio
import logging
import os
from collections.abc import Mapping
from typing import Any

import kopf

from . import kube, metrics
from .kube import KubeApi
from .reconcile import clean_shared_memory, handle_pod_event, reconcile, refresh_on_pod_loss
from .settings import GROUP, MANAGER, PLURAL, VERSION, Settings

RESOURCE = (GROUP, VERSION, PLURAL)
CONFIG = Settings.from_env()
log = logging.getLogger(__name__)


def plain(obj: Any) -> Any:
    """kopf bodies are read-only mapping views; the builders want plain dicts."""
    if isinstance(obj, Mapping):
        return {k: plain(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [plain(v) for v in obj]
    return obj


def configure(settings: kopf.OperatorSettings) -> None:
    # Keep kopf's bookkeeping in annotations: our status schema has no room for it.
    settings.persistence.progress_storage = kopf.AnnotationsProgressStorage(prefix=GROUP)
    settings.persistence.diffbase_storage = kopf.AnnotationsDiffBaseStorage(
        prefix=GROUP, key="last-handled-configuration")
    settings.scanning.disabled = True  # no CRD/namespace watching: fewer RBAC rights
    settings.posting.level = logging.WARNING
    settings.execution.max_workers = 4


@kopf.on.login()
async def login(**_: Any) -> kopf.ConnectionInfo:
    """kopf's watches use the same credentials as our client (kopf's own loader knows no exec plugins).

    kopf calls this again on a 401, which picks up rotated tokens and re-runs exec plugins."""
    return await kube.connection_info(await kube.load_configuration())


@kopf.on.startup()
async def startup(settings: kopf.OperatorSettings, memo: kopf.Memo, instances: kopf.Index, **_: Any) -> None:
    configure(settings)
    if "api" not in memo:  # tests inject a client pointed at kmock
        memo.api = await KubeApi.connect()
    memo.setdefault("config", CONFIG)
    memo.resync = asyncio.create_task(resync_instances(memo, instances))
    port = int(os.environ.get("HYBRID_METRICS_PORT", "0"))
    if port:
        metrics.serve(port)


@kopf.on.cleanup()
async def cleanup(memo: kopf.Memo, **_: Any) -> None:
    if "resync" in memo:
        memo.resync.cancel()
    await memo.api.close()


@kopf.on.create(*RESOURCE)
@kopf.on.update(*RESOURCE, field="spec")
@kopf.on.resume(*RESOURCE)
async def reconcile_instance(body: kopf.Body, memo: kopf.Memo, logger: Any, **_: Any) -> None:
    # Returning nothing: kopf would store a return value in .status, which our schema prunes.
    try:
        result = await reconcile(memo.api, plain(body), memo.config)
        logger.info("reconciled: phase %s, children %s", result["phase"], result["children"])
    except Exception:
        metrics.ERRORS.labels(handler="reconcile").inc()
        raise


@kopf.index(*RESOURCE)
def instances(body: kopf.Body, namespace: str, name: str, **_: Any) -> dict[tuple[str, str], dict[str, Any]]:
    """The live instances, kept current by kopf's watch (an index puts no finalizer on them)."""
    return {(namespace, name): plain(body)}


async def resync_instances(memo: kopf.Memo, index: kopf.Index) -> None:
    """Every status interval: recreate deleted or drifted children and refresh status from the pods.

    One loop instead of a kopf.timer: timers put a finalizer on every instance, so with the operator
    uninstalled or down, deleting an instance (or its namespace) would hang."""
    loop = asyncio.get_running_loop()
    started = loop.time()
    while True:
        # one pass per interval, its start to the next start: a slow pass does not stretch the interval
        await asyncio.sleep(max(0.0, started + memo.config.status_interval_s - loop.time()))
        started = loop.time()
        for key in list(index):
            for body in list(index.get(key, [])):
                if body["metadata"].get("deletionTimestamp"):
                    continue
                try:
                    await reconcile(memo.api, body, memo.config)
                except Exception as exc:  # noqa: BLE001  one instance's failure must not stop the others
                    metrics.ERRORS.labels(handler="resync").inc()
                    log.warning("resync of %s/%s failed: %s", *key, exc)


@kopf.on.event(*RESOURCE)  # the watch's DELETED event: no finalizer; owner references clean up the children
async def forget_instance(event: kopf.RawEvent, memo: kopf.Memo, logger: Any, **_: Any) -> None:
    if event.get("type") != "DELETED":
        return
    body = plain(event["object"])
    metrics.set_phase(body["metadata"]["namespace"], body["metadata"]["name"], None)
    if nodes := await clean_shared_memory(memo.api, body, memo.config):
        logger.info("shared-memory cleanup on nodes %s", ", ".join(nodes))


@kopf.on.event("v1", "pods", labels={"app.kubernetes.io/managed-by": MANAGER})
async def pod_changed(event: kopf.RawEvent, memo: kopf.Memo, instances: kopf.Index | None = None, **_: Any) -> None:
    pod = plain(event["object"])
    try:
        await handle_pod_event(memo.api, event.get("type"), pod)
        await refresh_on_pod_loss(memo.api, event.get("type"), pod, instances or {}, memo.config)
    except Exception:
        metrics.ERRORS.labels(handler="group-restart").inc()
        raise
