"""deploy/kubernetes/, checked offline (no cluster where the tests run).

Every manifest, and what each kustomization renders (`kubectl kustomize`), validates against the Kubernetes
API's own schemas, strictly (kubernetes-validate, a dev extra: the schemas ship in it). What the rendered
objects say is tied to the code: the encoder's flags and QVE_ variables are settings with valid values, the
ports agree from each Service to the container to `--port`, the probes are routes the app serves, the HPA's
metric is a family the service exports, the memory volumes hold the store and the arenas, and the grace
period outlasts the preStop sleep and the supervisor's longest drain.
"""

from __future__ import annotations

import ast
import inspect
import json
import os
import re
import shutil
import subprocess
import textwrap
from pathlib import Path
from urllib.parse import urlsplit

import kubernetes_validate
import pytest
import yaml

from service.config import Settings, unknown_env

ROOT = Path(__file__).resolve().parents[2]
KUBE = ROOT / "deploy" / "kubernetes"
VARIANTS = sorted(p.parent.name for p in KUBE.glob("*/kustomization.yaml"))
# A current release and the newest whose schemas kubernetes-validate 1.37 ships.
K8S_VERSIONS = ("1.33.0", "1.37.0")
# Kept beside the manifests, applied by hand (docs/kubernetes.md says how), never by a kustomization.
NOT_APPLIED = {"base/secret.example.yaml", "base/prometheus-adapter-rules.yaml"}
# What the cluster fills in for env valueFrom; stand-ins of the right shape.
FROM_CLUSTER = {"secretKeyRef": "a-test-key", "status.podIP": "192.0.2.10"}  # (192.0.2.0/24: documentation only)


def test_the_variants_are_there():
    assert VARIANTS == ["base", "mooncake", "one-host"]


# ---- files and rendering ---------------------------------------------------------------------------
def kustomization(variant: str) -> dict:
    return yaml.safe_load((KUBE / variant / "kustomization.yaml").read_text())


def patches(variant: str) -> list[Path]:
    return [KUBE / variant / p["path"] for p in kustomization(variant).get("patches", [])]


def manifest_files() -> list[Path]:
    """Every YAML file of whole objects: not a kustomization, not a patch one of them names."""
    skip = {KUBE / v / "kustomization.yaml" for v in VARIANTS} | {p for v in VARIANTS for p in patches(v)}
    return sorted(p for p in KUBE.rglob("*.yaml") if p not in skip)


def validate(doc: dict, where: str) -> None:
    for version in K8S_VERSIONS:
        try:
            kubernetes_validate.validate(doc, version, strict=True)
        except kubernetes_validate.ValidationError as e:
            pytest.fail(f"{where}: {doc['kind']} {doc['metadata'].get('name')} is not valid for Kubernetes {version}: {e}")


def _kustomize() -> list[str]:
    if shutil.which("kubectl"):
        return ["kubectl", "kustomize"]
    if shutil.which("kustomize"):
        return ["kustomize", "build"]
    pytest.skip("rendering the kustomizations needs kubectl (its `kustomize`) or kustomize on PATH")


@pytest.fixture(scope="module")
def rendered() -> dict[str, list[dict]]:
    """Each variant's objects as `kubectl apply -k` would send them."""
    out = {}
    for variant in VARIANTS:
        done = subprocess.run([*_kustomize(), str(KUBE / variant)], capture_output=True, text=True, timeout=60)
        assert done.returncode == 0, f"{variant} does not render: {done.stderr}"
        out[variant] = list(yaml.safe_load_all(done.stdout))
    return out


@pytest.mark.parametrize("path", manifest_files(), ids=lambda p: p.relative_to(KUBE).as_posix())
def test_each_manifest_file_is_valid(path):
    docs = list(yaml.safe_load_all(path.read_text()))
    assert docs and all(isinstance(d, dict) for d in docs), f"{path.name}: no objects"
    for doc in docs:
        validate(doc, path.relative_to(KUBE).as_posix())


@pytest.mark.parametrize("variant", VARIANTS)
def test_each_variant_renders_to_valid_objects(rendered, variant):
    kinds = sorted(d["kind"] for d in rendered[variant])
    assert {"Deployment", "Service", "PodDisruptionBudget", "HorizontalPodAutoscaler"} <= set(kinds), kinds
    for doc in rendered[variant]:
        validate(doc, variant)


