#!/usr/bin/env bash
# Installs what baton builds and runs with, on Debian 12 from a bare system up:
#   - Debian packages: the toolchain and libraries (gRPC, protobuf, spdlog, prometheus-cpp, oneDNN,
#     PCRE2, CLI11, nlohmann-json, cpp-httplib) and Debian's python3 with venv;
#   - a Python virtual environment (scripts/env.sh says where) with pip, which fetch-model uses.
# With --containers, what builds and runs the image (scripts/build-image.sh, scripts/deploy-local.sh):
# podman, buildah and runc, debootstrap (the local base image), and a containers.conf drop-in that
# makes them work on this machine kind (below, with the reason for each setting).
# With --tests, also what the tests need: Catch2, clang (the fuzzer), Prometheus and promtool, the
# pinned Python test packages (tests/requirements.txt) in the same venv, a pinned kubectl, and
# everything --containers installs (tests/deploy plays the manifests under podman).
# Idempotent: what is installed already is skipped. Proven on a fresh Debian 12 root file system by
# scripts/fresh-machine-check.sh.
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
# shellcheck source=scripts/env.sh
source "$here/env.sh"

with_tests=0 with_containers=0
for arg in "$@"; do
  case "$arg" in
    --tests) with_tests=1 with_containers=1 ;;
    --containers) with_containers=1 ;;
    *) echo "install-deps: unknown argument '$arg' (usage: install-deps.sh [--containers] [--tests])" >&2; exit 2 ;;
  esac
done

# What the binaries build with (deploy/docker/Dockerfile installs the same list; a test checks it).
# ocl-icd-opencl-dev: oneDNN's dnnl-config.cmake requires OpenCL, which libdnnl-dev only recommends.
build_packages=(
  build-essential cmake ninja-build pkg-config
  libgrpc++-dev protobuf-compiler-grpc libprotobuf-dev protobuf-compiler
  libspdlog-dev prometheus-cpp-dev libdnnl-dev ocl-icd-opencl-dev libpcre2-dev libcli11-dev
  nlohmann-json3-dev libssl-dev libcpp-httplib-dev
)
# The developer's tools around the build: ccache, Debian's python3 for the venv (a minimal system
# has none, and PEP 668 forbids pip outside a venv), certificates and curl for the registries.
tool_packages=(ccache python3 python3-venv ca-certificates curl)
# Only for the tests: Catch2, clang and its runtimes (libFuzzer, sanitizers: libclang-rt-14-dev,
# which clang only recommends; OpenMP: libomp-dev, for the fuzz targets' engine build) for the fuzz
# targets, Prometheus and promtool, iproute2
# and procps for the process and network tests, openssl to make the TLS tests' certificates,
# unzip for the model scripts' tests (the image's model fetch unpacks the wheel with it).
test_packages=(catch2 clang libclang-rt-14-dev libomp-dev prometheus iproute2 procps openssl unzip)

# The image and the local deployment: podman with buildah (Containerfile builds) and runc (crun,
# podman's default runtime, refuses this kernel's hybrid cgroup hierarchy); netavark and
# aardvark-dns (a pod network whose DNS resolves pod names), iptables (its NAT for published
# ports), catatonit (the pods' infra container), debootstrap (a base image made from Debian's
# packages when no registry is reachable), python3-yaml (deploy-local.sh edits the rendered YAML).
container_packages=(podman buildah runc netavark aardvark-dns iptables catatonit debootstrap python3-yaml)

packages=("${build_packages[@]}" "${tool_packages[@]}")
((with_containers)) && packages+=("${container_packages[@]}")
((with_tests)) && packages+=("${test_packages[@]}")

sudo_cmd=()
[[ $(id -u) -ne 0 ]] && sudo_cmd=(sudo)
missing=()
for p in "${packages[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
if ((${#missing[@]})); then
  echo "install-deps: apt-get install ${missing[*]}" >&2
  "${sudo_cmd[@]}" apt-get update -qq
  DEBIAN_FRONTEND=noninteractive "${sudo_cmd[@]}" apt-get install -y -qq --no-install-recommends "${missing[@]}" >&2
fi

# The venv, made from Debian's python3 (not whatever python3 comes first on PATH) so that every
# machine runs the tests on the same interpreter.
if [[ ! -x "$BATON_VENV/bin/python" ]]; then
  echo "install-deps: python3 -m venv $BATON_VENV" >&2
  mkdir -p "$(dirname "$BATON_VENV")"
  /usr/bin/python3 -m venv "$BATON_VENV"
fi

if ((with_containers)); then
  "$here/containers-conf.sh"
fi

((with_tests)) || exit 0

# Pinned Python test packages. The stamp holds the requirements' hash: a changed pin reinstalls.
requirements="$here/../tests/requirements.txt"
stamp="$BATON_VENV/.baton-test-requirements"
want="$(cat "$requirements" "$here/../tests/deploy/requirements.txt" | sha256sum | cut -d' ' -f1)"
if [[ "$(cat "$stamp" 2>/dev/null)" != "$want" ]]; then
  echo "install-deps: pip install -r tests/requirements.txt (into $BATON_VENV)" >&2
  "$BATON_VENV/bin/python" -m pip install --quiet --disable-pip-version-check -r "$requirements" >&2
  echo "$want" >"$stamp"
fi

"$here/fetch-kubectl.sh" >/dev/null
