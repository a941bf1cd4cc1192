"""Fixtures for the serving tests: real `baton` processes on loopback, the Python gRPC client
generated from proto/ (grpcio-tools), the random test model `baton tools make-test-model` writes."""

import os
from pathlib import Path

import pytest

from serving_harness import REPO, Server, compile_protos, make_test_model


@pytest.fixture(scope="session")
def baton_bin():
    path = Path(os.environ.get("BATON_BIN", REPO / "build" / "baton"))
    if not path.exists():
        pytest.skip(f"baton binary not built at {path} (run scripts/build.sh)")
    return path


@pytest.fixture(scope="session")
def batonctl(baton_bin):
    path = baton_bin.parent / "batonctl"
    if not path.exists():
        pytest.skip(f"batonctl not built at {path} (ninja -C build batonctl)")
    return path


@pytest.fixture(scope="session")
def pb(tmp_path_factory):
    """The generated Python modules for baton/v1 (generate_pb2, generate_pb2_grpc, ...)."""
    return compile_protos(tmp_path_factory.mktemp("pb"))


@pytest.fixture(scope="session")
def test_model(baton_bin, tmp_path_factory):
    return make_test_model(baton_bin, tmp_path_factory.mktemp("model") / "test.gguf", seed=7, layers=2, dim=64,
                           heads=4, kv_heads=2, ffn=128, ctx=1024)


def stop_all_clean(servers):
    """Stops every server, the last started first (frontends before their workers), then fails
    on the first that did not exit cleanly."""
    problems = []
    for s in reversed(servers):
        try:
            s.stop_clean()
        except AssertionError as e:
            problems.append(str(e))
    assert not problems, "\n\n".join(problems)


@pytest.fixture
def server_factory(baton_bin):
    servers = []

    def make(model, *extra, **kw):
        s = Server(baton_bin, model, *extra, **kw)
        servers.append(s)
        return s

    yield make
    stop_all_clean(servers)


@pytest.fixture(scope="module")
def shared_server(baton_bin, test_model):
    """One `baton local` on the test model for tests that do not change its flags."""
    s = Server(baton_bin, test_model)
    yield s
    s.stop_clean()
