// A small SVG writer for the charts batonctl draws by hand: elements opened and closed in order
// (so the document is well-formed XML whatever the caller writes), attribute values and text
// escaped, coordinates in a short fixed form. Plus the two things every chart axis needs: "nice"
// tick steps (1, 2 or 5 × 10^k) and tick labels with as many decimals as the step has.
#pragma once

#include <string>
#include <string_view>
#include <vector>

namespace baton::ctl {

// Escapes text for XML character data and attribute values (& < > " ').
std::string xml_escape(std::string_view text);

// A coordinate or length: at most 2 decimals, trailing zeros dropped, never "-0" ("12.5", "3").
std::string svg_number(double v);

// One attribute; the value is escaped when written.
struct SvgAttr {
  SvgAttr(std::string n, std::string v) : name(std::move(n)), value(std::move(v)) {}
  SvgAttr(std::string n, const char* v) : name(std::move(n)), value(v) {}
  SvgAttr(std::string n, double v) : name(std::move(n)), value(svg_number(v)) {}
  std::string name;
  std::string value;
};
using SvgAttrs = std::vector<SvgAttr>;

class SvgWriter {
 public:
  // Opens the <svg> root element of a width × height (px) drawing with a matching viewBox.
  SvgWriter(double width, double height);

  // <tag attrs...>; closed by close().
  void open(std::string_view tag, const SvgAttrs& attrs = {});
  // Closes the innermost open element. The root is closed by finish(), not here.
  void close();
  // <tag attrs.../>
  void leaf(std::string_view tag, const SvgAttrs& attrs = {});
  // <tag attrs...>text</tag>, the text escaped.
  void text(std::string_view tag, const SvgAttrs& attrs, std::string_view content);

  // Closes every open element and the root, and returns the document. The writer is spent.
  std::string finish();

 private:
  void start_tag(std::string_view tag, const SvgAttrs& attrs);
  std::string out_;
  std::vector<std::string> open_;  // innermost last; [0] is the root
};

// Ticks for an axis covering [lo, hi]: multiples of a step of 1, 2 or 5 × 10^k, from the last one
// <= lo to the first one >= hi; the step is the smallest for which that is at most `max_ticks`
// intervals (>= 2: a range across 0 needs two). hi <= lo (all samples equal, or none) still gives
// an interval.
struct AxisTicks {
  double step = 1;
  std::vector<double> values;  // ascending, values.front() <= lo, values.back() >= hi
};
AxisTicks nice_ticks(double lo, double hi, int max_ticks);

// A tick value printed with the decimals its step needs ("0.25", "1.5", "200").
std::string tick_label(double value, double step);

}  // namespace baton::ctl
