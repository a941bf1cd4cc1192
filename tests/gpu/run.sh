#!/usr/bin/env bash
# tests/gpu/run.sh: the GPU check, in one go on a machine with an NVIDIA GPU (sm_80 or newer):
# builds the engine with CUDA (or takes a prebuilt bundle), runs the [gpu] tests, runs the GPU
# benchmarks, and writes a Markdown report. Meant to finish in under 8 minutes.
#
#   tests/gpu/run.sh [--bundle DIR] [--out DIR] [--no-model]
#
#   --bundle DIR  binaries made by scripts/gpu-bundle.sh on another machine (DIR/run NAME runs
#                 one); without it the script builds here: -DBATON_ENGINE_ONLY=ON -DBATON_CUDA=ON
#                 into build-gpu/, for this GPU's architecture only (CMAKE_PREFIX_PATH may point
#                 at the engine's dependencies if the system has none).
#   --out DIR     where the logs and gpu-report.md go (default: $OUT if set, else gpu-report/).
#   --no-model    declare the SmolLM2 checks not applicable (listed so in the report) instead of
#                 failing when the model file is not here.
#
# No test it means to run may pass by skipping: the tests run with BATON_TEST_FAIL_ON_SKIP=1
# (tests/common/test_skip.h), the SmolLM2 checks need BATON_MODEL or the file in ~/.cache/baton or
# .device/ (scripts/gpu-bundle.sh explains how to carry it) unless --no-model says otherwise, and
# what does not apply to this machine (the nccl tests below two GPUs) is left out by name and
# listed as "not applicable", never as passed. SmolLM2's greedy ids on cuda:0 must equal the
# CPU's, or first differ where the CPU's top two logits are a near-tie (measured, and reported).
# Exit status: non-zero when the build or a test failed or a meant test did not run; benchmarks
# only report.
set -uo pipefail
cd "$(dirname "$0")/../.."
root=$PWD
bundle=""
out="${OUT:-$root/gpu-report}"
need_model=1
while [ $# -gt 0 ]; do
  case "$1" in
    --bundle) bundle=$(cd "$2" 2>/dev/null && pwd) || { echo "run.sh: no bundle folder $2" >&2; exit 2; }; shift 2 ;;
    --out) out=$2; shift 2 ;;
    --no-model) need_model=0; shift ;;
    *) echo "usage: tests/gpu/run.sh [--bundle DIR] [--out DIR] [--no-model]" >&2; exit 2 ;;
  esac
done
mkdir -p "$out"
report="$out/gpu-report.md"
t_start=$(date +%s)
log() { echo "[$(($(date +%s) - t_start)) s] $*"; }

if ! command -v nvidia-smi >/dev/null || ! nvidia-smi -L >/dev/null 2>&1; then
  echo "tests/gpu/run.sh: no NVIDIA GPU here (nvidia-smi finds none); nothing to run" >&2
  exit 77
fi
gpu_name=$(nvidia-smi --query-gpu=name --format=csv,noheader | head -1)
cc=$(nvidia-smi --query-gpu=compute_cap --format=csv,noheader | head -1 | tr -d .)
log "GPU: $gpu_name (compute capability $cc)"

