#include "grammar/json_schema.h"

#include "common/json_bounds.h"
#include "common/json_parse.h"

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <map>
#include <nlohmann/json.hpp>
#include <set>
#include <string>
#include <utility>
#include <vector>

namespace baton::grammar {
namespace {

// ordered_json keeps an object's keys in the order the text has them: properties are generated
// in the schema's order.
using json = nlohmann::ordered_json;
using Seq = GrammarBuilder::Seq;

const std::set<std::string, std::less<>>& annotations() {
  static const std::set<std::string, std::less<>> k{"title",    "description", "default",  "examples", "$schema",
                                                    "$id",      "$comment",    "readOnly", "writeOnly", "deprecated",
                                                    "$defs",    "definitions"};
  return k;
}

const std::set<std::string, std::less<>>& compiled_keywords() {
  static const std::set<std::string, std::less<>> k{"type",     "properties", "required",  "additionalProperties",
                                                    "items",    "minItems",   "maxItems",  "minLength",
                                                    "maxLength", "enum",      "const",     "anyOf",
                                                    "$ref"};
  return k;
}

// The escaped form of one JSON Pointer reference token.
std::string pointer_token(const std::string& key) {
  std::string out;
  for (char c : key) {
    if (c == '~') out += "~0";
    else if (c == '/') out += "~1";
    else out += c;
  }
  return out;
}

class SchemaCompiler {
 public:
  SchemaCompiler(const json* root, const SchemaBudget& budget)
      : root_(root), budget_(budget), start_(std::chrono::steady_clock::now()) {}

  // The shared pieces of JSON's own grammar.
  int32_t ws() {
    if (ws_ < 0) {
      ByteSet blank;
      blank.set(' ');
      blank.set('\t');
      const int32_t indent = b_.repeat("indent", {b_.bytes(blank)}, 0, 24);
      ws_ = b_.rule("ws", {{}, b_.lit(" "), {b_.byte('\n'), b_.ref(indent)}});
    }
    return ws_;
  }

  int32_t string_char() {
    if (char_ >= 0) return char_;
    ByteSet plain = byte_range(0x20, 0x7f);
    plain.reset('"');
    plain.reset('\\');
    const Element cont = b_.bytes(byte_range(0x80, 0xbf));
    ByteSet hex = byte_range('0', '9') | byte_range('a', 'f') | byte_range('A', 'F');
    ByteSet simple;
    for (char c : std::string("\"\\/bfnrt")) simple.set(static_cast<uint8_t>(c));
    ByteSet e1 = byte_range(0xe1, 0xec);
    e1.set(0xee);
    e1.set(0xef);
    const Element h = b_.bytes(hex);
    char_ = b_.rule("char", {
                                {b_.bytes(plain)},
                                {b_.bytes(byte_range(0xc2, 0xdf)), cont},
                                {b_.byte(0xe0), b_.bytes(byte_range(0xa0, 0xbf)), cont},
                                {b_.bytes(e1), cont, cont},
                                {b_.byte(0xed), b_.bytes(byte_range(0x80, 0x9f)), cont},
                                {b_.byte(0xf0), b_.bytes(byte_range(0x90, 0xbf)), cont, cont},
                                {b_.bytes(byte_range(0xf1, 0xf3)), cont, cont, cont},
                                {b_.byte(0xf4), b_.bytes(byte_range(0x80, 0x8f)), cont, cont},
                                {b_.byte('\\'), b_.bytes(simple)},
                                {b_.byte('\\'), b_.byte('u'), h, h, h, h},
                            });
    return char_;
  }

  int32_t string(int min, int max) {
    auto key = std::make_pair(min, max);
    if (auto it = strings_.find(key); it != strings_.end()) return it->second;
    const int32_t chars = b_.repeat("chars", {b_.ref(string_char())}, min, max);
    const int32_t r = b_.rule("string", {{b_.byte('"'), b_.ref(chars), b_.byte('"')}});
    strings_.emplace(key, r);
    return r;
  }

