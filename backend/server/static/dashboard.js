// kvbaton dashboard: draws the engine's events (GET /v1/kv/events) and stats (GET /v1/kv/stats) as
// SVG. Plain JS, no library, nothing loaded from elsewhere. Live: polls its own server with the token
// from the form or the URL fragment (#token=...), kept in memory only and never logged. Offline: the
// events are embedded in the page (kvbaton dashboard --events FILE).
"use strict";
(function () {
  const POLL_MS = 1000;
  const KEEP = 5000;  // events the page keeps (the oldest go first): a long run stays drawable
  const COLORS = { queued: "#c9ced8", exact: "#2e9e5b", approx: "#7bc8a4", prefilled: "#f08c3a",
                   decode: "#4c8bf5", evict: "#d64545", prefetch: "#9a5cd6" };
  const state = { events: [], next: 0, stats: null, token: null, live: true, dropped: 0 };

  const $ = (id) => document.getElementById(id);
  const esc = (s) => String(s).replace(/[&<>"']/g, (c) => ({ "&": "&amp;", "<": "&lt;", ">": "&gt;", '"': "&quot;", "'": "&#39;" }[c]));
  const fmt = (x, d = 2) => (x === null || x === undefined || !isFinite(x) ? "–" : Number(x).toFixed(d));
  const int = (n) => (n === null || n === undefined || !isFinite(n) ? "–" : Math.round(n).toLocaleString("en-US"));
  const pct = (x) => (x === null || x === undefined || !isFinite(x) ? "–" : `${(100 * x).toFixed(0)} %`);
  const mib = (b) => fmt(b / 1048576, 1) + " MiB";
  // {"device": 159, "host": 106} -> "device 159, host 106": counts by where they were, as words
  const byPlace = (m) => Object.entries(m || {}).filter(([, n]) => n).map(([k, n]) => `${k} ${int(n)}`).join(", ") || "none";
  const steOf = (v) => (v === null || v === undefined ? "no hint" : v === 0 ? "running" : "STE " + fmt(v, 0));
  // An eviction's steps_to_execution names the agents whose registered prompt the blocks belonged to;
  // empty when none did (a transcript, an answer: blocks no agent owns, which the STE policy evicts first).
  const evictedOwners = (ste) => {
    const owners = Object.entries(ste || {});
    return owners.length ? "owners " + owners.map(([a, v]) => `${a} (${steOf(v)})`).join(", ")
      : "no agent's registered prompt among them (unowned blocks go first)";
  };
  const laneOf = (e) => (e.kind === "request" ? (e.agent || "(no agent)") : "cache");
  const requests = () => state.events.filter((e) => e.kind === "request");

  function svg(width, height, body) {
    return `<svg viewBox="0 0 ${width} ${height}" width="${width}" height="${height}">${body}</svg>`;
  }

  function niceStep(span, target) {
    const raw = span / Math.max(1, target);
    const mag = Math.pow(10, Math.floor(Math.log10(raw || 1)));
    for (const m of [1, 2, 5, 10]) if (raw <= m * mag) return m * mag;
    return 10 * mag;
  }

  // -- timeline: one lane per agent, bars per request phase -------------------------------------------
  function renderTimeline() {
    const evs = state.events;
    if (!evs.length) { $("timeline").innerHTML = '<div class="empty">no events yet</div>'; return; }
    const lanes = [];
    for (const e of evs) { const l = laneOf(e); if (!lanes.includes(l)) lanes.push(l); }
    if (lanes.includes("cache")) { lanes.splice(lanes.indexOf("cache"), 1); lanes.push("cache"); }
    const start = (e) => (e.t_queued !== null && e.t_queued !== undefined ? e.t_queued : e.time);
    const t0 = Math.min(...evs.map(start));
    const t1 = Math.max(...evs.map((e) => e.t_done || e.time), t0 + 0.001);
    const width = Math.max(600, $("timeline").clientWidth || 1000), left = 120, right = 12, laneH = 28, top = 6;
    const height = top + lanes.length * laneH + 24;
    const x = (t) => left + ((t - t0) / (t1 - t0)) * (width - left - right);
    let body = "";
    lanes.forEach((lane, i) => {
      const y = top + i * laneH;
      body += `<rect x="0" y="${y}" width="${width}" height="${laneH}" fill="${i % 2 ? "#fafbfc" : "#fff"}"/>`;
      body += `<text x="6" y="${y + laneH / 2 + 4}" data-lane="${esc(lane)}">${esc(lane)}</text>`;
    });
    const step = niceStep(t1 - t0, 8);
    for (let s = 0; s <= t1 - t0 + 1e-9; s += step) {
      const xx = x(t0 + s);
      body += `<line x1="${xx}" x2="${xx}" y1="${top}" y2="${height - 20}" stroke="#eceef2"/>`;
      body += `<text class="axis" x="${xx}" y="${height - 6}" text-anchor="middle">${fmt(s, step < 1 ? 1 : 0)} s</text>`;
    }
    const drawn = new Set();  // the legend shows only the kinds of bar drawn
    for (const e of evs) {
      const y = top + lanes.indexOf(laneOf(e)) * laneH + 4, h = laneH - 8;
      if (e.kind !== "request") {
        const color = e.kind === "evict" ? COLORS.evict : COLORS.prefetch;
        const tip = e.kind === "evict"
          ? `evicted ${int(e.blocks)} blocks to ${e.tier} (policy ${e.policy}); ${evictedOwners(e.steps_to_execution)}`
          : `prefetched ${int(e.blocks)} blocks of ${e.agent} from ${e.tier}`;
        body += `<rect class="${e.kind}" x="${x(e.time) - 1.5}" y="${y}" width="3" height="${h}" fill="${color}"><title>${esc(tip)}</title></rect>`;
        drawn.add(e.kind);
        continue;
      }
      const tq = e.t_queued, ta = e.t_admitted || tq, tf = e.t_first_token || e.t_done, td = e.t_done;
      const tip = `${e.agent || "(no agent)"} ${e.op} ${e.finish}\nqueued→admitted ${fmt(ta - tq, 3)} s, prefill ${fmt(tf - ta, 3)} s, ` +
        `decode ${fmt(td - tf, 3)} s\nprompt tokens reused ${int(e.tokens_reused)} (approximately ${int(e.tokens_approximate)}), ` +
        `prefilled ${int(e.tokens_prefilled)}; generated ${int(e.tokens_generated)}\ncached blocks attached: ` +
        `${byPlace(e.blocks_loaded)}; brought back by prefetch ${int(e.prefetch_hits)}` +
        (e.tokens_recomputed ? `\nfound in other agents' K/V but computed: ${int(e.tokens_recomputed)}` : "") +
        (e.reasons && e.reasons.length ? `\n${e.reasons.map((r) => `- ${r}`).join("\n")}` : "") +
        (e.ste_predicted !== null && e.ste_predicted !== undefined ? `\nbefore it ran: ${steOf(e.ste_predicted)}` : "");
      let g = `<g class="request" data-agent="${esc(laneOf(e))}"><title>${esc(tip)}</title>`;
      if (ta > tq) g += `<rect x="${x(tq)}" y="${y + h / 2 - 2}" width="${Math.max(1, x(ta) - x(tq))}" height="4" fill="${COLORS.queued}"/>`;
      if (x(ta) - x(tq) >= 2) drawn.add("queued");  // a wait of less than 2 pixels is not visible: not in the legend
      const prompt = e.tokens_reused + e.tokens_prefilled;
      const parts = [[e.tokens_reused - e.tokens_approximate, "exact"], [e.tokens_approximate, "approx"],
                     [e.tokens_prefilled, "prefilled"]];
      let yy = y;
      for (const [n, kind] of parts) {  // the prefill bar's height split by where its prompt came from
        if (!prompt || n <= 0) continue;
        const hh = (h * n) / prompt;
        g += `<rect x="${x(ta)}" y="${yy}" width="${Math.max(1.5, x(tf) - x(ta))}" height="${hh}" fill="${COLORS[kind]}"/>`;
        yy += hh;
        drawn.add(kind);
      }
      if (e.t_first_token) { g += `<rect x="${x(tf)}" y="${y + 3}" width="${Math.max(1, x(td) - x(tf))}" height="${h - 6}" fill="${COLORS.decode}"/>`; drawn.add("decode"); }
      if (e.finish === "error" || e.finish === "abandoned") g += `<rect x="${x(tq)}" y="${y}" width="${Math.max(2, x(td) - x(tq))}" height="${h}" fill="none" stroke="#b3261e"/>`;
      body += g + "</g>";
    }
    $("timeline").innerHTML = svg(width, height, body);
    for (const item of document.querySelectorAll("#timeline-legend [data-kind]")) item.hidden = !drawn.has(item.dataset.kind);
  }

  // -- the agent step graph: agents by steps-to-execution, edges as observed hand-offs -----------------
  function renderGraph() {
    const ste = (state.stats && state.stats.cache && state.stats.cache.steps_to_execution) || {};
    const reqs = requests().slice().sort((a, b) => a.t_queued - b.t_queued);
    const agents = [];
    for (const a of [...Object.keys(ste), ...reqs.map((e) => e.agent).filter(Boolean)]) if (!agents.includes(a)) agents.push(a);
    if (!agents.length) { $("graph").innerHTML = '<div class="empty">no agents yet</div>'; return; }
    const edges = new Map();
    for (let i = 1; i < reqs.length; i++) {
      const a = reqs[i - 1].agent, b = reqs[i].agent;
      if (a && b && a !== b) edges.set(`${a}\u0000${b}`, (edges.get(`${a}\u0000${b}`) || 0) + 1);
    }
    const col = (a) => (a in ste ? Math.round(ste[a]) : Infinity);
    const cols = [...new Set(agents.map(col))].sort((p, q) => p - q);
    const nodeW = 112, nodeH = 34, gapX = 40, gapY = 14, pad = 8;
    const pos = {}, perCol = {};
    for (const a of agents) {
      const c = cols.indexOf(col(a)); perCol[c] = (perCol[c] || 0) + 1;
      pos[a] = { x: pad + c * (nodeW + gapX), y: 18 + (perCol[c] - 1) * (nodeH + gapY) };
    }
    const width = pad * 2 + cols.length * (nodeW + gapX), height = 18 + Math.max(...Object.values(perCol)) * (nodeH + gapY) + 4;
    let body = `<defs><marker id="arrow" viewBox="0 0 8 8" refX="7" refY="4" markerWidth="7" markerHeight="7" orient="auto"><path d="M0,0 L8,4 L0,8 z" fill="#8a90a0"/></marker></defs>`;
    cols.forEach((c, i) => {
      body += `<text class="axis" x="${pad + i * (nodeW + gapX) + nodeW / 2}" y="11" text-anchor="middle">${c === Infinity ? "not due" : "STE " + c}</text>`;
    });
    for (const [key, n] of edges) {
      const [a, b] = key.split("\u0000"), p = pos[a], q = pos[b];
      const x1 = p.x + nodeW / 2, y1 = p.y + nodeH / 2, x2 = q.x + nodeW / 2, y2 = q.y + nodeH / 2;
      const bend = x1 === x2 ? 40 : (x2 < x1 ? -30 : 0);
      body += `<path d="M${x1},${y1} Q${(x1 + x2) / 2 + bend},${(y1 + y2) / 2 + bend} ${x2},${y2}" fill="none" stroke="#b5bac6" stroke-width="${Math.min(4, 1 + Math.log2(n))}" marker-end="url(#arrow)"><title>${esc(a)} → ${esc(b)}: ${n}×</title></path>`;
    }
    for (const a of agents) {
      const s = ste[a], p = pos[a];
      const fill = s === 0 ? "#d7f2e1" : s !== undefined && s <= 1 ? "#fff3cf" : "#eef0f4";
      body += `<g class="node" data-agent="${esc(a)}"><rect x="${p.x}" y="${p.y}" width="${nodeW}" height="${nodeH}" rx="6" fill="${fill}" stroke="#b5bac6"/>` +
        `<text x="${p.x + 8}" y="${p.y + 14}">${esc(a.length > 16 ? a.slice(0, 15) + "…" : a)}</text>` +
        `<text class="axis" x="${p.x + 8}" y="${p.y + 28}">${s === undefined ? "no hint" : s === 0 ? "running" : "STE " + fmt(s, 0)}</text></g>`;
    }
    const hinted = reqs.filter((e) => e.ste_predicted !== null && e.ste_predicted !== undefined);
    const next = hinted.filter((e) => e.ste_predicted <= 1).length;
    $("graph").innerHTML = svg(width, height, body) + `<div class="legend" id="predicted"><span>the step graph ` +
      `predicted the agent as next (STE 1) before ${next} of ${hinted.length} hinted requests</span></div>`;
  }

  // -- cache occupancy per tier ----------------------------------------------------------------------
  function renderCache() {
    const s = state.stats;
    if (!s) { $("cache").innerHTML = `<div class="empty">${state.live ? "no stats yet" : "no stats saved with these events"}</div>`; return; }
    const total = Math.max(1, s.blocks_total), cacheOnly = s.blocks_cache_only || 0;
    const parts = [["held by handles", s.blocks_used - cacheOnly, "#4c8bf5"], ["cache only", cacheOnly, "#2e9e5b"],
                   ["free", s.blocks_free, "#e3e6ec"]];
    const width = 360;
    let x = 0, body = "";
    for (const [label, n, color] of parts) {
      const w = (width * Math.max(0, n)) / total;
      body += `<rect x="${x}" y="0" width="${w}" height="18" fill="${color}"><title>${label}: ${int(n)} blocks</title></rect>`;
      x += w;
    }
    // Every row: used / capacity, in blocks and in bytes (a server too old to report a tier's capacity: "–").
    const row = (tier, used, capacity) => `<tr data-tier="${esc(tier)}"><td>${esc(tier)}</td><td>${int(used)} / ${int(capacity)}</td>` +
      `<td>${mib(used * s.bytes_per_block)} / ${capacity === undefined ? "–" : mib(capacity * s.bytes_per_block)}</td>` +
      `<td>${capacity ? pct(used / capacity) : "–"}</td></tr>`;
    let rows = "<tr><th>tier</th><th>blocks used / capacity</th><th>bytes used / capacity</th><th>full</th></tr>" +
      row("device", s.blocks_used, s.blocks_total);
    const c = s.cache;
    if (c) for (const [tier, n] of Object.entries(c.nodes_per_tier || {})) rows += row(tier, n, (c.tier_capacity_blocks || {})[tier]);
    const extra = c ? `<div class="legend"><span>policy ${esc(c.policy)}</span><span>cache hits (blocks): ${esc(byPlace(c.hits_blocks))}</span>` +
      `<span>prefetch hit rate ${pct(c.prefetch_hit_rate)}</span><span>handles live ${int(s.handles_live)}</span></div>` : "";
    $("cache").innerHTML = svg(width, 18, body) +
      parts.map(([l, n, col]) => `<span class="legend" style="display:inline-flex;margin-right:10px"><span><i style="background:${col}"></i>${l} ${int(n)}</span></span>`).join("") +
      `<table>${rows}</table>` + extra;
  }

  // -- reuse and hit ratios over time ----------------------------------------------------------------
  function renderRatios() {
    const reqs = requests().filter((e) => e.t_done).sort((a, b) => a.t_done - b.t_done);
    if (!reqs.length) { $("ratios").innerHTML = '<div class="empty">no requests yet</div>'; return; }
    const t0 = Math.min(...reqs.map((e) => e.t_queued)), t1 = Math.max(reqs[reqs.length - 1].t_done, t0 + 0.001);
    const width = Math.max(360, ($("ratios").clientWidth || 360) - 4), height = 150, left = 40, bottom = 18;
    const x = (t) => left + ((t - t0) / (t1 - t0)) * (width - left - 6), y = (r) => 6 + (1 - r) * (height - bottom - 6);
    let reused = 0, prompt = 0, hits = 0, blocks = 0, lineA = "", lineB = "";
    for (const e of reqs) {
      reused += e.tokens_reused; prompt += e.tokens_reused + e.tokens_prefilled;
      hits += e.prefetch_hits; blocks += Object.values(e.blocks_loaded || {}).reduce((p, q) => p + q, 0);
      lineA += `${lineA ? "L" : "M"}${x(e.t_done)},${y(prompt ? reused / prompt : 0)} `;
      lineB += `${lineB ? "L" : "M"}${x(e.t_done)},${y(blocks ? hits / blocks : 0)} `;
    }
    let body = "";
    for (const r of [0, 0.25, 0.5, 0.75, 1]) body += `<line x1="${left}" x2="${width}" y1="${y(r)}" y2="${y(r)}" stroke="#eceef2"/><text class="axis" x="${left - 4}" y="${y(r) + 4}" text-anchor="end">${pct(r)}</text>`;
    const step = niceStep(t1 - t0, 6);  // seconds since the first request, as on the timeline
    for (let s = 0; s <= t1 - t0 + 1e-9; s += step) {
      body += `<line x1="${x(t0 + s)}" x2="${x(t0 + s)}" y1="6" y2="${height - bottom}" stroke="#f3f4f7"/>` +
        `<text class="axis tick" x="${x(t0 + s)}" y="${height - 4}" text-anchor="middle">${fmt(s, step < 1 ? 1 : 0)} s</text>`;
    }
    body += `<path d="${lineB}" fill="none" stroke="${COLORS.prefetch}" stroke-width="2"/><path d="${lineA}" fill="none" stroke="${COLORS.exact}" stroke-width="2"/>`;
    $("ratios").innerHTML = svg(width, height, body) +
      `<div class="legend"><span>prompt tokens reused ${pct(prompt ? reused / prompt : 0)}</span><span>cache blocks from prefetch ${pct(blocks ? hits / blocks : 0)}</span></div>`;
  }

  // -- per-agent table -------------------------------------------------------------------------------
  function renderAgents() {
    const by = new Map();
    for (const e of requests()) {
      const a = e.agent || "(no agent)";
      if (!by.has(a)) by.set(a, { n: 0, ttft: 0, nt: 0, reused: 0, prefilled: 0, generated: 0, next: 0, hinted: 0 });
      const r = by.get(a);
      r.n += 1; r.reused += e.tokens_reused; r.prefilled += e.tokens_prefilled; r.generated += e.tokens_generated;
      if (e.t_first_token) { r.ttft += e.t_first_token - e.t_queued; r.nt += 1; }
      if (e.ste_predicted !== null && e.ste_predicted !== undefined) { r.hinted += 1; if (e.ste_predicted <= 1) r.next += 1; }
    }
    if (!by.size) { $("agents").innerHTML = '<div class="empty">no requests yet</div>'; return; }
    let rows = "<tr><th>agent</th><th>calls</th><th>TTFT s</th><th>reused</th><th>prefilled</th><th>gen.</th>" +
      '<th>reuse</th><th title="requests the step graph predicted as next (STE 1) / hinted requests">next</th></tr>';
    for (const [a, r] of by) {
      rows += `<tr data-agent="${esc(a)}"><td>${esc(a)}</td><td>${int(r.n)}</td><td>${fmt(r.nt ? r.ttft / r.nt : NaN, 3)}</td><td>${int(r.reused)}</td>` +
        `<td>${int(r.prefilled)}</td><td>${int(r.generated)}</td><td>${pct(r.reused / Math.max(1, r.reused + r.prefilled))}</td>` +
        `<td>${r.hinted ? `${r.next}/${r.hinted}` : "–"}</td></tr>`;
    }
    $("agents").innerHTML = `<table>${rows}</table>`;
  }

  function render() {
    renderTimeline(); renderGraph(); renderCache(); renderRatios(); renderAgents();
  }

  // -- data --------------------------------------------------------------------------------------------
  async function getJSON(path) {
    const headers = { Accept: "application/json" };
    if (state.token) headers.Authorization = "Bearer " + state.token;
    const r = await fetch(path, { headers });
    if (r.status === 401) { const e = new Error("unauthorized"); e.status = 401; throw e; }
    if (!r.ok) throw new Error(`${path}: HTTP ${r.status}`);
    return r.json();
  }

  async function poll() {
    try {
      const page = await getJSON(`/v1/kv/events?since=${state.next}`);
      state.events.push(...page.events);
      if (state.events.length > KEEP) state.events.splice(0, state.events.length - KEEP);
      state.next = page.next;
      state.dropped += page.dropped;
      state.stats = await getJSON("/v1/kv/stats");
      $("auth").hidden = true;
      $("status").textContent = `live · ${state.events.length} events` + (state.dropped ? ` · ${state.dropped} dropped` : "") +
        ` · ${new Date().toLocaleTimeString()}`;
      render();
    } catch (err) {
      if (err.status === 401) {
        $("auth").hidden = false;
        $("status").innerHTML = '<span class="error">this server needs its token</span>';
        return;  // wait for the form
      }
      $("status").innerHTML = `<span class="error">${esc(err.message)}</span>`;
    }
    setTimeout(poll, POLL_MS);
  }

  function start() {
    const embedded = document.getElementById("kvbaton-data");
    if (embedded) {
      const data = JSON.parse(embedded.textContent);
      state.live = false;
      state.events = data.events;
      state.stats = data.stats;
      $("title").textContent = data.title || "";
      $("status").textContent = `offline · ${state.events.length} events`;
      render();
      return;
    }
    const fragment = new URLSearchParams(location.hash.slice(1));
    if (fragment.get("token")) state.token = fragment.get("token");
    $("auth").addEventListener("submit", (ev) => {
      ev.preventDefault();
      state.token = $("token").value;
      $("token").value = "";
      poll();
    });
    poll();
  }

  if (document.readyState === "loading") document.addEventListener("DOMContentLoaded", start); else start();
})();
