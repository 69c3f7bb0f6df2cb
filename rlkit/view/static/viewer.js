// rlkit view: the page over one run folder. Data comes from /api/* (rlkit/view/run_data.py);
// the Steps charts are uPlot's, the Engines timeline is drawn on one canvas (10,000s of
// requests stay responsive: no DOM node per request). Polls the run while it writes.
"use strict";

const state = { page: null, overview: null, steps: null, timeline: null, groups: null,
                modified: null, view: null, sampleIndex: 0, charts: [] };
const $ = (id) => document.getElementById(id);

async function api(what) {
  const r = await fetch("/api/" + what, { credentials: "same-origin" });
  if (!r.ok) throw new Error(`/api/${what}: ${r.status} ${await r.text()}`);
  return r.json();
}

function showError(e) { $("error").textContent = String(e && e.stack || e); }
function fmt(v, digits = 3) {
  if (v === null || v === undefined || Number.isNaN(v)) return "-";
  if (typeof v !== "number") return String(v);
  return Math.abs(v) >= 1000 || Number.isInteger(v) ? v.toLocaleString("en") : v.toPrecision(digits);
}
function el(tag, attrs = {}, ...children) {
  const e = document.createElement(tag);
  for (const [k, v] of Object.entries(attrs)) {
    if (k === "class") e.className = v; else if (k === "style") e.style.cssText = v;
    else if (k.startsWith("on")) e.addEventListener(k.slice(2), v); else e.setAttribute(k, v);
  }
  for (const c of children) e.append(c instanceof Node ? c : document.createTextNode(String(c)));
  return e;
}

// ---- pages -------------------------------------------------------------------------------
const PAGES = { steps: showSteps, engines: showEngines, groups: showGroups, advice: showAdvice, recipe: showRecipe };

async function route() {
  const page = (location.hash || "#steps").slice(1).split("/")[0];
  state.page = PAGES[page] ? page : "steps";
  for (const a of document.querySelectorAll("header nav a")) a.classList.toggle("active", a.dataset.page === state.page);
  for (const s of document.querySelectorAll(".page")) s.classList.toggle("active", s.id === "page-" + state.page);
  try { await PAGES[state.page](); $("error").textContent = ""; } catch (e) { showError(e); }
}

async function refreshOverview() {
  const o = await api("overview");
  state.overview = o;
  $("run-name").textContent = o.name;
  $("run-meta").textContent = `${o.source === "sim" ? "simulated" : "real"} run · ${o.steps} steps` +
    (o.num_steps ? ` of ${o.num_steps}` : "") + (o.mode ? ` · ${o.mode}` : "") + (o.policy ? ` · ${o.policy}` : "");
  document.title = `rlkit view: ${o.name}`;
  const changed = state.modified !== null && o.modified !== state.modified;
  state.modified = o.modified;
  const age = Date.now() / 1000 - o.modified;
  $("live").textContent = age < 30 ? "● live" : `last write ${new Date(o.modified * 1000).toLocaleString()}`;
  return changed;
}

// Steps: one uPlot chart per panel, x = step.
const PALETTE = ["#1976d2", "#e65100", "#2e7d32", "#6a1b9a", "#c62828", "#00838f", "#5d4037", "#9e9d24"];
async function showSteps(force) {
  if (!state.steps || force) state.steps = await api("steps");
  const { rows, panels } = state.steps;
  $("steps-recipe").textContent = state.overview ? state.overview.recipe || "(no recipe.yaml)" : "";
  const box = $("step-panels");
  for (const c of state.charts) c.destroy();
  state.charts = [];
  box.replaceChildren();
  if (!rows.length) { box.append(el("div", { class: "empty" }, "no steps yet")); return; }
  const xs = rows.map((r) => r.step);
  for (const p of panels) {
    const div = el("div", { class: "panel", "data-panel": p.title }, el("h4", {}, p.title));
    box.append(div);
    const data = [xs, ...p.series.map((k) => rows.map((r) => (k in r ? r[k] : null)))];
    const width = Math.max(300, div.clientWidth - 12);
    const opts = {
      width, height: 200, legend: { live: true },
      scales: { x: { time: false } },
      axes: [{ label: "step" }, {}],
      series: [{ label: "step" }, ...p.series.map((k, i) => ({ label: k, stroke: PALETTE[i % PALETTE.length], width: 1.5, spanGaps: true, points: { size: 4 } }))],
    };
    state.charts.push(new uPlot(opts, data, div));
  }
}