def test_the_validation_catches_a_misspelt_field(rendered):
    (deployment,) = [d for d in rendered["base"] if d["kind"] == "Deployment"]
    bad = json.loads(json.dumps(deployment))
    bad["spec"]["template"]["spec"]["containers"][0]["readinessprobe"] = {}  # not readinessProbe
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(bad, K8S_VERSIONS[-1], strict=True)


@pytest.mark.parametrize("variant", VARIANTS)
def test_kustomization_names_what_exists_and_applies_every_file(variant):
    k = kustomization(variant)
    named = set()
    for entry in k.get("resources", []):
        path = (KUBE / variant / entry).resolve()
        assert path.is_file() or (path / "kustomization.yaml").is_file(), f"{variant}: resource {entry} does not exist"
        named.add(path)
    for path in patches(variant):
        assert path.is_file(), f"{variant}: patch {path.name} does not exist"
        yaml.safe_load(path.read_text())  # parses
        named.add(path.resolve())
    files = {p.resolve() for p in (KUBE / variant).glob("*.yaml") if p.name != "kustomization.yaml"}
    left = {p.relative_to(KUBE).as_posix() for p in files - named}
    assert left <= NOT_APPLIED, f"{variant}: {sorted(left - NOT_APPLIED)} are applied by no kustomization"


# ---- the rendered objects, tied to the code --------------------------------------------------------
def objects(docs: list[dict], kind: str) -> list[dict]:
    return [d for d in docs if d["kind"] == kind]


def deployment(docs: list[dict], name: str = "qwen3vl-encoder") -> dict:
    (d,) = [d for d in objects(docs, "Deployment") if d["metadata"]["name"] == name]
    return d


def pod_spec(docs: list[dict], name: str = "qwen3vl-encoder") -> dict:
    return deployment(docs, name)["spec"]["template"]["spec"]


def cli_command(container: dict) -> str | None:
    """The `qwen3vl-encoder` command a container runs (the image's ENTRYPOINT is `serve`), or None."""
    image = container["image"].rsplit("/", 1)[-1].split(":")[0]
    if not image.startswith("qwen3vl-encoder"):
        return None
    command = container.get("command")
    if command is None:
        return "serve"
    return command[3] if command[:3] == ["python", "-m", "service"] else None


def containers(docs: list[dict], command: str) -> list[tuple[dict, dict]]:
    """(pod spec, container) for every container that runs `command`."""
    out = []
    for d in objects(docs, "Deployment"):
        spec = d["spec"]["template"]["spec"]
        out += [(spec, c) for c in spec["containers"] if cli_command(c) == command]
    return out


def environment(container: dict) -> dict[str, str]:
    env = {}
    for e in container.get("env", []):
        source = e.get("valueFrom", {})
        if "value" in e:
            env[e["name"]] = e["value"]
        elif "secretKeyRef" in source:
            env[e["name"]] = FROM_CLUSTER["secretKeyRef"]
        else:
            env[e["name"]] = FROM_CLUSTER[source["fieldRef"]["fieldPath"]]
    return env


def parse(command: str, container: dict) -> dict:
    from service.__main__ import build_parser

    try:
        return vars(build_parser().parse_args([command, *container.get("args", [])]))
    except SystemExit:  # argparse printed why: an unknown flag, a bad value
        pytest.fail(f"`qwen3vl-encoder {command}` refuses {container['name']}'s args {container.get('args')}")


def settings_of(container: dict, monkeypatch) -> Settings:
    """The Settings `serve` builds in this container: its args, then its QVE_ environment."""
    env = environment(container)
    assert unknown_env(env) == [], f"{container['name']}: QVE_ variables that are no setting"
    for k in [k for k in os.environ if k.startswith("QVE_")]:
        monkeypatch.delenv(k)
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    flags = parse("serve", container)
    flags.pop("command")
    return Settings(**flags)


def encoders(docs, monkeypatch) -> list[tuple[dict, dict, Settings]]:
    found = [(spec, c, settings_of(c, monkeypatch)) for spec, c in containers(docs, "serve")]
    assert found, "no encoder container"
    return found


