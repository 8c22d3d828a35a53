// metaq console: every page polls /api/snapshot (and /api/history for charts) and redraws itself.
// Values from the cluster reach the page only as text nodes (textContent), never as markup.
"use strict";

const PAGE = document.body.dataset.page;
const COLORS = ["#2b6cb0", "#c05621", "#2f855a", "#6b46c1", "#b7791f", "#c53030", "#2c7a7b", "#97266d"];
let pollMs = 2000;

// -- small helpers ----------------------------------------------------------------------------------
function el(tag, attrs, ...kids) {
  const e = document.createElement(tag);
  for (const [k, v] of Object.entries(attrs || {})) {
    if (v === null || v === undefined) continue;
    if (k === "class") e.className = v;
    else e.setAttribute(k, String(v));
  }
  for (const k of kids) {
    if (k === null || k === undefined) continue;
    e.append(k instanceof Node ? k : String(k));
  }
  return e;
}

function svg(tag, attrs, ...kids) {
  const e = document.createElementNS("http://www.w3.org/2000/svg", tag);
  for (const [k, v] of Object.entries(attrs || {})) e.setAttribute(k, String(v));
  for (const k of kids) e.append(k instanceof Node ? k : String(k));
  return e;
}

const num = (x) => (x === null || x === undefined ? "–" : Number(x).toLocaleString("en-US"));
const rate = (x) => (x === null || x === undefined ? "–" : x < 10 ? x.toFixed(1) : Math.round(x).toLocaleString("en-US"));

function bytes(x) {
  if (x === null || x === undefined) return "–";
  const units = ["B", "KiB", "MiB", "GiB", "TiB"];
  let i = 0;
  while (x >= 1024 && i < units.length - 1) { x /= 1024; i++; }
  return (i ? x.toFixed(1) : String(x)) + " " + units[i];
}

function duration(s) {
  if (s === null || s === undefined) return "–";
  s = Math.floor(s);
  const d = Math.floor(s / 86400), h = Math.floor(s / 3600) % 24, m = Math.floor(s / 60) % 60;
  return d ? `${d}d ${h}h` : h ? `${h}h ${m}m` : m ? `${m}m ${s % 60}s` : `${s}s`;
}

function clock(t) { return new Date(t * 1000).toLocaleTimeString("en-GB"); }

function link(page, params, text) {
  return el("a", { href: `/${page}.html?` + new URLSearchParams(params).toString() }, text);
}

// A table: columns [{key, title, num}], rows of {cells: {key: value or Node}, attrs}.
function table(columns, rows, empty) {
  if (!rows.length) return el("p", { class: "empty" }, empty || "none");
  const head = el("tr", {}, ...columns.map((c) => el("th", { class: c.num ? "num" : null }, c.title)));
  const body = rows.map((r) => el("tr", r.attrs || {}, ...columns.map((c) =>
    el("td", { class: c.num ? "num" : null, "data-col": c.key }, r.cells[c.key]))));
  return el("table", {}, el("thead", {}, head), el("tbody", {}, ...body));
}

function card(label, value, id) {
  return el("div", { class: "card", id }, el("div", { class: "value" }, value), el("div", { class: "label" }, label));
}

// -- charts: plain SVG lines over the history window ---------------------------------------------------
function chart(title, series, now, windowS, fmt) {
  const W = 640, H = 190, L = 56, R = 10, T = 12, B = 24;
  const names = Object.keys(series).sort();
  let max = 0;
  for (const n of names) for (const [, v] of series[n]) if (v !== null && v > max) max = v;
  max = max > 0 ? max * 1.1 : 1;
  const x = (t) => L + (W - L - R) * (1 - (now - t) / windowS);
  const y = (v) => T + (H - T - B) * (1 - v / max);
  const g = svg("svg", { viewBox: `0 0 ${W} ${H}`, class: "chart", role: "img", "aria-label": title });
  for (const f of [0, 0.5, 1]) {
    g.append(svg("line", { x1: L, x2: W - R, y1: y(max * f / 1.1), y2: y(max * f / 1.1), class: "grid" }));
    g.append(svg("text", { x: L - 4, y: y(max * f / 1.1) + 4, "text-anchor": "end", class: "axis" }, fmt(max * f / 1.1)));
  }
  for (const f of [0, 0.5, 1]) {
    const ago = windowS * (1 - f);
    const label = f === 1 ? "now" : ago < 120 ? `-${Math.round(ago)} s` : `-${+(ago / 60).toFixed(1)} min`;
    g.append(svg("text", { x: L + (W - L - R) * f, y: H - 6, "text-anchor": f === 0 ? "start" : f === 1 ? "end" : "middle",
      class: "axis" }, label));
  }
  names.forEach((n, i) => {
    let run = [];
    const flush = () => {
      if (run.length > 1) g.append(svg("polyline", { points: run.join(" "), stroke: COLORS[i % COLORS.length], class: "line" }));
      if (run.length === 1) g.append(svg("circle", { cx: run[0].split(",")[0], cy: run[0].split(",")[1], r: 2, fill: COLORS[i % COLORS.length] }));
      run = [];
    };
    for (const [t, v] of series[n]) {
      if (v === null || now - t > windowS) { flush(); continue; }
      run.push(`${x(t).toFixed(1)},${y(v).toFixed(1)}`);
    }
    flush();
  });
  const legend = el("div", { class: "legend" }, ...names.map((n, i) => {
    const sw = el("span", { class: "swatch" });
    sw.style.background = COLORS[i % COLORS.length];
    return el("span", { class: "item" }, sw, n);
  }));
  return el("figure", { class: "chart-box" }, el("figcaption", {}, title),
    names.length ? g : el("p", { class: "empty" }, "no samples yet"), legend);
}

