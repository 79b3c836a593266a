// SpecInfer live viewer: streams POST /v1/completions with draft trees and draws every verifier
// step. A step's tree: the root is the last token before the step, draft nodes are coloured by the
// speculators that proposed them, the accepted path is outlined in green and the LLM's bonus token
// hangs below the last accepted node. Plain DOM and hand-drawn SVG; no libraries, no network
// beyond the gateway itself.
'use strict';

const SVG_NS = 'http://www.w3.org/2000/svg';
const PALETTE = ['#4e79a7', '#f28e2b', '#76b7b2', '#e15759', '#b07aa1', '#edc948', '#9c755f', '#ff9da7'];
const GREEN = '#2e9d4f';
const TREE = {charW: 7.85, pad: 14, gap: 28, row: 28, box: 21, margin: 14, header: 18, maxChars: 12, minScale: 0.75};
const $ = id => document.getElementById(id);

let server = null;  // this gateway's model entry from GET /v1/models
let run = null;     // the request in flight or the last one
let shown = null;   // the step number pinned in the large view; null follows the latest
let legendFor = 0;  // speculators in the legend: the server's count, or more if the trees show more

// ---------------------------------------------------------------- small helpers

function make(ns, tag, attrs = {}, ...children) {
  const e = ns ? document.createElementNS(ns, tag) : document.createElement(tag);
  for (const [k, v] of Object.entries(attrs)) {
    if (v !== null && v !== undefined) e.setAttribute(k, v);
  }
  e.append(...children);
  return e;
}
const svg = (tag, attrs, ...children) => make(SVG_NS, tag, attrs, ...children);
const html = (tag, attrs, ...children) => make(null, tag, attrs, ...children);

/** Whitespace made visible: ␣ space, ⏎ newline, ⇥ tab; ∅ for an empty token. */
function visible(text) {
  return text.replace(/ /g, '␣').replace(/\n/g, '⏎').replace(/\t/g, '⇥').replace(/\r/g, '␍') || '∅';
}

function shortLabel(text) {
  const v = visible(text);
  return v.length > TREE.maxChars ? v.slice(0, TREE.maxChars - 1) + '…' : v;
}

/** hex colour mixed with white: amount 0 keeps it, 1 gives white. */
function tint(hex, amount) {
  const c = [1, 3, 5].map(i => parseInt(hex.slice(i, i + 2), 16));
  return '#' + c.map(v => Math.round(v + (255 - v) * amount).toString(16).padStart(2, '0')).join('');
}

const bits = mask => [...Array(31).keys()].filter(s => mask & (1 << s));

/** Tints for the speculators in a node's bitmask (bit s: speculator s proposed it). */
function tints(mask) {
  const who = bits(mask);
  return who.length ? who.map(s => tint(PALETTE[s % PALETTE.length], 0.68)) : ['#eeeeee'];
}

/** SVG fill: one tint, or side-by-side stripes (a gradient in the page's shared defs). */
function svgFill(mask) {
  const cols = tints(mask);
  if (cols.length === 1) return cols[0];
  const id = `spec-mask-${mask}`;
  if (!document.getElementById(id)) {
    const grad = svg('linearGradient', {id, x1: 0, x2: 1, y1: 0, y2: 0});
    cols.forEach((color, k) => grad.append(svg('stop', {offset: k / cols.length, 'stop-color': color}),
                                           svg('stop', {offset: (k + 1) / cols.length, 'stop-color': color})));
    $('shared-defs').append(grad);
  }
  return `url(#${id})`;
}

/** The same fill as a CSS background. */
function cssFill(mask) {
  const cols = tints(mask);
  if (cols.length === 1) return cols[0];
  return `linear-gradient(90deg, ${cols.map((c, k) => `${c} ${100 * k / cols.length}% ${100 * (k + 1) / cols.length}%`).join(', ')})`;
}

function maskStroke(mask) {
  const who = bits(mask);
  return who.length === 1 ? PALETTE[who[0] % PALETTE.length] : '#6f6a86';
}

const fmt = (x, digits) => (x === null || !isFinite(x)) ? '–' : String(Number(x.toFixed(digits)));

function setFigure(id, value, digits) {
  $(id).textContent = fmt(value, digits);
  $(id).dataset.value = value === null ? '' : value;
}

// ---------------------------------------------------------------- the gateway

