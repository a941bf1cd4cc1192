// Where a model comes from: its config and its tensors, by baton's names (GGUF's:
// "blk.0.attn_q.weight"), with ggml-ordered dims and the bytes as stored. A GGUF file
// (gguf_model_source) or a Hugging Face model directory (hf_model.h); Model::load reads either.
#pragma once

#include <memory>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "common/status.h"
#include "model/config.h"
#include "model/gguf.h"

namespace baton {

struct SourceTensor {
  GgmlType type = GgmlType::kF32;
  std::vector<uint64_t> dims;     // ggml order: dims[0] is the fastest-varying (row width)
  std::span<const uint8_t> data;  // the stored bytes (mapped; valid while the source lives)
};

class ModelSource {
 public:
  virtual ~ModelSource() = default;
  virtual const ModelConfig& config() const = 0;
  // The tensor baton calls `name`, or nullopt when the model has none.
  virtual std::optional<SourceTensor> tensor(std::string_view name) const = 0;
  // A short digest of the config and the weights' layout and first bytes: workers refuse KV and
  // requests of another fingerprint.
  virtual const std::string& fingerprint() const = 0;
  // Called by the loader once it has converted tensor `name` into the backend's own copy: a
  // source that maps a file drops the tensor's pages from this process's memory (a later read
  // faults them in again), so the file does not sit in the resident set beside the copy.
  virtual void release(std::string_view name) const {}
};

// Drops the whole pages inside `data`, a read-only file mapping's bytes, from the resident set.
void release_mapped_pages(std::span<const uint8_t> data);

// A GGUF file as a ModelSource; the file must outlive it. Errors are model_config_from_gguf's.
Result<std::unique_ptr<ModelSource>> gguf_model_source(const GgufFile& file);

}  // namespace baton
