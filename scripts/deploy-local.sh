#!/usr/bin/env bash
# Plays baton's Kubernetes manifests on this machine with `podman kube play`: the cpu overlay as
# deploy/podman adapts it (frontend, prefill and decode as separate pods on one podman network).
#
#   scripts/deploy-local.sh up   [--image IMAGE] [--http-port N] [--grpc-port N] [--overlay DIR]
#                                [--timeout SECONDS]
#   scripts/deploy-local.sh down [--overlay DIR]
#
# up: renders the overlay (kubectl kustomize), makes the internal plane's mutual-TLS Secret (an
# internal CA and one certificate for every role, as components/cert-manager issues them), fills
# the model volume by running the model Job's pod once (podman has no Jobs) from the host's copy
# of the model (scripts/fetch-model.sh), starts the three Deployments' pods, and waits until the
# frontend serves. Its last two lines are the OpenAI base URL and the gRPC address, both on the
# host's loopback (defaults: 8080 and 50051).
# down: removes every pod, container, volume, Secret and network `up` made (the image stays), and
# fails if anything is left.
#
# --image: the image the pods run (default localhost/baton:VERSION-cpu, scripts/build-image.sh's).
# --overlay: a kustomization to play instead of deploy/podman (e.g. one that adds to it: tests/deploy
# makes one with a shorter stall timeout). BATON_DEPLOY_KEEP=1: a failed `up` leaves what it made
# for a look (`down` removes it). Needs root (rootful podman); install-deps.sh --containers
# installs podman and its settings.
set -euo pipefail
top="$(cd "$(dirname "$0")/.." && pwd)"
# shellcheck source=scripts/env.sh
source "$top/scripts/env.sh"

usage() { sed -n '2,22p' "$0" | sed 's/^# \{0,1\}//' >&2; exit 2; }
(($#)) || usage
action="$1"; shift
[[ "$action" == up || "$action" == down ]] || usage
version="$(sed -n 's/^project(baton VERSION \([0-9.]*\).*/\1/p' "$top/CMakeLists.txt")"
image="localhost/baton:$version-cpu" http_port=8080 grpc_port=50051 overlay="$top/deploy/podman" timeout=300
while (($#)); do
  case "$1" in
    --image) image="${2:?--image needs IMAGE}"; shift ;;
    --http-port) http_port="${2:?--http-port needs a port}"; shift ;;
    --grpc-port) grpc_port="${2:?--grpc-port needs a port}"; shift ;;
    --overlay) overlay="$(cd "${2:?--overlay needs DIR}" && pwd)"; shift ;;
    --timeout) timeout="${2:?--timeout needs seconds}"; shift ;;
    -h|--help) usage ;;
    *) echo "deploy-local: unknown argument '$1' (see --help)" >&2; exit 2 ;;
  esac
  shift
done
for p in "$http_port" "$grpc_port"; do
  [[ "$p" =~ ^[0-9]+$ ]] && ((p >= 1 && p <= 65535)) || { echo "deploy-local: '$p' is not a port" >&2; exit 2; }
done
[[ "$timeout" =~ ^[0-9]+$ ]] || { echo "deploy-local: --timeout '$timeout' is not a number of seconds" >&2; exit 2; }
[[ $(id -u) -eq 0 ]] || { echo "deploy-local: run as root (rootful podman: pods on a network with DNS)" >&2; exit 2; }

"$top/scripts/install-deps.sh" --containers
kubectl="$("$top/scripts/fetch-kubectl.sh")"
network=baton
state="$BATON_CACHE/deploy-local"
start=$(date +%s)
log() { echo "deploy-local: $*" >&2; }

