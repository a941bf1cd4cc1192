# Sourced by the scripts (not run): where baton's set-up keeps what it fetches, and a PATH that
# finds it first. Override with BATON_CACHE or BATON_VENV.
#   BATON_CACHE  the model, the pinned kubectl (bin/) and the venv   (~/.cache/baton)
#   BATON_VENV   the Python virtual environment the scripts and tests use   ($BATON_CACHE/venv)
BATON_CACHE="${BATON_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/baton}"
BATON_VENV="${BATON_VENV:-$BATON_CACHE/venv}"
export BATON_CACHE BATON_VENV
case ":$PATH:" in
  *":$BATON_VENV/bin:"*) ;;
  *) PATH="$BATON_VENV/bin:$BATON_CACHE/bin:$PATH" ;;
esac
export PATH
