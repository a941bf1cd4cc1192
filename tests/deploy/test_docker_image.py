"""deploy/docker/Dockerfile, read (no Docker daemon here): a multi-stage build (CUDA toolkit to build,
a slim runtime with the CUDA runtime libraries to run), one image for every role, a non-root
user, `baton` as the entrypoint, the build dependencies of scripts/install-deps.sh, a portable
binary, a build context that keeps what the build needs, a base image pinned by digest (which the
build requires), and NCCL packages pinned to the CUDA version, which is the development toolkit's."""

import fnmatch
import re
import shutil
import subprocess
from pathlib import Path

import pytest

from deploy_helpers import DEPLOY, DOCKERFILE, REPO, dockerfile_env, parse_dockerfile


def stages():
    return parse_dockerfile()


def run_text(stage):
    return "\n".join(stage.all("RUN"))


def test_multi_stage_from_cuda_devel_to_runtime():
    named = {s.name: s for s in stages() if s.name}
    assert {"cuda-devel", "runtime"} <= set(named), list(named)
    final = stages()[-1]
    assert final.name == "runtime", "the last stage is the image"
    devel = run_text(named["cuda-devel"])
    for pkg in ("cuda-nvcc-", "libcublas-dev-", "libnccl-dev"):
        assert pkg in devel, f"the build stage does not install {pkg}"
    runtime = run_text(final)
    for pkg in ("cuda-cudart-", "libcublas-", "libnccl2"):
        assert pkg in runtime, f"the runtime stage does not install {pkg}"
    dev_packages = re.findall(r"(?<![\w/.-])[a-z0-9][\w.+-]*?-dev(?:-[0-9-]+)?(?![\w.-])", runtime)
    assert not dev_packages, f"the runtime stage installs development packages {dev_packages}"
    copies = final.all("COPY")
    assert "--from=binaries /out/baton /out/batonctl /usr/local/bin/" in copies, copies
    assert "--from=binaries /out/runtime-packages.txt /tmp/runtime-packages.txt" in copies, copies


def test_binaries_come_from_the_build_stage_or_prebuilt_ones():
    """The `binaries` stage is FROM ${BATON_BINARIES}: cuda-devel by default (built from source,
    stripped into /out with the runtime-packages.txt of deploy/docker/runtime-packages.sh), or
    prebuilt (FROM scratch: the build context's files, as scripts/build-image.sh --prebuilt stages
    them)."""
    named = {s.name: s for s in stages() if s.name}
    assert named["binaries"].base == "${BATON_BINARIES}", named["binaries"].base
    assert global_args().get("BATON_BINARIES") == "cuda-devel"
    devel = run_text(named["cuda-devel"])
    assert "cp build/baton build/batonctl /out/" in devel and "strip /out/baton /out/batonctl" in devel, devel
    assert "deploy/docker/runtime-packages.sh /out/baton /out/batonctl > /out/runtime-packages.txt" in devel
    assert named["prebuilt"].base == "scratch"
    assert named["prebuilt"].all("COPY") == ["baton batonctl runtime-packages.txt /out/"]
    script = (REPO / "scripts" / "build-image.sh").read_text()
    assert "BATON_BINARIES=prebuilt" in script and "runtime-packages.sh" in script


def test_non_root_user_and_baton_entrypoint():
    final = stages()[-1]
    user = final.all("USER")
    assert user, "no USER: the image would run as root"
    uid = user[-1].split(":")[0]
    assert uid.isdigit() and int(uid) != 0, f"USER {user[-1]}: numeric and not root (runAsNonRoot checks numbers)"
    assert f"--uid {uid}" in run_text(final), "the user is not created with that uid"
    assert final.all("ENTRYPOINT") == ['["baton"]'], final.all("ENTRYPOINT")


def test_ports_exposed_are_the_ones_baton_listens_on():
    """Every role's listeners (the image's ENV), and the frontend's HTTP API, which only the
    frontend may serve (so its BATON_HTTP_LISTEN is in the Kubernetes frontend.env, not the image)."""
    final = stages()[-1]
    env = dockerfile_env(final)
    exposed = {int(p) for args in final.all("EXPOSE") for p in args.split()}
    listen = {int(env[k].rpartition(":")[2]) for k in ("BATON_LISTEN", "BATON_METRICS_LISTEN",
                                                         "BATON_HEALTH_LISTEN")}
    frontend_env = (REPO / "deploy" / "k8s" / "base" / "frontend.env").read_text()
    http = int(re.search(r"^BATON_HTTP_LISTEN=\S+:(\d+)$", frontend_env, re.M).group(1))
    assert "BATON_HTTP_LISTEN" not in env, "workers refuse --http-listen: it is the frontend's alone"
    assert exposed == listen | {http}, (f"EXPOSE {exposed}, BATON_LISTEN/BATON_METRICS_LISTEN/BATON_HEALTH_LISTEN "
                                        f"{listen}, the frontend's BATON_HTTP_LISTEN {http}")
    assert all(env[k].startswith("0.0.0.0:") for k in ("BATON_LISTEN", "BATON_METRICS_LISTEN"))


