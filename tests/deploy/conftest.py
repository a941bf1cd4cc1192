"""Fixtures of the deploy/ tests. The serving fixtures (baton_bin, test_model, pb: the Python gRPC
modules generated from proto/) are the integration tests' own, imported from
tests/integration/conftest.py."""

import importlib.util
import sys
from pathlib import Path

import pytest

_INTEGRATION = Path(__file__).resolve().parents[1] / "integration"
if str(_INTEGRATION) not in sys.path:
    sys.path.insert(0, str(_INTEGRATION))  # serving_harness, which that conftest imports

_spec = importlib.util.spec_from_file_location("baton_integration_fixtures", _INTEGRATION / "conftest.py")
_integration = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(_integration)

baton_bin = _integration.baton_bin
test_model = _integration.test_model
pb = _integration.pb

import deploy_helpers  # noqa: E402  (after the sys.path set-up above)


@pytest.fixture(scope="session")
def flags():
    """{flag: env} that `baton serve` accepts, and where that list came from."""
    return deploy_helpers.serve_flags()


@pytest.fixture(scope="session")
def metrics():
    return deploy_helpers.exported_metrics()


@pytest.fixture(scope="session")
def rendered(tmp_path_factory):
    """{name: [objects]} of `kubectl kustomize` on every overlay under deploy/k8s/overlays, and on
    the variants (deploy_helpers.VARIANTS: an overlay plus a component it leaves out)."""
    assert deploy_helpers.OVERLAYS, "no overlays under deploy/k8s/overlays"
    out = {name: deploy_helpers.kustomize(deploy_helpers.K8S / "overlays" / name) for name in deploy_helpers.OVERLAYS}
    for name, (overlay, components) in deploy_helpers.VARIANTS.items():
        out[name] = deploy_helpers.kustomize_variant(overlay, components, tmp_path_factory.mktemp("kustomize-variant"))
    return out