// Engines: a lane per engine (its requests packed in rows), the trainer's phases below, step
// windows behind; pan and zoom in time.
const LABEL_W = 170, TRAINER_H = 26, AXIS_H = 22, LANE_GAP = 6;
async function showEngines(force) {
  if (!state.timeline || force) {
    state.timeline = await api("timeline");
    const sel = $("engine-step");
    const keep = sel.value;
    sel.replaceChildren(el("option", { value: "all" }, "all"));
    for (const s of state.timeline.steps) sel.append(el("option", { value: String(s.step) }, `${s.step}${s.round ? " (" + s.round + ")" : ""}`));
    sel.value = [...sel.options].some((o) => o.value === keep) ? keep : "all";
    if (!state.view) resetView();
    drawLegend();
  }
  drawEngines();
}

function resetView() {
  const tl = state.timeline;
  const sel = $("engine-step").value;
  const s = tl.steps.find((x) => String(x.step) === sel);
  state.view = s ? { t0: s.start, t1: Math.max(s.end, s.start + 1e-3) } : { t0: tl.t0, t1: Math.max(tl.t1, tl.t0 + 1e-3) };
}

function drawLegend() {
  const tl = state.timeline, box = $("engine-legend");
  box.replaceChildren();
  for (const name of tl.outcome_names) {
    const o = tl.outcomes[name] || { colour: "#777", label: name };
    box.append(el("span", { "data-outcome": name }, el("i", { style: `background:${o.colour}` }), o.label));
  }
  box.append(el("span", {}, el("i", { style: "background:#fff;border:2px solid #263238;box-sizing:border-box" }), "resumed a partial response"));
  box.append(el("span", {}, el("i", { style: "background:#ddd" }), "queued at the engine"));
  for (const [n, c] of Object.entries(tl.phase_colours)) if (tl.phases.some((p) => p.name === n)) box.append(el("span", {}, el("i", { style: `background:${c}` }), `trainer: ${n}`));
  if (tl.compare) box.append(el("span", {}, el("i", { style: "background:#000;height:2px" }), "compared run: requests running"));
}

function laneLayout() {
  const tl = state.timeline;
  const lanes = [];
  let y = AXIS_H;
  tl.workers.forEach((w, i) => {
    const rows = Math.max(1, tl.rows_per_lane[i]);
    const h = Math.max(22, Math.min(160, rows * 4));
    lanes.push({ name: w, y, h, rows });
    y += h + LANE_GAP;
  });
  return { lanes, trainerY: y, height: y + TRAINER_H + 6 };
}