// The samples' span (at least ten intervals): the charts fill their width from the first minutes on.
function chartWindow(history) {
  const s = history.samples;
  return Math.max(10 * history.interval, s.length ? history.now - s[0].t : 0);
}

function seriesOf(history, pick) {
  const out = {};
  for (const s of history.samples) {
    for (const [name, v] of pick(s)) (out[name] = out[name] || []).push([s.t, v]);
  }
  return out;
}

// -- status line and errors ---------------------------------------------------------------------------
function showStatus(snap, failure) {
  const status = document.getElementById("status");
  const errors = document.getElementById("errors");
  const problems = failure ? [failure] : snap.errors || [];  // the server adds a stalled snapshot's note
  errors.replaceChildren(...problems.map((p) => el("div", { class: "error" }, p)));
  if (failure) { status.textContent = "console not reachable"; return; }
  if (!snap.time) { status.textContent = `connecting to ${snap.target}…`; return; }
  const zk = snap.zookeeper ? ` (${snap.zookeeper.state.toLowerCase()})` : "";
  status.textContent = `${snap.target}${zk} · as of ${clock(snap.time)} (took ${(snap.took || 0).toFixed(2)} s)`;
}

// -- pages --------------------------------------------------------------------------------------------
const pages = {};

pages.brokers = (snap) => {
  const parts = snap.topics.reduce((n, t) => n + t.partitions.length, 0);
  const lag = snap.groups.reduce((n, g) => n + g.lag, 0);
  const cards = el("div", { class: "cards" }, card("brokers", num(snap.brokers.length), "card-brokers"),
    card("topics", num(snap.topics.length), "card-topics"), card("partitions", num(parts), "card-partitions"),
    card("consumer groups", num(snap.groups.length), "card-groups"), card("total lag", num(lag), "card-lag"),
    card("prepared transactions", num(snap.transactions.prepared.length), "card-prepared"));
  // Admin.brokers_status adds restarted brokers waiting for their old ZooKeeper session ("starting")
  const detailed = snap.brokers.some((b) => b.details && Object.keys(b.details).length);
  const rows = snap.brokers.map((b) => ({
    attrs: { "data-broker": b.id, class: b.error || b.state !== "live" ? "bad" : null },
    cells: { id: String(b.id), address: b.address || "–", data: b.data_address || "–", state: b.status || b.state,
      version: b.version || "–", uptime: duration(b.uptime),
      details: detailed ? Object.entries(b.details || {}).map(([k, v]) =>
        `${k}: ${typeof v === "number" && v > 1e9 && v < 1e10 ? clock(v) : v}`).join(", ") : "",
      error: b.error || "" },
  }));
  return [cards, el("h2", {}, "Brokers"), table([
    { key: "id", title: "id", num: true }, { key: "address", title: "gRPC address" }, { key: "data", title: "data port" },
    { key: "state", title: "state" }, { key: "version", title: "version" }, { key: "uptime", title: "uptime", num: true },
    ...(detailed ? [{ key: "details", title: "details" }] : []), { key: "error", title: "error" }], rows,
  "no live broker registered"), ...groupMembers(snap.members || [])];
};

