#include "model/model_source.h"

namespace baton {
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