def test_build_installs_what_install_deps_installs():
    text = (REPO / "scripts" / "install-deps.sh").read_text()
    block = re.search(r"build_packages=\((.*?)\)", text, re.S).group(1)
    wanted = {w for line in block.splitlines() for w in line.split("#")[0].split()}
    assert "libdnnl-dev" in wanted and "ocl-icd-opencl-dev" in wanted, wanted
    devel = run_text(next(s for s in stages() if s.name == "cuda-devel"))
    missing = {p for p in wanted if not re.search(rf"(?<![\w.-]){re.escape(p)}(?![\w.-])", devel)}
    assert not missing, f"scripts/install-deps.sh installs {sorted(missing)}, the image build does not"


def test_portable_release_build_without_tests():
    devel = run_text(next(s for s in stages() if s.name == "cuda-devel"))
    for opt in ("-DBATON_NATIVE=OFF", "-DCMAKE_BUILD_TYPE=Release", "-DBATON_TESTS=OFF", "-DBATON_CUDA=AUTO"):
        assert opt in devel, f"cmake without {opt}"
    assert "--target baton batonctl" in devel


def test_build_context_keeps_what_the_build_needs():
    ignore = DEPLOY / "docker" / "Dockerfile.dockerignore"
    assert ignore.exists(), "BuildKit reads Dockerfile.dockerignore next to the Dockerfile"
    patterns = [l.strip() for l in ignore.read_text().splitlines() if l.strip() and not l.startswith("#")]
    assert any(p.rstrip("/") in ("build*", "build") for p in patterns), "the host's build/ would be sent and copied"
    assert ".git" in patterns
    needed = ["CMakeLists.txt", "scripts/fetch-model.sh"]
    needed += re.findall(r"add_subdirectory\((\w+)\)", (REPO / "CMakeLists.txt").read_text())
    for path in needed:
        for p in patterns:
            p = p.rstrip("/")
            assert not fnmatch.fnmatch(path, p) and not path.startswith(p + "/"), f"{path} is ignored by {p}"
    assert DOCKERFILE.read_text().count("COPY . .") == 1


def global_args():
    """{name: default or None} of the ARGs before the first FROM (those a FROM line can use)."""
    out = {}
    for args in stages()[0].all("ARG"):
        name, eq, value = args.partition("=")
        out[name.strip()] = value.strip().strip('"') if eq else None
    return out


def expand(word, variables):
    """A Dockerfile word with $X, ${X}, ${X:-w}, ${X-w}, ${X:+w}, ${X+w} substituted (no nesting)."""
    def one(m):
        name, op, alt = m.group(1) or m.group(4), m.group(2), m.group(3)
        value = variables.get(name)
        if not op:
            return value or ""
        empty_is_unset = op.startswith(":")
        is_set = value is not None and not (empty_is_unset and value == "")
        if op.endswith("-"):
            return value if is_set else alt
        if op.endswith("+"):
            return alt if is_set else ""
        raise AssertionError(f"modifier {op} in {word!r}")
    return re.sub(r"\$\{(\w+)(?:(:?[-+?])([^}]*))?\}|\$(\w+)", one, word)


# name[:tag]@sha256:<64 hex>: a reference a registry resolves to exactly one manifest.
PINNED = re.compile(r"[a-z0-9]+(?:[._/-][a-z0-9]+)*(?::\w[\w.-]{0,127})?@sha256:[0-9a-f]{64}")


