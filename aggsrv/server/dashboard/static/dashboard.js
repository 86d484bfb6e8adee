// The aggsrv status page: polls api/status every 2 s and draws what it says. No dependencies;
// charts are plain SVG. Every value from the server goes in as text (textContent), never as
// markup, so a client id cannot inject anything.
"use strict";

const SVG = "http://www.w3.org/2000/svg";
const STATES = ["active", "idle", "straggling", "dropped_out"];
const COLORS = { active: "#2e90fa", idle: "#98a2b3", straggling: "#f79009", dropped_out: "#d92d20" };

function $(id) { return document.getElementById(id); }

function setText(id, value) {
  const el = $(id);
  if (el) el.textContent = value === null || value === undefined ? "–" : String(value);
}

function svgEl(name, attrs, text) {
  const el = document.createElementNS(SVG, name);
  for (const [k, v] of Object.entries(attrs)) el.setAttribute(k, String(v));
  if (text !== undefined) el.textContent = text;
  return el;
}

function fmtBound(b, prev) {
  if (b === null) return prev === null ? "all" : `>${fmtNum(prev)}`;
  return `≤${fmtNum(b)}`;
}

function fmtNum(x) {
  if (x === null || x === undefined) return "–";
  if (Math.abs(x) >= 1000) return x.toFixed(0);
  if (Number.isInteger(x)) return String(x);
  return x.toPrecision(3);
}

function fmtDuration(s) {
  if (s < 60) return `${s.toFixed(0)} s`;
  if (s < 3600) return `${(s / 60).toFixed(1)} min`;
  return `${(s / 3600).toFixed(1)} h`;
}

// A histogram {le: [...], counts: [...]} as bars; empty leading and trailing buckets dropped.
function drawHistogram(id, hist, color) {
  const box = $(id);
  box.replaceChildren();
  const W = 320, H = 160, pad = 22;
  const svg = svgEl("svg", { viewBox: `0 0 ${W} ${H}`, role: "img" });
  let first = hist.counts.findIndex((c) => c > 0);
  let last = hist.counts.length - 1 - [...hist.counts].reverse().findIndex((c) => c > 0);
  if (first < 0) {
    svg.appendChild(svgEl("text", { x: W / 2, y: H / 2, "text-anchor": "middle", fill: "#667085" },
      "no data yet"));
    box.appendChild(svg);
    return;
  }
  first = Math.max(0, first - 1);
  last = Math.min(hist.counts.length - 1, last + 1);
  const counts = hist.counts.slice(first, last + 1);
  const max = Math.max(...counts, 1);
  const bw = (W - 2 * pad) / counts.length;
  counts.forEach((c, i) => {
    const h = (H - 2 * pad) * (c / max);
    const x = pad + i * bw;
    const rect = svgEl("rect", { x: x + 1, y: H - pad - h, width: Math.max(bw - 2, 1), height: h,
                                 fill: color });
    const k = first + i;
    rect.appendChild(svgEl("title", {}, `${fmtBound(hist.le[k], k ? hist.le[k - 1] : null)}: ${c}`));
    svg.appendChild(rect);
    if (c > 0) {
      svg.appendChild(svgEl("text", { x: x + bw / 2, y: H - pad - h - 3, "text-anchor": "middle",
                                      "font-size": 10, fill: "#1d2330" }, String(c)));
    }
    svg.appendChild(svgEl("text", { x: x + bw / 2, y: H - 6, "text-anchor": "middle",
                                    "font-size": 9, fill: "#667085" },
                          fmtBound(hist.le[k], k ? hist.le[k - 1] : null)));
  });
  box.appendChild(svg);
}

// Evaluation results over versions: one line per metric, each scaled to its own range.
function drawEvaluation(id, results) {
  const box = $(id);
  box.replaceChildren();
  const W = 320, H = 160, pad = 24;
  const svg = svgEl("svg", { viewBox: `0 0 ${W} ${H}`, role: "img" });
  if (!results.length) {
    svg.appendChild(svgEl("text", { x: W / 2, y: H / 2, "text-anchor": "middle", fill: "#667085" },
      "no --eval results"));
    box.appendChild(svg);
    return;
  }
  const names = [...new Set(results.flatMap((r) => Object.keys(r.metrics)))].sort();
  const v0 = results[0].version, v1 = Math.max(results[results.length - 1].version, v0 + 1);
  const palette = ["#2e90fa", "#f79009", "#12b76a", "#d92d20", "#7a5af8"];
  names.forEach((name, j) => {
    const pts = results.filter((r) => name in r.metrics);
    const ys = pts.map((r) => r.metrics[name]);
    const lo = Math.min(...ys), hi = Math.max(...ys, lo + 1e-12);
    const d = pts.map((r, i) => {
      const x = pad + (W - 2 * pad) * (r.version - v0) / (v1 - v0);
      const y = H - pad - (H - 2 * pad) * (ys[i] - lo) / (hi - lo);
      return `${i ? "L" : "M"}${x.toFixed(1)},${y.toFixed(1)}`;
    }).join(" ");
    const color = palette[j % palette.length];
    svg.appendChild(svgEl("path", { d, fill: "none", stroke: color, "stroke-width": 2 }));
    svg.appendChild(svgEl("text", { x: pad + 4 + 110 * j, y: 12, "font-size": 11, fill: color },
      `${name} ${fmtNum(ys[ys.length - 1])}`));
  });
  svg.appendChild(svgEl("text", { x: pad, y: H - 6, "font-size": 9, fill: "#667085" }, `v${v0}`));
  svg.appendChild(svgEl("text", { x: W - pad, y: H - 6, "font-size": 9, fill: "#667085",
                                  "text-anchor": "end" }, `v${v1}`));
  box.appendChild(svg);
}