# ---- report: written on every exit, so a failure or a timeout still leaves one ------------------
write_report() {
python3 - "$out" "$gpu_name" "$build_note" "$tests_rc" "$(($(date +%s) - t_start))" >"$report" <<'PY'
import json, pathlib, sys
out, gpu, build, rc, secs = pathlib.Path(sys.argv[1]), sys.argv[2], sys.argv[3], sys.argv[4], sys.argv[5]
rows = []
for name in ("bench-attention.log", "bench-gpu.log"):
    p = out / name
    if p.exists():
        for line in p.read_text(errors="replace").splitlines():
            if line.startswith("BENCH_JSON "):
                try:
                    rows.append(json.loads(line[len("BENCH_JSON "):]))
                except ValueError:
                    pass
def lines(name):
    p = out / name
    return p.read_text(errors="replace").splitlines() if p.exists() else []
skipped = sorted({l.strip() for name in ("gpu-tests.log", "gpu-tests-kv.log", "model-check.txt")
                  for l in lines(name) if l.strip().startswith("SKIPPED:")})
not_applicable = [l for l in lines("not-applicable.txt") if l.strip()]
meant_but_missing = [l for l in lines("missing.txt") if l.strip()]
print(f"# GPU report\n\nGPU: {gpu}. Binaries: {build}. Wall time: {secs} s.\n")
verdict = {"0": "passed", "": "not run"}.get(rc, f"FAILED, exit {rc}")
print(f"## Tests ({verdict})\n")
for name in ("gpu-tests.log", "gpu-tests-kv.log"):
    if lines(name):
        print(f"{name}:\n```")
        print("\n".join(lines(name)[-12:]))
        print("```\n")
if meant_but_missing or skipped:
    print("**Meant to run but did not (a failure):**\n")
    for l in meant_but_missing + skipped:
        print(f"- {l}")
    print()
if not_applicable:
    print("Not applicable on this machine (left out by name, not counted as passed):\n")
    for l in not_applicable:
        print(f"- {l}")
    print()
if lines("greedy-compare.txt"):
    print("## SmolLM2 greedy ids, cuda:0 vs CPU\n\n```\n" + "\n".join(lines("greedy-compare.txt")) + "\n```\n")
for dev in ("cuda0", "cpu"):
    p = out / f"generate-{dev}.txt"
    if p.exists():
        label = "cuda:0" if dev == "cuda0" else dev
        print(f"## baton generate --device {label} (SmolLM2, greedy)\n\n```\n{p.read_text(errors='replace').strip()}\n```\n")
print("## Benchmarks\n")
if not rows:
    print("(no benchmark output; see bench-*.log)")
by = {}
for r in rows:
    by.setdefault(r.get("bench", "?"), []).append(r)
for bench, rs in by.items():
    keys = [k for k in rs[0] if k != "bench"]
    print(f"### {bench}\n")
    print("| " + " | ".join(keys) + " |")
    print("|" + "---|" * len(keys))
    for r in rs:
        print("| " + " | ".join(f"{r.get(k):.4g}" if isinstance(r.get(k), float) else str(r.get(k)) for k in keys) + " |")
    print()
PY
  cat "$report"
}
build_note="(not built)"
tests_rc=""
trap write_report EXIT

# ---- binaries ----------------------------------------------------------------------------------
# cmd NAME: the command line that runs binary NAME (paths without spaces).
if [ -n "$bundle" ]; then
  cmd() { echo "$bundle/run $1"; }
  build_note="prebuilt bundle $bundle"
else
  gencode="-gencode=arch=compute_${cc},code=sm_${cc}"
  [ "$cc" = 90 ] && gencode="-gencode=arch=compute_90a,code=sm_90a"
  # The full build where its dependencies are here (it adds the KV transport tests), else the
  # engine alone.
  targets=(baton baton_gpu_tests baton_bench_gpu baton_bench_attention)
  scope="full"
  if ! cmake -S . -B build-gpu -G Ninja -DCMAKE_BUILD_TYPE=Release -DBATON_CUDA=ON "-DBATON_CUDA_GENCODE=$gencode" \
      >"$out/build.log" 2>&1; then
    scope="engine only: no gRPC here, so no KV transport tests"
    rm -rf build-gpu
    cmake -S . -B build-gpu -G Ninja -DCMAKE_BUILD_TYPE=Release -DBATON_ENGINE_ONLY=ON -DBATON_CUDA=ON \
      "-DBATON_CUDA_GENCODE=$gencode" >>"$out/build.log" 2>&1 || { tail -30 "$out/build.log"; exit 1; }
  fi
  grep -q baton_kv_ipc_sender build-gpu/build.ninja && targets+=(baton_kv_ipc_sender)
  log "building ($scope, $gencode)"
  if ! cmake --build build-gpu -j "$(nproc)" --target "${targets[@]}" >>"$out/build.log" 2>&1; then
    tail -30 "$out/build.log"
    echo "tests/gpu/run.sh: the build failed (log: $out/build.log)" >&2
    exit 1
  fi
  cmd() { find "$root/build-gpu" -type f -name "$1" -perm -u+x | head -1; }
  build_note="built here into build-gpu/ ($scope, $gencode)"
fi
log "binaries: $build_note"
# cuBLASLt (and NCCL) are dlopened: say where they will come from.
[ -d /usr/local/cuda/lib64 ] && export LD_LIBRARY_PATH="/usr/local/cuda/lib64${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
log "libcublasLt: $( (ldconfig -p | grep -o '/[^ ]*libcublasLt\.so\.[0-9]*$' ; ls /usr/local/cuda/lib64/libcublasLt.so.* 2>/dev/null) | head -1)"

