"""Every YAML under cluster/ parses and carries what Ray and Kubernetes need.

The references are the installed tools where they exist: Ray's own cluster-config schema and
defaults (`prepare_config` + `validate_config`), Ray's TPU tables (chips per host, valid
topologies, accelerator types), the installed Ray version. Kubernetes fields are checked
against the manifests themselves: selectors match pod labels, Services point at named
container ports, every Secret referenced is one cluster/README.md tells you to create and none
is committed.
"""

from __future__ import annotations

import copy
import re
from pathlib import Path

import pytest
import yaml

REPO = Path(__file__).resolve().parents[2]
CLUSTER = REPO / "cluster"
LAUNCHER = CLUSTER / "tpu-vm" / "cluster.yaml"
KUBERNETES = CLUSTER / "kubernetes"
NAMESPACE = "tenantq"
# Kubernetes kinds used here and the apiVersion each is served under.
API_VERSIONS = {
    "Namespace": "v1",
    "ConfigMap": "v1",
    "Service": "v1",
    "PersistentVolumeClaim": "v1",
    "PersistentVolume": "v1",
    "StatefulSet": "apps/v1",
    "Deployment": "apps/v1",
    "NetworkPolicy": "networking.k8s.io/v1",
    "RayCluster": "ray.io/v1",
}
# The Secrets the manifests read, with their keys; created by hand (cluster/README.md).
SECRETS = {
    "tenantq-db": {"postgres-password", "mlflow-password", "optuna-password"},
    "tenantq-mlflow": {"admin-password", "flask-secret-key"},
}


def _docs() -> list[dict]:
    docs = []
    for path in sorted(KUBERNETES.glob("*.yaml")):
        docs += [d | {"_file": path.name} for d in yaml.safe_load_all(path.read_text()) if d]
    return docs


def _of_kind(kind: str) -> list[dict]:
    return [d for d in _docs() if d["kind"] == kind]


def _walk(node):
    if isinstance(node, dict):
        yield node
        for value in node.values():
            yield from _walk(value)
    elif isinstance(node, list):
        for value in node:
            yield from _walk(value)


def _pod_templates() -> list[tuple[str, dict, dict]]:
    """(owner, pod labels, pod spec) for every pod template, Ray pods with KubeRay's labels."""
    out = []
    for d in _of_kind("Deployment") + _of_kind("StatefulSet"):
        t = d["spec"]["template"]
        out.append((d["metadata"]["name"], t["metadata"]["labels"], t["spec"]))
    for rc in _of_kind("RayCluster"):
        ray_labels = {"ray.io/cluster": rc["metadata"]["name"]}
        head = rc["spec"]["headGroupSpec"]["template"]
        labels = head["metadata"].get("labels", {}) | ray_labels | {"ray.io/node-type": "head"}
        out.append((f"{rc['metadata']['name']} head", labels, head["spec"]))
        for group in rc["spec"]["workerGroupSpecs"]:
            t = group["template"]
            labels = t["metadata"].get("labels", {}) | ray_labels | {"ray.io/node-type": "worker"}
            out.append((f"{rc['metadata']['name']} {group['groupName']}", labels, t["spec"]))
    return out


def _selects(selector: dict[str, str], labels: dict[str, str]) -> bool:
    return all(labels.get(k) == v for k, v in selector.items())


# --- the Ray cluster launcher config (Cloud TPU VMs) --------------------------------------


def _launcher() -> dict:
    return yaml.safe_load(LAUNCHER.read_text())


def test_launcher_config_passes_rays_own_schema() -> None:
    from ray.autoscaler._private.util import prepare_config, validate_config

    config = _launcher()
    validate_config(prepare_config(copy.deepcopy(config)))  # raises on a schema violation
    broken = copy.deepcopy(config)
    broken["available_node_types"]["tpu_v6e_8"]["node_confg"] = {}
    with pytest.raises(Exception, match="node_confg"):
        validate_config(prepare_config(broken))


