"""Hangs with real processes: a worker that stops (SIGSTOP), one the network cuts off (a network
namespace whose link goes down), and one that accepts connections but never answers (a TCP relay
that turns into a black hole). None of them breaks a connection: only the frontend's progress
watchdog (scheduler/progress_watch.h) and HTTP/2 keepalive can tell.

In each test 8 streams run (half greedy, half seeded, as in test_failover.py), the fault strikes
mid-stream (or mid-prefill), and:
- every stream completes with exactly max_tokens tokens, greedy ones token for token equal to the
  undisturbed run, seeded ones up to the fault (test_failover.assert_same_as_undisturbed);
- each stream that was on the stuck worker gets its next token within 3 s (or the watchdog's
  bound from the worker's step, when that is longer: watchdog_bound) + 0.5 s + one re-prefill of
  the fault (the re-prefill measured on the same deployment: the moved streams'
  prompts and tokens so far, prefilled together);
- the stuck worker, resumed, takes new work again, and what it held for the abandoned attempts
  returns (its KV blocks all free).
"""

import math
import os
import re
import shutil
import signal
import socket
import subprocess
import threading
import time
import uuid

import grpc
import pytest

from serving_harness import Stream, wait_blocks_free
from test_failover import (WORKER_FLAGS, assert_same_as_undisturbed, failover_model, failovers, prompts,  # noqa: F401
                           run_all, start_streams)

MAX_TOKENS = 320
# The bound: 3 s + one re-prefill from the fault to the next token. scripts/sanitize.sh scales it
# (BATON_TEST_TIME_SCALE): under ASan every step is slower and so is the watchdog's bound, which
# follows the steps; there the streams' outcome is what counts, the Release run proves the time.
TIME_SCALE = float(os.environ.get("BATON_TEST_TIME_SCALE", "1"))
ALLOWANCE_S = 3.0 * TIME_SCALE


def prefill_step_seconds(pb, address):
    """The prefill worker's slowest recent step, as its load report gives it to the frontend."""
    with grpc.insecure_channel(address) as ch:
        load = pb.worker_grpc.PrefillWorkerStub(ch).GetLoad(pb.worker.LoadRequest(), timeout=10)
    return load.step_seconds


def worker(server_factory, model, role, *extra, listen="127.0.0.1:0", wrapper=()):
    return server_factory(model, *WORKER_FLAGS, *extra, subcommand=("serve", "--role", role), listen=listen,
                          wrapper=wrapper)


def frontend(server_factory, model, prefill_addresses, decode_addresses, *extra):
    return server_factory(model, "--prefill-addresses", ",".join(prefill_addresses), "--decode-addresses",
                          ",".join(decode_addresses), *extra, subcommand=("serve", "--role", "frontend"))


def wait_until(cond, timeout=120):
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.002)


def reprefill_seconds(pb, address, work, streams, moved, fault_at):
    """Wall time to prefill, together, what the moved streams had to re-prefill: each prompt and the
    tokens it had streamed by the fault (max_tokens 1: the prefill is all that runs). Other token
    ids of the same lengths: the failover's own prefill put these in the prefix cache, and a
    measurement that hits it would time a lookup, not a prefill."""
    token_lists = [work[i] + [t for t, at in zip(streams[i].ids, streams[i].times) if at < fault_at] for i in moved]
    token_lists = [[3 + (t + 131) % 270 for t in ids] for ids in token_lists]
    t0 = time.monotonic()
    again = [Stream(pb, address, ids, 1) for ids in token_lists]
    for s in again:
        s.join()
        assert s.error is None, s.error
    return time.monotonic() - t0


def watchdog_bound(step):
    """The longest silence the frontend allows an attempt whose worker's slowest recent step is
    `step` (grace 1.5 s + slack 3 x step: the defaults), or the 3 s allowance when that is longer,
    plus 0.5 s for the watchdog's 100 ms tick and a load report one poll old (a run on a slow
    machine came 0.03 s past 3 s + the re-prefill)."""
    return max(ALLOWANCE_S, (1.5 + 3 * step) * TIME_SCALE) + 0.5


def check_fault(pb, front, work, reference, streams, fault_at, what, step=0.0, max_tokens=MAX_TOKENS):
    same_seeded, n_seeded = assert_same_as_undisturbed(streams, reference, max_tokens, fault_at)
    moved = [i for i, s in enumerate(streams) if s.final.timing.failovers > 0]
    assert moved, f"no stream was on the {what}"
    # The longest wait for a token after the fault (tokens already in flight at the fault arrive
    # at once; the wait that matters is the failover's).
    gaps = [max(b - max(a, fault_at) for a, b in zip(streams[i].times, streams[i].times[1:]) if b >= fault_at)
            for i in moved]
    allowed = watchdog_bound(step) + reprefill_seconds(pb, front.address, work, streams, moved, fault_at)
    print(f"{what}: {len(moved)} of {len(streams)} streams failed over ({same_seeded} of {n_seeded} seeded ones "
          f"identical); longest wait for a token after the fault {', '.join(f'{g:.2f} s' for g in sorted(gaps))}; allowed {allowed:.2f} s")
    assert max(gaps) <= allowed, f"{what}: fault → next token {max(gaps):.2f} s > {allowed:.2f} s"
    return moved


