// Bonsai Pipeline web page: plain JS, no build step, nothing loaded from outside this server.
// Every request carries the bearer token kept in sessionStorage (this tab only). Data from the
// API is put on the page with textContent only, never as HTML: job sources are user input.
"use strict";

const TOKEN_KEY = "bonsai.token";
const FINAL = new Set(["succeeded", "failed", "cancelled", "skipped-cached"]);
const REFRESH_MS = 3000;
const state = { jobId: null, jobStatus: null, chainSha: null, timer: null, blobs: [] };

// ---- small DOM helpers ----------------------------------------------------------------------
const $ = (sel) => document.querySelector(sel);

function el(tag, attrs = {}, ...children) {
  const node = document.createElement(tag);
  for (const [key, value] of Object.entries(attrs)) {
    if (value === null || value === undefined || value === false) continue;
    if (key === "class") node.className = value;
    else if (key === "text") node.textContent = value;
    else if (key.startsWith("on")) node.addEventListener(key.slice(2), value);
    else node.setAttribute(key, value === true ? "" : String(value));
  }
  for (const child of children.flat()) {
    if (child !== null && child !== undefined) node.append(child instanceof Node ? child : String(child));
  }
  return node;
}

const svg = (tag, attrs = {}) => {
  const node = document.createElementNS("http://www.w3.org/2000/svg", tag);
  for (const [key, value] of Object.entries(attrs)) node.setAttribute(key, String(value));
  return node;
};

const short = (sha) => (sha ? sha.slice(0, 12) : "");
const when = (iso) => (iso ? new Date(iso).toLocaleString() : "–");

function bytes(n) {
  if (n === null || n === undefined) return "–";
  const units = ["B", "KiB", "MiB", "GiB", "TiB"];
  let i = 0;
  while (n >= 1024 && i < units.length - 1) { n /= 1024; i += 1; }
  return `${n.toFixed(i ? 1 : 0)} ${units[i]}`;
}

function seconds(s) {
  if (s === null || s === undefined) return "";
  return s < 60 ? `${s.toFixed(2)} s` : `${Math.floor(s / 60)} min ${Math.round(s % 60)} s`;
}

const badge = (status) => el("span", { class: `badge ${status}`, text: status });

// ---- token and API --------------------------------------------------------------------------
function takeTokenFromUrl() {
  // `#token=…` never reaches the server; `?token=…` does (the server keeps it out of its access log).
  const url = new URL(window.location.href);
  const hash = new URLSearchParams(url.hash.slice(1));
  const token = url.searchParams.get("token") || hash.get("token");
  if (token) {
    sessionStorage.setItem(TOKEN_KEY, token);
    url.searchParams.delete("token");
    hash.delete("token");
    const rest = hash.toString();
    // Drop it from the address bar and history: a token must not sit in bookmarks or screenshots.
    window.history.replaceState(null, "", url.pathname + url.search + (rest ? `#${rest}` : ""));
  }
  return Boolean(token);
}

class Unauthorized extends Error {}

async function api(path, asBlob = false) {
  const token = sessionStorage.getItem(TOKEN_KEY);
  const response = await fetch(path, { headers: { Authorization: `Bearer ${token}` } });
  if (response.status === 401 || response.status === 403) {
    const body = await response.json().catch(() => ({}));
    throw new Unauthorized(body.detail || response.statusText);
  }
  if (!response.ok) {
    const body = await response.json().catch(() => ({}));
    throw new Error(`${path}: ${response.status} ${body.detail || response.statusText}`);
  }
  return asBlob ? response.blob() : response.json();
}

function showLogin(message) {
  sessionStorage.removeItem(TOKEN_KEY);
  clearTimeout(state.timer);
  $("#app").hidden = true;
  $("#logout").hidden = true;
  $("#login").hidden = false;
  $("#login-error").textContent = message || "";
  $("#token-input").focus();
}

function guard(promise) {
  return promise.catch((err) => {
    if (err instanceof Unauthorized) showLogin(`The server refused the token: ${err.message}`);
    else console.error(err);
  });
}

