// The Sluicegate console page: renders the broker's live snapshot (server-sent events from
// /console/api/events), looks jobs up, and sends operators' actions. No dependencies.
"use strict";

const esc = (v) => String(v ?? "").replace(/[&<>"']/g, (c) => ({
  "&": "&amp;", "<": "&lt;", ">": "&gt;", '"': "&quot;", "'": "&#39;" }[c]));
const num = (v, d = 1) => (v === null || v === undefined ? "–" : Number(v).toFixed(d));
const pct = (v) => (v === null || v === undefined ? "–" : (100 * v).toFixed(1) + " %");
const $ = (id) => document.getElementById(id);
let me = { name: "?", role: "viewer" };
let last = null;

async function whoami() {
  const r = await fetch("/console/api/whoami");
  if (r.status === 401) { location.href = "/console/login"; return; }
  me = await r.json();
  $("who").textContent = `${me.name} (${me.role})`;
}

function notice(text, bad) {
  const n = $("notice");
  n.textContent = text;
  n.className = "notice" + (bad ? " bad" : "");
  n.hidden = !text;
}

async function act(action, target) {
  const note = action === "uncordon" || action === "resume" ? "" : (prompt(`${action} ${target}: a note for the audit log`, "") ?? null);
  if (note === null) return;
  const r = await fetch("/console/api/actions", {
    method: "POST",
    headers: { "Content-Type": "application/json" },
    body: JSON.stringify({ action, target, note }),
  });
  const body = await r.json().catch(() => ({}));
  if (r.ok) notice(`${action} ${target}: done (audited)`, false);
  else notice(`${action} ${target} refused (${r.status}): ${body.error || r.statusText}`, true);
}

function button(action, target) {
  if (me.role !== "operator") return "";
  return `<button class="act" data-action="${esc(action)}" data-target="${esc(target)}"
    data-testid="${esc(action)}-${esc(target)}">${esc(action)}</button>`;
}

function workerCard(w) {
  let state = w.online ? (w.health === "subhealthy" ? ["warn", "sub-healthy"] : ["ok", "online"]) : ["bad", "offline"];
  if (w.hold === "cordon") state = ["warn", "cordoned"];
  if (w.hold === "drain") state = w.drained ? ["warn", "drained"] : ["warn", `draining (${w.jobs_held} held)`];
  // A model is listed by name and by name@sha256: the name is enough here.
  const models = Object.entries(w.models || {}).filter(([m]) => !m.includes("@"))
    .map(([m, s]) => `${esc(m)}: ${esc(s)}`).join(", ");
  const util = w.utilisation ?? 0;
  const fc = w.forecast ? `forecast ${pct(w.forecast.predicted)}${w.forecast.crosses ? " (will fill)" : ""}` : "";
  const actions = w.hold ? button("uncordon", w.id) : button("drain", w.id) + button("cordon", w.id);
  return `<div class="node worker" data-testid="worker-${esc(w.id)}" data-state="${esc(state[1])}">
    <h4>${esc(w.id)} <span class="badge ${state[0]}" data-testid="worker-state-${esc(w.id)}">${esc(state[1])}</span></h4>
    ${w.why ? `<div class="row bad">${esc(w.why)}</div>` : ""}
    <div class="row">${esc(w.device_class)} · ${esc((w.providers || []).join(", "))}</div>
    <div class="bar" title="utilisation"><span style="width:${Math.round(100 * util)}%"></span></div>
    <div class="row">util ${pct(w.utilisation)} · queue ${esc(w.queue_depth)} · running ${esc(w.in_flight)} / ${esc(w.capacity)} · reserved ${esc(w.reserved)}</div>
    <div class="row">memory ${num(w.memory_used_mb, 0)} / ${num(w.memory_total_mb, 0)} MiB · ${esc(fc)}</div>
    <div class="row">models: ${models}</div>
    ${w.held_by ? `<div class="row">held by ${esc(w.held_by)}</div>` : ""}
    ${actions}</div>`;
}

function edgeCard(e) {
  const state = !e.online ? ["bad", "offline"] : e.paused ? ["warn", "offload paused"] : ["ok", "online"];
  const models = Object.entries(e.models || {}).map(([m, ms]) => `${esc(m)} ${num(ms)} ms`).join(", ");
  return `<div class="node edge" data-testid="edge-${esc(e.id)}">
    <h4>${esc(e.id)} <span class="badge ${state[0]}" data-testid="edge-state-${esc(e.id)}">${esc(state[1])}</span></h4>
    <div class="row">queue ${esc(e.queue_depth)} / ${esc(e.queue_capacity)} · running ${esc(e.in_flight)} · CPU ${num(e.cpu_percent)} % · ${num(e.memory_rss_mb, 0)} MiB</div>
    <div class="row">ran here ${esc(e.finished.edge || 0)} · on pools ${esc(e.finished.pool || 0)} · policy v${esc(e.policy_version)}</div>
    <div class="row">models: ${models}</div>
    ${e.paused ? button("resume", e.id) : button("pause", e.id)}</div>`;
}