# The overlay, rendered and split into what podman plays, in order: storage.yaml (the volume
# claims), jobs.yaml (the model Job as a pod) and deployments.yaml (each with the ConfigMaps its
# pods read). $state/names lists what `up` makes, for `down`: "job NAME CONTAINER", "pod NAME",
# "volume NAME", "secret NAME".
render() {  # render MIRROR_DIR SECRET_YAML_FILE
  "$kubectl" kustomize "$overlay" >"$state/rendered.yaml"
  /usr/bin/python3 - "$state" "$1" "$2" "$image" "$http_port" "$grpc_port" <<'PY'
import sys
import yaml

state, mirror, secret_file, image, http_port, grpc_port = sys.argv[1:]
docs = [d for d in yaml.safe_load_all(open(f"{state}/rendered.yaml")) if d]
playable = {"ConfigMap", "Deployment", "Job", "PersistentVolumeClaim"}
unknown = sorted({d["kind"] for d in docs} - playable)
if unknown:
    sys.exit(f"deploy-local: the overlay renders {unknown}, which podman kube play does not play here: "
             "remove them in the overlay (deploy/podman/kustomization.yaml shows how)")

def pod_specs(d):
    return [d["spec"]["template"]["spec"]] if d["kind"] in ("Deployment", "Job") else []

for d in docs:
    for spec in pod_specs(d):
        for c in spec.get("initContainers", []) + spec["containers"]:
            if c["image"].split("/")[-1].split(":")[0] == "baton":
                c["image"] = image
            for port in c.get("ports", []):
                if "hostPort" in port:
                    port["hostPort"] = int({8080: http_port, 50051: grpc_port}.get(port["containerPort"], port["hostPort"]))
        for v in spec.get("volumes", []):
            if v["name"] == "mirror" and "hostPath" in v:
                v["hostPath"]["path"] = mirror

config_maps = [d for d in docs if d["kind"] == "ConfigMap"]
def with_config_maps(objects):
    return config_maps + objects

def dump(name, objects):
    with open(f"{state}/{name}", "w") as f:
        yaml.safe_dump_all(objects, f, sort_keys=False)

claims = [d for d in docs if d["kind"] == "PersistentVolumeClaim"]
secret = yaml.safe_load(open(secret_file))
dump("storage.yaml", claims)
# podman has no Jobs: the Job's pod, once (restartPolicy Never: `up` reports a failure with its log).
jobs = []
for d in docs:
    if d["kind"] == "Job":
        template = d["spec"]["template"]
        spec = dict(template["spec"], restartPolicy="Never")
        jobs.append({"apiVersion": "v1", "kind": "Pod",
                     "metadata": {"name": d["metadata"]["name"], "labels": template["metadata"].get("labels", {})},
                     "spec": spec})
dump("jobs.yaml", with_config_maps(jobs))
deployments = [d for d in docs if d["kind"] == "Deployment"]
dump("deployments.yaml", with_config_maps(deployments))
with open(f"{state}/names", "w") as f:
    for j in jobs:
        print("job", j["metadata"]["name"], j["spec"]["containers"][0]["name"], file=f)
    for d in deployments:
        print("pod", d["metadata"]["name"] + "-pod-0", file=f)  # podman names a Deployment's pod so
    for c in claims:
        print("volume", c["metadata"]["name"], file=f)
    # podman keeps a volume for each ConfigMap and Secret a pod mounts, named after it.
    mounted = set()
    for spec in [d["spec"]["template"]["spec"] for d in deployments] + [j["spec"] for j in jobs]:
        for v in spec.get("volumes", []):
            mounted.add(v["configMap"]["name"] if "configMap" in v else v.get("secret", {}).get("secretName"))
    for name in sorted(n for n in mounted if n):
        print("volume", name, file=f)
    print("secret", secret["metadata"]["name"], file=f)
PY
}

secret_by_hand() { [[ "$(podman version --format '{{.Client.Version}}')" == 4.[0-3].* ]]; }

