// The picture of a `batonctl bench` run (--plot), one self-contained SVG, drawn from the report:
//   - TTFT and ITL: the empirical CDF of each (client side, ms), the p50 / p90 / p99 marked and
//     named in the legend with their values, the SLO bound when one was given;
//   - the server's breakdown of every ok request as a stacked bar (queue, prefill, KV transfer,
//     decode queue, decode = the rest of its e2e), in completion order; above kMaxBars requests
//     each bar is the mean of consecutive requests, and the panel says how many;
//   - chat: TTFT p50 and p99 per turn.
// Elements carry classes (cdf, percentile, segment, tick, legend-label) so that tools, and the
// tests, can find the series; values are the report's, printed as the legends show them.
#pragma once

#include <string>

#include "client/bench_report.h"

namespace baton::ctl {

// Most bars in the breakdown panel.
constexpr int kMaxBars = 240;
// Most steps drawn for a CDF (above it, the curve steps through evenly spaced ranks).
constexpr int kMaxCdfSteps = 400;

// A latency in ms as the plot prints it: 3 significant digits, at least 0 decimals ("123", "12.3",
// "1.23", "0.123").
std::string plot_ms(double ms);

std::string bench_plot_svg(const BenchReport& report);

// The same SVG in a minimal HTML page (for a browser tab, or where .svg files are not shown).
std::string bench_plot_html(const BenchReport& report);

}  // namespace baton::ctl
