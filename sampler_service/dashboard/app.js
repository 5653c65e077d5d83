// The live-run dashboard. Reads /health, /v1/stats, /v1/config and /v1/events every
// REFRESH_MS and edits the config with one PATCH carrying config_version. The page holds
// no data of its own; with an API key it asks once and keeps it in sessionStorage.
"use strict";

const REFRESH_MS = 2000;
const HISTORY = 300; // chart points kept (10 minutes at one per refresh)
const KEY_STORE = "adaptive-rollout-api-key";
// The knobs the config form edits, in its order: one of `choices`, a whole number, or
// JSON text (`rows` high). The form's fields are built from this list, so the page and the
// code that fills and reads the form cannot disagree about them.
const FORM = [
  { name: "rule", kind: "choice", choices: ["fixed", "positive", "balanced", "est"] },
  { name: "k_pos", kind: "number" },
  { name: "k_neg", kind: "number" },
  { name: "n_max", kind: "number" },
  { name: "wave", kind: "choice", choices: ["fixed", "adaptive"] },
  { name: "wave_size", kind: "number" },
  { name: "group_size", kind: "number" },
  { name: "max_tokens", kind: "number" },
  { name: "mixing", kind: "json", rows: 2 },
  { name: "schedule", kind: "json", rows: 5 },
];
const EVENTS_KEPT = 50;

const $ = (sel) => document.querySelector(sel);
const state = {
  authRequired: false,
  config: null,      // the live config as last read
  formConfig: null,  // the config the form was filled from: edits are relative to it
  dirty: false,      // the form has edits not yet sent
  lastSeq: 0,
  events: {},        // kind -> its last EVENTS_KEPT events: weight updates never push out config changes
  history: { t: [], groups: [], samples: [], ready: [], leased: [] },
  charts: {},
};

class Unauthorized extends Error {}

function apiKey() { return sessionStorage.getItem(KEY_STORE); }

async function api(method, path, body) {
  const headers = { Accept: "application/json" };
  const key = apiKey();
  if (key) headers.Authorization = "Bearer " + key;
  if (body !== undefined) headers["Content-Type"] = "application/json";
  const response = await fetch(path, { method, headers, body: body === undefined ? undefined : JSON.stringify(body) });
  let payload = null;
  try { payload = await response.json(); } catch (_) { payload = null; }
  if (response.status === 401) throw new Unauthorized(payload?.error?.message || "API key required");
  return { status: response.status, body: payload };
}

// -- formatting ------------------------------------------------------------------------
function fmt(value, digits = 2) {
  if (value === null || value === undefined) return "–";
  if (typeof value === "number" && !Number.isInteger(value)) return value.toFixed(digits);
  return String(value);
}
function pct(value) { return value === null || value === undefined ? "–" : (100 * value).toFixed(0) + "%"; }
function setText(sel, text) { const el = $(sel); if (el.textContent !== text) el.textContent = text; }
function clock(t) { return new Date(t * 1000).toLocaleTimeString(); }
function compact(v) { return typeof v === "object" && v !== null ? JSON.stringify(v) : String(v); }

function fillRows(tbody, rows) {
  tbody.replaceChildren(...rows.map((cells) => {
    const tr = document.createElement("tr");
    for (const cell of cells) {
      const td = document.createElement("td");
      td.textContent = cell;
      tr.append(td);
    }
    return tr;
  }));
}

// -- charts ----------------------------------------------------------------------------
function chartWidth(el) { return Math.max(el.clientWidth - 4, 280); }

// The time axis runs from the first sample this page took, over a minute at least: left
// to itself, uPlot spans a lone first point over years.
const MIN_SPAN_S = 60;
function showTimes(chart, times) {
  const start = times.length ? times[0] : Date.now() / 1000;
  chart.setScale("x", { min: start, max: Math.max(times[times.length - 1] ?? start, start + MIN_SPAN_S) });
}

// Rates and queue depths are read against zero: left to itself, uPlot fits the axis to
// the data, and a rate that moves from 41 to 43 groups/s looks like a collapse.
const FROM_ZERO = { range: (u, lo, hi) => [0, hi > 0 ? hi * 1.1 : 1] };
// Answers per prompt and prompt counts are whole numbers: ticks at whole steps only.
const WHOLE_STEPS = [1, 2, 5, 10, 20, 50, 100, 200, 500, 1e3, 2e3, 5e3, 1e4, 2e4, 5e4, 1e5, 1e6];

