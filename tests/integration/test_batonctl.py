"""`batonctl`, the command-line client, against real `baton local` servers on the random test
model: `generate` returns the same ids as single-process `baton generate` and prints the timing
block; errors are one line with exit code 1 (server / RPC) or 2 (flags); `bench` in closed-loop
and Poisson mode reports every request, the right token counts and ordered percentiles; its
--plot SVG draws the --json report's values; the chat workload grows its prompts turn by turn
from a shared system prompt (checked exactly against a recording frontend); Poisson arrivals
have exponential gaps; goodput counts the requests within the SLOs."""

import json
import math
import random
import re
import socket
import statistics
import subprocess
import threading
import xml.etree.ElementTree as ET
from concurrent import futures

import pytest

@pytest.fixture(scope="module")
def vocab(pb, shared_server):
    """The test model's vocabulary size, as ListModels reports it."""
    import grpc

    with grpc.insecure_channel(shared_server.address) as ch:
        models = pb.gen_grpc.GenerationStub(ch).ListModels(pb.gen.ListModelsRequest(), timeout=30)
    return models.models[0].vocab_size


@pytest.fixture(scope="module")
def rng():
    seed = random.randrange(1 << 30)
    print(f"random seed {seed}")
    return random.Random(seed)


def run(*args, timeout=60):
    return subprocess.run([str(a) for a in args], capture_output=True, text=True, timeout=timeout)


def unused_address():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return f"127.0.0.1:{s.getsockname()[1]}"  # closed again: nobody listens there


def assert_one_error_line(proc, code, pattern):
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == code, proc.stderr
    assert len(lines) == 1, proc.stderr
    assert re.match(r"batonctl: error: " + pattern, lines[0]), lines[0]


def reference_ids(baton_bin, model, prompt, max_tokens):
    out = subprocess.run([str(baton_bin), "generate", "--model", str(model), "--prompt-ids", ",".join(map(str, prompt)),
                          "--max-tokens", str(max_tokens), "--print-ids", "--ignore-eos", "--dtype", "f32"],
                         check=True, capture_output=True, text=True, timeout=60)
    return out.stdout.strip()


def test_generate_ids_equal_single_process(batonctl, baton_bin, test_model, server_factory, rng, vocab):
    srv = server_factory(test_model, "--dtype", "f32")
    for n in (6, 50):
        prompt = [rng.randrange(3, vocab) for _ in range(n)]
        want = reference_ids(baton_bin, test_model, prompt, 8)
        got = run(batonctl, "generate", "--address", srv.address, "--prompt-ids", ",".join(map(str, prompt)),
                  "--max-tokens", "8", "--ignore-eos", "--print-ids")
        assert got.returncode == 0, got.stderr
        assert got.stdout.strip() == want, f"prompt {prompt}"
        assert len(got.stdout.strip().split(",")) == 8
        # The timing block of the final message.
        err = got.stderr
        assert re.search(rf"^finish: length \| prompt {n} tokens, completion 8 tokens$", err, re.M), err
        ms = r"[0-9.]+ ms"
        assert re.search(rf"^queue {ms} \| prefill {ms} \| kv transfer {ms} \| decode queue {ms} \| ttft {ms} \| "
                         rf"e2e {ms}$", err, re.M), err
        assert re.search(r"^prefill worker prefill-[0-9a-f]{8} \| decode worker decode-[0-9a-f]{8}$", err, re.M), err


def test_generate_with_penalties_and_logprobs_equals_single_process(batonctl, baton_bin, test_model, server_factory,
                                                                    rng, vocab):
    srv = server_factory(test_model, "--dtype", "f32")
    prompt = ",".join(str(rng.randrange(3, vocab)) for _ in range(20))
    penalties = ["--presence-penalty", "0.8", "--frequency-penalty", "0.5", "--repetition-penalty", "1.3"]
    want = subprocess.run([str(baton_bin), "generate", "--model", str(test_model), "--prompt-ids", prompt,
                           "--max-tokens", "12", "--print-ids", "--ignore-eos", "--dtype", "f32", *penalties],
                          check=True, capture_output=True, text=True, timeout=60).stdout.strip()
    got = run(batonctl, "generate", "--address", srv.address, "--prompt-ids", prompt, "--max-tokens", "12",
              "--ignore-eos", "--print-ids", "--logprobs", "3", *penalties)
    assert got.returncode == 0, got.stderr
    assert got.stdout.strip() == want
    # A line per token: its id, its log-probability, three alternatives.
    lines = re.findall(r"^token (\d+) (-?[0-9.]+) \|((?: \d+:-?[0-9.]+){3})$", got.stderr, re.M)
    assert [int(t) for t, _, _ in lines] == [int(t) for t in want.split(",")], got.stderr
    assert all(float(lp) <= 0 for _, lp, _ in lines)
    bad = run(batonctl, "generate", "--address", srv.address, "--prompt-ids", prompt, "--presence-penalty", "3")
    assert bad.returncode != 0 and "--presence-penalty" in bad.stderr


