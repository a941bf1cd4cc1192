// The CUDA attention launchers (kernels/cuda/attention.h) against a naive double-precision CPU
// reference on fresh random inputs: shuffled block tables, block sizes 16 and 5, head dims 64 and
// 128, GQA ratios 1/3/4 (and 24 for decode's head groups), chunks starting mid-sequence, decode
// contexts short (one split, direct output) and long (split-K plus combine). KV slots no sequence
// owns hold NaN, so any read outside a sequence's keys poisons its output; outputs start poisoned
// too, and every element no sequence owns (gap rows, padding columns, rows of empty sequences)
// must still be poisoned afterwards.
#include <algorithm>
#include <catch2/catch.hpp>
#include <cmath>
#include <cstdint>
#include <numeric>
#include <string>
#include <vector>

#include "kernels/cuda/attention.h"
#include "tests/gpu/gpu_test_util.h"

namespace baton::gpu_test {
namespace {

using cuda::AttnParams;
using cuda::AttnSeq;

constexpr uint16_t kBf16Nan = 0xFFFF;  // what poison() writes

// Device allocation freed on scope exit.
struct DeviceBuffer {
  void* ptr = nullptr;
  explicit DeviceBuffer(size_t bytes) { CUDA_CHECK(cudaMalloc(&ptr, bytes > 0 ? bytes : 1)); }
  ~DeviceBuffer() { cudaFree(ptr); }
  DeviceBuffer(const DeviceBuffer&) = delete;
  DeviceBuffer& operator=(const DeviceBuffer&) = delete;
  template <class T>
  T* as() const {
    return static_cast<T*>(ptr);
  }
};

template <class T>
void upload(const DeviceBuffer& dst, const std::vector<T>& src) {
  CUDA_CHECK(cudaMemcpy(dst.ptr, src.data(), src.size() * sizeof(T), cudaMemcpyHostToDevice));
}

struct SeqSpec {
  int kv_offset;
  int n_new;
};

struct Shape {
  int head_dim;
  int block_size;
  int n_kv_heads;
  int group;  // query heads per KV head
  int n_head() const { return n_kv_heads * group; }
};

// One step's inputs: sequences' query rows (one unused gap row before each sequence), a paged
// KV cache with shuffled block ids, and the bf16 values as floats for the reference.
struct Problem {
  Shape s;
  std::vector<SeqSpec> specs;
  std::vector<AttnSeq> seqs;
  std::vector<int32_t> tables;
  int n_rows = 0;
  int64_t ld_q = 0, ld_out = 0;
  int n_blocks = 0;
  std::vector<uint16_t> q_bits, k_bits, v_bits;  // device images
  std::vector<float> q, k, v;                    // the same values (NaN where unowned)

  Problem(Shape shape, std::vector<SeqSpec> seq_specs) : s(shape), specs(std::move(seq_specs)) {
    const int D = s.head_dim;
    const int bs = s.block_size;
    ld_q = static_cast<int64_t>(s.n_head()) * D + 8;  // padded strides: the kernels must honour ld
    ld_out = static_cast<int64_t>(s.n_head()) * D + 16;
    int n_table = 0;
    for (const SeqSpec& sp : specs) {
      const int kv_len = sp.kv_offset + sp.n_new;
      n_rows += 1;  // gap row
      seqs.push_back({n_rows, sp.n_new, sp.kv_offset, n_table});
      n_rows += sp.n_new;
      n_table += (kv_len + bs - 1) / bs;
    }
    n_rows += 1;
    n_blocks = n_table + 3;  // a few blocks nobody owns
    std::vector<int32_t> ids(n_blocks);
    std::iota(ids.begin(), ids.end(), 0);
    std::shuffle(ids.begin(), ids.end(), rng());
    tables.assign(ids.begin(), ids.begin() + n_table);

    q = round_bf16(random_vector(static_cast<size_t>(n_rows) * ld_q, -2.0f, 2.0f));
    const size_t kv_elems = static_cast<size_t>(n_blocks) * bs * s.n_kv_heads * D;
    k = round_bf16(random_vector(kv_elems));
    v = round_bf16(random_vector(kv_elems));
    // Poison every cache slot no sequence owns.
    std::vector<bool> owned(static_cast<size_t>(n_blocks) * bs, false);
    for (size_t i = 0; i < specs.size(); ++i) {
      for (int pos = 0; pos < specs[i].kv_offset + specs[i].n_new; ++pos) owned[slot_of(i, pos)] = true;
    }
    for (size_t slot = 0; slot < owned.size(); ++slot) {
      if (owned[slot]) continue;
      for (size_t e = 0; e < static_cast<size_t>(s.n_kv_heads) * D; ++e) {
        k[slot * s.n_kv_heads * D + e] = NAN;
        v[slot * s.n_kv_heads * D + e] = NAN;
      }
    }
    q_bits = to_bits(q);
    k_bits = to_bits(k);
    v_bits = to_bits(v);
  }

