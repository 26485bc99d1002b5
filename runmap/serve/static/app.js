// The page of `runmap serve`: plain JavaScript over the server's own endpoints (no build step, no library).
// Chat streams /v1/chat/completions (server-sent events read from fetch's body stream); the Engine tab polls
// /api/info and /api/telemetry; the IFEval tab drives /api/ifeval/*; the Campaigns tab shows /api/campaigns/*.
"use strict";

const $ = (id) => document.getElementById(id);
const state = { model: null, history: [], abort: null, toks: [], info: null };

function fmtBytes(n) {
  if (n === null || n === undefined) return "–";
  const u = ["B", "KiB", "MiB", "GiB", "TiB"];
  let i = 0;
  while (n >= 1024 && i < u.length - 1) { n /= 1024; i++; }
  return `${n.toFixed(i ? 2 : 0)} ${u[i]}`;
}
const pct = (x) => (x === null || x === undefined ? "–" : `${(100 * x).toFixed(2)} %`);
function el(tag, attrs = {}, text) {
  const e = document.createElement(tag);
  for (const [k, v] of Object.entries(attrs)) e.setAttribute(k, v);
  if (text !== undefined) e.textContent = text;
  return e;
}
async function getJSON(url, opts) {
  const r = await fetch(url, opts);
  const body = await r.json().catch(() => ({}));
  if (!r.ok) throw new Error((body.error && body.error.message) || `${r.status} ${r.statusText}`);
  return body;
}

// ---- tabs ----------------------------------------------------------------------------------------------
for (const b of document.querySelectorAll(".tab")) {
  b.addEventListener("click", () => {
    document.querySelectorAll(".tab").forEach((t) => t.classList.toggle("active", t === b));
    document.querySelectorAll(".pane").forEach((p) => p.classList.toggle("active", p.id === `pane-${b.dataset.tab}`));
    if (b.dataset.tab === "campaigns") loadCampaigns();
    if (b.dataset.tab === "ifeval") pollIfeval();
  });
}

// ---- chat ----------------------------------------------------------------------------------------------
function addMessage(role, text) {
  const m = el("div", { class: `msg ${role}` }, text);
  $("messages").appendChild(m);
  $("messages").scrollTop = $("messages").scrollHeight;
  return m;
}

async function sendChat(text) {
  if (!state.model) { addMessage("error", "the server is not ready yet"); return; }
  state.history.push({ role: "user", content: text });
  addMessage("user", text);
  const out = addMessage("assistant streaming", "");
  out.dataset.chunks = "0";
  $("chat-send").disabled = true;
  $("chat-stop").disabled = false;
  state.abort = new AbortController();
  const t0 = performance.now();
  let first = null, answer = "", usage = null, finish = null;
  try {
    const r = await fetch("/v1/chat/completions", {
      method: "POST", headers: { "Content-Type": "application/json" }, signal: state.abort.signal,
      body: JSON.stringify({
        model: state.model, messages: state.history, stream: true, stream_options: { include_usage: true },
        max_tokens: parseInt($("chat-max-tokens").value, 10) || 256,
        temperature: parseFloat($("chat-temperature").value) || 0,
      }),
    });
    if (!r.ok) {
      const body = await r.json().catch(() => ({}));
      throw new Error((body.error && body.error.message) || `${r.status}`);
    }
    const reader = r.body.getReader();
    const dec = new TextDecoder();
    let buf = "";
    for (;;) {
      const { value, done } = await reader.read();
      if (done) break;
      buf += dec.decode(value, { stream: true });
      let cut;
      while ((cut = buf.indexOf("\n\n")) >= 0) {
        const event = buf.slice(0, cut);
        buf = buf.slice(cut + 2);
        for (const line of event.split("\n")) {
          if (!line.startsWith("data: ")) continue;
          const data = line.slice(6);
          if (data === "[DONE]") continue;
          const obj = JSON.parse(data);
          if (obj.error) throw new Error(obj.error.message);
          if (obj.usage) usage = obj.usage;
          for (const c of obj.choices || []) {
            if (c.delta && c.delta.content) {
              if (first === null) first = performance.now();
              answer += c.delta.content;
              out.textContent = answer;
              out.dataset.chunks = String(parseInt(out.dataset.chunks, 10) + 1);
              $("messages").scrollTop = $("messages").scrollHeight;
            }
            if (c.finish_reason) finish = c.finish_reason;
          }
        }
      }
    }
    state.history.push({ role: "assistant", content: answer });
    const dt = (performance.now() - t0) / 1000;
    const n = usage ? usage.completion_tokens : null;
    $("chat-stats").textContent = `${n ?? "?"} tokens in ${dt.toFixed(2)} s` +
      (first !== null ? `, first token after ${((first - t0) / 1000).toFixed(2)} s` : "") +
      (n && first !== null && n > 1 ? `, ${((n - 1) / ((performance.now() - first) / 1000)).toFixed(1)} tok/s` : "") +
      (finish ? `; finish: ${finish}` : "");
  } catch (e) {
    if (e.name === "AbortError") {
      $("chat-stats").textContent = "stopped";
      state.history.push({ role: "assistant", content: answer });
    } else {
      out.classList.add("error");
      out.textContent = (answer ? answer + "\n" : "") + `error: ${e.message}`;
      state.history.pop();
    }
  } finally {
    out.classList.remove("streaming");
    out.dataset.done = "1";
    $("chat-send").disabled = false;
    $("chat-stop").disabled = true;
    state.abort = null;
  }
}

