// The Ren-Queue console: plain JavaScript, no build step, nothing fetched from elsewhere.
//
// Data comes two ways: one snapshot (/console/api/status), fetched at most once every
// REFRESH_MS (sooner only when events say something changed, never more often), and
// the event log as server-sent events (/console/api/events), shared with every other
// open console by the gateway's one tail. Rows are kept per key and only changed cells
// are written, and events are drawn once per animation frame, so hundreds of backends
// or tenants and a busy log do not freeze the page.
"use strict";

const REFRESH_MS = 2000;     // the snapshot is fetched at most this often
const IDLE_REFRESH_MS = 10000; // ... and this often when no event comes
const EVENTS_SHOWN = 300;    // rows kept in the event list
const VIEWS = ["levels", "backends", "spend", "ab", "dlq", "events", "request"];

const $ = (id) => document.getElementById(id);
const state = {
  snapshot: null,
  skew: 0,               // server clock minus ours, seconds
  lastFetch: 0,
  fetching: false,
  timer: null,
  timerDue: 0,
  dirty: false,          // events came since the last snapshot was asked for
  pending: [],           // events not yet drawn
  drawScheduled: false,
  kinds: new Map(),      // event kind -> count since the page opened
  source: null,
  authorized: true,
  request: null,         // {id, tenant} of the timeline shown
  requestTimer: null,
};

// ------------------------------------------------------------------ helpers

function el(tag, cls, text) {
  const node = document.createElement(tag);
  if (cls) node.className = cls;
  if (text !== undefined && text !== null) node.textContent = String(text);
  return node;
}

function setText(node, text) {
  const value = text === null || text === undefined ? "-" : String(text);
  if (node.textContent !== value) node.textContent = value;
}

function now() { return Date.now() / 1000 + state.skew; }

function duration(seconds) {
  if (seconds === null || seconds === undefined) return "-";
  if (!isFinite(seconds)) return "never";
  seconds = Math.max(0, seconds);
  if (seconds < 10) return seconds.toFixed(1) + " s";
  if (seconds < 120) return Math.round(seconds) + " s";
  if (seconds < 7200) return Math.round(seconds / 60) + " min";
  if (seconds < 172800) return (seconds / 3600).toFixed(1) + " h";
  return (seconds / 86400).toFixed(1) + " d";
}

function clock(at) {
  if (!at) return "-";
  const d = new Date(at * 1000);
  return d.toISOString().slice(11, 23);
}

function money(x) { return x === null || x === undefined ? "-" : Number(x).toFixed(4); }

function bar(node, ratio, label, warnAt = 0.7, badAt = 0.9) {
  let fill = node.firstChild;
  if (!fill) {
    node.className = "bar";
    fill = el("i");
    node.append(fill, el("b"));
  }
  const r = Math.max(0, Math.min(1, ratio || 0));
  const width = (r * 100).toFixed(1) + "%";
  if (fill.style.width !== width) fill.style.width = width;
  const cls = "bar" + (r >= badAt ? " bad" : r >= warnAt ? " warn" : "");
  if (node.className !== cls) node.className = cls;
  setText(node.lastChild, label);
}

// A coloured label inside ``td`` (one <span>, made once).
function tag(td, text, kind) {
  let span = td.firstChild;
  if (!span) { span = el("span"); td.append(span); }
  setText(span, text);
  const cls = "tag " + kind;
  if (span.className !== cls) span.className = cls;
}

// Keep one <tr> per key in ``tbody``: made by ``make(key)`` once, filled by
// ``fill(tr, item)`` every time; rows of keys no longer there are removed.
function syncRows(tbody, items, keyOf, make, fill) {
  const rows = tbody._rows || (tbody._rows = new Map());
  const seen = new Set();
  let previous = null;
  for (const item of items) {
    const key = keyOf(item);
    seen.add(key);
    let tr = rows.get(key);
    if (!tr) {
      tr = make(key);
      rows.set(key, tr);
    }
    fill(tr, item);
    const wanted = previous ? previous.nextSibling : tbody.firstChild;
    if (wanted !== tr) tbody.insertBefore(tr, wanted);
    previous = tr;
  }
  for (const [key, tr] of rows) {
    if (!seen.has(key)) { tr.remove(); rows.delete(key); }
  }
}