  int32_t integer() {
    if (integer_ >= 0) return integer_;
    const Element digit = b_.bytes(byte_range('0', '9'));
    const int32_t more = b_.repeat("digits", {digit}, 0, 15);
    const int32_t minus = b_.optional("minus", b_.lit("-"));
    integer_ = b_.rule("integer", {{b_.ref(minus), b_.byte('0')},
                                   {b_.ref(minus), b_.bytes(byte_range('1', '9')), b_.ref(more)}});
    return integer_;
  }

  int32_t number() {
    if (number_ >= 0) return number_;
    const Element digit = b_.bytes(byte_range('0', '9'));
    const int32_t frac_digits = b_.repeat("fraction", {digit}, 1, 16);
    const int32_t frac = b_.optional("frac", {b_.byte('.'), b_.ref(frac_digits)});
    ByteSet e;
    e.set('e');
    e.set('E');
    ByteSet sign;
    sign.set('-');
    sign.set('+');
    const int32_t exp_sign = b_.optional("exp_sign", {b_.bytes(sign)});
    const int32_t exp_digits = b_.repeat("exp_digits", {digit}, 1, 2);
    const int32_t exp = b_.optional("exp", {b_.bytes(e), b_.ref(exp_sign), b_.ref(exp_digits)});
    number_ = b_.rule("number", {{b_.ref(integer()), b_.ref(frac), b_.ref(exp)}});
    return number_;
  }

  int32_t literal(const json& value) { return b_.rule("literal", {b_.lit(value.dump())}); }

  // An object of `value` members under any keys (value < 0: any JSON value).
  int32_t map_object(int32_t value) {
    const int32_t member = b_.rule("member", {{b_.ref(string(0, -1)), b_.ref(ws()), b_.byte(':'), b_.ref(ws()),
                                               b_.ref(value), b_.ref(ws())}});
    const int32_t more = b_.star("members", {b_.byte(','), b_.ref(ws()), b_.ref(member)});
    return b_.rule("object", {{b_.byte('{'), b_.ref(ws()), b_.byte('}')},
                              {b_.byte('{'), b_.ref(ws()), b_.ref(member), b_.ref(more), b_.byte('}')}});
  }

  // `[` items `]` with min..max items (max < 0: any number).
  int32_t array(int32_t item, int min, int max) {
    const Seq one{b_.ref(item), b_.ref(ws())};
    std::vector<Seq> alts;
    if (min == 0) alts.push_back({b_.byte('['), b_.ref(ws()), b_.byte(']')});
    if (max != 0) {
      Seq more{b_.byte(','), b_.ref(ws()), b_.ref(item), b_.ref(ws())};
      const int32_t rest = b_.repeat("items", more, std::max(min - 1, 0), max < 0 ? -1 : max - 1);
      alts.push_back({b_.byte('['), b_.ref(ws()), b_.ref(item), b_.ref(ws()), b_.ref(rest), b_.byte(']')});
    }
    return b_.rule("array", std::move(alts));
  }

  // Any JSON value (recursive through objects and arrays).
  int32_t any_value() {
    if (any_ >= 0) return any_;
    any_ = b_.declare("value");
    const int32_t obj = map_object(any_);
    const int32_t arr = array(any_, 0, -1);
    for (int32_t r : {obj, arr, string(0, -1), number()}) b_.add_alt(any_, {b_.ref(r)});
    for (const char* word : {"true", "false", "null"}) b_.add_alt(any_, b_.lit(word));
    return any_;
  }

