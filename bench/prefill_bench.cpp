// bench/prefill: prefill throughput of a GGUF model on the CPU backend, next to what the same
// GEMMs reach alone. For each dtype and prompt length T it reports
//   - prefill tokens/s and achieved GFLOP/s, counting 2·T·(matmul params) + causal attention
//     (4·head_dim·n_heads·T(T+1)/2 per layer) + the LM head for the one row that needs logits;
//   - GEMM alone: the layer's four projections (fused qkv, o, gate_up, down) at M = T through
//     the backend's gemm (oneDNN matmul, same dtype conversion), in GFLOP/s.
// --weights native runs the prefill on the file's quantised blocks (kernels/cpu/quant_gemm.h: int8
// activations against the native weights), beside the same dtype's dense GEMM alone; --weights
// both measures the two. Output is a Markdown table (bench/RESULTS.md keeps the measured ones).
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <random>
#include <string>
#include <vector>

#include "kv/block_pool.h"
#include "model/model.h"
#include "model/model_files.h"

using namespace baton;

namespace {

double now() {
  return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count();
}

// Median seconds of `reps` runs of fn after one warm-up.
template <typename F>
double time_median(int reps, F&& fn) {
  fn();
  std::vector<double> t;
  for (int i = 0; i < reps; ++i) {
    double t0 = now();
    fn();
    t.push_back(now() - t0);
  }
  std::sort(t.begin(), t.end());
  return t[t.size() / 2];
}

double gemm_alone_gflops(Backend& be, const ModelConfig& c, int64_t t, int reps) {
  const int64_t q = static_cast<int64_t>(c.n_heads) * c.head_dim;
  const int64_t qkv = q + 2 * static_cast<int64_t>(c.n_kv_heads) * c.head_dim;
  const int64_t shapes[4][2] = {
      {qkv, c.dim}, {c.dim, q}, {2 * static_cast<int64_t>(c.ffn_dim), c.dim}, {c.dim, c.ffn_dim}};
  std::mt19937 rng(1);
  std::normal_distribution<float> nd(0.0f, 0.05f);
  double flops = 0, secs = 0;
  for (const auto& s : shapes) {
    std::vector<float> w(static_cast<size_t>(s[0] * s[1]));
    for (float& x : w) x = nd(rng);
    auto m = be.make_matrix(w.data(), s[0], s[1], MatrixUse::kGemm);
    Buffer xb, yb;
    Tensor x = be.alloc_tensor(t, s[1], DType::kF32, &xb), y = be.alloc_tensor(t, s[0], DType::kF32, &yb);
    for (int64_t i = 0; i < t * s[1]; ++i) x.f32()[i] = nd(rng);
    secs += time_median(3 * reps, [&] { be.gemm(x, *m, nullptr, y, false); });
    flops += 2.0 * t * s[0] * s[1];
  }
  return flops / secs / 1e9;
}

}  // namespace

int main(int argc, char** argv) {
  if (argc < 2) {
    std::fprintf(stderr, "usage: %s MODEL.gguf [--dtype bf16|f32] [--weights dense|native|both] [T ...]\n", argv[0]);
    return 2;
  }
  std::vector<int64_t> lengths;
  std::vector<DType> dtypes = {DType::kBF16, DType::kF32};
  std::vector<Model::Weights> plans = {Model::Weights::kDense};
  for (int i = 2; i < argc; ++i) {
    const std::string arg = argv[i];
    if (arg == "--dtype" && i + 1 < argc) {
      dtypes = {std::string(argv[++i]) == "f32" ? DType::kF32 : DType::kBF16};
    } else if (arg == "--weights" && i + 1 < argc) {
      const std::string v = argv[++i];
      plans = v == "native" ? std::vector{Model::Weights::kNative}
              : v == "both" ? std::vector{Model::Weights::kDense, Model::Weights::kNative}
                            : std::vector{Model::Weights::kDense};
    } else {
      lengths.push_back(std::stoll(arg));
    }
  }
  if (lengths.empty()) lengths = {128, 512, 2048};
  auto files = open_model_files(argv[1]);  // a GGUF file or a Hugging Face directory
  if (!files.ok()) {
    std::fprintf(stderr, "baton: error: %s\n", files.status().message().c_str());
    return 1;
  }
  std::printf(
      "| dtype | weights | prompt tokens | prefill ms | prefill tok/s | achieved GFLOP/s | GEMM alone GFLOP/s | ratio "
      "|\n");
  std::printf("|---|---|---|---|---|---|---|---|\n");
  for (DType dtype : dtypes) {
    for (Model::Weights plan : plans) {
      std::string err;
      auto be = make_backend({"cpu", dtype, 0, {}}, &err);
      if (!be) {
        std::fprintf(stderr, "baton: error: %s\n", err.c_str());
        return 1;
      }
      auto model = Model::load(*files->source, *be, {}, plan);
      if (!model.ok()) {
        std::fprintf(stderr, "baton: error: %s\n", model.status().message().c_str());
        return 1;
      }
      const ModelConfig& c = (*model)->config();
      const double q = double(c.n_heads) * c.head_dim, kv = double(c.n_kv_heads) * c.head_dim;
      const double layer_params = c.dim * (q + 2 * kv) + q * c.dim + 3.0 * c.dim * c.ffn_dim;
      for (int64_t t : lengths) {
        std::mt19937 rng(static_cast<unsigned>(t));
        std::vector<int32_t> prompt(static_cast<size_t>(t));
        for (int32_t& id : prompt) id = static_cast<int32_t>(rng() % c.n_vocab);
        BlockPool pool(static_cast<int>((t + 15) / 16), 16);
        auto cache = (*model)->make_kv_cache(pool.n_total(), 16, DType::kF32);
        std::vector<int32_t> table;
        pool.grow_to(table, t);
        StepBatch batch;
        batch.add(prompt, 0, table, Logits::kLast);
        std::vector<float> logits;
        const int reps = t >= 2048 ? 3 : 7;
        const double secs = time_median(reps, [&] { (*model)->forward(batch, *cache, &logits); });
        const double flops = 2.0 * t * layer_params * c.n_layers +
                             4.0 * c.head_dim * c.n_heads * (double(t) * (t + 1) / 2) * c.n_layers +
                             2.0 * c.dim * c.n_vocab;
        const double gemm = gemm_alone_gflops(*be, c, t, reps);
        const double achieved = flops / secs / 1e9;
        std::printf("| %s | %s | %ld | %.1f | %.0f | %.0f | %.0f | %.0f %% |\n", dtype_name(be->compute_dtype()),
                    plan == Model::Weights::kNative ? "native" : "dense", static_cast<long>(t), secs * 1e3, t / secs,
                    achieved, gemm, 100.0 * achieved / gemm);
        std::fflush(stdout);
      }
    }
  }
  return 0;
}
