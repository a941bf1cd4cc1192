"""Fixtures for the serving tests: real `baton` processes on loopback, the Python gRPC client
generated from proto/ (grpcio-tools), the random test model `baton tools make-test-model` writes,
a seeded random generator, and certificates and API keys for the secure flags."""

import os
import random
from pathlib import Path

import pytest

from serving_harness import KEY, PRIVILEGED_KEY, REPO, Pki, Server, compile_protos, make_test_model


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


@pytest.fixture(scope="module")
def rng():
    """A random generator seeded afresh for each module; the seed is printed."""
    seed = random.randrange(1 << 30)
    print(f"random seed {seed}")
    return random.Random(seed)


@pytest.fixture(scope="module")
def pki(tmp_path_factory):
    """Certificates for each module: an internal CA with a leaf for each role and one for another
    member, a public CA with the server's and a client's leaf, a rogue CA with a leaf, and pki.keys
    listing KEY and PRIVILEGED_KEY."""
    p = Pki(tmp_path_factory.mktemp("pki"))
    p.internal_ca = p.ca("baton-internal-ca")
    p.public_ca = p.ca("baton-public-ca")
    p.rogue_ca = p.ca("rogue-ca")
    p.roles = {r: p.leaf(f"baton-{r}", p.internal_ca) for r in ("frontend", "prefill", "decode")}
    p.insider_b = p.leaf("baton-other", p.internal_ca)  # a deployment member that did not admit
    p.rogue = p.leaf("rogue", p.rogue_ca)
    p.public = p.leaf("baton-public", p.public_ca)
    p.client = p.leaf("client-alice", p.public_ca)
    p.keys = p.path / "api-keys"
    p.keys.write_text(f"# the test's client\n{KEY}\n# a privileged caller\n{PRIVILEGED_KEY} max-priority=5\n")
    return p
