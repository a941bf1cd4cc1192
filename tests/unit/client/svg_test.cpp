// client/svg.h: escaping, numbers, nice ticks against a brute-force search, and documents from
// random element trees that must stay well-formed XML.
#include "client/svg.h"

#include <catch2/catch.hpp>
#include <cmath>
#include <random>
#include <string>

#include "tests/unit/client/xml_check.h"

namespace baton::ctl {
namespace {

std::string xml_unescape(const std::string& s) {
  std::string out;
  for (size_t i = 0; i < s.size();) {
    bool matched = false;
    for (auto [entity, c] :
         {std::pair{"&amp;", '&'}, {"&lt;", '<'}, {"&gt;", '>'}, {"&quot;", '"'}, {"&apos;", '\''}}) {
      const std::string e = entity;
      if (s.compare(i, e.size(), e) == 0) {
        out += c;
        i += e.size();
        matched = true;
        break;
      }
    }
    if (!matched) out += s[i++];
  }
  return out;
}

std::string random_text(std::mt19937_64& rng, size_t max_len) {
  static const std::string alphabet = "ab <>&\"' ;#x01\xc3\xa9";
  std::string s(std::uniform_int_distribution<size_t>(0, max_len)(rng), ' ');
  for (char& c : s) c = alphabet[std::uniform_int_distribution<size_t>(0, alphabet.size() - 1)(rng)];
  return s;
}

TEST_CASE("xml_escape leaves no markup character and round-trips") {
  CHECK(xml_escape("a<b>&\"'") == "a&lt;b&gt;&amp;&quot;&apos;");
  std::mt19937_64 rng(std::random_device{}());
  for (int trial = 0; trial < 500; ++trial) {
    const std::string s = random_text(rng, 40);
    const std::string e = xml_escape(s);
    CHECK(e.find_first_of("<>\"'") == std::string::npos);
    for (size_t i = 0; i < e.size(); ++i) {
      if (e[i] == '&') CHECK(baton::test::xml_entity_at(e, i));
    }
    CHECK(xml_unescape(e) == s);
  }
}

TEST_CASE("svg_number keeps two decimals at most, no trailing zeros, no negative zero") {
  CHECK(svg_number(12.5) == "12.5");
  CHECK(svg_number(3) == "3");
  CHECK(svg_number(-0.001) == "0");
  std::mt19937_64 rng(std::random_device{}());
  for (int trial = 0; trial < 2000; ++trial) {
    const double v = std::uniform_real_distribution<double>(-5000, 5000)(rng);
    const std::string s = svg_number(v);
    CHECK(std::abs(std::stod(s) - v) <= 0.005 + 1e-9);
    CHECK(s != "-0");
    const size_t dot = s.find('.');
    if (dot != std::string::npos) {
      CHECK(s.size() - dot - 1 <= 2);
      CHECK(s.back() != '0');
    }
  }
}

// The smallest 1/2/5 × 10^k step whose multiples cover [lo, hi] in at most max_ticks intervals.
double brute_force_step(double lo, double hi, int max_ticks) {
  for (int k = -12; k <= 12; ++k) {
    for (double m : {1.0, 2.0, 5.0}) {
      const double step = m * std::pow(10.0, k);
      const double first = std::floor(lo / step + 1e-9), last = std::ceil(hi / step - 1e-9);
      if (last - first <= max_ticks) return step;
    }
  }
  return 0;
}

TEST_CASE("nice_ticks: the smallest 1-2-5 step that covers the range in max_ticks intervals") {
  std::mt19937_64 rng(std::random_device{}());
  for (int trial = 0; trial < 3000; ++trial) {
    const double scale = std::pow(10.0, std::uniform_int_distribution<int>(-4, 6)(rng));
    double lo = std::uniform_real_distribution<double>(0, 1)(rng) < 0.5
                    ? 0
                    : std::uniform_real_distribution<double>(-1, 1)(rng) * scale;
    double hi = lo + std::uniform_real_distribution<double>(1e-3, 10)(rng) * scale;
    const int max_ticks = std::uniform_int_distribution<int>(2, 10)(rng);
    const AxisTicks t = nice_ticks(lo, hi, max_ticks);
    INFO("lo " << lo << " hi " << hi << " max " << max_ticks << " step " << t.step);
    REQUIRE(t.values.size() >= 2);
    CHECK(t.values.size() - 1 <= static_cast<size_t>(max_ticks));
    CHECK(t.values.front() <= lo + 1e-9 * t.step);
    CHECK(t.values.back() >= hi - 1e-9 * t.step);
    for (size_t i = 1; i < t.values.size(); ++i) CHECK(t.values[i] - t.values[i - 1] == Approx(t.step));
    const double mantissa = t.step / std::pow(10.0, std::floor(std::log10(t.step) + 1e-12));
    CHECK((mantissa == Approx(1) || mantissa == Approx(2) || mantissa == Approx(5)));
    CHECK(t.step == Approx(brute_force_step(lo, hi, max_ticks)));
  }
  // Degenerate ranges still give an axis.
  for (double v : {0.0, 7.0, -3.0}) {
    const AxisTicks t = nice_ticks(v, v, 5);
    CHECK(t.values.size() >= 2);
    CHECK(t.values.front() <= v);
    CHECK(t.values.back() > v);
  }
}

TEST_CASE("tick_label prints the decimals of the step") {
  CHECK(tick_label(0.5, 0.5) == "0.5");
  CHECK(tick_label(200, 100) == "200");
  CHECK(tick_label(0.04, 0.02) == "0.04");
  CHECK(tick_label(-1e-17, 0.1) == "0.0");
  std::mt19937_64 rng(std::random_device{}());
  for (int trial = 0; trial < 1000; ++trial) {
    const int k = std::uniform_int_distribution<int>(-5, 5)(rng);
    const double step = std::vector<double>{1, 2, 5}[trial % 3] * std::pow(10.0, k);
    const double value = std::uniform_int_distribution<int>(-50, 50)(rng) * step;
    const std::string s = tick_label(value, step);
    const size_t dot = s.find('.');
    CHECK((dot == std::string::npos ? 0 : static_cast<int>(s.size() - dot - 1)) == std::max(0, -k));
    CHECK(std::abs(std::stod(s) - value) <= 0.5 * std::pow(10.0, std::min(0, k)) * 1.0001);
  }
}

TEST_CASE("random element trees make well-formed documents") {
  CHECK(baton::test::xml_problem("<a><b></a></b>") != "");  // the checker itself can fail
  CHECK(baton::test::xml_problem("<a x=\"1&2\"/>") != "");
  std::mt19937_64 rng(std::random_device{}());
  for (int trial = 0; trial < 200; ++trial) {
    SvgWriter w(std::uniform_real_distribution<double>(1, 2000)(rng), 300);
    int depth = 0;
    const int n_ops = std::uniform_int_distribution<int>(0, 60)(rng);
    std::vector<std::string> texts;
    for (int op = 0; op < n_ops; ++op) {
      const SvgAttrs attrs = {{"class", random_text(rng, 8)},
                              {"x", std::uniform_real_distribution<double>(-1e4, 1e4)(rng)}};
      switch (std::uniform_int_distribution<int>(0, 3)(rng)) {
        case 0:
          w.open("g", attrs);
          ++depth;
          break;
        case 1:
          if (depth > 0) {
            w.close();
            --depth;
          }
          break;
        case 2: w.leaf("rect", attrs); break;
        default: texts.push_back(random_text(rng, 20)); w.text("text", attrs, texts.back());
      }
    }
    const std::string doc = w.finish();  // closes what is still open
    std::string root;
    INFO(doc);
    CHECK(baton::test::xml_problem(doc, &root) == "");
    CHECK(root == "svg");
    // Every text is there, escaped.
    for (const std::string& t : texts) CHECK(doc.find(">" + xml_escape(t) + "</text>") != std::string::npos);
  }
}

}  // namespace
}  // namespace baton::ctl
