"""deploy/kuberay/rayservice.yaml against schemas, offline: every Kubernetes object (and the pod
templates inside the RayService, which are core PodTemplateSpecs) against Kubernetes' own schemas
in strict mode (``kubernetes-validate``, which ships them: no network), and the RayService itself
against deploy/kuberay/rayservice.schema.yaml, a strict schema of the subset the manifest uses,
written here from KubeRay v1.5.1's CRD. Unknown fields fail: the API server would drop them
silently (a misspelt ``nodeSelector`` schedules GPU pods anywhere)."""
from __future__ import annotations

import copy
from pathlib import Path

import jsonschema
import kubernetes_validate
import pytest
import yaml

REPO = Path(__file__).resolve().parents[1]
MANIFEST = REPO / "deploy" / "kuberay" / "rayservice.yaml"
RAYSERVICE_SCHEMA = REPO / "deploy" / "kuberay" / "rayservice.schema.yaml"
# The Kubernetes minor whose schemas the objects are checked against (kubernetes-validate ships
# 1.25 onwards); every field the manifest uses exists there.
K8S_VERSION = "1.30"


def manifest() -> list[dict]:
    return [doc for doc in yaml.safe_load_all(MANIFEST.read_text()) if doc]


def _k8s_errors(obj: dict, what: str) -> list[str]:
    try:
        kubernetes_validate.validate(obj, K8S_VERSION, strict=True)
    except kubernetes_validate.ValidationError as e:
        return [f"{what}: {'.'.join(map(str, e.path))}: {e.message}"]
    except kubernetes_validate.SchemaNotFoundError as e:
        return [f"{what}: {e.message}"]  # a kind that is neither core Kubernetes nor the RayService
    return []


def _rayservice_errors(doc: dict) -> list[str]:
    schema = yaml.safe_load(RAYSERVICE_SCHEMA.read_text())
    validator = jsonschema.Draft202012Validator(schema)
    errors = [f"RayService {'.'.join(map(str, e.path))}: {e.message}" for e in validator.iter_errors(doc)]
    cluster = doc.get("spec", {}).get("rayClusterConfig", {})
    groups = [("headGroupSpec", cluster.get("headGroupSpec", {}))]
    groups += [(f"workerGroupSpecs[{g.get('groupName')}]", g) for g in cluster.get("workerGroupSpecs", [])]
    for name, group in groups:
        # A PodTemplate wraps the template so the core PodTemplateSpec schema checks it, strictly.
        wrapped = {"apiVersion": "v1", "kind": "PodTemplate", "metadata": {"name": "check"},
                   "template": group.get("template", {})}
        errors += _k8s_errors(wrapped, f"RayService {name}.template")
    return errors


def manifest_errors(docs: list[dict]) -> list[str]:
    errors = []
    for doc in docs:
        if doc.get("kind") == "RayService":
            errors += _rayservice_errors(doc)
        else:
            errors += _k8s_errors(doc, f"{doc.get('kind')} {doc.get('metadata', {}).get('name')}")
    return errors


def _rayservice(docs: list[dict]) -> dict:
    return next(d for d in docs if d["kind"] == "RayService")


def _cluster(docs: list[dict]) -> dict:
    return _rayservice(docs)["spec"]["rayClusterConfig"]


def _worker_pod(docs: list[dict]) -> dict:
    return _cluster(docs)["workerGroupSpecs"][0]["template"]["spec"]


def _rename(mapping: dict, old: str, new: str) -> None:
    mapping[new] = mapping.pop(old)


def _misspell_auth_mode(docs):
    _rename(_cluster(docs)["authOptions"], "mode", "mdoe")


def _misspell_node_selector(docs):
    _rename(_worker_pod(docs), "nodeSelector", "nodeSelectr")


def _misspell_tolerations(docs):
    _rename(_worker_pod(docs), "tolerations", "toleratoins")


def _misspell_upgrade_type(docs):
    _rayservice(docs)["spec"]["upgradeStrategy"]["type"] = "NewClusterr"


def _misspell_storage_class(docs):
    claim = next(d for d in docs if d["kind"] == "PersistentVolumeClaim")
    _rename(claim["spec"], "storageClassName", "storageClassNmae")


def test_manifest_validates_against_kubernetes_and_rayservice_schemas():
    docs = manifest()
    assert manifest_errors(docs) == []
    kinds = {d["kind"] for d in docs}
    assert "RayService" in kinds and "PersistentVolumeClaim" in kinds


