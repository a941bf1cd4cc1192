#!/usr/bin/env bash
# Proves the README's two commands on a machine that has never seen baton: debootstraps a minimal
# Debian 12 (bookworm) into DIR, copies this checkout into it (what a clone has: tracked and
# untracked-but-not-ignored files), and runs, as root in a chroot with a clean environment, the
# commands the README shows under "Run it" and "Test it" — read from README.md, so the check and
# the README cannot drift apart.
#
#   scripts/fresh-machine-check.sh [--run|--test|--both|--image] [--keep] DIR
#
# --run: only the run command (~9 min on 2 cores); --test: only the test command (~45 min);
# --both (default). --image: the README's "Run it locally with podman" commands (the image built
# from source with the full Dockerfile, the manifests played by podman), then a chat request
# through the OpenAI API and `deploy-local.sh down`; the host must not run a podman deployment of
# baton meanwhile (the chroot's podman shares the host's network stack). DIR is made anew unless
# --keep reuses a root file system made before (faster, but then it is no longer a fresh machine).
# Needs root, debootstrap (installed if missing) and the network path to Debian's and PyPI's
# registries. Logs: DIR.log. Exit code: the command's. Too slow for every CI run; run it after any
# change to scripts/, CMakeLists.txt, deploy/ or the README's commands.
set -euo pipefail

mode=both keep=0 dir=""
for arg in "$@"; do
  case "$arg" in
    --run) mode=run ;;
    --test) mode=test ;;
    --both) mode=both ;;
    --image) mode=image ;;
    --keep) keep=1 ;;
    -*) echo "fresh-machine-check: unknown flag $arg" >&2; exit 2 ;;
    *) dir="$arg" ;;
  esac
done
[[ -n "$dir" ]] || { sed -n '2,15p' "$0" | sed 's/^# \{0,1\}//' >&2; exit 2; }
[[ $(id -u) -eq 0 ]] || { echo "fresh-machine-check: needs root (debootstrap, chroot, mounts)" >&2; exit 2; }
top="$(cd "$(dirname "$0")/.." && pwd)"
root="$(mkdir -p "$dir" && cd "$dir" && pwd)"
log="$root.log"

# The commands, from the README: the first ```sh block after each heading.
readme_command() {
  awk -v heading="$1" '
    $0 == heading { in_section = 1; next }
    in_section && /^## / { exit }
    in_section && /^```sh$/ { in_block = 1; next }
    in_block && /^```$/ { exit }
    in_block { print }' "$top/README.md"
}
run_cmd="$(readme_command "## Run it")"
test_cmd="$(readme_command "## Test it")"
image_cmd="$(readme_command "### Run it locally with podman")"
[[ -n "$run_cmd" && -n "$test_cmd" && -n "$image_cmd" ]] || {
  echo "fresh-machine-check: README.md has no sh block under '## Run it', '## Test it' or '### Run it locally with podman'" >&2
  exit 1
}
# After the image commands: a chat request through the OpenAI API on the default port `up`
# printed, then `down`, which must leave nothing.
image_cmd+="
curl -sf http://127.0.0.1:8080/v1/chat/completions -H 'Content-Type: application/json' \\
  -d '{\"messages\": [{\"role\": \"user\", \"content\": \"Why is the sky blue?\"}], \"max_tokens\": 32}' | tee /dev/stderr | grep -q '\"content\"'
./scripts/deploy-local.sh down"

if ((keep == 0)) || [[ ! -x "$root/bin/bash" ]]; then
  command -v debootstrap >/dev/null || DEBIAN_FRONTEND=noninteractive apt-get install -y -qq debootstrap >/dev/null
  rm -rf "$root" && mkdir -p "$root"
  mirror="$(awk '/^URIs:/ {print $2; exit}' /etc/apt/sources.list.d/debian.sources 2>/dev/null || true)"
  echo "fresh-machine-check: debootstrap --variant=minbase bookworm $root" >&2
  debootstrap --variant=minbase bookworm "$root" ${mirror:+"$mirror"} >"$log" 2>&1 || { tail -5 "$log" >&2; exit 1; }
  # The host's deb822 sources replace debootstrap's one-line list (apt warns about both).
  if [[ -f /etc/apt/sources.list.d/debian.sources ]]; then
    cp /etc/apt/sources.list.d/debian.sources "$root/etc/apt/sources.list.d/"
    rm -f "$root/etc/apt/sources.list"
  fi
fi

# This host's way to the registries (resolver, CA bundle, pip's index settings): a new machine on
# the same network has them too. Nothing of baton comes along.
cp /etc/resolv.conf "$root/etc/resolv.conf"
# An installed Debian has /etc/hosts (the installer writes it); debootstrap leaves none, and then
# "localhost" does not resolve (a unit test resolves it, as deployments that name localhost do).
[[ -f "$root/etc/hosts" ]] || printf '127.0.0.1\tlocalhost\n::1\t\tlocalhost ip6-localhost ip6-loopback\n' >"$root/etc/hosts"
mkdir -p "$root/etc/ssl/certs" "$root/usr/local/share/ca-certificates"
cp /etc/ssl/certs/ca-certificates.crt "$root/etc/ssl/certs/" 2>/dev/null || true
cp /usr/local/share/ca-certificates/*.crt "$root/usr/local/share/ca-certificates/" 2>/dev/null || true
cp /etc/pip.conf "$root/etc/pip.conf" 2>/dev/null || true
pass=()
for v in SSL_CERT_FILE REQUESTS_CA_BUNDLE PIP_CERT PIP_INDEX_URL PIP_TRUSTED_HOST http_proxy https_proxy no_proxy \
         HTTP_PROXY HTTPS_PROXY NO_PROXY; do
  [[ -n "${!v:-}" ]] && pass+=("$v=${!v}")
done

# The checkout, as a clone has it.
rm -rf "$root/src" && mkdir -p "$root/src"
(cd "$top" && git ls-files -z --cached --others --exclude-standard | tar --null -T - -cf -) | tar -xf - -C "$root/src"

# Everything mounted under the root goes, podman's storage mounts from --image or the deploy test too.
cleanup() { umount -R -l "$root" 2>/dev/null || true; }
trap cleanup EXIT
# The root a mount point of its own, as a machine's / is: podman's storage remounts / in its own
# mount namespace to unpack image layers, which fails on a plain folder.
mount --bind "$root" "$root"
mount -t proc proc "$root/proc"
mount --rbind /sys "$root/sys"
mount --rbind /dev "$root/dev"

in_chroot() {
  chroot "$root" /usr/bin/env -i HOME=/root TERM=dumb LANG=C.UTF-8 \
    PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin "${pass[@]}" \
    /bin/bash -euo pipefail -c "cd /src && $1"
}
status=0
for which in run test image; do
  [[ $mode == "$which" || ($mode == both && $which != image) ]] || continue
  case "$which" in
    run) cmd="$run_cmd" ;;
    test) cmd="$test_cmd" ;;
    image) cmd="$image_cmd" ;;
  esac
  echo "fresh-machine-check: [$which] $cmd" >&2
  start=$(date +%s)
  if in_chroot "$cmd" 2>&1 | tee -a "$log"; then
    echo "fresh-machine-check: [$which] passed in $(( $(date +%s) - start )) s" >&2
  else
    status=1
    echo "fresh-machine-check: [$which] FAILED after $(( $(date +%s) - start )) s (log: $log)" >&2
  fi
done
exit "$status"