// ---- jobs list ------------------------------------------------------------------------------
async function loadJobs() {
  const status = $("#status-filter").value;
  const jobs = await api(`/api/jobs?limit=200${status ? `&status=${encodeURIComponent(status)}` : ""}`);
  const body = $("#jobs tbody");
  body.replaceChildren(...jobs.map((job) => el("tr", {
    "data-job-id": job.id,
    class: job.id === state.jobId ? "selected" : null,
    onclick: () => selectJob(job.id),
  },
  el("td", { text: job.id }),
  el("td", {}, badge(job.status)),
  el("td", {}, el("progress", { max: 1, value: job.progress, title: `${Math.round(job.progress * 100)}%` }),
    ` ${Math.round(job.progress * 100)}%`),
  el("td", { text: job.current_stage || "–" }),
  el("td", { text: job.recipe }),
  el("td", { class: "source", text: job.source, title: job.source }),
  el("td", { text: when(job.created_at) }))));
  $("#jobs-empty").hidden = jobs.length > 0;
  $("#refreshed").textContent = `updated ${new Date().toLocaleTimeString()}`;
}

// ---- one job --------------------------------------------------------------------------------
function selectJob(jobId) {
  state.jobId = jobId;
  state.jobStatus = null;
  window.location.hash = `job=${jobId}`;
  for (const row of document.querySelectorAll("#jobs tbody tr")) {
    row.classList.toggle("selected", Number(row.dataset.jobId) === jobId);
  }
  guard(loadJob());
}

async function loadJob() {
  if (state.jobId === null) return;
  const job = await api(`/api/jobs/${state.jobId}`);
  const changed = job.status !== state.jobStatus || !FINAL.has(job.status);
  state.jobStatus = job.status;
  if (!changed && $("#job-panel").dataset.jobId === String(job.id)) return;
  $("#job-panel").hidden = false;
  $("#job-panel").dataset.jobId = job.id;
  $("#job-title").replaceChildren(`Job ${job.id} `, badge(job.status));
  $("#job-meta").textContent = `${job.source} · recipe ${job.recipe} · priority ${job.priority}`
    + ` · submitted by ${job.submitted_by || "–"} · revision ${job.resolved_revision || "–"}`;
  $("#job-error").textContent = job.error_message || "";
  renderTimeline(job.stages);
  renderValidation(job.validation);
  renderArtifacts(job.stages);
  await renderSparsity(job.stages);
}

function renderTimeline(runs) {
  const times = runs.flatMap((r) => [r.queued_at, r.started_at, r.finished_at]).filter(Boolean)
    .map((t) => Date.parse(t));
  const t0 = Math.min(...times);
  const span = Math.max(1, Math.max(...times) - t0);
  const pct = (iso) => ((Date.parse(iso) - t0) / span) * 100;
  $("#timeline").replaceChildren(...runs.map((run) => {
    const bar = el("div", { class: `bar ${run.status}` });
    if (run.started_at) {
      const end = run.finished_at ? pct(run.finished_at) : 100;
      bar.style.left = `${pct(run.started_at)}%`;
      bar.style.width = `${Math.max(0.6, end - pct(run.started_at))}%`;
    } else {
      bar.classList.add("waiting");
    }
    const details = [run.worker_host, run.device, seconds(run.duration_s)].filter(Boolean).join(" · ");
    return el("div", { class: "attempt", "data-stage": run.stage, "data-status": run.status },
      el("span", { class: "label", text: `${run.stage} #${run.attempt}` }),
      badge(run.status),
      el("div", { class: "track" }, bar),
      el("span", { class: "details muted", text: details }),
      run.error_message ? el("div", { class: "error run-error", text: `${run.error_kind}: ${run.error_message}` })
        : null);
  }));
  if (!runs.length) $("#timeline").append(el("p", { class: "muted", text: "No attempts yet." }));
}

function renderValidation(validation) {
  const box = $("#validation");
  if (!validation || !validation.verdict) {
    box.replaceChildren(el("p", { class: "muted", text: "Not validated yet." }));
    return;
  }
  const checks = Object.entries(validation.checks || {}).map(([name, result]) =>
    el("tr", {}, el("td", { text: name }), el("td", {}, badge(result))));
  box.replaceChildren(
    el("p", {}, "Verdict ", el("span", { class: `verdict badge ${validation.verdict}`, text: validation.verdict })),
    el("p", {}, "“1+1” answer: ", el("code", { class: "answer", text: JSON.stringify(validation.text) })),
    el("table", { class: "checks" }, el("tbody", {}, checks)));
}

