#!/bin/sh
# Prints the Debian packages that own the shared libraries the given binaries load, one per line,
# sorted: what an image that runs them installs (deploy/docker/Dockerfile; scripts/build-image.sh
# --prebuilt on the machine that built them). Fails when a library is missing or no package owns
# it (a library built or copied by hand belongs in no image). libcuda is skipped: the driver
# brings it at run time. POSIX sh; needs ldd and dpkg (Debian).
set -eu
[ "$#" -gt 0 ] || { echo "usage: runtime-packages.sh BINARY..." >&2; exit 2; }
missing="$(ldd "$@" | grep 'not found' | grep -v 'libcuda\.so' || true)"
if [ -n "$missing" ]; then
  echo "runtime-packages: unresolved libraries: $missing" >&2
  exit 1
fi
libs="$(ldd "$@" | awk '$2 == "=>" && $3 ~ /^\// {print $3}' | sort -u)"
owners=""
for lib in $libs; do
  real="$(readlink -f "$lib")"
  owner="$(dpkg -S "$real" 2>/dev/null || dpkg -S "${real#/usr}" 2>/dev/null || dpkg -S "$lib" 2>/dev/null)" || {
    echo "runtime-packages: no Debian package owns $lib" >&2
    exit 1
  }
  owners="$owners
$owner"
done
# "pkg1, pkg2: /path" (a path that several packages list) -> one package per line.
echo "$owners" | cut -d: -f1 | tr ',' '\n' | tr -d ' ' | grep -v '^$' | sort -u