def test_base_image_is_pinned_by_digest_and_the_build_requires_it():
    """Every stage that starts from an image (not from an earlier stage) names it by digest: a
    literal sha256, or a build argument without default that the build cannot do without (the
    reference is invalid without it and names the argument). No ${X:?}: Debian 12's buildah (1.28)
    refuses that modifier even when X is set."""
    defaults = global_args()
    known_stages, external = set(), []
    for stage in stages()[1:]:
        chosen = expand(stage.base, {k: v for k, v in defaults.items() if v is not None})
        if stage.base != "scratch" and chosen not in known_stages:  # scratch: no image at all
            external.append(stage)
        known_stages.add(stage.name)
    assert external, "no FROM an image"
    fake = "sha256:" + "0" * 64
    for stage in external:
        set_defaults = {k: v for k, v in defaults.items() if v is not None}
        if PINNED.fullmatch(expand(stage.base, set_defaults)):
            continue  # a literal digest
        digest_args = re.findall(r"@\$\{?(\w+)", stage.base)
        assert digest_args, f"FROM {stage.base}: no digest"
        (arg,) = digest_args
        assert arg in defaults and defaults[arg] is None, f"FROM {stage.base}: {arg} must be a global ARG without default"
        with_digest = expand(stage.base, set_defaults | {arg: fake})
        assert PINNED.fullmatch(with_digest), f"FROM {stage.base} with {arg}={fake} gives {with_digest!r}"
        without = expand(stage.base, set_defaults)
        assert not PINNED.fullmatch(without), f"FROM {stage.base} builds without {arg}: {without!r}"
        assert arg in without, f"without {arg} the build fails on {without!r}, which does not say what is missing"
    code = "\n".join(l for l in DOCKERFILE.read_text().splitlines() if not l.lstrip().startswith("#"))
    assert ":?" not in code, "${X:?...} in the Dockerfile: Debian 12's buildah rejects the modifier"


def test_nccl_packages_are_pinned_to_the_cuda_version():
    """libnccl2 / libnccl-dev installed as <NCCL_VERSION>+cuda<CUDA_VERSION> in both stages, so apt
    cannot pick an NCCL built for another CUDA; the CUDA packages and paths follow CUDA_VERSION."""
    defaults = global_args()
    cuda, nccl = defaults.get("CUDA_VERSION"), defaults.get("NCCL_VERSION")
    assert cuda and re.fullmatch(r"\d+\.\d+", cuda), f"CUDA_VERSION {cuda}"
    assert nccl and re.fullmatch(r"\d+\.\d+\.\d+-\d+", nccl), f"NCCL_VERSION {nccl}: <version>-<package revision>"
    variables = {"CUDA_VERSION": cuda, "NCCL_VERSION": nccl, "v": cuda.replace(".", "-")}
    named = {s.name: s for s in stages() if s.name}
    for stage_name, wanted in (("cuda-devel", {"libnccl-dev", "libnccl2"}), ("runtime", {"libnccl2"})):
        stage = named[stage_name]
        assert {"CUDA_VERSION", "NCCL_VERSION"} <= set(stage.all("ARG")), f"{stage_name}: ARGs not imported"
        text = run_text(stage)
        packages = re.findall(r"(?<![\w.-])(libnccl[\w-]*)(=[\w${}.+-]+)?", text)
        assert {p for p, _ in packages} == wanted, f"{stage_name}: NCCL packages {packages}"
        for package, version in packages:
            assert version, f"{stage_name}: {package} is not pinned"
            assert expand(version[1:], variables) == f"{nccl}+cuda{cuda}", f"{stage_name}: {package}{version}"
        assert 'v="$(echo "$CUDA_VERSION" | tr . -)"' in text, f"{stage_name}: CUDA package suffix not from CUDA_VERSION"
    env = dockerfile_env(stages()[-1])
    assert "/usr/local/cuda-${CUDA_VERSION}/lib64" in env["LD_LIBRARY_PATH"], env["LD_LIBRARY_PATH"]


def development_nvcc():
    found = shutil.which("nvcc")
    if found:
        return Path(found)
    default = Path("/usr/local/cuda/bin/nvcc")
    return default if default.exists() else None


def test_cuda_pin_is_the_development_toolkit():
    """The image builds with the CUDA (and NCCL) that the code is compiled with here."""
    nvcc = development_nvcc()
    if nvcc is None:
        pytest.skip("no CUDA toolkit (nvcc) on this machine to compare CUDA_VERSION with")
    out = subprocess.run([str(nvcc), "--version"], capture_output=True, text=True, timeout=30)
    release = re.search(r"release (\d+\.\d+)", out.stdout)
    assert release, out.stdout + out.stderr
    defaults = global_args()
    assert defaults["CUDA_VERSION"] == release.group(1), \
        f"the image pins CUDA {defaults['CUDA_VERSION']}, {nvcc} is CUDA {release.group(1)}"
    header = nvcc.resolve().parents[1] / "include" / "nccl.h"
    if header.exists():
        parts = dict(re.findall(r"#define NCCL_(MAJOR|MINOR|PATCH) (\d+)", header.read_text()))
        version = f"{parts['MAJOR']}.{parts['MINOR']}.{parts['PATCH']}"
        assert defaults["NCCL_VERSION"].split("-")[0] == version, \
            f"the image pins NCCL {defaults['NCCL_VERSION']}, {header} is {version}"