  // `depth`: the subschemas and $refs this one is inside.
  Result<int32_t> compile(const json& s, const std::string& path, int depth) {
    if (depth > budget_.max_depth) {
      return invalid_argument("the schema nests deeper than " + std::to_string(budget_.max_depth) + " levels at " +
                              where(path) + " (each subschema, and each $ref followed, is a level)");
    }
    BATON_RETURN_IF_ERROR(within_budget(path));
    deepest_ = std::max(deepest_, depth);
    if (s.is_boolean()) {
      if (s.get<bool>()) return any_value();
      return invalid_argument("the schema at " + where(path) + " is false: no value validates against it");
    }
    if (!s.is_object()) return invalid_argument("the schema at " + where(path) + " must be an object or a boolean");
    for (const auto& [key, _] : s.items()) {
      if (!compiled_keywords().contains(key) && !annotations().contains(key)) {
        return invalid_argument("JSON-schema keyword " + quote_input(key) + " (at " + where(path) +
                                ") is not supported for structured output; supported: type, properties, required, "
                                "additionalProperties, items, minItems, maxItems, minLength, maxLength, enum, const, "
                                "anyOf, $ref, $defs");
      }
    }
    auto only = [&](const char* keyword) -> Status {
      for (const auto& [key, _] : s.items()) {
        if (key != keyword && compiled_keywords().contains(key)) {
          return invalid_argument("'" + key + "' beside '" + keyword + "' (at " + where(path) +
                                  ") is not supported: put it inside each alternative");
        }
      }
      return {};
    };
    if (s.contains("$ref")) {
      BATON_RETURN_IF_ERROR(only("$ref"));
      return reference(s["$ref"], path + "/$ref", depth);
    }
    if (s.contains("anyOf")) {
      BATON_RETURN_IF_ERROR(only("anyOf"));
      const json& alts = s["anyOf"];
      if (!alts.is_array() || alts.empty()) return invalid_argument("'anyOf' at " + where(path) + " must be a non-empty array");
      const int32_t r = b_.declare("anyOf");
      for (size_t i = 0; i < alts.size(); ++i) {
        BATON_ASSIGN_OR_RETURN(int32_t alt, compile(alts[i], path + "/anyOf/" + std::to_string(i), depth + 1));
        b_.add_alt(r, {b_.ref(alt)});
      }
      return r;
    }
    if (s.contains("const")) {
      const int32_t r = literal(s["const"]);
      BATON_RETURN_IF_ERROR(within_budget(path + "/const"));
      return r;
    }
    if (s.contains("enum")) {
      const json& values = s["enum"];
      if (!values.is_array() || values.empty()) return invalid_argument("'enum' at " + where(path) + " must be a non-empty array");
      // The literals' elements are counted before any is built: a huge enum is refused for its
      // size at once, not after its literals have used up the time bound (which way it went
      // would then depend on the machine's speed).
      std::vector<std::string> literals;
      literals.reserve(values.size());
      int64_t elements = 0;
      for (const json& v : values) {
        literals.push_back(v.dump());
        elements += static_cast<int64_t>(literals.back().size()) + 1;  // GrammarBuilder::add_alt's count
      }
      BATON_RETURN_IF_ERROR(within_budget(path + "/enum", elements));
      const int32_t r = b_.declare("enum");
      for (const std::string& lit : literals) {
        b_.add_alt(r, b_.lit(lit));
        BATON_RETURN_IF_ERROR(within_budget(path + "/enum"));
      }
      return r;
    }
    std::vector<std::string> types;
    if (s.contains("type")) {
      const json& t = s["type"];
      if (t.is_string()) {
        types.push_back(t.get<std::string>());
      } else if (t.is_array() && !t.empty()) {
        for (const json& x : t) {
          if (!x.is_string()) return invalid_argument("'type' at " + where(path) + " must be a name or a list of names");
          types.push_back(x.get<std::string>());
        }
      } else {
        return invalid_argument("'type' at " + where(path) + " must be a name or a list of names");
      }
    } else if (s.contains("properties") || s.contains("additionalProperties")) {
      types.push_back("object");
    } else if (s.contains("items") || s.contains("minItems") || s.contains("maxItems")) {
      types.push_back("array");
    } else if (s.contains("minLength") || s.contains("maxLength")) {
      types.push_back("string");
    } else {
      return any_value();
    }
    if (types.size() == 1) return typed(s, types[0], path, depth);
    const int32_t r = b_.declare("types");
    for (const std::string& t : types) {
      BATON_ASSIGN_OR_RETURN(int32_t alt, typed(s, t, path, depth));
      b_.add_alt(r, {b_.ref(alt)});
    }
    return r;
  }