function makeCharts() {
  const rates = $("#chart-rates"), queue = $("#chart-queue"), hist = $("#chart-hist");
  state.charts.rates = new uPlot({
    width: chartWidth(rates), height: 200,
    scales: { y: FROM_ZERO, a: FROM_ZERO },
    series: [{}, { label: "groups/s", stroke: "#2563eb", width: 2 }, { label: "answers/s", stroke: "#15803d", width: 2, scale: "a" }],
    axes: [{}, { label: "groups/s" }, { label: "answers/s", scale: "a", side: 1, grid: { show: false } }],
  }, [[], [], []], rates);
  state.charts.queue = new uPlot({
    width: chartWidth(queue), height: 200,
    scales: { y: FROM_ZERO },
    series: [{}, { label: "READY", stroke: "#b45309", width: 2 }, { label: "LEASED", stroke: "#7c3aed", width: 2 }],
    axes: [{}, { incrs: WHOLE_STEPS }],
  }, [[], [], []], queue);
  state.charts.hist = new uPlot({
    width: chartWidth(hist), height: 200,
    scales: { x: { time: false, range: (u, lo, hi) => [lo - 1, hi + 1] }, y: FROM_ZERO },
    series: [{ label: "answers" }, { label: "prompts", fill: "#93c5fd", stroke: "#2563eb", paths: uPlot.paths.bars({ size: [0.8, 40] }), points: { show: false } }],
    axes: [{ label: "answers generated per prompt", incrs: WHOLE_STEPS }, { incrs: WHOLE_STEPS }],
  }, [[], []], hist);
  window.addEventListener("resize", () => {
    for (const [name, el] of [["rates", rates], ["queue", queue], ["hist", hist]]) {
      state.charts[name].setSize({ width: chartWidth(el), height: 200 });
    }
  });
}

function updateCharts(stats) {
  const h = state.history;
  const now = Date.now() / 1000;
  h.t.push(now);
  h.groups.push(stats.rates?.groups_per_s ?? null);
  h.samples.push(stats.rates?.samples_per_s ?? null);
  h.ready.push(stats.queue?.ready ?? null);
  h.leased.push(stats.queue?.leased ?? null);
  for (const key of Object.keys(h)) if (h[key].length > HISTORY) h[key].shift();
  state.charts.rates.setData([h.t, h.groups, h.samples]);
  state.charts.queue.setData([h.t, h.ready, h.leased]);
  showTimes(state.charts.rates, h.t);
  showTimes(state.charts.queue, h.t);
  const bins = Object.entries(stats.samples_per_group || {}).map(([n, c]) => [Number(n), c]).sort((a, b) => a[0] - b[0]);
  state.charts.hist.setData([bins.map((b) => b[0]), bins.map((b) => b[1])]);
}

// -- panels ----------------------------------------------------------------------------
function renderHealth(health) {
  const el = $("#health");
  el.textContent = health.status;
  el.className = "badge " + (health.status === "ok" ? "ok" : health.status === "starting" || health.status === "degraded" ? "warn" : "bad");
  setText("#policy-version", String(health.policy_version));
  // What works badly while the sampler still serves: shown only while there is any.
  const warnings = Array.isArray(health.warnings) ? health.warnings : [];
  $("#warnings-panel").hidden = warnings.length === 0;
  $("#warnings").replaceChildren(...warnings.map((w) => {
    const li = document.createElement("li");
    li.textContent = w;
    return li;
  }));
}