function drawEngines() {
  const tl = state.timeline, canvas = $("engine-canvas");
  const { lanes, trainerY, height } = laneLayout();
  const dpr = window.devicePixelRatio || 1;
  const width = canvas.parentElement.clientWidth;
  canvas.width = width * dpr; canvas.height = height * dpr;
  canvas.style.height = height + "px";
  const ctx = canvas.getContext("2d");
  ctx.setTransform(dpr, 0, 0, dpr, 0, 0);
  ctx.clearRect(0, 0, width, height);
  const { t0, t1 } = state.view;
  const plotW = width - LABEL_W - 8;
  const X = (t) => LABEL_W + ((t - t0) / (t1 - t0)) * plotW;
  state.geom = { X, T: (x) => t0 + ((x - LABEL_W) / plotW) * (t1 - t0), lanes, trainerY, plotW };
  // step windows behind everything: long rounds tinted, a label on the axis
  ctx.font = "11px system-ui, sans-serif";
  tl.steps.forEach((s, i) => {
    const a = X(s.start), b = X(s.end);
    if (b < LABEL_W || a > width) return;
    ctx.fillStyle = s.round === "long" ? "#fdf3e1" : (i % 2 ? "#f7f9fb" : "#ffffff");
    ctx.fillRect(Math.max(a, LABEL_W), AXIS_H, Math.min(b, width) - Math.max(a, LABEL_W), trainerY - AXIS_H);
    ctx.fillStyle = "#555";
    if (b - a > 30) ctx.fillText(`step ${s.step}${s.round ? " " + s.round : ""}`, Math.max(a, LABEL_W) + 3, 14);
  });
  // trainer phases as bands across the lanes (sync and sleep stop generation) and in their lane
  for (const p of tl.phases) {
    const a = X(p.start), b = X(p.end);
    if (b < LABEL_W || a > width) continue;
    const colour = tl.phase_colours[p.name] || "#aaa";
    ctx.globalAlpha = p.name === "train" ? 0.08 : 0.18;
    ctx.fillStyle = colour;
    ctx.fillRect(Math.max(a, LABEL_W), AXIS_H, Math.max(1, b - Math.max(a, LABEL_W)), trainerY - AXIS_H);
    ctx.globalAlpha = 1;
    ctx.fillRect(Math.max(a, LABEL_W), trainerY + 3, Math.max(1, b - Math.max(a, LABEL_W)), TRAINER_H - 6);
  }
  // requests
  const sp = tl.spans, n = sp.lane.length;
  const colours = tl.outcome_names.map((o) => (tl.outcomes[o] || { colour: "#777" }).colour);
  for (let i = 0; i < n; i++) {
    const e = sp.end[i], s = sp.start[i];
    if (e < t0 || s > t1) continue;
    const lane = lanes[sp.lane[i]], rowH = lane.h / lane.rows;
    const y = lane.y + sp.row[i] * rowH, h = Math.max(1, rowH * 0.85);
    const run = sp.admitted[i] !== null && sp.admitted[i] > s ? sp.admitted[i] : s;
    if (run > s) { ctx.fillStyle = "#dddddd"; ctx.fillRect(X(s), y, Math.max(0.5, X(run) - X(s)), h); }
    const a = Math.max(X(run), LABEL_W), b = X(e);
    ctx.fillStyle = colours[sp.outcome[i]];
    ctx.fillRect(a, y, Math.max(0.5, b - a), h);
    if (sp.resumed[i] > 0 && h >= 3) { ctx.fillStyle = "#263238"; ctx.fillRect(a, y, Math.max(0.5, b - a), Math.max(1, h * 0.3)); }
  }
  // the compared run (the simulator's prediction): requests running per lane, as a step curve
  if (tl.compare) {
    ctx.strokeStyle = "#000"; ctx.lineWidth = 1.2;
    for (const [laneIdx, curve] of Object.entries(tl.compare.lanes)) {
      const lane = lanes[Number(laneIdx)];
      if (!lane || !curve.length) continue;
      const top = Math.max(lane.rows, ...curve.map((c) => c[1]));
      ctx.beginPath();
      let prevY = lane.y + lane.h;
      ctx.moveTo(X(curve[0][0]), prevY);
      for (const [t, running] of curve) {
        const y = lane.y + lane.h - (running / top) * lane.h;
        ctx.lineTo(X(t), prevY); ctx.lineTo(X(t), y); prevY = y;
      }
      ctx.stroke();
    }
  }
  // labels, separators, axis
  ctx.fillStyle = "#fff"; ctx.fillRect(0, 0, LABEL_W, height);
  ctx.fillStyle = "#222"; ctx.strokeStyle = "#ccc"; ctx.lineWidth = 1;
  for (const lane of lanes) {
    ctx.fillText(shortName(lane.name), 6, lane.y + Math.min(lane.h / 2 + 4, 14));
    ctx.fillStyle = "#888"; ctx.fillText(`${lane.rows} max running`, 6, lane.y + Math.min(lane.h / 2 + 4, 14) + 12); ctx.fillStyle = "#222";
    ctx.beginPath(); ctx.moveTo(0, lane.y + lane.h + LANE_GAP / 2); ctx.lineTo(width, lane.y + lane.h + LANE_GAP / 2); ctx.stroke();
  }
  ctx.fillText("trainer", 6, trainerY + 17);
  ctx.fillStyle = "#555";
  const ticks = 8;
  for (let k = 0; k <= ticks; k++) {
    const t = t0 + ((t1 - t0) * k) / ticks;
    const x = X(t);
    ctx.fillText(`${(t - tl.t0).toFixed(t1 - t0 < 5 ? 2 : 1)} s`, Math.min(x, width - 50), height - 2 < trainerY + TRAINER_H ? height - 2 : trainerY + TRAINER_H + 4);
  }
  const shown = sp.start.filter((s, i) => sp.end[i] >= t0 && s <= t1).length;
  $("engine-summary").textContent = `${n.toLocaleString("en")} requests on ${lanes.length} lanes; ${shown.toLocaleString("en")} in view`;
  canvas.dataset.lanes = String(tl.workers.filter((w) => !w.startsWith("frozen:")).length);
  canvas.dataset.drawn = String(shown);
}