def test_launcher_tpu_workers_are_a_v6e_8_host_and_a_four_host_v6e_16_pod() -> None:
    from ray._private.accelerators.tpu import (
        TPUAcceleratorManager,
        get_num_tpu_visible_chips_per_host,
        get_tpu_cores_per_chip,
    )

    config = _launcher()
    assert config["provider"]["type"] == "gcp"
    assert config["provider"]["availability_zone"].startswith(config["provider"]["region"])
    head = config["available_node_types"][config["head_node_type"]]["node_config"]
    # The GCP provider tells Compute VMs from TPU VMs by machineType vs acceleratorType.
    assert "machineType" in head and "acceleratorType" not in head
    tpu_types = {
        name: t
        for name, t in config["available_node_types"].items()
        if name != config["head_node_type"]
    }
    assert tpu_types
    shapes = {}
    for name, node_type in tpu_types.items():
        node = node_type["node_config"]
        accelerator = node["acceleratorType"]
        assert "machineType" not in node
        assert TPUAcceleratorManager.is_valid_tpu_accelerator_type(accelerator)
        assert accelerator.startswith("v6e-") and "tpuv6e" in node["runtimeVersion"]
        # acceleratorType counts TensorCores; v6e has one per chip, so v6e-8 is 8 chips on
        # one host, v6e-16 16 chips on hosts of 4 (Ray's table of visible chips per host).
        chips = int(accelerator.split("-")[1]) // get_tpu_cores_per_chip(accelerator)
        per_host = get_num_tpu_visible_chips_per_host(accelerator)
        shapes[name] = (chips // per_host, per_host)
        # The autoscaler plans with the declared resources: exactly the node's (pod's) chips.
        assert node_type["resources"] == {"TPU": chips}
        assert node_type["max_workers"] <= config["max_workers"]
    assert shapes == {"tpu_v6e_8": (1, 8), "tpu_v6e_16": (4, 4)}


def test_launcher_starts_every_node_with_token_auth_and_a_loopback_dashboard() -> None:
    config = _launcher()
    head = " ".join(config["head_start_ray_commands"])
    workers = " ".join(config["worker_start_ray_commands"])
    for commands in (config["head_start_ray_commands"], config["worker_start_ray_commands"]):
        for command in commands:
            assert "RAY_AUTH_MODE=token" in command, command
    assert "--dashboard-host=127.0.0.1" in head
    gcs_port = re.search(r"--port=(\d+)", head).group(1)
    assert f"--address=$RAY_HEAD_IP:{gcs_port}" in workers
    # The token travels from the launching machine's home, never from the repository.
    assert config["file_mounts"]["~/.ray/auth_token"] == "~/.ray/auth_token"
    assert ".gitignore" in config["rsync_filter"]
    # One Python on every node, the one pyproject.toml requires.
    requires = re.search(
        r'requires-python = ">=(\d+\.\d+)"', (CLUSTER.parent / "pyproject.toml").read_text()
    )
    assert f"--python {requires.group(1)}" in " ".join(config["setup_commands"])


# --- Kubernetes manifests ------------------------------------------------------------------


def test_every_manifest_has_a_known_kind_api_version_name_and_namespace() -> None:
    docs = _docs()
    assert {d["kind"] for d in docs} == set(API_VERSIONS)
    for d in docs:
        assert d["apiVersion"] == API_VERSIONS[d["kind"]], (d["_file"], d["kind"])
        assert d["metadata"]["name"]
        if d["kind"] not in ("Namespace", "PersistentVolume"):  # cluster-scoped kinds
            assert d["metadata"]["namespace"] == NAMESPACE, (d["_file"], d["kind"])
    assert [d["metadata"]["name"] for d in _of_kind("Namespace")] == [NAMESPACE]


def test_no_secret_is_committed_and_every_reference_is_a_documented_secret() -> None:
    assert not any(d["kind"] == "Secret" for d in _docs())
    refs = {
        (node["secretKeyRef"]["name"], node["secretKeyRef"]["key"])
        for d in _docs()
        for node in _walk(d)
        if "secretKeyRef" in node
    }
    assert refs == {(name, key) for name, keys in SECRETS.items() for key in keys}
    readme = (CLUSTER / "README.md").read_text()
    for name, keys in SECRETS.items():
        create = re.search(
            rf"kubectl -n {NAMESPACE} create secret generic {name}((?:[^\n]*\\\n)*[^\n]*)", readme
        )
        assert create, f"cluster/README.md does not say how to create {name}"
        assert set(re.findall(r"--from-literal=([a-z-]+)=", create.group(1))) == keys
    # Nothing that looks like an inline credential in any manifest.
    for path in KUBERNETES.glob("*.yaml"):
        assert not re.search(r"(?i)password\s*[:=]\s*['\"]?[A-Za-z0-9]{8,}", path.read_text()), path


def test_services_are_cluster_internal_and_route_to_named_container_ports() -> None:
    pods = _pod_templates()
    for service in _of_kind("Service"):
        spec = service["spec"]
        assert spec["type"] == "ClusterIP", service["metadata"]["name"]
        targets = [p for p in pods if _selects(spec["selector"], p[1])]
        assert len(targets) == 1, service["metadata"]["name"]
        port_names = {p["name"] for c in targets[0][2]["containers"] for p in c.get("ports", [])}
        for port in spec["ports"]:
            assert port["targetPort"] in port_names
    for rc in _of_kind("RayCluster"):
        assert rc["spec"]["headGroupSpec"].get("serviceType", "ClusterIP") == "ClusterIP"
    assert not any(d["kind"] == "Ingress" for d in _docs())


def test_workloads_select_their_own_pods_and_size_every_container() -> None:
    for d in _of_kind("Deployment") + _of_kind("StatefulSet"):
        labels = d["spec"]["template"]["metadata"]["labels"]
        assert _selects(d["spec"]["selector"]["matchLabels"], labels), d["metadata"]["name"]
    for owner, _, spec in _pod_templates():
        for container in spec["containers"]:
            assert container["image"], owner
            resources = container["resources"]
            assert {"cpu", "memory"} <= set(resources["requests"]) & set(resources["limits"])
            if owner.startswith("tenantq "):  # Ray pods: KubeRay wants requests == limits
                assert resources["requests"] == resources["limits"], owner


def test_network_policies_admit_only_pods_that_exist() -> None:
    pods = _pod_templates()
    for policy in _of_kind("NetworkPolicy"):
        spec = policy["spec"]
        guarded = [p for p in pods if _selects(spec["podSelector"]["matchLabels"], p[1])]
        assert len(guarded) == 1, policy["metadata"]["name"]
        container_ports = {
            p["containerPort"] for c in guarded[0][2]["containers"] for p in c.get("ports", [])
        }
        for rule in spec["ingress"]:
            for source in rule["from"]:
                selector = source["podSelector"]["matchLabels"]
                assert any(_selects(selector, p[1]) for p in pods), selector
            assert {p["port"] for p in rule["ports"]} <= container_ports
        admitted = [
            p[0]
            for p in pods
            for rule in spec["ingress"]
            for s in rule["from"]
            if _selects(s["podSelector"]["matchLabels"], p[1])
        ]
        # The search driver (Ray head) may always talk to the study's stores; workers not.
        assert "tenantq head" in admitted
        assert not any("tpu" in name for name in admitted)


def test_postgres_holds_separate_databases_for_mlflow_and_optuna() -> None:
    (statefulset,) = _of_kind("StatefulSet")
    env = {e["name"]: e for e in statefulset["spec"]["template"]["spec"]["containers"][0]["env"]}
    assert env["POSTGRES_HOST_AUTH_METHOD"]["value"] == "scram-sha-256"
    (init,) = [c for c in _of_kind("ConfigMap") if c["metadata"]["name"] == "tenantq-postgres-init"]
    script = next(iter(init["data"].values()))
    databases = dict(re.findall(r"CREATE DATABASE (\w+) OWNER (\w+);", script))
    assert databases == {"mlflow": "mlflow", "mlflow_auth": "mlflow", "optuna": "optuna"}
    # The script's variables are the container's env (set from the Secret).
    for var in re.findall(r'"\$(\w+)"', script):
        assert var in env or var == "POSTGRES_USER", var
    # MLflow's URIs name the databases created for it.
    (mlflow,) = _of_kind("Deployment")
    args = " ".join(mlflow["spec"]["template"]["spec"]["containers"][0]["args"])
    assert {m for m in re.findall(r"@\$\{db\}/(\w+)", args)} == {"mlflow", "mlflow_auth"}


def test_mlflow_server_demands_a_login() -> None:
    (mlflow,) = _of_kind("Deployment")
    container = mlflow["spec"]["template"]["spec"]["containers"][0]
    args = " ".join(container["args"])
    assert "--app-name basic-auth" in args
    port = int(re.search(r"--port (\d+)", args).group(1))
    assert port in {p["containerPort"] for p in container["ports"]}
    assert "--disable-security-middleware" not in args
    env = {e["name"] for e in container["env"]}
    assert {"MLFLOW_AUTH_ADMIN_PASSWORD", "MLFLOW_FLASK_SERVER_SECRET_KEY"} <= env


def test_raycluster_matches_installed_ray_and_rays_tpu_tables() -> None:
    from ray._private.accelerators.tpu import VALID_TPU_TOPOLOGY, get_num_chips_from_topology
    from ray.util.tpu import get_chips_per_host

    (rc,) = _of_kind("RayCluster")
    spec = rc["spec"]
    ray_pin = _tested_pins()[0]  # '"ray[default]==X"', X pyproject's floor (the tested ray)
    assert spec["rayVersion"] == ray_pin.split("==")[1].strip('"')
    dockerfile = (CLUSTER / "Dockerfile").read_text()
    assert ray_pin in dockerfile
    assert spec["authOptions"] == {"mode": "token"}

    head = spec["headGroupSpec"]["template"]["spec"]["containers"][0]
    head_ports = {p["name"]: p["containerPort"] for p in head["ports"]}
    assert head_ports == {"gcs-server": 6379, "dashboard": 8265, "client": 10001, "metrics": 8080}
    head_env = {e["name"] for e in head["env"]}
    assert {
        "JAX_PLATFORMS",
        "MLFLOW_TRACKING_USERNAME",
        "MLFLOW_TRACKING_PASSWORD",
        "PGPASSWORD",
    } <= head_env
    assert "google.com/tpu" not in head["resources"]["limits"]

    groups = {g["groupName"]: g for g in spec["workerGroupSpecs"]}
    # a single-host v6e-8 group (HostWorkers) and a multi-host v6e-16 group (SliceWorkers)
    assert set(groups) == {"tpu-v6e-8", "tpu-v6e-16"}
    hosts = {}
    for group in groups.values():
        pod = group["template"]["spec"]
        selector = pod["nodeSelector"]
        accelerator = selector["cloud.google.com/gke-tpu-accelerator"]
        topology = selector["cloud.google.com/gke-tpu-topology"]
        assert accelerator == "tpu-v6e-slice"
        assert topology in VALID_TPU_TOPOLOGY["v6e"]
        chips_per_host = get_chips_per_host(topology, "v6e")
        (worker,) = pod["containers"]
        assert int(worker["resources"]["requests"]["google.com/tpu"]) == chips_per_host
        assert int(worker["resources"]["limits"]["google.com/tpu"]) == chips_per_host
        # one replica = one slice: every host of the topology, as Ray's tables count them
        assert group["numOfHosts"] == get_num_chips_from_topology(topology) // chips_per_host
        hosts[group["groupName"]] = (group["numOfHosts"], chips_per_host)
        assert group["minReplicas"] <= group["replicas"] <= group["maxReplicas"]
        assert any(t["key"] == "google.com/tpu" for t in pod["tolerations"])
        assert worker["image"].split("/")[-1].startswith("tenantq-tpu:")
    assert hosts == {"tpu-v6e-8": (1, 8), "tpu-v6e-16": (4, 4)}
    assert "JAX_EXTRA" in dockerfile  # the TPU image is the same Dockerfile with libtpu


# The versions the tests ran with are pyproject's floors (ray, mlflow, optuna: `>=` the tested
# version, so a user may take a newer one) and the test extra's pin (psycopg2-binary): the image
# and the TPU VMs pin exactly those. Read from pyproject, not from the installed packages: a
# fresh CI install may pick a newer release within the floor, which the image need not follow.
def _tested_pins() -> list[str]:
    import tomllib

    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    floors = {}
    for req in [*project["dependencies"], *project["optional-dependencies"]["test"]]:
        for op in (">=", "=="):
            if op in req:
                name, version = (x.strip() for x in req.split(op, 1))
                floors[name] = version.split(",")[0].split(";")[0].strip()
    names = ("ray[default]", "mlflow", "optuna", "psycopg2-binary")
    missing = [n for n in names if n not in floors]
    assert not missing, f"pyproject.toml has no floor or pin for {missing}"
    return [f'"{name}=={floors[name]}"' for name in names]


def test_image_and_tpu_vms_pin_the_versions_the_tests_ran_with() -> None:
    dockerfile = (CLUSTER / "Dockerfile").read_text()
    setup = " ".join(_launcher()["setup_commands"])
    for pin in _tested_pins():
        assert pin in dockerfile, pin
        assert pin in setup, pin


def test_every_ray_pod_mounts_the_shared_model_volume_read_only() -> None:
    (rc,) = _of_kind("RayCluster")
    pods = [rc["spec"]["headGroupSpec"]["template"]]
    pods += [g["template"] for g in rc["spec"]["workerGroupSpecs"]]
    (claim,) = [c for c in _of_kind("PersistentVolumeClaim") if c["_file"] == "models.yaml"]
    (volume,) = _of_kind("PersistentVolume")
    assert claim["spec"]["accessModes"] == volume["spec"]["accessModes"] == ["ReadOnlyMany"]
    assert volume["spec"]["csi"]["readOnly"] is True
    assert volume["spec"]["claimRef"]["name"] == claim["metadata"]["name"]
    for pod in pods:
        (models,) = [v for v in pod["spec"]["volumes"] if v["name"] == "models"]
        assert models["persistentVolumeClaim"] == {
            "claimName": claim["metadata"]["name"],
            "readOnly": True,
        }
        (container,) = pod["spec"]["containers"]
        (mount,) = [m for m in container["volumeMounts"] if m["name"] == "models"]
        assert mount == {"name": "models", "mountPath": "/models", "readOnly": True}
        assert pod["metadata"]["annotations"]["gke-gcsfuse/volumes"] == "true"
    # TPU VMs: the same disk, read-only, on the head and on every worker, mounted at /models.
    nodes = _launcher()["available_node_types"]
    head_disks = nodes["ray_head"]["node_config"]["disks"]
    assert any(d.get("mode") == "READ_ONLY" and "tenantq-models" in d["source"] for d in head_disks)
    (data,) = nodes["tpu_v6e_8"]["node_config"]["dataDisks"]
    assert data["mode"] == "READ_ONLY" and data["sourceDisk"].endswith("/disks/tenantq-models")
    assert any("mount -o ro" in c and "/models" in c for c in _launcher()["setup_commands"])