  GrammarBuilder& builder() { return b_; }
  SchemaStats stats() const {
    return {deepest_, b_.n_elements(), b_.n_rules(),
            std::chrono::duration<double>(std::chrono::steady_clock::now() - start_).count()};
  }

  // The budget's size and time bounds, checked after each piece of grammar is added (or before
  // adding `more_elements`).
  Status within_budget(const std::string& path, int64_t more_elements = 0) const {
    auto over = [&](const std::string& what) {
      return invalid_argument("the schema is too large for structured output: its grammar passed " + what +
                              " at " + where(path));
    };
    if (b_.n_elements() + more_elements > budget_.max_elements) {
      return over(std::to_string(budget_.max_elements) + " elements");
    }
    if (b_.n_rules() > budget_.max_rules) return over(std::to_string(budget_.max_rules) + " rules");
    if (std::chrono::duration<double>(std::chrono::steady_clock::now() - start_).count() > budget_.max_seconds) {
      char seconds[32];
      std::snprintf(seconds, sizeof seconds, "%g s", budget_.max_seconds);
      return over(std::string(seconds) + " of compile time");
    }
    return {};
  }

 private:
  // A location for a message: a long one (property names are the client's, of any length) keeps
  // its two ends, cut between UTF-8 characters, so that a refusal stays small enough to travel
  // as a status.
  static std::string where(const std::string& path) {
    if (path.empty()) return "the schema's root";
    if (path.size() <= 160) return path;
    auto boundary = [&](size_t i) {
      while (i > 0 && i < path.size() && (static_cast<unsigned char>(path[i]) & 0xC0) == 0x80) --i;
      return i;
    };
    const size_t head = boundary(60), tail = boundary(path.size() - 60);
    return path.substr(0, head) + "..." + path.substr(tail) + " (a " + std::to_string(path.size()) + "-byte path)";
  }

  Result<int> count(const json& s, const char* key, const std::string& path, int fallback) {
    if (!s.contains(key)) return fallback;
    const json& v = s[key];
    if (!v.is_number_integer() || v.get<int64_t>() < 0) {
      return invalid_argument("'" + std::string(key) + "' at " + where(path) + " must be an integer >= 0");
    }
    if (v.get<int64_t>() > kMaxCountedLimit) {
      return invalid_argument("'" + std::string(key) + "' at " + where(path) + " is " + v.dump() +
                              "; structured output supports at most " + std::to_string(kMaxCountedLimit));
    }
    return static_cast<int>(v.get<int64_t>());
  }

  Result<int32_t> typed(const json& s, const std::string& type, const std::string& path, int depth) {
    if (type == "string") {
      BATON_ASSIGN_OR_RETURN(int min, count(s, "minLength", path, 0));
      BATON_ASSIGN_OR_RETURN(int max, count(s, "maxLength", path, -1));
      if (max >= 0 && max < min) return invalid_argument("'maxLength' < 'minLength' at " + where(path));
      return string(min, max);
    }
    if (type == "integer") return integer();
    if (type == "number") return number();
    if (type == "boolean") return b_.rule("boolean", {b_.lit("true"), b_.lit("false")});
    if (type == "null") return b_.rule("null", {b_.lit("null")});
    if (type == "array") {
      BATON_ASSIGN_OR_RETURN(int min, count(s, "minItems", path, 0));
      BATON_ASSIGN_OR_RETURN(int max, count(s, "maxItems", path, -1));
      if (max >= 0 && max < min) return invalid_argument("'maxItems' < 'minItems' at " + where(path));
      int32_t item = -1;
      if (s.contains("items")) {
        if (s["items"].is_array()) {
          return invalid_argument("'items' at " + where(path) + " is a list (tuple validation), which is not supported");
        }
        BATON_ASSIGN_OR_RETURN(item, compile(s["items"], path + "/items", depth + 1));
      } else {
        item = any_value();
      }
      return array(item, min, max);
    }
    if (type == "object") return object(s, path, depth);
    return invalid_argument("'type' at " + where(path) + " is " + quote_input(type) +
                            "; expected object, array, string, number, integer, boolean or null");
  }