def port_named(container: dict, port) -> int:
    """A probe's or a Service's port (a name or a number) as one of the container's ports."""
    ports = {p.get("name"): p["containerPort"] for p in container.get("ports", [])}
    if isinstance(port, str):
        assert port in ports, f"{container['name']} has no port named {port}"
        return ports[port]
    assert port in ports.values(), f"{container['name']} does not declare port {port}"
    return port


def quantity(q) -> float:
    """A Kubernetes quantity (8Gi, 500Mi, 1.5G, 16, 250m) as a number."""
    m = re.fullmatch(r"(\d+(?:\.\d+)?)(Ki|Mi|Gi|Ti|k|M|G|T|m)?", str(q))
    assert m, f"cannot read the quantity {q!r}"
    scale = {None: 1, "m": 1e-3, "k": 1e3, "M": 1e6, "G": 1e9, "T": 1e12,
             "Ki": 2**10, "Mi": 2**20, "Gi": 2**30, "Ti": 2**40}[m.group(2)]
    return float(m.group(1)) * scale


def prestop_sleep_s(container: dict) -> float:
    command = container["lifecycle"]["preStop"]["exec"]["command"]
    assert command[0] == "sleep" and len(command) == 2, command
    return float(command[1])


def drain_bound_s() -> tuple[float, float]:
    """(API processes, engines): how long the supervisor waits for each to drain before it kills them, read
    from Supervisor._stop itself (a change there must be matched here and in terminationGracePeriodSeconds)."""
    from service.procs.supervisor import Supervisor

    tree = ast.parse(textwrap.dedent(inspect.getsource(Supervisor._stop)))
    joins = [n.args[0].value for n in ast.walk(tree) if isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute)
             and n.func.attr == "join" and n.args and isinstance(n.args[0], ast.Constant)]
    assert len(joins) == 2, f"Supervisor._stop's join timeouts changed: {joins}"
    return joins[0], joins[1]


def memory_volumes(spec: dict) -> dict[str, float]:
    return {v["name"]: quantity(v["emptyDir"]["sizeLimit"]) for v in spec.get("volumes", [])
            if v.get("emptyDir", {}).get("medium") == "Memory"}


@pytest.mark.parametrize("variant", VARIANTS)
def test_encoder_listens_on_its_container_port_on_every_interface(rendered, variant, monkeypatch):
    for spec, c, s in encoders(rendered[variant], monkeypatch):
        assert s.host == "0.0.0.0", "inside a container the Pod's address must reach it"
        assert port_named(c, "http") == s.port
        assert s.supervised and len(s.engine_devices) == 1 and s.device.startswith("cuda")
        assert c["resources"]["limits"]["nvidia.com/gpu"] == 1, "one engine, one GPU"
    dep = deployment(rendered[variant])
    assert int(dep["spec"]["template"]["metadata"]["annotations"]["prometheus.io/port"]) == s.port, "Prometheus scrapes it"


@pytest.mark.parametrize("variant", VARIANTS)
def test_every_service_reaches_a_declared_container_port(rendered, variant):
    docs = rendered[variant]
    for svc in objects(docs, "Service"):
        selector = svc["spec"]["selector"]
        pods = [d["spec"]["template"] for d in objects(docs, "Deployment")
                if selector.items() <= d["spec"]["template"]["metadata"]["labels"].items()]
        assert pods, f"Service {svc['metadata']['name']} selects no Pod"
        for p in svc["spec"]["ports"]:
            target = p.get("targetPort", p["port"])
            ok = [c for pod in pods for c in pod["spec"]["containers"]
                  if any(target in (q.get("name"), q["containerPort"]) for q in c.get("ports", []))]
            assert ok, f"Service {svc['metadata']['name']}: no container has port {target}"