def test_generate_streams_text(batonctl, shared_server):
    got = run(batonctl, "generate", "--address", shared_server.address, "--prompt", "The quick brown fox",
              "--max-tokens", "6", "--ignore-eos", "--temperature", "0.8", "--seed", "3", "--request-id", "ctl-text")
    assert got.returncode == 0, got.stderr
    assert got.stdout.endswith("\n")
    assert "completion 6 tokens" in got.stderr
    # The address can come from the environment too.
    env_run = subprocess.run([str(batonctl), "generate", "--chat", "hi", "--system", "be brief", "--max-tokens", "3"],
                             capture_output=True, text=True, timeout=60,
                             env={"BATONCTL_ADDRESS": shared_server.address, "PATH": "/usr/bin:/bin"})
    assert env_run.returncode == 0, env_run.stderr
    assert "finish: " in env_run.stderr


def test_generate_errors(batonctl, shared_server, vocab):
    # Nobody listening: one line, exit 1.
    got = run(batonctl, "generate", "--address", unused_address(), "--prompt-ids", "1,2,3", "--timeout", "20")
    assert_one_error_line(got, 1, r"UNAVAILABLE: ")
    # The server refuses a field: exit 1 with the server's message.
    got = run(batonctl, "generate", "--address", shared_server.address, "--prompt-ids", f"1,{vocab + 5}")
    assert_one_error_line(got, 1, r"INVALID_ARGUMENT: .*prompt_token_ids")
    # Bad flags: exit 2, before any RPC.
    for flags in (["--prompt-ids", "1,x"], [], ["--prompt", "a", "--chat", "b"], ["--prompt", "a", "--max-tokens", "0"]):
        got = run(batonctl, "generate", "--address", shared_server.address, *flags)
        assert_one_error_line(got, 2, r".+")


def check_bench_json(report, n_requests, output_tokens, prompt_tokens):
    assert report["requests"]["ok"] == n_requests, report["requests"]
    assert report["requests"]["failed"] == 0
    assert report["tokens"]["output"] == n_requests * output_tokens
    assert report["tokens"]["prompt"] == n_requests * prompt_tokens
    assert report["wall_seconds"] > 0
    tp = report["throughput"]
    assert tp["requests_per_second"] == pytest.approx(n_requests / report["wall_seconds"])
    assert tp["output_tokens_per_second"] == pytest.approx(n_requests * output_tokens / report["wall_seconds"])
    lat = report["latency_ms"]
    for key in ("ttft", "itl", "e2e", "server_queue", "server_prefill", "server_kv_transfer"):
        s = lat[key]
        assert s["n"] > 0, key
        assert 0 <= s["p50"] <= s["p90"] <= s["p99"] <= s["max"], (key, s)
        assert s["mean"] <= s["max"], (key, s)
    for key in ("ttft", "e2e", "server_queue", "server_prefill", "server_kv_transfer", "server_ttft"):
        assert lat[key]["n"] == n_requests, key
    # One gap per token after the first, unless the server sent several tokens in one message.
    assert 0 < lat["itl"]["n"] <= n_requests * (output_tokens - 1)
    assert lat["e2e"]["p50"] >= lat["ttft"]["p50"]


def test_bench_concurrency(batonctl, shared_server, tmp_path):
    out = tmp_path / "bench.json"
    got = run(batonctl, "bench", "--address", shared_server.address, "--requests", "12", "--concurrency", "4",
              "--prompt-tokens", "32", "--output-tokens", "8", "--warmup", "2", "--json", out)
    assert got.returncode == 0, got.stderr
    assert re.search(r"requests\s+12 ok, 0 failed", got.stdout), got.stdout
    for row in ("ttft", "itl", "e2e", "server queue", "server prefill", "server kv transfer"):
        assert re.search(rf"^\s+{row}\s+[0-9.]+\s+[0-9.]+\s+[0-9.]+\s+[0-9.]+", got.stdout, re.M), row
    report = json.loads(out.read_text())
    assert report["config"]["mode"] == "concurrency" and report["config"]["concurrency"] == 4
    check_bench_json(report, 12, 8, 32)