$("chat-form").addEventListener("submit", (ev) => {
  ev.preventDefault();
  const text = $("chat-input").value.trim();
  if (!text || state.abort) return;
  $("chat-input").value = "";
  sendChat(text);
});
$("chat-input").addEventListener("keydown", (ev) => {
  if (ev.key === "Enter" && !ev.shiftKey) { ev.preventDefault(); $("chat-form").requestSubmit(); }
});
$("chat-stop").addEventListener("click", () => state.abort && state.abort.abort());
$("chat-clear").addEventListener("click", () => { state.history = []; $("messages").textContent = ""; $("chat-stats").textContent = ""; });

// ---- engine: what is loaded, live telemetry -----------------------------------------------------------
function renderInfo(info) {
  const t = $("info-table");
  t.textContent = "";
  const m = info.memory || {};
  const rows = [
    ["model", info.model], ["architecture", info.arch], ["pack", info.pack], ["executor", info.executor],
    ["expert format", info.expert_format],
    ["regime", `${info.regime} (${info.resident} of ${info.num_experts} experts per layer resident, top-${info.top_k})`],
    ["device", `${info.device}${info.cuda_graphs ? ", CUDA graphs" : ""}`],
    ["fused ops", (info.fused || []).join(", ") || "none"], ["eviction policy", info.policy ?? "–"],
    ["max batch / context", `${info.max_batch} rows / ${info.max_seq_len} tokens`],
    ["load / warm-up", `${(info.load_s ?? 0).toFixed(1)} s / ${(info.warmup_s ?? 0).toFixed(1)} s`],
    ["non-routed weights", fmtBytes(m.nonrouted_bytes)], ["KV cache", fmtBytes(m.kv_cache_bytes)],
    ["resident expert rows", fmtBytes(m.resident_bytes)], ["spare rows / staging", `${fmtBytes(m.spare_bytes)} / ${fmtBytes(m.staging_bytes)}`],
  ];
  for (const [k, v] of rows) {
    const tr = el("tr");
    tr.appendChild(el("td", {}, k));
    tr.appendChild(el("td", {}, String(v)));
    t.appendChild(tr);
  }
  const bars = $("resident-bars");
  bars.textContent = "";
  (info.resident_per_layer || []).forEach((r, l) => {
    const d = el("div", { title: `layer ${l}: ${r}/${info.num_experts}` });
    d.style.height = `${Math.max(4, (56 * r) / info.num_experts)}px`;
    d.appendChild(el("span", {}, String(r)));
    bars.appendChild(d);
  });
}

