#!/usr/bin/env python3
"""Chaos under load: a frontend over two prefill and two decode workers (`baton serve` roles, one
decode worker in a network namespace of its own), a closed loop of C concurrent greedy streams,
and every few seconds a fault on a random worker: SIGKILL (restarted on the same port a few
seconds later), SIGSTOP (SIGCONT a few seconds later), or for the namespaced decode worker a
partition (its veth link down, then up). One fault at a time; the next comes after the last healed.

It reports, as the issue asks:
- requests lost (ended with an error: the goal is 0), duplicated (more tokens than max_tokens, a
  second final message: 0), greedy mismatches (output differs from the prompt's undisturbed
  output: 0);
- KV blocks not returned once the run is over and every worker is back (0);
- the time from each fault to the next token of each stream in flight then (the longest gap
  between two of its tokens that spans the fault): p50, p99, max.

Prompts come from a pool whose undisturbed outputs are measured first, on the same deployment,
twice at the same concurrency (the two runs must agree: greedy serving is deterministic here,
whatever the batch). Exit status 1 when any of the four counts is not 0.

Run from the repository root after scripts/build.sh, as root (network namespaces), with the
test venv (scripts/env.sh):
  $BATON_VENV/bin/python bench/chaos.py [--seconds 600] [--concurrency 8] [--json OUT]
"""

import argparse
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tests" / "integration"))

from serving_harness import Server, Stream, compile_protos, make_test_model, wait_blocks_free  # noqa: E402

FLAGS = ("--dtype", "f32", "--threads", "1")


class Namespace:
    """A network namespace joined to this one by a veth pair: `here` on this side, `there` inside."""

    def __init__(self):
        self.name = "baton-chaos-" + uuid.uuid4().hex[:6]
        self.host_if, self.ns_if = "bc" + self.name[-6:] + "h", "bc" + self.name[-6:] + "n"
        octet = 64 + int(self.name[-2:], 16) % 128
        self.here, self.there = f"10.{octet}.1.1", f"10.{octet}.1.2"

    def ip(self, *args, ns=False):
        subprocess.run((["ip", "netns", "exec", self.name] if ns else []) + ["ip", *args], check=True,
                       capture_output=True)

    def __enter__(self):
        self.ip("netns", "add", self.name)
        self.ip("link", "add", self.host_if, "type", "veth", "peer", "name", self.ns_if)
        self.ip("link", "set", self.ns_if, "netns", self.name)
        self.ip("addr", "add", f"{self.here}/24", "dev", self.host_if)
        self.ip("link", "set", self.host_if, "up")
        self.ip("addr", "add", f"{self.there}/24", "dev", self.ns_if, ns=True)
        self.ip("link", "set", self.ns_if, "up", ns=True)
        self.ip("link", "set", "lo", "up", ns=True)
        return self

    def link(self, up):
        self.ip("link", "set", self.host_if, "up" if up else "down")

    def __exit__(self, *exc):
        subprocess.run(["ip", "link", "del", self.host_if], capture_output=True)
        subprocess.run(["ip", "netns", "del", self.name], capture_output=True)


class Worker:
    """A worker process that can be killed and started again on the same address."""

    def __init__(self, bin_, model, role, host, wrapper=()):
        self.bin, self.model, self.role, self.wrapper = bin_, model, role, wrapper
        self.server = Server(bin_, model, *FLAGS, "--insecure", subcommand=("serve", "--role", role),
                             listen=f"{host}:0", wrapper=wrapper)
        self.address = self.server.address

    def restart(self):
        self.server.proc.wait()
        self.server = Server(self.bin, self.model, *FLAGS, "--insecure", subcommand=("serve", "--role", self.role),
                             listen=self.address, wrapper=self.wrapper)

    def stop(self):
        self.server.proc.send_signal(signal.SIGCONT)
        self.server.stop()


def pool_prompts(n, length, seed):
    rng = random.Random(seed)
    return [[rng.randrange(3, 270) for _ in range(length)] for _ in range(n)]


