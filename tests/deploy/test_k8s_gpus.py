"""The Kubernetes manifests on GPUs (deploy/k8s), on every overlay and variant as `kubectl kustomize`
renders them: GPU workers in QoS class Guaranteed, on nodes whose GPUs and driver the image's CUDA
build runs on (NVIDIA GPU feature discovery's labels, runtime class nvidia), with the GPUs they ask
for; the frontend and the cpu overlay without GPUs; NCCL settings and a /dev/shm for NCCL exactly
on the workers that run --kv-transport nccl. The rest of the manifests is in test_k8s_manifests.py."""

import re
from decimal import Decimal

import yaml

from deploy_helpers import ROLES, container_env, deployment, kv_transport, main_container, parse_dockerfile, pod_volume


# ---- GPUs --------------------------------------------------------------------------------------

def gpus(container, field):
    return int(container["resources"].get(field, {}).get("nvidia.com/gpu", 0))


def gpu_renders(rendered):
    names = [n for n in rendered if n == "gpu" or n.startswith("gpu+")]
    assert "gpu" in names, f"no gpu overlay among {sorted(rendered)}"
    return names


_QUANTITY_SUFFIXES = {"": 1, "m": Decimal("0.001"), "k": 10**3, "M": 10**6, "G": 10**9, "T": 10**12,
                      "Ki": 2**10, "Mi": 2**20, "Gi": 2**30, "Ti": 2**40}


def quantity(q):
    """A Kubernetes resource quantity ("4", "500m", "32Gi") as a number."""
    m = re.fullmatch(r"([0-9]+(?:\.[0-9]+)?)([a-zA-Z]*)", str(q))
    assert m and m.group(2) in _QUANTITY_SUFFIXES, f"quantity {q!r}"
    return Decimal(m.group(1)) * _QUANTITY_SUFFIXES[m.group(2)]


def qos_class(spec):
    """The pod's QoS class, as the kubelet derives it from cpu and memory of every container, init
    containers included (a limit without a request makes the request equal to it)."""
    guaranteed, any_set = True, False
    for c in spec.get("initContainers", []) + spec["containers"]:
        res = c.get("resources", {})
        limits = res.get("limits", {})
        requests = {**{k: v for k, v in limits.items()}, **res.get("requests", {})}
        for r in ("cpu", "memory"):
            any_set |= r in requests or r in limits
            if r not in limits or quantity(requests[r]) != quantity(limits[r]):
                guaranteed = False
    return "Guaranteed" if guaranteed else "Burstable" if any_set else "BestEffort"


def test_qos_class_follows_the_kubelet():
    main = {"name": "m", "resources": {"requests": {"cpu": "4", "memory": "1Gi"}, "limits": {"cpu": "4000m", "memory": "1024Mi"}}}
    init = {"name": "i", "resources": {"limits": {"cpu": "1", "memory": "64Mi"}}}
    assert qos_class({"containers": [main], "initContainers": [init]}) == "Guaranteed"
    assert qos_class({"containers": [main], "initContainers": [{"name": "i", "resources": {"requests": {"cpu": "1"}}}]}) == "Burstable"
    assert qos_class({"containers": [{"name": "m", "resources": {"requests": {"cpu": "1"}, "limits": {"cpu": "2"}}}]}) == "Burstable"
    assert qos_class({"containers": [{"name": "m"}]}) == "BestEffort"


def test_gpu_workers_have_guaranteed_qos(rendered):
    """requests == limits for cpu, memory and nvidia.com/gpu in every container of a GPU worker,
    init containers included: QoS Guaranteed (evicted last, whole cores with the static CPU manager)."""
    for name in gpu_renders(rendered):
        objects = rendered[name]
        for role in ("prefill", "decode"):
            spec = deployment(objects, role)["spec"]["template"]["spec"]
            where = f"{name} {role}"
            assert qos_class(spec) == "Guaranteed", f"{where}: QoS {qos_class(spec)}: " + \
                str({c["name"]: c.get("resources") for c in spec.get("initContainers", []) + spec["containers"]})
            for c in spec.get("initContainers", []) + spec["containers"]:
                assert gpus(c, "requests") == gpus(c, "limits"), f"{where} {c['name']}: {c['resources']}"
            assert gpus(main_container(deployment(objects, role)), "limits") >= 1, f"{where}: no GPU"


