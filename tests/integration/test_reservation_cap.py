"""A caller cannot park a decode reservation (issue: security). An Admit that asks for a 24 h
deadline and never streams holds its blocks at most min(60 s, --max-request-seconds); one that
streams but never sends KV ends DEADLINE_EXCEEDED at --max-request-seconds. A real request queued
behind the squatter finishes, with the same output as without it, once the blocks come back."""

import time

import grpc

from serving_harness import wait_blocks_free
from test_serving import generate

CAP_S = 3


def free_blocks(pb, decode):
    with grpc.insecure_channel(decode.address) as ch:
        rep = pb.worker_grpc.DecodeWorkerStub(ch).GetLoad(pb.worker.LoadRequest(), timeout=5)
    return rep.free_blocks, rep.total_blocks, rep.model_fingerprint


def squat(pb, decode, request_id, stream):
    """Admits 8 + 1000 tokens (63 of 64 blocks) with a 24 h deadline; optionally attaches a Stream
    (returned, still open) and never sends the KV."""
    _, _, fingerprint = free_blocks(pb, decode)
    ch = grpc.insecure_channel(decode.address)
    stub = pb.worker_grpc.DecodeWorkerStub(ch)
    stub.Admit(pb.worker.AdmitRequest(request_id=request_id, n_prompt_tokens=8, max_tokens=1000,
                                      model_fingerprint=fingerprint), timeout=24 * 3600)
    return ch, (stub.Stream(pb.worker.StreamRequest(request_id=request_id), timeout=24 * 3600) if stream else None)


def test_a_parked_reservation_is_freed_and_the_victim_finishes(pb, test_model, server_factory):
    decode = server_factory(test_model, "--kv-blocks", "64", "--max-request-seconds", str(CAP_S),
                            subcommand=("serve", "--role", "decode"))
    prefill = server_factory(test_model, subcommand=("serve", "--role", "prefill"))
    front = server_factory(test_model, "--prefill-addresses", prefill.address, "--decode-addresses", decode.address,
                           subcommand=("serve", "--role", "frontend"))
    victim = dict(prompt_token_ids=list(range(5, 25)), max_tokens=40, ignore_eos=True)  # 4 blocks
    expected, _, _ = generate(pb, front.address, **victim)

    for stream in (False, True):
        ch, events = squat(pb, decode, f"squatter-{stream}", stream)
        t0 = time.monotonic()
        assert free_blocks(pb, decode)[0] == 1
        got, final, _ = generate(pb, front.address, timeout=30, **victim)  # waits for the blocks
        waited = time.monotonic() - t0
        assert got == expected and final is not None
        assert CAP_S - 0.5 < waited < CAP_S + 5, f"the victim waited {waited:.1f} s"
        if events is not None:
            try:
                list(events)
                raise AssertionError("the squatter's stream ended OK")
            except grpc.RpcError as e:
                assert e.code() == grpc.StatusCode.DEADLINE_EXCEEDED, e
        ch.close()
        assert wait_blocks_free(decode)