  Result<int32_t> object(const json& s, const std::string& path, int depth) {
    const json* extra = s.contains("additionalProperties") ? &s["additionalProperties"] : nullptr;
    if (extra != nullptr && !extra->is_boolean() && !extra->is_object()) {
      return invalid_argument("'additionalProperties' at " + where(path) + " must be a boolean or a schema");
    }
    if (!s.contains("properties")) {
      if (s.contains("required") && !s["required"].empty()) {
        return invalid_argument("'required' at " + where(path) + " names properties the schema does not declare");
      }
      if (extra != nullptr && extra->is_boolean() && !extra->get<bool>()) {
        return b_.rule("empty_object", {{b_.byte('{'), b_.ref(ws()), b_.byte('}')}});
      }
      if (extra != nullptr && extra->is_object()) {
        BATON_ASSIGN_OR_RETURN(int32_t value, compile(*extra, path + "/additionalProperties", depth + 1));
        return map_object(value);
      }
      return map_object(any_value());
    }
    const json& props = s["properties"];
    if (!props.is_object()) return invalid_argument("'properties' at " + where(path) + " must be an object");
    std::set<std::string> required;
    if (s.contains("required")) {
      const json& req = s["required"];
      if (!req.is_array()) return invalid_argument("'required' at " + where(path) + " must be a list of names");
      for (const json& name : req) {
        if (!name.is_string() || !props.contains(name.get<std::string>())) {
          return invalid_argument("'required' at " + where(path) + " names " + quote_input(name.dump()) +
                                  ", which is not in 'properties' (undeclared properties are not generated)");
        }
        required.insert(name.get<std::string>());
      }
    }
    // Members in declaration order (ordered_json keeps it).
    std::vector<std::string> names;
    std::vector<int32_t> members;
    for (const auto& [name, sub] : props.items()) {
      BATON_ASSIGN_OR_RETURN(int32_t value, compile(sub, path + "/properties/" + pointer_token(name), depth + 1));
      Seq kv = b_.lit(json(name).dump());
      kv.insert(kv.end(), {b_.ref(ws()), b_.byte(':'), b_.ref(ws()), b_.ref(value), b_.ref(ws())});
      names.push_back(name);
      members.push_back(b_.rule("member_" + name, {kv}));
    }
    // Two chains of rules, linear in the number of properties: first[i] when no member has been
    // written yet, next[i] after one has (so a comma comes first), each either writing member i
    // or, when it is optional, passing to i + 1. (Listing at each point every later member that
    // may come next was quadratic: 20,000 optional properties made 200 million alternatives.)
    const auto n = static_cast<int32_t>(names.size());
    const int32_t first0 = b_.n_rules();
    for (int32_t i = 0; i <= n; ++i) b_.declare("first_" + std::to_string(i));
    const int32_t next0 = b_.n_rules();
    for (int32_t i = 0; i <= n; ++i) b_.declare("next_" + std::to_string(i));
    for (int32_t i = 0; i < n; ++i) {
      const bool optional = !required.contains(names[static_cast<size_t>(i)]);
      const int32_t member = members[static_cast<size_t>(i)];
      b_.add_alt(first0 + i, {b_.ref(member), b_.ref(next0 + i + 1)});
      b_.add_alt(next0 + i, {b_.byte(','), b_.ref(ws()), b_.ref(member), b_.ref(next0 + i + 1)});
      if (optional) {
        b_.add_alt(first0 + i, {b_.ref(first0 + i + 1)});
        b_.add_alt(next0 + i, {b_.ref(next0 + i + 1)});
      }
    }
    b_.add_alt(first0 + n, {});
    b_.add_alt(next0 + n, {});
    BATON_RETURN_IF_ERROR(within_budget(path + "/properties"));
    return b_.rule("object", {{b_.byte('{'), b_.ref(ws()), b_.ref(first0), b_.byte('}')}});
  }