def app_routes(command: str, container: dict, tmp_path) -> set[str]:
    """The GET paths the app of this container's command serves (built, not started: no model)."""
    if command == "serve":
        from service.api.app import create_app

        app = create_app(Settings(model="tiny", device="cpu", store=tmp_path / "store"), make_runtime=None)
    else:
        from service.__main__ import LM_KEY_ENV, _lm_keys
        from service.lm.router import RouterConfig, create_router_app

        args = parse("route", container)
        for name in ("command", "host", "port", "log_level", "otlp_endpoint"):
            args.pop(name)
        app = create_router_app(RouterConfig(**args, **_lm_keys(args, list(LM_KEY_ENV))))
    return {r.path for r in app.routes if "GET" in getattr(r, "methods", ())}


@pytest.mark.parametrize("variant", VARIANTS)
def test_probes_are_routes_the_app_serves_on_its_port(rendered, variant, tmp_path, monkeypatch):
    checked = 0
    for command in ("serve", "route"):
        for _, c in containers(rendered[variant], command):
            routes = app_routes(command, c, tmp_path)
            for probe in ("readinessProbe", "livenessProbe"):
                get = c[probe]["httpGet"]
                assert get["path"] in routes, f"{c['name']}'s {probe} asks for {get['path']}, which is no route"
                port = port_named(c, get["port"])
                if command == "serve":
                    assert port == settings_of(c, monkeypatch).port
                else:
                    assert port == parse("route", c)["port"]
                checked += 1
            if command == "serve":  # /ready says warm; /health only alive (200 while loading)
                assert (c["readinessProbe"]["httpGet"]["path"], c["livenessProbe"]["httpGet"]["path"]) == ("/ready", "/health")
    assert checked >= 2


def secret_example() -> tuple[str, set[str]]:
    (secret,) = yaml.safe_load_all((KUBE / "base" / "secret.example.yaml").read_text())
    return secret["metadata"]["name"], set(secret["stringData"])


@pytest.mark.parametrize("variant", VARIANTS)
def test_api_keys_come_from_the_secret(rendered, variant):
    name, keys = secret_example()
    seen = 0
    for d in objects(rendered[variant], "Deployment"):
        for c in d["spec"]["template"]["spec"]["containers"]:
            assert not [a for a in c.get("args", []) if a.endswith("api-key")], "a key in args: `ps` shows it"
            for e in c.get("env", []):
                if e["name"].endswith("API_KEY"):
                    ref = e["valueFrom"]["secretKeyRef"]
                    assert (ref["name"], ref["key"] in keys) == (name, True), e
                    seen += 1
    assert seen >= 1


@pytest.mark.parametrize("variant", VARIANTS)
def test_memory_volumes_hold_the_store_and_the_arenas(rendered, variant, monkeypatch):
    for spec, c, s in encoders(rendered[variant], monkeypatch):
        sizes = memory_volumes(spec)
        mounts = {m["mountPath"]: m for m in c["volumeMounts"]}
        shm = mounts["/dev/shm"]
        arenas = s.api_process_count() * s.arena_bytes
        assert sizes[shm["name"]] >= arenas + 512 * 2**20, "/dev/shm must hold every API process's arena"
        held = sizes[shm["name"]]
        if s.store_is_mooncake:
            held += s.mooncake_segment_bytes
        else:
            store = Path(s.store)
            ((path, m),) = [(p, m) for p, m in mounts.items() if store.is_relative_to(p)]
            assert store != Path(path), "an emptyDir's root is 0777: the service refuses it; use a folder in it"
            assert m["name"] in sizes and not m.get("readOnly"), "the store is RAM the encoder writes"
            assert sizes[m["name"]] >= s.store_capacity_bytes, "the volume must hold --store-capacity-bytes"
            held += sizes[m["name"]]
        assert quantity(c["resources"]["limits"]["memory"]) > held, "memory volumes count against the limit"
        assert s.api_process_count() * (1 + s.decode_worker_count()) <= quantity(c["resources"]["requests"]["cpu"])


@pytest.mark.parametrize("variant", VARIANTS)
def test_grace_period_outlasts_the_prestop_and_the_drain(rendered, variant, monkeypatch):
    from service.api.server import server_options

    api_s, engine_s = drain_bound_s()
    assert server_options(Settings())["timeout_graceful_shutdown"] < api_s, "uvicorn's own stop fits the API's wait"
    for spec, c, _ in encoders(rendered[variant], monkeypatch):
        grace = spec["terminationGracePeriodSeconds"]
        assert grace > prestop_sleep_s(c) + api_s + engine_s
        assert all(grace > prestop_sleep_s(o) for o in spec["containers"])
        for _, router in containers(rendered[variant], "route"):
            # The router's open requests still call the encoder and vLLM: they stop after it.
            assert all(prestop_sleep_s(o) > prestop_sleep_s(router) for o in spec["containers"] if o is not router)


