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
# ccache keys on the paths a compile names: with the repository as its base directory those are
# relative, so a build in another clone (CI's) hits what this one cached; without hashing the
# working directory, the -g builds (sanitizers) hit too.
CCACHE_BASEDIR="${CCACHE_BASEDIR:-$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)}"
CCACHE_NOHASHDIR="${CCACHE_NOHASHDIR:-1}"
export CCACHE_BASEDIR CCACHE_NOHASHDIR