function shortName(w) { return w.length > 26 ? "…" + w.slice(-25) : w; }

function hitTest(x, y) {
  const g = state.geom, tl = state.timeline;
  if (!g || x < LABEL_W) return null;
  const t = g.T(x);
  if (y >= g.trainerY) {
    const p = tl.phases.find((q) => q.start <= t && t <= q.end);
    return p ? `trainer: ${p.name} (step ${p.step})\n${(p.end - p.start).toFixed(3)} s` : null;
  }
  const laneIdx = g.lanes.findIndex((l) => y >= l.y && y < l.y + l.h);
  if (laneIdx < 0) return null;
  const lane = g.lanes[laneIdx], row = Math.floor(((y - lane.y) / lane.h) * lane.rows);
  const sp = tl.spans, slack = (2 * (state.view.t1 - state.view.t0)) / g.plotW;
  for (let i = 0; i < sp.lane.length; i++) {
    if (sp.lane[i] === laneIdx && sp.row[i] === row && sp.start[i] - slack <= t && t <= sp.end[i] + slack) {
      const o = tl.outcome_names[sp.outcome[i]];
      return `${lane.name}\nstep ${sp.step[i]}, group ${sp.group[i]}, sample ${sp.sample[i]}\n` +
        `${(tl.outcomes[o] || { label: o }).label}: ${sp.tokens[i]} tokens in ${(sp.end[i] - sp.start[i]).toFixed(3)} s` +
        (sp.resumed[i] ? `\nresumed from ${sp.resumed[i]} tokens` : "") +
        (sp.admitted[i] !== null ? `\nqueued ${(sp.admitted[i] - sp.start[i]).toFixed(3)} s` : "");
    }
  }
  return null;
}

function wireEngines() {
  const canvas = $("engine-canvas"), tip = $("engine-tip");
  let drag = null;
  canvas.addEventListener("wheel", (ev) => {
    if (!state.view || !state.geom) return;
    ev.preventDefault();
    const t = state.geom.T(ev.offsetX), k = ev.deltaY > 0 ? 1.25 : 0.8;
    state.view = { t0: t - (t - state.view.t0) * k, t1: t + (state.view.t1 - t) * k };
    drawEngines();
  }, { passive: false });
  canvas.addEventListener("mousedown", (ev) => { drag = { x: ev.offsetX, view: { ...state.view } }; });
  window.addEventListener("mouseup", () => { drag = null; });
  canvas.addEventListener("mousemove", (ev) => {
    if (drag && state.geom) {
      const dt = ((ev.offsetX - drag.x) / state.geom.plotW) * (drag.view.t1 - drag.view.t0);
      state.view = { t0: drag.view.t0 - dt, t1: drag.view.t1 - dt };
      drawEngines();
      return;
    }
    const text = hitTest(ev.offsetX, ev.offsetY);
    tip.style.display = text ? "block" : "none";
    if (text) { tip.textContent = text; tip.style.left = ev.offsetX + 14 + "px"; tip.style.top = ev.offsetY + 10 + "px"; }
  });
  canvas.addEventListener("mouseleave", () => { tip.style.display = "none"; });
  canvas.addEventListener("dblclick", () => { $("engine-step").value = "all"; resetView(); drawEngines(); });
  $("engine-step").addEventListener("change", () => { resetView(); drawEngines(); });
  $("engine-reset").addEventListener("click", () => { $("engine-step").value = "all"; resetView(); drawEngines(); });
  window.addEventListener("resize", () => { if (state.page === "engines" && state.timeline) drawEngines(); });
}