def metric_families() -> set[str]:
    from service.metrics import Metrics

    return {mf.name for mf in Metrics().registry.collect()}


@pytest.mark.parametrize("variant", VARIANTS)
def test_hpa_scales_the_encoders_on_waiting_images_below_the_admission_limit(rendered, variant, monkeypatch):
    docs = rendered[variant]
    (hpa,) = objects(docs, "HorizontalPodAutoscaler")
    assert hpa["apiVersion"] == "autoscaling/v2"
    ref = hpa["spec"]["scaleTargetRef"]
    assert (ref["kind"], ref["name"]) == ("Deployment", "qwen3vl-encoder")
    dep = deployment(docs, ref["name"])
    assert "replicas" not in dep["spec"], "the HPA owns the count: `kubectl apply` would reset it"
    (metric,) = hpa["spec"]["metrics"]
    assert metric["type"] == "Pods" and metric["pods"]["metric"]["name"] == "qve_waiting_images"
    assert "qve_waiting_images" in metric_families(), "service/metrics.py exports no family qve_waiting_images"
    target = metric["pods"]["target"]
    assert target["type"] == "AverageValue"
    for _, _, s in encoders(docs, monkeypatch):
        assert 0 < quantity(target["averageValue"]) < s.max_queue_images, "past --max-queue-images it is 429s"
    assert hpa["spec"]["behavior"]["scaleDown"]["stabilizationWindowSeconds"] >= 300, "a cold start costs minutes"
    (pdb,) = objects(docs, "PodDisruptionBudget")
    assert hpa["spec"]["minReplicas"] > pdb["spec"]["maxUnavailable"], "an eviction leaves an encoder serving"
    assert pdb["spec"]["selector"]["matchLabels"] == dep["spec"]["selector"]["matchLabels"]


def test_adapter_rule_serves_the_hpas_metric_summed_per_pod(rendered):
    (cm,) = yaml.safe_load_all((KUBE / "base" / "prometheus-adapter-rules.yaml").read_text())
    (rule,) = yaml.safe_load(cm["data"]["config.yaml"])["rules"]
    (hpa,) = objects(rendered["base"], "HorizontalPodAutoscaler")
    assert rule["name"]["as"] == hpa["spec"]["metrics"][0]["pods"]["metric"]["name"]
    assert rule["seriesQuery"] == 'qve_waiting_images{namespace!="",pod!=""}'
    assert re.fullmatch(r"sum\(<<\.Series>>\{<<\.LabelMatchers>>\}\) by \(<<\.GroupBy>>\)", rule["metricsQuery"])
    assert rule["resources"]["overrides"] == {"namespace": {"resource": "namespace"}, "pod": {"resource": "pod"}}
    assert re.fullmatch(rule["name"]["matches"], "qve_waiting_images")


def test_pods_run_as_the_images_user(rendered):
    (uid,) = {int(re.search(r"^ARG APP_UID=(\d+)$", (ROOT / "docker" / f).read_text(), re.M).group(1))
              for f in ("Dockerfile", "Dockerfile.cpu")}
    for variant in VARIANTS:
        for d in objects(rendered[variant], "Deployment"):
            ctx = d["spec"]["template"]["spec"]["securityContext"]
            assert (ctx["runAsNonRoot"], ctx["runAsUser"]) == (True, uid), d["metadata"]["name"]