# The internal plane's CA and the certificate every role presents and checks peers with (both
# usages), as components/cert-manager issues them; a Secret of type kubernetes.io/tls with ca.crt.
make_secret() {  # make_secret OUT_YAML
  local dir="$state/tls"
  mkdir -p "$dir"
  openssl req -x509 -newkey ec -pkeyopt ec_paramgen_curve:P-256 -nodes -days 30 -subj "/CN=baton-internal-ca" \
    -addext basicConstraints=critical,CA:TRUE -addext keyUsage=critical,keyCertSign,cRLSign \
    -keyout "$dir/ca.key" -out "$dir/ca.crt" 2>/dev/null
  openssl req -newkey ec -pkeyopt ec_paramgen_curve:P-256 -nodes -subj "/CN=baton-internal" \
    -keyout "$dir/tls.key" -out "$dir/tls.csr" 2>/dev/null
  openssl x509 -req -in "$dir/tls.csr" -CA "$dir/ca.crt" -CAkey "$dir/ca.key" -CAcreateserial -days 30 \
    -extfile <(printf '%s\n' "subjectAltName=DNS:baton-frontend,DNS:baton-prefill,DNS:baton-decode" \
                 "keyUsage=critical,digitalSignature" "extendedKeyUsage=serverAuth,clientAuth") \
    -out "$dir/tls.crt" 2>/dev/null
  # podman 4.3 writes a Secret's data into the volume without base64-decoding it (podman issue
  # 17071, fixed in 4.4), while its kube play refuses data that is not base64: that version gets
  # the files as they are, in a podman secret made directly (secret_by_hand).
  local encode=1
  secret_by_hand && encode=0
  /usr/bin/python3 - "$dir" "$encode" "$1" <<'PY'
import base64, sys, yaml
d, encode, out = sys.argv[1], sys.argv[2] == "1", sys.argv[3]
data = {}
for key in ("tls.crt", "tls.key", "ca.crt"):
    raw = open(f"{d}/{key}", "rb").read()
    data[key] = base64.b64encode(raw).decode() if encode else raw.decode()
yaml.safe_dump({"apiVersion": "v1", "kind": "Secret", "type": "kubernetes.io/tls",
                "metadata": {"name": "baton-internal-tls"}, "data": data}, open(out, "w"), sort_keys=False)
PY
  rm -f "$dir/ca.key" "$dir/tls.csr" "$dir/ca.srl"
}