def test_bench_rate(batonctl, shared_server, tmp_path):
    out = tmp_path / "bench.json"
    got = run(batonctl, "bench", "--address", shared_server.address, "--requests", "12", "--rate", "20",
              "--prompt-tokens", "32", "--output-tokens", "8", "--seed", "5", "--json", out)
    assert got.returncode == 0, got.stderr
    report = json.loads(out.read_text())
    assert report["config"]["mode"] == "rate" and report["config"]["rate"] == 20
    check_bench_json(report, 12, 8, 32)


def test_bench_errors(batonctl, shared_server):
    got = run(batonctl, "bench", "--address", unused_address(), "--requests", "2", "--concurrency", "1",
              "--timeout", "20")
    assert_one_error_line(got, 1, r"ListModels on .*UNAVAILABLE: ")
    got = run(batonctl, "bench", "--address", shared_server.address, "--requests", "2")
    assert_one_error_line(got, 2, r".*--concurrency or --rate")
    got = run(batonctl, "bench", "--address", shared_server.address, "--concurrency", "1", "--rate", "3")
    assert_one_error_line(got, 2, r".+")
    got = run(batonctl, "bench", "--address", shared_server.address, "--concurrency", "1", "--prompt-tokens", "1000",
              "--output-tokens", "100")
    assert_one_error_line(got, 2, r".*exceeds the context")
    # The test model's context is 1024: the last of 4 turns would send 100 + 4 * 200 + 3 * 50 ids.
    got = run(batonctl, "bench", "--address", shared_server.address, "--concurrency", "1", "--workload", "chat",
              "--turns", "4", "--system-prompt-tokens", "100", "--prompt-tokens", "200", "--output-tokens", "50")
    assert_one_error_line(got, 2, r".*last chat turn.* = 1100 exceeds the context")
    for flags in (["--workload", "chat", "--requests", "3"], ["--workload", "chat", "--duration", "2"],
                  ["--turns", "3"], ["--requests", "3", "--duration", "2"], ["--plot", "x.png"],
                  ["--workload", "dialogue"], ["--slo-ttft", "0"]):
        got = run(batonctl, "bench", "--address", shared_server.address, "--concurrency", "1", *flags)
        assert_one_error_line(got, 2, r".+")


SVG = "{http://www.w3.org/2000/svg}"


def classes(el):
    return el.get("class", "").split()


def find_class(root, cls, **data):
    """Elements of class `cls` whose data-* attributes equal `data` (data_p="50" -> data-p)."""
    return [el for el in root.iter() if cls in classes(el)
            and all(el.get("data-" + k.replace("_", "-")) == v for k, v in data.items())]


def axis_scale(panel, axis):
    """(px of value 0, px per unit) of a panel's x-axis or y-axis, from its tick lines and labels."""
    ticks = []
    (ax,) = find_class(panel, axis)
    for tick in find_class(ax, "tick"):
        line, text = tick.find(SVG + "line"), tick.find(SVG + "text")
        px = float(line.get("x1" if axis == "x-axis" else "y1"))
        ticks.append((float(text.text), px))
    assert len(ticks) >= 2, ticks
    (v0, p0), (v1, p1) = ticks[0], ticks[-1]
    per_unit = (p1 - p0) / (v1 - v0)
    return p0 - v0 * per_unit, per_unit


def shown_close(shown, value):
    """`shown` (a printed number) is `value` rounded to the digits it shows."""
    decimals = len(shown.split(".")[1]) if "." in shown else 0
    return abs(float(shown) - value) <= 0.5 * 10 ** -decimals + 1e-9


