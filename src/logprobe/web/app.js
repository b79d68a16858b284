// logprobe playground: plain JavaScript over the public API (no build step, nothing fetched from
// elsewhere). Score: tokens coloured by surprisal, alternatives, charts, and (with two models served)
// their divergence at each token. Generate: a streamed continuation with alternatives and branching, and
// the token tree below the prompt (a collapsible list).
// Compare: several texts side by side, and several models (of any tokenizers) on one text. Lens: layers x positions. Patch: one position patched layer by layer.
"use strict";

const $ = (id) => document.getElementById(id);
const state = { model: null, bosId: null, score: null, gen: { tokens: [], prompt: "", controller: null } };
const LN2 = Math.log(2);

// ---- API --------------------------------------------------------------------------------------
function headers() {
  const h = { "Content-Type": "application/json" };
  const key = sessionStorage.getItem("logprobe-key");
  if (key) h["Authorization"] = "Bearer " + key;
  return h;
}

// The body of a response, or an Error with the server's message. A proxy in front of the server may answer
// an error with a page of HTML: then the error says the status instead of failing to parse it.
async function readJson(r) {
  const status = `${r.status} ${r.statusText}`.trim();
  const data = await r.json().catch(() => { throw new Error(status); });
  if (!r.ok) throw new Error((data.error && data.error.message) || status);
  return data;
}

async function api(path, body) {
  return readJson(await fetch(path, body === undefined ? { headers: headers() }
    : { method: "POST", headers: headers(), body: JSON.stringify(body) }));
}

async function* streamEvents(path, body, signal) {
  const r = await fetch(path, { method: "POST", headers: headers(), body: JSON.stringify(body), signal });
  if (!r.ok) await readJson(r);   // throws the server's error
  const reader = r.body.getReader(), decoder = new TextDecoder();
  let buffer = "";
  for (;;) {
    const { value, done } = await reader.read();
    if (done) return;
    buffer += decoder.decode(value, { stream: true });
    let cut;
    while ((cut = buffer.indexOf("\n\n")) >= 0) {
      const event = buffer.slice(0, cut); buffer = buffer.slice(cut + 2);
      if (!event.startsWith("data: ")) continue;
      const payload = event.slice(6);
      if (payload === "[DONE]") return;
      const data = JSON.parse(payload);
      if (data.error) throw new Error(data.error.message);
      yield data;
    }
  }
}

function setStatus(id, text, isError) {
  const el = $(id); el.textContent = text; el.classList.toggle("error", !!isError);
}

// ---- shared rendering -------------------------------------------------------------------------
const fmt = (x, d = 4) => (x === null || x === undefined ? "–" : Number(x).toFixed(d));
const bits = (lp) => -lp / LN2;
function surprisalColour(b) {            // 0 bits: green, 16+ bits: red
  const t = Math.max(0, Math.min(1, b / 16));
  return `hsl(${Math.round(120 * (1 - t))}, 75%, ${Math.round(86 - 6 * t)}%)`;
}
function visible(s) { return s.replace(/\n/g, "⏎\n").replace(/\t/g, "⇥"); }
function el(tag, attrs = {}, text) {
  const e = document.createElement(tag);
  for (const [k, v] of Object.entries(attrs)) e.setAttribute(k, v);
  if (text !== undefined) e.textContent = text;
  return e;
}

function sortedAlternatives(map) {
  return Object.entries(map || {}).sort((a, b) => b[1] - a[1]);
}