@pytest.mark.parametrize(("mutate", "bad"), [
    (_misspell_auth_mode, "mdoe"),
    (_misspell_node_selector, "nodeSelectr"),
    (_misspell_tolerations, "toleratoins"),
    (_misspell_upgrade_type, "NewClusterr"),
    (_misspell_storage_class, "storageClassNmae"),
])
def test_a_misspelt_field_fails_validation(mutate, bad):
    docs = copy.deepcopy(manifest())
    mutate(docs)
    errors = manifest_errors(docs)
    assert errors and any(bad in e for e in errors), errors


def test_ray_start_params_must_be_strings():
    # KubeRay's CRD types rayStartParams as a map of strings: an unquoted number is refused.
    docs = copy.deepcopy(manifest())
    _cluster(docs)["headGroupSpec"]["rayStartParams"]["num-cpus"] = 8
    assert any("num-cpus" in e for e in manifest_errors(docs))


def test_an_unknown_kind_fails_instead_of_passing_unchecked():
    docs = copy.deepcopy(manifest())
    docs.append({"apiVersion": "example.com/v1", "kind": "Widget", "metadata": {"name": "w"}})
    assert any("Widget" in e for e in manifest_errors(docs))


def _by_kind(docs: list[dict], kind: str) -> dict[str, dict]:
    return {d["metadata"]["name"]: d for d in docs if d["kind"] == kind}


def _matches(selector: dict, labels: dict) -> bool:
    return all(labels.get(k) == v for k, v in selector.get("matchLabels", {}).items())


def _ray_pod_labels(docs: list[dict]) -> list[dict]:
    cluster = _cluster(docs)
    groups = [cluster["headGroupSpec"], *cluster["workerGroupSpecs"]]
    return [g["template"].get("metadata", {}).get("labels", {}) for g in groups]


def test_head_fault_tolerance_keeps_the_gcs_in_a_password_protected_redis():
    docs = manifest()
    cluster = _cluster(docs)
    ft = cluster["gcsFaultToleranceOptions"]
    # The password from a Secret, never a literal in the manifest.
    assert "value" not in ft["redisPassword"]
    secret_ref = ft["redisPassword"]["valueFrom"]["secretKeyRef"]
    # KubeRay refuses a cluster that also sets these itself (its validation.go).
    head = cluster["headGroupSpec"]
    assert not {"redis-password", "redis-username"} & set(head["rayStartParams"])
    env = {e["name"] for e in head["template"]["spec"]["containers"][0].get("env", [])}
    assert not {"REDIS_PASSWORD", "RAY_REDIS_ADDRESS", "REDIS_USERNAME"} & env

    # The address is the manifest's Redis Service, which selects a Redis that requires that password
    # and keeps an append-only file on a volume of its own.
    host, port = ft["redisAddress"].rsplit(":", 1)
    service = _by_kind(docs, "Service")[host]
    assert any(p["port"] == int(port) for p in service["spec"]["ports"])
    (redis,) = [d for d in _by_kind(docs, "Deployment").values()
                if _matches({"matchLabels": service["spec"]["selector"]}, d["spec"]["template"]["metadata"]["labels"])]
    pod = redis["spec"]["template"]["spec"]
    (container,) = pod["containers"]
    args = container["args"]
    password_env = args[args.index("--requirepass") + 1].removeprefix("$(").removesuffix(")")
    (env_var,) = [e for e in container["env"] if e["name"] == password_env]
    assert env_var["valueFrom"]["secretKeyRef"] == secret_ref
    assert args[args.index("--appendonly") + 1] == "yes"
    data = next(m for m in container["volumeMounts"] if m["mountPath"] == "/data")
    volume = next(v for v in pod["volumes"] if v["name"] == data["name"])
    assert volume["persistentVolumeClaim"]["claimName"] in _by_kind(docs, "PersistentVolumeClaim")
    assert redis["spec"]["replicas"] == 1 and redis["spec"]["strategy"]["type"] == "Recreate"

    # Only the Ray pods reach Redis.
    policies = [p for p in _by_kind(docs, "NetworkPolicy").values()
                if _matches(p["spec"]["podSelector"], redis["spec"]["template"]["metadata"]["labels"])]
    assert policies and all(p["spec"]["policyTypes"] == ["Ingress"] for p in policies)
    for policy in policies:
        for rule in policy["spec"]["ingress"]:
            assert rule["from"] and all("podSelector" in peer and "namespaceSelector" not in peer for peer in rule["from"])
            assert all(any(_matches(peer["podSelector"], labels) for labels in _ray_pod_labels(docs))
                       for peer in rule["from"])


