#include "grammar/grammar.h"

#include <cstdio>
#include <utility>

#include "common/check.h"

namespace baton::grammar {

ByteSet byte_range(uint8_t lo, uint8_t hi) {
  ByteSet s;
  for (int b = lo; b <= hi; ++b) s.set(static_cast<size_t>(b));
  return s;
}

int32_t GrammarBuilder::declare(std::string name) {
  alts_.emplace_back();
  names_.push_back(std::move(name));
  return static_cast<int32_t>(alts_.size() - 1);
}

void GrammarBuilder::add_alt(int32_t rule, Seq alt) {
  BATON_CHECK(rule >= 0 && rule < n_rules(), "rule %d of %d", rule, n_rules());
  n_elements_ += static_cast<int64_t>(alt.size()) + 1;
  alts_[static_cast<size_t>(rule)].push_back(std::move(alt));
}

int32_t GrammarBuilder::rule(std::string name, std::vector<Seq> alts) {
  const int32_t r = declare(std::move(name));
  for (Seq& a : alts) add_alt(r, std::move(a));
  return r;
}

Element GrammarBuilder::bytes(const ByteSet& set) {
  for (size_t i = 0; i < sets_.size(); ++i) {
    if (sets_[i] == set) return {Element::Kind::kBytes, static_cast<int32_t>(i)};
  }
  sets_.push_back(set);
  return {Element::Kind::kBytes, static_cast<int32_t>(sets_.size() - 1)};
}

Element GrammarBuilder::byte(uint8_t b) {
  ByteSet s;
  s.set(b);
  return bytes(s);
}

GrammarBuilder::Seq GrammarBuilder::lit(std::string_view text) {
  Seq out;
  for (char c : text) out.push_back(byte(static_cast<uint8_t>(c)));
  return out;
}

int32_t GrammarBuilder::repeat(std::string name, const Seq& x, int min, int max) {
  BATON_CHECK(min >= 0 && (max < 0 || max >= min), "repeat {%d,%d}", min, max);
  // tail: what follows the `min` required copies (any number more, or up to max - min more).
  int32_t tail = -1;
  if (max < 0) {
    tail = declare(name + "*");
    Seq more = x;
    more.push_back(ref(tail));
    add_alt(tail, std::move(more));
    add_alt(tail, {});
  } else {
    // opt_j: up to j more copies; opt_0 matches nothing. Each copy is followed by the shorter tail,
    // so the chain never refers back to itself.
    int32_t shorter = -1;
    for (int j = 1; j <= max - min; ++j) {
      const int32_t opt = declare(name + "{0," + std::to_string(j) + "}");
      Seq more = x;
      if (shorter >= 0) more.push_back(ref(shorter));
      add_alt(opt, std::move(more));
      add_alt(opt, {});
      shorter = opt;
    }
    tail = shorter;
  }
  const int32_t r = declare(std::move(name));
  Seq body;
  for (int i = 0; i < min; ++i) body.insert(body.end(), x.begin(), x.end());
  if (tail >= 0) body.push_back(ref(tail));
  add_alt(r, std::move(body));
  return r;
}

Grammar GrammarBuilder::build(int32_t root) && {
  BATON_CHECK(root >= 0 && root < n_rules(), "root rule %d of %d", root, n_rules());
  Grammar g;
  g.root = root;
  g.byte_sets = std::move(sets_);
  g.rule_names = std::move(names_);
  g.rule_starts.resize(alts_.size());
  for (size_t r = 0; r < alts_.size(); ++r) {
    BATON_CHECK(!alts_[r].empty(), "rule %s has no alternative", g.rule_names[r].c_str());
    for (const Seq& alt : alts_[r]) {
      g.rule_starts[r].push_back(static_cast<int32_t>(g.elements.size()));
      for (const Element& e : alt) {
        BATON_CHECK(e.kind != Element::Kind::kRule || (e.arg >= 0 && e.arg < n_rules()), "reference to rule %d", e.arg);
        g.elements.push_back(e);
      }
      g.elements.push_back({Element::Kind::kEnd, 0});
    }
  }
  return g;
}

bool Grammar::productive(int32_t rule) const {
  // The least fixed point, by a worklist (linear in the grammar's size: a chain of n rules settles
  // in one pass, where sweeping every rule until nothing changes took n sweeps). An alternative is
  // productive once every rule it refers to is; a rule, once one alternative is.
  const size_t n_rules = rule_starts.size();
  std::vector<int32_t> alt_rule, pending;          // per alternative: its rule, unsettled references
  std::vector<std::vector<int32_t>> used_by(n_rules);  // per rule: the alternatives referring to it (once per mention)
  std::vector<char> ok(n_rules, 0);
  std::vector<int32_t> ready;  // rules found productive, not yet propagated
  for (size_t r = 0; r < n_rules; ++r) {
    for (int32_t p : rule_starts[r]) {
      const auto alt = static_cast<int32_t>(alt_rule.size());
      alt_rule.push_back(static_cast<int32_t>(r));
      int32_t refs = 0;
      for (; elements[static_cast<size_t>(p)].kind != Element::Kind::kEnd; ++p) {
        const Element& e = elements[static_cast<size_t>(p)];
        if (e.kind == Element::Kind::kRule) {
          used_by[static_cast<size_t>(e.arg)].push_back(alt);
          ++refs;
        }
      }
      pending.push_back(refs);
      if (refs == 0 && !ok[r]) {
        ok[r] = 1;
        ready.push_back(static_cast<int32_t>(r));
      }
    }
  }
  while (!ready.empty()) {
    const int32_t r = ready.back();
    ready.pop_back();
    for (int32_t alt : used_by[static_cast<size_t>(r)]) {
      const int32_t owner = alt_rule[static_cast<size_t>(alt)];
      if (--pending[static_cast<size_t>(alt)] == 0 && !ok[static_cast<size_t>(owner)]) {
        ok[static_cast<size_t>(owner)] = 1;
        ready.push_back(owner);
      }
    }
  }
  return ok[static_cast<size_t>(rule)] != 0;
}

namespace {

std::string set_to_string(const ByteSet& s) {
  auto show = [](int b) {
    if (b >= 0x21 && b < 0x7f && b != '\\' && b != ']' && b != '-' && b != '"') return std::string(1, static_cast<char>(b));
    char buf[8];
    std::snprintf(buf, sizeof buf, "\\x%02x", b);
    return std::string(buf);
  };
  if (s.count() == 1) {
    for (int b = 0; b < 256; ++b) {
      if (s.test(static_cast<size_t>(b))) return "\"" + show(b) + "\"";
    }
  }
  std::string out = "[";
  for (int b = 0; b < 256;) {
    if (!s.test(static_cast<size_t>(b))) {
      ++b;
      continue;
    }
    int e = b;
    while (e + 1 < 256 && s.test(static_cast<size_t>(e + 1))) ++e;
    out += show(b);
    if (e > b) out += "-" + show(e);
    b = e + 1;
  }
  return out + "]";
}

}  // namespace

std::string Grammar::to_string() const {
  std::string out;
  for (int32_t r = 0; r < n_rules(); ++r) {
    out += rule_names[static_cast<size_t>(r)] + " ::=";
    const auto& starts = rule_starts[static_cast<size_t>(r)];
    for (size_t a = 0; a < starts.size(); ++a) {
      if (a > 0) out += " |";
      for (int32_t p = starts[a]; elements[static_cast<size_t>(p)].kind != Element::Kind::kEnd; ++p) {
        const Element& e = elements[static_cast<size_t>(p)];
        out += " ";
        out += e.kind == Element::Kind::kRule ? rule_names[static_cast<size_t>(e.arg)]
                                              : set_to_string(byte_sets[static_cast<size_t>(e.arg)]);
      }
      if (elements[static_cast<size_t>(starts[a])].kind == Element::Kind::kEnd) out += " \"\"";
    }
    out += "\n";
  }
  return out;
}

}  // namespace baton::grammar