function drawToks() {
  const c = $("toks-plot");
  const g = c.getContext("2d");
  g.clearRect(0, 0, c.width, c.height);
  const pts = state.toks;
  const max = Math.max(1, ...pts);
  g.strokeStyle = "#2f6fdb";
  g.lineWidth = 2;
  g.beginPath();
  pts.forEach((v, i) => {
    const x = (i / Math.max(1, 179)) * (c.width - 10) + 5;
    const y = c.height - 8 - (v / max) * (c.height - 24);
    i ? g.lineTo(x, y) : g.moveTo(x, y);
  });
  g.stroke();
  g.fillStyle = "#6b7280";
  g.font = "12px sans-serif";
  g.fillText(`tok/s, last ${pts.length} s (max ${max.toFixed(1)})`, 8, 14);
}

function renderLive(t) {
  $("live-toks").textContent = (t.tok_s ?? 0).toFixed(1);
  $("live-queue").textContent = `${t.running ?? 0} / ${t.waiting ?? 0}`;
  $("live-hit").textContent = pct(t.hit_rate);
  $("live-h2d").textContent = fmtBytes(t.bytes_h2d ?? 0);
  const tot = t.totals || {};
  $("live-totals").textContent = `${tot.requests ?? 0} / ${tot.generated_tokens ?? 0}`;
  $("live-joined").textContent = String((t.batch || {}).joined_running ?? 0);
  const body = $("obs-table").querySelector("tbody");
  body.textContent = "";
  for (const [name, o] of Object.entries(t.observations || {})) {
    const tr = el("tr");
    tr.appendChild(el("td", {}, name));
    tr.appendChild(el("td", { class: `status-${o.status}` }, o.status));
    tr.appendChild(el("td", {}, o.status === "OBSERVED" ? String(o.value) : (o.reason || "–")));
    tr.appendChild(el("td", {}, o.unit || ""));
    body.appendChild(tr);
  }
  state.toks.push(t.tok_s ?? 0);
  if (state.toks.length > 180) state.toks.shift();
  drawToks();
}

async function poll() {
  try {
    const t = await getJSON("/api/telemetry");
    const b = $("phase");
    b.textContent = t.phase;
    b.className = `badge ${t.phase}`;
    if (t.phase === "ready" && !state.model) {
      state.info = await getJSON("/api/info");
      state.model = state.info.model;
      $("model-name").textContent = `${state.info.model} · ${state.info.executor} · ${state.info.regime}`;
      renderInfo(state.info);
    }
    if (t.phase === "failed") $("model-name").textContent = t.error || "failed";
    renderLive(t);
  } catch (e) {
    $("phase").textContent = "offline";
    $("phase").className = "badge failed";
  }
}

// ---- IFEval ------------------------------------------------------------------------------------------
function renderScore(summary) {
  $("ifeval-score").hidden = !summary;
  if (!summary) return;
  const body = $("ifeval-score-table").querySelector("tbody");
  body.textContent = "";
  for (const level of ["prompt_level", "instruction_level"]) {
    const tr = el("tr");
    tr.appendChild(el("td", {}, level.replace("_", "-")));
    for (const mode of ["strict", "loose"]) {
      const a = summary[level][mode];
      tr.appendChild(el("td", {}, `${pct(a.accuracy)} (${a.followed}/${a.total})`));
    }
    body.appendChild(tr);
  }
  const bd = $("ifeval-breakdown").querySelector("tbody");
  bd.textContent = "";
  for (const [iid, c] of Object.entries(summary.by_instruction || {})) {
    const tr = el("tr");
    tr.appendChild(el("td", {}, iid));
    tr.appendChild(el("td", {}, String(c.total)));
    tr.appendChild(el("td", {}, `${pct(c.strict.accuracy)} (${c.strict.followed})`));
    tr.appendChild(el("td", {}, `${pct(c.loose.accuracy)} (${c.loose.followed})`));
    bd.appendChild(tr);
  }
}