function authHeaders() {
  const token = $('token').value.trim();
  return token ? {Authorization: `Bearer ${token}`} : {};
}

async function errorMessage(response) {
  const body = await response.text();
  try {
    return `${response.status}: ${JSON.parse(body).error.message}`;
  } catch {
    return `${response.status} ${response.statusText}: ${body.slice(0, 300)}`;
  }
}

async function loadModels() {
  try {
    const response = await fetch('/v1/models', {headers: authHeaders()});
    if (!response.ok) throw new Error(await errorMessage(response));
    server = (await response.json()).data[0];
    const s = server.specinfer || {};
    $('server').textContent = `${server.id} · default expansion ${(s.expansion || []).join(',') || '–'}` +
      ` · tree budget ${s.tree_budget ?? '–'} · ${s.speculators ?? 0} speculators`;
    $('speculation').options[0].textContent = `server default (${(s.expansion || []).join(',') || 'none'})`;
    drawLegend((s.speculators || 0) + (s.context_lookup_mask ? 1 : 0));
    if ($('chat').disabled && s.chat_template) $('chat').checked = true;  // first contact: chat where the model has it
    $('chat').disabled = !s.chat_template;
    if (!s.chat_template) $('chat').checked = false;
    if ($('error').dataset.source === 'models') showError('');
  } catch (e) {
    server = null;
    $('server').textContent = 'not connected';
    showError(`GET /v1/models: ${e.message}`, 'models');
  }
}

/** POST the request and call onEvent with each data event's JSON until [DONE]. */
async function streamCompletion(body, onEvent, signal) {
  const response = await fetch(body.messages ? '/v1/chat/completions' : '/v1/completions', {
    method: 'POST', signal, body: JSON.stringify(body),
    headers: {'Content-Type': 'application/json', Accept: 'text/event-stream', ...authHeaders()},
  });
  if (!response.ok) throw new Error(await errorMessage(response));
  const reader = response.body.getReader();
  const decoder = new TextDecoder();
  let buffer = '';
  for (;;) {
    const {value, done} = await reader.read();
    if (done) throw new Error('the stream ended without [DONE]');
    buffer = (buffer + decoder.decode(value, {stream: true})).replace(/\r\n/g, '\n');
    let cut;
    while ((cut = buffer.indexOf('\n\n')) >= 0) {
      const data = buffer.slice(0, cut).split('\n')
        .filter(line => line.startsWith('data:')).map(line => line.slice(5).trim()).join('\n');
      buffer = buffer.slice(cut + 2);
      if (!data) continue;
      if (data === '[DONE]') return;
      const event = JSON.parse(data);
      if (event.error) throw new Error(event.error.message);
      onEvent(event);
    }
  }
}

function requestBody() {
  const body = {
    model: server.id, prompt: $('prompt').value, max_tokens: Number($('max-tokens').value),
    temperature: Number($('temperature').value), top_p: 1, seed: Number($('seed').value),
    stream: true, stream_options: {include_usage: true}, return_draft_trees: true,
  };
  if ($('chat').checked) {
    body.messages = [{role: 'user', content: body.prompt}];
    delete body.prompt;
  }
  const mode = $('speculation').value;
  if (mode === 'off') body.speculation = 'off';
  if (mode === 'fixed') {
    const ks = $('expansion').value.split(',').map(k => k.trim());
    if (!ks.every(k => /^[1-9]\d*$/.test(k))) throw new Error('expansion: positive integers separated by commas, e.g. 2,2,1,1');
    body.speculation = ks.join(',');
  }
  return body;
}

// ---------------------------------------------------------------- one run

function newRun(prompt) {
  run = {steps: [], started: performance.now(), ended: null, usage: null, active: true,
         reached: [], offered: [], drafted: [], hit: [], controller: new AbortController()};
  shown = null;
  $('prompt-echo').textContent = prompt;
  $('completion').replaceChildren();
  $('steps').replaceChildren();
  $('tree').replaceChildren(html('p', {class: 'empty'}, 'waiting for the first step…'));
  $('summary').textContent = '';
  $('follow').hidden = true;
  updateFigures();
  drawLegend(0);
}

