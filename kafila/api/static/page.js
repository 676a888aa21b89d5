// The session page: polls this member's /status every second and chats through its own
// /v1/chat/completions (server-sent events). Only same-origin requests; text goes in with
// textContent, never as HTML.
"use strict";

const POLL_MS = 1000;
const SVG = "http://www.w3.org/2000/svg";
const $ = (id) => document.getElementById(id);
let modelId = null;
let history = [];  // the conversation: [{role, content}]
let busy = false;

function fmt(v, digits = 1) {
  return v === null || v === undefined || Number.isNaN(v) ? "–" : Number(v).toFixed(digits);
}
function mb(bytes) { return bytes === null || bytes === undefined ? "–" : (bytes / 1e6).toFixed(1) + " MB"; }
function el(tag, attrs = {}, text = null) {
  const e = document.createElement(tag);
  for (const [k, v] of Object.entries(attrs)) e.setAttribute(k, v);
  if (text !== null) e.textContent = text;
  return e;
}
function svg(tag, attrs = {}, text = null) {
  const e = document.createElementNS(SVG, tag);
  for (const [k, v] of Object.entries(attrs)) e.setAttribute(k, v);
  if (text !== null) e.textContent = text;
  return e;
}

// --- figures derived from /status ----------------------------------------------------------

function ringOf(st) { return (st.plan && st.plan.ring) || Object.keys(st.members || {}); }

function edgesOf(st) {
  // measured edges (kind and RTT as connected) over the plan's predicted ones
  const out = {};
  for (const e of (st.plan && st.plan.edges) || []) {
    out[e.from] = {from: e.from, to: e.to, kind: e.kind, rtt_ms: null, predicted_ms: e.ms, measured: false};
  }
  for (const e of st.edges || []) {
    const p = out[e.from] || {};
    out[e.from] = {from: e.from, to: e.to, kind: e.kind || p.kind, rtt_ms: e.rtt_ms,
                   predicted_ms: p.predicted_ms, measured: true};
  }
  return out;
}

function predictedTokS(plan) {
  if (!plan || !plan.stage_ms) return null;
  const stages = Object.values(plan.stage_ms);
  if (!stages.length || stages.some((v) => v === null)) return null;
  const total = stages.reduce((a, b) => a + b, 0) + (plan.edges || []).reduce((a, e) => a + (e.ms || 0), 0);
  return total > 0 ? 1000 / total : null;
}

function argmax(obj) {
  let best = null;
  for (const [k, v] of Object.entries(obj || {})) if (v !== null && (best === null || v > obj[best])) best = k;
  return best;
}

// --- drawing ---------------------------------------------------------------------------------

