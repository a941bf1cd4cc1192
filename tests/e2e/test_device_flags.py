"""`--device` on machines without a usable GPU, and bad device names: a clear one-line error and
exit code 2, never a crash. (On a GPU machine the CUDA path itself is tested by tests/gpu.)"""
from __future__ import annotations

import shutil
import subprocess

import pytest


def has_gpu() -> bool:
    if shutil.which("nvidia-smi") is None:
        return False
    return subprocess.run(["nvidia-smi", "-L"], capture_output=True).returncode == 0


def generate(baton_bin, model_path, *flags):
    return subprocess.run(
        [baton_bin, "generate", "--model", model_path, "--prompt", "hi", "--max-tokens", "2", *flags],
        capture_output=True, text=True, timeout=120,
    )


@pytest.mark.parametrize(
    "flags, message",
    [
        (["--device", "gpu"], "unknown device 'gpu'"),
        (["--device", "cuda:x"], "cuda:x"),
        (["--device", "cuda", "--dtype", "f32"], None),
    ],
)
def test_bad_device_flags_are_refused(baton_bin, model_path, flags, message):
    p = generate(baton_bin, model_path, *flags)
    assert p.returncode == 2, p.stderr
    assert p.stderr.startswith("baton: "), p.stderr
    assert len(p.stderr.strip().splitlines()) == 1, p.stderr
    if message:
        assert message in p.stderr


@pytest.mark.skipif(has_gpu(), reason="a GPU is here: tests/gpu covers --device cuda")
def test_cuda_without_a_gpu_says_so(baton_bin, model_path):
    p = generate(baton_bin, model_path, "--device", "cuda:0")
    assert p.returncode == 2, p.stderr
    # Either this build has no CUDA backend, or it has one and finds no device: both say so.
    assert "cuda:0" in p.stderr and ("no CUDA device" in p.stderr or "no CUDA backend" in p.stderr), p.stderr


def test_cpu_refuses_nothing_it_supports(baton_bin, model_path):
    p = generate(baton_bin, model_path, "--device", "cpu", "--kv-dtype", "bf16")
    assert p.returncode == 0, p.stderr