function row(cells) {
  const tr = el("tr");
  tr.cells_ = cells.map((cls) => { const td = el("td", cls); tr.append(td); return td; });
  return tr;
}

function requestLink(td, id, tenant) {
  let a = td.firstChild;
  if (!a) { a = el("a", "req"); td.append(a); }
  setText(a, id);
  a.href = "#request=" + encodeURIComponent(id) + (tenant ? "&tenant=" + encodeURIComponent(tenant) : "");
}

// ------------------------------------------------------------------ views

function currentView() {
  const hash = location.hash.replace(/^#/, "");
  const name = hash.split("=")[0].split("&")[0];
  return VIEWS.includes(name) ? name : "levels";
}

function showView() {
  const view = currentView();
  for (const name of VIEWS) {
    $("view-" + name).classList.toggle("active", name === view && state.authorized);
  }
  for (const a of document.querySelectorAll("#tabs a")) {
    a.classList.toggle("active", a.dataset.view === view);
  }
  if (view === "request") {
    const params = new URLSearchParams(location.hash.replace(/^#request=?/, "id="));
    const id = params.get("id");
    if (id) {
      $("request-id").value = id;
      $("request-tenant").value = params.get("tenant") || "";
      loadRequest(id, params.get("tenant") || "");
    }
  }
  tick();
}

function drawLevels(s) {
  const aging = state.snapshot.aging || {};
  syncRows($("levels-rows"), s.levels, (l) => l.name,
    () => row(["", "num", "num", "num", ""]),
    (tr, l) => {
      const [name, waiting, oldest, ages, barCell] = tr.cells_;
      setText(name, l.name);
      setText(waiting, l.waiting);
      oldest.dataset.since = l.oldest_at || "";
      setText(oldest, l.oldest_at ? duration(now() - l.oldest_at) : "-");
      const bound = aging[l.name];
      setText(ages, bound === null || bound === undefined ? "never" : duration(bound));
      const wait = l.oldest_at ? now() - l.oldest_at : 0;
      bar(barCell, bound ? wait / bound : 0, l.oldest_at && bound ? Math.round(100 * wait / bound) + "%" : "");
    });
  const totals = [
    ["in flight", s.in_flight],
    ["waiting", s.levels.reduce((n, l) => n + (l.waiting || 0), 0)],
    ["backends up", s.backends.filter((b) => b.healthy).length + " / " + s.backends.length],
    ["tenants", s.tenants.length],
    ["dead letters", state.snapshot.dlq.count],
    ["log seq", s.last_seq],
  ];
  syncRows($("totals"), totals, (t) => t[0],
    () => { const d = el("div", "card"); d.append(el("b"), el("span")); return d; },
    (d, t) => { setText(d.firstChild, t[1]); setText(d.lastChild, t[0]); });
}

function matches(filter, name) { return !filter || name.toLowerCase().includes(filter); }

function drawBackends(s) {
  const filter = $("backends-filter").value.trim().toLowerCase();
  const shown = s.backends.filter((b) => matches(filter, b.name));
  setText($("backends-count"), shown.length + " of " + s.backends.length + " backends");
  syncRows($("backends-rows"), shown, (b) => b.name,
    () => row(["", "", "", "num", "num", "num", "num", "num", "num", ""]),
    (tr, b) => {
      const c = tr.cells_;
      setText(c[0], b.name);
      const up = b.healthy && b.probe_ok !== false;
      tag(c[1], up ? (b.held ? "held" : "up") : b.out ? "out: no API key" : "down",
        up ? (b.held ? "warn" : "ok") : "bad");
      c[1].title = b.out || b.held || b.last_error_type || "";
      const circuit = b.circuit.replace("_", "-");
      tag(c[2], circuit + (b.consecutive_failures ? " (" + b.consecutive_failures + ")" : ""),
        b.circuit === "closed" ? "ok" : b.circuit === "open" ? "bad" : "warn");
      c[2].title = b.circuit_reason || "";
      const used = b.running === null ? b.in_flight : b.running;
      if (!c[3].firstChild) c[3].append(el("div"));
      bar(c[3].firstChild, b.concurrency ? used / b.concurrency : 0,
        used + " / " + (b.concurrency === null ? "-" : b.concurrency));
      setText(c[4], b.waiting);
      setText(c[5], b.calls_completed);
      setText(c[6], b.calls_failed);
      setText(c[7], b.rate_limited);
      setText(c[8], money(b.spend));
      drawQuota(c[9], b);
    });
}

function drawQuota(td, b) {
  let grid = td.firstChild;
  if (!grid) { grid = el("div", "quota"); td.append(grid); }
  const wanted = b.limits.length * 3;
  while (grid.childNodes.length < wanted) grid.append(el("span"), el("div"), el("span", "reset"));
  while (grid.childNodes.length > wanted) grid.lastChild.remove();
  b.limits.forEach((u, i) => {
    const [name, barNode, reset] = [grid.childNodes[3 * i], grid.childNodes[3 * i + 1], grid.childNodes[3 * i + 2]];
    setText(name, u.key + (u.calendar === "rolling" ? "" : " (" + u.calendar + ")"));
    bar(barNode, u.count ? u.used / u.count : 1, u.used + " / " + u.count);
    const until = u.left > 0 ? u.resets_at : (u.room_at || u.resets_at);
    reset.dataset.until = until || "";
    setText(reset, until ? "in " + duration(until - now()) : "-");
  });
  if (!b.limits.length && !td.dataset.none) td.dataset.none = "1";
  if (b.exhausted_until || b.cooldown_until) {
    td.title = b.exhausted_until ? "quota exhausted until " + clock(b.exhausted_until)
      : "429: no call until " + clock(b.cooldown_until);
  } else if (td.title) {
    td.title = "";
  }
}

function drawTenants(s) {
  const filter = $("tenants-filter").value.trim().toLowerCase();
  const shown = s.tenants.filter((t) => matches(filter, t.name));
  setText($("tenants-count"), shown.length + " of " + s.tenants.length + " tenants");
  syncRows($("tenants-rows"), shown, (t) => t.name,
    () => row(["", "num", "num", "", "num", "num", "wrap"]),
    (tr, t) => {
      const c = tr.cells_;
      setText(c[0], t.name);
      setText(c[1], money(t.spend_today));
      setText(c[2], t.budget ? money(t.budget.daily) + " " + t.budget.mode : "-");
      if (!c[3].firstChild) c[3].append(el("div"));
      const ratio = t.budget && t.budget.daily > 0 ? t.spend_today / t.budget.daily : 0;
      bar(c[3].firstChild, ratio, t.budget ? Math.round(100 * ratio) + "%" : "no budget", 0.8, 1);
      setText(c[4], money(t.spend));
      setText(c[5], t.submitted);
      setText(c[6], Object.entries(t.terminal).sort().map(([k, v]) => k + "=" + v).join(" ") || "-");
    });
}

function pct(x) { return x === null || x === undefined ? "-" : (100 * x).toFixed(1) + "%"; }
function secs(x) { return x === null || x === undefined ? "-" : x.toFixed(2) + " s"; }

function drawSplits(splits) {
  const box = $("splits");
  if (!splits.length) {
    if (!box.dataset.empty) { box.replaceChildren(el("p", "note", "No A/B splits in the config or the log.")); box.dataset.empty = "1"; }
    return;
  }
  delete box.dataset.empty;
  syncRows(box, splits, (sp) => sp.route,
    () => {
      const div = el("div", "split");
      const table = el("table", "grid");
      const head = el("tr");
      for (const h of ["arm", "weight", "requests", "completed", "failed", "expired", "error rate",
        "latency p50", "latency p95", "ttft p50", "cost $", "requests (all)"]) head.append(el("th", "num", h));
      head.firstChild.className = "";
      const thead = el("thead"); thead.append(head);
      const tbody = el("tbody");
      table.append(thead, tbody);
      div.append(el("h4"), el("p", "note"), table);
      div.body_ = tbody;
      return div;
    },
    (div, sp) => {
      setText(div.firstChild, sp.route + ": " + sp.state + (sp.arm ? " -> " + sp.arm : ""));
      setText(div.childNodes[1], "control " + sp.control + ", sticky by " + sp.key + "; figures over the last "
        + duration(sp.window) + (sp.reason ? "; " + sp.reason + (sp.by ? " (" + sp.by + ")" : "") : "")
        + (sp.note ? "; " + sp.note : ""));
      syncRows(div.body_, sp.arms, (a) => a.arm,
        () => row(["", "num", "num", "num", "num", "num", "num", "num", "num", "num", "num", "num"]),
        (tr, a) => {
          const c = tr.cells_, w = a.window;
          setText(c[0], a.arm + (a.control ? " (control)" : ""));
          setText(c[1], a.weight === null ? "-" : a.weight);
          setText(c[2], w.requests); setText(c[3], w.completed); setText(c[4], w.failed);
          setText(c[5], w.expired); setText(c[6], pct(w.error_rate));
          setText(c[7], secs(w.latency_p50)); setText(c[8], secs(w.latency_p95));
          setText(c[9], secs(w.ttft_p50)); setText(c[10], money(w.cost)); setText(c[11], a.total.requests);
        });
    });
}

function drawDlq(dlq) {
  if (dlq.error) { setText($("dlq-summary"), "cannot read the dead letters: " + dlq.error); return; }
  setText($("dlq-summary"), dlq.count + " dead letters" + (dlq.count > dlq.entries.length
    ? "; the newest " + dlq.entries.length + " shown" : "") + (dlq.unreadable ? "; " + dlq.unreadable + " unreadable" : "")
    + ". Requeue with `renqueue dlq requeue SEQ`.");
  syncRows($("dlq-rows"), dlq.entries, (e) => e.seq,
    () => row(["num", "", "", "", "", "wrap", ""]),
    (tr, e) => {
      const c = tr.cells_;
      setText(c[0], e.seq); setText(c[1], clock(e.time)); setText(c[2], e.stage); setText(c[3], e.tenant);
      requestLink(c[4], e.request_id, e.tenant); setText(c[5], e.reason); setText(c[6], e.requeued_as);
    });
}

function draw() {
  const snap = state.snapshot;
  if (!snap) return;
  const s = snap.status;
  drawLevels(s);
  drawBackends(s);
  drawTenants(s);
  drawSplits(snap.splits);
  drawDlq(snap.dlq);
  setText($("lag"), s.projected ? "projection " + s.events_behind + " behind" : "no projection yet");
  setText($("updated"), "at " + clock(snap.at));
}

// Countdowns and waits move every second without a fetch: only the visible view's.
function tick() {
  const view = $("view-" + currentView());
  if (!view || !state.snapshot) return;
  for (const node of view.querySelectorAll("[data-until]")) {
    const until = Number(node.dataset.until);
    if (until) setText(node, "in " + duration(until - now()));
  }
  for (const node of view.querySelectorAll("[data-since]")) {
    const since = Number(node.dataset.since);
    if (since) setText(node, duration(now() - since));
  }
}

// ------------------------------------------------------------------ the snapshot

// Fetch the snapshot in ``delay`` ms, but never sooner than REFRESH_MS after the last
// fetch; a fetch already planned for sooner stands.
function refreshSoon(delay) {
  const wait = Math.max(0, state.lastFetch + REFRESH_MS - Date.now(), delay || 0);
  const due = Date.now() + wait;
  if (state.timer !== null) {
    if (state.timerDue <= due) return;
    clearTimeout(state.timer);
  }
  state.timerDue = due;
  state.timer = setTimeout(() => { state.timer = null; refresh(); }, wait);
}

async function refresh() {
  if (state.fetching || !state.authorized) return;
  if (document.hidden) { refreshSoon(IDLE_REFRESH_MS); return; }
  state.fetching = true;
  state.dirty = false;
  state.lastFetch = Date.now();
  try {
    const response = await fetch("/console/api/status", { credentials: "same-origin" });
    if (response.status === 401 || response.status === 403) { needKey(response); return; }
    if (!response.ok) throw new Error("status " + response.status);
    const snap = await response.json();
    state.skew = snap.at - Date.now() / 1000;
    state.snapshot = snap;
    draw();
    document.body.dataset.loaded = "1";
  } catch (err) {
    setText($("updated"), "fetch failed: " + err.message);
  } finally {
    state.fetching = false;
    refreshSoon(state.dirty ? 0 : IDLE_REFRESH_MS);
  }
}

// ------------------------------------------------------------------ the events

function connect() {
  if (state.source) state.source.close();
  const source = new EventSource("/console/api/events");
  state.source = source;
  source.onopen = () => { $("live").className = "pill on"; setText($("live"), "live"); };
  source.onerror = (event) => {
    if (event.data) {  // the gateway says its tail of the event log is down (and retries)
      $("live").className = "pill off"; setText($("live"), "feed down");
      $("live").title = JSON.parse(event.data).reason || "";
      return;
    }
    $("live").className = "pill off"; setText($("live"), "reconnecting");
    if (source.readyState === EventSource.CLOSED) setTimeout(probeKey, 2000);
  };
  source.addEventListener("gap", () => {
    $("live").className = "pill on"; setText($("live"), "live"); $("live").title = "the event stream";
    state.dirty = true; refreshSoon(0);
  });
  source.onmessage = (message) => {
    state.pending.push(JSON.parse(message.data));
    if (!state.drawScheduled) {
      state.drawScheduled = true;
      requestAnimationFrame(drawEvents);
    }
  };
}

function drawEvents() {
  state.drawScheduled = false;
  const batch = state.pending.splice(0, state.pending.length).slice(-EVENTS_SHOWN);
  if (!batch.length) return;
  const tbody = $("events-rows");
  const fragment = document.createDocumentFragment();
  let touchesRequest = false;
  for (let i = batch.length - 1; i >= 0; i--) {
    const e = batch[i];
    state.kinds.set(e.kind, (state.kinds.get(e.kind) || 0) + 1);
    const tr = row(["num", "", "", "", "", "", ""]);
    const c = tr.cells_;
    tr.className = "fresh";
    tr.dataset.kind = e.kind;
    c[0].textContent = e.seq; c[1].textContent = clock(e.at);
    tag(c[2], e.kind, kindClass(e.kind));
    c[3].textContent = e.tenant;
    if (e.tenant === "_system") c[4].textContent = e.request_id; else requestLink(c[4], e.request_id, e.tenant);
    c[5].textContent = e.backend || "";
    c[6].textContent = e.line;
    fragment.append(tr);
    if (state.request && e.request_id === state.request.id) touchesRequest = true;
  }
  tbody.insertBefore(fragment, tbody.firstChild);
  while (tbody.childNodes.length > EVENTS_SHOWN) tbody.lastChild.remove();
  const kinds = [...state.kinds.entries()].sort((a, b) => b[1] - a[1]);
  syncRows($("kinds"), kinds, (k) => k[0],
    (key) => { const d = el("div", "card"); d.dataset.kind = key; d.append(el("b"), el("span")); return d; },
    (d, k) => { setText(d.firstChild, k[1]); setText(d.lastChild, k[0]); });
  if (touchesRequest) reloadRequestSoon();
  state.dirty = true;
  refreshSoon(0);
}

function kindClass(kind) {
  if (["completed", "routed", "started", "submitted"].includes(kind)) return "ok";
  if (["failed", "rejected", "expired", "cancelled"].includes(kind)) return "bad";
  if (["retrying", "fell_back", "preempted", "circuit", "promoted", "stolen"].includes(kind)) return "warn";
  return "";
}

// ------------------------------------------------------------------ a request's timeline

function reloadRequestSoon() {
  if (state.requestTimer !== null) return;
  state.requestTimer = setTimeout(() => {
    state.requestTimer = null;
    if (state.request) loadRequest(state.request.id, state.request.tenant);
  }, 500);
}

async function loadRequest(id, tenant) {
  state.request = { id, tenant };
  const query = tenant ? "?tenant=" + encodeURIComponent(tenant) : "";
  let response;
  try {
    response = await fetch("/console/api/requests/" + encodeURIComponent(id) + query, { credentials: "same-origin" });
  } catch (err) {
    setText($("request-error"), err.message);
    return;
  }
  if (response.status === 401 || response.status === 403) { needKey(response); return; }
  const body = await response.json();
  if (!response.ok) {
    setText($("request-error"), body.error ? body.error.message : "status " + response.status);
    $("request-rows").replaceChildren();
    $("request-rows")._rows = new Map();
    setText($("request-summary"), "");
    return;
  }
  setText($("request-error"), "");
  const events = body.events;
  const first = events.length ? events[0].at : 0;
  const last = events[events.length - 1];
  setText($("request-summary"), body.request_id + " of " + body.tenant + ": " + events.length + " events, "
    + "last " + last.kind + " " + duration(last.at - first) + " after the first");
  syncRows($("request-rows"), events, (e) => e.kind + "@" + e.at + "@" + (e.attempt || "") + "@" + (e.run || ""),
    () => row(["", "num", "", "", "wrap"]),
    (tr, e) => {
      const c = tr.cells_;
      tr.dataset.kind = e.kind;
      setText(c[0], clock(e.at)); setText(c[1], (e.at - first).toFixed(3));
      tag(c[2], e.kind, kindClass(e.kind));
      setText(c[3], e.backend || e.to_backend || "");
      setText(c[4], details(e));
    });
}

function details(e) {
  const skip = new Set(["kind", "at", "backend", "to_backend"]);
  const parts = [];
  for (const [key, value] of Object.entries(e)) {
    if (skip.has(key) || value === null || value === "") continue;
    if (typeof value === "object" && !Object.keys(value).length) continue;
    const shown = typeof value === "object" ? JSON.stringify(value)
      : typeof value === "number" && !Number.isInteger(value) ? +value.toFixed(4) : value;
    parts.push(key + "=" + shown);
  }
  return parts.join("  ");
}

// ------------------------------------------------------------------ the key

function needKey(response) {
  state.authorized = false;
  $("login").hidden = false;
  $("logout").hidden = true;
  if (state.source) { state.source.close(); state.source = null; }
  if (response && response.status === 403) setText($("login-error"), "that is a tenant's key, not an admin key");
  showView();
}

async function probeKey() {
  const response = await fetch("/console/api/status", { credentials: "same-origin" });
  if (response.status === 401 || response.status === 403) needKey(response);
}

async function login(event) {
  event.preventDefault();
  const key = $("login-key").value.trim();
  const response = await fetch("/console/login", {
    method: "POST", credentials: "same-origin",
    headers: { "Content-Type": "application/json" }, body: JSON.stringify({ key }),
  });
  if (!response.ok) {
    const body = await response.json().catch(() => ({}));
    setText($("login-error"), body.error ? body.error.message : "status " + response.status);
    return;
  }
  $("login-key").value = "";
  setText($("login-error"), "");
  start();
}

async function logout() {
  await fetch("/console/logout", { method: "POST", credentials: "same-origin" });
  needKey(null);
}

function start() {
  state.authorized = true;
  $("login").hidden = true;
  $("logout").hidden = false;
  showView();
  refresh();
  connect();
}

document.addEventListener("DOMContentLoaded", () => {
  $("login-form").addEventListener("submit", login);
  $("logout").addEventListener("click", logout);
  $("backends-filter").addEventListener("input", () => state.snapshot && drawBackends(state.snapshot.status));
  $("tenants-filter").addEventListener("input", () => state.snapshot && drawTenants(state.snapshot.status));
  $("request-form").addEventListener("submit", (event) => {
    event.preventDefault();
    const id = $("request-id").value.trim();
    const tenant = $("request-tenant").value.trim();
    location.hash = "request=" + encodeURIComponent(id) + (tenant ? "&tenant=" + encodeURIComponent(tenant) : "");
  });
  window.addEventListener("hashchange", showView);
  document.addEventListener("visibilitychange", () => { if (!document.hidden) refreshSoon(0); });
  setInterval(tick, 1000);
  start();
});
