// A zeroed byte buffer for weights a decode step streams: mapped on 2 MiB boundaries and advised
// for transparent huge pages (MADV_HUGEPAGE), so that reading gigabytes of weights takes one TLB
// entry per 2 MiB instead of per 4 KiB. On a 2-core Zen 4 VM a streaming read of 1 GiB measured
// 51–58 GB/s on huge pages against 40–45 on 4 KiB pages (bench/RESULTS.md). Where the kernel does
// not give huge pages (transparent_hugepage=never) it is plain anonymous memory.
#pragma once

#include <cstddef>
#include <cstdint>

namespace baton::cpu {

class HugeBytes {
 public:
  HugeBytes() = default;
  HugeBytes(const HugeBytes& other);
  HugeBytes& operator=(const HugeBytes& other);
  HugeBytes(HugeBytes&& other) noexcept;
  HugeBytes& operator=(HugeBytes&& other) noexcept;
  ~HugeBytes();

  // `n` zero bytes (what was held is released).
  void assign_zero(size_t n);
  uint8_t* data() { return data_; }
  const uint8_t* data() const { return data_; }
  size_t size() const { return size_; }
  bool empty() const { return size_ == 0; }

 private:
  void release();
  uint8_t* data_ = nullptr;
  size_t size_ = 0;
  size_t mapped_ = 0;  // bytes mapped at data_ (size_ rounded up to 2 MiB)
};

}  // namespace baton::cpu
