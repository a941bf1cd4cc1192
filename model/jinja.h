// A Jinja template engine for chat templates: the subset of Jinja2 that Hugging Face chat
// templates are written in, rendered as transformers renders them (see jinja_parser.h for the
// language and the lexer settings, jinja_value.h for the Python semantics).
//
// Why an engine and not a list of known formats: a model's template is code (Llama 2's and
// Mistral's refuse conversations whose roles do not alternate, Llama 3.1's writes the date into
// a system turn, Qwen2.5's adds a default system prompt), and models of one family ship variants.
// Rendering the template itself is what makes baton's prompt the one the model was trained on.
#pragma once

#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include "common/status.h"
#include "model/jinja_value.h"

namespace baton::jinja {

struct Node;

class Template {
 public:
  // INVALID_ARGUMENT (malformed) or UNIMPLEMENTED (a construct baton does not render), naming the
  // line and the construct.
  static Result<Template> parse(std::string_view source);

  // Renders with `globals` (a dict: messages, add_generation_prompt, bos_token, ...).
  // FAILED_PRECONDITION with the template's message when it calls raise_exception() (it refuses
  // the input); INVALID_ARGUMENT for any other error (an undefined value used, a type error).
  Result<std::string> render(const Value& globals) const;

 private:
  std::shared_ptr<const std::vector<std::unique_ptr<Node>>> body_;
};

}  // namespace baton::jinja