/** One verifier step's event → a step record, drawn everywhere. */
function addStep(choice) {
  const tree = choice.draft_tree || {token_ids: [], token_texts: [], parents: [], speculators: [], accepted: []};
  const ids = choice.token_ids || [];
  const texts = choice.token_texts || ids.map(String);
  const previous = run.steps[run.steps.length - 1];
  const step = {
    n: run.steps.length + 1, tree, ids, texts, text: choice.text ?? choice.delta?.content ?? '', finish: choice.finish_reason,
    bonus: ids.length > tree.accepted.length ? texts[tree.accepted.length] : null,
    root: previous ? previous.texts[previous.texts.length - 1] ?? '' : null,
  };
  run.steps.push(step);

  // each drafter's own acceptance: its nodes, and of those the accepted ones (bit s of a node's mask)
  tree.speculators.forEach((mask, u) => {
    for (let s = 0; mask >> s; s++) {
      if (!((mask >> s) & 1)) continue;
      run.drafted[s] = (run.drafted[s] || 0) + 1;
      run.hit[s] = (run.hit[s] || 0) + (tree.accepted.includes(u) ? 1 : 0);
    }
  });
  drawLegend(Math.max(0, ...tree.speculators.map(mask => 32 - Math.clz32(mask))));
  const depths = nodeDepths(tree.parents);
  const deepest = Math.max(0, ...depths);
  for (let d = 1; d <= deepest; d++) {
    run.offered[d] = (run.offered[d] || 0) + 1;
    run.reached[d] = (run.reached[d] || 0) + (tree.accepted.length >= d ? 1 : 0);
  }

  if (step.text) {
    const segment = html('span', {class: `segment s${step.n % 2}`, 'data-step': step.n, title: `step ${step.n}`}, step.text);
    segment.addEventListener('click', () => show(step.n));
    $('completion').append(segment);
    $('text').scrollTop = $('text').scrollHeight;
  }
  $('steps').prepend(stepRow(step, deepest));
  if (shown === null) drawLarge(step);
  updateFigures();
}

/** Accepted draft tokens this step emitted: all of them, unless the step was cut short. */
function emittedDrafts(step) {
  return Math.min(step.tree.accepted.length, step.ids.length);
}

function nodeDepths(parents) {
  const depth = [];
  parents.forEach((p, i) => { depth[i] = p < 0 ? 1 : depth[p] + 1; });
  return depth;
}

function finish(usage) {
  run.usage = usage;
  const s = usage.speculation || {};
  const parts = [`${usage.prompt_tokens} prompt + ${usage.completion_tokens} completion tokens`,
                 `${s.verifier_steps ?? '–'} verifier steps (${s.tree_steps ?? 0} with a tree)`,
                 `${s.accepted_draft_tokens ?? 0} accepted draft tokens`];
  $('summary').textContent = parts.join(' · ') + '.';
  if (s.no_tree_reason) {
    $('summary').append(html('br'), html('span', {class: 'note'}, `No trees: ${s.no_tree_reason}`));
  }
}

async function generate(ev) {
  ev.preventDefault();
  if (run && run.active) return;
  if (!server) await loadModels();
  if (!server) return;
  let body;
  try {
    body = requestBody();
  } catch (e) {
    showError(e.message);
    return;
  }
  showError('');
  newRun(body.prompt ?? body.messages[0].content);
  setStatus('running', 'streaming…');
  try {
    await streamCompletion(body, event => {
      if (event.usage) finish(event.usage);
      for (const choice of event.choices || []) addStep(choice);
    }, run.controller.signal);
    const reason = run.steps.length ? run.steps[run.steps.length - 1].finish : null;
    setStatus('done', `done${reason ? ` (${reason})` : ''}`);
    loadModels();  // the server's figures (e.g. speculators that joined since) may have changed
  } catch (e) {
    if (e.name === 'AbortError') {
      setStatus('stopped', 'stopped');
    } else {
      showError(e.message);
      setStatus('error', 'failed');
    }
  } finally {
    run.active = false;
    run.ended = performance.now();
    updateFigures();
  }
}

// ---------------------------------------------------------------- figures

