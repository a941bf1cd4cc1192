"""Graceful drain: SIGTERM while 8 requests stream. All 8 finish, new requests are refused with
UNAVAILABLE during the drain, and the process exits 0."""

import signal
import threading
import time

import grpc

from serving_harness import Server


def test_sigterm_drains_in_flight_streams(pb, baton_bin, test_model):
    srv = Server(baton_bin, test_model, "--drain-timeout", "60")
    n, max_tokens = 8, 900
    started = threading.Barrier(n + 1)
    results = [None] * n

    def stream(i):
        req = pb.gen.GenerateRequest(prompt_token_ids=[5 + i, 6, 7], max_tokens=max_tokens, ignore_eos=True)
        count, first = 0, True
        try:
            with grpc.insecure_channel(srv.address) as ch:
                for msg in pb.gen_grpc.GenerationStub(ch).Generate(req, timeout=120):
                    count += len(msg.token_ids)
                    if first:
                        first = False
                        started.wait(timeout=60)
            results[i] = count
        except grpc.RpcError as e:
            results[i] = e.code()
            if first:
                started.wait(timeout=60)

    threads = [threading.Thread(target=stream, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    started.wait(timeout=60)  # every stream has its first token
    srv.proc.send_signal(signal.SIGTERM)
    time.sleep(0.3)
    refused = None
    try:
        with grpc.insecure_channel(srv.address) as ch:
            list(pb.gen_grpc.GenerationStub(ch).Generate(
                pb.gen.GenerateRequest(prompt_token_ids=[9, 9], max_tokens=4), timeout=10))
    except grpc.RpcError as e:
        refused = e.code()
    for t in threads:
        t.join(timeout=120)
    assert results == [max_tokens] * n, results
    assert refused == grpc.StatusCode.UNAVAILABLE, refused
    assert srv.proc.wait(timeout=60) == 0