# ---- the real model, if it is here --------------------------------------------------------------
if [ -z "${BATON_MODEL:-}" ]; then
  for f in "$HOME/.cache/baton/SmolLM2-135M-Instruct.Q4_1.gguf" "$root/.device/SmolLM2-135M-Instruct.Q4_1.gguf"; do
    [ -f "$f" ] && export BATON_MODEL=$f && break
  done
  # Carried in parts (the device tool moves at most 64 MiB per call): .device/model.part-*.
  if [ -z "${BATON_MODEL:-}" ] && ls "$root"/.device/model.part-* >/dev/null 2>&1; then
    cat "$root"/.device/model.part-* >/tmp/SmolLM2-135M-Instruct.Q4_1.gguf && export BATON_MODEL=/tmp/SmolLM2-135M-Instruct.Q4_1.gguf
  fi
fi
# A missing or partial file would make the parity test fail as if the code were wrong.
want_sha=$(sed -n 's/^sha256="\([0-9a-f]*\)"$/\1/p' "$root/scripts/fetch-model.sh")
: >"$out/missing.txt"
: >"$out/not-applicable.txt"
if [ -n "${BATON_MODEL:-}" ] && ! echo "$want_sha  $BATON_MODEL" | sha256sum --check --status; then
  echo "the SmolLM2 checks: $BATON_MODEL is not the SmolLM2 file (sha256 differs)" | tee -a "$out/missing.txt"
  unset BATON_MODEL
fi
if [ -z "${BATON_MODEL:-}" ] && [ $need_model = 1 ] && [ ! -s "$out/missing.txt" ]; then
  echo "the SmolLM2 checks: no model file (set BATON_MODEL, carry it in .device/, or pass --no-model)" | tee -a "$out/missing.txt"
fi
log "model for the SmolLM2 checks: ${BATON_MODEL:-none}"

# ---- tests -------------------------------------------------------------------------------------
status=0
tests_rc=0
[ -s "$out/missing.txt" ] && status=1
# A test that BATON_SKIPs fails the run: everything selected below is meant to run here.
export BATON_TEST_FAIL_ON_SKIP=1
model_filter=""
if [ -z "${BATON_MODEL:-}" ]; then
  # Only reached with --no-model (or with the failure above already recorded).
  model_filter="~[smollm2]"
  # shellcheck disable=SC2046
  $(cmd baton_gpu_tests) "[smollm2]" --list-test-names-only 2>/dev/null | sed -n 's/^\([^ ].*\)$/\1: no model file (--no-model)/p' \
    | grep -v "^Matching\|^[0-9]* matching" >>"$out/not-applicable.txt"
fi
n_gpus=$(nvidia-smi -L | grep -c '^GPU')
kv_filter="[kv]"
if [ "$n_gpus" -lt 2 ]; then
  kv_filter="[kv]~[nccl]"
  # shellcheck disable=SC2046
  $(cmd baton_gpu_tests) "[nccl]" --list-test-names-only 2>/dev/null \
    | sed -n "s/^\([^ ].*\)\$/\1: NCCL needs two GPUs, this machine has $n_gpus/p" \
    | grep -v "^Matching\|^[0-9]* matching" >>"$out/not-applicable.txt"
fi
# Ops and model first, the KV transports (other processes, NCCL) apart: an abort or a hang in
# one group leaves the other's results.
log "running the [gpu] tests: ops, attention, model"
# shellcheck disable=SC2046
timeout -k 5 120 $(cmd baton_gpu_tests) "[gpu]~[kv]$model_filter" --durations yes >"$out/gpu-tests.log" 2>&1 || tests_rc=$?
tail -3 "$out/gpu-tests.log"
log "running the [gpu] tests: KV transports"
# shellcheck disable=SC2046
timeout -k 5 60 $(cmd baton_gpu_tests) "$kv_filter" --durations yes >"$out/gpu-tests-kv.log" 2>&1 || tests_rc=$?
tail -3 "$out/gpu-tests-kv.log"
[ $tests_rc -ne 0 ] && status=1

