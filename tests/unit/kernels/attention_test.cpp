// The CPU attention kernel against a naive reference on random shapes: GQA, odd lengths, chunks
// that start mid-sequence, several sequences per step, shuffled block tables, f32 and bf16 KV.
#include <algorithm>
#include <catch2/catch.hpp>
#include <cmath>
#include <limits>
#include <numeric>
#include <random>
#include <vector>

#include "kernels/backend.h"
#include "kernels/half.h"
#include "model/batch.h"
#include "tests/common/tolerance.h"

using namespace baton;

namespace {

struct SeqCase {
  int kv_offset;  // tokens already cached (written in an earlier "step" of this test)
  int n_new;
};

// Naive attention for one query row in double, over keys [0, pos], with each output element's
// error bound (tests/common/tolerance.h) for a kernel that computes with `tol`'s roundings.
void naive_attention(const std::vector<float>& q, const std::vector<float>& k, const std::vector<float>& v, int pos,
                     int n_head, int n_kv, int hd, float scale, const testing::AttentionTolerance& tol,
                     std::vector<double>& out, std::vector<double>& bound) {
  const int group = n_head / n_kv;
  out.assign(static_cast<size_t>(n_head) * hd, 0.0);
  bound.assign(out.size(), 0.0);
  std::vector<double> s(pos + 1), p(pos + 1), var(pos + 1), vcol(pos + 1);
  for (int h = 0; h < n_head; ++h) {
    const int g = h / group;
    double mx = -std::numeric_limits<double>::infinity();
    for (int j = 0; j <= pos; ++j) {
      testing::SumStats dot;
      for (int d = 0; d < hd; ++d) dot.add(double(q[h * hd + d]) * k[(size_t(j) * n_kv + g) * hd + d] * scale);
      s[j] = dot.sum;
      var[j] = tol.score_var(dot);
      mx = std::max(mx, s[j]);
    }
    double sum = 0;
    for (int j = 0; j <= pos; ++j) sum += (p[j] = std::exp(s[j] - mx));
    testing::SumStats p_stats;
    for (double& x : p) p_stats.add(x /= sum);
    for (int d = 0; d < hd; ++d) {
      testing::SumStats pv;
      for (int j = 0; j <= pos; ++j) pv.add(p[j] * (vcol[j] = v[(size_t(j) * n_kv + g) * hd + d]));
      out[h * hd + d] = pv.sum;
      bound[h * hd + d] = tol.element(p, var, vcol, p_stats, pv);
    }
  }
}

void run_case(std::mt19937& rng, int n_head, int n_kv, int hd, int block_size, DType kv_dtype,
              const std::vector<SeqCase>& cases, DType compute = DType::kF32) {
  std::string err;
  auto be = make_backend({"cpu", compute, 0, {}}, &err);
  REQUIRE(be);
  std::normal_distribution<float> nd(0.0f, 1.0f);
  const int kv_w = n_kv * hd, q_w = n_head * hd;

  // Every sequence's full K/V history, and a shuffled set of blocks for each.
  int total_blocks = 0;
  for (const auto& c : cases) total_blocks += (c.kv_offset + c.n_new + block_size - 1) / block_size;
  std::vector<int32_t> ids(total_blocks);
  std::iota(ids.begin(), ids.end(), 0);
  std::shuffle(ids.begin(), ids.end(), rng);
  KvCacheConfig kc{1, n_kv, hd, block_size, total_blocks, kv_dtype};
  auto cache = be->make_kv_cache(kc);

  std::vector<std::vector<float>> ks(cases.size()), vs(cases.size());
  std::vector<std::vector<int32_t>> tables(cases.size());
  size_t next = 0;
  auto round_kv = [&](float x) {
    if (kv_dtype == DType::kBF16) return bf16_to_fp32(fp32_to_bf16(x));
    if (kv_dtype == DType::kF16) return fp16_to_fp32(fp32_to_fp16(x));
    return x;
  };
  for (size_t i = 0; i < cases.size(); ++i) {
    const int len = cases[i].kv_offset + cases[i].n_new;
    for (int b = 0; b < (len + block_size - 1) / block_size; ++b) tables[i].push_back(ids[next++]);
    ks[i].resize(size_t(len) * kv_w);
    vs[i].resize(size_t(len) * kv_w);
    for (float& x : ks[i]) x = nd(rng);
    for (float& x : vs[i]) x = nd(rng);
  }
  // Step 1: write the cached prefix of every sequence.
  auto write = [&](bool prefix) {
    StepBatch b;
    std::vector<float> kbuf, vbuf;
    std::vector<std::vector<int32_t>> toks(cases.size());
    for (size_t i = 0; i < cases.size(); ++i) {
      const int s0 = prefix ? 0 : cases[i].kv_offset;
      const int n = prefix ? cases[i].kv_offset : cases[i].n_new;
      if (n == 0) continue;
      toks[i].assign(n, 0);
      b.add(toks[i], s0, tables[i], Logits::kNone);
      kbuf.insert(kbuf.end(), ks[i].begin() + size_t(s0) * kv_w, ks[i].begin() + size_t(s0 + n) * kv_w);
      vbuf.insert(vbuf.end(), vs[i].begin() + size_t(s0) * kv_w, vs[i].begin() + size_t(s0 + n) * kv_w);
    }
    if (b.empty()) return b;
    Tensor kt{kbuf.data(), DType::kF32, b.n_tokens(), kv_w, kv_w};
    Tensor vt{vbuf.data(), DType::kF32, b.n_tokens(), kv_w, kv_w};
    be->kv_write(*cache, 0, kt, vt, b.view());
    return b;
  };
  write(true);
  std::vector<std::vector<int32_t>> toks(cases.size());
  StepBatch step;
  for (size_t i = 0; i < cases.size(); ++i) {
    toks[i].assign(cases[i].n_new, 0);
    step.add(toks[i], cases[i].kv_offset, tables[i], Logits::kNone);
  }
  write(false);

  std::vector<float> q(size_t(step.n_tokens()) * q_w), out(q.size(), std::numeric_limits<float>::quiet_NaN());
  for (float& x : q) x = nd(rng);
  const float scale = 1.0f / std::sqrt(float(hd));
  Tensor qt{q.data(), DType::kF32, step.n_tokens(), q_w, q_w};
  Tensor ot{out.data(), DType::kF32, step.n_tokens(), q_w, q_w};
  be->attention(qt, *cache, 0, step.view(), n_head, scale, ot);

  // f32 compute: f32 roundings only. bf16 or f16 KV: the reference reads the same rounded K/V, so
  // the cache's type adds nothing. bf16 compute (the tile-matmul path rounds Q, K, V and P to
  // bf16): two bf16 roundings per product on both matmuls.
  testing::AttentionTolerance tol;
  if (be->compute_dtype() == DType::kBF16) tol.r_qk = tol.r_pv = 2 * testing::kUnitRoundoffBF16;
  double worst = 0;  // largest |error| / bound seen
  for (size_t i = 0; i < cases.size(); ++i) {
    std::vector<float> kr(ks[i].size()), vr(vs[i].size());
    std::transform(ks[i].begin(), ks[i].end(), kr.begin(), round_kv);
    std::transform(vs[i].begin(), vs[i].end(), vr.begin(), round_kv);
    for (int t = 0; t < cases[i].n_new; ++t) {
      const int row = step.seqs()[i].row0 + t;
      std::vector<float> qrow(q.begin() + size_t(row) * q_w, q.begin() + size_t(row + 1) * q_w);
      std::vector<double> ref, bound;
      naive_attention(qrow, kr, vr, cases[i].kv_offset + t, n_head, n_kv, hd, scale, tol, ref, bound);
      for (int c = 0; c < q_w; ++c) {
        const float got = out[size_t(row) * q_w + c];
        REQUIRE(std::isfinite(got));
        worst = std::max(worst, std::abs(got - ref[c]) / bound[c]);
      }
    }
  }
  INFO("heads " << n_head << "/" << n_kv << " hd " << hd << " block " << block_size << " compute "
                << dtype_name(be->compute_dtype()) << " kv " << dtype_name(kv_dtype) << ": largest error / bound "
                << worst);
  CHECK(worst <= 1.0);
}

}  // namespace

