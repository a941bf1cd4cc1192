#!/usr/bin/env bash
# Installs what baton builds and tests with: Debian packages (toolchain, gRPC, protobuf, spdlog,
# prometheus-cpp, Catch2, oneDNN, PCRE2, CLI11, nlohmann-json, ccache, ninja, clang for the
# fuzzer) and the Python test dependencies. Idempotent: installed packages are skipped.
set -euo pipefail

apt_packages=(
  build-essential cmake ninja-build ccache pkg-config clang curl
  libgrpc++-dev protobuf-compiler-grpc libprotobuf-dev protobuf-compiler
  libspdlog-dev prometheus-cpp-dev catch2 libdnnl-dev libpcre2-dev libcli11-dev nlohmann-json3-dev
  prometheus
)
# Test-only Python packages, pinned: the independent references (numpy forward over the GGUF,
# HF tokenizer built from the GGUF), the Python gRPC client the serving tests use, and the runner.
pip_packages=(pytest==9.2.0 numpy==2.4.6 gguf==0.19.0 tokenizers==0.23.3 transformers==5.24.0
  grpcio==1.85.3 grpcio-tools==1.85.1 protobuf==7.36.2)

sudo_cmd=()
[[ $(id -u) -ne 0 ]] && sudo_cmd=(sudo)
missing=()
for p in "${apt_packages[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
if ((${#missing[@]})); then
  echo "install-deps: apt-get install ${missing[*]}" >&2
  "${sudo_cmd[@]}" apt-get update -qq
  DEBIAN_FRONTEND=noninteractive "${sudo_cmd[@]}" apt-get install -y -qq --no-install-recommends "${missing[@]}" >&2
fi

# kubectl (with kustomize) renders the Kubernetes manifests in tests/deploy. This machine image
# ships it; Debian's own kubernetes-client (1.20) is too old for kustomize components.
if ! command -v kubectl >/dev/null; then
  echo "install-deps: apt-get install kubectl" >&2
  DEBIAN_FRONTEND=noninteractive "${sudo_cmd[@]}" apt-get install -y -qq kubectl >&2 ||
    echo "install-deps: kubectl is not available; tests/deploy will fail to render manifests" >&2
fi

if ! python3 -c 'import pytest, numpy, gguf, tokenizers, transformers, grpc, grpc_tools' 2>/dev/null; then
  echo "install-deps: pip install ${pip_packages[*]}" >&2
  python3 -m pip install --quiet "${pip_packages[@]}" >&2
fi
# The deployment tests' pinned validators (Kubernetes schemas bundled, offline).
if ! python3 -c 'import kubernetes_validate, jsonschema, yaml' 2>/dev/null; then
  echo "install-deps: pip install -r tests/deploy/requirements.txt" >&2
  python3 -m pip install --quiet -r "$(dirname "$0")/../tests/deploy/requirements.txt" >&2
fi
