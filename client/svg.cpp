#include "client/svg.h"

#include <algorithm>
#include <cmath>
#include <cstdio>

#include "common/check.h"

namespace baton::ctl {

std::string xml_escape(std::string_view text) {
  std::string out;
  out.reserve(text.size());
  for (char c : text) {
    switch (c) {
      case '&': out += "&amp;"; break;
      case '<': out += "&lt;"; break;
      case '>': out += "&gt;"; break;
      case '"': out += "&quot;"; break;
      case '\'': out += "&apos;"; break;
      default: out += c;
    }
  }
  return out;
}

std::string svg_number(double v) {
  if (!std::isfinite(v)) v = 0;  // a NaN in a coordinate would make the file unreadable, not just wrong
  char buf[64];
  std::snprintf(buf, sizeof(buf), "%.2f", v);
  std::string s = buf;
  s.erase(s.find_last_not_of('0') + 1);
  if (s.back() == '.') s.pop_back();
  if (s == "-0") s = "0";
  return s;
}

SvgWriter::SvgWriter(double width, double height) {
  out_ = "<?xml version=\"1.0\" encoding=\"UTF-8\"?>\n";
  start_tag("svg", {{"xmlns", "http://www.w3.org/2000/svg"},
                    {"width", width},
                    {"height", height},
                    {"viewBox", "0 0 " + svg_number(width) + " " + svg_number(height)},
                    {"font-family", "sans-serif"},
                    {"font-size", 12.0}});
  out_ += ">\n";
  open_.emplace_back("svg");
}

void SvgWriter::start_tag(std::string_view tag, const SvgAttrs& attrs) {
  out_ += '<';
  out_ += tag;
  for (const SvgAttr& a : attrs) {
    out_ += ' ';
    out_ += a.name;
    out_ += "=\"";
    out_ += xml_escape(a.value);
    out_ += '"';
  }
}

void SvgWriter::open(std::string_view tag, const SvgAttrs& attrs) {
  BATON_CHECK(!open_.empty(), "SvgWriter used after finish()");
  start_tag(tag, attrs);
  out_ += ">\n";
  open_.emplace_back(tag);
}

void SvgWriter::close() {
  BATON_CHECK(open_.size() > 1, "SvgWriter::close() without an open element (the root is closed by finish())");
  out_ += "</" + open_.back() + ">\n";
  open_.pop_back();
}

void SvgWriter::leaf(std::string_view tag, const SvgAttrs& attrs) {
  BATON_CHECK(!open_.empty(), "SvgWriter used after finish()");
  start_tag(tag, attrs);
  out_ += "/>\n";
}

void SvgWriter::text(std::string_view tag, const SvgAttrs& attrs, std::string_view content) {
  BATON_CHECK(!open_.empty(), "SvgWriter used after finish()");
  start_tag(tag, attrs);
  out_ += '>';
  out_ += xml_escape(content);
  out_ += "</";
  out_ += tag;
  out_ += ">\n";
}

std::string SvgWriter::finish() {
  while (!open_.empty()) {
    out_ += "</" + open_.back() + ">\n";
    open_.pop_back();
  }
  return std::move(out_);
}

AxisTicks nice_ticks(double lo, double hi, int max_ticks) {
  BATON_CHECK(max_ticks >= 2, "max_ticks %d", max_ticks);  // a range across 0 needs two intervals
  if (!std::isfinite(lo)) lo = 0;
  if (!std::isfinite(hi)) hi = lo;
  if (hi <= lo) hi = lo + (lo == 0 ? 1.0 : std::abs(lo) * 0.1);
  const double raw = (hi - lo) / max_ticks;
  double magnitude = std::pow(10.0, std::floor(std::log10(raw)));
  AxisTicks t;
  // The first candidate is <= raw, so at least max_ticks intervals; one of the next ones fits.
  for (;; magnitude *= 10) {
    bool found = false;
    for (double m : {1.0, 2.0, 5.0}) {
      const double step = m * magnitude;
      // A hair of slack: a bound that is a multiple of the step up to rounding adds no tick.
      const double first = std::floor(lo / step + 1e-9);
      const double last = std::ceil(hi / step - 1e-9);
      if (last - first <= max_ticks) {
        t.step = step;
        for (double k = first; k <= last; ++k) t.values.push_back(k * step);
        found = true;
        break;
      }
    }
    if (found) break;
  }
  return t;
}

std::string tick_label(double value, double step) {
  const int decimals = std::max(0, static_cast<int>(-std::floor(std::log10(step) + 1e-9)));
  char buf[64];
  std::snprintf(buf, sizeof(buf), "%.*f", decimals, value);
  std::string s = buf;
  if (s[0] == '-' && s.find_first_not_of("0.", 1) == std::string::npos) s.erase(0, 1);  // no "-0.0"
  return s;
}

}  // namespace baton::ctl
