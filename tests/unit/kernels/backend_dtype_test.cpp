// --dtype auto: a prefill-only CPU backend measures bf16 against f32 and computes in the faster;
// the KV default does not follow that choice, so a prefill worker and a decode worker agree.
#include <catch2/catch.hpp>
#include <cstdio>
#include <memory>
#include <string>

#include "kernels/backend.h"
#include "kernels/cpu/cpu_backend.h"

using namespace baton;

TEST_CASE("dtype auto measures the gemm and says what it chose and why") {
  BackendOptions o;
  o.measure_dtype = true;
  std::string error;
  auto measured = make_backend(o, &error);
  REQUIRE(measured);
  if (!cpu_has_bf16()) {  // nothing to choose between: f32, and no measurement
    CHECK(measured->compute_dtype() == DType::kF32);
    CHECK(measured->dtype_reason().empty());
    CHECK(measured->default_kv_dtype() == DType::kF32);
    return;
  }
  const std::string why = measured->dtype_reason();
  INFO(why);
  double bf16 = 0, f32 = 0;
  const size_t at = why.find("bf16 ");
  REQUIRE(at != std::string::npos);
  REQUIRE(std::sscanf(why.c_str() + at, "bf16 %lf GFLOP/s, f32 %lf GFLOP/s", &bf16, &f32) == 2);
  CHECK(bf16 > 0);
  CHECK(f32 > 0);
  CHECK(measured->compute_dtype() == (f32 > bf16 ? DType::kF32 : DType::kBF16));
  CHECK(measured->default_kv_dtype() == DType::kBF16);  // whichever it computes in

  // Asked for, not measured: no probe, and the flag's dtype.
  o.measure_dtype = false;
  o.dtype = DType::kF32;
  auto asked = make_backend(o, &error);
  REQUIRE(asked);
  CHECK(asked->compute_dtype() == DType::kF32);
  CHECK(asked->dtype_reason().empty());
  CHECK(asked->default_kv_dtype() == DType::kF32);  // --dtype f32 is the exact mode, KV included
  auto kv = resolve_kv_dtype(*measured, "");
  REQUIRE(kv.ok());
  CHECK(*kv == DType::kBF16);
}