function updateFigures() {
  const steps = run ? run.steps : [];
  const tokens = steps.reduce((sum, s) => sum + s.ids.length, 0);
  const later = steps.slice(1);
  const completion = run && run.usage ? run.usage.completion_tokens : tokens;
  const seconds = run ? ((run.ended ?? performance.now()) - run.started) / 1000 : 0;
  setFigure('fig-steps', steps.length ? steps.length : null, 0);
  setFigure('fig-tokens', steps.length ? completion : null, 0);
  setFigure('fig-rate', steps.length && seconds > 0 ? completion / seconds : null, 1);
  setFigure('fig-tps', later.length ? later.reduce((sum, s) => sum + s.ids.length, 0) / later.length : null, 2);
  setFigure('fig-last', steps.length ? steps[steps.length - 1].ids.length : null, 0);
  setFigure('fig-accepted', steps.length ? steps.reduce((sum, s) => sum + s.tree.accepted.length, 0) : null, 0);
  drawDepthChart();
  drawStepChart(steps);
}

function drawDepthChart() {
  const offered = run ? run.offered : [];
  const depths = offered.length - 1;
  const W = 320, H = 92, top = 14, bottom = 16;
  const chart = svg('svg', {viewBox: `0 0 ${W} ${H}`, class: 'depth-chart'});
  if (depths < 1) {
    chart.append(svg('text', {x: W / 2, y: H / 2, class: 'axis', 'text-anchor': 'middle'}, 'no trees yet'));
  }
  const slot = W / Math.max(depths, 8);
  for (let d = 1; d <= depths; d++) {
    const rate = run.reached[d] / offered[d];
    const x = (d - 1) * slot + slot * 0.15, w = slot * 0.7, h = (H - top - bottom) * rate;
    chart.append(
      svg('rect', {x, y: top, width: w, height: H - top - bottom, class: 'track', rx: 2}),
      svg('rect', {x, y: H - bottom - h, width: w, height: h, class: 'bar', rx: 2, 'data-depth': d, 'data-rate': rate},
          svg('title', {}, `depth ${d}: ${run.reached[d]} / ${offered[d]} steps`)),
      svg('text', {x: x + w / 2, y: H - bottom - h - 3, class: 'value', 'text-anchor': 'middle'}, Math.round(100 * rate)),
      svg('text', {x: x + w / 2, y: H - 4, class: 'axis', 'text-anchor': 'middle'}, d));
  }
  $('depth-chart').replaceChildren(chart);
}

function drawStepChart(steps) {
  const W = 320, H = 70, shownSteps = steps.slice(-64);
  const most = Math.max(4, ...shownSteps.map(s => s.ids.length));
  const slot = W / Math.max(shownSteps.length, 32), unit = (H - 12) / most;
  const chart = svg('svg', {viewBox: `0 0 ${W} ${H}`, class: 'step-chart'});
  for (let t = 1; t <= most; t++) {
    chart.append(svg('line', {x1: 0, x2: W, y1: H - t * unit, y2: H - t * unit, class: 'grid'}));
  }
  shownSteps.forEach((s, k) => {
    const x = k * slot + 1, w = Math.max(slot - 2, 1), drafts = emittedDrafts(s), bonus = s.ids.length - drafts;
    const group = svg('g', {'data-step': s.n}, svg('title', {}, `step ${s.n}: ${drafts} accepted + ${bonus} bonus`),
      svg('rect', {x, y: H - drafts * unit, width: w, height: drafts * unit, class: 'drafts'}),
      svg('rect', {x, y: H - (drafts + bonus) * unit, width: w, height: bonus * unit, class: 'bonus'}));
    group.addEventListener('click', () => show(s.n));
    chart.append(group);
  });
  $('step-chart').replaceChildren(chart);
}

// ---------------------------------------------------------------- steps and trees

function chip(text, attrs) {
  return html('span', {class: 'chip', title: JSON.stringify(text), ...attrs}, visible(text));
}

function stepRow(step, deepest) {
  const accepted = step.tree.accepted;
  const row = html('li', {'data-step': step.n, 'data-accepted': step.tree.accepted.length}, html('span', {class: 'n'}, `#${step.n}`));
  const chips = html('span', {class: 'chips'});
  accepted.slice(0, emittedDrafts(step)).forEach((i, k) => {
    const mask = step.tree.speculators[i];
    chips.append(chip(step.texts[k], {style: `background:${cssFill(mask)};border-color:${maskStroke(mask)}`}));
  });
  if (step.bonus !== null) chips.append(chip(step.bonus, {class: 'chip bonus'}));
  const size = step.tree.parents.length;
  const meta = size ? `${accepted.length}/${deepest} deep · ${size} nodes` : (step.n === 1 ? 'prompt' : 'no tree');
  row.append(chips, html('span', {class: 'meta'}, meta));
  row.addEventListener('click', () => show(shown === step.n ? null : step.n));
  return row;
}