// Members of replicated broker groups (Admin.brokers); a group of one is its broker row.
function groupMembers(members) {
  const size = {};
  for (const m of members) size[m.brokerId] = (size[m.brokerId] || 0) + 1;
  const rows = members.filter((m) => size[m.brokerId] > 1).map((m) => ({
    attrs: { "data-member": `${m.brokerId}-${m.replicaId}`,
      class: m.role === "down" || m.role === "electing" || !m.inSync ? "bad" : null },
    cells: { group: String(m.brokerId), replica: String(m.replicaId), address: m.address || "–", role: m.role,
      epoch: num(m.epoch), insync: m.inSync ? "yes" : "no", lag: num(m.lagMessages) },
  }));
  if (!rows.length) return [];
  return [el("h2", {}, "Broker group members"), table([
    { key: "group", title: "broker", num: true }, { key: "replica", title: "replica", num: true },
    { key: "address", title: "gRPC address" }, { key: "role", title: "role" }, { key: "epoch", title: "epoch", num: true },
    { key: "insync", title: "in sync" }, { key: "lag", title: "lag (offsets)", num: true }], rows)];
}

pages.topics = (snap, history) => {
  const now = history ? history.now : snap.time;
  const win = history ? chartWindow(history) : 60;
  const out = [];
  if (history) {
    out.push(el("div", { class: "charts" },
      chart("produce rate (messages/s)", seriesOf(history, (s) => Object.entries(s.topics).map(([t, v]) => [t, v[0]])), now, win, rate),
      chart("fetch rate (messages/s)", seriesOf(history, (s) => Object.entries(s.topics).map(([t, v]) => [t, v[1]])), now, win, rate)));
  }
  if (!snap.topics.length) out.push(el("p", { class: "empty" }, "no topics"));
  for (const t of snap.topics) {
    out.push(el("h2", { id: `topic-${t.topic}` }, t.topic));
    out.push(el("p", { class: "summary" }, `${t.partitions.length} partitions · ${num(t.messages)} offsets stored · ` +
      `${bytes(t.bytes)} on disk · produce ${rate(t.produce_rate)} msg/s (${bytes(t.produce_bytes_rate)}/s) · fetch ${rate(t.fetch_rate)} msg/s`));
    if (t.error) out.push(el("div", { class: "error" }, t.error));
    out.push(table([
      { key: "partition", title: "partition" }, { key: "broker", title: "broker", num: true }, { key: "state", title: "state" },
      { key: "earliest", title: "earliest", num: true }, { key: "last_stable", title: "last stable", num: true },
      { key: "log_end", title: "log end", num: true }, { key: "bytes", title: "size", num: true },
      { key: "segments", title: "segments", num: true }, { key: "produce", title: "produce msg/s", num: true },
      { key: "fetch", title: "fetch msg/s", num: true }, { key: "browse", title: "" }],
    t.partitions.map((p) => ({
      attrs: { "data-topic": t.topic, "data-partition": p.partition, class: p.state === "open" || p.state === "closed" ? null : "bad" },
      cells: { partition: p.partition, broker: String(p.broker_id), state: p.state, earliest: num(p.earliest),
        last_stable: num(p.last_stable), log_end: num(p.log_end), bytes: bytes(p.bytes), segments: num(p.segments),
        produce: rate(p.produce_rate), fetch: rate(p.fetch_rate),
        browse: p.last_stable === null ? "" : link("messages", { topic: t.topic, partition: p.partition }, "messages") },
    }))));
  }
  return out;
};

pages.groups = (snap, history) => {
  const out = [];
  if (history) {
    const win = chartWindow(history);
    out.push(el("div", { class: "charts" }, chart("lag (offsets) by group and topic",
      seriesOf(history, (s) => Object.entries(s.lag)), history.now, win, (x) => num(Math.round(x)))));
  }
  if (!snap.groups.length) out.push(el("p", { class: "empty" }, "no consumer groups in ZooKeeper"));
  for (const g of snap.groups) {
    out.push(el("h2", { id: `group-${g.group}` }, g.group));
    out.push(el("p", { class: "summary" }, `lag ${num(g.lag)} · ${g.members.length} live member(s)` +
      (g.members.length ? ": " + g.members.join(", ") : " (a Spark query's group has none: it commits from the driver)")));
    if (g.error) out.push(el("div", { class: "error" }, g.error));
    for (const t of g.topics) {
      if (t.error) out.push(el("div", { class: "error" }, `${t.topic}: ${t.error}`));
      out.push(table([
        { key: "topic", title: "topic" }, { key: "partition", title: "partition" },
        { key: "committed", title: "committed", num: true }, { key: "latest", title: "last stable", num: true },
        { key: "lag", title: "lag", num: true }, { key: "owner", title: "owner" }],
      t.partitions.map((p) => ({
        attrs: { "data-group": g.group, "data-topic": t.topic, "data-partition": p.partition, class: p.lag > 0 ? "lagging" : null },
        cells: { topic: t.topic, partition: p.partition, committed: p.committed === null ? "–" : num(p.committed),
          latest: num(p.latest), lag: num(p.lag), owner: p.owner || "" },
      })), `${t.topic}: no partitions`));
    }
  }
  return out;
};