remove_all() {  # everything named in $state/names, the network, and pods podman made from baton's labels
  local kind name rest left=()
  if [[ -f "$state/names" ]]; then
    while read -r kind name rest; do
      case "$kind" in
        pod|job) podman pod rm --force --time 45 "$name" >/dev/null 2>&1 || true ;;
      esac
    done <"$state/names"
  fi
  for label in app.kubernetes.io/name=baton app.kubernetes.io/name=baton-fetch-model; do
    podman pod ps --quiet --filter "label=$label" | xargs -r podman pod rm --force --time 45 >/dev/null 2>&1 || true
  done
  if [[ -f "$state/names" ]]; then
    while read -r kind name rest; do
      case "$kind" in
        volume) podman volume rm --force "$name" >/dev/null 2>&1 || true ;;
        secret) podman secret rm "$name" >/dev/null 2>&1 || true ;;
      esac
    done <"$state/names"
  fi
  podman network rm --force "$network" >/dev/null 2>&1 || true
  # What is left of it, if anything.
  if [[ -f "$state/names" ]]; then
    while read -r kind name rest; do
      case "$kind" in
        pod|job) podman pod exists "$name" && left+=("pod $name") ;;
        volume) podman volume exists "$name" && left+=("volume $name") ;;
        secret) podman secret inspect "$name" >/dev/null 2>&1 && left+=("secret $name") ;;
      esac
    done <"$state/names"
  fi
  podman network exists "$network" && left+=("network $network")
  while read -r c; do [[ -n "$c" ]] && left+=("container $c"); done < <(podman ps -a --format '{{.Names}}' --filter label=app.kubernetes.io/name=baton)
  if ((${#left[@]})); then
    log "left behind: ${left[*]}"
    return 1
  fi
  rm -rf "$state"
}

# podman kube play, its output kept in $state/podman.log: on this machine kind it writes errors
# that are none (no syslog, no systemd for health-check timers) on every call.
play() {
  podman kube play "$@" >>"$state/podman.log" 2>&1 || { tail -20 "$state/podman.log" >&2; return 1; }
}

dump_failure() {  # the pods' state and their last log lines
  podman ps -a --format '{{.Names}} {{.Status}}' >&2 || true
  while read -r c; do
    echo "---- $c (last 20 lines)" >&2
    podman logs --tail 20 "$c" >&2 || true
  done < <(podman ps -a --format '{{.Names}}' | grep -E '^baton-' | grep -v -- '-infra$' || true)
}

if [[ "$action" == down ]]; then
  mkdir -p "$state"
  if [[ ! -f "$state/names" ]]; then
    # No record of an `up` (it failed early, or the state was removed): name things from the overlay.
    make_secret "$state/secret.yaml" && render "$BATON_CACHE" "$state/secret.yaml" >/dev/null || true
  fi
  remove_all
  log "down: no baton pod, container, volume, Secret or network left ($(($(date +%s) - start)) s)"
  exit 0
fi

# ---- up --------------------------------------------------------------------------------------------
podman image exists "$image" || { log "no image $image: build it first (scripts/build-image.sh)"; exit 1; }
if podman pod ps --quiet --filter label=app.kubernetes.io/name=baton | grep -q .; then
  log "baton pods exist already: run 'scripts/deploy-local.sh down' first"
  exit 1
fi
for p in "$http_port" "$grpc_port"; do
  /usr/bin/python3 -c 'import socket, sys
s = socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1); s.bind(("127.0.0.1", int(sys.argv[1])))' "$p" 2>/dev/null ||
    { log "port $p on 127.0.0.1 is in use: pick another (--http-port / --grpc-port)"; exit 1; }
done
model="$("$top/scripts/fetch-model.sh")"
rm -rf "$state" && mkdir -p "$state"
make_secret "$state/secret.yaml"
render "$(dirname "$model")" "$state/secret.yaml"
trap 'status=$?; if ((status)); then log "up failed: removing what it made"; dump_failure; [[ -n "${BATON_DEPLOY_KEEP:-}" ]] || remove_all || true; fi' EXIT

podman network exists "$network" || podman network create "$network" >/dev/null
if secret_by_hand; then
  podman secret create baton-internal-tls "$state/secret.yaml" >/dev/null
else
  play "$state/secret.yaml"
fi
play "$state/storage.yaml"

# The model Job's pod: fills the volume (fetch-model.sh), then goes.
while read -r kind name container; do
  [[ "$kind" == job ]] || continue
  log "filling the model volume: Job $name as a pod"
  play --network "$network" "$state/jobs.yaml"
  code="$(podman wait "$name-$container" 2>>"$state/podman.log")"
  podman logs "$name-$container" 2>&1 | grep -v '^failed to connect to syslog' | sed 's/^/  /' >&2
  ((code == 0)) || { log "Job $name failed (exit $code)"; exit 1; }
  podman pod rm --force "$name" >/dev/null
done <"$state/names"

log "starting the pods ($image)"
play --network "$network" "$state/deployments.yaml"

# Served: the frontend's /health is 200 once it has a healthy prefill and decode worker.
deadline=$(($(date +%s) + timeout))
until curl --silent --fail --max-time 2 "http://127.0.0.1:$http_port/health" >/dev/null; do
  if (($(date +%s) > deadline)); then
    log "the frontend did not serve within $timeout s"
    exit 1
  fi
  sleep 1
done
log "up in $(($(date +%s) - start)) s: pods $(awk '$1 == "pod" {printf "%s ", $2}' "$state/names")on network $network"
echo "http://127.0.0.1:$http_port/v1"
echo "grpc 127.0.0.1:$grpc_port"
