"""bench/schema_budget.py on the small schemas kept in bench/schemas, with the real model's
vocabulary: the benchmark that sets the schema budget keeps running (its full run over public
schemas is in bench/RESULTS.md, "Schema budget"), and each kept schema compiles within the
defaults, its numbers far from the bounds the table's last row gives."""

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
BENCH = REPO / "build" / "bench" / "baton_bench_schema"


def test_schema_bench_runs_and_the_kept_schemas_fit_the_budget(tmp_path):
    if not BENCH.exists():
        pytest.skip(f"{BENCH} not built (scripts/build.sh)")
    model = os.environ.get("BATON_MODEL", "")
    args = [sys.executable, str(REPO / "bench" / "schema_budget.py"), "--bench", str(BENCH), "--out", str(tmp_path),
            str(REPO / "bench" / "schemas")]
    if model:
        args += ["--model", model]
    out = subprocess.run(args, capture_output=True, text=True, timeout=300, check=True).stdout
    rows = [line for line in out.splitlines() if line.startswith("| ") and ".json" in line]
    kept = sorted(p.name for p in (REPO / "bench" / "schemas").glob("*.json"))
    assert len(rows) == 2 * len(kept), out  # each as it is and rewritten to the subset
    for line in rows:
        cells = [c.strip() for c in line.strip("|").split("|")]
        assert cells[-1] == "ok", line  # the defaults compile it
        depth, elements, rules = int(cells[4]), int(cells[5]), int(cells[6])
        assert 0 < depth < 256 and 0 < elements < 1_500_000 and 0 < rules < 200_000, line
    assert re.search(r"\| \*\*bound \(default\)\*\* \| \| 256 \| 10000 \| 256 \| 1500000 \| 200000 \|", out), out
