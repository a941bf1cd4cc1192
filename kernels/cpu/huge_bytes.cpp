#include "kernels/cpu/huge_bytes.h"

#include <sys/mman.h>

#include <cstring>
#include <new>
#include <utility>

namespace baton::cpu {
namespace {

constexpr size_t kHuge = size_t{2} << 20;

}  // namespace

HugeBytes::HugeBytes(const HugeBytes& other) {
  assign_zero(other.size_);
  if (size_ > 0) std::memcpy(data_, other.data_, size_);
}

HugeBytes& HugeBytes::operator=(const HugeBytes& other) {
  if (this != &other) {
    HugeBytes copy(other);
    *this = std::move(copy);
  }
  return *this;
}

HugeBytes::HugeBytes(HugeBytes&& other) noexcept
    : data_(std::exchange(other.data_, nullptr)),
      size_(std::exchange(other.size_, 0)),
      mapped_(std::exchange(other.mapped_, 0)) {}

HugeBytes& HugeBytes::operator=(HugeBytes&& other) noexcept {
  if (this != &other) {
    release();
    data_ = std::exchange(other.data_, nullptr);
    size_ = std::exchange(other.size_, 0);
    mapped_ = std::exchange(other.mapped_, 0);
  }
  return *this;
}

HugeBytes::~HugeBytes() { release(); }

void HugeBytes::release() {
  if (data_ != nullptr) munmap(data_, mapped_);
  data_ = nullptr;
  size_ = mapped_ = 0;
}

void HugeBytes::assign_zero(size_t n) {
  release();
  if (n == 0) return;
  const size_t mapped = (n + kHuge - 1) / kHuge * kHuge;
  // Over-map by 2 MiB and trim both ends, so the buffer starts on a 2 MiB boundary.
  void* raw = mmap(nullptr, mapped + kHuge, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  if (raw == MAP_FAILED) throw std::bad_alloc();
  auto* base = static_cast<uint8_t*>(raw);
  const uintptr_t at = reinterpret_cast<uintptr_t>(base);
  uint8_t* aligned = base + ((kHuge - at % kHuge) % kHuge);
  if (aligned > base) munmap(base, static_cast<size_t>(aligned - base));
  const size_t tail = static_cast<size_t>(base + mapped + kHuge - (aligned + mapped));
  if (tail > 0) munmap(aligned + mapped, tail);
  madvise(aligned, mapped, MADV_HUGEPAGE);  // advice: without THP the pages are 4 KiB, nothing else changes
  data_ = aligned;
  size_ = n;
  mapped_ = mapped;
}

}  // namespace baton::cpu