def new_work_reaches(pb, front, label_of_worker, n=8, max_tokens=8, timeout=30):
    """Runs rounds of n streams until one of them ends on the worker with `label_of_worker`."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        got = run_all(pb, front.address, prompts(n, 20, seed=int(time.monotonic() * 1000) % 997), max_tokens)
        for s in got:
            assert s.error is None, s.error.details()
        if any(label_of_worker in (s.final.decode_worker, s.final.prefill_worker) for s in got):
            return True
    return False


def labels_of(streams, field):
    return {getattr(s.final, field) for s in streams}


def decode_fault_mid_stream(pb, front, work, fault, what, seconds_left=0.0, max_context=2048):
    """The undisturbed run of `work` (its streams must use both decode workers), then the same
    streams with fault() once each has 40 tokens: every stream completes as check_fault requires,
    all on one decode worker. Returns the label of the decode worker the fault struck.
    `seconds_left`: each stream still has about that long to go at the fault, at the undisturbed
    run's pace (more than MAX_TOKENS on a fast machine, within `max_context`)."""
    max_tokens = MAX_TOKENS
    undisturbed = run_all(pb, front.address, work, max_tokens)
    if seconds_left > 0:
        per_token = max((s.times[-1] - s.times[0]) / (len(s.times) - 1) for s in undisturbed)
        need = min(40 + math.ceil(seconds_left / per_token), max_context - max(len(p) for p in work))
        if need > max_tokens:
            max_tokens = need
            undisturbed = run_all(pb, front.address, work, max_tokens)
    reference = [s.ids for s in undisturbed]
    assert len(labels_of(undisturbed, "decode_worker")) == 2, "the streams did not use both decode workers"
    # The decode steps' length, as the workers report it: the longest gap between two tokens of
    # the undisturbed run (on a slow machine 1.5 s + 3 steps is more than 3 s).
    step = max(max(b - a for a, b in zip(s.times[1:], s.times[2:])) for s in undisturbed)
    streams = start_streams(pb, front.address, work, max_tokens)
    wait_until(lambda: min(len(s.ids) for s in streams) >= 40)
    fault()
    fault_at = time.monotonic()
    for s in streams:
        s.join()
    assert min(s.times[-1] for s in streams) > fault_at, "a stream finished before the fault: make them longer"
    check_fault(pb, front, work, reference, streams, fault_at, what, step, max_tokens)
    survivor = labels_of(streams, "decode_worker")
    assert len(survivor) == 1, survivor
    return next(iter(labels_of(undisturbed, "decode_worker") - survivor))


def test_decode_worker_stopped_mid_stream_costs_no_request(pb, server_factory, failover_model):
    prefill = [worker(server_factory, failover_model, "prefill")]
    decode = [worker(server_factory, failover_model, "decode") for _ in range(2)]
    front = frontend(server_factory, failover_model, [p.address for p in prefill], [d.address for d in decode])
    try:
        stopped = decode_fault_mid_stream(pb, front, prompts(8, 40, seed=2),
                                          lambda: decode[0].proc.send_signal(signal.SIGSTOP), "stopped decode worker")
        assert failovers(front, "decode") >= 1
    finally:
        decode[0].proc.send_signal(signal.SIGCONT)
    # Resumed: it answers its load polls again and takes new work; the abandoned sequences' blocks
    # came back (the frontend released them, or the cancelled streams did).
    assert new_work_reaches(pb, front, stopped), "the resumed decode worker took no new work"
    assert wait_blocks_free(decode[0]) and wait_blocks_free(decode[1])