// Groups and samples of one step.
async function showGroups(force, step) {
  const want = step !== undefined ? step : (state.groups ? state.groups.step : "");
  if (!state.groups || force || step !== undefined) {
    state.groups = await api("groups" + (want !== "" && want !== null ? `?step=${want}` : ""));
    if (step !== undefined) state.sampleIndex = 0;
  }
  const g = state.groups;
  const sel = $("group-step");
  sel.replaceChildren(...g.steps.map((s) => el("option", { value: String(s) }, String(s))));
  sel.value = String(g.step);
  const kept = g.groups.filter((x) => x.kept).length;
  $("group-summary").textContent = `${kept} groups trained, ${g.groups.length - kept} dropped; ${g.samples.length} samples saved`;
  const body = $("group-table").tBodies[0];
  body.replaceChildren();
  for (const x of g.groups) {
    const first = g.samples.findIndex((s) => s.group_id === x.group_id);
    const tr = el("tr", { class: (x.kept ? "" : "dropped ") + (first >= 0 ? "clickable" : ""), "data-group": String(x.group_id) },
      el("td", {}, x.group_id), el("td", {}, x.source_index ?? "-"),
      el("td", {}, x.kept ? (x.zero_variance ? "yes (zero variance)" : "yes") : String(x.dropped)),
      el("td", {}, (x.rewards || []).map((r) => fmt(r, 2)).join(" ")),
      el("td", {}, (x.lengths || []).join(" ")),
      el("td", {}, x.mixed ?? "-"), el("td", {}, x.max_lag ?? "-"),
      el("td", {}, first >= 0 ? "show" : ""));
    if (first >= 0) tr.addEventListener("click", () => { state.sampleIndex = first; drawSample(); });
    body.append(tr);
  }
  drawSample();
}

const VERSION_COLOURS = ["#bbdefb", "#ffe0b2", "#c8e6c9", "#e1bee7", "#ffcdd2", "#b2ebf2", "#d7ccc8", "#f0f4c3"];
function drawSample() {
  const g = state.groups, box = $("sample-tokens");
  const samples = g.samples;
  if (!samples.length) {
    $("sample-pos").textContent = "no samples saved for this step (tracking.samples_per_step)";
    $("sample-meta").textContent = ""; $("sample-group-rewards").replaceChildren(); $("sample-prompt").textContent = "";
    box.replaceChildren(); $("sample-legend").replaceChildren();
    return;
  }
  state.sampleIndex = Math.max(0, Math.min(state.sampleIndex, samples.length - 1));
  const s = samples[state.sampleIndex];
  const same = samples.filter((x) => x.group_id === s.group_id);
  $("sample-pos").textContent = `sample ${state.sampleIndex + 1} of ${samples.length} saved (group ${s.group_id}: ${same.indexOf(s) + 1} of ${same.length} saved)`;
  for (const tr of $("group-table").tBodies[0].rows) tr.classList.toggle("selected", tr.dataset.group === String(s.group_id));
  const versions = [...new Set(s.versions)];
  $("sample-meta").textContent = `group ${s.group_id}, sample ${s.sample_index} (slot ${s.slot}) · reward ${fmt(s.reward)} · ${s.ids.length} tokens, ` +
    `${s.finish_reason || s.status} · versions ${versions.join(", ")} · ${s.requests} request(s), ${s.resumes} resume(s) · prompt ${s.prompt_tokens} tokens`;
  $("sample-group-rewards").replaceChildren(el("span", {}, "group rewards: "),
    ...s.group_rewards.map((r, i) => el("span", { class: "reward-chip" + (s.group_slots[i] === s.slot ? " current" : "") }, fmt(r, 2))));
  $("sample-prompt").textContent = s.prompt;
  const mode = $("sample-colour").value;
  const legend = $("sample-legend");
  legend.replaceChildren();
  let colour;
  if (mode === "version") {
    colour = (i) => VERSION_COLOURS[versions.indexOf(s.versions[i]) % VERSION_COLOURS.length];
    versions.forEach((v, k) => legend.append(el("span", {}, el("i", { style: `background:${VERSION_COLOURS[k % VERSION_COLOURS.length]}` }), `version ${v}`)));
  } else if (mode === "mask") {
    colour = (i) => (s.loss_mask[i] ? "#c8e6c9" : "#eeeeee");
    legend.append(el("span", {}, el("i", { style: "background:#c8e6c9" }), "model token (trained)"), el("span", {}, el("i", { style: "background:#eeeeee" }), "observation (masked)"));
  } else if (mode === "logprob") {
    colour = (i) => heat(Math.min(1, -s.logprobs[i] / 5));
    legend.append(el("span", {}, el("i", { style: `background:${heat(0)}` }), "logprob 0"), el("span", {}, el("i", { style: `background:${heat(1)}` }), "logprob ≤ -5"));
  } else if (mode === "trainer") {
    // the engine's against the trainer's logprob of the same token: numerics, or a bug
    const t = s.trainer_logprobs;
    const scale = (d) => Math.max(0, Math.min(1, (Math.log10(Math.max(d, 1e-9)) + 6) / 5));
    colour = t ? (i) => heat(scale(Math.abs(s.logprobs[i] - t[i]))) : () => "transparent";
    if (t) {
      const worst = Math.max(...s.logprobs.map((x, i) => Math.abs(x - t[i])));
      legend.append(el("span", {}, el("i", { style: `background:${heat(0)}` }), "|Δ| ≤ 1e-6"),
        el("span", {}, el("i", { style: `background:${heat(1)}` }), "|Δ| ≥ 0.1"), el("span", {}, `max |Δ| ${worst.toExponential(1)}`));
    } else legend.append(el("span", {}, "no trainer logprobs for this sample"));
  } else {
    const t = s.teacher_logprobs;
    colour = t ? (i) => heat(Math.min(1, Math.abs(s.logprobs[i] - t[i]) / 2)) : () => "transparent";
    legend.append(t ? el("span", {}, el("i", { style: `background:${heat(1)}` }), "|Δ| ≥ 2 nats") : el("span", {}, "no teacher logprobs in this run"));
  }
  const frag = document.createDocumentFragment();
  s.tokens.forEach((text, i) => {
    frag.append(el("span", { style: `background:${colour(i)}`, title: `#${i} id ${s.ids[i]} · v${s.versions[i]} · logprob ${fmt(s.logprobs[i])}` +
      (s.trainer_logprobs ? ` · trainer ${fmt(s.trainer_logprobs[i], 6)}` : "") +
      (s.teacher_logprobs ? ` · teacher ${fmt(s.teacher_logprobs[i])}` : "") + (s.loss_mask[i] ? "" : " · observation") }, text));
  });
  box.replaceChildren(frag);
}

