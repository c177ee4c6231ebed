"""The CRD is the reference: every property has a description, and `kubectl explain` on the real API server
(tests/kube_cluster.py) shows them, as LeaderWorkerSet's CRD documents every field. And what a user copies
first, the examples and the user guide's walkthrough, keeps its cache across pods (spec.cache)."""
from __future__ import annotations

import re
from typing import Any

import pytest
import yaml
from hi_fixtures import ROOT
from hybrid_operator.render import render_children

# The API server forbids anything but name and generateName under the root's metadata (it documents ObjectMeta).
EXEMPT = {"metadata"}


def schema_of(crd: dict[str, Any]) -> dict[str, Any]:
    (version,) = crd["spec"]["versions"]
    return version["schema"]["openAPIV3Schema"]


def properties(node: dict[str, Any], path: str = "") -> list[tuple[str, dict[str, Any]]]:
    """(path, schema) of every property under `node`, nested ones included: `a.b`, `a[].b` in arrays, `a{}.b` in
    maps' values."""
    out = []
    for name, sub in (node.get("properties") or {}).items():
        where = f"{path}.{name}" if path else name
        out.append((where, sub))
        out += properties(sub, where)
    if isinstance(node.get("items"), dict):
        out += properties(node["items"], f"{path}[]")
    if isinstance(node.get("additionalProperties"), dict):
        out += properties(node["additionalProperties"], f"{path}{{}}")
    return out


def undescribed(node: dict[str, Any]) -> list[str]:
    return [path for path, sub in properties(node)
            if path not in EXEMPT and not str(sub.get("description") or "").strip()]


def test_the_walk_names_every_property_without_a_description():
    """What the check below relies on: nested, array and map-valued properties are all reached."""
    schema = {"type": "object", "properties": {
        "metadata": {"type": "object"},
        "a": {"type": "string"},
        "b": {"type": "object", "description": "b", "properties": {"c": {"type": "string", "description": "  "}}},
        "d": {"type": "array", "description": "d", "items": {"type": "object", "properties": {"e": {"type": "integer"}}}},
        "f": {"type": "object", "description": "f", "additionalProperties": {
            "type": "object", "properties": {"g": {"type": "string"}, "h": {"type": "string", "description": "h"}}}},
    }}
    assert undescribed(schema) == ["a", "b.c", "d[].e", "f{}.g"]


def test_every_property_of_the_crd_has_a_description(crd):
    schema = schema_of(crd)
    assert str(schema.get("description") or "").strip(), "the schema's root"
    assert len(properties(schema)) >= 100  # spec and status, nested ones included
    assert undescribed(schema) == []


def words(text: str) -> str:
    return " ".join(text.split())


@pytest.fixture(scope="module")
def explain(kube, chart):
    """`kubectl explain FIELD` on the real server, once the chart's CRD is in its published OpenAPI."""
    kube.wait(lambda: kube.kubectl("explain", "hybridinference.spec.cache", check=False).returncode == 0,
              60, "kubectl explain to know hybridinference")

    def run(*args: str) -> str:
        return kube.kubectl("explain", *args).stdout
    return run


def objects(schema: dict[str, Any], path: str = "") -> list[tuple[str, dict[str, Any]]]:
    """(kubectl explain path, schema) of every object with properties, arrays' items under the array's name."""
    node = schema.get("items", schema) if schema.get("type") == "array" else schema
    if not node.get("properties"):
        return []
    out = [(path, node)]
    for name, sub in node["properties"].items():
        out += objects(sub, f"{path}.{name}" if path else name)
    return out


def node_of(schema: dict[str, Any], path: str) -> dict[str, Any]:
    """The property at a `kubectl explain` path (arrays are passed through to their items' properties)."""
    node = schema
    for name in path.split("."):
        node = node.get("items", node)["properties"][name]
    return node