const tooltip = $("tooltip");
function showTooltip(anchor, info, onPick) {
  clearTimeout(hideTimer);
  tooltip.replaceChildren();
  tooltip.appendChild(el("div", { class: "head" }, JSON.stringify(info.token)));
  const facts = el("div", { class: "facts" });
  const parts = [`p = ${fmt(Math.exp(info.logprob))}`, `log p = ${fmt(info.logprob)}`,
    info.rank ? `rank ${info.rank}` : null, `${fmt(bits(info.logprob), 2)} bits`].filter(Boolean);
  parts.forEach((p) => facts.appendChild(el("span", {}, p)));
  tooltip.appendChild(facts);
  const table = el("table", { "aria-label": "Likeliest tokens at this position" });
  for (const [tok, lp] of sortedAlternatives(info.top)) {
    const tr = el("tr", tok === info.token ? { class: "own" } : {});
    const cell = el("td");
    if (onPick && tok !== info.token) {
      const b = el("button", { class: "alt", title: "Branch: continue with this token" }, JSON.stringify(tok));
      b.addEventListener("click", () => { hideTooltip(); onPick(tok, lp); });
      cell.appendChild(b);
    } else cell.textContent = JSON.stringify(tok);
    tr.append(cell, el("td", {}, fmt(Math.exp(lp))), el("td", {}, fmt(lp, 3)));
    table.appendChild(tr);
  }
  tooltip.appendChild(table);
  tooltip.hidden = false;
  placeTooltip(anchor);
}
const TIP_MARGIN = 8;              // px kept free between the tooltip and the viewport's edges
function placeTooltip(anchor) {
  // The layout viewport without scrollbars (what position: fixed is relative to); innerWidth counts a scrollbar.
  const vw = document.documentElement.clientWidth, vh = document.documentElement.clientHeight;
  tooltip.style.maxWidth = Math.max(0, Math.min(340, vw - 2 * TIP_MARGIN)) + "px";
  // Measure at the left edge: where the last tooltip stood, the width left to it would shrink this one.
  tooltip.style.left = "0px"; tooltip.style.top = "0px";
  const r = anchor.getBoundingClientRect();
  const w = tooltip.offsetWidth, h = tooltip.offsetHeight;
  const left = Math.max(0, Math.min(Math.max(TIP_MARGIN, r.left), vw - w - TIP_MARGIN));  // left >= 0, right <= vw
  let top = r.bottom + 6;
  if (top + h > vh) top = Math.max(TIP_MARGIN, r.top - h - 6);
  tooltip.style.left = left + "px"; tooltip.style.top = top + "px";
}
let hideTimer = null;
function hideTooltip() { clearTimeout(hideTimer); tooltip.hidden = true; }
function hideSoon() {              // leaves time to move the pointer onto the tooltip's buttons
  clearTimeout(hideTimer);
  hideTimer = setTimeout(() => { tooltip.hidden = true; }, 250);
}
tooltip.addEventListener("mouseenter", () => clearTimeout(hideTimer));
tooltip.addEventListener("mouseleave", hideSoon);
document.addEventListener("keydown", (e) => { if (e.key === "Escape") hideTooltip(); });

function tokenSpan(text, info, onPick, onSelect) {
  const span = el("span", { class: "tok", tabindex: "0", role: "button",
    "aria-label": `${JSON.stringify(info.token)}, log probability ${fmt(info.logprob, 3)}` });
  span.textContent = text === "" ? "▯" : visible(text);
  if (info.logprob !== null) span.style.background = surprisalColour(bits(info.logprob));
  const open = () => { if (info.logprob !== null) showTooltip(span, info, onPick); };
  span.addEventListener("mouseenter", open);
  span.addEventListener("focus", () => { open(); if (onSelect) onSelect(); });
  span.addEventListener("mouseleave", () => { if (document.activeElement !== span) hideSoon(); });
  span.addEventListener("blur", (e) => { if (!tooltip.contains(e.relatedTarget)) hideTooltip(); });
  span.addEventListener("click", () => { if (onSelect) onSelect(); open(); });
  span.addEventListener("keydown", (e) => {
    if (e.key === "Enter" && onPick) { const first = tooltip.querySelector("button.alt"); if (first) first.focus(); }
  });
  return span;
}

// ---- SVG charts -------------------------------------------------------------------------------
const SVG = "http://www.w3.org/2000/svg";
function svg(tag, attrs = {}, text) {
  const e = document.createElementNS(SVG, tag);
  for (const [k, v] of Object.entries(attrs)) e.setAttribute(k, v);
  if (text !== undefined) e.textContent = text;
  return e;
}

