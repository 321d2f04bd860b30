// Bonsai Pipeline web page: one job — actions, its error (once), timeline, validation, artifacts.
"use strict";

function selectJob(jobId) {
  state.jobId = jobId;
  state.jobKey = null;
  window.location.hash = `job=${jobId}`;
  for (const row of document.querySelectorAll("#jobs tbody tr")) {
    row.classList.toggle("selected", Number(row.dataset.jobId) === jobId);
  }
  $("#action-message").textContent = "";
  $("#retry-stage").value = "";
  $("#retry-force").checked = false;
  if (jobId !== state.chainJobId) $("#chain-panel").hidden = true;  // another job's lineage
  $("#allocation-diff").replaceChildren();
  guard(loadJob());
}

async function loadJob() {
  if (state.jobId === null) return;
  const job = await api(`/api/jobs/${state.jobId}`);
  // Redraw only when something moved: a finished job's page stays still between polls.
  const key = JSON.stringify([job.id, job.status, job.stages.map((r) => [r.id, r.status, r.finished_at])]);
  if (key === state.jobKey && FINAL.has(job.status)) return;
  state.jobKey = key;
  state.jobStatus = job.status;
  $("#job-panel").hidden = false;
  $("#job-panel").dataset.jobId = job.id;
  $("#job-panel").dataset.status = job.status;
  $("#job-title").replaceChildren(`Job ${job.id} `, badge(job.status));
  $("#job-meta").textContent = `${job.source} · recipe ${job.recipe} · priority ${job.priority}`
    + ` · submitted by ${job.submitted_by || "–"} of team ${job.team || "–"} · revision ${job.resolved_revision || "–"}`
    + Object.entries(job.waiting || {}).map(([stage, why]) => ` · ${stage} waits for a slot: ${why}`).join("");
  renderOptions(job);
  renderActions(job);
  const errors = renderErrors(job);
  renderTimeline(job.stages, errors);
  renderValidation(job.validation);
  renderArtifacts(job.stages);
  await renderSparsity(job.stages);
}

// ---- options: one row each; a long value (a calibration text) as its size, digest and first line ----
function renderOptions(job) {
  const rows = (job.options || []).map((row) => {
    const cell = el("td", { class: "option-value" }, row.value);
    if (row.long) {
      // The whole value enters the page only when asked for.
      cell.append(" ", el("button", {
        type: "button", class: "show-option", text: "show all",
        onclick: () => {
          const value = (job.params || {})[row.key];
          cell.replaceChildren(el("pre", {
            class: "option-full", text: typeof value === "string" ? value : JSON.stringify(value, null, 1),
          }));
        },
      }));
    }
    return el("tr", { "data-key": row.key }, el("th", { scope: "row", text: row.key }), cell);
  });
  $("#job-options").replaceChildren(...rows);
  $("#job-options").hidden = rows.length === 0;
}

// ---- retry and cancel -----------------------------------------------------------------------
function renderActions(job) {
  const session = state.session || {};
  const owned = session.is_admin || job.submitted_by === session.actor;
  const reason = !session.can_submit ? session.read_only_reason
    : owned ? null
      : `job ${job.id} was submitted by ${job.submitted_by || "someone else"}; only its submitter or a token `
        + "with the admin scope may change it";
  const final = FINAL.has(job.status);
  $("#actions-readonly").hidden = !reason;
  $("#actions-readonly").textContent = reason ? `Retry and cancel are off: ${reason}.` : "";
  for (const id of ["#retry-stage", "#retry-force", "#retry-button", "#cancel-button"]) {
    $(id).disabled = Boolean(reason);
  }
  if (!reason) {
    $("#cancel-button").disabled = final;
    $("#cancel-button").title = final ? `job ${job.id} is already ${job.status}` : "Stop the job";
    const active = job.stages.some((r) => r.status === "queued" || r.status === "running");
    $("#retry-button").disabled = active;
    $("#retry-button").title = active ? "a stage is queued or running: cancel it or wait" : "";
  }
}

async function act(what, path, body) {
  const message = $("#action-message");
  message.className = "";
  message.textContent = `${what}…`;
  try {
    const result = await api(path, { body });
    message.textContent = what === "retry"
      ? `Job ${result.job_id}: ${result.run_ids.length} new attempt(s) queued.`
      : `Job ${result.job_id} cancelled${result.revoked ? ` (${result.revoked} task(s) revoked)` : ""}.`;
  } catch (err) {
    if (err instanceof Unauthorized) throw err;
    message.className = "error";
    message.textContent = `${what} refused: ${err.message}`;
  }
  state.jobKey = null;
  await Promise.all([loadJobs(), loadJob()]);
}