function drawRing(st) {
  const root = $("ring");
  root.replaceChildren();
  const defs = svg("defs");
  const marker = svg("marker", {id: "arrow", viewBox: "0 0 10 10", refX: "9", refY: "5",
                                markerWidth: "7", markerHeight: "7", orient: "auto-start-reverse"});
  marker.append(svg("path", {d: "M 0 0 L 10 5 L 0 10 z", fill: "currentColor"}));
  defs.append(marker);
  root.append(defs);
  const ring = ringOf(st);
  const n = ring.length;
  if (!n) {
    const why = st.mode === "local" ? "one process (kafila serve): no ring" : "waiting for members…";
    root.append(svg("text", {x: 220, y: 200}, why));
    return;
  }
  const cx = 220, cy = 220, R = n === 1 ? 0 : 145, r = 34;
  const pos = {};
  ring.forEach((name, i) => {
    const a = -Math.PI / 2 + (2 * Math.PI * i) / n;
    pos[name] = [cx + R * Math.cos(a), cy + R * Math.sin(a)];
  });
  const members = st.members || {};
  const edges = edgesOf(st);
  if (n > 1) {
    for (const name of ring) {
      const e = edges[name];
      if (!e || !(e.to in pos)) continue;
      const [x1, y1] = pos[name], [x2, y2] = pos[e.to];
      const dx = x2 - x1, dy = y2 - y1, d = Math.hypot(dx, dy) || 1;
      const sx = x1 + (dx / d) * r, sy = y1 + (dy / d) * r, ex = x2 - (dx / d) * (r + 3), ey = y2 - (dy / d) * (r + 3);
      // bow outwards from the centre so the ring reads as a ring
      const mx = (sx + ex) / 2, my = (sy + ey) / 2;
      const ox = mx - cx, oy = my - cy, od = Math.hypot(ox, oy) || 1;
      const bow = n === 2 ? 40 : 28;
      const qx = mx + (ox / od) * bow, qy = my + (oy / od) * bow;
      const g = svg("g", {class: `edge ${e.kind || "unknown"}`, "data-from": e.from, "data-to": e.to,
                          "data-kind": e.kind || ""});
      g.append(svg("path", {d: `M ${sx} ${sy} Q ${qx} ${qy} ${ex} ${ey}`}));
      const lx = mx + (ox / od) * (bow + 22), ly = my + (oy / od) * (bow + 22);
      const rtt = e.rtt_ms !== null && e.rtt_ms !== undefined ? `${fmt(e.rtt_ms, 1)} ms` : `~${fmt(e.predicted_ms, 1)} ms`;
      g.append(svg("text", {x: lx, y: ly}, `${e.kind || "?"} · ${rtt}`));
      const nat = `${(members[e.from] || {}).nat || "?"} → ${(members[e.to] || {}).nat || "?"}`;
      g.append(svg("text", {x: lx, y: ly + 13, class: "sub"}, nat));
      root.append(g);
    }
  }
  const head = st.plan && st.plan.head;
  const me = st.session && st.session.name;
  for (const name of ring) {
    const [x, y] = pos[name];
    const g = svg("g", {class: "member" + (name === head ? " head" : ""), "data-name": name,
                        "data-head": String(name === head)});
    g.append(svg("circle", {cx: x, cy: y, r}));
    g.append(svg("text", {x, y: y + 5, class: "name"}, name));
    if (name === head) g.append(svg("text", {x, y: y - r - 7, class: "sub"}, "head"));
    if (name === me) g.append(svg("text", {x, y: y + r + 16, class: "sub"}, "this page"));
    root.append(g);
  }
  const list = $("edges");
  list.replaceChildren();
  for (const name of ring) {
    const e = edges[name];
    if (!e || n < 2) continue;
    const li = el("li", {"data-from": e.from, "data-to": e.to});
    li.append(`${e.from} → ${e.to}: `, el("span", {class: `kind-${e.kind}`}, e.kind || "?"),
              `, RTT ${fmt(e.rtt_ms, 2)} ms (plan ${fmt(e.predicted_ms, 2)} ms), NAT ` +
              `${(members[e.from] || {}).nat || "?"} / ${(members[e.to] || {}).nat || "?"}`);
    list.append(li);
  }
}

function drawMembers(st) {
  const body = $("members").tBodies[0];
  body.replaceChildren();
  const ring = ringOf(st);
  const names = ring.concat(Object.keys(st.members || {}).filter((m) => !ring.includes(m)));
  const stages = st.stages || {};
  const head = st.plan && st.plan.head;
  const me = st.session && st.session.name;
  const slowPredicted = argmax(Object.fromEntries(names.map((n) => [n, (stages[n] || {}).predicted_ms ?? null])));
  const slowMeasured = argmax(Object.fromEntries(names.map((n) => [n, (stages[n] || {}).compute_ms ?? null])));
  for (const name of names) {
    const m = (st.members || {})[name] || {};
    const s = stages[name] || {};
    const cls = [name === slowPredicted ? "bottleneck" : "", name === slowMeasured ? "slowest" : ""].join(" ").trim();
    const tr = el("tr", {"data-name": name, class: cls});
    const device = `${fmt(m.memory_gb, 1)} GB RAM, ${fmt(m.bandwidth_gbps, 1)} GB/s, ${fmt(m.overhead_us, 0)} µs`;
    let memory = "–";
    if (name === me && st.memory && st.memory.rss_bytes) {
      memory = `${mb(st.memory.rss_bytes)} / ${mb(st.memory.planned_bytes || st.memory.shard_bytes)}`;
    }
    const cells = [
      [name + (name === head ? " (head)" : "") + (name === me ? " (here)" : ""), "name"],
      [m.backend || (name === me && st.session ? st.session.backend : "–"), "backend"],
      [m.nat || "–", "nat"], [device, "device"],
      [s.blocks ?? "–", "blocks num"],
      [fmt(s.predicted_ms, 2), "predicted num"], [fmt(s.compute_ms, 2), "measured num"],
      [memory, "memory"], [m.state || "–", "state"],
    ];
    for (const [text, c] of cells) tr.append(el("td", {class: c}, String(text)));
    body.append(tr);
  }
}

