// A small SVG line chart (no library: the pages work offline). lineChart(container, series,
// {xLabel, format}) where series = [{name, points: [[x, y], ...]}]; null y values are gaps.
"use strict";

const CHART_COLORS = ["#2f5fd0", "#d0452f", "#1a7f37", "#9a6700", "#7a3fc0", "#00838f", "#5b6475", "#c2185b"];

function lineChart(container, series, options = {}) {
  const width = 640, height = 220, left = 56, right = 10, top = 10, bottom = 28;
  const format = options.format || ((v) => Number(v.toPrecision(3)).toString());
  const all = series.flatMap((s) => s.points.filter((p) => p[1] !== null && p[1] !== undefined));
  const ns = "http://www.w3.org/2000/svg";
  const svg = document.createElementNS(ns, "svg");
  svg.setAttribute("viewBox", `0 0 ${width} ${height}`);
  svg.setAttribute("preserveAspectRatio", "none");
  const add = (tag, attrs, text) => {
    const node = document.createElementNS(ns, tag);
    for (const [k, v] of Object.entries(attrs)) node.setAttribute(k, v);
    if (text !== undefined) node.textContent = text;
    svg.append(node);
    return node;
  };
  container.replaceChildren(svg);
  if (!all.length) {
    add("text", { x: width / 2, y: height / 2, "text-anchor": "middle" }, "no data yet");
    return;
  }
  let [x0, x1] = [Math.min(...all.map((p) => p[0])), Math.max(...all.map((p) => p[0]))];
  let [y0, y1] = [Math.min(...all.map((p) => p[1])), Math.max(...all.map((p) => p[1]))];
  if (options.zero) y0 = Math.min(0, y0);
  if (x1 === x0) x1 = x0 + 1;
  if (y1 === y0) { y1 += Math.abs(y1) * 0.1 || 1; y0 -= Math.abs(y0) * 0.1 || 0; }
  const sx = (x) => left + ((x - x0) / (x1 - x0)) * (width - left - right);
  const sy = (y) => top + (1 - (y - y0) / (y1 - y0)) * (height - top - bottom);
  add("line", { x1: left, y1: height - bottom, x2: width - right, y2: height - bottom, class: "axis" });
  add("line", { x1: left, y1: top, x2: left, y2: height - bottom, class: "axis" });
  for (const y of [y0, (y0 + y1) / 2, y1]) {
    add("text", { x: left - 4, y: sy(y) + 4, "text-anchor": "end" }, format(y));
    add("line", { x1: left, y1: sy(y), x2: width - right, y2: sy(y), class: "axis", "stroke-dasharray": "2 3" });
  }
  const xFormat = options.xFormat || ((v) => String(Math.round(v)));
  add("text", { x: left, y: height - 8 }, xFormat(x0));
  add("text", { x: width - right, y: height - 8, "text-anchor": "end" }, xFormat(x1));
  if (options.xLabel) add("text", { x: (left + width) / 2, y: height - 8, "text-anchor": "middle" }, options.xLabel);
  series.forEach((s, i) => {
    let path = "";
    let pen = "M";
    for (const [x, y] of s.points) {
      if (y === null || y === undefined) { pen = "M"; continue; }
      path += `${pen}${sx(x).toFixed(1)},${sy(y).toFixed(1)} `;
      pen = "L";
    }
    add("path", { d: path, fill: "none", stroke: CHART_COLORS[i % CHART_COLORS.length], "stroke-width": "1.5", "data-series": s.name });
  });
  if (series.length > 1 || options.legend) {
    const legend = document.createElement("div");
    legend.className = "legend";
    series.forEach((s, i) => {
      const item = document.createElement("span");
      item.style.color = CHART_COLORS[i % CHART_COLORS.length];
      item.textContent = "\u25A0 " + s.name;
      legend.append(item);
    });
    container.append(legend);
  }
}
