"""Fixtures for the end-to-end tests on the real SmolLM2-135M-Instruct GGUF.

Environment:
  BATON_BIN    path of the baton binary (default <repo>/build/baton; tests that need it skip,
               saying so, when it is missing)
  BATON_MODEL  path of the GGUF (default: what <repo>/scripts/fetch-model.sh prints last)

Measurements that tests record through the `measure` fixture are printed in a
"baton e2e measurements" section at the end of the run (also when the tests pass).
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]
if str(HERE) not in sys.path:
    sys.path.insert(0, str(HERE))

import reference as _reference  # noqa: E402  (tests/e2e/reference.py)

_MEASUREMENTS: list[str] = []


@pytest.fixture(scope="session")
def baton_bin() -> str:
    path = Path(os.environ.get("BATON_BIN", REPO / "build" / "baton"))
    if not (path.is_file() and os.access(path, os.X_OK)):
        pytest.skip(f"baton binary not found at {path} (build it, or set BATON_BIN)")
    return str(path)


@pytest.fixture(scope="session")
def model_path() -> str:
    env = os.environ.get("BATON_MODEL")
    if env:
        if not Path(env).is_file():
            pytest.fail(f"BATON_MODEL={env} does not exist")
        return env
    script = REPO / "scripts" / "fetch-model.sh"
    try:
        p = subprocess.run(["bash", str(script)], capture_output=True, text=True, timeout=600)
    except subprocess.TimeoutExpired:
        pytest.fail(f"{script} did not finish in 600 s")
    lines = [l for l in p.stdout.splitlines() if l.strip()]
    if p.returncode != 0 or not lines or not Path(lines[-1].strip()).is_file():
        pytest.fail(f"{script} failed (exit {p.returncode}): {p.stderr.strip()[-2000:]}")
    return lines[-1].strip()


def build_hf_tokenizer(path: str):
    """HF `tokenizers.Tokenizer` built from the GGUF without torch (see reference.py)."""
    return _reference.build_hf_tokenizer(path)


@pytest.fixture(scope="session")
def hf_tokenizer(model_path):
    """The HF tokenizer on the model's GGUF vocabulary (SmolLM2: digits isolated first)."""
    return build_hf_tokenizer(model_path)


@pytest.fixture(scope="session")
def reference(model_path):
    """The numpy reference model (tests/e2e/reference.py), loaded once per session."""
    return _reference.load(model_path)


@pytest.fixture(scope="session")
def measure():
    """measure(line): records a measured value; printed in the terminal summary."""
    def record(line: str) -> None:
        _MEASUREMENTS.append(line)
        print(line)
    return record


def pytest_terminal_summary(terminalreporter):
    if _MEASUREMENTS:
        terminalreporter.section("baton e2e measurements")
        for line in _MEASUREMENTS:
            terminalreporter.write_line(line)


@pytest.fixture(scope="session")
def pb(tmp_path_factory):
    """The generated Python modules for baton/v1 (the serving tests' own)."""
    integration = str(REPO / "tests" / "integration")
    if integration not in sys.path:
        sys.path.insert(0, integration)
    from serving_harness import compile_protos

    return compile_protos(tmp_path_factory.mktemp("pb"))