function renderStats(stats) {
  const r = stats.rates || {}, q = stats.queue || {};
  setText("#config-version", String(stats.config_version));
  setText("#rate-groups", fmt(r.groups_per_s));
  setText("#rate-samples", fmt(r.samples_per_s, 1));
  setText("#rate-tokens", fmt(r.tokens_per_s, 0));
  setText("#queue", `${fmt(q.ready)} / ${fmt(q.leased)}`);
  setText("#active", fmt(q.active_prompts));
  const st = stats.staleness || {};
  setText("#staleness", `${fmt(st.last, 0)} / ${fmt(st.mean, 1)} / ${fmt(st.max, 0)}`);
  setText("#total-samples", fmt(stats.samples));
  setText("#trained", fmt(stats.trained_groups));
  const domains = Object.entries(stats.domains || {}).sort((a, b) => a[0].localeCompare(b[0]));
  fillRows($("#domains tbody"), domains.map(([name, d]) => [
    name, pct(d.pass_rate), pct(d.target_share), pct(d.admitted_share), pct(d.emitted_share), fmt(d.emitted),
  ]));
  const pairs = (obj) => Object.entries(obj || {}).sort((a, b) => b[1] - a[1]).map(([k, v]) => [k, String(v)]);
  fillRows($("#stop-reasons tbody"), pairs(stats.stop_reasons));
  fillRows($("#drops tbody"), pairs(stats.dropped).length ? pairs(stats.dropped) : [["none", "0"]]);
  // Engine replicas (Ray actors), or the servers of --backend http.
  const servers = (stats.engine || {}).servers;
  renderReplicas(stats.replicas || servers, stats.replicas ? "Replicas" : "Engine servers");
  renderEpisodes(stats.episodes);
  renderTokens(stats.waste);
  renderWasteBy(stats.waste_by_quartile, stats.waste_by_domain);
  updateCharts(stats);
}

// decoded = trained + downsampled + waste + pending, as /v1/stats `waste` counts them.
function renderTokens(w) {
  if (!w) return;
  const share = (v) => pct(w.decoded ? v / w.decoded : null);
  const causes = Object.entries(w.waste || {}).map(([cause, v]) => [`waste: ${cause}`, `${fmt(v)} (${share(v)})`]);
  const redrawn = Object.entries(w.redrawn || {}).map(([cause, v]) => `${cause} ${fmt(v)}`).join(", ");
  fillRows($("#tokens tbody"), [
    ["decoded", fmt(w.decoded)],
    ["trained", `${fmt(w.trained)} (${share(w.trained)})`],
    ["downsampled", `${fmt(w.downsampled)} (${share(w.downsampled)})`],
    ...causes,
    ["pending (not yet acked)", `${fmt(w.pending)} (${share(w.pending)})`],
    ["surplus answers", fmt(w.surplus_answers)],
    ["answers drawn again", redrawn || "none"],
  ]);
}

// Stale drops and every other waste cause by the prompt's pass-rate bin and by domain:
// a bound that starves hard prompts shows as stale waste piling up in q1.
function renderWasteBy(byBin, byDomain) {
  if (!byBin || !byDomain) return;
  const rows = [...Object.entries(byBin), ...Object.entries(byDomain)];
  const causes = [...new Set(rows.flatMap(([, v]) => Object.keys(v)))];
  const head = document.createElement("tr");
  for (const c of ["", ...causes]) { const th = document.createElement("th"); th.textContent = c; head.append(th); }
  $("#waste-by thead").replaceChildren(head);
  fillRows($("#waste-by tbody"), rows.map(([key, v]) => [key, ...causes.map((c) => fmt(v[c]))]));
}

// Multi-turn episodes: shown once the sampler has run any.
function renderEpisodes(ep) {
  const panel = $("#episodes-panel");
  panel.hidden = !(ep && ep.episodes > 0);
  if (panel.hidden) return;
  const tokens = ep.model_tokens + ep.observation_tokens;
  fillRows($("#episodes tbody"), [
    ["episodes", fmt(ep.episodes)],
    ["turns per episode", fmt(ep.turns_per_episode, 2)],
    ["environment errors", fmt(ep.env_errors) + (ep.last_env_error ? ` (last: ${ep.last_env_error})` : "")],
    ["environment seconds", fmt(ep.env_seconds, 1)],
    ["model / observation tokens", `${fmt(ep.model_tokens)} / ${fmt(ep.observation_tokens)} (${pct(tokens ? ep.observation_tokens / tokens : null)} observation)`],
  ]);
}

