// libFuzzer target for the GGUF reader and what reads its metadata next (model config,
// tokenizer). Any input must yield a Status, never a crash, leak or sanitizer report.
// Build and run: scripts/fuzz-gguf.sh [seconds].
#include <cstddef>
#include <cstdint>
#include <span>

#include "model/config.h"
#include "model/gguf.h"
#include "model/tokenizer.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  auto file = baton::GgufFile::parse(std::span<const uint8_t>(data, size));
  if (!file.ok()) return 0;
  for (const auto& t : (*file)->tensors()) {
    auto bytes = (*file)->tensor_data(t);
    volatile uint8_t sink = bytes.empty() ? 0 : bytes[bytes.size() - 1];
    (void)sink;
  }
  (void)baton::model_config_from_gguf(**file);
  auto tok = baton::Tokenizer::from_gguf(**file);
  if (tok.ok()) (void)(*tok)->encode("Hello, world! 123 <|im_start|>user\n");
  return 0;
}