function renderZones(s) {
  $("zones").innerHTML = Object.entries(s.zones).map(([zone, z]) => `
    <div class="zone" data-testid="zone-${esc(zone)}"><h3>${esc(zone)}</h3>
      <div class="nodes">${z.workers.map(workerCard).join("")}${z.edges.map(edgeCard).join("")}</div></div>`).join("")
    || "<p>No node has reported yet.</p>";
}

function scatter(points, since, until) {
  const W = 520, H = 120, top = Math.max(10, ...points.map((p) => p.ms));
  const x = (t) => 4 + ((t - since) / Math.max(1, until - since)) * (W - 8);
  const y = (ms) => H - 4 - (ms / top) * (H - 8);
  const dots = points.map((p) => `<a href="#job=${encodeURIComponent(p.id)}" data-job="${esc(p.id)}">
    <circle cx="${x(p.t).toFixed(1)}" cy="${y(p.ms).toFixed(1)}" r="3"
      fill="${p.late ? "#b3261e" : p.offloaded ? "#3a7bd5" : "#1b7f3b"}"><title>${esc(p.id)}: ${num(p.ms)} ms on ${esc(p.on)}</title></circle></a>`).join("");
  return `<svg width="${W}" height="${H}" role="img" aria-label="job latency">${dots}
    <text x="4" y="12" font-size="10" fill="#666">${num(top, 0)} ms</text></svg>`;
}

function renderLines(s) {
  $("window").textContent = `(last ${s.window_s} s)`;
  const until = s.now, since = s.now - s.window_s;
  $("line-list").innerHTML = Object.entries(s.lines).map(([id, l]) => {
    const lat = l.latency_ms || {};
    const part = (k) => lat[k] ? `${num(lat[k].p50)} / ${num(lat[k].p99)}` : "–";
    const to = Object.entries(l.offloaded_to || {}).map(([w, n]) => `${esc(w)} ${esc(n)}`).join(", ") || "–";
    const why = (l.stayed_local || []).map((r) => `<li><b>${esc(r.jobs)}</b> ${esc(r.why)}${r.code ? ` <code>${esc(r.code)}</code>` : ""}</li>`).join("");
    return `<div class="line" data-testid="line-${esc(id)}"><h3>${esc(id)} <small>${esc(l.zone || "")}</small></h3>
      <table><tr><th>jobs/s</th><th>jobs</th><th>local</th><th>offloaded</th><th>to</th><th>attainment</th>
        <th>total p50/p99 ms</th><th>queue</th><th>inference</th><th>placement, transfer, delivery</th></tr>
      <tr><td class="num" data-testid="line-rate-${esc(id)}">${num(l.jobs_per_s, 2)}</td>
        <td class="num" data-testid="line-jobs-${esc(id)}">${esc(l.jobs || 0)}</td>
        <td class="num" data-testid="line-local-${esc(id)}">${esc(l.local || 0)}</td>
        <td class="num" data-testid="line-offloaded-${esc(id)}">${esc(l.offloaded || 0)}</td>
        <td data-testid="line-to-${esc(id)}">${to}</td><td class="num">${pct(l.attainment)}</td>
        <td class="num">${part("total")}</td><td class="num">${part("queue")}</td>
        <td class="num">${part("inference")}</td><td class="num">${part("other")}</td></tr></table>
      <p class="row" data-testid="line-statuses-${esc(id)}">answers: ${Object.entries(l.statuses || {}).map(([k, n]) => `${esc(k)} ${esc(n)}`).join(", ") || "–"}
        · points: <span style="color:#1b7f3b">●</span> on the line PC <span style="color:#3a7bd5">●</span> on a pool
        <span style="color:#b3261e">●</span> late; each links to its job</p>
      ${l.points && l.points.length ? scatter(l.points, since, until) : ""}
      ${why ? `<p>Why jobs stayed on the line PC:</p><ul data-testid="stayed-${esc(id)}">${why}</ul>` : ""}</div>`;
  }).join("") || "<p>No line has reported a job yet.</p>";
}

