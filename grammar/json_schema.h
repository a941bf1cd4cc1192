// JSON Schema → grammar: the output formats of OpenAI's response_format.
//
// The subset compiled (anything else is refused, naming the keyword and where it is):
//   type (a name or a list of names), properties, required, additionalProperties (false, true or a
//   schema), items, minItems, maxItems, minLength, maxLength, enum, const, anyOf, $ref within the
//   document ("#", "#/$defs/...", "#/definitions/..."), $defs / definitions; annotations (title,
//   description, default, examples, $schema, $id, $comment, ...) are ignored.
//
// What the grammar generates, and why it is narrower than what the schema validates:
// - Properties come in the order the schema lists them (as OpenAI's structured outputs produce
//   them); optional ones may be left out, undeclared ones are not generated.
// - Whitespace between tokens is nothing, one space, or a newline and up to 24 spaces or tabs,
//   so that a sampled output cannot run on in blank space; numbers have at most 16 digits before
//   and after the point and 2 in the exponent (so that every number is a finite double).
// - Strings are valid UTF-8 with JSON's escapes; an \u escape counts as one character.
// Every sentence of the grammar parses as JSON and validates against the schema.
#pragma once

#include <string_view>

#include "common/status.h"
#include "grammar/grammar.h"

namespace baton::grammar {

// Counted limits above this (maxLength, maxItems) are refused: each count is a grammar rule.
inline constexpr int kMaxCountedLimit = 1024;

// What compiling one schema may cost. A schema comes with a request, so each bound is checked
// as the compile goes, and past one the schema is refused (INVALID_ARGUMENT naming the bound and
// where in the schema it was reached) instead of the compile running on. The frontend compiles a
// request's schema before anything else sees it, and each worker again with the same budget.
// The defaults are about 10x the largest of 430 real-world schemas measured (bench/RESULTS.md,
// "Schema budget": depth 28, 150,561 elements, 20,281 rules, 7.9 ms); the time bound is a
// backstop far above any of them, sized so that a refusal comes within the 2 s a client is owed.
// The schema's text is also bounded by common/json_bounds.h.
struct SchemaBudget {
  // Subschemas inside one another (properties, items, anyOf, additionalProperties), each $ref
  // followed counting one more: a chain of 4,500 $refs is 4,500 deep.
  int max_depth = 256;
  // The grammar's size: every literal byte and every reference is an element; a rule per
  // property, per enum, per counted repeat step.
  int64_t max_elements = 1'500'000;
  int32_t max_rules = 200'000;
  // Wall time, checked as it goes.
  double max_seconds = 1.0;
};

// What a compile took, against the budget's bounds (bench/schema_bench.cpp measures real schemas).
struct SchemaStats {
  int depth = 0;  // the deepest nesting reached, $refs followed included (the root is 0)
  int64_t elements = 0;
  int32_t rules = 0;
  double seconds = 0;
};

// A grammar for one JSON document (with optional whitespace around it) that validates against
// `schema` (JSON text). INVALID_ARGUMENT naming the keyword and its location for what the subset
// does not have, for malformed schemas, and for a schema over `budget`.
// `prefix` and `suffix`: literal text the document comes between (a tool call's tags).
Result<Grammar> compile_json_schema(std::string_view schema, std::string_view prefix = {}, std::string_view suffix = {},
                                    const SchemaBudget& budget = {}, SchemaStats* stats = nullptr);

// A grammar for any JSON object (response_format json_object).
Grammar json_object_grammar();

}  // namespace baton::grammar