function renderReplicas(replicas, title) {
  const panel = $("#replicas-panel");
  const list = Array.isArray(replicas) ? replicas.filter((r) => r && typeof r === "object") : [];
  panel.hidden = list.length === 0;
  if (!list.length) return;
  setText("#replicas-title", title);
  const columns = [...new Set(list.flatMap((r) => Object.keys(r)))];
  const head = document.createElement("tr");
  for (const c of columns) { const th = document.createElement("th"); th.textContent = c; head.append(th); }
  $("#replicas thead").replaceChildren(head);
  fillRows($("#replicas tbody"), list.map((r) => columns.map((c) => fmt(r[c] === undefined ? null : r[c]))));
}

function eventSummary(e) {
  const d = e.data || {};
  if (e.kind === "config") {
    const diff = Object.entries(d.diff || {}).map(([k, [a, b]]) => `${k} ${compact(a)} → ${compact(b)}`).join(", ");
    return `v${d.config_version}: ${diff || "no change"}` + (d.step !== undefined ? ` (step ${d.step})` : "");
  }
  if (e.kind === "weights") return `v${d.version} via ${d.transport}, ${fmt(d.seconds)} s (paused ${fmt(d.paused_s)} s)`;
  return compact(d);
}

function renderEvents(fresh) {
  for (const e of fresh) {
    const list = (state.events[e.kind] ??= []);
    list.push(e);
    if (list.length > EVENTS_KEPT) list.shift();
  }
  const kind = $("#event-kind").value;
  const shown = kind ? state.events[kind] || [] : Object.values(state.events).flat().sort((a, b) => a.seq - b.seq).slice(-EVENTS_KEPT);
  $("#events").replaceChildren(...shown.slice().reverse().map((e) => {
    const li = document.createElement("li");
    const kind = document.createElement("span"); kind.className = "kind"; kind.textContent = e.kind;
    const src = document.createElement("span"); src.className = "src"; src.textContent = `${clock(e.time)} ${e.source}`;
    li.append(kind, src, document.createTextNode(eventSummary(e)));
    return li;
  }));
}

// -- config form -----------------------------------------------------------------------
// One knob's field: its label, its input (id f-<name>) and where the server's complaint
// about it goes.
function formField({ name, kind, choices, rows }) {
  const field = document.createElement("div");
  field.className = kind === "json" ? "field wide" : "field";
  const label = document.createElement("label");
  label.htmlFor = "f-" + name;
  label.textContent = kind === "json" ? `${name} (JSON)` : name;
  let input;
  if (kind === "choice") {
    input = document.createElement("select");
    for (const choice of choices) input.append(new Option(choice));
  } else if (kind === "json") {
    input = document.createElement("textarea");
    input.rows = rows;
    input.spellcheck = false;
  } else {
    input = document.createElement("input");
    input.type = "number";
    input.step = "1";
  }
  input.id = "f-" + name;
  input.name = name;
  const error = document.createElement("span");
  error.className = "field-error";
  error.dataset.field = name;
  field.append(label, input, error);
  return field;
}

function formValue(name) {
  const el = $("#config-form").elements[name];
  return el.value;
}

// One step per line: long schedules stay readable and editable.
function scheduleText(steps) {
  return steps.length ? "[\n" + steps.map((s) => "  " + JSON.stringify(s)).join(",\n") + "\n]" : "[]";
}

function fillForm(cfg) {
  const form = $("#config-form");
  for (const { name, kind } of FORM) {
    const value = cfg[name];
    form.elements[name].value = name === "schedule" ? scheduleText(value) : kind === "json" ? JSON.stringify(value) : String(value);
  }
  state.formConfig = cfg;
  state.dirty = false;
}

function clearErrors() {
  for (const el of document.querySelectorAll("#config-form .field-error")) { el.textContent = ""; el.classList.remove("ok"); }
  for (const el of document.querySelectorAll("#config-form .field.invalid")) el.classList.remove("invalid");
}