function lineChart(target, series, labels) {
  const W = 560, H = 220, L = 36, B = 22, T = 30;
  const all = series.flatMap((s) => s.values.filter((v) => v !== null));
  const max = Math.max(1, ...all);
  const n = labels.length, x = (i) => L + (n <= 1 ? 0 : (i * (W - L - 8)) / (n - 1));
  const y = (v) => T + (H - T - B) * (1 - v / max);
  const root = svg("svg", { viewBox: `0 0 ${W} ${H}`, role: "img", "aria-label": series.map((s) => s.name).join(" and ") + " per token" });
  for (let k = 0; k <= 4; k++) {
    const v = (max * k) / 4;
    root.append(svg("line", { x1: L, x2: W - 4, y1: y(v), y2: y(v), stroke: "#e3e6ee" }),
      svg("text", { x: 2, y: y(v) + 4 }, v.toFixed(1)));
  }
  series.forEach((s) => {
    const pts = s.values.map((v, i) => (v === null ? null : `${x(i)},${y(v)}`)).filter(Boolean).join(" ");
    root.append(svg("polyline", { points: pts, fill: "none", stroke: s.colour, "stroke-width": 2, "stroke-dasharray": s.dash || "" }));
    s.values.forEach((v, i) => { if (v !== null) root.append(svg("circle", { cx: x(i), cy: y(v), r: 3, fill: s.colour })); });
  });
  labels.forEach((lab, i) => { if (n <= 24 || i % Math.ceil(n / 24) === 0) root.append(svg("text", { x: x(i), y: H - 6, "text-anchor": "middle" }, lab.slice(0, 6))); });
  series.forEach((s, k) => root.append(svg("text", { x: L + 160 * k, y: 12, fill: s.colour }, "— " + s.name)));
  target.replaceChildren(root);
}

function barChart(target, alternatives) {
  // Probability and log probability of the k likeliest, side by side (seed 003's two views).
  const W = 560, rowH = 22, H = 28 + rowH * alternatives.length, mid = W / 2, labelW = 90;
  const root = svg("svg", { viewBox: `0 0 ${W} ${H}`, role: "img", "aria-label": "Probability and log probability of the likeliest tokens" });
  root.append(svg("text", { x: labelW, y: 14 }, "probability"), svg("text", { x: mid + labelW, y: 14 }, "log probability"));
  const minLp = Math.min(-1, ...alternatives.map((a) => a[1]));
  alternatives.forEach(([tok, lp], i) => {
    const yy = 22 + i * rowH, p = Math.exp(lp);
    const pw = (mid - labelW - 60) * p, lw = (mid - labelW - 60) * (lp / minLp);
    root.append(
      svg("text", { x: 2, y: yy + 14 }, JSON.stringify(tok).slice(0, 12)),
      svg("rect", { x: labelW, y: yy + 3, width: Math.max(1, pw), height: rowH - 8, fill: "navy" }),
      svg("text", { x: labelW + pw + 4, y: yy + 14 }, p.toFixed(3)),
      svg("text", { x: mid + 2, y: yy + 14 }, JSON.stringify(tok).slice(0, 12)),
      svg("rect", { x: mid + labelW, y: yy + 3, width: Math.max(1, lw), height: rowH - 8, fill: "darkgreen" }),
      svg("text", { x: mid + labelW + lw + 4, y: yy + 14 }, lp.toFixed(2)));
  });
  target.replaceChildren(root);
}

// ---- Score view -------------------------------------------------------------------------------
async function entropies(item) {            // entropy (bits) of each position's distribution, from the server
  const prompt = (state.bosId !== null ? [state.bosId] : []).concat(item.token_ids);
  const out = await api("/v1/completions", { model: state.model, prompt, max_tokens: 0, position_stats: true });
  const entropy = out.choices[0].position_stats.prompt.entropy;   // nats; null at position 0
  const offset = state.bosId !== null ? 1 : 0;
  return item.token_ids.map((_, i) => {
    const h = entropy[i + offset];
    return h === null || h === undefined ? null : h / LN2;
  });
}