TEST_CASE("attention matches a naive reference on random shapes", "[attention]") {
  std::random_device rd;
  const unsigned seed = rd();
  INFO("seed " << seed);
  std::mt19937 rng(seed);
  std::uniform_int_distribution<int> len(1, 150), off(0, 200), pick(0, 3);
  const int heads[][2] = {{4, 4}, {8, 2}, {9, 3}, {6, 1}};
  for (int trial = 0; trial < 12; ++trial) {
    const auto* h = heads[pick(rng)];
    const int hd = std::array<int, 4>{16, 32, 64, 128}[pick(rng)];
    const int block = std::array<int, 4>{1, 7, 16, 64}[pick(rng)];
    std::vector<SeqCase> cases;
    const int n_seq = 1 + pick(rng);
    for (int s = 0; s < n_seq; ++s) cases.push_back({trial % 3 == 0 ? 0 : off(rng), len(rng)});
    run_case(rng, h[0], h[1], hd, block, DType::kF32, cases);
  }
}

TEST_CASE("attention handles single-token decode steps and long prefixes", "[attention]") {
  std::mt19937 rng(std::random_device{}());
  run_case(rng, 9, 3, 64, 16, DType::kF32, {{700, 1}, {0, 1}, {33, 1}, {129, 1}});
}

