#!/usr/bin/env bash
# Builds baton's container image with podman from deploy/docker/Dockerfile, prints its size, and
# checks that it starts as it will run under the manifests (non-root, read-only root file system).
#
#   scripts/build-image.sh [--cuda] [--prebuilt BUILD_DIR] [--tag IMAGE] [--base IMAGE@sha256:...]
#                          [--rebuild-base]
#
# The base image (Debian 12), pinned by digest as the Dockerfile requires:
#   --base REF@sha256:DIGEST   that image (a registry's, or one in local storage)
#   otherwise                  debian:bookworm-slim from Docker Hub, by the digest it has now; where
#                              no registry is reachable, a base made here from Debian's packages
#                              (debootstrap, trimmed as -slim is) and kept in local storage as
#                              localhost/baton-debian:bookworm (--rebuild-base makes it anew).
# The binaries:
#   default                    built from this checkout inside the image build (the Dockerfile's
#                              cuda-devel stage): portable (no -march=native), ~10 min on 2 cores
#   --prebuilt BUILD_DIR       BUILD_DIR/baton and BUILD_DIR/batonctl, built on this Debian 12 machine
#                              beforehand (scripts/build.sh: BUILD_DIR=build); a few minutes. Such a
#                              build uses this CPU's instructions (-march=native): the image then runs
#                              on CPUs like this one only. The tests build their image this way.
# --cuda: with the CUDA runtime (NVIDIA's Debian 12 repository must be reachable); tag baton:VERSION.
# Without it the image is CPU-only; tag baton:VERSION-cpu. --tag overrides either.
# Needs root or rootful podman (install-deps.sh --containers installs podman and its settings).
# The last line printed is the image's name.
set -euo pipefail
top="$(cd "$(dirname "$0")/.." && pwd)"
# shellcheck source=scripts/env.sh
source "$top/scripts/env.sh"

cuda=0 prebuilt="" tag="" base="" rebuild_base=0
while (($#)); do
  case "$1" in
    --cuda) cuda=1 ;;
    --prebuilt) prebuilt="${2:?--prebuilt needs BUILD_DIR}"; shift ;;
    --tag) tag="${2:?--tag needs IMAGE}"; shift ;;
    --base) base="${2:?--base needs IMAGE@sha256:DIGEST}"; shift ;;
    --rebuild-base) rebuild_base=1 ;;
    -h|--help) sed -n '2,27p' "$0" | sed 's/^# \{0,1\}//'; exit 0 ;;
    *) echo "build-image: unknown argument '$1' (see --help)" >&2; exit 2 ;;
  esac
  shift
done
[[ $(id -u) -eq 0 ]] || { echo "build-image: run as root (rootful podman; the local base needs debootstrap)" >&2; exit 2; }
if [[ -n "$base" && ! "$base" =~ ^[^@]+@sha256:[0-9a-f]{64}$ ]]; then
  echo "build-image: --base '$base' is not IMAGE@sha256:<64 hex digits>" >&2
  exit 2
fi
if [[ -n "$prebuilt" ]]; then
  for f in baton batonctl; do
    [[ -x "$prebuilt/$f" ]] || { echo "build-image: --prebuilt: no executable $prebuilt/$f (scripts/build.sh builds it)" >&2; exit 2; }
  done
fi

"$top/scripts/install-deps.sh" --containers

version="$(sed -n 's/^project(baton VERSION \([0-9.]*\).*/\1/p' "$top/CMakeLists.txt")"
[[ -n "$version" ]] || { echo "build-image: no project version in CMakeLists.txt" >&2; exit 1; }
if [[ -z "$tag" ]]; then
  tag="localhost/baton:$version"
  ((cuda)) || tag+="-cpu"
fi
start=$(date +%s)
scratch="$(mktemp -d /var/tmp/baton-image.XXXXXX)"
trap 'rm -rf "$scratch"' EXIT

# ---- the base image, by digest ---------------------------------------------------------------------
local_base=localhost/baton-debian:bookworm