function latestOutputs(runs, stage) {
  const done = runs.filter((r) => r.stage === stage && (r.status === "succeeded" || r.status === "skipped-cached"));
  return done.length ? done[done.length - 1].outputs : [];
}

async function renderSparsity(runs) {
  const outputs = latestOutputs(runs, "decompose");
  const report = outputs.find((o) => o.name === "report.json");
  const png = outputs.find((o) => o.name === "sparsity.png");
  const box = $("#sparsity");
  if (!report && !png) {
    box.replaceChildren(el("p", { class: "muted", text: "No decompose report yet." }));
    return;
  }
  if (box.dataset.report === (report && report.sha256)) return;  // already drawn
  box.dataset.report = report ? report.sha256 : "";
  const parts = [];
  if (report) {
    const data = await api(`/api/artifacts/${report.sha256}/download`);
    parts.push(sparsityChart(data.layers || {}, data.totals || {}));
  }
  if (png) {
    const blob = await api(`/api/artifacts/${png.sha256}/download`, true);
    const url = URL.createObjectURL(blob);
    state.blobs.push(url);
    parts.push(el("details", {}, el("summary", { text: "Plot from the decompose stage" }),
      el("img", { src: url, alt: "per-layer sparsity plot", class: "plot" })));
  }
  box.replaceChildren(...parts);
}

function sparsityChart(layers, totals) {
  const names = Object.keys(layers).sort((a, b) => Number(a) - Number(b));
  const width = 420;
  const barH = 18;
  const left = 70;
  const height = names.length * (barH + 6) + 24;
  const chart = svg("svg", { width, height, viewBox: `0 0 ${width} ${height}`, role: "img",
    "aria-label": "per-layer sparsity" });
  names.forEach((name, i) => {
    const value = layers[name].sparsity || 0;
    const y = i * (barH + 6);
    const label = svg("text", { x: 0, y: y + barH - 4, class: "axis" });
    label.textContent = `layer ${name}`;
    const bar = svg("rect", { x: left, y, width: Math.max(1, value * (width - left - 60)), height: barH,
      class: "layer", "data-layer": name, "data-sparsity": value });
    const title = svg("title");
    title.textContent = `layer ${name}: ${(value * 100).toFixed(1)}% zeros, `
      + `${(layers[name].bits_per_weight || 0).toFixed(2)} bits/weight`;
    bar.append(title);
    const text = svg("text", { x: left + Math.max(1, value * (width - left - 60)) + 6, y: y + barH - 4,
      class: "axis" });
    text.textContent = `${(value * 100).toFixed(1)}%`;
    chart.append(label, bar, text);
  });
  const foot = svg("text", { x: 0, y: height - 4, class: "axis" });
  foot.textContent = totals.sparsity !== undefined
    ? `all ternary weights: ${(totals.sparsity * 100).toFixed(1)}% zeros` : "";
  chart.append(foot);
  return chart;
}

function renderArtifacts(runs) {
  const rows = [];
  for (const run of runs) {
    for (const out of run.outputs) {
      rows.push(el("tr", { "data-sha256": out.sha256 },
        el("td", { text: `${run.stage} #${run.attempt}` }),
        el("td", { text: out.name }),
        el("td", { text: out.kind }),
        el("td", { text: bytes(out.size_bytes) }),
        el("td", {}, el("code", { text: short(out.sha256), title: out.sha256 })),
        el("td", {},
          el("button", { type: "button", class: "provenance", onclick: () => showChain(out.sha256, false) },
            "provenance"),
          " ",
          el("button", { type: "button", onclick: () => guard(download(out)) }, "download"))));
    }
  }
  $("#artifacts tbody").replaceChildren(...rows);
}

