// A context-free grammar over bytes: the form structured output is compiled to (json_schema.h)
// and matched against token by token (token_constraint.h).
//
// A rule is a list of alternatives; an alternative is a sequence of elements, each a byte set
// (matches one byte in the set) or a reference to a rule. Repetition is written with rules
// (GrammarBuilder::star and friends expand it). Rules must not be left-recursive, directly or
// through rules that can match nothing: the matcher expands a reference before it reads a byte.
// Grammars made by the builder's helpers never are.
#pragma once

#include <bitset>
#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

namespace baton::grammar {

using ByteSet = std::bitset<256>;

struct Element {
  enum class Kind : uint8_t { kBytes, kRule, kEnd };
  Kind kind = Kind::kEnd;
  int32_t arg = 0;  // kBytes: index into Grammar::byte_sets; kRule: the rule
};

// Immutable once built. The alternatives are flattened: `elements` holds every alternative's
// elements followed by a kEnd, and rule r's alternatives start at rule_starts[r][...]. A position
// in the grammar is an index into `elements`.
struct Grammar {
  std::vector<Element> elements;
  std::vector<std::vector<int32_t>> rule_starts;
  std::vector<ByteSet> byte_sets;
  int32_t root = 0;
  std::vector<std::string> rule_names;  // for messages and tests

  int32_t n_rules() const { return static_cast<int32_t>(rule_starts.size()); }
  // Whether rule r derives some finite byte string (false for r ::= r, or a cycle of such).
  bool productive(int32_t r) const;
  // A readable listing, one rule per line: `name ::= "ab" [0-9] other | ...`.
  std::string to_string() const;
};

// Builds a Grammar. Elements are made by bytes()/lit()/ref(); a Seq is an alternative.
class GrammarBuilder {
 public:
  using Seq = std::vector<Element>;

  // A new rule with no alternatives yet (so that rules may refer to each other before both exist).
  int32_t declare(std::string name);
  void add_alt(int32_t rule, Seq alt);
  // declare + add_alt for each alternative.
  int32_t rule(std::string name, std::vector<Seq> alts);

  Element bytes(const ByteSet& set);
  Element byte(uint8_t b);
  Element ref(int32_t rule) const { return {Element::Kind::kRule, rule}; }
  // The bytes of `text`, one element each.
  Seq lit(std::string_view text);

  // Rules matching `x` repeated: min..max times (max < 0: unbounded), by a chain of rules (no
  // left recursion). `x` must not match the empty string.
  int32_t repeat(std::string name, const Seq& x, int min, int max);
  int32_t star(std::string name, const Seq& x) { return repeat(std::move(name), x, 0, -1); }
  int32_t optional(std::string name, const Seq& x) { return repeat(std::move(name), x, 0, 1); }

  int32_t n_rules() const { return static_cast<int32_t>(alts_.size()); }
  // Elements added so far, each alternative's end included: the built grammar's size.
  int64_t n_elements() const { return n_elements_; }
  // The grammar, rooted at `root`. Every declared rule must have an alternative.
  Grammar build(int32_t root) &&;

 private:
  std::vector<std::vector<Seq>> alts_;
  std::vector<std::string> names_;
  std::vector<ByteSet> sets_;
  int64_t n_elements_ = 0;
};

// The bytes lo..hi inclusive.
ByteSet byte_range(uint8_t lo, uint8_t hi);

}  // namespace baton::grammar
