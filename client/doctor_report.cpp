#include "client/doctor_report.h"

#include <algorithm>
#include <cstdio>
#include <sstream>

namespace baton::ctl {
namespace {

std::string fixed(double v, int digits) {
  char buf[48];
  std::snprintf(buf, sizeof buf, "%.*f", digits, v);
  return buf;
}

std::string join(const std::vector<std::string>& v, const char* sep) {
  std::string out;
  for (const std::string& s : v) out += (out.empty() ? "" : sep) + s;
  return out;
}

// Rows of cells printed as columns two spaces apart, the first row the header.
std::string table(const std::vector<std::vector<std::string>>& rows) {
  std::vector<size_t> width;
  for (const auto& row : rows) {
    width.resize(std::max(width.size(), row.size()), 0);
    for (size_t i = 0; i < row.size(); ++i) width[i] = std::max(width[i], row[i].size());
  }
  std::string out;
  for (const auto& row : rows) {
    std::string line;
    for (size_t i = 0; i < row.size(); ++i) {
      line += row[i];
      if (i + 1 < row.size()) line += std::string(width[i] - row[i].size() + 2, ' ');
    }
    out += line + "\n";
  }
  return out;
}

std::string dash(const std::string& s) { return s.empty() ? "-" : s; }

std::vector<std::string> node_row(const NodeReport& n, const std::vector<Problem>& problems) {
  const std::string status = has_problem(problems, n.role, n.address) ? "PROBLEM" : "OK";
  if (!n.reachable) return {n.role, n.address, status, "unreachable", "-", "-", "-", "-", "-"};
  std::string model = "-";
  if (n.has_report) model = n.model_name + " (" + n.model_fingerprint.substr(0, 8) + ")";
  std::string kv = "-";
  if (n.has_report && n.role != "frontend") kv = n.kv_dtype + ", " + std::to_string(n.block_size) + "/block";
  std::string transport = "-";
  if (n.role == "prefill") transport = dash(n.kv_transport);
  if (n.role == "decode") transport = n.kv_transports.empty() ? "-" : "receives " + join(n.kv_transports, ",");
  std::string clock = "-";
  if (n.has_clock) {
    clock = (n.clock_offset_seconds >= 0 ? "+" : "") + fixed(n.clock_offset_seconds, 3) + " s (rtt " +
            fixed(n.rtt_seconds * 1e3, 1) + " ms)";
  }
  return {n.role, n.address, status, dash(n.health), model, kv, transport, clock, dash(n.version)};
}

nlohmann::json node_json(const NodeReport& n, const std::vector<Problem>& problems) {
  nlohmann::json j = {
      {"role", n.role},
      {"address", n.address},
      {"ok", !has_problem(problems, n.role, n.address)},
      {"reachable", n.reachable},
      {"failed_call", n.failed_call},
      {"error_code", n.error_code},
      {"error", n.error},
      {"health", n.health},
      {"model_name", n.model_name},
      {"model_fingerprint", n.model_fingerprint},
      {"kv_dtype", n.kv_dtype},
      {"block_size", n.block_size},
      {"kv_transport", n.kv_transport},
      {"kv_transports", n.kv_transports},
      {"version", n.version},
      {"draining", n.draining},
  };
  j["frontend_healthy"] = n.frontend_healthy ? nlohmann::json(*n.frontend_healthy) : nlohmann::json(nullptr);
  j["clock_offset_seconds"] = n.has_clock ? nlohmann::json(n.clock_offset_seconds) : nlohmann::json(nullptr);
  j["rtt_seconds"] = n.has_clock ? nlohmann::json(n.rtt_seconds) : nlohmann::json(nullptr);
  return j;
}

}  // namespace

std::string format_bandwidth(double bps) {
  if (bps >= 1e9) return fixed(bps / 1e9, 2) + " GB/s";
  if (bps >= 1e6) return fixed(bps / 1e6, 1) + " MB/s";
  if (bps >= 1e3) return fixed(bps / 1e3, 1) + " kB/s";
  return fixed(bps, 0) + " B/s";
}

std::string format_bytes(int64_t bytes) {
  const double b = static_cast<double>(bytes);
  if (bytes >= (int64_t{1} << 30)) return fixed(b / (1 << 30), 1) + " GiB";
  if (bytes >= (int64_t{1} << 20)) return fixed(b / (1 << 20), 1) + " MiB";
  if (bytes >= (int64_t{1} << 10)) return fixed(b / (1 << 10), 1) + " KiB";
  return std::to_string(bytes) + " B";
}

std::string doctor_text(const DoctorReport& r, const std::vector<Problem>& problems) {
  std::ostringstream out;
  std::vector<std::vector<std::string>> nodes = {
      {"ROLE", "ADDRESS", "STATUS", "HEALTH", "MODEL", "KV", "TRANSPORT", "CLOCK", "VERSION"}};
  if (r.frontend) nodes.push_back(node_row(*r.frontend, problems));
  for (const auto* list : {&r.prefill, &r.decode}) {
    for (const NodeReport& n : *list) nodes.push_back(node_row(n, problems));
  }
  out << table(nodes);
  if (!r.links.empty()) {
    std::vector<std::vector<std::string>> links = {
        {"LINK (prefill -> decode)", "TRANSPORT", "STATUS", "BANDWIDTH", "LATENCY", "PROBE"}};
    for (const LinkReport& l : r.links) {
      std::string status = has_problem(problems, "link", link_name(l)) ? "PROBLEM" : "OK";
      if (!l.skipped.empty() && status == "OK") status = "SKIPPED";
      std::vector<std::string> row = {link_name(l), dash(l.transport), status, "-", "-", "-"};
      if (l.measured()) {
        row[3] = format_bandwidth(l.bandwidth_bytes_per_second());
        row[4] = fixed(l.latency_median_seconds() * 1e3, 2) + " ms";
        row[5] = format_bytes(l.bytes) + " x " + std::to_string(l.seconds.size());
      } else if (!l.skipped.empty()) {
        row[5] = "skipped: " + l.skipped;
      }
      links.push_back(row);
    }
    out << "\n" << table(links);
    out << "(bandwidth: K and V bytes of one large transfer / its median time; latency: the median minimal "
           "transfer, one token of every layer, send to acknowledgement)\n";
  }
  out << "\n";
  if (problems.empty()) {
    out << "no problems\n";
  } else {
    out << problems.size() << (problems.size() == 1 ? " problem:\n" : " problems:\n");
    for (const Problem& p : problems) {
      out << "  - " << problem_subject(p) << ": " << p.what << "\n    fix: " << p.fix << "\n";
    }
  }
  return out.str();
}

nlohmann::json doctor_json(const DoctorReport& r, const std::vector<Problem>& problems) {
  nlohmann::json j;
  j["ok"] = problems.empty();
  j["kv_bytes"] = r.kv_bytes;
  j["rounds"] = r.rounds;
  j["frontend"] = r.frontend ? node_json(*r.frontend, problems) : nlohmann::json(nullptr);
  j["workers"] = nlohmann::json::array();
  for (const auto* list : {&r.prefill, &r.decode}) {
    for (const NodeReport& n : *list) j["workers"].push_back(node_json(n, problems));
  }
  j["links"] = nlohmann::json::array();
  for (const LinkReport& l : r.links) {
    j["links"].push_back({
        {"prefill", l.prefill},
        {"decode", l.decode},
        {"ok", !has_problem(problems, "link", link_name(l)) && l.skipped.empty()},
        {"measured", l.measured()},
        {"skipped", l.skipped},
        {"error_code", l.error_code},
        {"error", l.error},
        {"transport", l.transport},
        {"bytes", l.bytes},
        {"seconds", l.seconds},
        {"bandwidth_bytes_per_second", l.bandwidth_bytes_per_second()},
        {"latency_bytes", l.latency_bytes},
        {"latency_seconds", l.latency_seconds},
        {"latency_median_seconds", l.latency_median_seconds()},
    });
  }
  j["problems"] = nlohmann::json::array();
  for (const Problem& p : problems) {
    j["problems"].push_back(
        {{"kind", p.kind}, {"address", p.address}, {"subject", problem_subject(p)}, {"problem", p.what}, {"fix", p.fix}});
  }
  return j;
}

}  // namespace baton::ctl
