// html.cpp: the self-contained HTML report. The page is static text below with the report's
// data embedded as JSON; its script draws the SVG charts and tables in the browser. Nothing is
// fetched: no fonts, no libraries, no network.
#include "zp/reports/html.hpp"

#include <algorithm>
#include <numeric>

#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include "zp/checked.hpp"
#include "zp/planner/model_states.hpp"
#include "zp/reports/junit.hpp"

namespace zp::reports {

std::vector<ZeroCurve> zero_curves(const Comparison& c) {
  std::vector<uint64_t> dps;
  for (uint64_t d = 1; d <= 1024; d *= 2) dps.push_back(d);
  const uint64_t own = static_cast<uint64_t>(std::max<int64_t>(c.strategy.dp, 1));
  if (std::find(dps.begin(), dps.end(), own) == dps.end()) {
    dps.push_back(own);
    std::sort(dps.begin(), dps.end());
  }
  std::vector<ZeroCurve> out;
  for (int stage = 0; stage <= 3; ++stage) {
    ZeroCurve z;
    z.stage = stage;
    for (uint64_t d : dps) {
      planner::Strategy s;
      s.precision = c.strategy.precision;
      s.optimizer = c.strategy.optimizer;
      s.stage = stage;
      s.dp = static_cast<int64_t>(d);
      z.dp.push_back(d);
      // Expert parallelism (the run's ep, or the largest part of it that divides d): a rank
      // holds the dense parameters and E/ep of the experts, their states partitioned over d
      // and d/ep ranks (DeepSpeed-MoE; planner::partition_elems).
      const uint64_t ep = std::gcd(d, static_cast<uint64_t>(std::max<int64_t>(c.strategy.ep, 1)));
      const uint64_t dense = c.n_params - c.n_expert_params, expert = c.n_expert_params / ep;
      const uint64_t held = dense + expert;
      const uint64_t part = zp::partition_elems(dense, d) + zp::partition_elems(expert, d / ep);
      z.bytes_per_device.push_back(
          planner::model_state_bytes(held, part, s)[planner::Tier::gpu].total());
    }
    out.push_back(std::move(z));
  }
  return out;
}

nlohmann::json html_data(const Comparison& c) {
  nlohmann::json curves = nlohmann::json::array();
  std::vector<uint64_t> dps;
  for (const ZeroCurve& z : zero_curves(c)) {
    curves.push_back({{"stage", z.stage}, {"bytes", z.bytes_per_device}});
    dps = z.dp;
  }
  return {{"report", to_json(c)},
          {"strategy_text", planner::describe(c.strategy)},
          {"zero",
           {{"dp", dps},
            {"current", {{"stage", c.strategy.stage}, {"dp", c.strategy.dp}}},
            {"curves", curves}}}};
}

namespace {

// JSON inside <script type="application/json">: '<', '>' and '&' written as \u escapes (valid
// JSON), so no string in the data can close the script element or open a comment.
std::string script_safe(const std::string& json) {
  std::string out;
  out.reserve(json.size());
  for (char ch : json) {
    if (ch == '<') out += "\\u003c";
    else if (ch == '>') out += "\\u003e";
    else if (ch == '&') out += "\\u0026";
    else out += ch;
  }
  return out;
}

constexpr std::string_view kHead = R"zphtml(<!DOCTYPE html>
<html lang="en">
<head>
<meta charset="utf-8">
<meta name="viewport" content="width=device-width, initial-scale=1">
<title>)zphtml";

constexpr std::string_view kStyle = R"zphtml(</title>
<style>
body { font-family: system-ui, -apple-system, "Segoe UI", sans-serif; margin: 24px; color: #222; }
h1 { font-size: 1.4em; margin-bottom: 4px; }
h2 { font-size: 1.15em; margin-top: 28px; border-bottom: 1px solid #ddd; padding-bottom: 4px; }
.sub { color: #555; margin: 2px 0; }
.ok { color: #1a7f37; font-weight: 600; }
.bad { color: #c62828; font-weight: 600; }
.chart { overflow-x: auto; }
svg text { font-size: 11px; fill: #333; }
svg .axis { stroke: #999; stroke-width: 1; }
svg .grid { stroke: #eee; stroke-width: 1; }
.legend span { display: inline-block; margin-right: 14px; font-size: 0.9em; }
.legend i { display: inline-block; width: 12px; height: 12px; margin-right: 4px; vertical-align: -2px; }
table { border-collapse: collapse; font-size: 0.9em; margin-top: 8px; }
th, td { padding: 3px 10px; border-bottom: 1px solid #eee; }
td.num, th.num { text-align: right; font-variant-numeric: tabular-nums; }
#zp-error { color: #c62828; white-space: pre-wrap; }
</style>
)zphtml";

constexpr std::string_view kOpenBody = "</head>\n<body>\n";

// The report's sections; the data follows in <script id="zp-data">.
constexpr std::string_view kReportSections = R"zphtml(<h1 id="zp-title">zeroplan report</h1>
<p class="sub" id="zp-strategy"></p>
<p id="zp-verdict"></p>
<p id="zp-error"></p>
<h2>Memory per device by category</h2>
<p class="sub">Each category's high-water mark, stacked; the black tick is the tier's peak (the
high-water of the sum, which can be lower since categories peak at different moments).</p>
<div class="legend" id="zp-legend"></div>
<div id="zp-memory"></div>
<h2>Memory over one step</h2>
<p class="sub">Bytes in use at each op of one micro-step (forward, backward, optimizer) on rank 0:
the prediction stacked by category, its total as a solid line, the measurement dashed.</p>
<div id="zp-timeline"></div>
<h2>ZeRO: model states per device against data-parallel degree</h2>
<p class="sub">The ZeRO paper's table as curves (both axes logarithmic): parameters, gradients and
optimizer states of this model under each stage; the ringed point is this run's strategy.</p>
<div id="zp-zero"></div>
<h2>Numbers</h2>
<div id="zp-table"></div>
<div id="zp-steps"></div>
<script type="application/json" id="zp-data">)zphtml";

constexpr std::string_view kScript = R"zphtml(</script>
<script>
"use strict";
(function () {
  const NS = "http://www.w3.org/2000/svg";  // the SVG namespace name, not a fetch
  const CATS = ["params", "grads", "master", "optimizer", "activations", "buffers", "workspace", "overhead"];
  const COLORS = { params: "#4e79a7", grads: "#f28e2b", master: "#e15759", optimizer: "#76b7b2",
                   activations: "#59a14f", buffers: "#edc948", workspace: "#b07aa1", overhead: "#9c755f" };
  const STAGE_COLORS = ["#6b6b6b", "#4e79a7", "#f28e2b", "#59a14f"];
  const STAGE_NAMES = ["stage 0 (baseline)", "stage 1 (P_os)", "stage 2 (P_os+g)", "stage 3 (P_os+g+p)"];
  const TIERS = ["gpu", "cpu", "nvme"];

  function el(name, attrs, parent) {
    const e = document.createElementNS(NS, name);
    for (const k in attrs) e.setAttribute(k, String(attrs[k]));
    if (parent) parent.appendChild(e);
    return e;
  }
  function html(name, text, parent, cls) {
    const e = document.createElement(name);
    if (text !== undefined && text !== null) e.textContent = text;
    if (cls) e.className = cls;
    if (parent) parent.appendChild(e);
    return e;
  }
  function label(parent, x, y, s, anchor) {
    const t = el("text", { x: x, y: y, "text-anchor": anchor || "start" }, parent);
    t.textContent = s;
    return t;
  }
  function tip(node, s) { el("title", {}, node).textContent = s; }
  // As zp::format_bytes: binary units, 3 significant digits.
  function fmtBytes(b) {
    if (b < 1024) return Math.round(b) + " B";
    const units = ["KiB", "MiB", "GiB", "TiB", "PiB", "EiB"];
    let v = b / 1024, i = 0;
    while (v >= 1024 && i < units.length - 1) { v /= 1024; ++i; }
    return (v >= 100 ? v.toFixed(1) : v.toFixed(2)) + " " + units[i];
  }
  // As zp::format_count: 124.4 M, 6.74 B, 1.00 T.
  function fmtCount(n) {
    for (const [scale, suffix] of [[1e12, "T"], [1e9, "B"], [1e6, "M"], [1e3, "K"]])
      if (n >= scale) { const v = n / scale; return (v >= 100 ? v.toFixed(1) : v.toFixed(2)) + " " + suffix; }
    return String(n);
  }
  function breakdown(perDevice, tier) {
    const t = perDevice && perDevice[tier];
    return CATS.map(c => (t && t.breakdown && t.breakdown[c]) || 0);
  }
  function peakOf(perDevice, tier) { return (perDevice && perDevice[tier] && perDevice[tier].total) || 0; }
  function sum(a) { return a.reduce((x, y) => x + y, 0); }
  function svgFor(parent, chart, tier, w, h, geo) {
    const svg = el("svg", { width: w, height: h, viewBox: "0 0 " + w + " " + h, "data-chart": chart,
                            "data-tier": tier, "data-left": geo.left, "data-top": geo.top,
                            "data-plot-width": geo.pw, "data-plot-height": geo.ph,
                            "data-max-bytes": geo.max }, null);
    const div = html("div", null, parent, "chart");
    div.appendChild(svg);
    return svg;
  }
  function yAxis(svg, geo, ticks) {
    for (const t of ticks) {
      el("line", { x1: geo.left, x2: geo.left + geo.pw, y1: t.y, y2: t.y, class: "grid" }, svg);
      label(svg, geo.left - 6, t.y + 4, t.text, "end");
    }
    el("line", { x1: geo.left, x2: geo.left, y1: geo.top, y2: geo.top + geo.ph, class: "axis" }, svg);
    el("line", { x1: geo.left, x2: geo.left + geo.pw, y1: geo.top + geo.ph, y2: geo.top + geo.ph, class: "axis" }, svg);
  }
  function linearTicks(geo) {
    const out = [];
    for (let i = 0; i <= 4; ++i) {
      const b = geo.max * i / 4;
      out.push({ y: geo.top + geo.ph - geo.ph * i / 4, text: fmtBytes(b) });
    }
    return out;
  }

  // Stacked bars: per tier, one group per rank, predicted (and measured) side by side.
  // Bar heights: bytes / max-bytes * plot-height; y grows downwards from the plot's bottom.
  function memoryCharts(report, root) {
    const kinds = report.ranks.length && report.ranks[0].measured ? ["predicted", "measured"] : ["predicted"];
    const BAR = 34, INNER = 6, GAP = 36;
    for (const tier of TIERS) {
      let max = 0;
      for (const r of report.ranks)
        for (const k of kinds) max = Math.max(max, sum(breakdown(r[k], tier)), peakOf(r[k], tier));
      if (max === 0) continue;
      const groupW = kinds.length * BAR + (kinds.length - 1) * INNER;
      const geo = { left: 90, top: 24, pw: GAP + report.ranks.length * (groupW + GAP), ph: 240, max: max };
      const svg = svgFor(root, "memory", tier, geo.left + geo.pw + 20, geo.top + geo.ph + 48, geo);
      label(svg, geo.left, 14, tier + " tier, per device");
      yAxis(svg, geo, linearTicks(geo));
      report.ranks.forEach((r, g) => {
        const gx = geo.left + GAP + g * (groupW + GAP);
        label(svg, gx + groupW / 2, geo.top + geo.ph + 32, "rank " + r.rank, "middle");
        kinds.forEach((kind, ki) => {
          const x = gx + ki * (BAR + INNER);
          const b = breakdown(r[kind], tier);
          let cum = 0;
          CATS.forEach((cat, ci) => {
            if (b[ci] === 0) return;
            const h = b[ci] / max * geo.ph;
            const y = geo.top + geo.ph - (cum + b[ci]) / max * geo.ph;
            const rect = el("rect", { x: x, y: y, width: BAR, height: h, fill: COLORS[cat],
                                      "data-rank": r.rank, "data-kind": kind, "data-category": cat,
                                      "data-bytes": b[ci] }, svg);
            tip(rect, "rank " + r.rank + " " + kind + " " + tier + " " + cat + ": " + fmtBytes(b[ci]));
            cum += b[ci];
          });
          const peak = peakOf(r[kind], tier);
          const py = geo.top + geo.ph - peak / max * geo.ph;
          const line = el("line", { x1: x - 3, x2: x + BAR + 3, y1: py, y2: py, stroke: "#000",
                                    "stroke-width": 2, "data-peak-bytes": peak, "data-rank": r.rank,
                                    "data-kind": kind }, svg);
          tip(line, "rank " + r.rank + " " + kind + " " + tier + " peak: " + fmtBytes(peak));
          label(svg, x + BAR / 2, geo.top + geo.ph + 14, kind === "predicted" ? "pred." : "meas.", "middle");
        });
      });
    }
  }

  // Timeline: x = (pos + 1) / n_ops of the plot width (pos -1: before the first op), y as bars.
  function timelineCharts(report, root) {
    const tl = report.timeline;
    if (!tl || (!tl.predicted.length && !tl.measured.length)) {
      html("p", "No timeline was recorded for this report.", root, "sub");
      return;
    }
    const nOps = Math.max(tl.ops.length, 1);
    for (const tier of TIERS) {
      const rows = s => CATS.map((c, ci) => (s[tier] ? s[tier][ci] : 0));
      const pTot = tl.predicted.map(s => sum(rows(s)));
      const mTot = tl.measured.map(s => sum(rows(s)));
      const max = Math.max(0, ...pTot, ...mTot);
      if (max === 0) continue;
      const geo = { left: 90, top: 24, pw: 760, ph: 240, max: max };
      const svg = svgFor(root, "timeline", tier, geo.left + geo.pw + 20, geo.top + geo.ph + 40, geo);
      label(svg, geo.left, 14, tier + " tier, bytes in use");
      yAxis(svg, geo, linearTicks(geo));
      label(svg, geo.left + geo.pw / 2, geo.top + geo.ph + 30, "op position in the step (" + tl.ops.length + " ops)", "middle");
      const X = pos => geo.left + (pos + 1) / nOps * geo.pw;
      const Y = b => geo.top + geo.ph - b / max * geo.ph;
      const lower = tl.predicted.map(() => 0);
      CATS.forEach((cat, ci) => {
        const vals = tl.predicted.map(s => rows(s)[ci]);
        if (!vals.some(v => v > 0)) return;
        const upper = lower.map((l, i) => l + vals[i]);
        const pts = [];
        tl.predicted.forEach((s, i) => pts.push(X(s.pos) + "," + Y(upper[i])));
        for (let i = tl.predicted.length - 1; i >= 0; --i) pts.push(X(tl.predicted[i].pos) + "," + Y(lower[i]));
        const poly = el("polygon", { points: pts.join(" "), fill: COLORS[cat], "fill-opacity": 0.75,
                                     "data-series": "predicted:" + cat }, svg);
        tip(poly, "predicted " + cat + ", peak " + fmtBytes(Math.max(...vals)));
        upper.forEach((u, i) => { lower[i] = u; });
      });
      const line = (series, totals, attrs) => {
        if (!series.length) return;
        const pts = series.map((s, i) => X(s.pos) + "," + Y(totals[i])).join(" ");
        const pl = el("polyline", Object.assign({ points: pts, fill: "none", "data-series": attrs.name,
                                                  "data-n-points": series.length }, attrs.style), svg);
        let at = 0;
        totals.forEach((t, i) => { if (t > totals[at]) at = i; });
        const pos = series[at].pos;
        tip(pl, attrs.name + ": peak " + fmtBytes(totals[at]) + " at " + (pos >= 0 ? tl.ops[pos] : "the start"));
      };
      line(tl.predicted, pTot, { name: "predicted-total", style: { stroke: "#000", "stroke-width": 1.5 } });
      line(tl.measured, mTot, { name: "measured-total", style: { stroke: "#c62828", "stroke-width": 1.5,
                                                                 "stroke-dasharray": "5,3" } });
    }
  }

  // ZeRO curves: x = log2(dp) / log2(max dp) of the width; y = log10(bytes) between the
  // smallest and largest value, top is largest.
  function zeroChart(zero, root) {
    const all = [].concat(...zero.curves.map(c => c.bytes)).filter(b => b > 0);
    if (!all.length) return;
    const lmin = Math.log10(Math.min(...all));
    let lmax = Math.log10(Math.max(...all));
    if (lmax === lmin) lmax = lmin + 1;
    const geo = { left: 90, top: 24, pw: 560, ph: 260, max: Math.max(...all) };
    const svg = svgFor(root, "zero", "gpu", geo.left + geo.pw + 200, geo.top + geo.ph + 44, geo);
    svg.setAttribute("data-min-bytes", String(Math.min(...all)));
    const maxDp = Math.max(...zero.dp, 2);
    const X = d => geo.left + Math.log2(d) / Math.log2(maxDp) * geo.pw;
    const Y = b => geo.top + geo.ph * (1 - (Math.log10(b) - lmin) / (lmax - lmin));
    const ticks = [];
    for (let i = 0; i <= 4; ++i) {
      const l = lmin + (lmax - lmin) * i / 4;
      ticks.push({ y: Y(Math.pow(10, l)), text: fmtBytes(Math.pow(10, l)) });
    }
    yAxis(svg, geo, ticks);
    for (const d of zero.dp) label(svg, X(d), geo.top + geo.ph + 14, String(d), "middle");
    label(svg, geo.left + geo.pw / 2, geo.top + geo.ph + 32, "data-parallel degree (Nd)", "middle");
    label(svg, geo.left, 14, "model states per device (gpu tier, no offload)");
    zero.curves.forEach(c => {
      const color = STAGE_COLORS[c.stage];
      const pts = [];
      zero.dp.forEach((d, i) => { if (c.bytes[i] > 0) pts.push(X(d) + "," + Y(c.bytes[i])); });
      el("polyline", { points: pts.join(" "), fill: "none", stroke: color, "stroke-width": 2,
                       "data-stage": c.stage }, svg);
      zero.dp.forEach((d, i) => {
        if (c.bytes[i] <= 0) return;
        const cur = c.stage === zero.current.stage && d === zero.current.dp;
        const dot = el("circle", { cx: X(d), cy: Y(c.bytes[i]), r: cur ? 7 : 3, fill: cur ? "none" : color,
                                   stroke: color, "stroke-width": cur ? 2.5 : 1, "data-stage": c.stage,
                                   "data-dp": d, "data-bytes": c.bytes[i], "data-current": cur ? 1 : 0 }, svg);
        tip(dot, STAGE_NAMES[c.stage] + ", Nd " + d + ": " + fmtBytes(c.bytes[i]));
      });
      const last = c.bytes[c.bytes.length - 1];
      if (last > 0) label(svg, geo.left + geo.pw + 8, Y(last) + 4, STAGE_NAMES[c.stage]);
    });
  }

  function tables(report, root, stepsRoot) {
    const measured = report.ranks.length && report.ranks[0].measured;
    const t = html("table", null, root);
    const head = html("tr", null, t);
    for (const h of ["rank", "tier", "category", "predicted"].concat(measured ? ["measured", "error"] : []))
      html("th", h, head, h === "predicted" || h === "measured" || h === "error" ? "num" : null);
    for (const r of report.ranks)
      for (const tier of TIERS) {
        if (!peakOf(r.predicted, tier) && !(measured && peakOf(r.measured, tier))) continue;
        const pb = breakdown(r.predicted, tier), mb = measured ? breakdown(r.measured, tier) : null;
        const rows = CATS.map((c, i) => [c, pb[i], mb ? mb[i] : null]);
        rows.push(["peak", peakOf(r.predicted, tier), measured ? peakOf(r.measured, tier) : null]);
        for (const [cat, p, m] of rows) {
          if (!p && !m) continue;
          const tr = html("tr", null, t);
          html("td", String(r.rank), tr, "num");
          html("td", tier, tr);
          html("td", cat, tr);
          html("td", fmtBytes(p), tr, "num");
          if (measured) {
            html("td", fmtBytes(m), tr, "num");
            html("td", (p ? Math.abs(m - p) / p * 100 : (m ? 100 : 0)).toFixed(2) + "%", tr, "num");
          }
        }
      }
    if (report.steps && report.steps.length) {
      const s = html("table", null, stepsRoot);
      const h = html("tr", null, s);
      for (const c of ["step", "loss", "seconds", "grad norm", "loss scale"]) html("th", c, h, "num");
      for (const st of report.steps) {
        const tr = html("tr", null, s);
        html("td", String(st.step), tr, "num");
        html("td", st.loss.toFixed(4) + (st.skipped ? " (skipped)" : ""), tr, "num");
        html("td", st.seconds.toFixed(3), tr, "num");
        html("td", st.grad_norm.toFixed(4), tr, "num");
        html("td", String(st.loss_scale), tr, "num");
      }
    }
  }

  // Draws html_data()'s object into the page's sections, replacing what they held (the serve
  // page calls it again on every change).
  function draw(data) {
    try {
      for (const id of ["zp-legend", "zp-memory", "zp-timeline", "zp-zero", "zp-table", "zp-steps", "zp-error"])
        document.getElementById(id).replaceChildren();
      const report = data.report;
      document.getElementById("zp-title").textContent =
          "zeroplan report: " + report.model.name + " (" + fmtCount(report.model.params) + " params)";
      document.getElementById("zp-strategy").textContent =
          data.strategy_text + "; " + report.device + " backend; " + report.ranks.length + " rank(s)";
      const v = document.getElementById("zp-verdict");
      if (report.verdict) {
        v.textContent = (report.verdict.within_tolerance ? "ok: every peak within " : "MISMATCH: a peak is ") +
            report.verdict.max_error_pct.toFixed(2) +
            (report.verdict.within_tolerance ? "% of" : "% off") + " the prediction (tolerance " +
            report.verdict.tolerance_pct.toFixed(2) + "%)";
        v.className = report.verdict.within_tolerance ? "ok" : "bad";
      } else {
        v.textContent = "prediction only (nothing measured)";
      }
      const legend = document.getElementById("zp-legend");
      for (const c of CATS) {
        const s = html("span", null, legend);
        html("i", null, s).style.background = COLORS[c];
        s.appendChild(document.createTextNode(c));
      }
      memoryCharts(report, document.getElementById("zp-memory"));
      timelineCharts(report, document.getElementById("zp-timeline"));
      zeroChart(data.zero, document.getElementById("zp-zero"));
      tables(report, document.getElementById("zp-table"), document.getElementById("zp-steps"));
      document.body.setAttribute("data-zp-status", "ok");
    } catch (e) {
      fail(e);
    }
  }
  function fail(e) {
    document.getElementById("zp-error").textContent = "This report could not be drawn: " + e;
    document.body.setAttribute("data-zp-status", "error: " + e);
  }
  window.zpDraw = draw;
  window.zpFmtBytes = fmtBytes;
  const embedded = document.getElementById("zp-data").textContent;
  if (embedded.trim() !== "") {
    try {
      draw(JSON.parse(embedded));
    } catch (e) {
      fail(e);
    }
  }
})();
</script>
)zphtml";

constexpr std::string_view kTail = R"zphtml(</body>
</html>
)zphtml";

// zero-plan serve: the page's own style, its form (between kServeForm's halves: the catalog's
// <option>s, then the hardware presets'), and its script, which posts the form to /api/estimate
// and /api/fit and draws the answers with the report's zpDraw.
constexpr std::string_view kServeStyle = R"zphtml(<style>
form { display: flex; flex-wrap: wrap; gap: 12px; }
fieldset { border: 1px solid #ddd; padding: 8px 12px; }
fieldset label { display: inline-block; margin: 4px 10px 4px 0; font-size: 0.9em; }
input[type=number] { width: 6em; }
#zp-config { width: 100%; box-sizing: border-box; font-family: ui-monospace, monospace; font-size: 0.85em; }
#zp-summary span { margin-right: 18px; font-weight: 600; }
#zp-serve-error { color: #c62828; white-space: pre-wrap; font-size: 1em; }
body[data-zp-serve="error"] #zp-memory, body[data-zp-serve="error"] #zp-timeline,
body[data-zp-serve="error"] #zp-zero, body[data-zp-serve="error"] #zp-table,
body[data-zp-serve="error"] #zp-fit { opacity: 0.25; }
</style>
)zphtml";

constexpr std::string_view kServeFormModels = R"zphtml(</head>
<body data-zp-serve="busy">
<h1>zero-plan serve</h1>
<p class="sub">Will this run fit? Change anything and the estimate, the charts and the fit table
follow; the address bar holds the inputs, so the URL shares them.</p>
<form id="zp-form" autocomplete="off" onsubmit="return false">
<fieldset><legend>Model</legend>
<label>catalog <select name="model">)zphtml";

constexpr std::string_view kServeFormHardware = R"zphtml(</select></label>
<label>or a config.json <input type="file" id="zp-file" accept=".json,application/json"></label><br>
<textarea name="config" id="zp-config" rows="3" cols="60"
 placeholder="or paste a config.json here (what save_pretrained writes); empty: the catalog model"></textarea>
</fieldset>
<fieldset><legend>Strategy</legend>
<label>ZeRO stage <select name="stage"><option>0</option><option>1</option><option selected>2</option><option>3</option></select></label>
<label>data-parallel degree <input name="dp" type="number" min="1" value="8" size="5"></label>
<label>micro-batch <input name="micro_batch" type="number" min="1" value="1" size="4"></label>
<label>sequence <input name="seq" type="number" min="1" placeholder="model's" size="6"></label>
<label>grad. accumulation <input name="grad_accum" type="number" min="1" placeholder="1" size="4"></label><br>
<label>precision <select name="precision"><option value="">bf16 (default)</option><option>bf16</option><option>fp16</option><option>fp32</option></select></label>
<label>checkpointing <select name="checkpointing"><option>none</option><option>full</option><option>selective</option></select></label>
<label>attention <select name="attention"><option value="">the profile's default</option><option>eager</option><option>sdpa</option><option>flash</option></select></label>
<label>optimizer offload <select name="offload_optimizer"><option>none</option><option>cpu</option><option>nvme</option></select></label>
<label>parameter offload <select name="offload_param"><option>none</option><option>cpu</option><option>nvme</option></select></label>
</fieldset>
<fieldset><legend>Target</legend>
<label>profile <select name="profile"><option>zeroplan</option><option>deepspeed</option><option>fsdp</option><option>pytorch</option></select></label>
<label>hardware <select name="hardware"><option value="">none</option>)zphtml";

constexpr std::string_view kServeFormEnd = R"zphtml(</select></label>
<label>GPUs for the fit table <input name="gpus" type="number" min="1" value="8" size="5"></label>
</fieldset>
</form>
<p id="zp-summary"></p>
<pre id="zp-serve-error"></pre>
<h2>Fastest configurations that fit (zero-plan fit)</h2>
<p class="sub">The search over ZeRO stage, offload, micro-batch and checkpointing for the model,
sequence, precision, profile and GPUs above; the strategy fields are not pinned here.</p>
<div id="zp-fit"></div>
)zphtml";

constexpr std::string_view kServeScript = R"zphtml(<script>
"use strict";
(function () {
  const form = document.getElementById("zp-form");
  const config = document.getElementById("zp-config");
  // What the fit search is told; the other fields are what it searches.
  const FIT_KEYS = ["profile", "hardware", "gpus", "seq", "precision", "attention"];
  let generation = 0, timer = null;

  function toBase64Url(text) {
    let bin = "";
    for (const b of new TextEncoder().encode(text)) bin += String.fromCharCode(b);
    return btoa(bin).replace(/\+/g, "-").replace(/\//g, "_").replace(/=+$/, "");
  }
  function fromBase64Url(s) {
    const bin = atob(s.replace(/-/g, "+").replace(/_/g, "/"));
    return new TextDecoder().decode(Uint8Array.from(bin, (c) => c.charCodeAt(0)));
  }
  // Every field that holds a value (the pasted config apart), by name.
  function fields() {
    const out = {};
    for (const e of form.elements)
      if (e.name && e.name !== "config" && e.value.trim() !== "") out[e.name] = e.value.trim();
    return out;
  }
  function readQuery() {
    const q = new URLSearchParams(location.search);
    for (const e of form.elements) {
      if (!e.name || !q.has(e.name)) continue;
      if (e.name === "config") {
        try { e.value = fromBase64Url(q.get("config")); } catch (x) { e.value = ""; }
      } else {
        e.value = q.get(e.name);
      }
    }
  }
  function writeQuery() {
    const q = new URLSearchParams(fields());
    if (config.value.trim() !== "") { q.delete("model"); q.set("config", toBase64Url(config.value)); }
    history.replaceState(null, "", "?" + q.toString());
  }
  function request(keys) {
    const f = fields(), keywords = {};
    for (const [k, v] of Object.entries(f))
      if (k !== "model" && (keys ? keys.includes(k) : k !== "gpus")) keywords[k] = v;
    const body = { keywords: keywords };
    if (config.value.trim() !== "") body.config = config.value; else body.model = f.model;
    return body;
  }
  async function post(path, body) {
    const r = await fetch(path, { method: "POST", headers: { "Content-Type": "application/json" },
                                  body: JSON.stringify(body) });
    const j = await r.json();
    if (!r.ok) throw j;
    return j;
  }
  function node(name, text, parent, cls) {
    const e = document.createElement(name);
    if (text !== null) e.textContent = text;
    if (cls) e.className = cls;
    parent.appendChild(e);
    return e;
  }
  function summary(est) {
    const root = document.getElementById("zp-summary");
    root.replaceChildren();
    for (const tier of ["gpu", "cpu", "nvme"]) {
      const t = est.per_device[tier];
      if (!t || !t.total) continue;
      const s = node("span", tier + ": " + zpFmtBytes(t.total) + " per device", root);
      s.setAttribute("data-tier", tier);
      s.setAttribute("data-bytes", String(t.total));
    }
    if (est.fits === true || est.fits === false) {
      const s = node("span", (est.fits ? "fits " : "does not fit ") + est.hardware.name, root,
                     est.fits ? "ok" : "bad");
      s.setAttribute("data-fits", String(est.fits));
    }
  }
  function describe(s) {
    let out = "stage " + s.stage + " dp " + s.dp;
    if (s.tp > 1) out += " tp " + s.tp;
    out += " B=" + s.micro_batch;
    if (s.checkpointing !== "none") out += " ckpt " + s.checkpointing;
    if (s.offload_optimizer !== "none") out += " opt->" + s.offload_optimizer;
    if (s.offload_param !== "none") out += " params->" + s.offload_param;
    if (s.dpu) out += " dpu";
    if (s.grad_accum > 1) out += " ga " + s.grad_accum;
    return out;
  }
  function fitTable(fit) {
    const root = document.getElementById("zp-fit");
    root.replaceChildren();
    if (!fit) { node("p", "choose a hardware preset to search configurations", root, "sub"); return; }
    node("p", fit.n_searched + " configurations searched on " + fit.gpus + " x " + fit.hardware +
         ", " + fit.n_fit + " fit", root, "sub");
    if (fit.candidates.length === 0) {
      node("p", "nothing fits; the closest: " + describe(fit.closest.strategy), root, "bad");
      for (const s of fit.closest.shortfalls) node("p", s, root, "sub");
      return;
    }
    const table = node("table", null, root);
    const head = node("tr", null, table);
    for (const h of ["#", "strategy", "gpu peak", "step s", "tokens/s", "TFLOP/s"]) node("th", h, head);
    fit.candidates.forEach((c, i) => {
      const tr = node("tr", null, table);
      tr.setAttribute("data-fit-rank", String(i + 1));
      tr.setAttribute("data-gpu-bytes", String(c.per_device.gpu.total));
      node("td", String(i + 1), tr, "num");
      node("td", describe(c.strategy), tr);
      node("td", zpFmtBytes(c.per_device.gpu.total), tr, "num");
      node("td", c.step_seconds.toFixed(3), tr, "num");
      node("td", c.tokens_per_second.toFixed(0), tr, "num");
      node("td", c.tflops_per_gpu.toFixed(1), tr, "num");
    });
  }
  async function update() {
    const mine = ++generation;
    writeQuery();
    document.body.setAttribute("data-zp-serve", "busy");
    try {
      const est = await post("/api/estimate", request(null));
      const f = fields();
      const fit = f.hardware ? (await post("/api/fit", request(FIT_KEYS))).result : null;
      if (mine !== generation) return;
      document.getElementById("zp-serve-error").textContent = "";
      zpDraw(est.report);
      summary(est.result);
      fitTable(fit);
      document.body.setAttribute("data-zp-serve", "ready");
    } catch (e) {
      if (mine !== generation) return;
      document.getElementById("zp-serve-error").textContent =
          e && e.error ? "error: " + e.error + (e.hint ? "\nhint: " + e.hint : "") : "error: " + e;
      document.getElementById("zp-summary").replaceChildren();
      document.body.setAttribute("data-zp-serve", "error");
    }
  }
  function soon() { clearTimeout(timer); timer = setTimeout(update, 250); }
  form.addEventListener("input", soon);
  form.addEventListener("change", soon);
  document.getElementById("zp-file").addEventListener("change", async (ev) => {
    const file = ev.target.files[0];
    if (file) { config.value = await file.text(); soon(); }
  });
  readQuery();
  update();
})();
</script>
)zphtml";

}  // namespace

std::string render_serve_page(const std::vector<std::string>& models,
                              const std::vector<std::string>& hardware) {
  std::string out(kHead);
  out += "zero-plan serve";
  out += kStyle;
  out += kServeStyle;
  out += kServeFormModels;
  for (const std::string& m : models)
    out += fmt::format("<option{}>{}</option>", m == "gpt2-xl" ? " selected" : "", xml_escape(m));
  out += kServeFormHardware;
  for (const std::string& h : hardware) out += fmt::format("<option>{}</option>", xml_escape(h));
  out += kServeFormEnd;
  // The report's sections, empty until the first answer, and its drawing script.
  out += kReportSections;
  out += kScript;
  out += kServeScript;
  out += kTail;
  return out;
}

std::string render_html(const Comparison& c) {
  std::string out(kHead);
  out += xml_escape(fmt::format("zeroplan: {} ({})", c.model, planner::describe(c.strategy)));
  out += kStyle;
  out += kOpenBody;
  out += kReportSections;
  out += script_safe(html_data(c).dump());
  out += kScript;
  out += kTail;
  return out;
}

}  // namespace zp::reports