pages.transactions = (snap) => {
  const tx = snap.transactions;
  const out = [el("h2", {}, "Prepared (in doubt)")];
  for (const e of tx.errors || []) out.push(el("div", { class: "error" }, e));
  out.push(table([
    { key: "broker", title: "broker", num: true }, { key: "xid", title: "xid" }, { key: "coordinator", title: "coordinator" },
    { key: "messages", title: "messages", num: true }, { key: "age", title: "prepared", num: true }],
  tx.prepared.map((t) => ({
    attrs: { "data-xid": t.xid },
    cells: { broker: String(t.broker_id), xid: t.xid, coordinator: t.coordinator || "–", messages: num(t.messages),
      age: duration(t.prepared_seconds_ago) + " ago" },
  })), "no prepared transactions"));
  out.push(el("h2", {}, "Partitions held back by an unsettled transaction"));
  out.push(table([
    { key: "topic", title: "topic" }, { key: "partition", title: "partition" },
    { key: "last_stable", title: "last stable", num: true }, { key: "log_end", title: "log end", num: true },
    { key: "held", title: "held back", num: true }],
  tx.unsettled.map((u) => ({
    attrs: { "data-topic": u.topic, "data-partition": u.partition },
    cells: { topic: u.topic, partition: u.partition, last_stable: num(u.last_stable), log_end: num(u.log_end), held: num(u.held_back) },
  })), "none: every partition's last stable offset is its log end"));
  out.push(el("p", { class: "note" }, tx.note));
  return out;
};

// The message browser: a form (GET to this page) and the messages of its query, fetched once.
let browsed = null;
function shown(v) {
  if (v === null || v === undefined) return el("span", { class: "null" }, "null");
  const body = v.text !== undefined ? el("span", { class: "text" }, v.text) : el("span", { class: "hex" }, v.hex);
  return el("span", {}, body, v.truncated ? el("span", { class: "more" }, ` … (${num(v.size)} bytes)`) : null);
}