let ifevalTimer = null;
async function pollIfeval() {
  try {
    const s = await getJSON("/api/ifeval");
    const j = s.job;
    $("ifeval-dir").textContent = s.dir;
    const p = j.progress ?? 0;
    $("ifeval-bar").style.width = `${(100 * p).toFixed(1)}%`;
    $("ifeval-progress-text").textContent = j.total ? `${j.answered}/${j.total} prompts (${(100 * p).toFixed(0)} %)` : "idle";
    $("ifeval-state").textContent = j.state === "idle" ? "no run started" :
      `run ${j.name}: ${j.state}` + (j.resumed_from ? ` (resumed with ${j.resumed_from} answered)` : "") +
      (j.error ? ` — ${j.error}` : "") + (j.dir ? ` — ${j.dir}` : "");
    $("ifeval-state").dataset.state = j.state;
    renderScore(j.state === "done" ? j.summary : null);
    const body = $("ifeval-runs").querySelector("tbody");
    body.textContent = "";
    for (const r of s.runs) {
      const tr = el("tr");
      tr.appendChild(el("td", {}, r.name));
      tr.appendChild(el("td", {}, r.status ?? "–"));
      tr.appendChild(el("td", {}, r.prompts ? `${r.answered}/${r.prompts}` : "–"));
      tr.appendChild(el("td", {}, r.scored ? "yes" : "no"));
      body.appendChild(tr);
    }
    const busy = ["running", "stopping", "scoring"].includes(j.state);
    $("ifeval-start").disabled = busy;
    $("ifeval-stop").disabled = !busy;
    clearTimeout(ifevalTimer);
    if (busy) ifevalTimer = setTimeout(pollIfeval, 500);
  } catch (e) {
    $("ifeval-state").textContent = `error: ${e.message}`;
  }
}

$("ifeval-limit").addEventListener("focus", () => { $("ifeval-subset-first").checked = true; });
$("ifeval-form").addEventListener("submit", async (ev) => {
  ev.preventDefault();
  const first = document.querySelector('input[name="ifeval-subset"]:checked').value === "first";
  const body = { max_new_tokens: parseInt($("ifeval-max-new").value, 10) || 1280 };
  if (first) body.limit = parseInt($("ifeval-limit").value, 10);
  if ($("ifeval-name").value.trim()) body.name = $("ifeval-name").value.trim();
  try {
    await getJSON("/api/ifeval/start", { method: "POST", headers: { "Content-Type": "application/json" }, body: JSON.stringify(body) });
  } catch (e) {
    $("ifeval-state").textContent = `error: ${e.message}`;
    return;
  }
  pollIfeval();
});
$("ifeval-stop").addEventListener("click", async () => {
  await getJSON("/api/ifeval/stop", { method: "POST" }).catch(() => {});
  pollIfeval();
});

// ---- campaigns ---------------------------------------------------------------------------------------
async function loadCampaigns() {
  try {
    const s = await getJSON("/api/campaigns");
    $("campaign-roots").textContent = `from ${s.roots.join(", ")}`;
    const sel = $("campaign-select");
    const keep = sel.value;
    sel.textContent = "";
    for (const c of s.campaigns) sel.appendChild(el("option", { value: c.name }, `${c.name} (${c.records} records)`));
    if (!s.campaigns.length) { $("campaign-report").textContent = "no campaign with records/ under these folders"; return; }
    if (keep) sel.value = keep;
    showCampaign(sel.value);
  } catch (e) {
    $("campaign-report").textContent = `error: ${e.message}`;
  }
}
async function showCampaign(name) {
  $("campaign-report").textContent = "rendering…";
  try {
    const r = await getJSON(`/api/campaigns/${encodeURIComponent(name)}`);
    $("campaign-report").innerHTML = r.html; // rendered by the server from the records (raw HTML in Markdown is off)
  } catch (e) {
    $("campaign-report").textContent = `error: ${e.message}`;
  }
}
$("campaign-select").addEventListener("change", (ev) => showCampaign(ev.target.value));

poll();
setInterval(poll, 1000);