function fillRows(id, rows) {
  const body = $(id);
  body.replaceChildren();
  for (const cells of rows) {
    const tr = document.createElement("tr");
    for (const c of cells) {
      const td = document.createElement("td");
      td.textContent = String(c);
      tr.appendChild(td);
    }
    body.appendChild(tr);
  }
}

// The settings by group (s.strategy.groups: [title, keys]; differential privacy's only when
// it is on), a heading row before each group's key/value rows.
function renderSettings(strategy) {
  const body = $("settings");
  body.replaceChildren();
  for (const [title, keys] of strategy.groups || []) {
    const head = document.createElement("tr");
    const th = document.createElement("th");
    th.colSpan = 2;
    th.textContent = title;
    head.appendChild(th);
    body.appendChild(head);
    for (const k of keys) {
      const tr = document.createElement("tr");
      for (const c of [k, JSON.stringify(strategy.settings[k])]) {
        const td = document.createElement("td");
        td.textContent = String(c);
        tr.appendChild(td);
      }
      body.appendChild(tr);
    }
  }
}

// One row per shard (rank 0's view, s.shards; null for a single server): N rows, N small.
function renderShards(s) {
  const panel = $("shards-panel");
  panel.hidden = !s.shards;
  if (!s.shards) return;
  setText("shards-count", s.shards.length);
  fillRows("shards", s.shards.map((r) => [
    r.rank, r.address, `[${r.begin}, ${r.end})`, r.version,
    r.takes_writes ? "yes" : (r.reachable ? "no" : "unreachable"),
    r.last_heard === null ? "never" : fmtAgo(s.time - r.last_heard),
    r.durability === "on" ? fmtBytes(r.wal_bytes) +
      (r.last_checkpoint ? `, checkpoint v${r.last_checkpoint.version}` : "") : "off",
    r.reachable ? r.failure : r.error,
  ]));
  $("shards").querySelectorAll("tr").forEach((tr, i) => {
    if (!s.shards[i].takes_writes) tr.className = "refusing";
  });
}

function fmtBytes(n) {
  return n >= 1e6 ? `${(n / 1e6).toFixed(1)} MB` : `${(n / 1e3).toFixed(1)} kB`;
}

function fmtAgo(s) {
  return s < 0.5 ? "now" : `${fmtDuration(s)} ago`;
}

function render(s) {
  setText("strategy-name", s.strategy.name);
  setText("strategy-name-2", s.strategy.name);
  setText("version", s.version);
  setText("versions-last-minute", s.versions_last_minute);
  for (const k of ["accepted", "applied", "buffered", "filtered", "duplicate", "rejected"]) {
    setText(`updates-${k}`, s.updates[k]);
  }
  setText("clients-known", s.clients.known);
  const bar = $("states-bar");
  bar.replaceChildren();
  const total = STATES.reduce((a, k) => a + s.clients.states[k], 0);
  for (const k of STATES) {
    setText(`state-${k}`, s.clients.states[k]);
    if (total && s.clients.states[k]) {
      const span = document.createElement("span");
      span.style.width = `${100 * s.clients.states[k] / total}%`;
      span.style.background = COLORS[k];
      span.title = `${k}: ${s.clients.states[k]}`;
      bar.appendChild(span);
    }
  }
  setText("uptime", fmtDuration(Math.max(0, s.time - s.started)));
  const dp = s.privacy;
  $("privacy-card").hidden = !dp;
  if (dp) {
    setText("dp-epsilon", dp.epsilon === null ? "∞" : dp.epsilon.toFixed(3));
    setText("dp-delta", String(dp.delta));
    setText("dp-releases", dp.releases);
    setText("dp-target", dp.target_epsilon === null ? "none" : `ε ≤ ${dp.target_epsilon}`);
    setText("dp-spent", dp.budget_spent ? "· spent: no more versions" : "");
    $("dp-insecure").hidden = !dp.insecure_seed;
  }
  drawHistogram("chart-staleness", s.staleness, "#2e90fa");
  drawHistogram("chart-turnaround", s.job_turnaround_seconds, "#12b76a");
  drawHistogram("chart-lag", s.client_lag, "#f79009");
  drawHistogram("chart-rate", s.client_update_rate, "#7a5af8");
  drawHistogram("chart-silence", s.client_silence_seconds, "#667085");
  drawEvaluation("chart-eval", s.evaluation);
  setText("eval-count", s.evaluation.length);
  fillRows("slowest", s.clients.slowest.map((r) => [r.client, r.seconds.toFixed(1)]));
  fillRows("refusals", s.refusal_reasons.map((r) => [r.code, r.reason, r.count]));
  $("data-withheld").hidden = !s.data_withheld;
  renderSettings(s.strategy);
  const groups = $("groups");
  groups.replaceChildren();
  if (s.groups) {
    s.groups.groups.forEach((members, g) => {
      const p = document.createElement("p");
      p.textContent = `group ${g} (${members.length}): ${members.join(", ")}`;
      groups.appendChild(p);
    });
  } else {
    groups.textContent = "none";
  }
  setText("dropped", s.dropped_flags.length ? s.dropped_flags.join(", ") : "none");
  renderShards(s);
}

async function poll() {
  const status = $("connection");
  try {
    const resp = await fetch("api/status", { cache: "no-store" });
    if (!resp.ok) throw new Error(`HTTP ${resp.status}`);
    render(await resp.json());
    status.textContent = `updated ${new Date().toLocaleTimeString()}`;
    status.className = "muted";
  } catch (err) {
    status.textContent = `cannot reach the server (${err.message}); retrying`;
    status.className = "error";
  }
}

poll();
setInterval(poll, 2000);
