// Hand-written canvas charts for the detslurm dashboard (no third-party code, works offline).
// lineChart: many series (one per trial) of already-downsampled points, with a min/max band when
// few series are shown; parallelCoords: one line per trial across hyperparameter axes.
"use strict";

const DS = window.DS || (window.DS = {});

DS.palette = (i) => `hsl(${(i * 137.508) % 360}, 62%, 45%)`;

function setupCanvas(canvas, height) {
  const ratio = window.devicePixelRatio || 1;
  const width = canvas.clientWidth || 600;
  canvas.width = Math.round(width * ratio);
  canvas.height = Math.round(height * ratio);
  canvas.style.height = height + "px";
  const ctx = canvas.getContext("2d");
  ctx.setTransform(ratio, 0, 0, ratio, 0, 0);
  return { ctx, width, height };
}

// "Nice" tick values (1, 2, 5 x 10^k) covering [lo, hi].
function ticks(lo, hi, count) {
  if (!(hi > lo)) { hi = lo + 1; }
  const raw = (hi - lo) / count;
  const mag = Math.pow(10, Math.floor(Math.log10(raw)));
  const step = [1, 2, 5, 10].map((m) => m * mag).find((s) => s >= raw);
  const out = [];
  for (let v = Math.ceil(lo / step) * step; v <= hi + step * 1e-9; v += step) out.push(v);
  return out;
}

function fmt(v) {
  if (v === null || v === undefined || Number.isNaN(v)) return "";
  const a = Math.abs(v);
  if (a !== 0 && (a >= 1e5 || a < 1e-3)) return v.toExponential(2);
  return String(Math.round(v * 1e4) / 1e4);
}
DS.fmt = fmt;

function extent(arrays) {
  let lo = Infinity, hi = -Infinity;
  for (const a of arrays) for (const v of a) { if (v < lo) lo = v; if (v > hi) hi = v; }
  return lo === Infinity ? [0, 1] : [lo, hi];
}

// series: [{label, color, x: [...], y: [...], lo?: [...], hi?: [...]}]
DS.lineChart = function (canvas, series, opts) {
  const { ctx, width, height } = setupCanvas(canvas, opts.height || 320);
  const pad = { l: 64, r: 16, t: 12, b: 36 };
  const W = width - pad.l - pad.r, H = height - pad.t - pad.b;
  const [x0, x1] = extent(series.map((s) => s.x));
  const bands = series.length <= 20;
  const [y0, y1] = extent(series.map((s) => s.y).concat(bands ? series.flatMap((s) => [s.lo || [], s.hi || []]) : []));
  const ySpan = y1 - y0 || Math.abs(y0) || 1;
  const yl = y0 - ySpan * 0.04, yh = y1 + ySpan * 0.04;
  const X = (v) => pad.l + ((v - x0) / (x1 - x0 || 1)) * W;
  const Y = (v) => pad.t + H - ((v - yl) / (yh - yl)) * H;
  ctx.clearRect(0, 0, width, height);
  ctx.font = "11px system-ui, sans-serif";
  ctx.strokeStyle = "#e5e9f0"; ctx.fillStyle = "#6b7686"; ctx.lineWidth = 1;
  for (const v of ticks(yl, yh, 6)) {
    ctx.beginPath(); ctx.moveTo(pad.l, Y(v)); ctx.lineTo(pad.l + W, Y(v)); ctx.stroke();
    ctx.textAlign = "right"; ctx.fillText(fmt(v), pad.l - 6, Y(v) + 4);
  }
  for (const v of ticks(x0, x1, 8)) {
    ctx.beginPath(); ctx.moveTo(X(v), pad.t); ctx.lineTo(X(v), pad.t + H); ctx.stroke();
    ctx.textAlign = "center"; ctx.fillText(fmt(v), X(v), pad.t + H + 16);
  }
  ctx.textAlign = "center"; ctx.fillText(opts.xLabel || "", pad.l + W / 2, height - 4);
  series.forEach((s) => {
    if (bands && s.lo && s.hi && s.x.length > 1) {
      ctx.globalAlpha = 0.12; ctx.fillStyle = s.color; ctx.beginPath();
      s.x.forEach((x, i) => (i ? ctx.lineTo(X(x), Y(s.hi[i])) : ctx.moveTo(X(x), Y(s.hi[i]))));
      for (let i = s.x.length - 1; i >= 0; i--) ctx.lineTo(X(s.x[i]), Y(s.lo[i]));
      ctx.closePath(); ctx.fill(); ctx.globalAlpha = 1;
    }
    ctx.strokeStyle = s.color; ctx.lineWidth = series.length > 100 ? 0.8 : 1.6; ctx.beginPath();
    s.x.forEach((x, i) => (i ? ctx.lineTo(X(x), Y(s.y[i])) : ctx.moveTo(X(x), Y(s.y[i]))));
    ctx.stroke();
    if (s.x.length === 1) { ctx.fillStyle = s.color; ctx.fillRect(X(s.x[0]) - 2, Y(s.y[0]) - 2, 4, 4); }
  });
  // What the tests (and curious users) can read back: how many curves and points are drawn.
  canvas.dataset.series = String(series.length);
  canvas.dataset.points = String(series.reduce((n, s) => n + s.x.length, 0));
  hover(canvas, series, { X, Y, pad, W, H, x0, x1 }, opts);
};

