// Bonsai Pipeline web page, shared helpers: DOM building, formatting, the token and the API.
// Plain scripts (no build step, nothing loaded from outside this server), loaded in order by
// index.html. Data from the API goes on the page with textContent only, never as HTML: job
// sources and error messages are user input.
"use strict";

const TOKEN_KEY = "bonsai.token";
const FINAL = new Set(["succeeded", "failed", "cancelled", "skipped-cached", "not-needed"]);
const REFRESH_MS = 3000;
const state = {
  jobId: null, jobStatus: null, jobKey: null, chainSha: null, chainJobId: null, timer: null, blobs: [], session: null,
};

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

function svg(tag, attrs = {}, text = null) {
  const node = document.createElementNS("http://www.w3.org/2000/svg", tag);
  for (const [key, value] of Object.entries(attrs)) {
    if (value !== null && value !== undefined) node.setAttribute(key, String(value));
  }
  if (text !== null) node.textContent = text;
  return node;
}

const short = (sha) => (sha ? sha.slice(0, 12) : "");
const when = (iso) => (iso ? new Date(iso).toLocaleString() : "–");
const pct = (x, digits = 1) => `${(x * 100).toFixed(digits)}%`;

function bytes(n) {
  if (n === null || n === undefined) return "–";
  const units = ["B", "KiB", "MiB", "GiB", "TiB"];
  let i = 0;
  while (n >= 1024 && i < units.length - 1) { n /= 1024; i += 1; }
  return `${n.toFixed(i ? 1 : 0)} ${units[i]}`;
}

function seconds(s) {
  if (s === null || s === undefined) return "";
  if (s < 60) return `${s.toFixed(s < 10 ? 2 : 1)} s`;
  if (s < 3600) return `${Math.floor(s / 60)} min ${Math.round(s % 60)} s`;
  return `${Math.floor(s / 3600)} h ${Math.round((s % 3600) / 60)} min`;
}

// A number as people read it: fixed digits in a sensible range, else scientific.
function num(x, digits = 3) {
  if (typeof x !== "number" || !Number.isFinite(x)) return String(x);
  if (Number.isInteger(x)) return String(x);
  const a = Math.abs(x);
  return a !== 0 && (a < 10 ** -digits || a >= 1e6) ? x.toExponential(2) : x.toFixed(digits);
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

// The API's `detail` as one sentence: a string, or FastAPI's list of field errors.
function detailText(body, fallback) {
  const detail = body && body.detail;
  if (typeof detail === "string") return detail;
  if (Array.isArray(detail)) {
    return detail.map((d) => `${(d.loc || []).filter((p) => p !== "body").join(".") || "request"}: ${d.msg}`)
      .join("; ");
  }
  return fallback;
}

// GET by default; `options.body` (any JSON value) makes it a POST.
async function api(path, options = {}) {
  const token = sessionStorage.getItem(TOKEN_KEY);
  const init = { method: options.method || (options.body !== undefined ? "POST" : "GET"),
    headers: { Authorization: `Bearer ${token}` } };
  if (options.body !== undefined) {
    init.headers["Content-Type"] = "application/json";
    init.body = JSON.stringify(options.body);
  }
  const response = await fetch(path, init);
  if (response.status === 401) {
    const body = await response.json().catch(() => ({}));
    throw new Unauthorized(detailText(body, response.statusText));
  }
  if (!response.ok) {
    const body = await response.json().catch(() => ({}));
    throw new Error(detailText(body, `${response.status} ${response.statusText}`));
  }
  return options.blob ? response.blob() : response.json();
}

function showLogin(message) {
  sessionStorage.removeItem(TOKEN_KEY);
  clearTimeout(state.timer);
  state.session = null;
  $("#app").hidden = true;
  $("#logout").hidden = true;
  $("#who").textContent = "";
  $("#login").hidden = false;
  $("#login-error").textContent = message || "";
  $("#token-link-example").textContent = `${window.location.origin}/#token=TOKEN`;
  $("#token-input").focus();
}

function guard(promise) {
  return promise.catch((err) => {
    if (err instanceof Unauthorized) showLogin(`The server refused the token: ${err.message}`);
    else console.error(err);
  });
}