function historyText(h) {
  const who = h.name ? ` ${h.name}` : "";
  const ring = h.ring ? `: ring ${h.ring.join(" → ")}` : "";
  const why = h.reason ? ` (${h.reason})` : "";
  return `${h.at} ${h.event}${who}${ring}${why}`;
}

function drawHistory(st) {
  const list = $("history");
  if (!list) return;
  const items = (st.history || []).slice(-30).reverse();  // the newest first
  list.replaceChildren(...items.map((h) => el("li", {"data-event": h.event}, historyText(h))));
}

function drawFigures(st) {
  const s = st.session || {};
  $("model").textContent = s.model || "";
  $("me").textContent = s.name ? `member ${s.name}` + (s.host ? `, host ${s.host}` : "") : "";
  const code = $("code");  // the host's current session code (loopback only; fresh after a wrong guess)
  code.hidden = !st.code;
  code.textContent = st.code ? `code ${st.code}` : "";
  const state = $("state");
  state.textContent = s.state || (st.ready ? "serving" : "–");
  state.className = "badge " + (s.state || (st.ready ? "serving" : ""));
  const problem = $("problem");
  problem.hidden = !s.degraded;
  problem.textContent = s.degraded ? `degraded: ${s.degraded}` : "";
  const plan = st.plan || {};
  $("tok-measured").textContent = fmt(st.tok_s, 1);
  $("tok-predicted").textContent = fmt(predictedTokS(plan), 1);
  const bn = argmax(plan.stage_ms || {});
  const cap = bn && plan.stage_ms[bn] > 0 ? `, at most ${fmt(1000 / plan.stage_ms[bn], 1)} tok/s` : "";
  $("bottleneck").textContent = bn ? `${bn} (${fmt(plan.stage_ms[bn], 2)} ms predicted${cap})` : "–";
  $("step-ms").textContent = fmt(st.step_ms, 2);
  $("network-ms").textContent = fmt(st.network_ms, 2);
  const r = st.requests;
  $("requests").textContent = r ? `${r.active} / ${r.queued}` : "– (the head schedules)";
  $("inflight").textContent = st.api ? String(st.api.inflight_requests) : "–";
  const spec = st.speculation || st.speculative;
  $("acceptance").textContent = spec && spec.acceptance !== undefined ? `${fmt(100 * spec.acceptance, 0)} %` : "– (not speculating)";
  $("dipsd").textContent = dipsdText(spec && spec.dipsd);
  $("uptime").textContent = s.uptime_s !== undefined ? `${fmt(s.uptime_s, 0)} s` : "–";
  const w = st.weights || {};
  const bar = $("weights-bar");
  if (w.source === "local file" || w.source === "own file") {
    bar.value = 1;
    $("weights-text").textContent = `${w.source}`;
  } else if (w.total_bytes !== undefined) {  // live while fetching (MB/s, ETA), kept once done
    bar.value = w.total_bytes ? Math.min(1, w.done_bytes / w.total_bytes) : 1;
    $("weights-text").textContent = `${transferText(w)} from the ${w.source || "host"}`;
  } else if (w.tensor_bytes) {
    const total = w.tensor_bytes, got = w.received_bytes || 0;
    bar.value = Math.min(1, got / total);
    const rate = w.seconds ? ` at ${fmt(got / 1e6 / w.seconds, 1)} MB/s` : "";
    $("weights-text").textContent = `${mb(got)} of ${mb(total)} from the ${w.source || "host"}${rate}`;
  } else {
    bar.value = 0;
    $("weights-text").textContent = s.host === true ? "the host serves them" : "waiting";
  }
  drawTransfers(st.transfers || {});
}

