"""`--device` on machines without a usable GPU, and bad device names: a clear one-line error that
names the actual reason, exit code 2, never a crash. (On a GPU machine the CUDA path itself is
tested by tests/gpu.)

Which reason applies depends on the binary (kernels/backend.cpp make_backend,
kernels/cuda/cuda_backend.cu make_cuda_backend):
  * a build without the CUDA backend refuses every cuda[:N] device for that reason alone ("this
    build of baton has no CUDA backend"), before it looks at the device index or --dtype;
  * a build with it checks, in order, the device name ("bad device 'cuda:x'"), then --dtype (f32
    is CPU-only), and only then looks for a GPU ("no CUDA device is usable here"). So --device cuda
    --dtype f32 is refused for the dtype on every host, GPU or not.
The `cuda_backend` fixture tells the two builds apart from --device cuda:0 with the default dtype,
which reaches the GPU lookup on a CUDA build.
"""
from __future__ import annotations

import shutil
import subprocess

import pytest

NO_BACKEND = "this build of baton has no CUDA backend"
NO_DEVICE = "no CUDA device is usable here"
F32_REFUSED = "the CUDA backend computes in bf16 (fp32 accumulation); --dtype f32 is CPU-only"


def has_gpu() -> bool:
    if shutil.which("nvidia-smi") is None:
        return False
    return subprocess.run(["nvidia-smi", "-L"], capture_output=True).returncode == 0


def generate(baton_bin, model_path, *flags, max_tokens=2):
    return subprocess.run(
        [baton_bin, "generate", "--model", model_path, "--prompt", "hi", "--max-tokens", str(max_tokens), *flags],
        capture_output=True, text=True, timeout=120,
    )


def one_error_line(p) -> str:
    """The single `baton: error: ...` line of a refused run (exit 2, nothing else on stderr)."""
    assert p.returncode == 2, p.stderr
    lines = p.stderr.strip().splitlines()
    assert len(lines) == 1, p.stderr
    assert lines[0].startswith("baton: error: "), p.stderr
    return lines[0]


@pytest.fixture(scope="module")
def cuda_backend(baton_bin, model_path) -> bool:
    """Whether this baton binary has the CUDA backend: `--device cuda:0` (bf16, a valid name) gets
    past the build check only there (and runs, or fails the GPU lookup)."""
    p = generate(baton_bin, model_path, "--device", "cuda:0", max_tokens=1)
    if NO_BACKEND in p.stderr:
        return False
    cuda_reasons = (NO_DEVICE, "CUDA device(s), numbered from 0", "is too old", "cublasLt")
    assert p.returncode == 0 or any(r in p.stderr for r in cuda_reasons), (
        f"--device cuda:0 neither ran nor gave a known reason (exit {p.returncode}): {p.stderr}")
    return True


def test_unknown_device_is_named(baton_bin, model_path):
    line = one_error_line(generate(baton_bin, model_path, "--device", "gpu"))
    assert "unknown device 'gpu' (expected cpu or cuda[:N])" in line, line


def test_bad_cuda_index_is_refused_for_the_right_reason(baton_bin, model_path, cuda_backend):
    line = one_error_line(generate(baton_bin, model_path, "--device", "cuda:x"))
    if cuda_backend:
        assert "bad device 'cuda:x' (expected cuda or cuda:N with N a device index)" in line, line
    else:
        assert f"device 'cuda:x' is not available: {NO_BACKEND}" in line, line


def test_cuda_f32_is_refused_for_the_right_reason(baton_bin, model_path, cuda_backend):
    """On a CUDA build the dtype is the reason on any host (it is checked before the GPU lookup, so
    a GPU-less host does not say "no CUDA device" instead); without the backend, the build is."""
    line = one_error_line(generate(baton_bin, model_path, "--device", "cuda", "--dtype", "f32"))
    if cuda_backend:
        assert F32_REFUSED in line, line
        assert NO_DEVICE not in line and NO_BACKEND not in line, line
    else:
        assert f"device 'cuda' is not available: {NO_BACKEND}" in line, line


@pytest.mark.skipif(has_gpu(), reason="a GPU is here: tests/gpu covers --device cuda")
def test_cuda_without_a_gpu_says_so(baton_bin, model_path, cuda_backend):
    line = one_error_line(generate(baton_bin, model_path, "--device", "cuda:0"))
    if cuda_backend:
        assert f"device 'cuda:0': {NO_DEVICE}" in line, line
    else:
        assert f"device 'cuda:0' is not available: {NO_BACKEND}" in line, line


def test_cpu_refuses_nothing_it_supports(baton_bin, model_path):
    p = generate(baton_bin, model_path, "--device", "cpu", "--kv-dtype", "bf16")
    assert p.returncode == 0, p.stderr