def run_pool(pb, address, pool, max_tokens, concurrency):
    """Each prompt of the pool once, `concurrency` at a time: {index: ids}."""
    out, lock, todo = {}, threading.Lock(), list(range(len(pool)))

    def client():
        while True:
            with lock:
                if not todo:
                    return
                i = todo.pop()
            s = Stream(pb, address, pool[i], max_tokens, timeout=600)
            s.join()
            if s.error is not None:
                raise SystemExit(f"undisturbed run: prompt {i} failed: {s.error.code()} {s.error.details()}")
            out[i] = s.ids

    threads = [threading.Thread(target=client) for _ in range(concurrency)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--bin", default=os.environ.get("BATON_BIN", str(REPO / "build" / "baton")))
    ap.add_argument("--seconds", type=float, default=600)
    ap.add_argument("--concurrency", type=int, default=8)
    ap.add_argument("--pool", type=int, default=48, help="distinct prompts")
    ap.add_argument("--prompt-tokens", type=int, default=48)
    ap.add_argument("--max-tokens", type=int, default=96)
    ap.add_argument("--fault-every", type=float, nargs=2, default=(4.0, 10.0), metavar=("MIN", "MAX"),
                    help="seconds between a fault's healing and the next fault")
    ap.add_argument("--fault-lasts", type=float, nargs=2, default=(2.0, 6.0), metavar=("MIN", "MAX"))
    ap.add_argument("--seed", type=int, default=None)
    ap.add_argument("--json", help="also write the results here")
    a = ap.parse_args()
    if os.geteuid() != 0 or shutil.which("ip") is None:
        raise SystemExit("chaos.py needs root and iproute2 (its partitions are network namespaces)")
    seed = a.seed if a.seed is not None else random.randrange(1 << 30)
    rng = random.Random(seed)
    tmp = Path(tempfile.mkdtemp(prefix="baton-chaos-"))
    (tmp / "pb").mkdir()
    pb = compile_protos(tmp / "pb")
    model = make_test_model(a.bin, tmp / "model.gguf", seed=11, layers=4, dim=512, heads=8, kv_heads=4, ffn=1536,
                            ctx=2048)
    workers, front = [], None
    with Namespace() as ns:
        try:
            # Every worker listens where each of the others reaches it (the veth's two ends), so
            # that KV comes from the host the frontend named.
            prefill = [Worker(a.bin, model, "prefill", ns.here) for _ in range(2)]
            decode = [Worker(a.bin, model, "decode", ns.there, wrapper=("ip", "netns", "exec", ns.name)),
                      Worker(a.bin, model, "decode", ns.here)]
            workers = prefill + decode
            front = Server(a.bin, model, "--insecure", "--prefill-addresses", ",".join(w.address for w in prefill),
                           "--decode-addresses", ",".join(w.address for w in decode),
                           subcommand=("serve", "--role", "frontend"))
            pool = pool_prompts(a.pool, a.prompt_tokens, seed)
            ref = run_pool(pb, front.address, pool, a.max_tokens, a.concurrency)
            again = run_pool(pb, front.address, pool, a.max_tokens, a.concurrency)
            unstable = [i for i in ref if ref[i] != again[i]]
            if unstable:
                raise SystemExit(f"greedy output differs between two undisturbed runs for prompts {unstable}: "
                                 "no reference to compare with")
            result = chaos(pb, front, ns, prefill, decode, pool, ref, a, rng)
            # Everything back: every worker up, then every KV block free.
            for w in workers:
                w.server.proc.send_signal(signal.SIGCONT)
            ns.link(True)
            time.sleep(2)
            unreturned = 0
            for w in workers:
                if not wait_blocks_free(w.server, timeout=30, role=w.role):
                    text = w.server.metrics()
                    free = [float(line.split()[-1]) for line in text.splitlines()
                            if line.startswith("baton_kv_blocks_free{")]
                    total = [float(line.split()[-1]) for line in text.splitlines()
                             if line.startswith("baton_kv_blocks_capacity{")]
                    unreturned += int(sum(total) - sum(free))
            result["kv_blocks_not_returned"] = unreturned
        finally:
            if front is not None:
                front.stop()
            for w in workers:
                w.stop()
    result.update(seed=seed, seconds=a.seconds, concurrency=a.concurrency)
    report(result)
    if a.json:
        Path(a.json).write_text(json.dumps(result, indent=1))
    bad = result["lost"] + result["duplicated"] + result["greedy_mismatches"] + result["kv_blocks_not_returned"]
    sys.exit(1 if bad else 0)


def chaos(pb, front, ns, prefill, decode, pool, ref, a, rng):
    stop_at = time.monotonic() + a.seconds
    lock = threading.Lock()
    done = []   # finished streams: (prompt index, Stream)
    live = set()  # streams in flight

    def client(k):
        crng = random.Random(rng.randrange(1 << 30) + k)
        while time.monotonic() < stop_at:
            i = crng.randrange(len(pool))
            s = Stream(pb, front.address, pool[i], a.max_tokens, timeout=600)
            with lock:
                live.add(s)
            s.join()
            with lock:
                live.discard(s)
                done.append((i, s))

    clients = [threading.Thread(target=client, args=(k,)) for k in range(a.concurrency)]
    for t in clients:
        t.start()
    faults = []  # (kind, worker role, time, streams in flight then)
    targets = [("prefill", w) for w in prefill] + [("decode", w) for w in decode]
    while time.monotonic() + a.fault_every[1] + a.fault_lasts[1] < stop_at:
        time.sleep(rng.uniform(*a.fault_every))
        role, w = rng.choice(targets)
        kinds = ["kill", "stop"] + (["partition"] if w is decode[0] else [])
        kind = rng.choice(kinds)
        with lock:
            in_flight = list(live)
        at = time.monotonic()
        if kind == "kill":
            w.server.proc.kill()
        elif kind == "stop":
            w.server.proc.send_signal(signal.SIGSTOP)
        else:
            ns.link(False)
        faults.append((kind, role, at, in_flight))
        print(f"{at - stop_at + a.seconds:7.1f} s: {kind} {role} worker {w.address}", flush=True)
        time.sleep(rng.uniform(*a.fault_lasts))
        if kind == "kill":
            w.restart()
        elif kind == "stop":
            w.server.proc.send_signal(signal.SIGCONT)
        else:
            ns.link(True)
    for t in clients:
        t.join()

    lost = duplicated = mismatched = 0
    failovers = 0
    for i, s in done:
        if s.error is not None:
            lost += 1
            print(f"lost: prompt {i}: {s.error.code()} {s.error.details()}", flush=True)
            continue
        if len(s.ids) > a.max_tokens:
            duplicated += 1
        failovers += s.final.timing.failovers
        if s.ids != ref[i]:
            mismatched += 1
            k = next((j for j, (x, y) in enumerate(zip(s.ids, ref[i])) if x != y), min(len(s.ids), len(ref[i])))
            print(f"mismatch: prompt {i} at token {k} (failovers {s.final.timing.failovers})", flush=True)
    waits = []
    for kind, role, at, in_flight in faults:
        for s in in_flight:
            times = s.times
            spans = [b - max(x, at) for x, b in zip([s.started] + times, times) if b >= at]
            if spans and times[-1] > at:
                waits.append((max(spans), kind, role))
    ws = sorted(w for w, _, _ in waits)

    def pct(p):
        return ws[min(len(ws) - 1, int(p * len(ws)))] if ws else float("nan")

    by_kind = {}
    for w, kind, role in waits:
        by_kind.setdefault(f"{kind} {role}", []).append(w)
    return dict(requests=len(done), lost=lost, duplicated=duplicated, greedy_mismatches=mismatched,
                failovers=failovers, faults=len(faults),
                faults_by_kind={k: sum(1 for f in faults if f"{f[0]} {f[1]}" == k) for k in by_kind},
                fault_to_next_token_p50=pct(0.5), fault_to_next_token_p99=pct(0.99),
                fault_to_next_token_max=ws[-1] if ws else float("nan"),
                fault_to_next_token_max_by_kind={k: max(v) for k, v in by_kind.items()},
                tokens=sum(len(s.ids) for _, s in done))


def report(r):
    print(f"\nseed {r['seed']}: {r['seconds']:.0f} s at c={r['concurrency']}, {r['faults']} faults "
          f"({', '.join(f'{v} {k}' for k, v in sorted(r['faults_by_kind'].items()))})")
    print(f"requests {r['requests']} ({r['tokens']} tokens, {r['failovers']} failovers): lost {r['lost']}, "
          f"duplicated {r['duplicated']}, greedy mismatches {r['greedy_mismatches']}, KV blocks not returned "
          f"{r['kv_blocks_not_returned']}")
    print(f"fault → next token of each stream in flight: p50 {r['fault_to_next_token_p50']:.2f} s, p99 "
          f"{r['fault_to_next_token_p99']:.2f} s, max {r['fault_to_next_token_max']:.2f} s")
    for k, v in sorted(r["fault_to_next_token_max_by_kind"].items()):
        print(f"  max after {k}: {v:.2f} s")


if __name__ == "__main__":
    main()
