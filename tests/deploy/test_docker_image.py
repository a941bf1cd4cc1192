"""deploy/docker/Dockerfile, read (no Docker daemon here): a multi-stage build (CUDA toolkit to build,
a slim runtime with the CUDA runtime libraries to run), one image for every role, a non-root
user, `baton` as the entrypoint, the build dependencies of scripts/install-deps.sh, a portable
binary, and a build context that keeps what the build needs."""

import fnmatch
import re

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
    assert any(c.startswith("--from=cuda-devel") and "build/baton" in c and "/usr/local/bin/" in c for c in copies), copies
    assert any("build/batonctl" in c for c in copies), "batonctl is not in the image"


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