def dockerfile_arg_defaults():
    """{ARG: default} of every ARG in the Dockerfile that has one (quotes removed)."""
    out = {}
    for stage in parse_dockerfile():
        for args in stage.all("ARG"):
            name, eq, value = args.partition("=")
            if eq:
                out[name.strip()] = value.strip().strip('"')
    return out


# Oldest driver branch that runs each CUDA major release (NVIDIA's CUDA release notes, "CUDA Toolkit
# and Minimum Required Driver Version", minor version compatibility).
MIN_DRIVER = {12: 525, 13: 580}


def node_matches(spec, labels):
    """Whether a node with `labels` satisfies a pod's nodeSelector and required node affinity."""
    if any(labels.get(k) != v for k, v in spec.get("nodeSelector", {}).items()):
        return False
    required = spec.get("affinity", {}).get("nodeAffinity", {}).get("requiredDuringSchedulingIgnoredDuringExecution")
    if required is None:
        return True

    def holds(e):
        value, op = labels.get(e["key"]), e["operator"]
        if op in ("Gt", "Lt"):
            if value is None or not value.lstrip("-").isdigit():
                return False
            return int(value) > int(e["values"][0]) if op == "Gt" else int(value) < int(e["values"][0])
        return {"In": value in e.get("values", []), "NotIn": value not in e.get("values", []),
                "Exists": value is not None, "DoesNotExist": value is None}[op]

    return any(t.get("matchExpressions") and all(holds(e) for e in t["matchExpressions"])
               for t in required["nodeSelectorTerms"])


def test_gpu_workers_land_only_on_gpus_the_image_runs_on(rendered):
    """Required node affinity on NVIDIA GPU feature discovery's labels: compute capability at least
    the lowest sm_XX the image's CUDA_GENCODE builds, and a driver for the image's CUDA_VERSION;
    runtimeClassName nvidia. The frontend stays off both."""
    args = dockerfile_arg_defaults()
    archs = [int(a) for a in re.findall(r"code=(?:sm|compute)_(\d+)", args["CUDA_GENCODE"])]
    assert archs, args["CUDA_GENCODE"]
    major = min(archs) // 10
    cuda_major = int(args["CUDA_VERSION"].split(".")[0])
    assert cuda_major in MIN_DRIVER, f"CUDA {args['CUDA_VERSION']}: add its minimum driver to MIN_DRIVER"
    driver = MIN_DRIVER[cuda_major]
    node = {"nvidia.com/gpu.present": "true", "nvidia.com/gpu.product": "NVIDIA-H100-80GB-HBM3",
            "nvidia.com/gpu.compute.major": str(major), "nvidia.com/gpu.compute.minor": "0",
            "nvidia.com/cuda.driver.major": str(driver), "nvidia.com/cuda.driver.minor": "65"}
    for name in gpu_renders(rendered):
        objects = rendered[name]
        for role in ("prefill", "decode"):
            spec = deployment(objects, role)["spec"]["template"]["spec"]
            where = f"{name} {role}"
            assert spec.get("runtimeClassName") == "nvidia", f"{where}: runtimeClassName {spec.get('runtimeClassName')}"
            assert node_matches(spec, node), f"{where}: refuses a compute {major}.0 GPU with driver {driver}"
            assert node_matches(spec, node | {"nvidia.com/gpu.compute.major": str(major + 1)}), where
            assert not node_matches(spec, node | {"nvidia.com/gpu.compute.major": str(major - 1)}), \
                f"{where}: would run on compute capability {major - 1}.x, below the image's sm_{min(archs)}"
            assert not node_matches(spec, node | {"nvidia.com/cuda.driver.major": str(driver - 1)}), \
                f"{where}: would run on driver {driver - 1}, too old for CUDA {args['CUDA_VERSION']}"
            assert not node_matches(spec, {}), f"{where}: would run on a node without GPU labels"
    for name, objects in rendered.items():
        spec = deployment(objects, "frontend")["spec"]["template"]["spec"]
        assert "runtimeClassName" not in spec and node_matches(spec, {}), f"{name}: the frontend is tied to GPU nodes"
        if not name.startswith("gpu"):
            for role in ROLES:
                assert "runtimeClassName" not in deployment(objects, role)["spec"]["template"]["spec"], f"{name} {role}"