async function divergenceFrom(item, other) {  // POST /v1/compare over the scored tokens, aligned with them
  const prompt = (state.bosId !== null ? [state.bosId] : []).concat(item.token_ids);
  const out = await api("/v1/compare", { models: [state.model, other], input: prompt });
  const offset = state.bosId !== null ? 1 : 0;
  const series = (name) => item.token_ids.map((_, i) => {
    const v = out.positions[name][i + offset];
    return v === null || v === undefined || v >= 9999 ? null : v / LN2;   // 9999.0 stands for infinity
  });
  return { out, js: series("js"), kl: series("kl_pq") };
}

async function showDivergence(item) {
  const other = $("score-vs").value, figure = $("score-divergence-figure");
  figure.hidden = true;
  if (!other || other === state.model) return;
  setStatus("score-status", `Comparing with ${other}…`);
  const { out, js, kl } = await divergenceFrom(item, other);
  figure.hidden = false;
  $("score-divergence-caption").textContent = `Divergence of ${other} from ${state.model} at each token (bits)`;
  lineChart($("score-divergence"), [
    { name: "KL(this‖other)", colour: "#8a3ffc", values: kl },
    { name: "Jensen–Shannon", colour: "#0b7a5c", dash: "5 4", values: js }], item.tokens);
  const s = out.summary;
  $("score-totals").appendChild(el("span", { id: "total-agreement" },
    s.top1_agreement === null ? "top-1 agreement –" : `top-1 agreement ${Math.round(100 * s.top1_agreement)}%`));
}

function selectScoreToken(i) {
  const item = state.score;
  document.querySelectorAll("#score-tokens .tok").forEach((s, j) => s.classList.toggle("selected", i === j));
  const top = item.top_logprobs ? item.top_logprobs[i] : null;
  $("score-bars-caption").textContent = `Top alternatives after ${JSON.stringify(item.text.slice(0, item.text_offset[i]).slice(-24))}`;
  if (top) barChart($("score-bars"), sortedAlternatives(top));
}

async function runScore() {
  const text = $("score-text").value, k = Number($("score-k").value) || 5;
  setStatus("score-status", "Scoring…");
  try {
    const out = await api("/v1/score", { model: state.model, input: text, top_logprobs: k });
    const item = { ...out.data[0], text };
    state.score = item;
    const box = $("score-tokens"); box.replaceChildren();
    item.tokens.forEach((tok, i) => {
      const end = i + 1 < item.tokens.length ? item.text_offset[i + 1] : text.length;
      const info = { token: tok, logprob: item.token_logprobs[i], rank: item.token_ranks[i],
        top: item.top_logprobs ? item.top_logprobs[i] : null };
      box.appendChild(tokenSpan(text.slice(item.text_offset[i], end), info, null, () => selectScoreToken(i)));
    });
    $("score-totals").replaceChildren(
      el("span", { id: "total-logprob" }, `log-likelihood ${fmt(item.logprob, 3)}`),
      el("span", { id: "total-ppl" }, `perplexity ${fmt(item.perplexity, 3)}`),
      el("span", { id: "total-tokens" }, `${item.num_tokens} tokens`));
    const series = [{ name: "surprisal (bits)", colour: "#b3261e", values: item.token_logprobs.map((lp) => (lp === null ? null : bits(lp))) }];
    if ($("score-entropy").checked) {
      setStatus("score-status", "Reading the entropy of each position…");
      series.push({ name: "entropy (bits)", colour: "#2857c5", dash: "5 4", values: await entropies(item) });
    }
    lineChart($("score-line"), series, item.tokens);
    selectScoreToken(item.tokens.length - 1);
    await showDivergence(item);
    setStatus("score-status", `Scored ${item.num_tokens} tokens.`);
  } catch (e) { setStatus("score-status", e.message, true); }
}

// ---- Generate view ----------------------------------------------------------------------------
function renderGeneration() {
  const g = state.gen, box = $("gen-tokens");
  $("gen-prefix").textContent = g.prompt;
  box.replaceChildren();
  g.tokens.forEach((t, i) => {
    const span = tokenSpan(t.text, t, (tok, lp) => branch(i, tok, lp));
    if (t.branched) span.style.outline = "2px dashed #2857c5";
    box.appendChild(span);
  });
}