async function download(artifact) {
  const blob = await api(`/api/artifacts/${artifact.sha256}/download`, true);
  const url = URL.createObjectURL(blob);
  const link = el("a", { href: url, download: artifact.name.split("/").pop() });
  document.body.append(link);
  link.click();
  link.remove();
  setTimeout(() => URL.revokeObjectURL(url), 60000);
}

// ---- provenance chain -----------------------------------------------------------------------
function showChain(sha256, verify) {
  state.chainSha = sha256;
  $("#chain-panel").hidden = false;
  $("#chain-status").textContent = verify ? "re-hashing every file…" : "loading…";
  guard(loadChain(sha256, verify));
}

async function loadChain(sha256, verify) {
  const report = await api(`/api/artifacts/${sha256}/chain?verify=${verify}`);
  const byHash = new Map(report.nodes.map((n) => [n.sha256, n]));
  const shown = new Set();
  const item = (name, sha) => {
    const node = byHash.get(sha) || { sha256: sha, statements: [], inputs: [] };
    const repeat = shown.has(sha);
    shown.add(sha);
    const producer = node.statements && node.statements.length
      ? node.statements.map((s) => `${s.stage} run ${s.stage_run_id} (job ${s.job_id})`).join(", ") : "no statement";
    const line = el("div", { class: `node ${node.ok === false ? "broken" : "ok"}${repeat ? " repeat" : ""}`,
      "data-name": name },
      el("span", { class: "mark", text: node.ok === false ? "✗" : "✓" }),
      el("strong", { text: name }), " ",
      el("code", { text: short(sha), title: sha }), " ",
      el("span", { class: "muted", text: `${node.kind || "?"} · ${bytes(node.size_bytes)} · ${producer}`
        + (node.signature ? ` · signature ${node.signature}` : "") }),
      repeat && node.inputs.length ? el("span", { class: "muted", text: " (inputs shown above)" }) : null);
    const children = repeat ? [] : node.inputs.map((input) => item(input.name, input.sha256));
    return el("li", {}, line, children.length ? el("ul", {}, children) : null);
  };
  $("#chain-title").textContent = `Provenance chain of ${report.name}`;
  $("#chain").replaceChildren(el("ul", { class: "tree" }, item(report.name, report.sha256)));
  $("#chain-problems").replaceChildren(...report.problems.map((p) => el("li", { text: p.message })));
  const checked = report.rehashed ? `${bytes(report.rehashed_bytes)} re-hashed` : "records checked (not re-hashed)";
  $("#chain-status").replaceChildren(badge(report.ok ? "verified" : "broken"),
    ` ${report.artifacts} artifacts, ${report.statements} statements, ${checked} in ${report.elapsed_s} s`);
  $("#chain-panel").scrollIntoView({ behavior: "smooth", block: "start" });
}

// ---- start ----------------------------------------------------------------------------------
async function refresh() {
  clearTimeout(state.timer);
  await guard(Promise.all([loadJobs(), loadJob()]));
  if (!$("#app").hidden) state.timer = setTimeout(refresh, REFRESH_MS);
}

function start() {
  $("#login").hidden = true;
  $("#app").hidden = false;
  $("#logout").hidden = false;
  const match = /job=(\d+)/.exec(window.location.hash);
  if (match) state.jobId = Number(match[1]);
  refresh();
}

document.addEventListener("DOMContentLoaded", () => {
  takeTokenFromUrl();
  $("#login-form").addEventListener("submit", (event) => {
    event.preventDefault();
    sessionStorage.setItem(TOKEN_KEY, $("#token-input").value.trim());
    $("#token-input").value = "";
    start();
  });
  $("#logout").addEventListener("click", () => showLogin(""));
  $("#status-filter").addEventListener("change", () => guard(loadJobs()));
  $("#verify").addEventListener("click", () => state.chainSha && showChain(state.chainSha, true));
  // A link with a new fragment opened in this tab does not reload the page.
  window.addEventListener("hashchange", () => {
    if (takeTokenFromUrl() && $("#app").hidden) return start();
    const match = /job=(\d+)/.exec(window.location.hash);
    if (match && Number(match[1]) !== state.jobId) selectJob(Number(match[1]));
  });
  if (sessionStorage.getItem(TOKEN_KEY)) start();
  else showLogin("");
});