def test_prefill_worker_stopped_mid_prefill_costs_no_request(pb, server_factory, failover_model):
    # No prefix cache: the faulted run prefills the reference run's prompts cold again.
    prefill = [worker(server_factory, failover_model, "prefill", "--prefix-cache-blocks", "0") for _ in range(2)]
    decode = [worker(server_factory, failover_model, "decode")]
    front = frontend(server_factory, failover_model, [p.address for p in prefill], [d.address for d in decode])
    # Long prompts, two per prefill worker: each takes several steps of --prefill-token-budget tokens.
    work = prompts(4, 1500, seed=3)
    max_tokens = 64
    greedy = lambda: [Stream(pb, front.address, p, max_tokens) for p in work]  # noqa: E731
    undisturbed = greedy()
    for s in undisturbed:
        s.join()
    reference = [s.ids for s in undisturbed]
    assert len(labels_of(undisturbed, "prefill_worker")) == 2, "the prompts did not use both prefill workers"

    # The watchdog's bound for a prefill is grace + slack x the worker's slowest recent step, as
    # it reported it: with 512-token steps of 1,500-token prompts that is more than 3 s on a slow
    # machine. The allowance follows the same report (defaults 1.5 s and 3).
    step = max(prefill_step_seconds(pb, p.address) for p in prefill)
    bound = watchdog_bound(step)
    streams = greedy()
    mark = front.log_mark()
    time.sleep(0.3)  # into the first prompts' prefill
    prefill[0].proc.send_signal(signal.SIGSTOP)
    stopped_at = time.monotonic()
    try:
        for s in streams:
            s.join()
        for i, (s, ref) in enumerate(zip(streams, reference)):
            assert s.error is None, f"stream {i}: {s.error.code()} {s.error.details()}"
            assert s.ids == ref, f"stream {i} differs from the undisturbed run"
        moved = [i for i, s in enumerate(streams) if s.final.timing.failovers > 0]
        assert moved, "no prompt was on the stopped prefill worker"
        assert failovers(front, "prefill") >= 1
        # Each moved prompt's first token: within 3 s + one re-prefill of the fault (the moved
        # prompts prefilled together, measured after).
        firsts = [streams[i].times[0] - stopped_at for i in moved]
        t0 = time.monotonic()
        again = [Stream(pb, front.address, work[i], 1) for i in moved]
        for s in again:
            s.join()
        allowed = bound + time.monotonic() - t0
        said = [float(m.group(1)) for line in front.log_since(mark) for m in [re.search(r"\(bound ([0-9.]+) s", line)] if m]
        print(f"stopped prefill worker: {len(moved)} of {len(streams)} prompts failed over; fault → first token "
              f"{', '.join(f'{g:.2f} s' for g in sorted(firsts))}; allowed {allowed:.2f} s (watchdog {bound:.2f} s; "
              f"the frontend's bounds {said})")
        assert max(firsts) <= allowed
        # The moved prompts end on the other prefill worker (one that finished before the stop
        # may show the stopped one).
        survivor = labels_of([streams[i] for i in moved], "prefill_worker")
        assert len(survivor) == 1, survivor
    finally:
        prefill[0].proc.send_signal(signal.SIGCONT)
    stopped_label = next(iter(labels_of(undisturbed, "prefill_worker") - survivor))
    assert new_work_reaches(pb, front, stopped_label), "the resumed prefill worker took no new work"
    assert wait_blocks_free(decode[0])


class Namespace:
    """A network namespace joined to this one by a veth pair: 10.X.0.1 here, 10.X.0.2 there.
    partition() takes the link down (packets are dropped silently both ways, nothing is reset);
    heal() brings it back."""

    def __init__(self):
        self.name = "baton-" + uuid.uuid4().hex[:8]
        self.host_if, self.ns_if = self.name[-8:] + "h", self.name[-8:] + "n"
        octet = 64 + int(self.name[-2:], 16) % 128
        self.here, self.there = f"10.{octet}.0.1", f"10.{octet}.0.2"
        self.up = False

    def __enter__(self):
        def ip(*args, ns=False):
            subprocess.run((["ip", "netns", "exec", self.name] if ns else []) + ["ip", *args], check=True,
                           capture_output=True)
        ip("netns", "add", self.name)
        self.up = True
        ip("link", "add", self.host_if, "type", "veth", "peer", "name", self.ns_if)
        ip("link", "set", self.ns_if, "netns", self.name)
        ip("addr", "add", f"{self.here}/24", "dev", self.host_if)
        ip("link", "set", self.host_if, "up")
        ip("addr", "add", f"{self.there}/24", "dev", self.ns_if, ns=True)
        ip("link", "set", self.ns_if, "up", ns=True)
        ip("link", "set", "lo", "up", ns=True)
        return self

    def wrapper(self):
        return ("ip", "netns", "exec", self.name)

    def partition(self):
        subprocess.run(["ip", "link", "set", self.host_if, "down"], check=True)

    def heal(self):
        subprocess.run(["ip", "link", "set", self.host_if, "up"], check=True)

    def __exit__(self, *exc):
        subprocess.run(["ip", "link", "del", self.host_if], capture_output=True)
        subprocess.run(["ip", "netns", "del", self.name], capture_output=True)


def network_namespaces_usable():
    if os.geteuid() != 0 or shutil.which("ip") is None:
        return False
    probe = "baton-probe-" + uuid.uuid4().hex[:6]
    ok = subprocess.run(["ip", "netns", "add", probe], capture_output=True).returncode == 0
    subprocess.run(["ip", "netns", "del", probe], capture_output=True)
    return ok