# ---- the variants ----------------------------------------------------------------------------------
def test_one_host_vllm_reads_the_encoders_store_read_only(rendered, monkeypatch):
    docs = rendered["one-host"]
    spec = pod_spec(docs)
    ((_, enc, s),) = encoders(docs, monkeypatch)
    (vllm,) = [c for c in spec["containers"] if c["name"] == "vllm"]
    assert vllm["command"] == ["vllm", "serve"]
    args = vllm["args"]
    assert args[0] == s.model, "one checkpoint for both: its preprocessor_config.json sets the pixel limits"
    ec = json.loads(args[args.index("--ec-transfer-config") + 1])
    assert (ec["ec_connector"], ec["ec_role"]) == ("ECExampleConnector", "ec_consumer")
    assert ec["ec_connector_extra_config"]["shared_storage_path"] == str(s.store)
    assert "runAsUser" not in vllm.get("securityContext", {}), "vLLM runs as the Pod's user, who owns the store"
    store = [m for m in enc["volumeMounts"] if Path(s.store).is_relative_to(m["mountPath"])][0]
    (seen,) = [m for m in vllm["volumeMounts"] if m["name"] == store["name"]]
    assert seen["mountPath"] == store["mountPath"]
    # ECExampleConnector makes <store>/<key>/ on every lookup: on a read-only volume a miss raises in vLLM.
    assert not seen.get("readOnly")
    assert s.store_min_residency_s >= 60, "vLLM checks an entry and loads it later"
    assert vllm["resources"]["limits"]["nvidia.com/gpu"] == 1

    ((_, router),) = containers(docs, "route")
    r = parse("route", router)
    vllm_port = int(args[args.index("--port") + 1])
    assert (urlsplit(r["encoder_url"]).hostname, urlsplit(r["encoder_url"]).port) == ("127.0.0.1", s.port)
    assert (urlsplit(r["vllm_url"]).hostname, urlsplit(r["vllm_url"]).port) == ("127.0.0.1", vllm_port)
    assert args[args.index("--host") + 1] == "127.0.0.1", "vLLM's one client is the router"
    assert set(environment(router)) == {"QVE_API_KEY", "QVE_ENCODER_API_KEY"}
    (chat,) = [svc for svc in objects(docs, "Service") if svc["metadata"]["name"] == "qwen3vl-chat"]
    assert port_named(router, chat["spec"]["ports"][0]["targetPort"]) == r["port"]


def test_mooncake_encoders_advertise_their_pod_ip_to_the_master_they_name(rendered, monkeypatch):
    from service.store.options import parse_mooncake

    docs = rendered["mooncake"]
    master_spec = pod_spec(docs, "qwen3vl-mooncake-master")
    (master,) = master_spec["containers"]
    flags = dict(a.removeprefix("--").split("=", 1) for a in master["args"])
    for spec, c, s in encoders(docs, monkeypatch):
        assert s.store_is_mooncake
        (local,) = [e for e in c["env"] if e["name"] == "QVE_MOONCAKE_LOCAL_HOST"]
        assert local["valueFrom"]["fieldRef"]["fieldPath"] == "status.podIP"
        assert not any(v.get("emptyDir", {}).get("medium") == "Memory" and v["name"] == "store"
                       for v in spec["volumes"]), "the pool holds the entries, not a volume"
        host, port = parse_mooncake(s.store).rsplit(":", 1)
        port = int(port)
        (svc,) = [v for v in objects(docs, "Service") if v["metadata"]["name"] == host]
        (p,) = [p for p in svc["spec"]["ports"] if p["port"] == port]
        assert port_named(master, p["targetPort"]) == int(flags["rpc_port"])
        ttl = re.fullmatch(r"(\d+)s", flags["default_kv_lease_ttl"])
        assert int(ttl.group(1)) >= s.store_min_residency_s, "an answered entry must outlive the lease"
    assert flags["metrics_host"] == "127.0.0.1", "the master's metrics stay on its loopback"
    # Only pool members reach the pool (no authentication in Mooncake); the encoders' HTTP port stays open.
    (policy,) = objects(docs, "NetworkPolicy")
    member = policy["spec"]["podSelector"]["matchLabels"]
    for d in objects(docs, "Deployment"):
        assert member.items() <= d["spec"]["template"]["metadata"]["labels"].items(), d["metadata"]["name"]
    froms, ports = policy["spec"]["ingress"]
    assert froms["from"] == [{"podSelector": {"matchLabels": member}}] and "ports" not in froms
    assert ports == {"ports": [{"port": "http", "protocol": "TCP"}]}
