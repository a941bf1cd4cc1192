"""`--kv-memory` sizes a worker's KV pool in bytes or as a share of the memory still available.
The pool's capacity (baton_kv_blocks_capacity, per role) is checked against the block size
computed here from the model's shape; bad amounts, an amount that holds no block, and
`--kv-blocks` beside it stop the process with one line naming the flag."""

import random
import subprocess

from serving_harness import Server, kv_blocks_of, metric_values

# conftest's test model: 2 layers, 2 KV heads of 64 / 4 = 16 dims; f32 KV.
BLOCK_SIZE = 16
BLOCK_BYTES = 2 * 2 * BLOCK_SIZE * 2 * 16 * 4


def capacity(srv, role):
    (v,) = kv_blocks_of(metric_values(srv.metrics(), "baton_kv_blocks_capacity"), role).values()
    return int(v)


def mem_available():
    for line in open("/proc/meminfo"):
        if line.startswith("MemAvailable:"):
            return int(line.split()[1]) * 1024
    raise AssertionError("no MemAvailable")


def test_bytes_size_both_pools(baton_bin, test_model, server_factory):
    blocks = random.randint(20, 400)
    amount = random.choice([f"{blocks * BLOCK_BYTES}", f"{blocks * BLOCK_BYTES // 1024}KiB",
                            f"{blocks * BLOCK_BYTES // 1024}k"])
    srv = server_factory(test_model, "--kv-dtype", "f32", "--kv-memory", amount, "--block-size", str(BLOCK_SIZE))
    assert capacity(srv, "decode") == blocks
    assert capacity(srv, "prefill") == blocks


def test_a_share_of_available_memory(baton_bin, test_model, server_factory):
    share = random.choice([1, 2, 3])
    before = mem_available()
    srv = server_factory(test_model, "--kv-dtype", "f32", "--kv-memory", f"{share}%")
    after = mem_available()
    got = capacity(srv, "decode")
    # The worker read MemAvailable between the two readings, which other processes move a little.
    lo, hi = sorted((before, after))
    assert int(lo * 0.9 * share / 100) // BLOCK_BYTES <= got <= int(hi * 1.1 * share / 100) // BLOCK_BYTES


def test_bad_amounts_stop_the_process_naming_the_flag(baton_bin, test_model):
    for extra, expect in [(["--kv-memory", "lots"], "--kv-memory"),
                          (["--kv-memory", "150%"], "at most 100%"),
                          (["--kv-memory", "0"], "must be positive"),
                          (["--kv-memory", "100"], "holds no KV block"),
                          (["--kv-memory", "1G", "--kv-blocks", "64"], "excludes")]:
        p = subprocess.run([str(baton_bin), "local", "--model", str(test_model), "--listen", "127.0.0.1:0",
                            "--kv-dtype", "f32", *extra], capture_output=True, text=True, timeout=60)
        assert p.returncode != 0, (extra, p.stdout[-500:])
        assert expect in p.stderr + p.stdout, (extra, p.stderr[-2000:])