function rankIn(top, token) {
  const i = sortedAlternatives(top).findIndex(([t]) => t === token);
  return i >= 0 ? i + 1 : null;
}

async function generate(prompt, keep) {
  const g = state.gen;
  if (g.controller) g.controller.abort();
  g.controller = new AbortController();
  g.prompt = $("gen-prompt").value;
  g.tokens = keep;
  renderGeneration();
  const seed = $("gen-seed").value;
  const body = { model: state.model, prompt, stream: true, max_tokens: Number($("gen-max").value) || 32,
    temperature: Number($("gen-temp").value), top_p: Number($("gen-top-p").value) || 1,
    logprobs: Number($("gen-k").value) || 5, logprobs_mode: $("gen-processed").checked ? "processed" : "raw" };
  if (seed !== "") body.seed = Number(seed);
  setStatus("gen-status", "Generating…");
  try {
    for await (const chunk of streamEvents("/v1/completions", body, g.controller.signal)) {
      const ch = chunk.choices[0], lp = ch.logprobs;
      if (!lp || !lp.tokens.length) continue;
      lp.tokens.forEach((tok, j) => {
        const text = lp.tokens.length === 1 ? ch.text : (tok.startsWith("bytes:") ? "" : tok);
        g.tokens.push({ token: tok, text, logprob: lp.token_logprobs[j], top: lp.top_logprobs[j],
          rank: rankIn(lp.top_logprobs[j], tok) });
      });
      renderGeneration();
      if (ch.finish_reason) setStatus("gen-status", `Done (${ch.finish_reason}), ${g.tokens.length} tokens.`);
    }
  } catch (e) {
    if (e.name !== "AbortError") setStatus("gen-status", e.message, true); else setStatus("gen-status", "Stopped.");
  } finally { g.controller = null; }
}

function branch(i, token, logprob) {
  const g = state.gen;
  const kept = g.tokens.slice(0, i);
  const top = g.tokens[i].top;
  const chosen = { token, text: token.startsWith("bytes:") ? "" : token, logprob, top, rank: rankIn(top, token), branched: true };
  const prompt = g.prompt + kept.map((t) => t.text).join("") + chosen.text;
  generate(prompt, kept.concat([chosen]));
}

// The token tree (POST /v1/tree) as nested <details>: a node's summary is its token, its probability and its
// path's; its children follow inside, the likeliest first. The first two levels start open.
function treeNode(tree, index) {
  const n = tree.nodes[index];
  const pct = (lp) => `${(100 * Math.exp(lp)).toFixed(lp > -4.6 ? 1 : 3)}%`;
  const label = el("span", { class: "tree-label" });
  label.append(el("span", { class: "tok tree-token" }, visible(n.token)), el("span", { class: "tree-p" }, pct(n.logprob)),
    el("span", { class: "tree-cum" }, `path ${pct(n.cumulative_logprob)}`));
  label.title = `rank ${n.rank}, processed ${pct(n.processed_logprob)}, entropy ${fmt(n.entropy / LN2, 2)} bits` +
    (n.is_stop ? ", end of text" : "");
  if (!n.children.length) {
    const leaf = el("div", { class: "tree-leaf" }); leaf.appendChild(label); return leaf;
  }
  const box = el("details", n.depth < 2 ? { open: "" } : {});
  const summary = el("summary"); summary.appendChild(label); box.appendChild(summary);
  const list = el("div", { class: "tree-children" });
  n.children.forEach((c) => list.appendChild(treeNode(tree, c)));
  box.appendChild(list);
  return box;
}

async function runTree() {
  const body = { model: state.model, prompt: $("gen-prompt").value, depth: Number($("tree-depth").value) || 3,
    branches: Number($("tree-branches").value) || 3, temperature: Number($("gen-temp").value),
    top_p: Number($("gen-top-p").value) || 1 };
  setStatus("tree-status", "Expanding…");
  $("tree").replaceChildren();
  try {
    const tree = await api("/v1/tree", body);
    tree.roots.forEach((r) => $("tree").appendChild(treeNode(tree, r)));
    setStatus("tree-status", `${tree.nodes.length} nodes, ${tree.usage.forward_tokens} tokens through the model.`);
  } catch (e) { setStatus("tree-status", e.message, true); }
}

