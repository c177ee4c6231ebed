"""Offline stand-in for the apiserver's validation of a HybridInference.

Same order as the apiserver: apply schema defaults, check the OpenAPI schema (with kubectl's
strict field validation: unknown fields are errors), then evaluate every x-kubernetes-validations
CEL rule from crds/hybridinferences.yaml at every place it applies (cel-python).
"""
from __future__ import annotations

import copy
from collections.abc import Iterator
from typing import Any

import celpy
import jsonschema
import yaml
from hi_fixtures import CRD_PATH


def crd_schema() -> dict[str, Any]:
    crd = yaml.safe_load(CRD_PATH.read_text())
    return crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"]


def apply_defaults(schema: dict[str, Any], value: Any) -> Any:
    """Structural-schema defaulting: fill absent properties that declare `default`, recursively."""
    if isinstance(value, dict) and "properties" in schema:
        for key, sub in schema["properties"].items():
            if key not in value and "default" in sub:
                value[key] = copy.deepcopy(sub["default"])
            if key in value:
                value[key] = apply_defaults(sub, value[key])
    elif isinstance(value, list) and "items" in schema:
        return [apply_defaults(schema["items"], v) for v in value]
    return value


def _strict(schema: Any) -> Any:
    """jsonschema view of the CRD schema: unknown fields rejected, as `kubectl apply` does by default."""
    if isinstance(schema, list):
        return [_strict(s) for s in schema]
    if not isinstance(schema, dict):
        return schema
    out = {k: _strict(v) for k, v in schema.items() if not k.startswith("x-kubernetes-")}
    if "properties" in schema and "additionalProperties" not in schema:
        out["additionalProperties"] = False
    return out


def field_path(parts: Iterator[Any]) -> str:
    out = ""
    for p in parts:
        out += f"[{p}]" if isinstance(p, int) else (f".{p}" if out else p)
    return out


def _rule_sites(schema: dict[str, Any], value: Any, path: str) -> Iterator[tuple[dict[str, Any], Any, str]]:
    """Every (rule, self, path) the apiserver would evaluate for this object."""
    for rule in schema.get("x-kubernetes-validations", []):
        yield rule, value, path
    if isinstance(value, dict):
        for key, sub in schema.get("properties", {}).items():
            if key in value:
                yield from _rule_sites(sub, value[key], f"{path}.{key}" if path else key)
    elif isinstance(value, list) and "items" in schema:
        for i, item in enumerate(value):
            yield from _rule_sites(schema["items"], item, f"{path}[{i}]")


_ENV = celpy.Environment()
_PROGRAMS: dict[str, Any] = {}


def evaluate_rule(rule: str, self_value: Any) -> bool:
    if rule not in _PROGRAMS:
        _PROGRAMS[rule] = _ENV.program(_ENV.compile(rule))
    result = _PROGRAMS[rule].evaluate({"self": celpy.json_to_cel(self_value)})
    if isinstance(result, Exception):  # cel-python returns evaluation errors as values
        raise result
    return bool(result)


def validate(obj: dict[str, Any]) -> list[str]:
    """Error messages (empty list: accepted). Each names the offending field."""
    schema = crd_schema()
    obj = apply_defaults(schema, copy.deepcopy(obj))
    errors = [f"{field_path(e.absolute_path) or '<root>'}: {e.message}"
              for e in jsonschema.Draft7Validator(_strict(schema)).iter_errors(obj)]
    if errors:  # the apiserver stops before CEL when the schema fails
        return errors
    for rule, value, path in _rule_sites(schema, obj, ""):
        if not evaluate_rule(rule["rule"], value):
            errors.append(rule["message"])
    return errors


def all_rules() -> list[str]:
    out: list[str] = []

    def walk(schema: Any) -> None:
        if isinstance(schema, dict):
            out.extend(r["rule"] for r in schema.get("x-kubernetes-validations", []))
            for v in schema.values():
                walk(v)
        elif isinstance(schema, list):
            for v in schema:
                walk(v)
    walk(crd_schema())
    return out