// the head's live DiP-SD schedule (speculation.dipsd): N batches, each request's draft length
function dipsdText(d) {
  if (!d) return "– (off, or not the head)";
  if (!d.active) return `– (under two requests speculating; ${d.solves} solves)`;
  const lengths = d.requests.map((r) => `${r.id} l=${r.l} b${r.batch}`).join(", ");
  const fb = d.fallback ? ", greedy fallback" : "";
  return `N=${d.n_batches}: ${lengths} (${fmt(d.tokens_per_s, 1)} tok/s expected, ${d.solved_by}${fb})`;
}

// one weight transfer's figures (TransferProgress.as_dict) in words
function transferText(t) {
  const pct = t.total_bytes ? ` (${fmt(100 * t.done_bytes / t.total_bytes, 0)} %)` : "";
  const rate = t.mb_s ? `, ${fmt(t.mb_s, 1)} MB/s` : "";
  const left = t.state === "done" ? (t.done_bytes >= t.total_bytes ? ", done" : ", done (the member had the rest)")
    : t.eta_s !== null && t.eta_s !== undefined ? `, ${fmt(t.eta_s, 0)} s left` : `, ${t.state || "waiting"}`;
  return `${mb(t.done_bytes)} of ${mb(t.total_bytes)}${pct}${rate}${left}`;
}

// the host's /status: a bar per member for the weights it serves them
function drawTransfers(transfers) {
  const box = $("transfers");
  if (!box) return;
  box.replaceChildren();
  for (const [name, t] of Object.entries(transfers)) {
    const row = el("div", {class: "transfer", "data-member": name});
    row.append(el("div", {class: "label"}, `weights to ${name}: ${transferText(t)}`));
    const bar = el("progress", {max: "1"});
    bar.value = t.state === "done" ? 1 : t.total_bytes ? Math.min(1, t.done_bytes / t.total_bytes) : 0;
    row.append(bar);
    box.append(row);
  }
}

// GET /status `load`: the head's slots and queue, every stage's requests and rows, the requests held
function drawLoad(st) {
  const load = st.load || {};
  const batches = (load.micro_batches || []).filter((n) => n > 0);
  const rows = batches.length ? `; micro-batches in flight: ${batches.join(" + ")} rows` : "";
  $("load-slots").textContent = load.slots ? `slots: ${load.active} of ${load.slots} busy, ${load.queued} queued `
    + `(at most ${load.max_queued} wait)${rows}` : "– (the head reports its queue once the session serves)";
  const ring = (st.plan && st.plan.ring) || Object.keys(load.stages || {});
  const stages = $("load-stages").querySelector("tbody");
  stages.replaceChildren(...ring.map((name) => {
    const s = (load.stages || {})[name] || {};
    const tr = el("tr", {"data-name": name});
    for (const [v, c] of [[name, "name"], [s.active, "active num"], [s.batch_rows, "rows num"], [s.steps, "steps num"]]) {
      tr.append(el("td", {class: c}, v === undefined || v === null ? "–" : String(v)));
    }
    return tr;
  }));
  const reqs = $("load-requests").querySelector("tbody");
  reqs.replaceChildren(...(load.requests || []).map((r) => {
    const tr = el("tr", {"data-id": r.id});
    const cells = [[r.id, "id"], [r.origin, "origin"], [r.state, "state"],
      [`${r.tokens} / ${r.max_tokens}`, "tokens num"], [fmt(r.tok_s, 1), "tok-s num"]];
    for (const [v, c] of cells) tr.append(el("td", {class: c}, String(v)));
    return tr;
  }));
}