// The form field an error's `field` belongs to: "schedule[0].set.k_pos" -> schedule,
// "mixing.name" -> mixing; anything else is shown beside the Apply button.
function showError(field, message) {
  const top = (field || "").split(/[.[]/)[0];
  const target = FORM.some((knob) => knob.name === top) ? top : "config_version";
  const el = document.querySelector(`#config-form .field-error[data-field="${target}"]`);
  el.textContent = message;
  el.closest(".field")?.classList.add("invalid");
}

function changedKnobs() {
  const patch = {};
  for (const { name, kind } of FORM) {
    const text = formValue(name).trim();
    let value = text;
    if (kind === "json") {
      try { value = JSON.parse(text); } catch (err) { throw Object.assign(new Error(`not valid JSON: ${err.message}`), { field: name }); }
    } else if (kind === "number") {
      value = text === "" ? text : Number(text);
    }
    if (JSON.stringify(value) !== JSON.stringify(state.formConfig[name])) patch[name] = value;
  }
  return patch;
}

// Discard the form's edits and show the live config as it is now.
async function reloadForm() {
  const { status, body } = await api("GET", "/v1/config");
  if (status !== 200) throw new Error(body?.error?.message || `GET /v1/config: ${status}`);
  state.config = body;
  fillForm(body);
}

async function submitConfig(event) {
  event.preventDefault();
  clearErrors();
  let patch;
  try { patch = changedKnobs(); } catch (err) { showError(err.field, err.message); return; }
  if (!Object.keys(patch).length) { showError("config_version", "nothing changed"); return; }
  // The version the edits were made against: if the config changed since, the server
  // refuses (409) rather than silently undoing someone else's change.
  const { status, body } = await api("PATCH", "/v1/config", { ...patch, config_version: state.formConfig.config_version });
  if (status === 200) {
    state.config = body;
    fillForm(body);
    const ok = $("#form-status");
    ok.textContent = `applied: config v${body.config_version}`;
    ok.classList.add("ok");
    return;
  }
  const err = body?.error || {};
  showError(err.field, `${status} ${err.message || "request failed"}`);
}

// -- refresh loop ----------------------------------------------------------------------
function askForKey(message) {
  sessionStorage.removeItem(KEY_STORE);
  $("#key-panel").hidden = false;
  $("#content").hidden = true;
  $("#key-error").textContent = message || "";
}

async function refresh() {
  const health = (await api("GET", "/health")).body;
  renderHealth(health);
  state.authRequired = !!health.auth_required;
  if (state.authRequired && !apiKey()) { askForKey(); return; }
  const [stats, config, events] = await Promise.all([
    api("GET", "/v1/stats"), api("GET", "/v1/config"), api("GET", `/v1/events?since=${state.lastSeq}`),
  ]);
  $("#key-panel").hidden = true;
  $("#content").hidden = false;
  if (stats.status === 200) renderStats(stats.body);
  if (config.status === 200) {
    state.config = config.body;
    if (!state.dirty) fillForm(config.body);
  }
  if (events.status === 200) {
    const fresh = events.body.events.filter((e) => e.kind === "config" || e.kind === "weights" || e.kind === "schedule_skipped" || e.kind === "engine_failed" || e.kind === "replica");
    renderEvents(fresh);
    state.lastSeq = events.body.last_seq;
  }
  setText("#updated", "updated " + new Date().toLocaleTimeString());
}

async function tick() {
  try {
    await refresh();
  } catch (err) {
    if (err instanceof Unauthorized) askForKey("The key was refused: " + err.message);
    else setText("#updated", "sampler unreachable: " + err.message);
  }
  setTimeout(tick, REFRESH_MS);
}

function start() {
  $("#config-form").prepend(...FORM.map(formField));
  makeCharts();
  $("#config-form").addEventListener("submit", (e) => {
    submitConfig(e).catch((err) => {
      if (err instanceof Unauthorized) askForKey("The key was refused: " + err.message);
      else showError("config_version", err.message);
    });
  });
  $("#config-form").addEventListener("input", () => { state.dirty = true; });
  $("#event-kind").addEventListener("change", () => renderEvents([]));
  $("#reset").addEventListener("click", () => {
    clearErrors();
    reloadForm().catch((err) => showError("config_version", err.message));
  });
  $("#key-form").addEventListener("submit", (e) => {
    e.preventDefault();
    const key = $("#key-input").value.trim();
    if (!key) return;
    sessionStorage.setItem(KEY_STORE, key);
    $("#key-input").value = "";
    $("#key-error").textContent = "";
    refresh().catch((err) => askForKey(err instanceof Unauthorized ? "The key was refused: " + err.message : err.message));
  });
  tick();
}

document.addEventListener("DOMContentLoaded", start);