function retryJob() {
  const stage = $("#retry-stage").value;
  const body = { force: $("#retry-force").checked };
  if (stage) body.from_stage = stage;
  return guard(act("retry", `/api/jobs/${state.jobId}/retry`, body));
}

function cancelJob() {
  return guard(act("cancel", `/api/jobs/${state.jobId}/cancel`, null));
}

// ---- the error, once ------------------------------------------------------------------------
// A job's message is usually "<stage> failed: <the attempt's message>", and a retried stage fails
// the same way again: show each distinct message once, naming every attempt it came from.
function renderErrors(job) {
  const groups = [];
  const byText = new Map();
  for (const run of job.stages) {
    if (!run.error_message) continue;
    let group = byText.get(run.error_message);
    if (!group) {
      group = { kind: run.error_kind, text: run.error_message, runs: [] };
      byText.set(run.error_message, group);
      groups.push(group);
    }
    group.runs.push(run);
  }
  const jobText = job.error_message || "";
  const covered = groups.some((g) => jobText.endsWith(g.text));
  const box = $("#job-error");
  const items = groups.map((g, i) => el("li", { class: "error-item", "data-error": i + 1 },
    el("strong", { text: `${g.runs.map((r) => `${r.stage} #${r.attempt}`).join(", ")}` }),
    g.kind ? el("span", { class: "muted", text: ` (${g.kind})` }) : null, ": ",
    el("span", { class: "message", text: g.text })));
  if (jobText && !covered) items.unshift(el("li", { class: "error-item" }, el("span", { text: jobText })));
  box.hidden = items.length === 0;
  // "cancelled by user" is news, not a fault.
  box.classList.toggle("note", job.status === "cancelled" && groups.length === 0);
  box.replaceChildren(...(items.length ? [el("ul", {}, items)] : []));
  const numbers = new Map();
  groups.forEach((g, i) => g.runs.forEach((r) => numbers.set(r.id, i + 1)));
  return numbers;
}

// ---- timeline -------------------------------------------------------------------------------
function renderTimeline(runs, errorNumbers) {
  const box = $("#timeline");
  if (!runs.length) {
    box.replaceChildren(el("p", { class: "muted", text: "No attempts yet." }));
    return;
  }
  const now = Date.now();
  const times = runs.flatMap((r) => [r.queued_at, r.started_at, r.finished_at]).filter(Boolean)
    .map((t) => Date.parse(t));
  const open = runs.some((r) => r.started_at && !r.finished_at);
  const t0 = times.length ? Math.min(...times) : now;
  const t1 = Math.max(t0 + 1, ...(times.length ? times : [now]), open ? now : 0);
  const span_s = (t1 - t0) / 1000;
  const at = (iso) => ((Date.parse(iso) - t0) / (t1 - t0)) * 100;
  const rows = runs.map((run) => {
    const track = el("div", { class: "track" });
    if (run.queued_at && run.started_at) {
      const wait = el("div", { class: "bar queued-wait", title: "waiting in the queue" });
      wait.style.left = `${at(run.queued_at)}%`;
      wait.style.width = `${Math.max(0, at(run.started_at) - at(run.queued_at))}%`;
      track.append(wait);
    }
    const bar = el("div", { class: `bar ${run.status}` });
    if (run.started_at) {
      const end = run.finished_at ? at(run.finished_at) : 100;
      bar.style.left = `${at(run.started_at)}%`;
      bar.style.width = `${Math.max(0.6, end - at(run.started_at))}%`;
      bar.title = `${when(run.started_at)} → ${run.finished_at ? when(run.finished_at) : "now"}`;
    } else {
      bar.classList.add("waiting");
    }
    track.append(bar);
    const details = [run.requested_by ? `asked by ${run.requested_by}` : null, run.worker_host, run.device,
      seconds(run.duration_s)].filter(Boolean).join(" · ");
    const number = errorNumbers.get(run.id);
    return el("div", { class: "attempt", "data-stage": run.stage, "data-status": run.status },
      el("span", { class: "label", text: `${run.stage} #${run.attempt}${run.shard ? ` shard ${run.shard}` : ""}` }),
      badge(run.status),
      track,
      el("span", { class: "details muted", title: details },
        number ? el("span", { class: "error see-error", text: "error above · " }) : null, details));
  });
  box.replaceChildren(...rows, timeAxis(span_s, t0));
}

// ---- validation -----------------------------------------------------------------------------
// The numbers behind each check, formatted; anything not listed here shows in its reason.
const CHECK_NUMBERS = {
  agreement: [["top1_agreement", "top-1", pct], ["mean_kl", "mean KL", (v) => `${num(v, 4)} nats`],
    ["p90_kl", "p90 KL", (v) => num(v, 4)], ["n_positions", "positions", String]],
  bits_per_weight: [["linear_bpw", "linear", (v) => `${num(v, 4)} bpw`], ["recipe_bpw", "recipe", (v) => num(v, 4)],
    ["file_bpw", "file", (v) => `${num(v, 3)} bpw`], ["ternary_share", "ternary", pct]],
  sparsity: [["measured", "measured", pct], ["reported", "reported", pct]],
  loads: [["load_s", "load", (v) => `${num(v, 2)} s`]],
  tensor_types: [["n_wrong", "wrong types", String]],
  answer: [["expected", "expected", String], ["first_number", "got", String]],
  source_answer: [["first_number", "source got", String]],
};

function summaryMetrics(v) {
  const d = v.details || {};
  const agreement = d.agreement || v.agreement || {};
  const bpw = d.bits_per_weight || {};
  const sparsity = d.sparsity || {};
  const items = [
    ["top1_agreement", "top-1 agreement", agreement.top1_agreement, pct],
    ["mean_kl", "mean KL (nats)", agreement.mean_kl, (x) => num(x, 4)],
    ["linear_bpw", "bits/weight (linear)", bpw.linear_bpw, (x) => num(x, 4)],
    ["file_bpw", "bits/weight (file)", bpw.file_bpw, (x) => num(x, 3)],
    ["sparsity", "zeros", sparsity.measured, pct],
    ["tokens_per_s", "tokens/s", v.tokens_per_s, (x) => num(x, 1)],
  ];
  return el("div", { class: "metrics" }, items.filter(([, , value]) => typeof value === "number")
    .map(([key, label, value, fmt]) => el("div", { class: "metric", "data-metric": key, "data-value": value },
      el("span", { class: "value", text: fmt(value) }), el("span", { class: "label", text: label }))));
}

function renderValidation(validation) {
  const box = $("#validation");
  if (!validation || !validation.verdict) {
    box.replaceChildren(el("p", { class: "muted", text: "Not validated yet." }));
    $("#validation-checks").replaceChildren();
    return;
  }
  const details = validation.details || {};
  const rows = Object.entries(validation.checks || {}).map(([name, verdict]) => {
    const detail = details[name] || {};
    const numbers = (CHECK_NUMBERS[name] || []).filter(([key]) => detail[key] !== undefined && detail[key] !== null)
      .map(([key, label, fmt]) => `${label} ${fmt(detail[key])}`).join(" · ");
    return el("tr", { "data-check": name },
      el("td", { text: name }), el("td", {}, badge(verdict)),
      el("td", { class: "numbers", text: numbers }),
      el("td", { class: "reason", text: detail.reason || "" }));
  });
  box.replaceChildren(
    el("p", {}, "Verdict ", el("span", { class: `verdict badge ${validation.verdict}`, text: validation.verdict }),
      validation.device ? el("span", { class: "muted", text: ` on ${validation.device}` }) : null),
    summaryMetrics(validation),
    el("p", {}, "“1+1=” answer: ", el("code", { class: "answer", text: JSON.stringify(validation.text) })));
  const head = el("tr", {}, ["check", "verdict", "numbers", "reason"].map((h) => el("th", { text: h })));
  $("#validation-checks").replaceChildren(el("h3", { text: "Validation checks" }),
    el("table", { class: "checks" }, el("thead", {}, head), el("tbody", {}, rows)));
}

// ---- artifacts and the sparsity plot --------------------------------------------------------
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
    delete box.dataset.report;
    box.replaceChildren(el("p", { class: "muted", text: "No decompose report yet." }));
    return;
  }
  if (box.dataset.report === (report && report.sha256)) return;  // already drawn
  box.dataset.report = report ? report.sha256 : "";
  const parts = [];
  if (report && report.retained === false) {
    parts.push(el("p", { class: "muted", text: "The decompose report's bytes are not retained (removed by gc)." }));
  } else if (report) {
    const data = await api(`/api/artifacts/${report.sha256}/download`);
    parts.push(sparsityChart(data.layers || {}, data.totals || {}));
    const search = (data.allocation || {}).search;
    if (search) parts.push(searchTable(search));
  }
  const candidates = outputs.find((o) => o.name === "candidates.png");
  if (candidates) {
    const blob = await api(`/api/artifacts/${candidates.sha256}/download`, { blob: true });
    const url = URL.createObjectURL(blob);
    state.blobs.push(url);
    parts.push(el("img", { src: url, alt: "size against agreement of the files the auto search tried",
      class: "plot" }));
  }
  if (png) {
    const blob = await api(`/api/artifacts/${png.sha256}/download`, { blob: true });
    const url = URL.createObjectURL(blob);
    state.blobs.push(url);
    parts.push(el("details", {}, el("summary", { text: "Plot from the decompose stage" }),
      el("img", { src: url, alt: "per-layer sparsity plot", class: "plot" })));
  }
  box.replaceChildren(...parts);
}

