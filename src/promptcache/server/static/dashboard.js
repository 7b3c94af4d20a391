// promptcache dashboard: polls /v1/dashboard/data and fills the page. No library.
"use strict";
(function () {
  const params = new URLSearchParams(location.search);
  const interval = Math.max(100, parseInt(params.get("interval") || "1000", 10) || 1000);
  const fromHash = new URLSearchParams(location.hash.replace(/^#/, "")).get("key");
  if (fromHash) {
    sessionStorage.setItem("promptcache-key", fromHash);
    history.replaceState(null, "", location.pathname + location.search);
  }
  let updates = 0;
  const $ = (id) => document.getElementById(id);

  function pct(x) { return x === null || x === undefined ? "-" : (x * 100).toFixed(1) + "%"; }
  function int(n) { return n === null || n === undefined ? "-" : Number(n).toLocaleString("en-US"); }
  function bytes(n) { return n === null || n === undefined ? "-" : int(n) + " B"; }
  function human(n) {
    if (n === null || n === undefined) return "";
    const u = ["B", "KiB", "MiB", "GiB", "TiB"]; let i = 0; let v = n;
    while (v >= 1024 && i < u.length - 1) { v /= 1024; i++; }
    return v.toFixed(i ? 1 : 0) + " " + u[i];
  }
  function secs(x) { return x === null || x === undefined ? "-" : (x < 1 ? (x * 1000).toFixed(1) + " ms" : x.toFixed(2) + " s"); }
  function set(id, text, value) {
    const el = $(id); if (!el) return;
    el.textContent = text;
    el.dataset.value = value === null || value === undefined ? "" : String(value);
  }
  function cell(tr, text, cls, title) {
    const td = document.createElement("td"); td.textContent = text;
    if (cls) td.className = cls; if (title) td.title = title; tr.appendChild(td); return td;
  }
  function fill(tableId, rows) {
    const body = $(tableId).querySelector("tbody"); body.replaceChildren();
    for (const r of rows) { const tr = document.createElement("tr"); r(tr); body.appendChild(tr); }
  }

  function tierRows(stats) {
    const c = stats.cache || {}; const rows = [];
    const byTier = c.hit_tokens_by_tier || {};
    rows.push({ name: "ram", bytes: c.ram_bytes, blocks: c.ram_blocks, budget: c.ram_budget_bytes,
                hit: byTier.ram || 0, health: "ok" });
    const tiers = c.tiers || {};
    for (const name of Object.keys(tiers).sort()) {
      const t = tiers[name];
      let health = "ok";
      if (t.error) health = "error: " + t.error;
      else if (t.degraded) health = "degraded: " + (t.degraded_reason || "");
      else if (t.healthy === false) health = "unhealthy (" + (t.state || "") + ")";
      rows.push({ name, bytes: t.bytes_on_disk, blocks: t.blocks_on_disk, budget: t.budget_bytes,
                  hit: byTier[name] || 0, health });
    }
    return rows;
  }

  function chart(series) {
    const svg = $("chart"); svg.replaceChildren();
    const ns = "http://www.w3.org/2000/svg"; const H = 160, n = series.length;
    const W = Math.max(200, Math.round(svg.getBoundingClientRect().width) || 600);
    svg.setAttribute("viewBox", `0 0 ${W} ${H}`);
    const x = (i) => (n <= 1 ? W / 2 : 10 + (i * (W - 20)) / (n - 1));
    const y = (v) => H - 10 - v * (H - 20);
    const grid = document.createElementNS(ns, "path");
    grid.setAttribute("d", `M0 ${y(0)} H${W} M0 ${y(0.5)} H${W} M0 ${y(1)} H${W}`);
    grid.setAttribute("stroke", "#e3e6ea"); svg.appendChild(grid);
    let d = "";
    series.forEach((p, i) => {
      const dot = document.createElementNS(ns, "circle");
      dot.setAttribute("cx", x(i)); dot.setAttribute("cy", y(p.hit_rate)); dot.setAttribute("r", 2.5);
      dot.setAttribute("fill", "#5c6bc0"); svg.appendChild(dot);
      if (p.rolling !== null && p.rolling !== undefined) d += (d ? " L" : "M") + x(i) + " " + y(p.rolling);
    });
    if (d) {
      const line = document.createElementNS(ns, "path");
      line.setAttribute("d", d); line.setAttribute("fill", "none");
      line.setAttribute("stroke", "#ef6c00"); line.setAttribute("stroke-width", 2); svg.appendChild(line);
    }
  }

  function render(data) {
    const stats = data.stats || {}; const c = stats.cache; const req = data.requests || {};
    $("model").textContent = (data.server || {}).model || "";
    if (c) {
      set("hit-rate", pct(c.token_hit_rate), c.token_hit_rate);
      set("hit-tokens", int(c.hit_tokens), c.hit_tokens);
      set("prompt-tokens", int(c.hit_tokens + c.miss_tokens), c.hit_tokens + c.miss_tokens);
      set("lookups", int(c.lookups), c.lookups);
    } else {
      set("hit-rate", "cache off", null);
    }
    const rolling = stats.rolling || {};
    set("rolling-rate", pct(rolling.hit_rate), rolling.hit_rate);
    $("rolling-n").textContent = rolling.requests_in_window === undefined ? "-" : rolling.requests_in_window;
    $("threshold").textContent = pct(rolling.threshold);
    const alert = !!(stats.alert && stats.alert.active);
    const badge = $("alert"); badge.className = "badge " + (alert ? "alert" : "ok");
    const seen = rolling.requests_in_window || 0; const need = (stats.alert && stats.alert.min_requests) || 0;
    badge.textContent = alert ? "hit rate alert"
      : seen < need ? "hit rate: too few requests yet (" + seen + " of " + need + ")" : "hit rate ok";
    if (!alert && seen < need) badge.className = "badge wait";
    badge.dataset.value = String(alert);
    set("tokens-saved", int(req.tokens_saved), req.tokens_saved);
    set("seconds-saved", req.seconds_saved_estimate === null ? "-" : secs(req.seconds_saved_estimate),
        req.seconds_saved_estimate);
    set("ttft-cached", secs(req.ttft_cached_s), req.ttft_cached_s);
    set("ttft-uncached", secs(req.ttft_uncached_s), req.ttft_uncached_s);
    $("ttft-cached-n").textContent = "(" + (req.ttft_cached_requests || 0) + " requests)";
    $("ttft-uncached-n").textContent = "(" + (req.ttft_uncached_requests || 0) + " requests)";
    const eng = data.engine || {};
    set("active", int(eng.active), eng.active);
    set("queued", eng.queued === null ? "n/a" : int(eng.queued), eng.queued);
    set("requests", int(req.requests), req.requests);
    // MLX arrays held (Metal caps a process's buffers whatever their bytes) and the
    // memory governor's footprint: the engine's stats (absent: an engine without them)
    const es = stats.engine || {};
    const arrays = es.ram_arrays === undefined ? undefined : es.ram_arrays + (es.live_arrays || 0);
    set("arrays", int(arrays), arrays);
    set("ram-arrays", int(es.ram_arrays), es.ram_arrays);
    set("live-arrays", int(es.live_arrays), es.live_arrays);
    set("max-arrays", es.max_arrays === null ? "no cap" : int(es.max_arrays), es.max_arrays);
    const limited = es.memory_limit_bytes !== undefined;
    set("footprint", limited ? human(es.memory_footprint_bytes) : "-", es.memory_footprint_bytes);
    set("memory-limit", limited ? human(es.memory_limit_bytes) : "no limit", es.memory_limit_bytes);
    set("memory-level", limited ? es.memory_level : "-", es.memory_level);
    const spec = data.speculation || {};
    set("spec-acceptance", pct(spec.acceptance_rate), spec.acceptance_rate);
    set("spec-tokens-per-forward", spec.tokens_per_forward === null || spec.tokens_per_forward === undefined ? "-" : spec.tokens_per_forward.toFixed(2), spec.tokens_per_forward);
    set("spec-pool-tokens", int(spec.pool_tokens), spec.pool_tokens);
    chart(req.series || []);
    fill("tiers", tierRows(stats).map((t) => (tr) => {
      tr.id = "tier-" + t.name;
      cell(tr, t.name);
      const bc = cell(tr, t.bytes === undefined || t.bytes === null ? "-" : human(t.bytes), "num bytes", bytes(t.bytes)); bc.dataset.value = t.bytes === undefined ? "" : String(t.bytes);
      const kc = cell(tr, int(t.blocks), "num blocks"); kc.dataset.value = t.blocks === undefined ? "" : String(t.blocks);
      cell(tr, t.budget === undefined ? "-" : human(t.budget), "num");
      cell(tr, int(t.hit), "num");
      cell(tr, t.health, "health");
    }));
    const causes = Object.entries((c && c.misses_by_cause) || {}).sort((a, b) => b[1] - a[1]);
    fill("causes", causes.map(([k, v]) => (tr) => { cell(tr, k); cell(tr, int(v), "num"); }));
    const diag = data.diagnosis;
    const shadow = stats.shadow;
    let text = diag && diag.summary ? diag.summary : "";
    if (shadow && shadow.mismatches) {
      text = "shadow verification: " + shadow.mismatches + " mismatch(es) of " + shadow.checked +
        " checks, " + shadow.quarantined_blocks + " blocks quarantined. " + text;
    }
    $("diagnosis").textContent = text;
    const who = (rows) => (rows || []).map((r) => (tr) => {
      cell(tr, r.id); cell(tr, int(r.requests), "num"); cell(tr, int(r.prompt_tokens), "num"); cell(tr, pct(r.hit_rate), "num");
    });
    fill("sessions", who(req.busiest_sessions));
    fill("tenants", who(req.busiest_tenants));
    updates += 1;
    set("updates", String(updates), updates);
    $("updated-at").textContent = new Date().toLocaleTimeString();
  }

  async function poll() {
    const key = sessionStorage.getItem("promptcache-key");
    const headers = key ? { Authorization: "Bearer " + key } : {};
    try {
      const r = await fetch("/v1/dashboard/data", { headers, cache: "no-store" });
      if (r.status === 401) {
        $("keyform").hidden = false; $("status").textContent = "API key needed";
        $("keyerror").textContent = key ? "the key was refused" : "";
      } else if (!r.ok) {
        $("status").textContent = "error " + r.status;
      } else {
        $("keyform").hidden = true; $("status").textContent = "live";
        render(await r.json());
      }
    } catch (e) {
      $("status").textContent = "server unreachable";
    }
    setTimeout(poll, interval);
  }

  $("keyform").addEventListener("submit", (ev) => {
    ev.preventDefault();
    sessionStorage.setItem("promptcache-key", $("keyinput").value);
    $("keyinput").value = "";
  });
  poll();
})();
