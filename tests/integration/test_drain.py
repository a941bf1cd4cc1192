"""Graceful drain: SIGTERM while 8 requests stream. The frontend's health turns NOT_SERVING at once
while all 8 still stream, all 8 finish, new requests are refused with UNAVAILABLE during the drain,
and the process exits 0.

The health service is grpc.health.v1 (the frontend turns it NOT_SERVING in its drain; its messages
are written by hand in serving_harness.health_status).

What a call that arrives during the drain sees: the frontend keeps its listener open while the
requests in flight finish, so the call reaches it and is refused with UNAVAILABLE "this frontend is
shutting down; retry on another replica" (server/generate_call.cpp), on a new channel and on one
connected before: distinguishable from a crashed or unreachable server. The health watch tells a
drain from a dead process too: a watch opened before SIGTERM receives NOT_SERVING while the
in-flight streams go on.
"""

import signal
import threading
import time

import grpc
import pytest

from serving_harness import HEALTH_CHECK, HEALTH_WATCH, NOT_SERVING, SERVING, Server, _identity, health_status

class HealthWatch:
    """grpc.health.v1 Watch on the whole server, recording (time, status) as updates arrive."""

    def __init__(self, channel):
        self.updates = []
        self.not_serving = threading.Event()
        self._call = channel.unary_stream(HEALTH_WATCH, request_serializer=_identity,
                                          response_deserializer=_identity)(b"", timeout=180)
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self):
        try:
            for raw in self._call:
                status = health_status(raw)
                self.updates.append((time.monotonic(), status))
                if status == NOT_SERVING:
                    self.not_serving.set()
        except grpc.RpcError:
            pass  # the watch ends when the server goes away

    def cancel(self):
        self._call.cancel()


def start_streams(pb, srv, n, max_tokens):
    """n threads streaming max_tokens each; returns (threads, results, end times, barrier passed
    once every stream has its first token)."""
    started = threading.Barrier(n + 1)
    results, ended = [None] * n, [None] * n

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
        ended[i] = time.monotonic()

    threads = [threading.Thread(target=stream, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    return threads, results, ended, started


def try_generate(pb, channel):
    """(code, details) of a small Generate on `channel`."""
    try:
        list(pb.gen_grpc.GenerationStub(channel).Generate(
            pb.gen.GenerateRequest(prompt_token_ids=[9, 9], max_tokens=4), timeout=10))
        return grpc.StatusCode.OK, ""
    except grpc.RpcError as e:
        return e.code(), e.details()


def test_sigterm_drains_in_flight_streams(pb, baton_bin, test_model):
    """Asserts, in order: health SERVING before the signal; after SIGTERM a health watch opened
    before it receives NOT_SERVING within 10 s and before any of the 8 streams has ended (the drain
    itself, not a dead process, which would end the watch without an update); a new request on a
    new channel gets UNAVAILABLE; every stream gets all its tokens; exit code 0."""
    srv = Server(baton_bin, test_model, "--drain-timeout", "60")
    n, max_tokens = 8, 900
    try:
        with grpc.insecure_channel(srv.address) as watch_channel:
            check = watch_channel.unary_unary(HEALTH_CHECK, request_serializer=_identity,
                                              response_deserializer=_identity)
            assert health_status(check(b"", timeout=10)) == SERVING
            watch = HealthWatch(watch_channel)
            threads, results, ended, started = start_streams(pb, srv, n, max_tokens)
            started.wait(timeout=60)  # every stream has its first token
            sigterm_at = time.monotonic()
            srv.proc.send_signal(signal.SIGTERM)
            assert watch.not_serving.wait(timeout=10), f"no NOT_SERVING within 10 s of SIGTERM: {watch.updates}"
            time.sleep(0.3)
            with grpc.insecure_channel(srv.address) as ch:
                refused, details = try_generate(pb, ch)
            for t in threads:
                t.join(timeout=120)
            watch.cancel()

        statuses = [s for _, s in watch.updates]
        assert statuses[0] == SERVING and NOT_SERVING in statuses, statuses
        assert SERVING not in statuses[statuses.index(NOT_SERVING):], f"SERVING again during the drain: {statuses}"
        assert results == [max_tokens] * n, results
        not_serving_at = next(t for t, s in watch.updates if s == NOT_SERVING)
        assert sigterm_at <= not_serving_at < min(ended), "NOT_SERVING must come while the streams still run"
        assert refused == grpc.StatusCode.UNAVAILABLE, (refused, details)
        assert srv.proc.wait(timeout=60) == 0
    finally:
        srv.stop()


def test_calls_during_the_drain_are_refused_with_the_reason(pb, baton_bin, test_model):
    """A call that arrives during the drain, on a channel connected before SIGTERM (a client that
    keeps its connection, as load balancers and SDKs do) and on a new one, gets UNAVAILABLE with a
    message that says the frontend is shutting down: distinguishable from a crashed or unreachable
    server, so a client knows to retry elsewhere at once."""
    srv = Server(baton_bin, test_model, "--drain-timeout", "60")
    try:
        with grpc.insecure_channel(srv.address) as old:
            assert try_generate(pb, old)[0] == grpc.StatusCode.OK  # connected before the signal
            threads, results, _, started = start_streams(pb, srv, 1, 900)
            started.wait(timeout=60)
            srv.proc.send_signal(signal.SIGTERM)
            time.sleep(0.3)
            on_old = try_generate(pb, old)
            with grpc.insecure_channel(srv.address) as new:
                on_new = try_generate(pb, new)
            for t in threads:
                t.join(timeout=120)
        assert results == [900], "the drain lets the in-flight stream finish"
        for code, details in (on_old, on_new):
            assert code == grpc.StatusCode.UNAVAILABLE, (code, details)
            assert "shutting down" in details, details
    finally:
        srv.stop_clean()