def test_serving_does_not_depend_on_the_head():
    """With the GCS in Redis a head restart is survivable only if no replica and no Service
    endpoint live on the head: it runs none (num-cpus 0) and the Serve Service excludes it."""
    docs = manifest()
    spec = _rayservice(docs)["spec"]
    assert spec["excludeHeadPodFromServeSvc"] is True
    assert spec["rayClusterConfig"]["headGroupSpec"]["rayStartParams"]["num-cpus"] == "0"


def _ray_policies(docs: list[dict]) -> list[dict]:
    """The NetworkPolicies that select every Ray pod (head and each worker group)."""
    labels = _ray_pod_labels(docs)
    return [p for p in _by_kind(docs, "NetworkPolicy").values()
            if all(_matches(p["spec"]["podSelector"], lab) and lab for lab in labels)]


def _check_ray_pod_policy(docs: list[dict]) -> None:
    cluster = _cluster(docs)
    groups = [cluster["headGroupSpec"], *cluster["workerGroupSpecs"]]
    (metrics_port,) = {int(g["rayStartParams"]["metrics-export-port"]) for g in groups}
    policies = _ray_policies(docs)
    assert policies and all("Ingress" in p["spec"]["policyTypes"] for p in policies)
    ray_labels = _ray_pod_labels(docs)
    outside: dict[int, list[dict]] = {}  # port -> peers outside the Ray cluster allowed to it
    for policy in policies:
        for rule in policy["spec"]["ingress"]:
            peers = rule.get("from")
            assert peers, f"{policy['metadata']['name']}: a rule without `from` admits every source"
            foreign = [p for p in peers if "namespaceSelector" in p or "ipBlock" in p
                       or not all(_matches(p["podSelector"], lab) for lab in ray_labels)]
            if not foreign:
                continue  # Ray pod to Ray pod: every port
            assert rule.get("ports"), f"{policy['metadata']['name']}: {foreign} reach every port"
            assert not any("ipBlock" in p for p in foreign)
            for port in rule["ports"]:
                outside.setdefault(int(port["port"]), []).extend(foreign)
    # Serve's HTTP port (ingress controller), metrics (Prometheus), dashboard (the operator): no other.
    assert set(outside) == {8000, metrics_port, 8265}, outside
    monitoring = [{"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "monitoring"}}}]
    assert outside[metrics_port] == monitoring
    (operator,) = outside[8265]
    assert operator["podSelector"] == {"matchLabels": {"app.kubernetes.io/name": "kuberay-operator"}}


def test_ray_pods_metrics_port_is_open_only_to_the_monitoring_namespace():
    _check_ray_pod_policy(manifest())


def test_a_policy_that_opens_the_metrics_port_to_everyone_fails():
    docs = copy.deepcopy(manifest())
    policy = _by_kind(docs, "NetworkPolicy")["fastcosy-ray"]
    policy["spec"]["ingress"].append({"ports": [{"port": 8080, "protocol": "TCP"}]})
    with pytest.raises(AssertionError, match="admits every source"):
        _check_ray_pod_policy(docs)


def test_a_policy_that_opens_the_metrics_port_to_another_namespace_fails():
    docs = copy.deepcopy(manifest())
    policy = _by_kind(docs, "NetworkPolicy")["fastcosy-ray"]
    policy["spec"]["ingress"][1]["ports"].append({"port": 8080, "protocol": "TCP"})  # the ingress controller's rule
    with pytest.raises(AssertionError):
        _check_ray_pod_policy(docs)



def test_every_ray_node_gets_the_project_s_ray_system_config():
    """A Ray pod without it ships voice prompts over 6.4 s through the object store (constants.py)."""
    from deployments.constants import RAY_SYSTEM_CONFIG

    cluster = _cluster(manifest())
    pods = [cluster["headGroupSpec"]["template"]] + [g["template"] for g in cluster["workerGroupSpecs"]]
    for pod in pods:
        (container,) = pod["spec"]["containers"]
        env = {e["name"]: e["value"] for e in container.get("env") or []}
        assert {k: int(env[f"RAY_{k}"]) for k in RAY_SYSTEM_CONFIG} == RAY_SYSTEM_CONFIG


@pytest.mark.parametrize("cluster_file", ["cluster.yaml", "cluster-trt.yaml"])
def test_every_cluster_launcher_node_gets_the_project_s_ray_system_config(cluster_file):
    from deployments.constants import RAY_SYSTEM_CONFIG

    doc = yaml.safe_load((REPO / cluster_file).read_text())
    for key in ("head_start_ray_commands", "worker_start_ray_commands"):
        (start,) = [c for c in doc[key] if "ray start" in c]
        for name, value in RAY_SYSTEM_CONFIG.items():
            assert f"RAY_{name}={value}" in start.split(";")[1]  # exported before `ray start` runs
