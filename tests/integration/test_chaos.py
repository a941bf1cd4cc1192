"""Chaos under load, short: bench/chaos.py for 60 s (its full run is 10 minutes, bench/RESULTS.md)
— two prefill and two decode workers, 8 greedy streams at a time, faults on random workers one
after another (SIGKILL and restart, SIGSTOP and SIGCONT, a partition of the decode worker in its
own network namespace). Nothing may be lost, duplicated or different from the undisturbed output,
and every KV block must come back."""

import json
import os
import subprocess
import sys

import pytest

from serving_harness import REPO
from test_hangs import network_namespaces_usable


@pytest.mark.skipif(not network_namespaces_usable(), reason="network namespaces need root and iproute2")
def test_a_minute_of_chaos_loses_nothing(baton_bin, tmp_path):
    out = tmp_path / "chaos.json"
    env = dict(os.environ, BATON_BIN=str(baton_bin))
    run = subprocess.run([sys.executable, str(REPO / "bench" / "chaos.py"), "--seconds", "60", "--json", str(out)],
                         capture_output=True, text=True, env=env, timeout=900)
    print(run.stdout[-4000:])
    assert out.exists(), run.stdout[-4000:] + run.stderr[-4000:]
    r = json.loads(out.read_text())
    assert r["faults"] >= 3, r
    assert (r["lost"], r["duplicated"], r["greedy_mismatches"], r["kv_blocks_not_returned"]) == (0, 0, 0, 0), \
        run.stdout[-4000:]
    assert run.returncode == 0, run.stderr[-4000:]
