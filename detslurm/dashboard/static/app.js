// The detslurm dashboard: a small hash-routed page over the server's JSON. Everything shown
// comes from the store, and much of it from trials (names, metrics, logs): it is put in the page
// as text nodes only, never as HTML.
"use strict";

const CONFIG = JSON.parse(document.getElementById("detslurm-config").textContent);
const app = document.getElementById("app");
let timers = [];
// Bumped on every navigation: an answer that arrives for a page the user has left is dropped
// (a refresh in flight must not draw over the new page).
let generation = 0;
class Stale extends Error {}

function h(tag, attrs, ...children) {
  const el = document.createElement(tag);
  for (const [k, v] of Object.entries(attrs || {})) {
    if (k === "class") el.className = v;
    else if (k.startsWith("on")) el.addEventListener(k.slice(2), v);
    else if (v !== null && v !== undefined && v !== false) el.setAttribute(k, v === true ? "" : v);
  }
  for (const c of children.flat()) {
    if (c === null || c === undefined || c === false) continue;
    el.append(c instanceof Node ? c : document.createTextNode(String(c)));
  }
  return el;
}

// replaceChildren() would print a null (an absent section) as the text "null".
function show(...nodes) {
  app.replaceChildren(...nodes.flat().filter((n) => n !== null && n !== undefined && n !== false));
}

async function api(path, opts) {
  const g = generation;
  const resp = await fetch(path, Object.assign({ credentials: "same-origin" }, opts || {}));
  const body = await resp.json().catch(() => ({ error: resp.statusText }));
  if (g !== generation) throw new Stale("page left");
  if (!resp.ok) throw new Error(body.error || resp.statusText);
  return body;
}

// Pages of things still running poll for news at this interval (one cheap request each time).
const REFRESH_MS = 15000;
const TERMINAL = new Set(["COMPLETED", "CANCELED", "ERROR"]);

const state = (s) => h("span", { class: "state " + s }, s);
const bar = (p) => h("span", { class: "bar", title: Math.round(p * 100) + "%" }, h("i", { style: `width:${Math.round(p * 100)}%` }));
const time = (t) => (t ? t.replace("T", " ").slice(0, 19) : "");
const size = (n) => (n >= 1 << 30 ? (n / (1 << 30)).toFixed(2) + " GiB" : n >= 1 << 20 ? (n / (1 << 20)).toFixed(1) + " MiB" : n >= 1024 ? (n / 1024).toFixed(1) + " KiB" : n + " B");

