"""`batonctl`, the command-line client, against real `baton local` servers on the random test
model: `generate` returns the same ids as single-process `baton generate` and prints the timing
block; errors are one line with exit code 1 (server / RPC) or 2 (flags); `bench` in closed-loop
and Poisson mode reports every request, the right token counts and ordered percentiles."""

import json
import random
import re
import socket
import subprocess

import pytest

@pytest.fixture(scope="module")
def batonctl(baton_bin):
    path = baton_bin.parent / "batonctl"
    if not path.exists():
        pytest.skip(f"batonctl not built at {path} (ninja -C build batonctl)")
    return path


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
        assert re.search(r"^prefill worker 127\.0\.0\.1:\d+ \| decode worker 127\.0\.0\.1:\d+$", err, re.M), err


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