async function poll() {
  try {
    const r = await fetch("/status", {cache: "no-store"});
    const st = await r.json();
    drawFigures(st);
    drawRing(st);
    drawMembers(st);
    drawLoad(st);
    drawHistory(st);
    document.body.dataset.updated = String(Date.now());
  } catch (err) {
    $("state").textContent = "unreachable";
    $("state").className = "badge degraded";
  } finally {
    setTimeout(poll, POLL_MS);
  }
}

// --- chat ---------------------------------------------------------------------------------

async function model() {
  if (modelId) return modelId;
  const r = await fetch("/v1/models", {cache: "no-store"});
  const body = await r.json();
  modelId = body.data && body.data.length ? body.data[0].id : null;
  return modelId;
}

async function send(prompt) {
  const log = $("log");
  log.append(el("div", {class: "msg user"}, prompt));
  const out = el("div", {class: "msg assistant", "data-done": "false", "data-chunks": "0"});
  const thinking = el("span", {class: "thinking meta"});  // a thinking model's thinking (reasoning_content)
  const text = el("span", {class: "text"});
  out.append(thinking, text);
  log.append(out);
  log.scrollTop = log.scrollHeight;
  const messages = history.concat([{role: "user", content: prompt}]);
  const req = {model: await model(), messages, stream: true, temperature: 0};
  const max = parseInt($("max-tokens").value, 10);
  if (max > 0) req.max_tokens = max;
  const started = performance.now();
  let chunks = 0, first = null;
  try {
    const r = await fetch("/v1/chat/completions", {method: "POST", headers: {"content-type": "application/json"},
                                                   body: JSON.stringify(req)});
    if (!r.ok) {
      const body = await r.json().catch(() => ({}));
      throw new Error((body.error && body.error.message) || `HTTP ${r.status}`);
    }
    const reader = r.body.getReader();
    const dec = new TextDecoder();
    let buf = "";
    for (;;) {
      const {value, done} = await reader.read();
      if (done) break;
      buf += dec.decode(value, {stream: true});
      let cut;
      while ((cut = buf.indexOf("\n\n")) >= 0) {
        const event = buf.slice(0, cut);
        buf = buf.slice(cut + 2);
        for (const line of event.split("\n")) {
          if (!line.startsWith("data: ")) continue;
          const data = line.slice(6);
          if (data === "[DONE]") continue;
          const chunk = JSON.parse(data);
          if (chunk.error) throw new Error(chunk.error.message);
          for (const c of chunk.choices || []) {
            const thought = c.delta && c.delta.reasoning_content;
            if (thought) thinking.textContent += thought;
            const piece = c.delta && c.delta.content;
            if (thought || piece) {
              text.textContent += piece || "";
              chunks += 1;
              first = first ?? performance.now();
              out.dataset.chunks = String(chunks);
              log.scrollTop = log.scrollHeight;
            }
          }
        }
      }
    }
    history = messages.concat([{role: "assistant", content: text.textContent}]);
    const ttft = first === null ? "–" : fmt(first - started, 0);
    out.append(el("span", {class: "meta"}, `${chunks} pieces, first after ${ttft} ms`));
  } catch (err) {
    out.classList.add("error");
    out.append(el("span", {class: "meta"}, String(err.message || err)));
  } finally {
    out.dataset.done = "true";
  }
}

function setup() {
  const form = $("chat-form"), prompt = $("prompt"), button = $("send");
  form.addEventListener("submit", async (ev) => {
    ev.preventDefault();
    const text = prompt.value.trim();
    if (!text || busy) return;
    busy = true;
    button.disabled = true;
    prompt.value = "";
    try { await send(text); } finally { busy = false; button.disabled = false; prompt.focus(); }
  });
  prompt.addEventListener("keydown", (ev) => {
    if (ev.key === "Enter" && !ev.shiftKey) { ev.preventDefault(); form.requestSubmit(); }
  });
  $("clear").addEventListener("click", () => { history = []; $("log").replaceChildren(); });
  poll();
}

document.addEventListener("DOMContentLoaded", setup);
