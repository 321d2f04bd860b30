// Bonsai Pipeline web page: an artifact's lineage as one graph, every file drawn once.
// Columns are the stages that wrote the files; a line joins each file to each file made from it.
"use strict";

// The stages in the server's graph order (each after its inputs), from /api/session: never spelled here.
const stageColumns = () => (state.session && state.session.stages) || [];
const NODE_W = 190;
const NODE_H = 36;
const COL_GAP = 70;
const ROW_GAP = 12;
const HEAD_H = 24;

function showChain(sha256, verify) {
  state.chainSha = sha256;
  state.chainJobId = state.jobId;
  $("#chain-panel").hidden = false;
  $("#chain-status").textContent = verify ? "re-hashing every file…" : "loading…";
  guard(loadChain(sha256, verify));
}

function producer(node) {
  return node.statements && node.statements.length
    ? node.statements.map((s) => `${s.stage} run ${s.stage_run_id} (job ${s.job_id})`).join(", ")
    : "no statement";
}

// One entry per sha256; inputs the report names but does not describe become placeholders.
function lineageNodes(report) {
  const bySha = new Map();
  for (const node of report.nodes) if (!bySha.has(node.sha256)) bySha.set(node.sha256, node);
  for (const node of report.nodes) {
    for (const input of node.inputs || []) {
      if (!bySha.has(input.sha256)) {
        bySha.set(input.sha256, { name: input.name, sha256: input.sha256, inputs: [], statements: [], ok: false });
      }
    }
  }
  return bySha;
}

function lineageGraph(report) {
  const bySha = lineageNodes(report);
  const stages = stageColumns();
  const columnOf = (node) => {
    const index = stages.indexOf(node.name.split("/")[0]);
    return index < 0 ? stages.length : index;
  };
  const columns = new Map();
  for (const node of bySha.values()) {
    const c = columnOf(node);
    if (!columns.has(c)) columns.set(c, []);
    columns.get(c).push(node);
  }
  const order = [...columns.keys()].sort((a, b) => a - b);
  const place = new Map();
  order.forEach((c, ci) => {
    columns.get(c).sort((a, b) => a.name.localeCompare(b.name)).forEach((node, ri) => {
      place.set(node.sha256, { x: 8 + ci * (NODE_W + COL_GAP), y: HEAD_H + ri * (NODE_H + ROW_GAP) });
    });
  });
  const rows = Math.max(...order.map((c) => columns.get(c).length));
  const width = 16 + order.length * NODE_W + (order.length - 1) * COL_GAP;
  const height = HEAD_H + rows * (NODE_H + ROW_GAP) + 4;
  const graph = svg("svg", { viewBox: `0 0 ${width} ${height}`, width: "100%", class: "lineage", role: "img",
    "aria-label": `lineage of ${report.name}` });
  graph.style.maxWidth = `${width}px`;
  order.forEach((c, ci) => graph.append(svg("text", { x: 8 + ci * (NODE_W + COL_GAP), y: 14, class: "column" },
    stages[c] || "other")));
  const edges = svg("g", { class: "edges" });
  graph.append(edges);
  for (const node of bySha.values()) {
    const to = place.get(node.sha256);
    for (const input of node.inputs || []) {
      const from = place.get(input.sha256);
      const x1 = from.x + NODE_W;
      const y1 = from.y + NODE_H / 2;
      const x2 = to.x;
      const y2 = to.y + NODE_H / 2;
      const bend = Math.max(30, (x2 - x1) / 2);
      edges.append(svg("path", { class: "edge", "data-from": input.sha256, "data-to": node.sha256,
        d: `M${x1},${y1} C${x1 + bend},${y1} ${x2 - bend},${y2} ${x2},${y2}` }));
    }
  }
  for (const node of bySha.values()) {
    const { x, y } = place.get(node.sha256);
    const label = node.name.includes("/") ? node.name.slice(node.name.indexOf("/") + 1) : node.name;
    const g = svg("g", { class: `node ${node.ok === false ? "broken" : "ok"}${node.sha256 === report.sha256
      ? " root" : ""}`, "data-name": node.name, "data-sha256": node.sha256, tabindex: 0,
    transform: `translate(${x},${y})` });
    g.append(svg("title", {}, `${node.name}\n${node.sha256}\n${producer(node)}`));
    g.append(svg("rect", { width: NODE_W, height: NODE_H, rx: 5 }));
    g.append(svg("text", { x: 8, y: 15, class: "name" },
      `${node.ok === false ? "✗" : "✓"} ${label.length > 23 ? `…${label.slice(-22)}` : label}`));
    g.append(svg("text", { x: 8, y: 29, class: "meta" }, `${node.kind || "?"} · ${bytes(node.size_bytes)}`));
    g.addEventListener("click", () => selectLineageNode(node, bySha));
    g.addEventListener("keydown", (e) => { if (e.key === "Enter") selectLineageNode(node, bySha); });
    graph.append(g);
  }
  return graph;
}

function selectLineageNode(node, bySha) {
  for (const g of document.querySelectorAll("#chain .node")) {
    g.classList.toggle("picked", g.dataset.sha256 === node.sha256);
  }
  for (const path of document.querySelectorAll("#chain .edge")) {
    path.classList.toggle("hi", path.dataset.to === node.sha256 || path.dataset.from === node.sha256);
  }
  const inputs = (node.inputs || []).map((i) => (bySha.get(i.sha256) || i).name);
  const usedBy = [...bySha.values()].filter((n) => (n.inputs || []).some((i) => i.sha256 === node.sha256))
    .map((n) => n.name);
  $("#chain-detail").replaceChildren(el("dl", { class: "record" },
    el("dt", { text: "file" }), el("dd", { text: node.name }),
    el("dt", { text: "sha256" }), el("dd", {}, el("code", { text: node.sha256 })),
    el("dt", { text: "kind · size" }), el("dd", { text: `${node.kind || "?"} · ${bytes(node.size_bytes)}` }),
    el("dt", { text: "written by" }), el("dd", { text: producer(node) }),
    el("dt", { text: "signature" }), el("dd", { text: node.signature || "none" }),
    el("dt", { text: "made from" }), el("dd", { text: inputs.join(", ") || "nothing (a source file)" }),
    el("dt", { text: "used by" }), el("dd", { text: usedBy.join(", ") || "nothing in this lineage" })));
}

async function loadChain(sha256, verify) {
  const report = await api(`/api/artifacts/${sha256}/chain?verify=${verify}`);
  $("#chain-title").textContent = `Lineage of ${report.name}`;
  $("#chain").replaceChildren(lineageGraph(report));
  $("#chain-detail").replaceChildren();
  $("#chain-problems").replaceChildren(...report.problems.map((p) => el("li", { text: p.message })));
  const checked = report.rehashed ? `${bytes(report.rehashed_bytes)} re-hashed` : "records checked (not re-hashed)";
  $("#chain-status").replaceChildren(badge(report.ok ? "verified" : "broken"),
    ` ${report.artifacts} artifacts, ${report.statements} statements, ${checked} in ${report.elapsed_s} s`);
  $("#chain-panel").scrollIntoView({ behavior: "smooth", block: "start" });
}