TEST_CASE("decode-sized steps match the reference for every head size, block size and KV type", "[attention]") {
  // Items of at most 8 query rows (a position or two times the GQA group) take the direct path:
  // AVX-512 tiles of 16 keys for head_dim 32, 64 and 128, the portable loop otherwise. Lengths
  // cross tile and block edges (a tile of 16 within one block, or spread over blocks of 1 or 7).
  const unsigned seed = std::random_device{}();
  INFO("seed " << seed);
  std::mt19937 rng(seed);
  std::uniform_int_distribution<int> off(0, 300), pick(0, 3), one_or_two(1, 2);
  const int heads[][2] = {{9, 3}, {8, 1}, {4, 4}, {8, 2}};
  // bf16 compute on a bf16 cache takes the bf16 dot-product path where the CPU has avx512_bf16.
  for (DType compute : {DType::kF32, DType::kBF16}) {
    for (DType kv : {DType::kF32, DType::kBF16}) {
      for (int hd : {16, 32, 64, 128}) {
        const auto* h = heads[pick(rng)];
        const int block = std::array<int, 4>{1, 7, 16, 64}[pick(rng)];
        const int n_new = h[0] / h[1] == 8 ? 1 : one_or_two(rng);  // at most 8 rows an item
        INFO("compute " << dtype_name(compute) << ", kv " << dtype_name(kv) << ", head_dim " << hd << ", heads " << h[0]
                        << "/" << h[1] << ", block " << block);
        run_case(rng, h[0], h[1], hd, block, kv, {{off(rng), n_new}, {0, 1}, {15, n_new}, {16, 1}, {off(rng), n_new}},
                 compute);
      }
    }
  }
}

TEST_CASE("attention reads bf16 and f16 KV caches", "[attention]") {
  std::mt19937 rng(std::random_device{}());
  run_case(rng, 8, 2, 64, 16, DType::kBF16, {{50, 37}, {0, 90}, {20, 1}});
  run_case(rng, 8, 2, 64, 16, DType::kF16, {{50, 37}, {0, 90}, {20, 1}});
}

TEST_CASE("attention with bf16 compute stays within bf16 tolerance", "[attention]") {
  std::mt19937 rng(std::random_device{}());
  // Long new-token runs take the tile-matmul path (bf16 operands where the CPU supports them).
  run_case(rng, 9, 3, 64, 16, DType::kF32, {{0, 300}, {200, 77}, {5, 3}}, DType::kBF16);
  run_case(rng, 8, 8, 128, 7, DType::kF32, {{31, 64}}, DType::kBF16);
}