def test_kubectl_explain_shows_every_description(crd, explain):
    """For each object of the schema (spec, spec.stages, spec.serving.apiKeySecretRef, status.conditions, ...) the
    server's `kubectl explain` prints its description and each of its fields' descriptions, as written in the CRD."""
    schema = schema_of(crd)
    nodes = objects(schema)
    assert len(nodes) >= 18
    missing = []
    for path, node in nodes:
        shown = words(explain(f"hybridinference.{path}" if path else "hybridinference"))
        described = [(path or "(root)", node_of(schema, path) if path else schema)]
        described += [(f"{path}.{name}" if path else name, sub) for name, sub in node["properties"].items()
                      if path or name not in EXEMPT]
        missing += [where for where, sub in described
                    if not sub.get("description") or words(sub["description"]) not in shown]
    assert missing == []


def test_kubectl_explain_spec_recursive_lists_every_spec_field(crd, explain):
    """`kubectl explain hybridinference.spec --recursive`: every spec property, nested ones included, at its depth."""
    shown = [line.split("\t")[0] for line in explain("hybridinference.spec", "--recursive").split("FIELDS:")[1]
             .splitlines() if "\t" in line]
    expected = []
    for path, _ in properties(node_of(schema_of(crd), "spec")):
        if "{}" in path:
            continue  # a map's values are not fields
        parts = path.replace("[]", "").split(".")
        expected.append("  " * len(parts) + parts[-1])
    assert sorted(shown) == sorted(expected)
    assert len(expected) >= 70


@pytest.mark.parametrize("field,said", [
    ("spec.cache", ["a group restart took 44-47 s with spec.cache (hostPath or claim) against 74 s without",
                    "tests/e2e/test_real_node.py"]),
    ("spec.model.dtype", ["vLLM --dtype", "default bfloat16"]),
    ("spec.serving.port", ["vLLM --port", "default 8000", "status.endpoint"]),
    ("spec.stages.device", ["vLLM's CUDA backend", "vLLM's CPU backend", "under offload they get no pods"]),
    ("spec.stages.gpuMemory", ["Without it every stage needs layers"]),
    ("status.failures.exitCode", ["75: it stopped because another stage went"]),
])
def test_kubectl_explain_answers_what_a_field_does(explain, field, said):
    shown = words(explain(f"hybridinference.{field}"))
    assert [s for s in said if s not in shown] == [], shown


def test_the_walkthrough_and_every_example_keep_the_cache_across_pods():
    """A restarted group loads what the last one compiled (the real node: 44-47 s against 74 s without
    spec.cache): every instance in examples/ renders /cache on a volume that outlives its pods, one its
    namespace admits (hostPath only where Pod Security is privileged; a claim the same file creates)."""
    guide = (ROOT / "docs" / "user-guide.md").read_text()
    walkthrough = guide.split("## 4. Walkthrough")[1].split("\n## 5.")[0]
    assert re.findall(r"kubectl apply -f (examples/\S+)", walkthrough) == ["examples/hybrid.yaml"]
    instances = 0
    for path in sorted((ROOT / "examples").glob("*.yaml")):
        docs = [d for d in yaml.safe_load_all(path.read_text()) if d]
        for hi in (d for d in docs if d["kind"] == "HybridInference"):
            instances += 1
            ns, cache = hi["metadata"]["namespace"], hi["spec"].get("cache", {})
            body = {**hi, "metadata": {**hi["metadata"], "uid": "0123456789abcdef", "generation": 1}}
            for sts in (c for c in render_children(body) if c["kind"] == "StatefulSet"):
                (volume,) = [v for v in sts["spec"]["template"]["spec"]["volumes"] if v["name"] == "cache"]
                assert "emptyDir" not in volume, (path.name, sts["metadata"]["name"])
            if "claimName" in cache:
                assert any(d["kind"] == "PersistentVolumeClaim" and d["metadata"] == {"name": cache["claimName"],
                                                                                      "namespace": ns}
                           for d in docs), path.name
            else:
                (namespace,) = [d for d in docs if d["kind"] == "Namespace" and d["metadata"]["name"] == ns]
                assert namespace["metadata"]["labels"]["pod-security.kubernetes.io/enforce"] == "privileged"
    assert instances >= 2