# Debian 12 from the mirror this machine's apt uses, trimmed as the -slim images are (no manuals,
# documentation or translations, now or from later installs), imported into local storage.
make_local_base() {
  local root="$scratch/base" mirror
  mirror="$(awk '/^URIs:/ {print $2; exit}' /etc/apt/sources.list.d/debian.sources 2>/dev/null || true)"
  echo "build-image: no registry reachable: making $local_base with debootstrap --variant=minbase bookworm ${mirror:-}" >&2
  debootstrap --variant=minbase bookworm "$root" ${mirror:+"$mirror"} >"$scratch/debootstrap.log" 2>&1 || {
    tail -5 "$scratch/debootstrap.log" >&2
    return 1
  }
  # This machine's apt sources (the updates and security suites, its mirror): the image's apt-get
  # installs come from where this machine's do.
  if [[ -f /etc/apt/sources.list.d/debian.sources ]]; then
    cp /etc/apt/sources.list.d/debian.sources "$root/etc/apt/sources.list.d/"
    rm -f "$root/etc/apt/sources.list"
  fi
  cat >"$root/etc/dpkg/dpkg.cfg.d/baton-slim" <<'EOF'
# As in Debian's -slim images: no manuals, documentation (but the copyrights) or translations.
path-exclude /usr/share/man/*
path-exclude /usr/share/info/*
path-exclude /usr/share/doc/*
path-include /usr/share/doc/*/copyright
path-exclude /usr/share/locale/*
path-include /usr/share/locale/locale.alias
path-exclude /usr/share/groff/*
path-exclude /usr/share/lintian/*
EOF
  cat >"$root/etc/apt/apt.conf.d/baton-slim" <<'EOF'
// As in Debian's container images: downloaded packages and apt's binary caches are not kept.
APT::Keep-Downloaded-Packages "false";
Dir::Cache::pkgcache "";
Dir::Cache::srcpkgcache "";
EOF
  find "$root/usr/share/doc" -mindepth 1 -not -name copyright -not -type d -delete
  rm -rf "$root"/usr/share/{man,info,groff,lintian}/* "$root"/var/lib/apt/lists/* "$root"/var/cache/apt/*.bin \
    "$root"/var/cache/apt/archives/*.deb "$root"/var/log/*.log
  find "$root/usr/share/locale" -mindepth 1 -maxdepth 1 -not -name locale.alias -exec rm -rf {} +
  tar -C "$root" -c . | podman import \
    --change 'ENV PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin' \
    --change 'CMD ["bash"]' \
    --change 'LABEL org.opencontainers.image.description="Debian 12 (bookworm), minbase, made by baton scripts/build-image.sh"' \
    - "$local_base" >/dev/null
}

if [[ -z "$base" ]]; then
  if podman pull --quiet docker.io/library/debian:bookworm-slim >/dev/null 2>&1; then
    digest="$(podman image inspect --format '{{.Digest}}' docker.io/library/debian:bookworm-slim)"
    base="docker.io/library/debian@$digest"
    echo "build-image: base docker.io/library/debian:bookworm-slim is $digest: record it with the release" >&2
  else
    if ((rebuild_base)) || ! podman image exists "$local_base"; then
      make_local_base
    fi
    digest="$(podman image inspect --format '{{.Digest}}' "$local_base")"
    base="${local_base%:*}@$digest"
    echo "build-image: base $local_base ($digest, made $(podman image inspect --format '{{.Created}}' "$local_base" | cut -d. -f1))" >&2
  fi
fi

# ---- the image -------------------------------------------------------------------------------------
args=(--build-arg "DEBIAN_IMAGE=${base%@*}" --build-arg "DEBIAN_DIGEST=${base#*@}" --build-arg "WITH_CUDA=$cuda"
      --file "$top/deploy/docker/Dockerfile" --tag "$tag" --layers
      # RUN steps on the host's network: apt-get reaches the mirror as this machine does. From
      # podman's default bridge network a sandboxed machine of this kind resolved no names.
      --network host)
if [[ -n "$prebuilt" ]]; then
  context="$scratch/context"
  mkdir -p "$context"
  cp "$prebuilt/baton" "$prebuilt/batonctl" "$context/"
  strip "$context/baton" "$context/batonctl"
  "$top/deploy/docker/runtime-packages.sh" "$context/baton" "$context/batonctl" >"$context/runtime-packages.txt"
  if grep -q '^BATON_NATIVE:BOOL=ON' "$prebuilt/CMakeCache.txt" 2>/dev/null; then
    echo "build-image: $prebuilt was built with -march=native: the image runs on CPUs like this one only" >&2
  fi
  args+=(--build-arg BATON_BINARIES=prebuilt)
else
  context="$top"
  # Named although it is the default: buildah 1.28 decides which stages are used before it applies
  # an ARG's default to a FROM, and skipped cuda-devel as unused.
  args+=(--build-arg BATON_BINARIES=cuda-devel --ignorefile "$top/deploy/docker/Dockerfile.dockerignore")
fi
echo "build-image: podman build $tag ($([[ -n "$prebuilt" ]] && echo "binaries from $prebuilt" || echo "built from source"), base ${base%@*})" >&2
podman build "${args[@]}" "$context" >&2

# As the manifests run it: a non-root user, a read-only root file system, no capabilities.
got="$(podman run --rm --read-only --user 10001:10001 --cap-drop ALL --security-opt no-new-privileges "$tag" --version)"
[[ "$got" == "baton $version" ]] || { echo "build-image: '$tag --version' printed '$got', not 'baton $version'" >&2; exit 1; }
size="$(podman image inspect --format '{{.Size}}' "$tag")"
echo "build-image: $tag: $((size / 1000000)) MB, built in $(($(date +%s) - start)) s; '$got' as uid 10001 on a read-only root" >&2
echo "$tag"
