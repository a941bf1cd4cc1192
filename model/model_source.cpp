#include "model/model_source.h"

#include <sys/mman.h>
#include <unistd.h>

#include <cstdint>

namespace baton {

void release_mapped_pages(std::span<const uint8_t> data) {
  static const uintptr_t page = static_cast<uintptr_t>(::sysconf(_SC_PAGESIZE));
  const uintptr_t begin = (reinterpret_cast<uintptr_t>(data.data()) + page - 1) / page * page;
  const uintptr_t end = (reinterpret_cast<uintptr_t>(data.data()) + data.size()) / page * page;
  // Pages shared with a neighbouring tensor stay; that one releases them. Advice only: a failure
  // leaves the pages resident, which is what happened before.
  if (end > begin) ::madvise(reinterpret_cast<void*>(begin), end - begin, MADV_DONTNEED);
}

namespace {

class GgufModelSource final : public ModelSource {
 public:
  GgufModelSource(const GgufFile& file, ModelConfig config)
      : file_(file), config_(std::move(config)), fingerprint_(model_fingerprint(config_, file)) {}

  const ModelConfig& config() const override { return config_; }
  const std::string& fingerprint() const override { return fingerprint_; }
  std::optional<SourceTensor> tensor(std::string_view name) const override {
    const GgufTensorInfo* t = file_.tensor(name);
    if (t == nullptr) return std::nullopt;
    return SourceTensor{t->type, t->dims, file_.tensor_data(*t)};
  }
  void release(std::string_view name) const override {
    const GgufTensorInfo* t = file_.tensor(name);
    if (t != nullptr && file_.mapped()) release_mapped_pages(file_.tensor_data(*t));
  }

 private:
  const GgufFile& file_;
  ModelConfig config_;
  std::string fingerprint_;
};

}  // namespace

Result<std::unique_ptr<ModelSource>> gguf_model_source(const GgufFile& file) {
  BATON_ASSIGN_OR_RETURN(ModelConfig config, model_config_from_gguf(file));
  return std::unique_ptr<ModelSource>(new GgufModelSource(file, std::move(config)));
}

}  // namespace baton
