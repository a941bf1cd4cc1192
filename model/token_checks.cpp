#include "model/token_checks.h"

#include <string>

namespace baton {

Status check_token_id(int32_t id, const ModelConfig& model, std::string_view name) {
  if (id >= 0 && id < model.n_vocab) return {};
  return invalid_argument(std::string(name) + " = " + std::to_string(id) + " is outside the vocabulary [0, " +
                          std::to_string(model.n_vocab) + ")");
}

Status check_token_ids(std::span<const int32_t> ids, const ModelConfig& model, std::string_view name) {
  for (size_t i = 0; i < ids.size(); ++i) {
    // The name is built only for the id that fails: the loop runs over every prompt token.
    if (ids[i] < 0 || ids[i] >= model.n_vocab) {
      return check_token_id(ids[i], model, std::string(name) + "[" + std::to_string(i) + "]");
    }
  }
  return {};
}

Status check_context(int64_t n_positions, const ModelConfig& model, std::string_view what) {
  if (n_positions <= model.n_ctx) return {};
  return invalid_argument(std::string(what) + ": " + std::to_string(n_positions) +
                          " tokens, more than the model's context of " + std::to_string(model.n_ctx));
}

}  // namespace baton
