"""The Pod Security Standards' `baseline` and `restricted` checks, applied to a pod spec.

Follows https://kubernetes.io/docs/concepts/security/pod-security-standards/ (the controls the
PodSecurity admission plugin enforces). Returns violations; empty means the level admits the pod.
"""
from __future__ import annotations

from typing import Any

BASELINE_CAPS = {"AUDIT_WRITE", "CHOWN", "DAC_OVERRIDE", "FOWNER", "FSETID", "KILL", "MKNOD", "NET_BIND_SERVICE",
                 "SETFCAP", "SETGID", "SETPCAP", "SETUID", "SYS_CHROOT"}
SAFE_SYSCTLS = {"kernel.shm_rmid_forced", "net.ipv4.ip_local_port_range", "net.ipv4.ip_unprivileged_port_start",
                "net.ipv4.tcp_syncookies", "net.ipv4.ping_group_range", "net.ipv4.ip_local_reserved_ports",
                "net.ipv4.tcp_keepalive_time", "net.ipv4.tcp_fin_timeout", "net.ipv4.tcp_keepalive_intvl",
                "net.ipv4.tcp_keepalive_probes"}
RESTRICTED_VOLUMES = {"configMap", "csi", "downwardAPI", "emptyDir", "ephemeral", "persistentVolumeClaim",
                      "projected", "secret"}


def _containers(spec: dict[str, Any]) -> list[dict[str, Any]]:
    return spec.get("initContainers", []) + spec.get("containers", []) + spec.get("ephemeralContainers", [])


def baseline(spec: dict[str, Any]) -> list[str]:
    v = []
    for key in ("hostNetwork", "hostPID", "hostIPC"):
        if spec.get(key):
            v.append(f"{key}=true")
    for vol in spec.get("volumes", []):
        if "hostPath" in vol:
            v.append(f"hostPath volume {vol['name']}")
    pod_sc = spec.get("securityContext", {})
    if pod_sc.get("seccompProfile", {}).get("type") == "Unconfined":
        v.append("pod seccompProfile Unconfined")
    for s in pod_sc.get("sysctls", []):
        if s["name"] not in SAFE_SYSCTLS:
            v.append(f"unsafe sysctl {s['name']}")
    for c in _containers(spec):
        sc = c.get("securityContext", {})
        if sc.get("privileged"):
            v.append(f"{c['name']}: privileged")
        extra = set(sc.get("capabilities", {}).get("add", [])) - BASELINE_CAPS
        if extra:
            v.append(f"{c['name']}: capabilities {sorted(extra)}")
        if any(p.get("hostPort") for p in c.get("ports", [])):
            v.append(f"{c['name']}: hostPort")
        if sc.get("procMount", "Default") != "Default":
            v.append(f"{c['name']}: procMount")
        if sc.get("seccompProfile", {}).get("type") == "Unconfined":
            v.append(f"{c['name']}: seccompProfile Unconfined")
        if sc.get("appArmorProfile", {}).get("type") == "Unconfined":
            v.append(f"{c['name']}: appArmor Unconfined")
    return v


def restricted(spec: dict[str, Any]) -> list[str]:
    v = baseline(spec)
    for vol in spec.get("volumes", []):
        kinds = set(vol) - {"name"}
        if not kinds <= RESTRICTED_VOLUMES:
            v.append(f"volume {vol['name']} of type {sorted(kinds)}")
    pod_sc = spec.get("securityContext", {})
    for c in _containers(spec):
        sc = c.get("securityContext", {})
        if sc.get("allowPrivilegeEscalation") is not False:
            v.append(f"{c['name']}: allowPrivilegeEscalation != false")
        if not sc.get("runAsNonRoot", pod_sc.get("runAsNonRoot")):
            v.append(f"{c['name']}: runAsNonRoot != true")
        if sc.get("runAsUser", pod_sc.get("runAsUser")) == 0:
            v.append(f"{c['name']}: runAsUser 0")
        seccomp = sc.get("seccompProfile", pod_sc.get("seccompProfile", {})).get("type")
        if seccomp not in ("RuntimeDefault", "Localhost"):
            v.append(f"{c['name']}: seccompProfile {seccomp}")
        caps = sc.get("capabilities", {})
        if "ALL" not in caps.get("drop", []):
            v.append(f"{c['name']}: capabilities not dropping ALL")
        if set(caps.get("add", [])) - {"NET_BIND_SERVICE"}:
            v.append(f"{c['name']}: adds capabilities")
    return v