def test_gpu_overlay_gives_workers_gpus(rendered):
    for name in gpu_renders(rendered):
        objects = rendered[name]
        for role in ("prefill", "decode"):
            dep = deployment(objects, role)
            c = main_container(dep)
            assert gpus(c, "requests") >= 1 and gpus(c, "requests") == gpus(c, "limits"), f"{name} {role}: {c['resources']}"
            assert container_env(objects, c).get("BATON_DEVICE") == "cuda", f"{name} {role}: not on the CUDA backend"
            spec = dep["spec"]["template"]["spec"]
            assert any(t["key"] == "nvidia.com/gpu" for t in spec.get("tolerations", []))
        frontend = main_container(deployment(objects, "frontend"))
        assert gpus(frontend, "requests") == gpus(frontend, "limits") == 0, "the frontend needs no GPU"


def test_cpu_overlay_needs_no_gpu(rendered):
    names = [n for n in rendered if n == "cpu" or n.startswith("cpu+")]
    assert "cpu" in names
    for name in names:
        for o in rendered[name]:
            assert "nvidia.com/gpu" not in yaml.safe_dump(o), f"{name}: {o['kind']}/{o['metadata']['name']} asks for a GPU"


# ---- NCCL ----------------------------------------------------------------------------------------

NCCL_SETTINGS = ("NCCL_SOCKET_IFNAME", "NCCL_IB_DISABLE", "NCCL_DEBUG")


def test_nccl_settings_only_with_the_nccl_transport(rendered):
    """NCCL_* variables and the /dev/shm for NCCL exactly on the pods that run --kv-transport nccl:
    prefill and decode together, on GPUs with the CUDA backend. The gpu overlay keeps tcp; the
    kv-nccl variant switches both workers."""
    with_nccl = []
    for name, objects in rendered.items():
        for role in ROLES:
            dep = deployment(objects, role)
            c = main_container(dep)
            env = container_env(objects, c)
            where = f"{name} {role}"
            nccl_vars = sorted(k for k in env if k.startswith("NCCL_"))
            shm = [m for m in c.get("volumeMounts", []) if m["mountPath"] == "/dev/shm"]
            if env.get("BATON_KV_TRANSPORT", "tcp") != "nccl":
                assert not nccl_vars, f"{where}: {nccl_vars} set without BATON_KV_TRANSPORT=nccl"
                assert not shm, f"{where}: a /dev/shm for NCCL without NCCL"
                continue
            with_nccl.append(where)
            assert role in ("prefill", "decode"), f"{where}: nccl is between prefill and decode workers"
            assert set(NCCL_SETTINGS) <= set(nccl_vars), f"{where}: NCCL without {set(NCCL_SETTINGS) - set(nccl_vars)}"
            assert gpus(c, "limits") >= 1 and env.get("BATON_DEVICE") == "cuda", f"{where}: nccl without a GPU"
            assert shm and pod_volume(dep["spec"]["template"]["spec"], shm[0]["name"])["emptyDir"]["medium"] == "Memory", \
                f"{where}: NCCL needs a memory-backed /dev/shm larger than the runtime's 64 MiB"
        assert (kv_transport(objects, "prefill") == "nccl") == (kv_transport(objects, "decode") == "nccl"), \
            f"{name}: only one end of the KV hand-off is set up for NCCL"
    assert kv_transport(rendered["gpu"], "prefill") == "tcp", "the gpu overlay is documented to keep tcp"
    assert with_nccl, "no rendered variant runs the nccl transport (deploy_helpers.VARIANTS: gpu+kv-nccl)"