function table(id, headers, rows) {
  return h("table", { id },
    h("thead", {}, h("tr", {}, headers.map((x) => h("th", { class: x.startsWith("#") ? "num" : "" }, x.replace(/^#/, ""))))),
    h("tbody", {}, rows.map((r) => h("tr", {}, r.map((c, i) => h("td", { class: headers[i].startsWith("#") ? "num" : "" }, c))))));
}

function card(label, value) {
  return h("div", { class: "card" }, h("b", {}, label), value);
}

function select(id, options, value, onchange) {
  const s = h("select", { id, onchange: (e) => onchange(e.target.value) }, options.map(([v, label]) => h("option", { value: v }, label)));
  s.value = value;
  return s;
}

// ---- pages ------------------------------------------------------------------------------

async function experimentsPage() {
  const rows = await api("/api/experiments");
  show(
    h("h1", {}, "Experiments"),
    rows.length === 0 ? h("p", { class: "muted" }, "No experiments yet: det experiment create CONFIG CONTEXT") :
      table("experiments", ["#ID", "Name", "State", "Progress", "Best metric", "Searcher", "#Trials", "Owner", "Pool", "Started"],
        rows.map((e) => [
          h("a", { href: `#/experiments/${e.id}` }, String(e.id)), h("a", { href: `#/experiments/${e.id}` }, e.name),
          state(e.state), h("span", {}, bar(e.progress), " ", Math.round(e.progress * 100) + "%"),
          e.best_metric === null ? "" : `${e.metric} ${DS.fmt(e.best_metric)}`, e.searcher, String(e.trials),
          e.owner, e.resource_pool || "default", time(e.start_time),
        ])));
}

function axisOptions(epochsPerBatch) {
  const out = [["batches", "Batches"], ["time", "Time (s)"]];
  if (epochsPerBatch) out.splice(1, 0, ["epochs", "Epochs"]);
  return out;
}

function toSeries(curves, axis) {
  const factor = curves.epochs_per_batch || 1;
  return curves.series.map((s, i) => ({
    label: `trial ${s.trial_id}`, color: DS.palette(s.trial_id),
    x: axis === "time" ? s.seconds : axis === "epochs" ? s.batches.map((b) => b * factor) : s.batches,
    y: s.value, lo: s.vmin, hi: s.vmax,
  }));
}

// A metric chart with its selectors; `base` is the curves endpoint (experiment or trial).
function metricChart(base, names, initial) {
  const choices = Object.entries(names).flatMap(([g, ms]) => ms.map((m) => [`${g}\u0000${m}`, `${g} / ${m}`]));
  const view = { key: initial && choices.some((c) => c[0] === initial) ? initial : (choices[0] || [""])[0], axis: "batches", curves: null };
  const canvas = h("canvas", { id: "curves" });
  const info = h("span", { class: "legend", id: "curves-info" });
  const axisSel = h("span", {});
  const draw = () => {
    if (!view.curves) return;
    DS.lineChart(canvas, toSeries(view.curves, view.axis), { xLabel: view.axis === "time" ? "seconds" : view.axis });
    const raw = view.curves.series.reduce((n, s) => n + s.raw_points, 0);
    info.textContent = `${view.curves.series.length} trials, ${canvas.dataset.points} of ${raw} points drawn`;
  };
  const load = async () => {
    if (!view.key) { info.textContent = "no metrics reported yet"; return; }
    const [group, metric] = view.key.split("\u0000");
    view.curves = await api(`${base}?group=${encodeURIComponent(group)}&metric=${encodeURIComponent(metric)}`);
    axisSel.replaceChildren(select("x-axis", axisOptions(view.curves.epochs_per_batch), view.axis, (v) => { view.axis = v; draw(); }));
    draw();
  };
  const panel = h("div", { class: "panel" },
    h("div", { class: "controls" }, "Metric ", select("metric", choices, view.key, (v) => { view.key = v; load(); }), " x axis ", axisSel, info),
    canvas);
  return { panel, load };
}

function actionButtons(exp) {
  if (!CONFIG.actions) return null;
  const act = async (action) => {
    if (action === "kill" && !confirm(`Kill experiment ${exp.id}?`)) return;
    await api(`/api/experiments/${exp.id}/${action}`, { method: "POST", headers: { "X-Detslurm-Token": CONFIG.token } });
    route();
  };
  return h("div", { class: "controls" }, ["pause", "activate", "kill"].map((a) =>
    h("button", { id: `action-${a}`, class: a === "kill" ? "danger" : "", onclick: () => act(a) }, a)));
}

function hparamView(data) {
  const plain = data.hparam_names.filter((n) => data.trials.some((t) => typeof t.hparams[n] !== "object"));
  // Constants (the same value in every trial) say nothing about the metric: only what varies is drawn.
  const varying = plain.filter((n) => new Set(data.trials.map((t) => JSON.stringify(t.hparams[n]))).size > 1);
  const names = varying.length ? varying : plain;
  const e = data.experiment;
  const withMetric = data.trials.filter((t) => t.searcher_metric !== null);
  const axes = names.map((n) => ({ name: n, values: withMetric.map((t) => t.hparams[n]) }));
  axes.push({ name: e.metric || "searcher metric", values: withMetric.map((t) => t.searcher_metric) });
  const canvas = h("canvas", { id: "hparams" });
  setTimeout(() => DS.parallelCoords(canvas, axes, { smallerIsBetter: e.smaller_is_better }), 0);
  return h("div", { class: "panel" }, h("div", { class: "legend" }, `${withMetric.length} trials with a searcher metric; blue: better, red: worse`), canvas);
}

function rungTable(rungs) {
  if (!rungs.length) return null;
  return [h("h2", {}, "ASHA rungs"), table("rungs", ["Bracket", "Rung", "#Length", "#Trials", "Best (searcher's sign)", "Promoted"],
    rungs.map((r) => [String(r.bracket), String(r.index), String(r.units), String(r.trials.length),
      r.trials.slice(0, 5).map((t, i) => `t${t}: ${DS.fmt(r.metrics[i])}`).join(", "), r.promoted.map((t) => "t" + t).join(", ")]))];
}

async function experimentPage(id) {
  const data = await api(`/api/experiments/${id}`);
  const e = data.experiment;
  const chart = metricChart(`/api/experiments/${id}/curves`, data.metric_names, e.metric ? `validation\u0000${e.metric}` : null);
  show(
    h("h1", {}, `Experiment ${e.id}: `, e.name),
    h("div", { class: "cards" }, card("State", state(e.state)), card("Progress", `${Math.round(e.progress * 100)}%`),
      card("Searcher", e.searcher), card("Best " + (e.metric || "metric"), e.best_metric === null ? "-" : DS.fmt(e.best_metric)),
      card("Trials", String(data.trials.length)), card("Owner", e.owner), card("Pool", e.resource_pool || "default")),
    actionButtons(e), data.error ? h("p", { class: "error" }, data.error) : null,
    h("h2", {}, "Metrics"), chart.panel,
    rungTable(data.rungs),
    h("h2", {}, "Hyperparameters against the searcher metric"), hparamView(data),
    h("h2", {}, "Trials"),
    table("trials", ["#ID", "State", "#Batches", "Searcher metric", "Rung", "#Restarts", "Hyperparameters"],
      data.trials.map((t) => [h("a", { href: `#/trials/${t.id}` }, String(t.id)), state(t.state), String(t.batches),
        t.searcher_metric === null ? "" : DS.fmt(t.searcher_metric), t.rung === null ? "" : String(t.rung), String(t.restarts),
        Object.entries(t.hparams).map(([k, v]) => `${k}=${typeof v === "object" ? JSON.stringify(v) : v}`).join(" ")])));
  await chart.load();
  // A running experiment's curves grow: redraw them (the chosen metric and axis stay).
  if (!TERMINAL.has(e.state)) timers.push(setInterval(() => chart.load().catch(() => {}), REFRESH_MS));
}

function logPanel(id) {
  const pre = h("pre", { id: "log" });
  const follow = h("input", { type: "checkbox", id: "follow", checked: true });
  const rank = h("input", { type: "number", id: "rank", min: 0, placeholder: "all", style: "width:70px" });
  let cursor = "", busy = false;
  const pump = async () => {
    if (busy) return;
    busy = true;
    try {
      const r = rank.value.trim();
      const chunk = await api(`/api/trials/${id}/logs?cursor=${encodeURIComponent(cursor)}&rank=${encodeURIComponent(r)}`);
      cursor = chunk.cursor;
      if (chunk.lines.length) {
        const atEnd = pre.scrollTop + pre.clientHeight >= pre.scrollHeight - 4;
        pre.append(chunk.lines.join("\n") + "\n");
        if (atEnd) pre.scrollTop = pre.scrollHeight;
      }
      if (chunk.more) setTimeout(pump, 0);
    } finally { busy = false; }
  };
  rank.addEventListener("change", () => { cursor = ""; pre.replaceChildren(); pump(); });
  timers.push(setInterval(() => follow.checked && pump(), 2000));
  pump();
  return h("div", {}, h("div", { class: "controls" }, h("label", {}, follow, " follow"), h("label", {}, "rank ", rank)), pre);
}

async function trialPage(id) {
  const data = await api(`/api/trials/${id}`);
  const t = data.trial;
  const m = data.experiment.metric;
  const chart = metricChart(`/api/trials/${id}/curves`, data.metric_names, m ? `validation\u0000${m}` : null);
  show(
    h("h1", {}, `Trial ${t.id} `, h("span", { class: "muted" }, "of experiment "), h("a", { href: `#/experiments/${data.experiment.id}` }, `${data.experiment.id} (${data.experiment.name})`)),
    h("div", { class: "cards" }, card("State", state(t.state)), card("Batches", String(t.batches)),
      card("Searcher metric", t.searcher_metric === null ? "-" : DS.fmt(t.searcher_metric)), card("Restarts", String(t.restarts)),
      card("Runs", String(t.runs)), t.exit_reason ? card("Exit", t.exit_reason) : null),
    h("h2", {}, "Metrics"), chart.panel,
    h("div", { class: "grid2" },
      h("div", {}, h("h2", {}, "Hyperparameters"), table("hparams-table", ["Name", "Value"],
        Object.entries(t.hparams).map(([k, v]) => [k, typeof v === "object" ? JSON.stringify(v) : String(v)]))),
      h("div", {}, h("h2", {}, "Runs (Slurm jobs)"), table("runs", ["#Run", "State", "Job id", "Slurm state", "Pending reason", "Exit"],
        data.runs.map((r) => [String(r.run_id), state(r.state), r.job_id || "", r.slurm_state || "", r.pending_reason || "",
          r.exit_reason || (r.exit_code === null ? "" : "code " + r.exit_code)])))),
    h("h2", {}, "Checkpoints"),
    data.checkpoints.length ? table("checkpoints", ["UUID", "#Batches", "#Size", "State", "Validation metric", "Reported"],
      data.checkpoints.map((c) => [c.uuid, String(c.steps_completed), size(c.size), c.state,
        c.validation_metric === null ? "" : DS.fmt(c.validation_metric), time(c.report_time)])) : h("p", { class: "muted" }, "none"),
    h("h2", {}, "Logs"), logPanel(id));
  await chart.load();
  if (!TERMINAL.has(t.state)) timers.push(setInterval(() => chart.load().catch(() => {}), REFRESH_MS));
}

// The queue and the pools come from Slurm: without a cluster the server says so in `notice`.
const notice = (data) => h("p", { class: "muted", id: "notice" }, data.notice);

async function queuePage() {
  const data = await api("/api/queue");
  const rows = data.rows;
  show(h("h1", {}, "Job queue"),
    data.notice ? notice(data) : rows.length === 0 ? h("p", { class: "muted" }, "The queue is empty.") :
      table("queue", ["#", "ID", "Type", "Job name", "#Priority", "Submitted", "Slots", "State", "User", "Pool", "Pending reason"],
        rows.map((r) => [String(r["#"]), r.id, r.type, r.name, r.priority === null ? "" : String(r.priority), r.submitted,
          r.slots, r.state, r.user, r.partition, r.reason])));
}

async function poolsPage() {
  const data = await api("/api/pools");
  const rows = data.rows;
  show(h("h1", {}, "Resource pools"),
    data.notice ? notice(data) : table("pools", ["Pool", "Partition", "Slot type", "#Nodes", "Slots (used/total)", "State", "Default", "Description"],
      rows.map((r) => [r.name, r.partition, r.slot_type, String(r.nodes), `${r.slots_used}/${r.slots_total}`, r.state,
        r.default ? "yes" : "", r.description])));
}

// ---- routing ----------------------------------------------------------------------------

async function route() {
  timers.forEach(clearInterval);
  timers = [];
  generation++;
  const path = location.hash.replace(/^#/, "") || "/";
  let m, page = "experiments";
  document.body.dataset.ready = "";
  try {
    if ((m = path.match(/^\/experiments\/(\d+)$/))) await experimentPage(m[1]);
    else if (path === "/") { await experimentsPage(); timers.push(setInterval(() => experimentsPage().catch(() => {}), REFRESH_MS)); }
    else if ((m = path.match(/^\/trials\/(\d+)$/))) { page = ""; await trialPage(m[1]); }
    else if (path === "/queue") { page = "queue"; await queuePage(); timers.push(setInterval(() => queuePage().catch(() => {}), REFRESH_MS)); }
    else if (path === "/pools") { page = "pools"; await poolsPage(); }
    else await experimentsPage();
  } catch (err) {
    if (err instanceof Stale) return; // the user went on to another page meanwhile
    show(h("p", { class: "error", id: "error" }, String(err.message || err)));
  }
  document.querySelectorAll("header nav a").forEach((a) => a.classList.toggle("active", a.dataset.nav === page));
  // Set once the page's data (and its first chart) is in: what the browser tests wait for.
  document.body.dataset.ready = path;
}

document.getElementById("mode").textContent = CONFIG.actions ? "actions enabled" : "read-only";
window.addEventListener("hashchange", route);
route();