// ---- Compare view -----------------------------------------------------------------------------
async function runCompare() {
  const texts = [...document.querySelectorAll(".compare-text")].map((t) => t.value).filter((t) => t.trim());
  if (texts.length < 2) { setStatus("compare-status", "Write at least two texts.", true); return; }
  setStatus("compare-status", "Scoring…");
  try {
    const out = await api("/v1/score", { model: state.model, input: texts });
    const best = out.data.reduce((b, d) => (d.mean_logprob > b.mean_logprob ? d : b), out.data[0]);
    const body = $("compare-table").tBodies[0]; body.replaceChildren();
    out.data.forEach((d, i) => {
      const tr = el("tr", d === best ? { class: "best" } : {});
      tr.append(el("td", {}, texts[i]), el("td", {}, fmt(d.logprob, 3)), el("td", {}, fmt(d.mean_logprob, 3)),
        el("td", {}, fmt(d.perplexity, 2)), el("td", {}, String(d.num_tokens)));
      body.appendChild(tr);
    });
    setStatus("compare-status", `Most natural: ${JSON.stringify(texts[out.data.indexOf(best)])}`);
  } catch (e) { setStatus("compare-status", e.message, true); }
}

// Several models on one text, aligned on the spans where all their tokenizations cut (POST /v1/compare, align "text").
const shortName = (name) => name.split("/").pop();
function differenceColour(d) {          // d in [-1, 1]: blue where the second model gives more, orange where less
  const a = Math.min(1, Math.abs(d)) * 0.6;
  return d >= 0 ? `rgba(40, 87, 197, ${a.toFixed(3)})` : `rgba(230, 120, 20, ${a.toFixed(3)})`;
}

function spanFacts(out, i) {
  return out.models.map((m, k) => `${shortName(m)}: ${fmt(out.spans.logprobs[i][k], 3)} (${out.spans.num_tokens[i][k]} tokens)`);
}

async function runModels() {
  const text = $("models-text").value;
  const models = [...document.querySelectorAll("#models-pick input:checked")].map((c) => c.value);
  if (models.length < 2) { setStatus("models-status", "Choose at least two models.", true); return; }
  if (!text) { setStatus("models-status", "Write a text.", true); return; }
  setStatus("models-status", "Reading the text with each model…");
  try {
    const out = await api("/v1/compare", { models, input: text, align: "text" });
    const s = out.summary, diff = out.spans.difference.map((row) => row[0]);
    $("models-totals").replaceChildren(...out.models.map((m, k) => el("span", { class: "bpb" },
      `${shortName(m)}: ${fmt(s.bits_per_byte[k], 3)} bits per byte, ${s.num_tokens[k]} tokens`)));
    const scale = Math.max(1e-9, ...diff.map(Math.abs)), spans = $("models-spans");
    spans.replaceChildren();
    out.spans.text.forEach((t, i) => {
      const node = el("span", { class: "tok span", tabindex: "0", "data-span": String(i),
        title: spanFacts(out, i).join("\n") }, visible(t));
      node.style.background = differenceColour(diff[i] / scale);
      spans.appendChild(node);
    });
    const table = $("models-table"), head = el("tr");
    head.append(el("th", {}, "Span"), ...out.models.map((m) => el("th", {}, `log prob, ${shortName(m)}`)),
      el("th", {}, "Spread"));
    table.tHead.replaceChildren(head);
    table.tBodies[0].replaceChildren(...out.disagreements.map((i) => {
      const tr = el("tr", { "data-span": String(i) });
      tr.append(el("td", { class: "mono" }, visible(JSON.stringify(out.spans.text[i]))),
        ...out.spans.logprobs[i].map((lp) => el("td", {}, fmt(lp, 3))), el("td", {}, fmt(out.spans.spread[i], 3)));
      return tr;
    }));
    const top = out.disagreements.length ? JSON.stringify(out.spans.text[out.disagreements[0]]) : "–";
    setStatus("models-status", `${s.num_spans} spans over ${s.num_bytes} bytes; they disagree most on ${top}.`);
  } catch (e) { setStatus("models-status", e.message, true); }
}