@pytest.mark.skipif(not network_namespaces_usable(), reason="network namespaces need root and iproute2")
def test_decode_worker_partitioned_from_the_frontend_costs_no_request(pb, server_factory, failover_model):
    """One decode worker in its own network namespace, the rest on this side of a veth pair; the
    link goes down mid-stream (the issue's `tc netem loss 100%`: this kernel has no netem, and a
    downed link drops every packet the same way, with no reset)."""
    with Namespace() as ns:
        # Addresses on the veth, so that the KV the prefill worker sends to either decode worker
        # comes from the host the frontend named (the decode workers check it). Not loopback:
        # plaintext needs --insecure.
        prefill = [worker(server_factory, failover_model, "prefill", "--insecure", listen=f"{ns.here}:0")]
        # The cut-off worker pings its callers every second (its log at info: what its sequences did).
        decode = [worker(server_factory, failover_model, "decode", "--insecure", "--log-level", "info",
                         "--worker-keepalive-seconds", "1", "--worker-keepalive-timeout-seconds", "1",
                         listen=f"{ns.there}:0", wrapper=ns.wrapper()),
                  worker(server_factory, failover_model, "decode", "--insecure", listen=f"{ns.here}:0")]
        front = frontend(server_factory, failover_model, [p.address for p in prefill], [d.address for d in decode],
                         "--insecure")
        at = {}

        def partition():
            at["mark"] = decode[0].log_mark()
            ns.partition()

        try:
            # Its streams must outlast the keepalive's verdict (a ping a second, a second to answer,
            # ~2 s) however fast this machine decodes: 3 s of tokens to go. (At 6 s the partition
            # lasts long enough that, after the heal, new requests' KV hand-offs from the prefill
            # worker stall past the progress bound now and then: a hole of its own, not this test's.)
            cut = decode_fault_mid_stream(pb, front, prompts(8, 40, seed=5), partition, "partitioned decode worker",
                                          seconds_left=3.0)
            # Still cut off: the worker's pings went unanswered, so it cancelled the calls the frontend
            # gave up on itself, and none of its sequences ran on to max_tokens (each had some 6 s of
            # tokens to go at the undisturbed pace; the streams all ended elsewhere by now).
            log = decode[0].log_since(at["mark"])
            ended = [line for line in log if " ended: CANCELLED" in line]
            finished = [line for line in log if " finished: " in line]
            print(f"cut-off decode worker: {len(ended)} sequences cancelled by its keepalive, {len(finished)} ran on")
            assert ended and not finished, log[-20:]
        finally:
            ns.heal()
        assert new_work_reaches(pb, front, cut), "the decode worker took no new work after the link healed"
        assert wait_blocks_free(decode[0]) and wait_blocks_free(decode[1])


class BlackHoleRelay:
    """A TCP relay to `target`; after swallow() it still accepts connections and reads what comes,
    but forwards nothing either way and answers nothing: a worker that accepts and never answers."""

    def __init__(self, target):
        self.target = target
        self.swallowing = threading.Event()
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.address = f"127.0.0.1:{self.listener.getsockname()[1]}"
        self.sockets = []
        threading.Thread(target=self._accept, daemon=True).start()

    def swallow(self):
        self.swallowing.set()

    def _accept(self):
        while True:
            try:
                conn, _ = self.listener.accept()
            except OSError:
                return
            self.sockets.append(conn)
            if self.swallowing.is_set():
                threading.Thread(target=self._pipe, args=(conn, None), daemon=True).start()
                continue
            host, port = self.target.rsplit(":", 1)
            up = socket.create_connection((host, int(port)))
            self.sockets.append(up)
            threading.Thread(target=self._pipe, args=(conn, up), daemon=True).start()
            threading.Thread(target=self._pipe, args=(up, conn), daemon=True).start()

    def _pipe(self, src, dst):
        try:
            while True:
                data = src.recv(65536)
                if not data:
                    break
                if dst is not None and not self.swallowing.is_set():
                    dst.sendall(data)
        except OSError:
            pass

    def close(self):
        self.listener.close()
        for s in self.sockets:
            try:
                s.close()
            except OSError:
                pass


def test_decode_worker_that_never_answers_costs_no_request(pb, server_factory, failover_model):
    prefill = [worker(server_factory, failover_model, "prefill")]
    decode = [worker(server_factory, failover_model, "decode") for _ in range(2)]
    relay = BlackHoleRelay(decode[0].address)
    try:
        front = frontend(server_factory, failover_model, [p.address for p in prefill],
                         [relay.address, decode[1].address])
        decode_fault_mid_stream(pb, front, prompts(8, 40, seed=6), relay.swallow, "silent decode worker")
        # It stays silent: new requests go to the other one and complete.
        for s in run_all(pb, front.address, prompts(4, 20, seed=7), 16):
            assert s.error is None, s.error.details()
    finally:
        relay.close()
