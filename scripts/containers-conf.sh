#!/usr/bin/env bash
# Writes /etc/containers/containers.conf.d/baton.conf: what podman and buildah need to run baton's
# image and pods on this machine (scripts/install-deps.sh --containers runs it). Each setting is
# written only where this machine needs it, with its reason in the file. Idempotent; a drop-in, so
# the machine's own containers.conf is left as it is.
set -euo pipefail

sudo_cmd=()
[[ $(id -u) -ne 0 ]] && sudo_cmd=(sudo)
dir=/etc/containers/containers.conf.d
conf="$dir/baton.conf"

containers=() engine=() network=()

# podman asks for nofile 1048576 and nproc 4194304 by default, and an OCI runtime cannot raise a
# limit above the hard limit of the process that starts it ("error setting rlimits": no container
# starts). So containers get min(hard limit, podman's default) open files, and at most 32768
# threads: on a sandboxed machine of this kind runc failed to set nproc above 32768 although its
# hard limit was 96363. nproc counts every thread of the containers' user (uid 10001, all baton
# pods together); a baton role runs a few hundred.
capped() {  # min(the hard limit of ulimit flag $1, $2)
  local hard
  hard="$(ulimit -H "$1")"
  if [[ "$hard" == unlimited ]] || ((hard >= $2)); then echo "$2"; else echo "$hard"; fi
}
nofile="$(capped -n 1048576)" nproc="$(capped -u 32768)"
containers+=("# podman's default ulimits (nofile 1048576, nproc 4194304) exceed what the OCI runtime may set"
             "# here, and then no container starts. Open files: this machine's hard limit ($nofile). Threads"
             "# of the containers' user: at most 32768, the most runc could set on a sandboxed machine of"
             "# this kind although its hard limit was higher ($nproc)."
             "default_ulimits = [\"nofile=$nofile:$nofile\", \"nproc=$nproc:$nproc\"]")

# crun (podman's default runtime) refuses a hybrid cgroup hierarchy (cgroup v1 controllers with a
# cgroup2 'unified' mount beside them); runc runs on it.
if [[ "$(stat -fc %T /sys/fs/cgroup)" != cgroup2fs ]]; then
  engine+=("# The cgroup hierarchy is v1 or hybrid, which crun (podman's default runtime) refuses; runc runs on it."
           "runtime = \"runc\"")
fi

# Without systemd as PID 1 there is no systemd bus to create cgroups through, nor a journal.
if [[ "$(cat /proc/1/comm 2>/dev/null)" != systemd ]]; then
  engine+=("# PID 1 is not systemd: cgroups are made through the file system, and events go to a file"
           "# (podman's defaults, systemd and journald, need a systemd bus and a journal)."
           "cgroup_manager = \"cgroupfs\""
           "events_logger = \"file\"")
fi

# Pods find each other by name only on a network with DNS: netavark's (aardvark-dns). CNI would need
# the dnsname plugin, which Debian 12 does not install with podman.
network+=("# Pods resolve each other by name through aardvark-dns, which only the netavark backend runs."
          "network_backend = \"netavark\"")

section() {  # [name] and its lines, when there are any
  local name="$1"; shift
  (($#)) || return 0
  printf '\n[%s]\n' "$name"
  printf '%s\n' "$@"
}
content="$(
  echo "# Written by baton's scripts/containers-conf.sh (install-deps.sh --containers) for podman and buildah."
  section containers "${containers[@]}"
  section engine "${engine[@]}"
  section network "${network[@]}"
)"
if [[ "$(cat "$conf" 2>/dev/null)" != "$content" ]]; then
  "${sudo_cmd[@]}" mkdir -p "$dir"
  printf '%s\n' "$content" | "${sudo_cmd[@]}" tee "$conf" >/dev/null
  echo "containers-conf: wrote $conf" >&2
fi
