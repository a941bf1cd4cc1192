#include "model/output_constraints.h"

#include "grammar/json_schema.h"
#include "model/tokenizer.h"

namespace baton {
namespace {

Result<grammar::Grammar> compile(const OutputFormat& format) {
  if (format.kind == OutputFormat::Kind::kJsonObject) return grammar::json_object_grammar();
  return grammar::compile_json_schema(format.schema, format.prefix, format.suffix);
}

}  // namespace

Status validate_output_format(const OutputFormat& format) {
  if (format.kind == OutputFormat::Kind::kText) return {};
  return compile(format).status();
}

OutputConstraints::OutputConstraints(const Tokenizer& tokenizer, int32_t n_vocab) {
  std::vector<std::string> bytes(static_cast<size_t>(std::max(n_vocab, tokenizer.n_vocab())));
  for (int32_t id = 0; id < tokenizer.n_vocab(); ++id) {
    const TokenType t = tokenizer.type(id);
    if (t == TokenType::kControl || t == TokenType::kUnknown || t == TokenType::kUnused) continue;
    bytes[static_cast<size_t>(id)] = tokenizer.token_bytes(id);
  }
  vocabulary_ = grammar::TokenVocabulary::create(std::move(bytes), tokenizer.stop_ids());
}

Status OutputConstraints::resolve(SamplingParams* params) {
  params->constraint.reset();
  if (params->format.kind == OutputFormat::Kind::kText) return {};
  const OutputFormat& f = params->format;
  // Lengths first: the parts cannot run into one another.
  const std::string key = std::to_string(static_cast<int>(f.kind)) + ":" + std::to_string(f.prefix.size()) + ":" +
                          std::to_string(f.suffix.size()) + ":" + f.prefix + f.suffix + f.schema;
  {
    std::lock_guard lock(mu_);
    for (auto it = cached_.begin(); it != cached_.end(); ++it) {
      if (it->first == key) {
        cached_.splice(cached_.begin(), cached_, it);
        params->constraint = it->second;
        return {};
      }
    }
  }
  // Compiled outside the lock: a large schema does not hold up requests whose schema is kept.
  BATON_ASSIGN_OR_RETURN(grammar::Grammar g, compile(params->format));
  auto constraint = std::make_shared<grammar::TokenConstraint>(std::move(g), vocabulary_);
  std::lock_guard lock(mu_);
  cached_.emplace_front(key, constraint);
  if (cached_.size() > kCached) cached_.pop_back();
  params->constraint = std::move(constraint);
  return {};
}

Status resolve_format(OutputConstraints* constraints, const std::string& worker, SamplingParams* params) {
  if (params->format.kind == OutputFormat::Kind::kText) return {};
  if (constraints == nullptr) {
    return failed_precondition(worker + " has no vocabulary for structured output (response_format); send the request to "
                               "a worker started with its model's tokenizer");
  }
  return constraints->resolve(params);
}

}  // namespace baton