function heat(x) { // 0: pale, 1: strong red
  const a = Math.max(0, Math.min(1, x));
  return `rgba(229, 57, 53, ${0.08 + 0.72 * a})`;
}

function wireGroups() {
  const step = (d) => {
    const g = state.groups; if (!g) return;
    const i = g.steps.indexOf(g.step) + d;
    if (i >= 0 && i < g.steps.length) showGroups(true, g.steps[i]).catch(showError);
  };
  $("group-prev-step").addEventListener("click", () => step(-1));
  $("group-next-step").addEventListener("click", () => step(1));
  $("group-step").addEventListener("change", (ev) => showGroups(true, Number(ev.target.value)).catch(showError));
  $("sample-prev").addEventListener("click", () => { state.sampleIndex--; drawSample(); });
  $("sample-next").addEventListener("click", () => { state.sampleIndex++; drawSample(); });
  $("sample-colour").addEventListener("change", drawSample);
}

async function showAdvice() {
  const list = await api("advice"), box = $("advice-list");
  box.replaceChildren();
  if (!list.length) box.append(el("div", { class: "empty" }, "Nothing to say: no rule found a problem in this run."));
  for (const a of list) box.append(el("div", { class: "advice " + a.level, "data-rule": a.rule }, el("b", {}, a.rule), el("p", {}, a.message), el("div", { class: "evidence" }, a.evidence)));
}

async function showRecipe() {
  const o = state.overview || (await api("overview"));
  $("recipe-text").textContent = o.recipe || "(no recipe.yaml: a simulator run)";
  $("run-files").replaceChildren(el("h3", {}, "files"), ...o.files.map((f) => el("div", {}, el("a", { href: "/run/" + encodeURIComponent(f) }, f))));
}

// ---- live: the run may still be writing ---------------------------------------------------
async function poll() {
  try {
    if (await refreshOverview()) {
      state.steps = state.timeline = null;
      if (state.page === "groups") state.groups = null;
      await PAGES[state.page](true);
    }
  } catch (e) { showError(e); }
}

window.addEventListener("hashchange", route);
wireEngines();
wireGroups();
refreshOverview().then(route).catch(showError);
setInterval(poll, 5000);
