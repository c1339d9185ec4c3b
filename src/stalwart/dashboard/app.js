// stalwart's live dashboard: polls the controller's JSON and redraws in place (no reload, no
// dependencies). The machine grid is one canvas, redrawn only when a machine changes, so a job of
// 1,024 machines costs one fillRect each.
"use strict";

const COLORS = {
  active: "#16a34a", standby: "#3b82f6", evicted: "#dc2626", idle: "#d1d5db", provisioning: "#fbbf24",
  released: "#9ca3af", loss: "#2563eb", throughput: "#0d9488", ettr: "#16a34a", window_ettr: "#9333ea",
  detection: "#f59e0b", localization: "#ef4444", failover: "#3b82f6", lost_progress: "#6b7280",
  hot_update: "#8b5cf6", startup: "#a3a3a3", other: "#d4d4d4", incident: "#dc2626",
};
const PHASES = ["detection", "localization", "failover", "lost_progress", "hot_update"];
const POLL_MS = 1000;
const MAX_DRAW = 1500;      // points per line drawn (older points are strided)

const S = {
  job: new URLSearchParams(location.search).get("job") || "latest", jobId: null, cursor: 0,
  steps: [], ettr: [], ov: null, gridKey: "", grid: {cell: 12, gap: 2, cols: 1, rows: []},
  details: {}, pinned: null, polls: 0, ready: false, firstRenderMs: null, lastRenderMs: 0,
  errors: 0,
};

