#include "client/bench_plot.h"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <numeric>

#include "client/svg.h"

namespace baton::ctl {
namespace {

std::string format(const char* fmt, auto... args) {
  char buf[512];
  std::snprintf(buf, sizeof(buf), fmt, args...);
  return buf;
}

constexpr double kWidth = 960;
constexpr const char* kAxisColor = "#444";
constexpr const char* kGridColor = "#e4e4e4";

// A plot area in px; y grows downwards, (x, y) is the top left corner.
struct Area {
  double x = 0, y = 0, w = 0, h = 0;
};

// Maps [lo, hi] onto [px_lo, px_hi] (px_hi < px_lo for a y axis).
struct Scale {
  double lo = 0, hi = 1, px_lo = 0, px_hi = 1;
  double operator()(double v) const { return px_lo + (v - lo) / (hi - lo) * (px_hi - px_lo); }
};

struct Percentile {
  const char* name;  // "p50"
  double p;          // 50
  const char* color;
};
constexpr Percentile kPercentiles[] = {{"p50", 50, "#2a9d8f"}, {"p90", 90, "#e9a03b"}, {"p99", 99, "#d1495b"}};

struct Segment {
  const char* key;    // data-segment, the JSON key of server_ms
  const char* label;  // legend
  const char* color;
  double ServerSegmentsMs::*field;
};
constexpr Segment kSegments[] = {
    {"queue", "queue", "#9aa0a6", &ServerSegmentsMs::queue},
    {"prefill", "prefill", "#1f77b4", &ServerSegmentsMs::prefill},
    {"kv_transfer", "KV transfer", "#ff7f0e", &ServerSegmentsMs::kv_transfer},
    {"decode_queue", "decode queue", "#bcbd22", &ServerSegmentsMs::decode_queue},
    {"decode", "decode (rest of e2e)", "#2ca02c", &ServerSegmentsMs::decode},
};

// Grid lines, ticks and tick labels of both axes, and the axis titles.
void draw_axes(SvgWriter& w, const Area& a, const Scale& x, const AxisTicks& xt, const Scale& y, const AxisTicks& yt,
               const std::string& x_title, const std::string& y_title,
               const std::vector<std::pair<double, std::string>>* x_labels = nullptr) {
  w.open("g", {{"class", "y-axis"}, {"font-size", 11.0}, {"text-anchor", "end"}});
  for (double v : yt.values) {
    const double py = y(v);
    w.open("g", {{"class", "tick"}});
    w.leaf("line", {{"x1", a.x}, {"y1", py}, {"x2", a.x + a.w}, {"y2", py}, {"stroke", kGridColor}});
    w.text("text", {{"x", a.x - 6}, {"y", py + 4}}, tick_label(v, yt.step));
    w.close();
  }
  w.text("text",
         {{"class", "axis-title"},
          {"transform",
           format("translate(%s %s) rotate(-90)", svg_number(a.x - 44).c_str(), svg_number(a.y + a.h / 2).c_str())},
          {"text-anchor", "middle"},
          {"font-size", 12.0}},
         y_title);
  w.close();
  w.open("g", {{"class", "x-axis"}, {"font-size", 11.0}, {"text-anchor", "middle"}});
  std::vector<std::pair<double, std::string>> ticks;
  if (x_labels != nullptr) {
    ticks = *x_labels;
  } else {
    for (double v : xt.values) ticks.emplace_back(v, tick_label(v, xt.step));
  }
  for (const auto& [v, label] : ticks) {
    const double px = x(v);
    w.open("g", {{"class", "tick"}});
    w.leaf("line", {{"x1", px}, {"y1", a.y + a.h}, {"x2", px}, {"y2", a.y + a.h + 5}, {"stroke", kAxisColor}});
    w.text("text", {{"x", px}, {"y", a.y + a.h + 18}}, label);
    w.close();
  }
  w.text("text", {{"class", "axis-title"}, {"x", a.x + a.w / 2}, {"y", a.y + a.h + 36}, {"font-size", 12.0}}, x_title);
  w.close();
  w.leaf("path", {{"class", "frame"},
                  {"d", "M" + svg_number(a.x) + " " + svg_number(a.y) + "V" + svg_number(a.y + a.h) + "H" +
                            svg_number(a.x + a.w)},
                  {"fill", "none"},
                  {"stroke", kAxisColor}});
}

void draw_no_data(SvgWriter& w, const Area& a, const std::string& what) {
  w.leaf("rect", {{"x", a.x}, {"y", a.y}, {"width", a.w}, {"height", a.h}, {"fill", "none"}, {"stroke", kGridColor}});
  w.text(
      "text",
      {{"class", "no-data"}, {"x", a.x + a.w / 2}, {"y", a.y + a.h / 2}, {"text-anchor", "middle"}, {"fill", "#888"}},
      "no " + what + " samples");
}

// One legend row: a swatch (line or box) and a label, from (x, y) to the right; returns the next x.
double legend_entry(SvgWriter& w, double x, double y, const char* color, bool box, const std::string& label,
                    const SvgAttrs& label_attrs, bool dashed = false) {
  if (box) {
    w.leaf("rect", {{"x", x}, {"y", y - 9}, {"width", 12.0}, {"height", 10.0}, {"fill", color}});
  } else {
    SvgAttrs line = {{"x1", x}, {"y1", y - 4}, {"x2", x + 14}, {"y2", y - 4}, {"stroke", color}, {"stroke-width", 2.0}};
    if (dashed) line.emplace_back("stroke-dasharray", "4 3");
    w.leaf("line", line);
  }
  SvgAttrs attrs = label_attrs;
  attrs.emplace_back("x", x + 18);
  attrs.emplace_back("y", y);
  w.text("text", attrs, label);
  return x + 18 + 6.5 * static_cast<double>(label.size()) + 14;
}

// The empirical CDF of `ms` (ok requests' latencies) with its percentiles, in area `a`.
void draw_cdf(SvgWriter& w, const Area& a, const char* metric, const char* title, const char* x_title,
              const char* color, std::vector<double> ms, const LatencySummary& summary, std::optional<double> slo_ms) {
  w.open("g", {{"class", "panel"}, {"data-metric", metric}});
  w.text("text", {{"class", "panel-title"}, {"x", a.x}, {"y", a.y - 30}, {"font-size", 13.0}, {"font-weight", "bold"}},
         title);
  if (ms.empty()) {
    draw_no_data(w, a, metric);
    w.close();
    return;
  }
  std::sort(ms.begin(), ms.end());
  const AxisTicks xt = nice_ticks(0, ms.back(), 6);
  const AxisTicks yt = nice_ticks(0, 1, 4);
  const Scale x{xt.values.front(), xt.values.back(), a.x, a.x + a.w};
  const Scale y{0, 1, a.y + a.h, a.y};
  draw_axes(w, a, x, xt, y, yt, x_title, "fraction of samples ≤ x");

  // The staircase through (sorted[i], (i + 1) / n), or through evenly spaced ranks above kMaxCdfSteps.
  const size_t n = ms.size();
  const size_t n_steps = std::min<size_t>(n, kMaxCdfSteps);
  std::string d = "M" + svg_number(x(ms.front())) + " " + svg_number(y(0));
  for (size_t k = 1; k <= n_steps; ++k) {
    const size_t i = (k * n + n_steps - 1) / n_steps - 1;  // ceil(k n / n_steps) - 1: rank of level k / n_steps
    d += "H" + svg_number(x(ms[i])) + "V" + svg_number(y(static_cast<double>(i + 1) / static_cast<double>(n)));
  }
  w.leaf("path", {{"class", "cdf"},
                  {"data-metric", metric},
                  {"d", d},
                  {"fill", "none"},
                  {"stroke", color},
                  {"stroke-width", 1.8}});

  const double values[] = {summary.p50, summary.p90, summary.p99};
  for (size_t i = 0; i < std::size(kPercentiles); ++i) {
    const Percentile& p = kPercentiles[i];
    const double px = x(values[i]);
    w.open("g", {{"class", "percentile"}, {"data-metric", metric}, {"data-p", p.p}});
    w.leaf("line", {{"x1", px},
                    {"y1", a.y + a.h},
                    {"x2", px},
                    {"y2", y(p.p / 100)},
                    {"stroke", p.color},
                    {"stroke-width", 1.5},
                    {"stroke-dasharray", "4 3"}});
    w.leaf("circle", {{"cx", px}, {"cy", y(p.p / 100)}, {"r", 3.0}, {"fill", p.color}});
    w.close();
  }
  if (slo_ms && *slo_ms <= x.hi) {
    w.leaf("line", {{"class", "slo"},
                    {"x1", x(*slo_ms)},
                    {"y1", a.y},
                    {"x2", x(*slo_ms)},
                    {"y2", a.y + a.h},
                    {"stroke", "#c00"},
                    {"stroke-width", 1.5},
                    {"stroke-dasharray", "8 4"}});
  }

  // Legend, inside the plot at the bottom right (where a CDF is empty).
  const double lx = a.x + a.w - 150;
  double ly = a.y + a.h - 16 * (std::size(kPercentiles) + 1 + (slo_ms ? 1 : 0)) + 4;
  w.open("g", {{"class", "legend"}, {"font-size", 11.0}});
  w.leaf("rect", {{"x", lx - 6},
                  {"y", ly - 13},
                  {"width", 152.0},
                  {"height", 16.0 * (std::size(kPercentiles) + 1 + (slo_ms ? 1 : 0)) + 2},
                  {"fill", "white"},
                  {"fill-opacity", 0.85},
                  {"stroke", kGridColor}});
  legend_entry(w, lx, ly, color, false, format("CDF, n = %zu", n), {{"class", "legend-label"}});
  for (size_t i = 0; i < std::size(kPercentiles); ++i) {
    ly += 16;
    const Percentile& p = kPercentiles[i];
    legend_entry(w, lx, ly, p.color, false, std::string(p.name) + " " + plot_ms(values[i]) + " ms",
                 {{"class", "legend-label percentile-label"}, {"data-metric", metric}, {"data-p", p.p}}, true);
  }
  if (slo_ms) {
    ly += 16;
    legend_entry(w, lx, ly, "#c00", false, "SLO " + plot_ms(*slo_ms) + " ms" + (*slo_ms > x.hi ? " (off scale)" : ""),
                 {{"class", "legend-label slo-label"}, {"data-metric", metric}}, true);
  }
  w.close();
  w.close();
}

// The ok requests that carry the server's breakdown, in completion order (ties: issue order).
std::vector<const RequestSample*> completion_order(const std::vector<RequestSample>& samples) {
  std::vector<const RequestSample*> out;
  for (const RequestSample& s : samples) {
    if (s.ok && s.has_final) out.push_back(&s);
  }
  std::stable_sort(out.begin(), out.end(),
                   [](const RequestSample* a, const RequestSample* b) { return a->finished_at < b->finished_at; });
  return out;
}

void draw_breakdown(SvgWriter& w, const Area& a, const std::vector<RequestSample>& samples) {
  const std::vector<const RequestSample*> done = completion_order(samples);
  const size_t n = done.size();
  const size_t per_bar = std::max<size_t>(1, (n + kMaxBars - 1) / kMaxBars);
  const size_t n_bars = (n + per_bar - 1) / per_bar;
  w.open("g", {{"class", "panel"},
               {"data-metric", "server_breakdown"},
               {"data-requests-per-bar", static_cast<double>(per_bar)}});
  std::string title = "Server-side time per request, in completion order (stacked)";
  if (per_bar > 1) title += format(" — each bar the mean of %zu requests", per_bar);
  w.text("text", {{"class", "panel-title"}, {"x", a.x}, {"y", a.y - 30}, {"font-size", 13.0}, {"font-weight", "bold"}},
         title);
  // The legend, in one row under the title.
  w.open("g", {{"class", "legend"}, {"font-size", 11.0}});
  double lx = a.x;
  for (const Segment& s : kSegments) {
    lx = legend_entry(w, lx, a.y - 10, s.color, true, s.label, {{"class", "legend-label"}, {"data-segment", s.key}});
  }
  w.close();
  if (n == 0) {
    draw_no_data(w, a, "server breakdown");
    w.close();
    return;
  }
  std::vector<ServerSegmentsMs> bars(n_bars);
  for (size_t b = 0; b < n_bars; ++b) {
    const size_t first = b * per_bar, last = std::min(n, first + per_bar);
    for (const Segment& s : kSegments) {
      double sum = 0;
      for (size_t i = first; i < last; ++i) sum += server_segments_ms(*done[i]).*s.field;
      bars[b].*s.field = sum / static_cast<double>(last - first);
    }
  }
  double top = 0;
  for (const ServerSegmentsMs& b : bars)
    top = std::max(top, b.queue + b.prefill + b.kv_transfer + b.decode_queue + b.decode);
  const AxisTicks yt = nice_ticks(0, top, 5);
  const Scale y{0, yt.values.back(), a.y + a.h, a.y};
  // Bar b spans [b, b + 1) on the x axis; ticks name the requests (1-based) at the centre of their bar.
  const Scale x{0, static_cast<double>(n_bars), a.x, a.x + a.w};
  const AxisTicks xt = nice_ticks(0, static_cast<double>(n), 8);
  std::vector<std::pair<double, std::string>> x_labels;
  for (double v : xt.values) {
    const double request = std::max(1.0, v);  // the first tick names request 1
    if (request > static_cast<double>(n)) continue;
    x_labels.emplace_back((request - 0.5) / static_cast<double>(per_bar), format("%.0f", request));
  }
  draw_axes(w, a, x, xt, y, yt,
            per_bar > 1 ? "request (completion order; bars of consecutive requests)" : "request (completion order)",
            "ms", &x_labels);
  const double bw = a.w / static_cast<double>(n_bars);
  const double gap = bw >= 4 ? std::min(2.0, bw * 0.2) : 0;
  std::vector<double> base(n_bars, 0);
  for (const Segment& s : kSegments) {
    w.open("g", {{"class", "segment"}, {"data-segment", s.key}, {"fill", s.color}});
    for (size_t b = 0; b < n_bars; ++b) {
      const double v = bars[b].*s.field;
      const double y_top = y(base[b] + v), y_bottom = y(base[b]);
      w.leaf("rect", {{"x", x(static_cast<double>(b)) + gap / 2},
                      {"y", y_top},
                      {"width", bw - gap},
                      {"height", y_bottom - y_top}});
      base[b] += v;
    }
    w.close();
  }
  w.close();
}

void draw_turns(SvgWriter& w, const Area& a, const std::vector<TurnSummary>& turns) {
  w.open("g", {{"class", "panel"}, {"data-metric", "ttft_by_turn"}});
  w.text("text", {{"class", "panel-title"}, {"x", a.x}, {"y", a.y - 30}, {"font-size", 13.0}, {"font-weight", "bold"}},
         "Chat: TTFT by turn (the prompt grows with the history)");
  const char* colors[] = {kPercentiles[0].color, kPercentiles[2].color};
  w.open("g", {{"class", "legend"}, {"font-size", 11.0}});
  double lx = a.x;
  lx = legend_entry(w, lx, a.y - 10, colors[0], true, "TTFT p50", {{"class", "legend-label"}, {"data-series", "p50"}});
  legend_entry(w, lx, a.y - 10, colors[1], true, "TTFT p99", {{"class", "legend-label"}, {"data-series", "p99"}});
  w.close();
  double top = 0;
  for (const TurnSummary& t : turns) top = std::max(top, t.ttft_ms.p99);
  if (top <= 0) {
    draw_no_data(w, a, "TTFT");
    w.close();
    return;
  }
  const AxisTicks yt = nice_ticks(0, top, 5);
  const Scale y{0, yt.values.back(), a.y + a.h, a.y};
  const double n = static_cast<double>(turns.size());
  const Scale x{0, n, a.x, a.x + a.w};
  std::vector<std::pair<double, std::string>> x_labels;
  const int every = std::max(1, static_cast<int>(std::ceil(n / 20)));
  for (size_t t = 0; t < turns.size(); t += every)
    x_labels.emplace_back(static_cast<double>(t) + 0.5, format("%zu", t + 1));
  draw_axes(w, a, x, AxisTicks{}, y, yt, "turn", "ms", &x_labels);
  const double slot = a.w / n;
  const double bw = std::min(40.0, slot * 0.38);
  for (int series = 0; series < 2; ++series) {
    w.open("g", {{"class", "turn-series"}, {"data-series", series == 0 ? "p50" : "p99"}, {"fill", colors[series]}});
    for (size_t t = 0; t < turns.size(); ++t) {
      const double v = series == 0 ? turns[t].ttft_ms.p50 : turns[t].ttft_ms.p99;
      const double bx = x(static_cast<double>(t) + 0.5) + (series == 0 ? -bw : 0);
      w.leaf("rect", {{"x", bx}, {"y", y(v)}, {"width", bw}, {"height", y(0) - y(v)}});
      if (turns.size() <= 12) {
        w.text("text",
               {{"x", bx + bw / 2}, {"y", y(v) - 3}, {"text-anchor", "middle"}, {"font-size", 10.0}, {"fill", "#333"}},
               plot_ms(v));
      }
    }
    w.close();
  }
  w.close();
}

}  // namespace

std::string plot_ms(double ms) {
  const double a = std::abs(ms);
  if (a >= 100) return format("%.0f", ms);
  if (a >= 10) return format("%.1f", ms);
  if (a >= 1) return format("%.2f", ms);
  return format("%.3f", ms);
}

std::string bench_plot_svg(const BenchReport& r) {
  const BenchConfig& c = r.config;
  const bool chat = !r.turns.empty();
  // Rows: title 0-76, CDFs 76-376, breakdown 376-676, turns 676-976.
  const double height = chat ? 976 : 676;
  SvgWriter w(kWidth, height);
  w.leaf("rect", {{"width", kWidth}, {"height", height}, {"fill", "white"}});

  const std::string load = c.concurrency > 0 ? format("concurrency %d%s", c.concurrency, chat ? " conversations" : "")
                                             : format("Poisson arrivals at %.2f/s", c.rate);
  const std::string shape =
      chat ? format("chat: %d conversations × %d turns, system prompt %d + %d ids a turn, %d output tokens",
                    c.conversations, c.turns, c.system_prompt_tokens, c.prompt_tokens, c.output_tokens)
           : format("%d prompt + %d output tokens", c.prompt_tokens, c.output_tokens);
  w.text("text", {{"class", "title"}, {"x", 20.0}, {"y", 24.0}, {"font-size", 16.0}, {"font-weight", "bold"}},
         "batonctl bench — " + c.model);
  w.text("text", {{"class", "subtitle"}, {"x", 20.0}, {"y", 44.0}, {"fill", "#333"}}, load + "; " + shape);
  std::string results = format("%d ok, %d failed in %.2f s · %.2f req/s · %.1f output tok/s", r.n_ok, r.n_failed,
                               r.wall_seconds, r.requests_per_second, r.output_tokens_per_second);
  if (c.slo.any())
    results += format(" · goodput %.2f req/s (%.1f %% met the SLOs)", r.slo.goodput, r.slo.attainment * 100);
  w.text("text", {{"class", "subtitle"}, {"x", 20.0}, {"y", 62.0}, {"fill", "#333"}}, results);

  std::vector<double> ttft, itl;
  for (const RequestSample& s : r.samples) {
    if (!s.ok) continue;
    if (s.ttft >= 0) ttft.push_back(s.ttft * 1e3);
    for (double g : s.itl) itl.push_back(g * 1e3);
  }
  auto summary = [&](const char* key) {
    for (const auto& [k, s] : r.latencies_ms) {
      if (k == key) return s;
    }
    return LatencySummary{};
  };
  auto slo_ms = [](std::optional<double> seconds) {
    return seconds ? std::optional<double>(*seconds * 1e3) : std::nullopt;
  };
  draw_cdf(w, Area{70, 126, 380, 200}, "ttft", "Time to first token (client)", "ms", "#1f77b4", std::move(ttft),
           summary("ttft"), slo_ms(c.slo.ttft_seconds));
  draw_cdf(w, Area{560, 126, 370, 200}, "itl", "Inter-token latency (client)", "ms between successive token messages",
           "#ff7f0e", std::move(itl), summary("itl"), slo_ms(c.slo.itl_seconds));
  draw_breakdown(w, Area{70, 426, 870, 200}, r.samples);
  if (chat) draw_turns(w, Area{70, 726, 870, 200}, r.turns);
  return w.finish();
}

std::string bench_plot_html(const BenchReport& report) {
  std::string svg = bench_plot_svg(report);
  svg.erase(0, svg.find("<svg"));  // the XML declaration has no place inside HTML
  return "<!DOCTYPE html>\n<html><head><meta charset=\"utf-8\"><title>batonctl bench: " +
         xml_escape(report.config.model) + "</title></head>\n<body style=\"margin:0\">\n" + svg + "</body></html>\n";
}

}  // namespace baton::ctl
