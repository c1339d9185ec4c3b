"""The operator's pod template, merged into the pods stalwart builds (pure).

A job's `kubernetes.pod_template` is a PodTemplateSpec, as Kubeflow's PyTorchJob and JobSet take
one: `metadata` (labels, annotations) and any `spec` field of a PodSpec (tolerations, volumes,
resources of the `agent` container, nodeSelector, affinity, imagePullSecrets, priorityClassName,
securityContext, more containers...). It is merged into every agent pod, the ones
`stalwart k8s manifests` renders and the ones the controller creates after an eviction, so
nothing an operator shapes is lost at the first failover (a patch of the rendered YAML would be).

The merge (`merge`) follows strategic merge patch's rules for the cases pods have: mappings merge
key by key (the template's scalar wins); lists of named items (containers, volumes, env,
volumeMounts, ports, imagePullSecrets) merge item by item by name; other lists (tolerations,
required affinity terms) are appended to. The agent container's `command` and `args` are
stalwart's and cannot be replaced.
"""
from __future__ import annotations

import copy
from typing import Any

AGENT_CONTAINER = "agent"
OWN_FIELDS = ("command", "args")        # of the agent container: what makes it stalwart's agent


def _named(items: list[Any]) -> bool:
    return bool(items) and all(isinstance(i, dict) and isinstance(i.get("name"), str) for i in items)


def merge(ours: Any, theirs: Any) -> Any:
    """`theirs` merged into `ours` (neither is changed): see the module's doc."""
    if isinstance(ours, dict) and isinstance(theirs, dict):
        out = dict(ours)
        for k, v in theirs.items():
            out[k] = merge(ours[k], v) if k in ours else copy.deepcopy(v)
        return out
    if isinstance(ours, list) and isinstance(theirs, list):
        if _named(ours) and _named(theirs):
            out_list = list(ours)
            index = {item["name"]: i for i, item in enumerate(out_list)}
            for item in theirs:
                if item["name"] in index:
                    out_list[index[item["name"]]] = merge(out_list[index[item["name"]]], item)
                else:
                    out_list.append(copy.deepcopy(item))
            return out_list
        return list(ours) + [copy.deepcopy(i) for i in theirs if i not in ours]
    return copy.deepcopy(theirs)


def pod_spec_fields() -> set[str] | None:
    """The PodSpec field names (camelCase) the official client knows, None without it."""
    try:
        from kubernetes.client import V1PodSpec
    except ImportError:
        return None
    return set(V1PodSpec.attribute_map.values())


def check(template: Any, where: str, own: str = AGENT_CONTAINER) -> dict[str, Any]:
    """A pod template as given in a job YAML, checked: a mapping of `metadata` and `spec`, the
    spec's fields PodSpec's, stalwart's container (`own`) keeps its command. Raises ValueError."""
    if template is None:
        return {}
    if not isinstance(template, dict):
        raise ValueError(f"{where} must be a mapping (a PodTemplateSpec: metadata, spec)")
    unknown = sorted(set(template) - {"metadata", "spec"})
    if unknown:
        raise ValueError(f"{where}: unknown key(s) {', '.join(unknown)} (a PodTemplateSpec has metadata and spec)")
    for part in ("metadata", "spec"):
        if not isinstance(template.get(part, {}), dict):
            raise ValueError(f"{where}.{part} must be a mapping")
    meta = template.get("metadata", {})
    bad_meta = sorted(set(meta) - {"labels", "annotations"})
    if bad_meta:
        raise ValueError(f"{where}.metadata: only labels and annotations can be set (got {', '.join(bad_meta)})")
    spec = template.get("spec", {})
    fields = pod_spec_fields()
    if fields is not None:
        bad = sorted(set(spec) - fields)
        if bad:
            raise ValueError(f"{where}.spec: {', '.join(bad)} not a PodSpec field (PodSpec fields are "
                             "camelCase: nodeSelector, priorityClassName, ...)")
    containers = spec.get("containers", [])
    if not isinstance(containers, list) or not all(isinstance(c, dict) and c.get("name") for c in containers):
        raise ValueError(f"{where}.spec.containers: a list of containers, each with a name "
                         f"({own!r} to shape stalwart's)")
    for c in containers:
        if c["name"] == own:
            fixed = sorted(set(c) & set(OWN_FIELDS))
            if fixed:
                raise ValueError(f"{where}: the {own} container's {', '.join(fixed)} are stalwart's")
        elif "image" not in c:
            raise ValueError(f"{where}.spec.containers: {c['name']!r} needs an image (only {own!r} "
                             "takes stalwart's)")
    return template


def apply(pod: dict[str, Any], template: dict[str, Any]) -> dict[str, Any]:
    """`pod` (a Pod, or a Deployment's pod template) with the operator's template merged in;
    stalwart's own labels stay (they select the pods)."""
    if not template:
        return pod
    out = dict(pod)
    meta = dict(pod.get("metadata") or {})
    theirs = template.get("metadata") or {}
    if theirs.get("labels"):
        meta["labels"] = {**theirs["labels"], **(meta.get("labels") or {})}
    if theirs.get("annotations"):
        meta["annotations"] = {**(meta.get("annotations") or {}), **theirs["annotations"]}
    out["metadata"] = meta
    out["spec"] = merge(pod.get("spec") or {}, template.get("spec") or {})
    return out