/** Pin step n in the large view, or follow the latest step when n is null. */
function show(n) {
  if (!run || !run.steps.length) return;
  shown = n;
  $('follow').hidden = n === null;
  for (const li of $('steps').children) li.classList.toggle('selected', Number(li.dataset.step) === n);
  drawLarge(run.steps[(n ?? run.steps.length) - 1]);
}

function drawLarge(step) {
  const size = step.tree.parents.length, accepted = step.tree.accepted.length;
  $('tree-title').textContent = `Step ${step.n} · ` +
    (size ? `${size} draft nodes · ${accepted} accepted` : 'no draft tree') + (step.bonus !== null ? ' + bonus' : '');
  const tree = drawTree(step);
  $('tree').replaceChildren(tree);
  // a wide (deep) tree shrinks to fit, down to a size whose labels stay readable; beyond, it scrolls
  const natural = Number(tree.getAttribute('width'));
  const scale = Math.min(1, Math.max(TREE.minScale, ($('tree').clientWidth - 2) / natural));
  tree.setAttribute('width', natural * scale);
  tree.setAttribute('height', Number(tree.getAttribute('height')) * scale);
}

/** Lay out left to right by depth, one row per leaf; a parent sits at the middle of its children. */
function layout(step) {
  const {parents, token_texts: texts, speculators, accepted} = step.tree;
  const nodes = [{kind: 'root', text: step.root, depth: 0, children: []}];
  parents.forEach((p, i) => {
    nodes.push({kind: 'draft', text: texts[i], mask: speculators[i], depth: nodes[p + 1].depth + 1,
                parent: p + 1, children: [], accepted: false});
    nodes[p + 1].children.push(i + 1);
  });
  accepted.forEach(i => { nodes[i + 1].accepted = true; });
  if (step.bonus !== null) {
    const at = accepted.length ? accepted[accepted.length - 1] + 1 : 0;
    nodes.push({kind: 'bonus', text: step.bonus, depth: nodes[at].depth + 1, parent: at, children: []});
    nodes[at].children.push(nodes.length - 1);
  }
  let rows = 0;
  (function place(u) {
    const node = nodes[u], c = node.children;
    c.forEach(place);
    node.row = c.length ? (nodes[c[0]].row + nodes[c[c.length - 1]].row) / 2 : rows++;
  })(0);

  const widths = [];
  for (const node of nodes) {
    node.label = node.kind === 'root' ? (node.text === null ? 'prompt' : shortLabel(node.text))
      : (node.kind === 'bonus' ? '★ ' : '') + shortLabel(node.text);
    node.w = node.label.length * TREE.charW + TREE.pad;
    widths[node.depth] = Math.max(widths[node.depth] || 0, node.w);
  }
  const xs = [TREE.margin];
  widths.forEach((w, d) => { xs[d + 1] = xs[d] + w + TREE.gap; });
  for (const node of nodes) {
    node.x = xs[node.depth];
    node.y = TREE.margin + TREE.header + node.row * TREE.row + TREE.row / 2;
  }
  return {nodes, xs, width: xs[xs.length - 1] - TREE.gap + TREE.margin,
          height: 2 * TREE.margin + TREE.header + rows * TREE.row};
}

function drawTree(step) {
  const {nodes, xs, width, height} = layout(step);
  const out = svg('svg', {width, height, viewBox: `0 0 ${width} ${height}`, class: 'tree', 'data-step': step.n});
  xs.slice(1, -1).forEach((x, d) => out.append(svg('text', {x, y: TREE.margin + 6, class: 'depth'}, `depth ${d + 1}`)));
  for (const node of nodes.slice(1)) {  // edges under nodes
    const from = nodes[node.parent], x1 = from.x + from.w, x2 = node.x, mid = (x1 + x2) / 2;
    const cls = node.kind === 'bonus' ? 'edge bonus' : node.accepted ? 'edge accepted' : 'edge';
    out.append(svg('path', {class: cls, d: `M${x1},${from.y} C${mid},${from.y} ${mid},${node.y} ${x2},${node.y}`}));
  }
  for (const node of nodes) {
    const g = svg('g', {class: `node ${node.kind}${node.accepted ? ' accepted' : ''}`,
                        'data-accepted': node.accepted ? 'true' : null, 'data-bonus': node.kind === 'bonus' ? 'true' : null,
                        'data-depth': node.depth, 'data-speculators': node.mask ?? null});
    const fill = node.kind === 'draft' ? svgFill(node.mask) : null;
    const stroke = node.kind === 'draft' && !node.accepted ? maskStroke(node.mask) : null;
    const who = node.kind === 'draft' ? bits(node.mask).map(drafterLabel).join(' + ') : '';
    const what = {root: 'last token before the step', bonus: "the LLM's bonus token",
                  draft: `proposed by ${who}${node.accepted ? ', accepted' : ''}`}[node.kind];
    g.append(
      svg('title', {}, `${node.text === null ? '(prompt)' : JSON.stringify(node.text)} — ${what}`),
      svg('rect', {x: node.x, y: node.y - TREE.box / 2, width: node.w, height: TREE.box, rx: 5, fill, stroke}),
      svg('text', {x: node.x + node.w / 2, y: node.y + 4, 'text-anchor': 'middle'}, node.label));
    out.append(g);
  }
  return out;
}