pages.messages = (snap) => {
  const q = new URLSearchParams(location.search);
  const topic = q.get("topic") || "", partition = q.get("partition") || "", count = q.get("count") || "50";
  // find: by message id when one is given, else by key (the empty key too); browse: a partition from an offset
  const finding = q.has("key") || q.has("msg_id"), msgId = (q.get("msg_id") || "").trim(), key = q.get("key") || "";
  const topicSel = el("select", { name: "topic", id: "topic" }, el("option", { value: "" }, "topic…"),
    ...snap.topics.map((t) => { const o = el("option", { value: t.topic }, t.topic); o.selected = t.topic === topic; return o; }));
  const parts = (snap.topics.find((t) => t.topic === topic) || { partitions: [] }).partitions;
  const partitionSelect = (id, all) => el("select", { name: "partition", id },
    ...(all ? [el("option", { value: "" }, "all")] : []),
    ...parts.map((p) => { const o = el("option", { value: p.partition }, p.partition); o.selected = p.partition === partition; return o; }));
  topicSel.addEventListener("change", () => { location.search = new URLSearchParams({ topic: topicSel.value }).toString(); });
  const form = el("form", { method: "get", action: "/messages.html", class: "browse" },
    el("label", {}, "topic ", topicSel), el("label", {}, "partition ", partitionSelect("partition", false)),
    el("label", {}, "from offset ", el("input", { name: "from", id: "from", value: q.get("from") || "", placeholder: "last N", size: 12 })),
    el("label", {}, "count ", el("input", { name: "count", id: "count", value: count, size: 5 })),
    el("button", { type: "submit" }, "show"));
  const find = el("form", { method: "get", action: "/messages.html", class: "browse", id: "find" },
    el("input", { type: "hidden", name: "topic", value: topic }),
    el("label", {}, "find by key ", el("input", { name: "key", id: "key", value: finding ? key : "", size: 20 })),
    el("label", {}, "or message id ", el("input", { name: "msg_id", id: "msg-id", value: msgId, size: 20 })),
    el("label", {}, "in ", partitionSelect("find-partition", true)),
    el("input", { type: "hidden", name: "count", value: count }),
    el("button", { type: "submit", id: "find-button" }, "find"));
  const out = [form, find];
  if (!topic || (!partition && !finding)) {
    out.push(el("p", { class: "empty" }, "choose a topic and a partition, or find messages by key or message id"));
    return out;
  }
  if (!browsed) {
    browsed = { pending: true };
    const ask = !finding ? "/api/messages?" + new URLSearchParams({ topic, partition, from: q.get("from") || "", count })
      : "/api/lookup?" + new URLSearchParams({ topic, partition, count, ...(msgId !== "" ? { msg_id: msgId } : { key }) });
    fetch(ask).then(loggedIn).then((d) => { browsed = d; refresh(); })
      .catch((e) => { browsed = { error: String(e) }; refresh(); });
  }
  if (browsed.pending) { out.push(el("p", {}, "fetching…")); return out; }
  if (browsed.error) { out.push(el("div", { class: "error", id: "browse-error" }, browsed.error)); return out; }
  const d = browsed;
  if (finding) {
    out.push(el("p", { class: "summary", id: "range" }, `${d.topic}${d.partition ? " " + d.partition : ""}: ` +
      (d.msg_id !== null ? `the message with id ${d.msg_id}` : `messages with key "${d.key}", newest first`) +
      ` · ${d.messages.length} found`));
  } else {
    out.push(el("p", { class: "summary", id: "range" }, `${d.topic} ${d.partition}: offsets ${num(d.earliest)} to ` +
      `${num(d.last_stable)} (last stable; log end ${num(d.log_end)}) · showing ${d.messages.length} from ${num(d.from)}`,
      d.next < d.last_stable ? el("span", {}, " · ", link("messages", { topic: d.topic, partition: d.partition, from: d.next,
        count }, `next from ${num(d.next)}`)) : null));
  }
  out.push(table([
    ...(finding ? [{ key: "partition", title: "partition" }] : []),
    { key: "offset", title: "offset", num: true }, { key: "timestamp", title: "timestamp (UTC)" }, { key: "key", title: "key" },
    { key: "value", title: "value" }, { key: "size", title: "bytes", num: true }, { key: "attribute", title: "attribute" },
    { key: "id", title: "message id", num: true }],
  d.messages.map((m) => ({
    attrs: { "data-offset": m.offset, "data-partition": m.partition || partition },
    cells: { partition: m.partition || "", offset: String(m.offset), timestamp: m.timestamp || "", key: shown(m.key),
      value: shown(m.value), size: m.value === null ? "–" : num(m.value.size),
      attribute: m.attribute === null ? "" : m.attribute, id: String(m.msg_id) },
  })), finding ? "no message found" : "no committed messages in this range"));
  return out;
};

// -- the poll loop ------------------------------------------------------------------------------------
let snap = null, history = null, rendering = false, drawn = null;
function refresh() {
  if (!snap || rendering) return;
  rendering = true;
  try {
    const main = document.getElementById("main");
    // the message browser keeps what the user is choosing: redrawn only when its topics or result change
    const key = PAGE !== "messages" ? null : JSON.stringify([browsed,
      snap.topics.map((t) => [t.topic, t.partitions.map((p) => p.partition)])]);
    if (key === null || key !== drawn) main.replaceChildren(...pages[PAGE](snap, history));
    drawn = key;
    document.body.dataset.updated = String(snap.time || "");
  } finally { rendering = false; }
}

// With a login (SASL_SSL clusters) an expired or ended session answers 401: back to the login page.
function loggedIn(r) {
  if (r.status === 401) { location.href = "/login"; throw new Error("logged out"); }
  return r.json();
}

async function whoami() {
  const me = await fetch("/api/whoami").then(loggedIn);
  if (!me.user) return;
  document.getElementById("user").textContent = me.user;
  document.getElementById("logout-csrf").value = me.csrf;
  document.getElementById("logout").hidden = false;
}

async function poll() {
  try {
    const wantHistory = PAGE === "topics" || PAGE === "groups";
    const [s, h] = await Promise.all([fetch("/api/snapshot").then(loggedIn),
      wantHistory ? fetch("/api/history").then(loggedIn) : Promise.resolve(null)]);
    snap = s; history = h;
    if (s.interval) pollMs = Math.max(500, Math.min(5000, s.interval * 1000));
    showStatus(snap, null);
    refresh();
  } catch (e) {
    showStatus(snap, `console not reachable: ${e}`);
  }
  setTimeout(poll, pollMs);
}

document.getElementById(`nav-${PAGE}`).classList.add("active");
whoami().catch(() => {});
poll();
