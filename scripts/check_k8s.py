"""Validates every Kubernetes manifest in deploy/k8s as an API server would
accept it (`kubectl apply`, strict field validation): the built-in kinds
against the Kubernetes API's JSON schemas (kubernetes-validate), the JobSet
against the vendored JobSet CRD schema. Then checks the checker: mutated
manifests (a misspelt field, a wrong type, a value outside an enum) must
fail. Run by scripts/check-k8s."""

import copy
import json
import sys
from pathlib import Path

import jsonschema
import kubernetes_validate
import yaml

REPO = Path(__file__).resolve().parent.parent
K8S = REPO / "deploy" / "k8s"
KUBERNETES = "1.34"
JOBSET_API = "jobset.x-k8s.io/v1alpha2"


def strict(schema):
    """An OpenAPI v3 CRD schema as JSON Schema that refuses unknown fields,
    as strict field validation does (except where the schema preserves
    them)."""
    if isinstance(schema, dict):
        out = {k: strict(v) for k, v in schema.items()}
        if (
            "properties" in out
            and "additionalProperties" not in out
            and not out.get("x-kubernetes-preserve-unknown-fields")
        ):
            out["additionalProperties"] = False
        return out
    if isinstance(schema, list):
        return [strict(v) for v in schema]
    return schema


JOBSET = jsonschema.Draft4Validator(
    strict(json.loads((K8S / "schemas" / "jobset.x-k8s.io_v1alpha2_jobset.json").read_text()))
)


def errors(doc):
    """The reasons `doc` would be refused (empty: accepted)."""
    if not isinstance(doc, dict) or "apiVersion" not in doc or "kind" not in doc:
        return ["not a Kubernetes object (apiVersion and kind)"]
    name = (doc.get("metadata") or {}).get("name")
    if not name:
        return ["metadata.name is missing"]
    if doc["apiVersion"] == JOBSET_API:
        if doc["kind"] != "JobSet":
            return [f"{doc['kind']}: {JOBSET_API} has only JobSet"]
        return [
            f"{'.'.join(map(str, e.absolute_path)) or '(root)'}: {e.message}"
            for e in sorted(JOBSET.iter_errors(doc), key=lambda e: list(map(str, e.absolute_path)))
        ]
    try:
        kubernetes_validate.validate(doc, KUBERNETES, strict=True)
    except kubernetes_validate.ValidationError as e:
        return [f"{'.'.join(map(str, e.path)) or '(root)'}: {e.message}"]
    except kubernetes_validate.SchemaNotFoundError as e:
        return [f"no schema for {doc['apiVersion']} {doc['kind']} in Kubernetes {KUBERNETES}: {e}"]
    return []


def load(path):
    return [d for d in yaml.safe_load_all(path.read_text()) if d is not None]


def main():
    failed = False
    checked = 0
    for path in sorted(K8S.glob("*.yaml")):
        for doc in load(path):
            checked += 1
            for reason in errors(doc):
                failed = True
                print(f"{path.relative_to(REPO)}: {doc.get('kind')} {doc.get('metadata', {}).get('name')}: {reason}")
    if failed:
        sys.exit(1)

    # The checker must refuse what an API server refuses.
    jobset = next(d for d in load(K8S / "jobset.yaml") if d["kind"] == "JobSet")
    job = next(d for d in load(K8S / "sparrow.yaml") if d["kind"] == "Job")

    def mutated(doc, change):
        doc = copy.deepcopy(doc)
        change(doc)
        return doc

    cases = {
        "a JobSet with a misspelt field (replica)": mutated(
            jobset, lambda d: d["spec"]["replicatedJobs"][0].update({"replica": 1})
        ),
        "a JobSet failure rule with an unknown action": mutated(
            jobset, lambda d: d["spec"]["failurePolicy"]["rules"][0].update({"action": "RestartPod"})
        ),
        "a JobSet whose success policy lacks its operator": mutated(
            jobset, lambda d: d["spec"]["successPolicy"].pop("operator")
        ),
        "a JobSet pod with a misspelt container field": mutated(
            jobset,
            lambda d: d["spec"]["replicatedJobs"][1]["template"]["spec"]["template"]["spec"]["containers"][0].update(
                {"imagePullPolcy": "Always"}
            ),
        ),
        "a JobSet with a string where an integer belongs": mutated(
            jobset, lambda d: d["spec"]["replicatedJobs"][3]["template"]["spec"].update({"completions": "two"})
        ),
        "a Job with a string where an integer belongs": mutated(job, lambda d: d["spec"].update({"backoffLimit": "3"})),
        "a Job with a misspelt field": mutated(job, lambda d: d["spec"].update({"completion": 2})),
    }
    let_through = [what for what, doc in cases.items() if not errors(doc)]
    if let_through:
        print("the manifest check accepted broken manifests:", *let_through, sep="\n  ")
        sys.exit(1)
    print(f"k8s: {checked} objects valid (Kubernetes {KUBERNETES}, JobSet {JOBSET_API}); {len(cases)} mutations refused")


if __name__ == "__main__":
    main()