// ---- Lens view --------------------------------------------------------------------------------
// The served model's card and every n-th of its layers (n from the input `stepId`), the last one always.
async function everyNthLayer(stepId) {
  const card = await api(`/v1/models/${encodeURIComponent(state.model)}`);
  const step = Math.max(1, Number($(stepId).value) || 1), layers = [];
  for (let l = 0; l < card.num_layers; l += step) layers.push(l);
  layers.push(card.num_layers);
  return { card, layers };
}

async function runLens() {
  const text = $("lens-text").value;
  if (!text.trim()) { setStatus("lens-status", "Write a text.", true); return; }
  setStatus("lens-status", "Reading the layers…");
  try {
    const { card, layers } = await everyNthLayer("lens-step");
    const out = await api("/v1/completions", { model: state.model, prompt: text, max_tokens: 0,
      output_lens: { layers, top_k: 3 } });
    const lens = out.choices[0].logit_lens;
    const table = $("lens-table"); table.replaceChildren();
    const head = el("tr", {}); head.appendChild(el("th", { scope: "col" }, "layer"));
    lens.tokens.forEach((t) => head.appendChild(el("th", { scope: "col" }, visible(t))));
    table.appendChild(el("thead")).appendChild(head);
    const body = table.appendChild(el("tbody"));
    for (const entry of [...lens.layers].reverse()) {   // the model's own distribution on top
      const tr = el("tr", {});
      tr.appendChild(el("th", { scope: "row" }, entry.layer === card.num_layers ? `${entry.layer} (out)` : String(entry.layer)));
      entry.logprobs.forEach((lp, i) => {
        if (lp === null) { tr.appendChild(el("td", { class: "lens-cell" }, "")); return; }
        const p = Math.exp(lp), before = entry.top_tokens[i] || [];   // the likeliest tokens after token i - 1
        const title = `layer ${entry.layer}, token ${JSON.stringify(lens.tokens[i])}: p = ${fmt(p)}, rank ${entry.ranks[i]}; ` +
          `likeliest: ${before.map((t, j) => `${JSON.stringify(t)} ${fmt(Math.exp(entry.top_logprobs[i][j]), 3)}`).join(", ")}`;
        const td = el("td", { class: "lens-cell", title, "data-p": p.toFixed(6) }, visible(before[0] || ""));
        td.style.background = `rgba(40, 87, 197, ${Math.min(1, 0.08 + p)})`;
        td.style.color = p > 0.5 ? "white" : "black";
        tr.appendChild(td);
      });
      body.appendChild(tr);
    }
    setStatus("lens-status", `Read ${lens.layers.length} layers at ${lens.tokens.length} positions.`);
  } catch (e) { setStatus("lens-status", e.message, true); }
}

// ---- Patch view -------------------------------------------------------------------------------
async function runPatch() {
  const text = $("patch-text").value, source = $("patch-source").value;
  if (!text.trim() || !source.trim()) { setStatus("patch-status", "Write a text and a source.", true); return; }
  setStatus("patch-status", "Patching…");
  try {
    const { layers } = await everyNthLayer("patch-step");
    const body = $("patch-table").querySelector("tbody"); body.replaceChildren();
    for (const layer of layers) {         // one request a layer: each is its own forward pass
      const out = await api("/v1/completions", { model: state.model, prompt: text, max_tokens: 1, temperature: 0,
        logprobs: 1, return_unmodified: true,
        interventions: [{ layer, op: "patch", positions: [-1], source: { prompt: source, position: -1 } }] });
      const c = out.choices[0], un = c.unmodified;
      const p = Math.exp(c.logprobs.token_logprobs[0]), q = Math.exp(un.logprobs[un.logprobs.length - 1]);
      const bar = el("td", {}), track = bar.appendChild(el("div", { class: "patch-track" }));
      track.appendChild(el("div", { class: "patch-bar" })).style.width = `${(100 * p).toFixed(1)}%`;
      const tr = el("tr", { "data-layer": String(layer), "data-p": p.toFixed(6), "data-q": q.toFixed(6) });
      tr.append(el("th", { scope: "row" }, String(layer)), el("td", { class: "mono" }, visible(JSON.stringify(c.text))),
        el("td", {}, fmt(p)), el("td", {}, fmt(q)), bar);
      body.appendChild(tr);
    }
    setStatus("patch-status", `Patched ${layers.length} layers.`);
  } catch (e) { setStatus("patch-status", e.message, true); }
}

