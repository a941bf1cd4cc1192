// When a CPU kernel is worth an OpenMP parallel region. Waking a team costs microseconds (tens of
// them with OMP_WAIT_POLICY=PASSIVE, which `baton local` uses); a decode step's elementwise ops
// touch a few thousand floats and finish faster on the calling thread. Measured on 2 cores:
// serving decode ITL 57 → see bench/RESULTS.md once small ops stayed serial.
#pragma once

#include <cstdint>

namespace baton::cpu {

// Elements (of f32 work) below which an elementwise kernel runs on the calling thread.
constexpr int64_t kParallelMinElems = 1 << 16;

inline bool worth_parallel(int64_t n_elems) { return n_elems >= kParallelMinElems; }

}  // namespace baton::cpu