// The auto recipe's quality search: every file tried, the chosen one marked.
function searchTable(search) {
  const target = [["min_top1", "top-1 ≥"], ["max_kl", "KL ≤"]]
    .filter(([key]) => search[key] != null).map(([key, text]) => `${text} ${search[key]}`).join(", ");
  const head = el("tr", {}, ...["file MB", "bpw", "top-1", "mean KL", "meets", ""].map(
    (text) => el("th", { text })));
  const rows = search.trials.map((t, i) => el("tr", { class: i === search.chosen ? "chosen" : "" },
    el("td", { text: (t.file_bytes / 1e6).toFixed(1) }), el("td", { text: t.spent_bpw.toFixed(2) }),
    el("td", { text: `${(100 * t.top1).toFixed(1)} %` }), el("td", { text: t.mean_kl.toFixed(3) }),
    el("td", { text: t.meets ? "yes" : "no" }), el("td", { text: i === search.chosen ? "chosen" : "" })));
  return el("div", { class: "search" },
    el("h3", { text: `Auto search (${target}; ${search.positions} positions of the ${search.scored_on} text)` }),
    el("table", { class: "search-trials" }, head, ...rows),
    search.met ? el("p", { class: "muted", text: "Validate confirms the target on its own text." })
      : el("p", { class: "warn", text: "No file tried met the target; the largest is kept." }));
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
            "lineage"),
          " ",
          out.retained === false
            ? el("span", { class: "muted", title: "removed by gc; the record and lineage stay",
              text: "bytes not retained" })
            : el("button", { type: "button", onclick: () => guard(download(out)) }, "download"))));
    }
  }
  $("#artifacts tbody").replaceChildren(...rows);
}