# ---- the real model end to end: greedy ids on the GPU against the CPU's -------------------------
if [ -n "${BATON_MODEL:-}" ]; then
  log "baton generate on cuda:0 and on the CPU (SmolLM2, greedy), ids compared"
  chat="What is the capital of France? Answer in one sentence."
  for dev in cuda:0 cpu; do
    # shellcheck disable=SC2046
    timeout -k 5 30 $(cmd baton) generate --model "$BATON_MODEL" --device "$dev" --max-tokens 48 \
      --chat "$chat" >"$out/generate-${dev/:/}.txt" 2>&1 || status=1
  done
  # A ChatML prompt as ids, then greedy ids on both devices: the GPU in bf16, the CPU in f32 (the
  # exact mode the near-tie margin below is measured in).
  # shellcheck disable=SC2046
  prompt_ids=$($(cmd baton) tokenize --model "$BATON_MODEL" \
    "<|im_start|>system
You are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>
<|im_start|>user
$chat<|im_end|>
<|im_start|>assistant
")
  for dev in cuda:0 cpu; do
    dtype=bf16; [ "$dev" = cpu ] && dtype=f32
    # shellcheck disable=SC2046
    timeout -k 5 30 $(cmd baton) generate --model "$BATON_MODEL" --device "$dev" --dtype "$dtype" --max-tokens 64 \
      --ignore-eos --prompt-ids "$prompt_ids" --print-ids >"$out/ids-${dev/:/}.txt" 2>"$out/ids-${dev/:/}.log" || status=1
  done
  # Where they first differ, the CPU's logits for that position say whether the top two were a
  # near-tie: within K_NEAR_TIE of the row's logit range.
  python3 - "$out" "$prompt_ids" "$(cmd baton)" "$BATON_MODEL" >"$out/greedy-compare.txt" <<'PY' || status=1
import pathlib, struct, subprocess, sys
out, prompt, baton, model = pathlib.Path(sys.argv[1]), sys.argv[2], sys.argv[3].split(), sys.argv[4]
K_NEAR_TIE = 0.002  # the parity test's near-tie margin (tests/gpu/model_test.cpp), x the logit range
def ids(dev):
    lines = [l for l in (out / f"ids-{dev}.txt").read_text().split("\n") if l.strip()]
    return [int(x) for x in lines[-1].split(",")] if lines else []
gpu, cpu = ids("cuda0"), ids("cpu")
print(f"cuda:0: {len(gpu)} ids, cpu: {len(cpu)} ids")
if not gpu or not cpu:
    print("FAILED: a device produced no ids"); sys.exit(1)
n = next((i for i, (a, b) in enumerate(zip(gpu, cpu)) if a != b), None)
if n is None and len(gpu) == len(cpu):
    print(f"identical: {len(gpu)} greedy ids"); sys.exit(0)
if n is None:  # one output is a prefix of the other: a device stopped early, which no near tie explains
    print(f"FAILED: the outputs agree for {min(len(gpu), len(cpu))} ids, but cuda:0 gave {len(gpu)} and cpu {len(cpu)}")
    sys.exit(1)
ctx = prompt + "," + ",".join(map(str, cpu[:n]))
npy = out / "diverge-logits.npy"
subprocess.run(baton + ["generate", "--model", model, "--device", "cpu", "--dtype", "f32", "--prompt-ids", ctx,
                        "--max-tokens", "1", "--logits-out", str(npy)], check=True, capture_output=True)
raw = npy.read_bytes()
hlen = struct.unpack("<H", raw[8:10])[0]
row = struct.unpack(f"<{(len(raw) - 10 - hlen) // 4}f", raw[10 + hlen:])
top = sorted(range(len(row)), key=lambda i: row[i], reverse=True)[:2]
margin = (row[top[0]] - row[top[1]]) / (max(row) - min(row))
print(f"first difference at generated position {n}: cuda:0 {gpu[n]}, cpu {cpu[n]}; "
      f"CPU f32 top two {top} margin {margin:.2e} x range (near-tie below {K_NEAR_TIE})")
if margin >= K_NEAR_TIE or {gpu[n], cpu[n]} != set(top):
    print("FAILED: the ids diverge where the CPU's choice is not a near-tie between the two"); sys.exit(1)
print("accepted: divergence after a measured near-tie")
PY
  cat "$out/greedy-compare.txt"
fi

# ---- benchmarks ---------------------------------------------------------------------------------
log "attention benchmark"
timeout -k 5 45 $(cmd baton_bench_attention) >"$out/bench-attention.log" 2>&1
log "end-to-end benchmark (cuBLAS peak, prefill MFU, decode)"
timeout -k 5 ${BATON_GPU_BENCH_TIMEOUT:-100} $(cmd baton_bench_gpu) >"$out/bench-gpu.log" 2>&1
log "done"

exit $status