def test_bench_plot_draws_the_json_values(batonctl, shared_server, tmp_path):
    out, svg_path, html_path = tmp_path / "bench.json", tmp_path / "bench.svg", tmp_path / "bench.html"
    got = run(batonctl, "bench", "--address", shared_server.address, "--requests", "16", "--concurrency", "3",
              "--prompt-tokens", "24", "--output-tokens", "6", "--slo-ttft", "10", "--json", out, "--plot", svg_path,
              "--plot", html_path)
    assert got.returncode == 0, got.stderr
    report = json.loads(out.read_text())
    text = svg_path.read_text()
    assert len(text) < 100_000
    root = ET.fromstring(text.encode())  # well-formed XML, or this raises
    assert root.tag == SVG + "svg"
    # The HTML page embeds the same drawing.
    html = html_path.read_text()
    assert html.startswith("<!DOCTYPE html>") and text[text.index("<svg"):] in html

    # TTFT and ITL: a CDF each, with p50/p90/p99 drawn at the report's values and named with them.
    for metric in ("ttft", "itl"):
        (panel,) = find_class(root, "panel", metric=metric)
        (cdf,) = find_class(panel, "cdf", metric=metric)
        n = report["latency_ms"][metric]["n"]
        assert cdf.get("d").count("V") == min(n, 400)
        x0, per_ms = axis_scale(panel, "x-axis")
        for p in ("50", "90", "99"):
            want = report["latency_ms"][metric]["p" + p]
            (label,) = find_class(panel, "percentile-label", metric=metric, p=p)
            m = re.fullmatch(rf"p{p} ([0-9.]+) ms", label.text)
            assert m and shown_close(m.group(1), want), (label.text, want)
            (marker,) = find_class(panel, "percentile", metric=metric, p=p)
            x = float(marker.find(SVG + "line").get("x1"))
            assert abs((x - x0) / per_ms - want) <= 0.02 / per_ms + 1e-6, (metric, p, x, want)
        assert any(t.text.startswith("ms") for t in find_class(panel, "axis-title"))
    (slo_label,) = find_class(root, "slo-label", metric="ttft")
    assert slo_label.text.startswith("SLO 10000 ms")

    # The breakdown: one stacked bar per request in completion order, segment heights = server_ms.
    (panel,) = find_class(root, "panel", metric="server_breakdown")
    legend = {t.text for t in find_class(panel, "legend-label")}
    assert {"queue", "prefill", "KV transfer", "decode queue", "decode (rest of e2e)"} <= legend
    rows = sorted((r for r in report["per_request"] if r["server_ms"] is not None),
                  key=lambda r: (r["finished_seconds"], r["index"]))
    assert len(rows) == 16
    y0, per_ms = axis_scale(panel, "y-axis")  # negative: y grows downwards
    tops = [y0] * len(rows)
    for key in ("queue", "prefill", "kv_transfer", "decode_queue", "decode"):
        (seg,) = find_class(panel, "segment", segment=key)
        rects = seg.findall(SVG + "rect")
        assert len(rects) == len(rows), key
        for i, (rect, row) in enumerate(zip(rects, rows)):
            height = float(rect.get("height"))
            assert abs(height / -per_ms - row["server_ms"][key]) <= 0.03 / -per_ms, (key, i, height, row)
            # Stacked: each segment sits on the one below it.
            assert abs(float(rect.get("y")) + height - tops[i]) <= 0.03, (key, i)
            tops[i] = float(rect.get("y"))
    for row in rows:
        m = row["server_ms"]
        parts = m["queue"] + m["prefill"] + m["kv_transfer"] + m["decode_queue"]
        assert m["decode"] == pytest.approx(max(0.0, m["e2e"] - parts), abs=1e-9)


def check_chat_rows(rows, conversations, turns, system, prompt, output):
    """Every conversation's turns: once each, prompt S + t·P + (t−1)·O ids, one after the other."""
    assert len(rows) == conversations * turns
    by_conv = {}
    for r in rows:
        by_conv.setdefault(r["conversation"], []).append(r)
    assert sorted(by_conv) == list(range(conversations))
    for conv, rs in by_conv.items():
        rs.sort(key=lambda r: r["turn"])
        assert [r["turn"] for r in rs] == list(range(1, turns + 1)), conv
        for r in rs:
            t = r["turn"]
            assert r["prompt_tokens"] == system + t * prompt + (t - 1) * output, r
        for a, b in zip(rs, rs[1:]):
            assert b["sent_seconds"] >= a["finished_seconds"], (a, b)  # sequential within a conversation
    return by_conv