function renderPools(s) {
  $("pool-list").innerHTML = Object.entries(s.pools).map(([name, p]) => {
    const models = Object.entries(p.models || {}).map(([m, f]) => `<tr><td>${esc(m)}</td><td class="num">${esc(f.jobs)}</td>
      <td class="num">${num(f.service_ms.p50)} / ${num(f.service_ms.p99)}</td><td class="num">${num(f.queue_ms.p50)} / ${num(f.queue_ms.p99)}</td>
      <td class="num">${num(f.batch_size.p50, 0)} / ${num(f.batch_size.p99, 0)}</td>
      <td class="num">${esc(f.ok)}</td><td class="num">${esc(f.expired)}</td><td class="num">${esc(f.rejected)}</td>
      <td class="num" data-testid="pool-failed-${esc(name)}-${esc(m)}">${esc(f.failed)}</td></tr>`).join("");
    const by = Object.entries(p.by_worker || {}).map(([w, n]) => `${esc(w)} ${esc(n)}`).join(", ") || "–";
    const d = p.demand;
    return `<div class="line" data-testid="pool-${esc(name)}"><h3>${esc(name)}</h3>
      <p>${esc(p.online)} of ${esc(p.workers.length)} workers online · utilisation ${pct(p.utilisation)} · memory ${num(p.memory_used_mb, 0)} / ${num(p.memory_total_mb, 0)} MiB ·
      queue ${esc(p.queue_depth)} · running ${esc(p.in_flight)} · ${num(p.jobs_per_s, 2)} jobs/s
      ${d ? ` · demand ${num(d.ratio, 2)} of capacity, wants ${esc(d.desired_workers)} workers` : ""}</p>
      <p>jobs by worker: <span data-testid="pool-by-worker-${esc(name)}">${by}</span></p>
      ${models ? `<table><tr><th>model</th><th>jobs</th><th>service p50/p99 ms</th><th>queue p50/p99 ms</th><th>batch p50/p99</th><th title="answered by the model">ok</th><th title="refused unrun: its deadline had passed">expired</th><th title="refused unrun: bad image, token or policy">rejected</th><th title="the model or the worker failed it">failed</th></tr>${models}</table>` : ""}</div>`;
  }).join("") || "<p>No pool in the policy.</p>";
}

function renderCompliance(s) {
  const c = s.compliance, p = c.policy, m = c.classes, a = c.audit, dl = c.dead_letters;
  const days = p ? (p.expires_in_s / 86400).toFixed(1) : "–";
  const cell = (cls, zone) => {
    const found = m.cells.find((x) => x.class === cls && x.zone === zone);
    if (!found) return "<td></td>";
    const kind = found.forbidden ? "forbidden" : "";
    const link = found.example ? ` <a href="#job=${encodeURIComponent(found.example)}">e.g.</a>` : "";
    return `<td class="num ${kind}" data-testid="cell-${esc(cls)}-${esc(zone)}">${esc(found.jobs)}${found.forbidden ? ` (${esc(found.forbidden)} never expected)` : ""}${link}</td>`;
  };
  const matrix = m.classes.length ? `<table data-testid="class-matrix"><tr><th>data class \\ zone it ran in</th>${m.zones.map((z) => `<th>${esc(z)}</th>`).join("")}</tr>
    ${m.classes.map((cls) => `<tr><th>${esc(cls)}${m.rules && m.rules[cls] && m.rules[cls].campus_only ? " <small>(campus only)</small>" : ""}</th>${m.zones.map((z) => cell(cls, z)).join("")}</tr>`).join("")}</table>` : "<p>No job in the window yet.</p>";
  const audit = a ? `<p data-testid="audit">Audit chain: ${esc(a.records)} records, head <code>${esc(String(a.head || "").slice(0, 16))}</code>,
    last verified ${a.verified_at ? new Date(1000 * a.verified_at).toLocaleTimeString() : "never"}
    <span class="badge ${a.ok === false ? "bad" : "ok"}">${a.ok === false ? "FAILED: " + esc(a.error) : "ok"}</span></p>` : "<p>Audit verification: not reported.</p>";
  const dead = (dl.recent || []).map((d) => `<li data-testid="dead-${esc(d.job_id)}"><a href="#job=${encodeURIComponent(d.job_id)}">${esc(d.job_id)}</a>
    ${esc(d.reason)} ${button("release", d.job_id)}</li>`).join("");
  $("compliance-body").innerHTML = `
    <p data-testid="policy">${p ? `Policy <b>${esc(p.campus)} v${esc(p.version)}</b> <code>${esc(p.digest.slice(0, 16))}</code>,
      signed by ${esc(p.signer_threshold)} of ${esc(p.signers.join(", "))}, expires ${esc(new Date(1000 * p.expires).toISOString())} (${days} days)` : "<span class=bad>no verified policy</span>"}</p>
    ${matrix}${audit}
    <p data-testid="dead-letters">Dead letters: <b>${esc(dl.count)}</b></p>${dead ? `<ul>${dead}</ul>` : ""}`;
}

