// client/bench_plot.h on random reports: a well-formed SVG with both CDFs, their percentile
// labels showing the report's values, one stacked bar per ok request (or per bin above
// kMaxBars) whose segment heights are the requests' breakdown on the drawn scale, the chat
// panel; "no samples" panels when nothing succeeded; the HTML page embeds the same SVG.
#include "client/bench_plot.h"

#include <catch2/catch.hpp>
#include <cmath>
#include <random>
#include <regex>

#include "client/svg.h"
#include "tests/unit/client/random_samples.h"
#include "tests/unit/client/xml_check.h"

namespace baton::ctl {
namespace {

size_t count(const std::string& s, const std::string& what) {
  size_t n = 0;
  for (size_t i = s.find(what); i != std::string::npos; i = s.find(what, i + 1)) ++n;
  return n;
}

// The text of the element that starts with `open` (an exact prefix of its start tag), up to its
// closing tag `</tag>` at the same depth.
std::string element(const std::string& doc, const std::string& open, const std::string& tag) {
  const size_t start = doc.find(open);
  if (start == std::string::npos) return "";
  int depth = 0;
  for (size_t i = start; i < doc.size(); ++i) {
    if (doc.compare(i, tag.size() + 1, "<" + tag) == 0 &&
        (doc[i + tag.size() + 1] == ' ' || doc[i + tag.size() + 1] == '>')) {
      const size_t end = doc.find('>', i);
      if (doc[end - 1] != '/') ++depth;
    } else if (doc.compare(i, tag.size() + 3, "</" + tag + ">") == 0 && --depth == 0) {
      return doc.substr(start, i + tag.size() + 3 - start);
    }
  }
  return "";
}

std::vector<double> attr_values(const std::string& s, const std::string& tag, const std::string& attr) {
  std::vector<double> out;
  const std::regex re("<" + tag + "[^>]* " + attr + "=\"([-0-9.]+)\"");
  for (auto it = std::sregex_iterator(s.begin(), s.end(), re); it != std::sregex_iterator(); ++it) {
    out.push_back(std::stod((*it)[1]));
  }
  return out;
}

// The y axis of a panel: px per unit from its first and last tick (line y, label value).
double px_per_unit(const std::string& panel) {
  const std::string axis = element(panel, "<g class=\"y-axis\"", "g");
  const std::regex tick("<line x1=\"[-0-9.]+\" y1=\"([-0-9.]+)\"[^>]*/>\\s*<text[^>]*>([-0-9.]+)</text>");
  std::vector<std::pair<double, double>> ticks;  // (px, value)
  for (auto it = std::sregex_iterator(axis.begin(), axis.end(), tick); it != std::sregex_iterator(); ++it) {
    ticks.emplace_back(std::stod((*it)[1]), std::stod((*it)[2]));
  }
  REQUIRE(ticks.size() >= 2);
  return (ticks.front().first - ticks.back().first) / (ticks.back().second - ticks.front().second);
}

const LatencySummary& summary(const BenchReport& r, const std::string& key) {
  for (const auto& [k, s] : r.latencies_ms) {
    if (k == key) return s;
  }
  FAIL("no summary " << key);
  static LatencySummary none;
  return none;
}

BenchReport random_report(std::mt19937_64& rng, size_t n, int turns) {
  BenchConfig c;
  c.model = "model <&> \"quoted\"";
  c.concurrency = 3;
  c.output_tokens = 16;
  if (turns > 0) {
    c.workload = "chat";
    c.turns = turns;
    c.conversations = static_cast<int>(n) / turns;
  }
  c.slo.ttft_seconds = 0.1;
  return make_report(c, baton::test::random_samples(rng, n, turns), 2.0);
}

TEST_CASE("the plot draws the report's percentiles and every request's breakdown") {
  std::mt19937_64 rng(std::random_device{}());
  for (int trial = 0; trial < 30; ++trial) {
    const size_t n = std::uniform_int_distribution<size_t>(1, 600)(rng);
    const int turns = trial % 3 == 0 ? std::uniform_int_distribution<int>(1, 5)(rng) : 0;
    const BenchReport r = random_report(rng, n, turns);
    const std::string svg = bench_plot_svg(r);
    INFO("n " << n << " turns " << turns);
    REQUIRE(baton::test::xml_problem(svg) == "");
    CHECK(svg.find(xml_escape(r.config.model)) != std::string::npos);

    for (const char* metric : {"ttft", "itl"}) {
      const LatencySummary& s = summary(r, metric);
      if (s.n == 0) continue;
      // The staircase: one rise per sample, or per evenly spaced rank above kMaxCdfSteps.
      std::smatch d;
      REQUIRE(std::regex_search(
          svg, d, std::regex("<path class=\"cdf\" data-metric=\"" + std::string(metric) + "\" d=\"([^\"]*)\"")));
      CHECK(count(d[1], "V") == std::min<size_t>(s.n, kMaxCdfSteps));
      const std::pair<const char*, double> ps[] = {{"50", s.p50}, {"90", s.p90}, {"99", s.p99}};
      for (const auto& [p, value] : ps) {
        const std::regex label("data-metric=\"" + std::string(metric) + "\" data-p=\"" + p + "\"[^>]*>p" + p +
                               " ([0-9.]+) ms</text>");
        std::smatch m;
        REQUIRE(std::regex_search(svg, m, label));
        const std::string shown = m[1];
        const size_t dot = shown.find('.');
        const int decimals = dot == std::string::npos ? 0 : static_cast<int>(shown.size() - dot - 1);
        CHECK(std::abs(std::stod(shown) - value) <= 0.5 * std::pow(10.0, -decimals) + 1e-9);
      }
    }

    // One bar per ok request in completion order, or per bin of consecutive ones.
    std::vector<const RequestSample*> done;
    for (const RequestSample& s : r.samples) {
      if (s.ok && s.has_final) done.push_back(&s);
    }
    std::stable_sort(done.begin(), done.end(), [](auto* a, auto* b) { return a->finished_at < b->finished_at; });
    const size_t per_bar = std::max<size_t>(1, (done.size() + kMaxBars - 1) / kMaxBars);
    const size_t n_bars = (done.size() + per_bar - 1) / per_bar;
    const std::string panel = element(svg, "<g class=\"panel\" data-metric=\"server_breakdown\"", "g");
    REQUIRE(!panel.empty());
    if (done.empty()) {
      CHECK(panel.find("no-data") != std::string::npos);
      continue;
    }
    CHECK(n_bars <= static_cast<size_t>(kMaxBars));
    const double scale = px_per_unit(panel);
    for (const char* key : {"queue", "prefill", "kv_transfer", "decode_queue", "decode"}) {
      const std::string seg = element(panel, "<g class=\"segment\" data-segment=\"" + std::string(key) + "\"", "g");
      const std::vector<double> heights = attr_values(seg, "rect", "height");
      REQUIRE(heights.size() == n_bars);
      for (size_t b = 0; b < n_bars; ++b) {
        double sum = 0;
        const size_t last = std::min(done.size(), (b + 1) * per_bar);
        for (size_t i = b * per_bar; i < last; ++i) {
          const ServerSegmentsMs m = server_segments_ms(*done[i]);
          sum += std::string(key) == "queue"          ? m.queue
                 : std::string(key) == "prefill"      ? m.prefill
                 : std::string(key) == "kv_transfer"  ? m.kv_transfer
                 : std::string(key) == "decode_queue" ? m.decode_queue
                                                      : m.decode;
        }
        CHECK(heights[b] == Approx(sum / static_cast<double>(last - b * per_bar) * scale).margin(0.03));
      }
    }
    CHECK((turns > 0) == (svg.find("data-metric=\"ttft_by_turn\"") != std::string::npos));
    if (turns > 0 && summary(r, "ttft").n > 0) {
      const std::string turns_panel = element(svg, "<g class=\"panel\" data-metric=\"ttft_by_turn\"", "g");
      const std::string p99 = element(turns_panel, "<g class=\"turn-series\" data-series=\"p99\"", "g");
      CHECK(attr_values(p99, "rect", "height").size() == static_cast<size_t>(turns));
    }
  }
}

TEST_CASE("a run without successes still plots, saying there are no samples") {
  std::mt19937_64 rng(std::random_device{}());
  BenchConfig c;
  c.rate = 2;
  for (size_t n : {0, 5}) {
    const BenchReport r = make_report(c, baton::test::random_samples(rng, n, 0, /*p_fail=*/1.0), 1.0);
    const std::string svg = bench_plot_svg(r);
    CHECK(baton::test::xml_problem(svg) == "");
    CHECK(count(svg, "class=\"no-data\"") == 3);
    CHECK(count(svg, "class=\"cdf\"") == 0);
  }
}

TEST_CASE("the HTML page holds the same SVG") {
  std::mt19937_64 rng(std::random_device{}());
  const BenchReport r = random_report(rng, 50, 0);
  const std::string svg = bench_plot_svg(r);
  const std::string html = bench_plot_html(r);
  CHECK(html.starts_with("<!DOCTYPE html>"));
  CHECK(html.find(svg.substr(svg.find("<svg"))) != std::string::npos);
}

TEST_CASE("plot_ms prints 3 significant digits") {
  CHECK(plot_ms(1234.4) == "1234");
  CHECK(plot_ms(12.345) == "12.3");
  CHECK(plot_ms(1.2345) == "1.23");
  CHECK(plot_ms(0.12345) == "0.123");
}

}  // namespace
}  // namespace baton::ctl