  // Cache slot (block · block_size + offset) of sequence i's position pos.
  size_t slot_of(size_t i, int pos) const {
    const int bs = s.block_size;
    return static_cast<size_t>(tables[seqs[i].table0 + pos / bs]) * bs + pos % bs;
  }
  static std::vector<uint16_t> to_bits(const std::vector<float>& x) {
    std::vector<uint16_t> b(x.size());
    for (size_t i = 0; i < x.size(); ++i) b[i] = std::isnan(x[i]) ? kBf16Nan : fp32_to_bf16(x[i]);
    return b;
  }
  int max_n_new() const {
    int m = 0;
    for (const SeqSpec& sp : specs) m = std::max(m, sp.n_new);
    return m;
  }
  int max_kv_len() const {
    int m = 1;
    for (const SeqSpec& sp : specs) m = std::max(m, sp.kv_offset + sp.n_new);
    return m;
  }

  // Reference outputs of every owned (row, head), in row-major order of (sequence, row, head, d).
  std::vector<float> reference(double scale) const {
    const int D = s.head_dim;
    std::vector<float> out;
    std::vector<double> p;
    for (size_t i = 0; i < specs.size(); ++i) {
      for (int r = 0; r < specs[i].n_new; ++r) {
        const int pos = specs[i].kv_offset + r;
        const float* qrow = &q[static_cast<size_t>(seqs[i].row0 + r) * ld_q];
        for (int h = 0; h < s.n_head(); ++h) {
          const int kvh = h / s.group;
          p.assign(pos + 1, 0.0);
          double mx = -INFINITY;
          for (int key = 0; key <= pos; ++key) {
            const float* krow = &k[(slot_of(i, key) * s.n_kv_heads + kvh) * D];
            double dot = 0;
            for (int d = 0; d < D; ++d) dot += double(qrow[h * D + d]) * krow[d];
            p[key] = dot * scale;
            mx = std::max(mx, p[key]);
          }
          double sum = 0;
          for (double& x : p) sum += (x = std::exp(x - mx));
          for (int d = 0; d < D; ++d) {
            double acc = 0;
            for (int key = 0; key <= pos; ++key) acc += p[key] * v[(slot_of(i, key) * s.n_kv_heads + kvh) * D + d];
            out.push_back(static_cast<float>(acc / sum));
          }
        }
      }
    }
    return out;
  }
};

enum class Launcher { kPrefill, kDecode };

// Runs one launcher on the problem and checks it. `max_kv_len` is the host bound handed to the
// launcher (>= the true maximum, as with a CUDA graph captured for longer sequences).
void run_and_check(const Problem& pr, Launcher which, int max_kv_len) {
  const Shape& s = pr.s;
  const int D = s.head_dim;
  DeviceBuffer q(pr.q_bits.size() * 2), k(pr.k_bits.size() * 2), v(pr.v_bits.size() * 2);
  DeviceBuffer tables(pr.tables.size() * 4), seqs(pr.seqs.size() * sizeof(AttnSeq));
  const size_t out_elems = static_cast<size_t>(pr.n_rows) * pr.ld_out;
  DeviceBuffer out(out_elems * 2);
  upload(q, pr.q_bits);
  upload(k, pr.k_bits);
  upload(v, pr.v_bits);
  upload(tables, pr.tables);
  upload(seqs, pr.seqs);
  poison(out.ptr, out_elems * 2);

  AttnParams p{};
  p.q = q.as<__nv_bfloat16>();
  p.ld_q = pr.ld_q;
  p.out = out.as<__nv_bfloat16>();
  p.ld_out = pr.ld_out;
  p.k_cache = k.as<__nv_bfloat16>();
  p.v_cache = v.as<__nv_bfloat16>();
  p.seqs = seqs.as<AttnSeq>();
  p.block_tables = tables.as<int32_t>();
  p.n_seqs = static_cast<int>(pr.seqs.size());
  p.n_head = s.n_head();
  p.n_kv_heads = s.n_kv_heads;
  p.head_dim = D;
  p.block_size = s.block_size;
  p.scale = 1.0f / std::sqrt(static_cast<float>(D));
  p.max_n_new = pr.max_n_new();
  p.max_kv_len = max_kv_len;

  if (which == Launcher::kPrefill) {
    cuda::attention_prefill(p, nullptr);
  } else {
    const size_t ws_bytes = cuda::attention_decode_workspace_bytes(p.n_seqs, p.n_head, D, max_kv_len);
    DeviceBuffer ws(ws_bytes);
    poison(ws.ptr, ws_bytes);
    cuda::attention_decode(p, ws.ptr, ws_bytes, nullptr);
    CUDA_CHECK(cudaDeviceSynchronize());
  }
  CUDA_CHECK(cudaDeviceSynchronize());

  std::vector<uint16_t> host(out_elems);
  CUDA_CHECK(cudaMemcpy(host.data(), out.ptr, out_elems * 2, cudaMemcpyDeviceToHost));
  std::vector<float> got;
  std::vector<bool> owned(out_elems, false);
  for (size_t i = 0; i < pr.seqs.size(); ++i) {
    for (int r = 0; r < pr.seqs[i].n_new; ++r) {
      for (int e = 0; e < s.n_head() * D; ++e) {
        const size_t idx = static_cast<size_t>(pr.seqs[i].row0 + r) * pr.ld_out + e;
        owned[idx] = true;
        got.push_back(bf16_to_fp32(host[idx]));
      }
    }
  }
  size_t n_stray = 0;
  for (size_t idx = 0; idx < out_elems; ++idx) n_stray += !owned[idx] && host[idx] != kBf16Nan;
  CHECK(n_stray == 0);  // nothing written outside the sequences' rows and heads

  const std::vector<float> ref = pr.reference(p.scale);
  REQUIRE(got.size() == ref.size());
  const double err = rel_error(got, ref);
  INFO("rel error " << err);
  CHECK(err <= 1e-2);
}

std::string describe(const Shape& s) {
  return "head_dim " + std::to_string(s.head_dim) + ", block_size " + std::to_string(s.block_size) + ", n_kv_heads " +
         std::to_string(s.n_kv_heads) + ", group " + std::to_string(s.group);
}

int random_int(int lo, int hi) {
  return std::uniform_int_distribution<int>(lo, hi)(rng());
}

}  // namespace

TEST_CASE("attention_prefill matches the reference on mixed chunks", "[gpu]") {
  for (int head_dim : {64, 128}) {
    for (int block_size : {16, 5}) {
      for (int group : {1, 3, 4}) {
        const Shape s{head_dim, block_size, 2, group};
        // Fresh chunks each run: first chunks (kv_offset 0) and chunks starting mid-sequence,
        // n_new 1 / 7 / 64 / 200+, plus an empty sequence (it must write nothing).
        const std::vector<SeqSpec> specs = {
            {0, random_int(200, 260)},  {random_int(1, 300), 7}, {0, 1},
            {random_int(100, 400), 64}, {random_int(0, 60), 0},  {random_int(1, 200), random_int(200, 300)},
            {random_int(1, 500), 1},
        };
        INFO(describe(s));
        const Problem pr(s, specs);
        run_and_check(pr, Launcher::kPrefill, pr.max_kv_len());
      }
    }
  }
}

TEST_CASE("attention_prefill matches the reference on long chunks", "[gpu]") {
  // Many query tiles per sequence and many key tiles per query tile, with unaligned offsets.
  for (int head_dim : {64, 128}) {
    const Shape s{head_dim, 16, 1, 4};
    const std::vector<SeqSpec> specs = {{0, random_int(1000, 1100)}, {random_int(500, 800), random_int(250, 400)}};
    INFO(describe(s));
    const Problem pr(s, specs);
    run_and_check(pr, Launcher::kPrefill, pr.max_kv_len() + 1000);
  }
}

TEST_CASE("attention_decode matches the reference with split keys", "[gpu]") {
  for (int head_dim : {64, 128}) {
    for (int block_size : {16, 5}) {
      for (int group : {1, 3, 4}) {
        const Shape s{head_dim, block_size, 2, group};
        // One new token each; contexts 1, short, ~1000, 5000 (many splits); the bound handed to
        // the launcher is larger than any true length, as in a replayed CUDA graph.
        const std::vector<SeqSpec> specs = {
            {0, 1},    {random_int(1, 60), 1},    {random_int(900, 1100), 1},
            {4999, 1}, {random_int(100, 200), 1}, {random_int(0, 50), 0},
        };
        INFO(describe(s));
        const Problem pr(s, specs);
        run_and_check(pr, Launcher::kDecode, pr.max_kv_len() + random_int(0, 700));
      }
    }
  }
}

TEST_CASE("attention_decode matches the reference with one split", "[gpu]") {
  // max_kv_len <= 64 keeps every call at one split (splits hold >= 64 keys): the main kernel
  // writes out directly and no workspace is needed.
  for (int head_dim : {64, 128}) {
    for (int block_size : {16, 5}) {
      const Shape s{head_dim, block_size, 2, 4};
      const std::vector<SeqSpec> specs = {{0, 1}, {random_int(1, 20), 1}, {random_int(30, 50), 1}, {63, 1}};
      INFO(describe(s));
      CHECK(cuda::attention_decode_workspace_bytes(static_cast<int>(specs.size()), s.n_head(), head_dim, 64) == 0);
      const Problem pr(s, specs);
      run_and_check(pr, Launcher::kDecode, 64);
    }
  }
}

TEST_CASE("attention_decode handles more than 16 query heads per KV head", "[gpu]") {
  const Shape s{128, 16, 1, 24};  // two head groups, the second half full
  const std::vector<SeqSpec> specs = {{random_int(2000, 3000), 1}, {random_int(0, 40), 1}};
  INFO(describe(s));
  const Problem pr(s, specs);
  run_and_check(pr, Launcher::kDecode, pr.max_kv_len());
}

}  // namespace baton::gpu_test