/** What speculator s hosts, as the server names it (an SSM, or a feature drafter's head). */
function drafterName(s) {
  return server?.specinfer?.drafters?.[s] || `SSM ${s}`;
}

/** Who drafts with bit s: a speculator, the manager's context lookup, a constrained request's grammar or a
 * request's prediction. */
function drafterLabel(s) {
  const info = server?.specinfer || {};
  if ((1 << s) === (info.context_lookup_mask || 0)) return 'context lookup';
  if ((1 << s) === (info.grammar_mask || 0)) return 'grammar (forced tokens)';
  if ((1 << s) === (info.prediction_mask || 0)) return 'prediction';
  return drafterName(s);
}

function drawLegend(speculators) {
  legendFor = Math.max(speculators, legendFor);
  speculators = legendFor;
  const info = server?.specinfer || {};
  const served = Math.max(info.speculators || 0, (info.drafters || []).length);
  const own = s => [info.context_lookup_mask, info.grammar_mask, info.prediction_mask].includes(1 << s);  // the manager's
  const items = [];
  for (let s = 0; s < speculators; s++) {
    if (!(s < served || own(s))) continue;
    const tally = run?.drafted[s] ? ` · ${run.hit[s]} of ${run.drafted[s]} accepted` : '';
    items.push([drafterLabel(s) + tally, cssFill(1 << s), maskStroke(1 << s), s]);
  }
  if (speculators > 1) items.push([speculators > 2 ? 'several drafters' : 'both', cssFill(3), maskStroke(3)]);
  items.push(['accepted path', '#ffffff', GREEN], ['★ bonus (LLM)', GREEN, GREEN]);
  $('legend').replaceChildren(...items.map(([name, fill, stroke, s]) => html('span',
    {class: 'key-item', ...(s === undefined ? {} : {'data-drafter': s, 'data-drafted': run?.drafted[s] || 0,
                                                   'data-accepted': run?.hit[s] || 0})},
    html('i', {class: 'swatch', style: `background:${fill};border-color:${stroke}`}), name)));
}

// ---------------------------------------------------------------- page state

function showError(message, source = '') {
  $('error').textContent = message;
  $('error').dataset.source = source;
  $('error').hidden = !message;
}

function setStatus(state, text) {
  $('status').dataset.state = state;
  $('status').textContent = text;
  $('run').disabled = state === 'running';
  $('stop').disabled = state !== 'running';
}

function init() {
  document.body.prepend(svg('svg', {width: 0, height: 0, style: 'position:absolute'}, svg('defs', {id: 'shared-defs'})));
  $('token').value = localStorage.getItem('specinfer.token') || '';
  $('token').addEventListener('change', () => {
    localStorage.setItem('specinfer.token', $('token').value.trim());
    loadModels();
  });
  const syncExpansion = () => { $('expansion').disabled = $('speculation').value !== 'fixed'; };
  $('speculation').addEventListener('change', syncExpansion);
  syncExpansion();
  $('form').addEventListener('submit', generate);
  $('prompt').addEventListener('keydown', e => {
    if (e.key === 'Enter' && (e.ctrlKey || e.metaKey)) $('form').requestSubmit();
  });
  $('stop').addEventListener('click', () => run && run.controller.abort());
  $('follow').addEventListener('click', () => show(null));
  drawLegend(0);
  updateFigures();
  loadModels();
}

init();
