"""Request priority cannot be used to starve other clients: it is bounded, and a client may lower
its own priority but not raise it above the frontend's --max-priority (default 0)."""

import grpc
import pytest

from test_serving import generate


@pytest.mark.parametrize("priority", [-1000, -3, 0])
def test_lower_or_default_priority_is_served(pb, shared_server, priority):
    ids, _, _ = generate(pb, shared_server.address, prompt_token_ids=[5, 6, 7], max_tokens=3, ignore_eos=True,
                         priority=priority)
    assert len(ids) == 3


def test_raising_priority_is_denied_by_default(pb, shared_server):
    with pytest.raises(grpc.RpcError) as err:
        generate(pb, shared_server.address, prompt_token_ids=[5, 6, 7], max_tokens=3, priority=1)
    assert err.value.code() == grpc.StatusCode.PERMISSION_DENIED
    assert "--max-priority" in err.value.details() and "priority 1 " in err.value.details()


@pytest.mark.parametrize("priority", [-1001, 1001, 2**31 - 1])
def test_priority_outside_the_bound_is_invalid(pb, shared_server, priority):
    with pytest.raises(grpc.RpcError) as err:
        generate(pb, shared_server.address, prompt_token_ids=[5, 6, 7], max_tokens=3, priority=priority)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "priority must be in [-1000, 1000]" in err.value.details()


def test_max_priority_lets_clients_raise_up_to_it(pb, test_model, server_factory):
    srv = server_factory(test_model, "--max-priority", "10")
    ids, _, _ = generate(pb, srv.address, prompt_token_ids=[5, 6, 7], max_tokens=3, ignore_eos=True, priority=10)
    assert len(ids) == 3
    with pytest.raises(grpc.RpcError) as err:
        generate(pb, srv.address, prompt_token_ids=[5, 6, 7], max_tokens=3, priority=11)
    assert err.value.code() == grpc.StatusCode.PERMISSION_DENIED