const $ = (id) => document.getElementById(id);
const esc = (s) => String(s === null || s === undefined ? "" : s).replace(/[&<>"']/g,
  (c) => ({"&": "&amp;", "<": "&lt;", ">": "&gt;", '"': "&quot;", "'": "&#39;"}[c]));
const fmt = (v, d = 3) => (v === null || v === undefined || Number.isNaN(v)) ? "–" : Number(v).toFixed(d);

// The API's token comes in the URL's fragment (#token=..., never sent to a server nor logged),
// is kept for this tab only (sessionStorage) and taken out of the address bar.
const TOKEN = (() => {
  const m = /(?:^#|&)token=([^&]+)/.exec(location.hash);
  if (m) {
    sessionStorage.setItem("stalwartToken", decodeURIComponent(m[1]));
    history.replaceState(null, "", location.pathname + location.search);
  }
  return sessionStorage.getItem("stalwartToken") || "";
})();

async function getJSON(path) {
  const r = await fetch(path, {cache: "no-store", headers: TOKEN ? {Authorization: `Bearer ${TOKEN}`} : {}});
  const body = await r.json();
  if (r.status === 401) throw new Error("the controller wants its token: open the dashboard at the address " +
                                        "`stalwart run` or `stalwart status` prints (…/#token=…)");
  if (!r.ok) throw new Error(body.error || `${r.status} ${path}`);
  return body;
}

// -- plots (the same pictures as stalwart/plots.py) ----------------------------------------------
function niceTicks(lo, hi, n) {
  if (!(isFinite(lo) && isFinite(hi)) || hi <= lo) return [lo];
  const raw = (hi - lo) / n, mag = Math.pow(10, Math.floor(Math.log10(raw)));
  const step = [1, 2, 2.5, 5, 10].map((m) => m * mag).find((s) => s >= raw);
  const out = [];
  for (let t = Math.ceil(lo / step - 1e-9) * step; t <= hi + step * 1e-9; t += step) out.push(+t.toFixed(10));
  return out;
}

function stride(points) {
  if (points.length <= MAX_DRAW) return points;
  const k = Math.ceil(points.length / MAX_DRAW), out = [];
  for (let i = 0; i < points.length; i += k) out.push(points[i]);
  if (out[out.length - 1] !== points[points.length - 1]) out.push(points[points.length - 1]);
  return out;
}

function lineChart(series, o) {
  const W = o.width || 640, H = o.height || 220, L = 52, R = 14, T = 26, B = 34;
  const xs = [], ys = [];
  for (const s of series) for (const [x, y] of s.points) if (y !== null && isFinite(y)) { xs.push(x); ys.push(y); }
  if (!xs.length) return `<svg viewBox="0 0 ${W} ${H}" data-points="0"><text x="${W / 2}" y="${H / 2}" ` +
    `text-anchor="middle" fill="#6b7280" font-size="12">no data yet</text></svg>`;
  for (const m of o.marks || []) { xs.push(m.x); if (m.x2 !== null && m.x2 !== undefined) xs.push(m.x2); }
  let x0 = Math.min(...xs), x1 = Math.max(...xs);
  let y0 = o.yMin !== undefined ? o.yMin : Math.min(...ys), y1 = o.yMax !== undefined ? o.yMax : Math.max(...ys);
  if (x1 === x0) x1 = x0 + 1;
  if (y1 === y0) { y0 -= 0.5 * (Math.abs(y0) || 1); y1 += 0.5 * (Math.abs(y1) || 1); }
  const sx = (x) => L + (W - L - R) * (x - x0) / (x1 - x0), sy = (y) => H - B - (H - T - B) * (y - y0) / (y1 - y0);
  const out = [];
  for (const t of niceTicks(y0, y1, 5)) {
    out.push(`<line x1="${L}" y1="${sy(t).toFixed(1)}" x2="${W - R}" y2="${sy(t).toFixed(1)}" stroke="#e5e7eb"/>`,
      `<text x="${L - 4}" y="${(sy(t) + 3.5).toFixed(1)}" text-anchor="end">${+t.toPrecision(4)}</text>`);
  }
  for (const t of niceTicks(x0, x1, 6)) {
    out.push(`<text x="${sx(t).toFixed(1)}" y="${H - B + 15}" text-anchor="middle">${+t.toPrecision(4)}</text>`);
  }
  out.push(`<line x1="${L}" y1="${H - B}" x2="${W - R}" y2="${H - B}" stroke="#9ca3af"/>`,
    `<text x="${(L + W - R) / 2}" y="${H - 4}" text-anchor="middle">${esc(o.xLabel)}</text>`);
  for (const m of o.marks || []) {
    const x = sx(m.x), title = `<title>${esc(m.label)}</title>`;
    if (m.x2 !== null && m.x2 !== undefined && m.x2 > m.x) {
      out.push(`<rect class="mark" x="${x.toFixed(1)}" y="${T}" width="${Math.max(1, sx(m.x2) - x).toFixed(1)}" ` +
        `height="${H - T - B}" fill="${COLORS.incident}" fill-opacity="0.12">${title}</rect>`);
    }
    out.push(`<line class="mark" x1="${x.toFixed(1)}" y1="${T}" x2="${x.toFixed(1)}" y2="${H - B}" ` +
      `stroke="${COLORS.incident}" stroke-dasharray="3 2">${title}</line>`,
      `<text x="${(x + 2).toFixed(1)}" y="${T + 9}" fill="${COLORS.incident}" font-size="9">#${esc(m.id)}</text>`);
  }
  let lx = L, n = 0;
  for (const s of series) {
    const pts = stride(s.points.filter(([x, y]) => y !== null && isFinite(y)));
    n += pts.length;
    const d = pts.map(([x, y]) => `${sx(x).toFixed(1)},${sy(y).toFixed(1)}`).join(" ");
    out.push(`<polyline class="series" data-name="${esc(s.name)}" fill="none" stroke="${s.color}" ` +
      `stroke-width="1.6"${s.dash ? ` stroke-dasharray="${s.dash}"` : ""} points="${d}"/>`,
      `<line x1="${lx}" y1="${T - 12}" x2="${lx + 14}" y2="${T - 12}" stroke="${s.color}" stroke-width="2"/>`,
      `<text x="${lx + 18}" y="${T - 8}">${esc(s.name)}</text>`);
    lx += 26 + 7 * s.name.length;
  }
  return `<svg viewBox="0 0 ${W} ${H}" font-family="sans-serif" font-size="10" fill="#374151" ` +
    `data-points="${n}" data-last-x="${x1}">${out.join("")}</svg>`;
}

function incidentMarks() {
  return (S.ov ? S.ov.incidents : []).filter((i) => i.detected_at !== null).map((i) => ({
    id: i.id, x: i.detected_at, x2: i.resumed_at !== null ? i.resumed_at : i.localized_at,
    label: `#${i.id} ${i.symptom} → ${i.mechanism || "localizing"}`,
  }));
}

function renderPlots() {
  const marks = incidentMarks(), win = S.windowS || 3600;
  $("plot-ettr").innerHTML = lineChart([
    {name: "cumulative ETTR", color: COLORS.ettr, points: S.ettr.map((p) => [p[0], p[1]])},
    {name: `sliding ETTR (${win / 3600} h)`, color: COLORS.window_ettr, dash: "5 3", points: S.ettr.map((p) => [p[0], p[2]])},
  ], {xLabel: "seconds since the job started", yMin: 0, yMax: 1, marks, width: 1200, height: 230});
  const lossByStep = new Map();
  for (const p of S.steps) if (p[2] !== null) lossByStep.set(p[1], p[2]);  // the last execution wins
  $("plot-loss").innerHTML = lineChart([{name: "loss", color: COLORS.loss,
    points: [...lossByStep.entries()].sort((a, b) => a[0] - b[0])}], {xLabel: "step"});
  $("plot-rate").innerHTML = lineChart([{name: "steps/s", color: COLORS.throughput,
    points: S.steps.map((p) => [p[0], p[3]])}], {xLabel: "seconds since the job started", yMin: 0, marks});
}

// -- machine grid: one canvas ---------------------------------------------------------------------
function layoutGrid(n) {
  const g = S.grid, width = Math.max(200, $("grid-wrap").clientWidth);
  g.cell = n <= 64 ? 30 : n <= 256 ? 18 : 12;
  g.gap = n <= 256 ? 3 : 2;
  g.cols = Math.max(1, Math.floor((width + g.gap) / (g.cell + g.gap)));
  const rows = Math.max(1, Math.ceil(n / g.cols)), c = $("grid");
  const dpr = window.devicePixelRatio || 1, w = g.cols * (g.cell + g.gap), h = rows * (g.cell + g.gap);
  c.width = Math.round(w * dpr); c.height = Math.round(h * dpr);
  c.style.width = `${w}px`; c.style.height = `${h}px`;
  c.getContext("2d").setTransform(dpr, 0, 0, dpr, 0, 0);
}

function drawGrid() {
  const g = S.grid, rows = g.rows, ctx = $("grid").getContext("2d");
  ctx.clearRect(0, 0, $("grid").width, $("grid").height);
  ctx.font = "10px sans-serif"; ctx.textAlign = "center"; ctx.textBaseline = "middle";
  for (let i = 0; i < rows.length; i++) {
    const [id, state, alive] = rows[i], x = (i % g.cols) * (g.cell + g.gap), y = Math.floor(i / g.cols) * (g.cell + g.gap);
    ctx.fillStyle = COLORS[state] || "#e5e7eb";
    ctx.fillRect(x, y, g.cell, g.cell);
    if (!alive) { ctx.strokeStyle = "#111827"; ctx.lineWidth = 2; ctx.strokeRect(x + 1, y + 1, g.cell - 2, g.cell - 2); }
    if (state === "evicted") {
      ctx.strokeStyle = "#fff"; ctx.lineWidth = 1.5; ctx.beginPath();
      ctx.moveTo(x + 3, y + 3); ctx.lineTo(x + g.cell - 3, y + g.cell - 3);
      ctx.moveTo(x + g.cell - 3, y + 3); ctx.lineTo(x + 3, y + g.cell - 3); ctx.stroke();
    } else if (g.cell >= 28) {
      ctx.fillStyle = "#fff"; ctx.fillText(id, x + g.cell / 2, y + g.cell / 2);
    }
  }
}

function renderGrid(m) {
  const key = JSON.stringify(m.rows);
  if (key !== S.gridKey) {
    if (m.rows.length !== S.grid.rows.length) layoutGrid(m.rows.length);
    S.grid.rows = m.rows; S.grid.reasons = m.reasons; S.gridKey = key;
    drawGrid();
    if (S.pinned !== null) showMachine(S.pinned, true);
  }
  $("machine-counts").innerHTML = Object.entries(m.counts).filter(([, n]) => n).map(([s, n]) =>
    `<i style="background:${COLORS[s]};display:inline-block;width:10px;height:10px"></i> ${esc(s)} ${n}`).join(" &nbsp; ");
}

function machineText(i) {
  const [id, state, alive, slot, reason] = S.grid.rows[i], G = (S.ov.layout || {}).gpus_per_machine || 1;
  let t = `${id}: ${state}`;
  if (slot >= 0) t += `, slot ${slot} (ranks ${slot * G}–${slot * G + G - 1})`;
  if (!alive) t += ", agent not answering";
  if (reason >= 0) t += ` — ${S.grid.reasons[reason]}`;
  return t;
}

function cellIndex(ev) {
  const g = S.grid, r = $("grid").getBoundingClientRect();
  const cx = Math.floor((ev.clientX - r.left) / (g.cell + g.gap)), cy = Math.floor((ev.clientY - r.top) / (g.cell + g.gap));
  const i = cy * g.cols + cx;
  return cx >= 0 && cx < g.cols && i >= 0 && i < g.rows.length ? i : -1;
}

function showMachine(id, pinned) {
  const i = S.grid.rows.findIndex((r) => r[0] === id);
  if (i < 0) return;
  $("machine-detail").textContent = machineText(i) + (pinned ? " (pinned; click again to release)" : "");
}

function setupGrid() {
  const c = $("grid"), tip = $("tooltip");
  c.addEventListener("mousemove", (ev) => {
    const i = cellIndex(ev);
    if (i < 0) { tip.hidden = true; return; }
    tip.textContent = machineText(i); tip.hidden = false;
    tip.style.left = `${ev.clientX + 12}px`; tip.style.top = `${ev.clientY + 12}px`;
    if (S.pinned === null) showMachine(S.grid.rows[i][0], false);
  });
  c.addEventListener("mouseleave", () => { tip.hidden = true; });
  c.addEventListener("click", (ev) => {
    const i = cellIndex(ev);
    if (i < 0) return;
    const id = S.grid.rows[i][0];
    S.pinned = S.pinned === id ? null : id;
    showMachine(id, S.pinned !== null);
  });
  window.addEventListener("resize", () => { layoutGrid(S.grid.rows.length); drawGrid(); });
}

// -- incidents ----------------------------------------------------------------------------------------
function renderTimeline() {
  const incs = S.ov.incidents, wall = Math.max(S.ov.wall_s || 1, 1), W = 1200, H = 20 + 16 * Math.max(1, incs.length);
  const sx = (t) => 8 + (W - 16) * Math.min(Math.max(t, 0), wall) / wall;
  const out = [`<line x1="8" y1="${H - 6}" x2="${W - 8}" y2="${H - 6}" stroke="#9ca3af"/>`];
  incs.forEach((inc, k) => {
    const y = 6 + 16 * k, det = inc.detected_at;
    let t = det - (inc.phases.detection || 0);
    for (const p of ["detection", "localization", "failover"]) {
      const d = inc.phases[p] || 0;
      if (d > 0) out.push(`<rect x="${sx(t).toFixed(1)}" y="${y}" width="${Math.max(2, sx(t + d) - sx(t)).toFixed(1)}" ` +
        `height="11" fill="${COLORS[p]}"><title>#${inc.id} ${p}: ${d.toFixed(2)} s</title></rect>`);
      t += d;
    }
    out.push(`<text x="${(sx(det) + 4).toFixed(1)}" y="${y + 9}" font-size="10">#${esc(inc.id)} ${esc(inc.symptom)}</text>`);
  });
  $("timeline").innerHTML = `<svg viewBox="0 0 ${W} ${H}" font-family="sans-serif" fill="#374151">${out.join("")}</svg>`;
}

function incidentHeadline(inc) {
  const ev = inc.evicted.length ? `evicted ${inc.evicted.join(", ")}` : "nothing evicted";
  const det = inc.detection_s !== null ? `, detected ${inc.detection_s.toFixed(2)} s after the fault` : "";
  return `#${inc.id} ${inc.symptom} (${inc.category}) → ${inc.mechanism || "localizing…"}; ${ev}${det}; at t=${fmt(inc.detected_at, 1)} s`;
}

function renderIncidents() {
  const box = $("incidents");
  $("incident-count").textContent = `${S.ov.incidents.length}`;
  for (const inc of S.ov.incidents) {
    let el = box.querySelector(`details[data-id="${inc.id}"]`);
    if (!el) {
      el = document.createElement("details");
      el.className = "incident"; el.dataset.id = inc.id;
      el.innerHTML = `<summary></summary><div class="body"><p class="cause"></p><div class="more">loading…</div></div>`;
      el.addEventListener("toggle", () => { if (el.open) loadIncident(inc.id); });
      box.appendChild(el);
    }
    el.querySelector("summary").textContent = incidentHeadline(inc);
    el.querySelector(".cause").textContent = `cause: ${inc.cause || "(being localized)"}`;
    if (el.open && S.details[inc.id] !== JSON.stringify(inc)) loadIncident(inc.id);
  }
}

function table(head, rows) {
  return `<table><tr>${head.map((h) => `<th>${esc(h)}</th>`).join("")}</tr>` +
    rows.map((r) => `<tr>${r.map((c) => `<td>${c}</td>`).join("")}</tr>`).join("") + "</table>";
}

async function loadIncident(id) {
  const el = $("incidents").querySelector(`details[data-id="${id}"]`);
  const inc = S.ov.incidents.find((i) => i.id === id);
  S.details[id] = JSON.stringify(inc);
  let d;
  try { d = await getJSON(`/api/jobs/${S.jobId}/incidents/${id}`); } catch (e) {
    el.querySelector(".more").textContent = `could not load: ${e.message}`; return;
  }
  const parts = [];
  parts.push("<h4>Per-phase durations (s)</h4>" + table(PHASES, [PHASES.map((p) => fmt(d.phases[p], 2))]));
  parts.push(`<p>suspects: ${esc(d.suspects.join(", ") || "–")}; evicted: ${esc(d.evicted.join(", ") || "–")}` +
    `${d.analysis ? `; analysis: ${esc(d.analysis)}` : ""}</p>`);
  if (d.evidence.length) {
    parts.push("<h4>Evidence</h4>" + table(["t (s)", "event", "data"], d.evidence.map((e) =>
      [fmt(e.t, 2), esc(e.kind), `<code>${esc(JSON.stringify(e.data))}</code>`])));
  }
  if (d.checks) {
    parts.push(`<h4>Stop-time checks (${esc(d.checks.checks.join(", "))}; ${fmt(d.checks.seconds, 2)} s)</h4>` +
      table(["machine", "check", "result", "detail"], d.checks.results.map((r) => [esc(r.machine), esc(r.check),
        r.ok ? '<span class="ok">pass</span>' : '<span class="bad">FAIL</span>', esc(r.detail)])));
  }
  if (d.replay) {
    parts.push(`<h4>Dual-phase replay (k=${esc(d.replay.k)}, ${fmt(d.replay.seconds, 1)} s)</h4>` +
      `<p>failed horizontal groups: ${esc(JSON.stringify(d.replay.failed_horizontal))}; failed vertical groups: ` +
      `${esc(JSON.stringify(d.replay.failed_vertical))}; isolated: ${esc((d.replay.machines || []).join(", ") || "none")}</p>`);
  }
  if (d.stacks.length) {
    parts.push("<h4>Stacks, grouped</h4>" + d.stacks.map((g) =>
      `<p>${g.processes.length} process(es): ${esc(g.processes.join(", "))}</p><pre>${esc(g.stack)}</pre>`).join(""));
  }
  el.querySelector(".more").innerHTML = parts.join("");
}

// -- the rest of the page -----------------------------------------------------------------------------
function renderHeader(ov) {
  $("job").textContent = ov.job;
  const st = $("state");
  st.textContent = ov.phase; st.className = `badge ${ov.phase}`;
  $("step").textContent = `${ov.step} / ${ov.steps_target}`;
  $("progress").style.width = `${Math.min(100, 100 * ov.step / Math.max(1, ov.steps_target))}%`;
  $("loss").textContent = fmt(ov.loss, 4);
  const last = S.steps.length ? S.steps[S.steps.length - 1][3] : null;
  $("rate").textContent = fmt(ov.steps_per_s !== null ? ov.steps_per_s : last, 1);
  $("ettr").textContent = fmt(ov.ettr, 3);
  $("window-ettr").textContent = fmt(ov.window_ettr, 3);
  $("wall").textContent = `${fmt(ov.wall_s, 1)} s`;
  $("restarts").textContent = ov.restarts;
  $("standby").textContent = ov.standby_pool;
  $("report-link").href = `/api/jobs/${ov.job_id}/report.html`;
  const total = Object.values(ov.unproductive_s).reduce((a, b) => a + b, 0) + (ov.productive_s || 0);
  const parts = [["productive", ov.productive_s || 0, "#16a34a"]].concat(
    Object.entries(ov.unproductive_s).map(([k, v]) => [k, v, COLORS[k]]));
  $("buckets").innerHTML = parts.filter(([, v]) => v > 0).map(([k, v, c]) =>
    `<div style="width:${(100 * v / (total || 1)).toFixed(2)}%;background:${c}" title="${esc(k)}: ${v.toFixed(2)} s"></div>`).join("");
  $("bucket-legend").innerHTML = parts.map(([k, v, c]) => `<span><i style="background:${c}"></i>${esc(k)} ${v.toFixed(1)} s</span>`).join("");
}

async function poll() {
  const t0 = performance.now();
  try {
    const ov = await getJSON(`/api/jobs/${S.job}/dashboard`);
    if (ov.job_id === null) throw new Error("no job has been submitted to this controller yet");
    if (ov.job_id !== S.jobId) {
      Object.assign(S, {jobId: ov.job_id, cursor: 0, steps: [], ettr: [], details: {}, gridKey: ""});
      $("incidents").innerHTML = "";
    }
    const se = await getJSON(`/api/jobs/${ov.job_id}/series?since=${S.cursor}`);
    S.ov = ov;
    S.steps.push(...se.steps.points); S.cursor = se.steps.next; S.ettr = se.ettr; S.windowS = se.window_s;
    renderHeader(ov); renderGrid(ov.machines); renderPlots(); renderTimeline(); renderIncidents();
    $("banner").hidden = true;
    S.polls += 1;
    S.lastRenderMs = performance.now() - t0;
    if (!S.ready) { S.ready = true; S.firstRenderMs = performance.now(); document.body.dataset.ready = "1"; }
  } catch (e) {
    S.errors += 1;
    $("banner").textContent = e.message; $("banner").hidden = false;
  }
  setTimeout(poll, POLL_MS);
}

// for tests and scripts: where a machine's cell is, its colour on the canvas, the page's state
const LONG_TASKS = [];
try {
  new PerformanceObserver((l) => { for (const e of l.getEntries()) LONG_TASKS.push(e.duration); })
    .observe({type: "longtask", buffered: true});
} catch (e) { /* no long-task timing in this browser */ }

function cellOffset(id) {
  const i = S.grid.rows.findIndex((r) => r[0] === id), g = S.grid;
  if (i < 0) return null;
  return {x: (i % g.cols) * (g.cell + g.gap) + g.cell / 2, y: Math.floor(i / g.cols) * (g.cell + g.gap) + g.cell / 2,
    size: g.cell};
}

window.stalwartDash = {
  state: S,
  cellOffset,
  cellCenter(id) {
    const o = cellOffset(id), r = $("grid").getBoundingClientRect();
    return o && {x: r.left + o.x, y: r.top + o.y};
  },
  cellColor(id) {   // a pixel near the cell's left edge (the evicted mark crosses its middle)
    const o = cellOffset(id), dpr = window.devicePixelRatio || 1;
    if (!o) return null;
    const px = $("grid").getContext("2d").getImageData(Math.round((o.x - o.size / 2 + 1) * dpr),
      Math.round(o.y * dpr), 1, 1).data;
    return "#" + [px[0], px[1], px[2]].map((v) => v.toString(16).padStart(2, "0")).join("");
  },
  longTasks: () => LONG_TASKS.slice(),
};

setupGrid();
poll();