async function download(artifact) {
  const blob = await api(`/api/artifacts/${artifact.sha256}/download`, { blob: true });
  const url = URL.createObjectURL(blob);
  const link = el("a", { href: url, download: artifact.name.split("/").pop() });
  document.body.append(link);
  link.click();
  link.remove();
  setTimeout(() => URL.revokeObjectURL(url), 60000);
}

// ---- the auto allocation against another job ----------------------------------------------------
async function compareAllocation(event) {
  event.preventDefault();
  const other = Number($("#against-job").value);
  const job = await api(`/api/jobs/${state.jobId}?against=${other}`);
  $("#allocation-diff").replaceChildren(allocationDiff(job.allocation_diff));
}

function allocationDiff(diff) {
  if (diff.error) return el("p", { class: "warn", text: diff.error });
  const moved = [...diff.up.map((m) => ["up", m]), ...diff.down.map((m) => ["down", m])];
  const summary = `${diff.up.length} up, ${diff.down.length} down, ${diff.unchanged} unchanged against job `
    + `${diff.against}` + (diff.same_source ? "" : " (a different source)")
    + (diff.only_here.length || diff.only_there.length
      ? `; ${diff.only_here.length} tensors only here, ${diff.only_there.length} only there` : "");
  const head = el("tr", {}, ...["tensor", `job ${diff.against}`, "this job", ""].map((text) => el("th", { text })));
  const rows = moved.map(([way, m]) => el("tr", { class: way },
    el("td", {}, el("code", { text: m.tensor })), el("td", { text: m.from }), el("td", { text: m.to }),
    el("td", { text: way === "up" ? "▲ up" : "▼ down" })));
  return el("div", { class: "allocation-diff" }, el("p", { text: summary }),
    moved.length ? el("table", {}, head, ...rows) : el("p", { class: "muted", text: "No tensor moved." }));
}
