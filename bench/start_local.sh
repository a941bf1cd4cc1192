# Sourced by the serving benches: start_local LOG BATON [ARGS...] starts `BATON local --listen
# 127.0.0.1:0 ARGS...` in the background with its output in LOG, waits up to 4 min for its
# "listening on port N" line, and sets $pid and $port; it exits the script if the server does not
# come up.
start_local() {
  local log=$1 bin=$2
  shift 2
  "$bin" local --listen 127.0.0.1:0 "$@" >"$log" 2>&1 &
  pid=$!
  port=""
  for _ in $(seq 1 480); do
    port=$(sed -n 's/^listening on port \([0-9]*\)$/\1/p' "$log")
    [ -n "$port" ] && return 0
    sleep 0.5
  done
  echo "$bin did not start (see $log)" >&2
  kill "$pid"
  exit 1
}
