"""The Kubernetes manifests' security (deploy/k8s), on every overlay and variant as
`kubectl kustomize` renders them: every plane authenticated with certificates mounted from the
Secrets cert-manager issues (mutual TLS inside, TLS outside, each plane its own CA), NetworkPolicies
that let through only the data flow between the roles (and NCCL's ports only where the workers use
NCCL), and pods that run as the image's user without privileges. The rest of the manifests is in
test_k8s_manifests.py."""

from deploy_helpers import (ROLES, container_env, deployment, find, kv_transport, labels_match, main_container,
                            named_ports, runtime_stage)


def image_user_id():
    user = runtime_stage().all("USER")[-1]
    return int(user.split(":")[0])


# ---- transport security -----------------------------------------------------------------------

def secret_file(objects, dep, container, path):
    """(Secret name, key) of the file at `path` in a container: a mounted Secret volume's key."""
    volumes = {v["name"]: v for v in dep["spec"]["template"]["spec"].get("volumes", [])}
    for m in container.get("volumeMounts", []):
        prefix = m["mountPath"].rstrip("/") + "/"
        if path.startswith(prefix) and "secret" in volumes.get(m["name"], {}):
            assert m.get("readOnly"), f"{m['name']} is mounted writable"
            return volumes[m["name"]]["secret"]["secretName"], path[len(prefix):]
    return None, None


def test_every_plane_is_authenticated_with_mounted_certificates(rendered):
    """No role runs --insecure: the internal plane is mutual TLS on every role and the public API
    TLS, each file a key of a mounted Secret that a cert-manager Certificate issues (with the keys
    cert-manager writes), for names the Services use."""
    for name, objects in rendered.items():
        certificates = {c["spec"]["secretName"]: c for c in find(objects, "Certificate")}
        for role in ROLES:
            dep = deployment(objects, role)
            c = main_container(dep)
            env = container_env(objects, c)
            where = f"{name} {role}"
            assert "--insecure" not in c.get("args", []) and env.get("BATON_INSECURE") in (None, "false"), where
            wanted = {"BATON_INTERNAL_TLS_CERT": "tls.crt", "BATON_INTERNAL_TLS_KEY": "tls.key",
                      "BATON_INTERNAL_TLS_CA": "ca.crt"}
            if role == "frontend":
                wanted |= {"BATON_TLS_CERT": "tls.crt", "BATON_TLS_KEY": "tls.key"}
            for var, key in wanted.items():
                assert var in env, f"{where}: {var} is not set"
                secret, got = secret_file(objects, dep, c, env[var])
                assert secret, f"{where}: {var}={env[var]} is in no mounted Secret"
                assert got == key, f"{where}: {var} reads key {got} of Secret {secret}; cert-manager writes {key}"
                assert secret in certificates, f"{where}: no Certificate issues Secret {secret}"
            internal = certificates[secret_file(objects, dep, c, env["BATON_INTERNAL_TLS_CERT"])[0]]["spec"]
            assert {"server auth", "client auth"} <= set(internal["usages"]), f"{where}: {internal['usages']}"
            assert {"baton-prefill", "baton-decode"} <= set(internal["dnsNames"])
        front = deployment(objects, "frontend")
        fenv = container_env(objects, main_container(front))
        public = certificates[secret_file(objects, front, main_container(front), fenv["BATON_TLS_CERT"])[0]]["spec"]
        assert "baton" in public["dnsNames"], f"{name}: the public certificate does not name Service baton"
        issuers = {i["metadata"]["name"] for i in find(objects, "Issuer")}
        for cert in certificates.values():
            assert cert["spec"]["issuerRef"]["name"] in issuers, f"{name}: {cert['metadata']['name']}'s issuer"
        # The two planes trust different CAs: a public certificate opens no worker.
        assert internal["issuerRef"]["name"] != public["issuerRef"]["name"]


# ---- network policies -------------------------------------------------------------------------