const OUTCOMES = [["same", "same"], ["moved", "moved"], ["candidate_refused", "candidate refused"],
  ["candidate_placed", "candidate placed"], ["refused_otherwise", "refused otherwise"]];

function renderShadow(s) {
  const sh = s.shadow;
  $("shadow").hidden = !sh;
  if (!sh) return;
  const forbidden = sh.forbidden.reduce((n, f) => n + f.jobs, 0);
  const where = sh.forbidden.map((f) => `<tr><td>${esc(f.data_class)}</td><td>${esc(f.zone)}</td>
    <td class="num warned" data-testid="shadow-forbidden-${esc(f.data_class)}-${esc(f.zone)}">${esc(f.jobs)}</td></tr>`).join("");
  const outcomes = OUTCOMES.map(([, label]) => `<th>${esc(label)}</th>`).join("");
  const counts = OUTCOMES.map(([k]) => `<td class="num" data-testid="shadow-outcome-${esc(k)}">${esc(sh.outcomes[k] || 0)}</td>`).join("");
  const moves = sh.moved.map((m) => `<li>${esc(m.production)} → ${esc(m.candidate)}: <b>${esc(m.jobs)}</b></li>`).join("");
  const more = sh.moved_pairs > sh.moved.length ? `<p class="hint">and ${esc(sh.moved_pairs - sh.moved.length)} more pairs</p>` : "";
  const refusals = Object.entries(sh.candidate_refusals).map(([code, n]) => `<code>${esc(code)}</code> ${esc(n)}`).join(", ") || "none";
  $("shadow-body").innerHTML = `
    <p data-testid="shadow-candidate">Candidate: <b>${esc(sh.candidate)}</b></p>
    <p>Decisions compared: <b data-testid="shadow-decisions">${esc(sh.decisions)}</b> ·
      agreement with production: <b data-testid="shadow-agreement">${pct(sh.agreement)}</b></p>
    <p data-testid="shadow-forbidden">Placements the policy in force forbids:
      <span class="badge ${forbidden ? "warn" : "ok"}" data-testid="shadow-forbidden-count">${esc(forbidden)}</span></p>
    ${where ? `<table data-testid="shadow-forbidden-where"><tr><th>data class</th><th>zone</th><th>jobs</th></tr>${where}</table>` : ""}
    <p>Decisions by how they compare with production's:</p>
    <table data-testid="shadow-outcomes"><tr>${outcomes}</tr><tr>${counts}</tr></table>
    <p>Largest moves (production worker → candidate worker: jobs):</p>
    ${moves ? `<ul data-testid="shadow-moves">${moves}</ul>${more}` : "<p data-testid=shadow-moves>none</p>"}
    <p data-testid="shadow-refusals">The candidate's refusals, by code: ${refusals}</p>`;
}

const counts = (o) => Object.entries(o || {}).map(([k, n]) => `${esc(k)} <b>${esc(n)}</b>`).join(", ") || "none";

function renderPeers(s) {
  const pe = s.peers || {peers: [], refused: {}};
  $("peers").hidden = !pe.peers.length;
  const rows = pe.peers.map((p) => {
    const offers = p.offers.map((o) => `${esc(o.model)} on ${esc(o.device_class)}: ${esc(o.free_slots)} free, queue ${num(o.queue_p50_ms)} ms, score ${esc(o.score)}`).join("<br>") || "none (stale or full)";
    const link = p.link ? `${num(1000 * p.link.rtt_s)} ms round trip` : "not measured";
    return `<tr data-testid="peer-${esc(p.peer)}"><th>${esc(p.peer)}</th>
      <td><span class="badge ${p.standing === "in_force" ? "ok" : "warn"}" data-testid="peer-standing-${esc(p.peer)}">${esc(p.standing)}</span>
        <small>${esc(p.reason)}</small></td>
      <td>${link}</td>
      <td data-testid="peer-free-${esc(p.peer)}" class="num">${esc(p.free_slots)}</td><td><small>${offers}</small></td>
      <td data-testid="peer-sent-${esc(p.peer)}">${counts(p.sent)}</td>
      <td data-testid="peer-received-${esc(p.peer)}">${counts(p.received)}</td></tr>`;
  }).join("");
  $("peer-list").innerHTML = `<table><tr><th>campus</th><th>agreement</th><th>link</th><th>free slots</th>
    <th>offers</th><th>jobs sent (by answer)</th><th>jobs taken (by answer)</th></tr>${rows}</table>
    <p data-testid="peer-refused">Their messages refused here: ${counts(pe.refused)}</p>`;
}

