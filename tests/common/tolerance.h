// The numeric tests' tolerances, derived in one place from the compute type's unit roundoff and
// the length of each reduction — no hand-picked constants and no silent multipliers.
//
// The model (Higham & Mary, "A new approach to probabilistic rounding error analysis", 2019):
// every rounding contributes an error of relative size at most u, the unit roundoff of the type it
// happens in, and on random inputs these errors are independent and centred. Summing terms t_k
// in floating point then errs by Σ_k r_k t_k + Σ_k a_k S_k, where r_k (|r_k| ≤ r) is the rounding
// of the term itself (forming a product, or rounding operands to a narrower type first), a_k
// (|a_k| ≤ u of the accumulator) that of the k-th addition and S_k the k-th partial sum. By
// Hoeffding's inequality that is at most
//     kLambda · sqrt(r² Σ t_k² + u² Σ S_k²)
// except with probability 2·exp(−kLambda²/2); kLambda = 7 makes that 5e-11 per checked value, so
// with ~1e6 values checked in a run a false failure every ~20,000 runs. (The worst-case bound,
// n·u·Σ|t_k|, is ~sqrt(n) times looser and would hide real defects.) The partial sums are taken
// in the reference's order; a kernel that sums in lanes or tiles has smaller ones.
// Errors that are not random, such as a polynomial exp's, are added in the worst case.
//
// A deliberately wrong kernel has to fail against these bounds: shown once for the CPU attention
// kernel (bench/RESULTS.md, "Tolerances").
#pragma once

#include <algorithm>
#include <cmath>
#include <span>

namespace baton::testing {

// Hoeffding's λ: see the comment above.
inline constexpr double kLambda = 7.0;

// Unit roundoff u = 2^-p of each type (p = significand bits, implicit bit included).
inline constexpr double kUnitRoundoffF32 = 0x1p-24;
inline constexpr double kUnitRoundoffBF16 = 0x1p-8;

// Σ t_k² and Σ S_k² of a sum, accumulated term by term, for sum_tolerance.
struct SumStats {
  double sum = 0;      // S_k so far
  double terms2 = 0;   // Σ t_k²
  double partial2 = 0; // Σ S_k²
  double abs = 0;      // Σ |t_k|
  void add(double t) {
    sum += t;
    terms2 += t * t;
    partial2 += sum * sum;
    abs += std::abs(t);
  }
};

// Bound on the rounding error of a sum whose terms carry relative error at most `r` and whose
// additions round to `u_acc`.
inline double sum_tolerance(const SumStats& s, double r, double u_acc = kUnitRoundoffF32) {
  return kLambda * std::sqrt(r * r * s.terms2 + u_acc * u_acc * s.partial2);
}

// Bound on the error of each attention output element o_c = Σ_j p_j v_jc (p = softmax(s),
// s_j = scale · Σ_d q_d k_jd) of one query row and head. Accumulation is in f32; `r_qk` and
// `r_pv` are the relative rounding of one product's operands (f32: u; bf16 operands: 2 u_bf16).
//   1. The roundings inside score s_j (its hd products, its additions, and a few f32 roundings of
//      |s_j|: scale·log2(e) folded into q, the max subtracted) move s_j by e_j.
//   2. A score error moves p_j by p_j (e_j − ē), ē = Σ p_i e_i, so o_c moves by
//      Σ_j p_j (v_jc − o_c) e_j: a linear combination of all the scores' independent roundings, so
//      one Hoeffding bound over all of them: kLambda · sqrt(Σ_j p_j² (v_jc − o_c)² · var_j), with
//      var_j = r_qk² Σ_d t_jd² + u² Σ_d S_jd² + (4 u s_j)² (score_var).
//   3. exp's relative error (not random): at most exp_rel·(Σ p_j |v_jc| + |o_c|).
//   4. The sum Σ p_j v_jc (sum_tolerance) and the normalisation by Σ p (sum_tolerance of the p).
struct AttentionTolerance {
  double r_qk = kUnitRoundoffF32;
  double r_pv = kUnitRoundoffF32;
  double exp_rel_error = 1e-7;  // kernels/cpu/fast_math.h: exp2_fast

  // Step 1 for one key, from the stats of its hd scaled products.
  double score_var(const SumStats& products) const {
    const double u = kUnitRoundoffF32, fold = 4 * u * products.sum;
    return r_qk * r_qk * products.terms2 + u * u * products.partial2 + fold * fold;
  }

  // Steps 2-4 for one output element: the normalised probabilities p (reference order), each key's
  // score_var, V's column and the stats of Σ p_j v_jc (whose sum is o_c); `p_stats` those of Σ p_j.
  double element(std::span<const double> p, std::span<const double> var, std::span<const double> v_col,
                 const SumStats& p_stats, const SumStats& pv) const {
    const double o = pv.sum;
    double scores2 = 0;
    for (size_t j = 0; j < p.size(); ++j) scores2 += p[j] * p[j] * (v_col[j] - o) * (v_col[j] - o) * var[j];
    const double from_scores = kLambda * std::sqrt(scores2);
    const double from_exp = exp_rel_error * (pv.abs + std::abs(o));
    const double from_sums = sum_tolerance(pv, r_pv) + sum_tolerance(p_stats, kUnitRoundoffF32) * std::abs(o);
    return from_scores + from_exp + from_sums;
  }
};

// Norm-wise relative error ‖out − ref‖ / ‖ref‖ of an op whose operands are rounded to bf16 once
// and accumulated in f32 (the CUDA backend's ops against the f32 CPU twin): each product carries
// two roundings, uniform on [−u, u], so each output's error has standard deviation about
// (2u/√3)·‖terms‖, and for random-sign data ‖terms‖ ≈ |output|. A norm-wise error averages over
// every element, so it concentrates at that σ; 2.5σ leaves room for the f32 accumulation order.
inline constexpr double kBf16NormwiseTolerance = 2.5 * 2 * kUnitRoundoffBF16 / 1.7320508075688772;

// A whole model in bf16 against f32: the roundings compound through the layers in a way no short
// derivation bounds, so the floor is measured in the same run: the CPU backend in bf16 (the same
// bf16 weights and GEMM operands, f32 accumulation) against the CPU in f32. Another bf16
// implementation is allowed this factor over that floor (independent roundings of the same size
// add in quadrature, √2; the rest for attention's bf16 probabilities on the GPU).
inline constexpr double kModelBf16OverFloor = 2.0;

}  // namespace baton::testing