  Result<int32_t> reference(const json& ref, const std::string& path, int depth) {
    if (!ref.is_string()) return invalid_argument("'$ref' at " + where(path) + " must be a string");
    const std::string target = ref.get<std::string>();
    if (auto it = refs_.find(target); it != refs_.end()) return it->second;
    if (target.empty() || target[0] != '#') {
      return invalid_argument("'$ref' " + quote_input(target) + " at " + where(path) +
                              " points outside the schema; only references within it (\"#/$defs/...\") are supported");
    }
    const json* node = root_;
    try {
      node = &root_->at(json::json_pointer(target.substr(1)));
    } catch (const json::exception&) {
      return invalid_argument("'$ref' " + quote_input(target) + " at " + where(path) + " points to nothing in the schema");
    }
    // Declared before it is compiled, so that a schema may refer to itself.
    const int32_t r = b_.declare("ref " + target);
    refs_.emplace(target, r);
    BATON_ASSIGN_OR_RETURN(int32_t body, compile(*node, target.substr(1), depth + 1));
    b_.add_alt(r, {b_.ref(body)});
    return r;
  }

  const json* root_;
  const SchemaBudget budget_;
  const std::chrono::steady_clock::time_point start_;
  int deepest_ = 0;
  GrammarBuilder b_;
  int32_t ws_ = -1, char_ = -1, integer_ = -1, number_ = -1, any_ = -1;
  std::map<std::pair<int, int>, int32_t> strings_;
  std::map<std::string, int32_t> refs_;
};

Grammar document(SchemaCompiler& c, int32_t value, std::string_view prefix = {}, std::string_view suffix = {}) {
  GrammarBuilder& b = c.builder();
  GrammarBuilder::Seq seq = b.lit(prefix);
  for (const Element& e : {b.ref(c.ws()), b.ref(value), b.ref(c.ws())}) seq.push_back(e);
  for (const Element& e : b.lit(suffix)) seq.push_back(e);
  const int32_t root = b.rule("root", {seq});
  return std::move(b).build(root);
}

}  // namespace

Result<Grammar> compile_json_schema(std::string_view schema, std::string_view prefix, std::string_view suffix,
                                    const SchemaBudget& budget, SchemaStats* stats) {
  // Deeper JSON is refused before anything walks it (this compiler, dump() and == recurse).
  BATON_RETURN_IF_ERROR(check_json_bounds(schema, "the JSON schema"));
  json root;
  if (!parse_ordered_json(schema, &root)) return invalid_argument("the JSON schema is not valid JSON");
  SchemaCompiler c(&root, budget);
  auto value = c.compile(root, "", 0);
  if (stats != nullptr) *stats = c.stats();
  BATON_RETURN_IF_ERROR(value.status());
  Grammar g = document(c, *value, prefix, suffix);
  if (stats != nullptr) *stats = c.stats();
  BATON_RETURN_IF_ERROR(c.within_budget("the prefix and suffix"));
  if (!g.productive(g.root)) {
    return invalid_argument("the JSON schema admits no finite value (a $ref that leads back to itself before any value?)");
  }
  return g;
}

Grammar json_object_grammar() {
  const json root = json::object();
  SchemaCompiler c(&root, SchemaBudget{});
  auto value = c.compile(json{{"type", "object"}}, "", 0);
  return document(c, *value);
}

}  // namespace baton::grammar