// ---- set-up -----------------------------------------------------------------------------------
function showView(name) {
  for (const v of ["score", "generate", "compare", "lens", "patch"]) {
    $("view-" + v).hidden = v !== name;
    $("tab-" + v).setAttribute("aria-selected", String(v === name));
  }
  hideTooltip();
}

// The select says what it waits for: a placeholder option while /v1/models is asked, the reason beside it
// when that fails (on every tab, since the model list belongs to all of them).
function modelPlaceholder(text) {
  const sel = $("model");
  sel.replaceChildren(el("option", { value: "", disabled: "", selected: "" }, text));
  sel.disabled = true;
  state.model = null;
}

function modelHint(text) {
  const hint = $("model-hint");
  hint.textContent = text || ""; hint.hidden = !text; hint.classList.toggle("error", !!text);
}

async function loadModels() {
  modelPlaceholder("loading models…");
  modelHint("");
  let models;
  try {
    models = await api("/v1/models");
  } catch (e) {
    modelPlaceholder("no models");
    modelHint("Cannot load the models: " + e.message);
    return;
  }
  if (!models.data.length) { modelPlaceholder("no models"); modelHint("The server serves no model."); return; }
  const sel = $("model"); sel.replaceChildren();
  for (const m of models.data) sel.appendChild(el("option", { value: m.id }, m.id));
  sel.disabled = false;
  state.model = sel.value;
  const vs = $("score-vs");             // a second model to compare with, when the server has one
  vs.replaceChildren(el("option", { value: "" }, "(none)"));
  for (const m of models.data) vs.appendChild(el("option", { value: m.id }, m.id));
  $("score-vs-label").hidden = models.data.length < 2;
  const pick = $("models-pick");        // the models compared on one text: the first two ticked
  pick.replaceChildren(el("legend", {}, "Models"));
  models.data.forEach((m, i) => {
    const box = el("input", { type: "checkbox", value: m.id });
    box.checked = i < 2;
    const label = el("label", {}); label.append(box, " " + m.id); pick.appendChild(label);
  });
  try {
    state.bosId = (await api("/tokenizer_info")).bos_token_id;
    setStatus("score-status", "Ready.");
  } catch (e) { setStatus("score-status", "Cannot read the tokenizer: " + e.message, true); }
}

$("api-key").value = sessionStorage.getItem("logprobe-key") || "";
$("api-key").addEventListener("change", (e) => { sessionStorage.setItem("logprobe-key", e.target.value); loadModels(); });
$("model").addEventListener("change", (e) => { state.model = e.target.value; });
["score", "generate", "compare", "lens", "patch"].forEach((v) => $("tab-" + v).addEventListener("click", () => showView(v)));
$("lens-run").addEventListener("click", runLens);
$("patch-run").addEventListener("click", runPatch);
$("score-run").addEventListener("click", runScore);
$("gen-run").addEventListener("click", () => generate($("gen-prompt").value, []));
$("gen-stop").addEventListener("click", () => { if (state.gen.controller) state.gen.controller.abort(); });
$("tree-run").addEventListener("click", runTree);
$("compare-add").addEventListener("click", () => {
  const n = document.querySelectorAll(".compare-text").length + 1;
  $("compare-inputs").appendChild(el("textarea", { class: "compare-text", rows: "2", "aria-label": `Text ${n}` }));
});
$("compare-run").addEventListener("click", runCompare);
$("models-run").addEventListener("click", runModels);
loadModels();
