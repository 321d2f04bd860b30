// Bonsai Pipeline web page: the per-layer sparsity chart and the time axis of the stage timeline.
"use strict";

// Tick spacing for a span of `span_s` seconds: the smallest step from the list giving <= 8 ticks.
const TICK_STEPS_S = [0.05, 0.1, 0.2, 0.5, 1, 2, 5, 10, 15, 30, 60, 120, 300, 600, 900, 1800, 3600,
  7200, 14400, 21600, 43200, 86400];

function tickStep(span_s) {
  return TICK_STEPS_S.find((step) => span_s / step <= 8) || TICK_STEPS_S[TICK_STEPS_S.length - 1];
}

function tickLabel(s, step) {
  if (step < 60) return `${Number(s.toFixed(2))} s`;
  if (step < 3600) return `${Math.round(s / 60)} min`;
  return `${Number((s / 3600).toFixed(1))} h`;
}

// An axis row under the timeline's tracks: ticks every `step` seconds from 0 to `span_s`.
function timeAxis(span_s, t0) {
  const step = tickStep(span_s);
  const track = el("div", { class: "axis-track" });
  for (let s = 0; s <= span_s + 1e-9; s += step) {
    const left = (s / span_s) * 100;
    // CSSOM, not a style attribute: the page's CSP allows no inline styles.
    const tick = el("span", { class: "tick", "data-seconds": Number(s.toFixed(3)) },
      el("span", { class: "tick-label", text: tickLabel(s, step) }));
    tick.style.left = `${left}%`;
    track.append(tick);
  }
  return el("div", { class: "attempt axis-row" },
    el("span", { class: "label muted", text: "time" }),
    el("span"),
    track,
    el("span", { class: "details muted", text: `since ${new Date(t0).toLocaleTimeString()} (first queued)` }));
}

// Horizontal bars, one per layer, with a 0–100% axis; everything stays inside the viewBox.
function sparsityChart(layers, totals) {
  const names = Object.keys(layers).sort((a, b) => Number(a) - Number(b));
  const width = 420;
  const left = 62;        // layer labels
  const right = 110;      // value labels
  const plotW = width - left - right;
  const barH = 16;
  const gap = 6;
  const top = 4;
  const axisH = 30;       // ticks and their labels under the bars
  const plotH = names.length * (barH + gap);
  const height = top + plotH + axisH + 18;  // + the totals line
  const chart = svg("svg", { width: "100%", viewBox: `0 0 ${width} ${height}`, role: "img",
    "aria-label": "per-layer sparsity", preserveAspectRatio: "xMinYMin meet", class: "sparsity-chart" });
  chart.style.maxWidth = `${width}px`;
  const xOf = (v) => left + Math.min(1, Math.max(0, v)) * plotW;
  for (const v of [0, 0.25, 0.5, 0.75, 1]) {
    chart.append(svg("line", { x1: xOf(v), x2: xOf(v), y1: top, y2: top + plotH + 4, class: "grid" }));
    chart.append(svg("text", { x: xOf(v), y: top + plotH + 16, class: "axis tick", "text-anchor": "middle" },
      `${v * 100}%`));
  }
  names.forEach((name, i) => {
    const layer = layers[name];
    const value = layer.sparsity || 0;
    const y = top + i * (barH + gap);
    chart.append(svg("text", { x: 0, y: y + barH - 4, class: "axis" }, `layer ${name}`));
    const bar = svg("rect", { x: left, y, width: Math.max(1, xOf(value) - left), height: barH,
      class: "layer", "data-layer": name, "data-sparsity": value });
    const bpw = typeof layer.bits_per_weight === "number" ? layer.bits_per_weight : undefined;
    bar.append(svg("title", {}, `layer ${name}: ${pct(value)} zeros`
      + (bpw !== undefined ? `, ${bpw.toFixed(2)} bits/weight` : "")));
    chart.append(bar);
    // Values sit right of the plot area, so a 100% bar never pushes them out of the box.
    chart.append(svg("text", { x: left + plotW + 6, y: y + barH - 4, class: "axis value" },
      `${pct(value)}${bpw !== undefined ? ` · ${bpw.toFixed(2)} bpw` : ""}`));
  });
  chart.append(svg("text", { x: left + plotW / 2, y: top + plotH + 28, class: "axis", "text-anchor": "middle" },
    "zeros among the layer's ternary weights"));
  chart.append(svg("text", { x: 0, y: height - 4, class: "axis" }, typeof totals.sparsity === "number"
    ? `all ternary weights: ${pct(totals.sparsity)} zeros` : ""));
  return chart;
}