def test_bench_chat_grows_the_history(batonctl, shared_server, tmp_path, pb):
    out = tmp_path / "chat.json"
    c, t, s, p, o = 5, 3, 40, 12, 5
    got = run(batonctl, "bench", "--address", shared_server.address, "--workload", "chat", "--conversations", c,
              "--turns", t, "--system-prompt-tokens", s, "--prompt-tokens", p, "--output-tokens", o,
              "--concurrency", 2, "--json", out, "--plot", tmp_path / "chat.svg")
    assert got.returncode == 0, got.stderr
    report = json.loads(out.read_text())
    assert report["config"]["workload"] == "chat"
    assert report["requests"]["ok"] == c * t and report["requests"]["failed"] == 0
    rows = report["per_request"]
    by_conv = check_chat_rows(rows, c, t, s, p, o)
    for r in rows:
        assert r["server_prompt_tokens"] == r["prompt_tokens"]  # the server counted what was sent
        assert r["output_tokens"] == o
    assert report["tokens"]["prompt"] == sum(r["prompt_tokens"] for r in rows)
    # --concurrency 2: never more than two conversations in progress.
    spans = [(min(r["sent_seconds"] for r in rs), max(r["finished_seconds"] for r in rs)) for rs in by_conv.values()]
    for start, _ in spans:
        assert sum(1 for a, b in spans if a <= start < b) <= 2, spans
    # Per-turn TTFT, in the JSON and the table.
    assert [x["turn"] for x in report["turns"]] == [1, 2, 3]
    for x in report["turns"]:
        assert x["ok"] == c
        assert x["prompt_tokens_mean"] == s + x["turn"] * p + (x["turn"] - 1) * o
        assert 0 < x["ttft_ms"]["p50"] <= x["ttft_ms"]["p99"]
    for turn in (1, 2, 3):
        assert re.search(rf"^\s+{turn}\s+{c}\s+0\s+[0-9.]+\s+[0-9.]+\s+[0-9.]+\s+\S+$", got.stdout, re.M), got.stdout
    # Cached prompt tokens: reported exactly when this build's generate.proto has the field.
    has_field = "cached_prompt_tokens" in pb.gen.Timing.DESCRIPTOR.fields_by_name
    assert (report["tokens"]["cached_prompt"] is not None) == has_field
    if not has_field:
        assert re.search(r"^cached prompt\s+not reported by the server$", got.stdout, re.M), got.stdout
    else:
        # The shared system prompt's whole blocks come from the prefix cache after the first turn
        # that sent it; every later turn of a conversation also finds its own history there.
        cached = report["tokens"]["cached_prompt"]
        assert cached == sum(r["cached_prompt_tokens"] for r in rows) > 0
        assert report["tokens"]["cached_prompt_ratio"] == pytest.approx(cached / report["tokens"]["prompt"])
        m = re.search(r"^cached prompt\s+(\d+) of (\d+) prompt tokens \(hit ratio ([0-9.]+) %\)$", got.stdout, re.M)
        assert m and int(m.group(1)) == cached, got.stdout
        assert float(m.group(3)) == pytest.approx(100 * cached / int(m.group(2)), abs=0.06)
        for x in report["turns"][1:]:
            assert x["cached_prompt_tokens"] >= c * (s // 16 * 16)
    root = ET.fromstring((tmp_path / "chat.svg").read_bytes())
    (panel,) = find_class(root, "panel", metric="ttft_by_turn")
    (p99,) = find_class(panel, "turn-series", series="p99")
    assert len(p99.findall(SVG + "rect")) == t


class RecordingFrontend:
    """A Generation service that records every prompt it is sent and answers each with `output`
    random ids (in two messages) and a final message: what batonctl sends, seen from outside."""

    def __init__(self, pb, vocab=2000, output=4):
        import grpc

        self.prompts, self.answers, self.lock = [], {}, threading.Lock()
        rng = random.Random()
        frontend = self

        class Servicer(pb.gen_grpc.GenerationServicer):
            def ListModels(self, request, context):
                return pb.gen.ListModelsResponse(models=[pb.gen.ModelInfo(name="fake", vocab_size=vocab,
                                                                          context_length=8192)])

            def Generate(self, request, context):
                ids = [rng.randrange(vocab) for _ in range(request.max_tokens)]
                with frontend.lock:
                    frontend.prompts.append(list(request.prompt_token_ids))
                    frontend.answers[tuple(request.prompt_token_ids)] = ids
                half = len(ids) // 2
                yield pb.gen.GenerateResponse(token_ids=ids[:half])
                yield pb.gen.GenerateResponse(token_ids=ids[half:])
                final = pb.gen.FinalInfo(finish_reason=pb.gen.FINISH_REASON_LENGTH)
                final.usage.prompt_tokens = len(request.prompt_token_ids)
                final.usage.completion_tokens = len(ids)
                final.timing.e2e_seconds = 0.001
                yield pb.gen.GenerateResponse(final=final)

        self.server = grpc.server(futures.ThreadPoolExecutor(max_workers=8))
        pb.gen_grpc.add_GenerationServicer_to_server(Servicer(), self.server)
        self.address = f"127.0.0.1:{self.server.add_insecure_port('127.0.0.1:0')}"
        self.server.start()

    def stop(self):
        self.server.stop(None)


def test_bench_chat_sends_the_history_to_a_recording_frontend(batonctl, pb, tmp_path):
    c, t, s, p, o = 4, 3, 16, 5, 4
    fake = RecordingFrontend(pb, output=o)
    try:
        got = run(batonctl, "bench", "--address", fake.address, "--workload", "chat", "--conversations", c,
                  "--turns", t, "--system-prompt-tokens", s, "--prompt-tokens", p, "--output-tokens", o,
                  "--concurrency", 3, "--json", tmp_path / "chat.json")
    finally:
        fake.stop()
    assert got.returncode == 0, got.stderr
    check_chat_rows(json.loads((tmp_path / "chat.json").read_text())["per_request"], c, t, s, p, o)
    prompts = fake.prompts
    assert len(prompts) == c * t
    system = prompts[0][:s]
    assert all(q[:s] == system for q in prompts)  # one system prompt, identical in every conversation
    # Chain the turns: turn k+1 = turn k's prompt + the answer the server gave it + a new message.
    firsts = [q for q in prompts if len(q) == s + p]
    assert len(firsts) == c
    assert len({tuple(q[s:]) for q in firsts}) == c  # conversations' user messages differ
    remaining = {tuple(q) for q in prompts} - {tuple(q) for q in firsts}
    for q in firsts:
        for _ in range(t - 1):
            prefix = q + fake.answers[tuple(q)]
            (nxt,) = [r for r in remaining if list(r[:len(prefix)]) == prefix and len(r) == len(prefix) + p]
            remaining.remove(nxt)
            q = list(nxt)
    assert not remaining


def test_bench_rate_is_poisson(batonctl, shared_server, tmp_path, rng):
    """Send times of an open loop at rate λ. Their gaps are i.i.d. Exp(λ) if the arrivals are
    Poisson: over n gaps the sample mean has standard deviation (1/λ)/√n, and the sample
    coefficient of variation s/m (1 for an exponential) has asymptotic standard deviation 1/√n
    (delta method with the exponential's moments μ3 = 2/λ³, μ4 = 9/λ⁴: Var ≈ (8/4 + 1 − 2)/n).
    Both are checked at 4.5 standard deviations (a false failure about once in 10⁵ runs); evenly
    spaced arrivals (CV 0) or uniform gaps (CV 0.58) fail."""
    rate, n_requests = 40.0, 300
    seed = rng.randrange(1 << 30)
    out = tmp_path / "poisson.json"
    got = run(batonctl, "bench", "--address", shared_server.address, "--rate", rate, "--requests", n_requests,
              "--prompt-tokens", "4", "--output-tokens", "2", "--seed", seed, "--json", out, timeout=120)
    assert got.returncode == 0, got.stderr
    report = json.loads(out.read_text())
    assert report["requests"]["delayed_arrivals"] == 0
    rows = report["per_request"]
    sent = sorted(r["sent_seconds"] for r in rows)
    gaps = [b - a for a, b in zip(sent, sent[1:])]
    n = len(gaps)
    mean = statistics.fmean(gaps)
    cv = statistics.pstdev(gaps) / mean
    sd = 1 / math.sqrt(n)
    assert abs(mean * rate - 1) <= 4.5 * sd, (mean, 1 / rate)
    assert abs(cv - 1) <= 4.5 * sd, cv
    # Sent when due: the scheduled arrivals are what was measured.
    lags = sorted(r["sent_seconds"] - r["arrival_seconds"] for r in rows)
    assert lags[0] >= 0 and lags[len(lags) // 2] < 0.005, lags[-5:]
    # Seeded: the same seed schedules the same arrivals, another seed others.
    again = tmp_path / "again.json"
    for s, same in ((seed, True), (seed + 1, False)):
        got = run(batonctl, "bench", "--address", shared_server.address, "--rate", rate, "--requests", "20",
                  "--prompt-tokens", "4", "--output-tokens", "2", "--seed", s, "--json", again)
        assert got.returncode == 0, got.stderr
        arrivals = [r["arrival_seconds"] for r in json.loads(again.read_text())["per_request"]]
        want = [r["arrival_seconds"] for r in rows[:20]]
        assert (arrivals == pytest.approx(want, abs=1e-9)) == same


def test_bench_goodput(batonctl, shared_server, tmp_path):
    common = ["--address", shared_server.address, "--requests", "10", "--concurrency", "2", "--prompt-tokens", "16",
              "--output-tokens", "6"]
    # No request can meet an impossible SLO.
    out = tmp_path / "none.json"
    got = run(batonctl, "bench", *common, "--slo-ttft", "1e-7", "--slo-itl", "1e-7", "--json", out)
    assert got.returncode == 0, got.stderr
    slo = json.loads(out.read_text())["slo"]
    assert slo["met"] == 0 and slo["attainment"] == 0 and slo["goodput_requests_per_second"] == 0
    assert re.search(r"^goodput\s+0\.00 req/s: 0 of 10 requests \(0\.0 %\) met TTFT <= 0\.0001 ms and ITL <= 0\.0001 ms$",
                     got.stdout, re.M), got.stdout
    # Every request meets a generous one: goodput is the throughput.
    out = tmp_path / "all.json"
    got = run(batonctl, "bench", *common, "--slo-ttft", "600", "--slo-itl", "600", "--json", out)
    assert got.returncode == 0, got.stderr
    report = json.loads(out.read_text())
    assert report["slo"]["met"] == 10 and report["slo"]["attainment"] == 1
    assert report["slo"]["goodput_requests_per_second"] == pytest.approx(report["throughput"]["requests_per_second"])
    assert report["slo"]["itl_measure"].startswith("per-request p99")
    # In between: the count is the per-request rows' (TTFT and p99 gap both within their bounds).
    out = tmp_path / "some.json"
    got = run(batonctl, "bench", *common, "--slo-ttft", "0.004", "--slo-itl", "0.004", "--json", out)
    assert got.returncode == 0, got.stderr
    report = json.loads(out.read_text())
    met = [r["ttft_ms"] <= 4 and r["itl_p99_ms"] <= 4 for r in report["per_request"]]
    assert [r["slo_met"] for r in report["per_request"]] == met
    assert report["slo"]["met"] == sum(met)
    assert report["slo"]["met_ttft"] == sum(r["ttft_ms"] <= 4 for r in report["per_request"])
    assert report["slo"]["goodput_requests_per_second"] == pytest.approx(sum(met) / report["wall_seconds"])
    for r in report["per_request"]:
        assert r["itl_p99_ms"] == pytest.approx(r["itl_max_ms"])  # below 100 gaps the p99 is the max


def test_bench_duration(batonctl, shared_server, tmp_path):
    out = tmp_path / "duration.json"
    got = run(batonctl, "bench", "--address", shared_server.address, "--duration", "1.5", "--concurrency", "2",
              "--prompt-tokens", "8", "--output-tokens", "4", "--json", out)
    assert got.returncode == 0, got.stderr
    report = json.loads(out.read_text())
    n = report["requests"]["total"]
    assert n >= 2 and report["config"]["duration_seconds"] == 1.5 and report["config"]["requests"] == n
    # No request is started once the duration is over (its start is decided before then; the call
    # itself may begin a moment later on a loaded machine).
    assert all(0 <= r["arrival_seconds"] < 1.5 for r in report["per_request"])
    assert all(r["arrival_seconds"] <= r["sent_seconds"] < r["arrival_seconds"] + 1.0 for r in report["per_request"])
    assert max(r["finished_seconds"] for r in report["per_request"]) >= 1.5 - 0.5  # it kept sending until near the end
    assert re.search(rf"requests for 1\.5 s \({n} sent\)", got.stdout), got.stdout