function hover(canvas, series, g, opts) {
  const tip = DS.tooltip || (DS.tooltip = document.body.appendChild(Object.assign(document.createElement("div"), { className: "tooltip" })));
  canvas.onmouseleave = () => { tip.style.display = "none"; };
  canvas.onmousemove = (ev) => {
    const r = canvas.getBoundingClientRect();
    const mx = ev.clientX - r.left, my = ev.clientY - r.top;
    let best = null, bestD = 12 * 12;
    for (const s of series) {
      for (let i = 0; i < s.x.length; i++) {
        const dx = g.X(s.x[i]) - mx, dy = g.Y(s.y[i]) - my, d = dx * dx + dy * dy;
        if (d < bestD) { bestD = d; best = { s, i }; }
      }
    }
    if (!best) { tip.style.display = "none"; return; }
    tip.textContent = `${best.s.label}: ${fmt(best.s.y[best.i])} at ${opts.xLabel || "x"} ${fmt(best.s.x[best.i])}`;
    Object.assign(tip.style, { display: "block", left: ev.clientX + 12 + "px", top: ev.clientY + 12 + "px" });
  };
}

// axes: [{name, values: [per line], categorical?}], lines colored by the last axis (the metric).
DS.parallelCoords = function (canvas, axes, opts) {
  const { ctx, width, height } = setupCanvas(canvas, opts.height || 300);
  const pad = { l: 40, r: 40, t: 24, b: 28 };
  const W = width - pad.l - pad.r, H = height - pad.t - pad.b;
  const n = axes.length ? axes[0].values.length : 0;
  ctx.clearRect(0, 0, width, height);
  ctx.font = "11px system-ui, sans-serif";
  const scales = axes.map((a) => {
    if (a.values.every((v) => typeof v === "number" || v === null)) {
      const nums = a.values.filter((v) => typeof v === "number");
      const [lo, hi] = extent([nums]);
      // A hyperparameter drawn log-uniformly (a learning rate) spreads out on a log axis.
      if (lo > 0 && hi / lo > 100) {
        const l0 = Math.log(lo), l1 = Math.log(hi);
        return { num: true, lo, hi, f: (v) => (typeof v === "number" && v > 0 ? (Math.log(v) - l0) / (l1 - l0) : null) };
      }
      return { num: true, lo, hi, f: (v) => (typeof v === "number" ? (hi > lo ? (v - lo) / (hi - lo) : 0.5) : null) };
    }
    const cats = [...new Set(a.values.map(String))].sort();
    return { num: false, cats, f: (v) => (cats.length > 1 ? cats.indexOf(String(v)) / (cats.length - 1) : 0.5) };
  });
  const AX = (i) => pad.l + (axes.length > 1 ? (i / (axes.length - 1)) * W : W / 2);
  const metric = scales[scales.length - 1];
  let drawn = 0;
  // Color follows the metric (flipped when larger is better); the best lines are drawn last, on
  // top, and many lines are fainter so that where they bunch still shows.
  const goodness = (j) => {
    const m = metric ? metric.f(axes[axes.length - 1].values[j]) : null;
    return m === null ? null : opts.smallerIsBetter ? 1 - m : m;
  };
  const order = [...Array(n).keys()].filter((j) => goodness(j) !== null).sort((a, b) => goodness(a) - goodness(b));
  const alpha = order.length > 200 ? 0.18 : 0.55;
  for (const j of order) {
    const good = goodness(j);
    ctx.strokeStyle = `hsla(${Math.round(good * 220)}, 70%, 45%, ${alpha})`;
    ctx.beginPath();
    axes.forEach((a, i) => {
      const p = scales[i].f(a.values[j]);
      const y = pad.t + H - (p === null ? 0 : p) * H;
      i ? ctx.lineTo(AX(i), y) : ctx.moveTo(AX(i), y);
    });
    ctx.stroke();
    drawn++;
  }
  ctx.fillStyle = "#1d2430"; ctx.strokeStyle = "#8a94a3";
  axes.forEach((a, i) => {
    ctx.beginPath(); ctx.moveTo(AX(i), pad.t); ctx.lineTo(AX(i), pad.t + H); ctx.stroke();
    ctx.textAlign = "center"; ctx.fillText(a.name, AX(i), pad.t - 8);
    const s = scales[i];
    const lo = s.num ? fmt(s.lo) : s.cats[0], hi = s.num ? fmt(s.hi) : s.cats[s.cats.length - 1];
    ctx.fillStyle = "#6b7686"; ctx.fillText(String(hi ?? ""), AX(i), pad.t + 10 - 14 + 28);
    ctx.fillText(String(lo ?? ""), AX(i), pad.t + H + 16); ctx.fillStyle = "#1d2430";
  });
  canvas.dataset.lines = String(drawn);
  canvas.dataset.axes = String(axes.length);
};
