"""Fixtures for the serving tests: real `baton` processes on loopback, the Python gRPC client
generated from proto/ (grpcio-tools), the random test model `baton tools make-test-model` writes."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

from serving_harness import REPO, Server


@pytest.fixture(scope="session")
def baton_bin():
    path = Path(os.environ.get("BATON_BIN", REPO / "build" / "baton"))
    if not path.exists():
        pytest.skip(f"baton binary not built at {path} (run scripts/build.sh)")
    return path


@pytest.fixture(scope="session")
def pb(tmp_path_factory):
    """The generated Python modules for baton/v1 (generate_pb2, generate_pb2_grpc, ...)."""
    from grpc_tools import protoc

    out = tmp_path_factory.mktemp("pb")
    protos = [str(p.relative_to(REPO / "proto")) for p in (REPO / "proto" / "baton" / "v1").glob("*.proto")]
    import grpc_tools

    include = str(Path(grpc_tools.__file__).parent / "_proto")
    rc = protoc.main(["protoc", f"-I{REPO / 'proto'}", f"-I{include}", f"--python_out={out}", f"--grpc_python_out={out}"]
                     + protos)
    assert rc == 0, "protoc failed on proto/baton/v1"
    sys.path.insert(0, str(out))
    import baton.v1.generate_pb2 as gen
    import baton.v1.generate_pb2_grpc as gen_grpc
    import baton.v1.worker_pb2 as worker
    import baton.v1.worker_pb2_grpc as worker_grpc

    class Modules:
        pass

    m = Modules()
    m.gen, m.gen_grpc, m.worker, m.worker_grpc = gen, gen_grpc, worker, worker_grpc
    return m


@pytest.fixture(scope="session")
def test_model(baton_bin, tmp_path_factory):
    path = tmp_path_factory.mktemp("model") / "test.gguf"
    subprocess.run([str(baton_bin), "tools", "make-test-model", "--out", str(path), "--seed", "7", "--layers", "2",
                    "--dim", "64", "--heads", "4", "--kv-heads", "2", "--ffn", "128", "--ctx", "1024"], check=True)
    return path


@pytest.fixture
def server_factory(baton_bin):
    servers = []

    def make(model, *extra, **kw):
        s = Server(baton_bin, model, *extra, **kw)
        servers.append(s)
        return s

    yield make
    for s in servers:
        s.stop()


@pytest.fixture(scope="module")
def shared_server(baton_bin, test_model):
    """One `baton local` on the test model for tests that do not change its flags."""
    s = Server(baton_bin, test_model)
    yield s
    s.stop()