function render(s) {
  last = s;
  $("campus").textContent = s.compliance.policy ? `${s.compliance.policy.campus} · broker ${s.broker}` : `broker ${s.broker}`;
  renderZones(s); renderLines(s); renderPools(s); renderCompliance(s); renderShadow(s); renderPeers(s);
}

async function lookup(id) {
  $("job-id").value = id;
  const r = await fetch(`/console/api/jobs/${encodeURIComponent(id)}`);
  const j = await r.json();
  if (!r.ok) { $("job-body").innerHTML = `<p class="bad" data-testid="job-error">${esc(j.error)}</p>`; return; }
  const pl = j.placement || {}, why = pl.why || {}, cands = why.candidates || {};
  const ranked = (cands.ranked || []).map((c, i) => `<tr><td>${i + 1}</td><td>${esc(c.worker_id)}</td><td>${esc(c.zone)}</td><td>${esc(c.device_class)}</td>
    <td class="num">${num(c.transfer_ms)}</td><td class="num">${num(c.queue_ms)}</td><td class="num">${num(c.service_ms)}</td>
    <td class="num">${num(c.penalty_ms)}</td><td class="num">${num(c.predicted_ms)}</td><td class="num">${num(c.score_ms)}</td></tr>`).join("");
  const filtered = Object.entries(cands.filtered || {}).map(([r, n]) => `${esc(n)} ${esc(r)}`).join(", ");
  const dead = (pl.inflight || {}).dead_letter;
  const retry = dead && dead.retry ? `<p>Released by ${esc(dead.retry.by)} for one retry: <a href="#job=${encodeURIComponent(dead.retry.job_id)}">${esc(dead.retry.job_id)}</a></p>`
    : dead ? `<p class="bad">Dead letter: ${esc(dead.reason)} ${button("release", j.job_id)}</p>` : "";
  const audit = (j.audit || []).map((a) => `<li>#${esc(a.seq)} ${esc(a.kind)} at ${esc(new Date(a.t).toISOString())}</li>`).join("");
  $("job-body").innerHTML = `<h3 data-testid="job-title">${esc(j.job_id)}</h3>
    <ol data-testid="job-path">${(j.path || []).map((p) => `<li>${esc(p)}</li>`).join("")}</ol>
    ${retry}
    ${pl.status ? `<p data-testid="job-decision">Decision: <b>${esc(pl.status)}</b>${pl.worker ? ` on ${esc(pl.worker)}` : ""}${pl.reason ? ` — ${esc(pl.reason)}` : ""}</p>` : "<p>The broker was never asked to place it: it ran on its line PC.</p>"}
    ${ranked ? `<table data-testid="job-candidates"><tr><th>#</th><th>worker</th><th>zone</th><th>device</th><th>transfer</th><th>queue</th><th>service</th><th>penalty</th><th>predicted ms</th><th>score</th></tr>${ranked}</table>` : ""}
    ${filtered ? `<p data-testid="job-filtered">Filtered out: ${filtered}; eligible ${esc(cands.eligible)}</p>` : ""}
    ${audit ? `<p>Audit records:</p><ul data-testid="job-audit">${audit}</ul>` : ""}`;
}

function fromHash() {
  const m = location.hash.match(/^#job=(.+)$/);
  if (m) { lookup(decodeURIComponent(m[1])); $("job").scrollIntoView(); }
}

function connect() {
  const es = new EventSource("/console/api/events");
  es.addEventListener("snapshot", (ev) => {
    $("live").textContent = "live"; $("live").className = "badge ok";
    render(JSON.parse(ev.data));
  });
  es.onerror = () => { $("live").textContent = "reconnecting"; $("live").className = "badge bad"; };
}

document.addEventListener("click", (ev) => {
  const b = ev.target.closest("button.act");
  if (b) act(b.dataset.action, b.dataset.target);
});
$("job-form").addEventListener("submit", (ev) => {
  ev.preventDefault();
  location.hash = "job=" + encodeURIComponent($("job-id").value.trim());
});
window.addEventListener("hashchange", fromHash);

whoami().then(async () => {
  const r = await fetch("/console/api/snapshot");
  if (r.ok) render(await r.json());
  connect();
  fromHash();
});
