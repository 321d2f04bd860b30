// Bonsai Pipeline web page: start-up, what the token may do, the submit form and the jobs list.
// Every request carries the bearer token kept in sessionStorage (this tab only); how to get one
// is written on the page itself (#how-to-login).
"use strict";

// ---- what this token may do -----------------------------------------------------------------
async function loadSession() {
  const session = await api("/api/session");
  state.session = session;
  $("#who").textContent = `token ${session.token} · ${session.scopes.join(" + ")}`;
  const recipe = $("#submit-recipe");
  recipe.replaceChildren(...session.recipes.map((name) => el("option", { value: name, text: name,
    selected: name === session.default_recipe })));
  $("#retry-stage").replaceChildren(el("option", { value: "", text: "first stage not done" }),
    ...session.stages.map((name) => el("option", { value: name, text: name })));
  const reason = session.can_submit ? null : session.read_only_reason;
  $("#submit-fields").disabled = Boolean(reason);
  $("#submit-readonly").hidden = !reason;
  $("#submit-readonly").textContent = reason ? `Submitting is off: ${reason}.` : "";
  $("#submit-roots").textContent = session.can_submit
    ? (session.source_roots.length
      ? `Hub ids (org/name@revision) always; local folders and .gguf files under ${session.source_roots.join(", ")}.`
      : "Hub ids (org/name@revision) only: the server allows no local folders (BONSAI_SOURCE_ROOTS is empty).")
    : "";
}

// ---- submit ---------------------------------------------------------------------------------
async function submitJob(event) {
  event.preventDefault();
  const message = $("#submit-message");
  message.className = "";
  let options;
  try {
    options = JSON.parse($("#submit-options").value.trim() || "{}");
    if (options === null || typeof options !== "object" || Array.isArray(options)) throw new Error("not an object");
  } catch (err) {
    message.className = "error";
    message.textContent = `Options must be a JSON object such as {"method": "absmean"} (${err.message}).`;
    return;
  }
  const body = {
    source: $("#submit-source").value.trim(),
    recipe: $("#submit-recipe").value,
    priority: Number.parseInt($("#submit-priority").value || "0", 10),
    options,
  };
  message.textContent = "submitting…";
  try {
    const result = await api("/api/jobs", { body });
    message.textContent = `Submitted job ${result.job_ids.join(", ")}.`;
    await loadJobs();
    selectJob(result.job_ids[0]);
  } catch (err) {
    if (err instanceof Unauthorized) throw err;
    message.className = "error";
    message.textContent = `Not submitted: ${err.message}`;
  }
}

// ---- jobs list ------------------------------------------------------------------------------
async function loadJobs() {
  const status = $("#status-filter").value;
  const jobs = await api(`/api/jobs?limit=200${status ? `&status=${encodeURIComponent(status)}` : ""}`);
  const body = $("#jobs tbody");
  body.replaceChildren(...jobs.map((job) => el("tr", {
    "data-job-id": job.id,
    "data-status": job.status,
    class: job.id === state.jobId ? "selected" : null,
    onclick: () => selectJob(job.id),
  },
  el("td", { text: job.id }),
  el("td", {}, badge(job.status)),
  el("td", {}, el("progress", { max: 1, value: job.progress, title: `${Math.round(job.progress * 100)}%` }),
    ` ${Math.round(job.progress * 100)}%`),
  el("td", { text: job.current_stage || "–" }),
  el("td", { text: job.recipe }),
  el("td", { text: job.priority }),
  el("td", { class: "source", text: job.source, title: job.source }),
  el("td", { text: when(job.created_at) }))));
  $("#jobs-empty").hidden = jobs.length > 0;
  $("#refreshed").textContent = `updated ${new Date().toLocaleTimeString()}`;
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
  state.jobKey = null;
  // The session first: the job panel's buttons depend on the token's scopes.
  guard(loadSession()).then(() => !$("#app").hidden && refresh());
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
  $("#submit-form").addEventListener("submit", (event) => guard(submitJob(event)));
  $("#retry-button").addEventListener("click", retryJob);
  $("#cancel-button").addEventListener("click", cancelJob);
  $("#against-form").addEventListener("submit", (event) => guard(compareAllocation(event)));
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