def ingress_allowed(objects, src_labels, dst_role, port):
    """Whether the rendered NetworkPolicies let a pod with `src_labels` (None: something outside
    the namespace's pods) reach `dst_role`'s pods on `port` (a container port name or number)."""
    dst = deployment(objects, dst_role)
    labels = dst["spec"]["template"]["metadata"]["labels"]
    named = named_ports(main_container(dst))
    number = named.get(port, port)
    policies = [p for p in find(objects, "NetworkPolicy")
                if "Ingress" in p["spec"].get("policyTypes", ["Ingress"]) and labels_match(p["spec"]["podSelector"], labels)]
    if not policies:
        return True
    for p in policies:
        for rule in p["spec"].get("ingress", []):
            peers = rule.get("from")
            if peers is not None:
                if src_labels is None or not any("podSelector" in peer and labels_match(peer["podSelector"], src_labels)
                                                 for peer in peers):
                    continue
            ports = rule.get("ports")
            def matches(q):
                if "port" not in q:
                    return True
                if "endPort" in q:
                    return isinstance(number, int) and q["port"] <= number <= q["endPort"]
                return q["port"] in (port, number) or named.get(q["port"]) == number
            if ports is None or any(matches(q) for q in ports):
                return True
    return False


def test_network_policies_allow_only_the_data_flow(rendered):
    for name, objects in rendered.items():
        nccl = kv_transport(objects, "prefill") == "nccl"
        role_labels = {r: deployment(objects, r)["spec"]["template"]["metadata"]["labels"] for r in ROLES}
        want = {  # (from, to, port): allowed
            (None, "frontend", "grpc"): True, (None, "prefill", "grpc"): False, (None, "decode", "grpc"): False,
            (None, "frontend", "http"): True, ("prefill", "frontend", "http"): True,
            ("frontend", "prefill", "grpc"): True, ("frontend", "decode", "grpc"): True,
            ("prefill", "decode", "grpc"): True, ("decode", "prefill", "grpc"): False,
            ("decode", "decode", "grpc"): False,
            (None, "decode", "metrics"): True, (None, "prefill", "health"): True,
            (None, "decode", 40000): False, ("frontend", "decode", 40000): False,
            # NCCL's own ports, between the workers only, and only where they use NCCL.
            ("prefill", "decode", 40000): nccl, ("decode", "prefill", 40000): nccl,
        }
        for (src, dst, port), allowed in want.items():
            got = ingress_allowed(objects, role_labels.get(src), dst, port)
            assert got == allowed, f"{name}: {src or 'outside'} -> {dst}:{port} allowed={got}, want {allowed}"


# ---- pod privileges ---------------------------------------------------------------------------

def test_pods_run_as_the_image_user_without_privileges(rendered):
    uid = image_user_id()
    assert uid != 0
    for name, objects in rendered.items():
        for o in objects:
            if o["kind"] not in ("Deployment", "Job"):
                continue
            spec = o["spec"]["template"]["spec"]
            where = f"{name} {o['kind']}/{o['metadata']['name']}"
            sc = spec["securityContext"]
            assert sc["runAsNonRoot"] and sc["runAsUser"] == uid, f"{where}: runs as {sc.get('runAsUser')}, image USER {uid}"
            assert spec.get("enableServiceLinks") is False, \
                f"{where}: service links would inject BATON_* variables named after the Services"
            for c in spec.get("initContainers", []) + spec["containers"]:
                csc = c["securityContext"]
                assert csc["allowPrivilegeEscalation"] is False and csc["readOnlyRootFilesystem"] is True, where
                assert csc["capabilities"]["drop"] == ["ALL"], where
                if csc["readOnlyRootFilesystem"] and c["name"] != "wait-for-model":
                    assert any(m["mountPath"] == "/tmp" for m in c.get("volumeMounts", [])), f"{where} {c['name']}: no writable /tmp"
