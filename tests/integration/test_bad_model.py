"""A model file that cannot be used fails the same way in every command that loads weights:
`baton generate`, `baton serve --role prefill|decode` and `baton local` exit with one status
and one line on stderr naming the problem. Cases: a tensor whose bytes were overwritten with 0xFF
(it dequantises to NaN: loading checks every tensor and names it), a block of a quantised tensor
(Q8_0, Q4_1: the real SmolLM2 file's) whose scale is NaN, and a truncated file.

A model whose weights are finite but whose forward pass overflows (a norm weight of 3e38) loads,
and then never produces a token: `generate` fails, and a served request ends INTERNAL with the
reason, without a token, without a failover (it would overflow anywhere), its KV blocks freed, and
the worker's log says so."""

import random
import subprocess

import grpc
import numpy as np
import pytest
from gguf import GGUFReader

from serving_harness import Server, real_model_path, wait_blocks_free

CORRUPT_TENSOR = "blk.1.ffn_down.weight"


def rewrite_tensor(src, dst, name, data):
    raw = bytearray(src.read_bytes())
    (t,) = [t for t in GGUFReader(src).tensors if t.name == name]
    assert len(data) == int(t.n_bytes)
    raw[int(t.data_offset):int(t.data_offset) + len(data)] = data
    dst.write_bytes(bytes(raw))
    return dst


@pytest.fixture(scope="module")
def corrupt_model(test_model, tmp_path_factory):
    (t,) = [t for t in GGUFReader(test_model).tensors if t.name == CORRUPT_TENSOR]
    path = rewrite_tensor(test_model, tmp_path_factory.mktemp("bad") / "corrupt.gguf", CORRUPT_TENSOR,
                          b"\xff" * int(t.n_bytes))
    # The overwritten values are NaN (f32 0xFFFFFFFF): what a corrupted disk or download gives.
    assert np.isnan(np.frombuffer(b"\xff" * 16, dtype=np.float32)).all()
    return path


@pytest.fixture(scope="module")
def real_model():
    return real_model_path()


# Quantised tensors of SmolLM2-135M-Instruct.Q4_1.gguf: (name, type, bytes per 32-weight block). Each
# block starts with its f16 scale d (Q8_0: d, 32 int8; Q4_1: d, m, 16 bytes of nibbles).
QUANTISED = {"Q8_0": ("token_embd.weight", 34), "Q4_1": ("blk.0.ffn_down.weight", 20)}
F16_NAN = b"\x00\x7e"


@pytest.fixture(scope="module", params=sorted(QUANTISED))
def nan_scale_model(request, real_model, tmp_path_factory):
    """The real model with one block of a quantised tensor given a NaN scale; (path, tensor name)."""
    name, block_bytes = QUANTISED[request.param]
    (t,) = [t for t in GGUFReader(real_model).tensors if t.name == name]
    assert t.tensor_type.name == request.param, f"{name} is {t.tensor_type.name} in {real_model}"
    raw = bytearray(real_model.read_bytes())
    block = random.randrange(int(t.n_bytes) // block_bytes)
    offset = int(t.data_offset) + block * block_bytes
    raw[offset:offset + 2] = F16_NAN
    path = tmp_path_factory.mktemp("bad") / f"nan-scale-{request.param}.gguf"
    path.write_bytes(bytes(raw))
    assert np.isnan(np.frombuffer(F16_NAN, dtype=np.float16)).all()
    return path, name


@pytest.fixture(scope="module")
def truncated_model(test_model, tmp_path_factory):
    path = tmp_path_factory.mktemp("bad") / "truncated.gguf"
    path.write_bytes(test_model.read_bytes()[: test_model.stat().st_size // 2])
    return path


COMMANDS = {
    "generate": ["generate", "--prompt-ids", "1,2,3", "--max-tokens", "1"],
    "serve prefill": ["serve", "--role", "prefill", "--listen", "127.0.0.1:0"],
    "serve decode": ["serve", "--role", "decode", "--listen", "127.0.0.1:0"],
    "local": ["local", "--listen", "127.0.0.1:0"],
}


def run_every_command(baton_bin, model):
    """{command: (exit status, its last `baton: ` line)} of every command that loads weights."""
    results = {}
    for name, args in COMMANDS.items():
        p = subprocess.run([str(baton_bin), args[0], "--model", str(model), *args[1:]], capture_output=True,
                           text=True, timeout=120)
        lines = [l for l in p.stderr.splitlines() if l.startswith("baton: ")]
        assert p.returncode != 0 and lines, f"{name}: exit {p.returncode}\n{p.stderr[-2000:]}"
        results[name] = (p.returncode, lines[-1])
    return results


@pytest.mark.parametrize("which", ["corrupt", "truncated"])
def test_bad_model_fails_alike_in_every_command(which, baton_bin, corrupt_model, truncated_model):
    model = corrupt_model if which == "corrupt" else truncated_model
    results = run_every_command(baton_bin, model)
    if which == "corrupt":
        for name, (_, line) in results.items():
            assert CORRUPT_TENSOR in line and "not finite" in line, f"{name}: {line}"
    codes = {code for code, _ in results.values()}
    assert codes == {1}, results  # a model file that cannot be used exits 1 (bad flags exit 2)
    print("\n".join(f"{n}: exit {c}: {l}" for n, (c, l) in results.items()))


def test_a_nan_scale_in_a_quantised_block_fails_alike_in_every_command(baton_bin, nan_scale_model):
    """A block scale is one f16 for 32 weights: NaN there makes every weight of the block NaN once
    dequantised, which the load refuses as for an f32 tensor, naming it."""
    model, tensor = nan_scale_model
    results = run_every_command(baton_bin, model)
    for name, (code, line) in results.items():
        assert code == 1, f"{name}: exit {code}: {line}"
        assert f"tensor '{tensor}'" in line and "not finite" in line and "corrupt" in line, f"{name}: {line}"


@pytest.fixture(scope="module")
def overflowing_model(test_model, tmp_path_factory):
    (t,) = [t for t in GGUFReader(test_model).tensors if t.name == "output_norm.weight"]
    huge = np.full(int(t.n_elements), 3e38, dtype=np.float32).tobytes()
    return rewrite_tensor(test_model, tmp_path_factory.mktemp("bad") / "overflow.gguf", "output_norm.weight", huge)


def test_logits_that_are_not_finite_never_become_a_token(pb, baton_bin, overflowing_model):
    p = subprocess.run([str(baton_bin), "generate", "--model", str(overflowing_model), "--prompt-ids", "5,6,7",
                        "--max-tokens", "4", "--print-ids"], capture_output=True, text=True, timeout=120)
    assert p.returncode == 1 and "not finite" in p.stderr, p.stderr
    assert p.stdout == ""
    srv = Server(baton_bin, overflowing_model)
    try:
        req = pb.gen.GenerateRequest(prompt_token_ids=[5, 6, 7], max_tokens=4, ignore_eos=True)
        got = []
        with grpc.insecure_channel(srv.address) as ch:
            with pytest.raises(grpc.RpcError) as err:
                for m in pb.gen_grpc.GenerationStub(ch).Generate(req, timeout=60):
                    got.extend(m.token_ids)
        assert err.value.code() == grpc.StatusCode.INTERNAL, err.value.details()
        assert "not finite" in err.value.details() and "attempt" not in err.value.details()
        assert got == []
        assert wait_blocks_free(srv)
        # The worker that met them logs it, with the position (the prompt's last: the first token).
        srv.wait_for_log(r"error.*the logits at position 3 are not finite")
    finally:
        srv.stop_clean()
