// Random schemas from the structured-output subset, random instances of them, and a validator
// for the subset written from the JSON Schema specification (independent of grammar/): the
// grammar's tests compare against these.
#pragma once

#include <nlohmann/json.hpp>
#include <memory>
#include <random>
#include <set>
#include <string>
#include <string_view>
#include <vector>

#include "grammar/token_constraint.h"

namespace baton::grammar::testing {

using ojson = nlohmann::ordered_json;

// One token per byte (256: the stop token): a constraint over it accepts exactly the grammar's
// byte strings.
inline std::shared_ptr<const TokenVocabulary> byte_vocabulary() {
  std::vector<std::string> bytes;
  for (int b = 0; b < 256; ++b) bytes.emplace_back(1, static_cast<char>(b));
  bytes.emplace_back();
  return TokenVocabulary::create(std::move(bytes), {256});
}

inline bool accepts(TokenConstraint& c, std::string_view text) { return c.complete(c.advance_bytes(c.start(), text)); }

inline ojson random_schema(std::mt19937& rng, int depth, ojson* defs) {
  auto pick = [&](int n) { return static_cast<int>(rng() % static_cast<unsigned>(n)); };
  const int kinds = depth <= 0 ? 7 : 11;
  switch (pick(kinds)) {
    case 0: {
      ojson s{{"type", "string"}, {"maxLength", pick(8)}};
      if (pick(3) == 0) s["minLength"] = pick(std::max(1, s["maxLength"].get<int>()));
      return s;
    }
    case 1: return {{"type", "integer"}};
    case 2: return {{"type", "number"}};
    case 3: return {{"type", "boolean"}};
    case 4: return {{"type", "null"}};
    case 5: {
      ojson values = ojson::array();
      const int n = 1 + pick(4);
      for (int i = 0; i < n; ++i) values.push_back(pick(2) ? ojson("v" + std::to_string(pick(100))) : ojson(pick(1000) - 500));
      return {{"enum", values}};
    }
    case 6: return pick(2) ? ojson{{"const", "c\"" + std::to_string(pick(10))}} : ojson{{"type", ojson::array({"string", "null"})}, {"maxLength", 4}};
    case 7: {
      ojson props = ojson::object();
      ojson required = ojson::array();
      const int n = 1 + pick(4);
      for (int i = 0; i < n; ++i) {
        const std::string name = "p" + std::to_string(i) + (pick(4) == 0 ? "é" : "");
        props[name] = random_schema(rng, depth - 1, defs);
        if (pick(2)) required.push_back(name);
      }
      return {{"type", "object"}, {"properties", props}, {"required", required}, {"additionalProperties", false}};
    }
    case 8: {
      ojson s{{"type", "array"}, {"items", random_schema(rng, depth - 1, defs)}, {"maxItems", 1 + pick(3)}};
      if (pick(2)) s["minItems"] = pick(2);
      return s;
    }
    case 9: return {{"anyOf", ojson::array({random_schema(rng, depth - 1, defs), random_schema(rng, depth - 1, defs)})}};
    default: {
      const std::string name = "d" + std::to_string(defs->size());
      (*defs)[name] = nullptr;  // taken before the body, which may add definitions of its own
      (*defs)[name] = random_schema(rng, depth - 1, defs);
      return {{"$ref", "#/$defs/" + name}};
    }
  }
}

// A schema with its $defs at the root.
inline ojson random_document_schema(std::mt19937& rng, int depth) {
  ojson defs = ojson::object();
  ojson s = random_schema(rng, depth, &defs);
  if (!defs.empty()) {
    if (s.contains("$ref")) s = {{"anyOf", ojson::array({s})}};  // $ref has no siblings
    s["$defs"] = defs;
  }
  return s;
}

inline const ojson& resolve(const ojson& root, const ojson& s) {
  const ojson* at = &s;
  while (at->is_object() && at->contains("$ref")) at = &root.at(ojson::json_pointer((*at)["$ref"].get<std::string>().substr(1)));
  return *at;
}

inline size_t utf8_length(const std::string& s) {
  size_t n = 0;
  for (unsigned char c : s) n += (c & 0xc0) != 0x80;
  return n;
}

// Whether `v` validates against `s` (the subset's keywords, as JSON Schema defines them).
inline bool validates(const ojson& root, const ojson& schema, const ojson& v) {
  const ojson& s = resolve(root, schema);
  if (s.is_boolean()) return s.get<bool>();
  if (s.contains("anyOf")) {
    for (const ojson& alt : s["anyOf"]) {
      if (validates(root, alt, v)) return true;
    }
    return false;
  }
  if (s.contains("const") && v != s["const"]) return false;
  if (s.contains("enum")) {
    bool found = false;
    for (const ojson& e : s["enum"]) found = found || e == v;
    if (!found) return false;
  }
  if (s.contains("type")) {
    std::set<std::string> types;
    if (s["type"].is_string()) types.insert(s["type"].get<std::string>());
    else for (const ojson& t : s["type"]) types.insert(t.get<std::string>());
    const bool integral = v.is_number_integer() || (v.is_number_float() && v.get<double>() == static_cast<double>(static_cast<int64_t>(v.get<double>())));
    const bool ok = (types.contains("string") && v.is_string()) || (types.contains("number") && v.is_number()) ||
                    (types.contains("integer") && v.is_number() && integral) || (types.contains("boolean") && v.is_boolean()) ||
                    (types.contains("null") && v.is_null()) || (types.contains("object") && v.is_object()) ||
                    (types.contains("array") && v.is_array());
    if (!ok) return false;
  }
  if (v.is_string()) {
    const size_t n = utf8_length(v.get<std::string>());
    if (s.contains("maxLength") && n > s["maxLength"].get<size_t>()) return false;
    if (s.contains("minLength") && n < s["minLength"].get<size_t>()) return false;
  }
  if (v.is_array()) {
    if (s.contains("maxItems") && v.size() > s["maxItems"].get<size_t>()) return false;
    if (s.contains("minItems") && v.size() < s["minItems"].get<size_t>()) return false;
    if (s.contains("items")) {
      for (const ojson& x : v) {
        if (!validates(root, s["items"], x)) return false;
      }
    }
  }
  if (v.is_object()) {
    if (s.contains("required")) {
      for (const ojson& r : s["required"]) {
        if (!v.contains(r.get<std::string>())) return false;
      }
    }
    for (const auto& [k, x] : v.items()) {
      if (s.contains("properties") && s["properties"].contains(k)) {
        if (!validates(root, s["properties"][k], x)) return false;
      } else if (s.contains("additionalProperties") && s["additionalProperties"] == false) {
        return false;
      }
    }
  }
  return true;
}

// Whitespace the grammar allows between tokens.
inline std::string random_ws(std::mt19937& rng) {
  switch (rng() % 4) {
    case 0: return " ";
    case 1: return "\n" + std::string(rng() % 5, ' ');
    default: return "";
  }
}

// A random instance of `schema`, as text, with properties in schema order and random whitespace.
inline std::string random_instance(std::mt19937& rng, const ojson& root, const ojson& schema) {
  const ojson& s = resolve(root, schema);
  auto pick = [&](int n) { return static_cast<int>(rng() % static_cast<unsigned>(n)); };
  if (s.contains("anyOf")) return random_instance(rng, root, s["anyOf"][static_cast<size_t>(pick(static_cast<int>(s["anyOf"].size())))]);
  if (s.contains("const")) return s["const"].dump();
  if (s.contains("enum")) return s["enum"][static_cast<size_t>(pick(static_cast<int>(s["enum"].size())))].dump();
  std::string type = s["type"].is_string() ? s["type"].get<std::string>() : s["type"][static_cast<size_t>(pick(2))].get<std::string>();
  if (type == "string") {
    static const char* pieces[] = {"a", "Z", " ", "é", "\\n", "\\\"", "\\u00e9", "→", "😀", "7"};
    const int min = s.value("minLength", 0), max = s.value("maxLength", 6);
    std::string out = "\"";
    for (int i = 0, n = min + pick(max - min + 1); i < n; ++i) out += pieces[pick(10)];
    return out + "\"";
  }
  if (type == "integer") return std::to_string(pick(2000) - 1000);
  if (type == "number") {
    static const char* numbers[] = {"0", "-0.5", "12.25", "1e3", "-7E-2", "3.0", "123456789"};
    return numbers[pick(7)];
  }
  if (type == "boolean") return pick(2) ? "true" : "false";
  if (type == "null") return "null";
  if (type == "array") {
    const int min = s.value("minItems", 0), max = s.value("maxItems", 3);
    std::string out = "[" + random_ws(rng);
    for (int i = 0, n = min + pick(max - min + 1); i < n; ++i) {
      if (i > 0) out += "," + random_ws(rng);
      out += random_instance(rng, root, s["items"]) + random_ws(rng);
    }
    return out + "]";
  }
  std::set<std::string> required;
  for (const ojson& r : s.value("required", ojson::array())) required.insert(r.get<std::string>());
  std::string out = "{" + random_ws(rng);
  bool first = true;
  for (const auto& [k, sub] : s["properties"].items()) {
    if (!required.contains(k) && pick(2)) continue;
    if (!first) out += "," + random_ws(rng);
    first = false;
    out += ojson(k).dump() + random_ws(rng) + ":" + random_ws(rng) + random_instance(rng, root, sub) + random_ws(rng);
  }
  return out + "}";
}

}  // namespace baton::grammar::testing
