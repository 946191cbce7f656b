// The chat page of ggml-hybrid serve: chat with a served model, and watch its expert cache (GET /experts).
// A model's answer is untrusted: it is rendered by renderMarkdown below into elements made with createElement and
// text nodes only; no string ever becomes markup (no innerHTML), and the server's Content-Security-Policy allows
// no inline script besides.
'use strict';

const PREFIX = 'ggml-hybrid.';
const POLL_MS = 1000;
const $ = (id) => document.getElementById(id);
const saved = (name, fallback) => {
  try {
    const v = localStorage.getItem(PREFIX + name);
    return v === null ? fallback : JSON.parse(v);
  } catch (e) {
    return fallback;
  }
};
const save = (name, value) => localStorage.setItem(PREFIX + name, JSON.stringify(value));

let apiKey = saved('key', '');
let conversation = saved('conversation', []);
let running = null; // {controller, message element}
let samples = []; // recent /experts answers: [{t, view}]

class NeedKey extends Error {}

// -- Markdown, safely: elements and text nodes only ------------------------------------------------------------

const INLINE = /(`+)([\s\S]*?[^`])\1(?!`)|\*\*([^*\n]+)\*\*|\*([^*\s][^*\n]*)\*/g;

function inline(parent, text) {
  let last = 0;
  for (const m of text.matchAll(INLINE)) {
    if (m.index > last) parent.appendChild(document.createTextNode(text.slice(last, m.index)));
    const el = document.createElement(m[2] !== undefined ? 'code' : m[3] !== undefined ? 'strong' : 'em');
    el.textContent = m[2] !== undefined ? m[2] : m[3] !== undefined ? m[3] : m[4];
    parent.appendChild(el);
    last = m.index + m[0].length;
  }
  if (last < text.length) parent.appendChild(document.createTextNode(text.slice(last)));
}

function renderMarkdown(text, parent) {
  parent.replaceChildren();
  const lines = text.split('\n');
  let para = null;
  let list = null;
  const endBlocks = () => { para = null; list = null; };
  for (let i = 0; i < lines.length; i++) {
    const line = lines[i];
    const fence = line.match(/^\s*(```+|~~~+)\s*([\w+-]*)/);
    if (fence) {
      endBlocks();
      const body = [];
      for (i++; i < lines.length && !lines[i].trim().startsWith(fence[1]); i++) body.push(lines[i]);
      const pre = document.createElement('pre');
      const code = document.createElement('code');
      if (fence[2]) code.className = 'language-' + fence[2];
      code.textContent = body.join('\n');
      pre.appendChild(code);
      parent.appendChild(pre);
      continue;
    }
    const heading = line.match(/^(#{1,6})\s+(.*)$/);
    const item = line.match(/^\s*([-*+]|\d+[.)])\s+(.*)$/);
    if (heading) {
      endBlocks();
      const h = document.createElement('h' + Math.min(6, heading[1].length + 2));
      inline(h, heading[2]);
      parent.appendChild(h);
    } else if (item) {
      const tag = /\d/.test(item[1]) ? 'ol' : 'ul';
      if (!list || list.tagName.toLowerCase() !== tag) {
        para = null;
        list = document.createElement(tag);
        parent.appendChild(list);
      }
      const li = document.createElement('li');
      inline(li, item[2]);
      list.appendChild(li);
    } else if (line.trim() === '') {
      endBlocks();
    } else {
      list = null;
      if (!para) {
        para = document.createElement('p');
        parent.appendChild(para);
      } else {
        para.appendChild(document.createTextNode('\n'));
      }
      inline(para, line);
    }
  }
}

// -- the API ---------------------------------------------------------------------------------------------------

function headers(json) {
  const h = {};
  if (json) h['Content-Type'] = 'application/json';
  if (apiKey) h.Authorization = 'Bearer ' + apiKey;
  return h;
}

async function api(path, options = {}) {
  const r = await fetch(path, {...options, headers: headers(options.body !== undefined)});
  if (r.status === 401) {
    askKey(apiKey ? 'The server refused this API key: give another.' : 'This server needs an API key.');
    throw new NeedKey();
  }
  return r;
}

async function errorText(r) {
  try {
    const body = await r.json();
    return (body.error && body.error.message) || JSON.stringify(body);
  } catch (e) {
    return 'HTTP ' + r.status;
  }
}

function askKey(reason) {
  $('key-reason').textContent = reason;
  $('key-form').hidden = false;
  $('key').focus();
}

function useKey() {
  apiKey = $('key').value.trim();
  save('key', apiKey);
  $('key').value = '';
  $('key-form').hidden = true;
  loadModels();
}

async function loadModels() {
  try {
    const r = await api('/v1/models');
    if (!r.ok) throw new Error(await errorText(r));
    const ids = (await r.json()).data.map((m) => m.id);
    const select = $('model');
    select.replaceChildren(...ids.map((id) => {
      const o = document.createElement('option');
      o.value = o.textContent = id;
      return o;
    }));
    const want = saved('model', '');
    if (ids.includes(want)) select.value = want;
    $('status').textContent = '';
    $('page-ready') || markReady();
    tick(); // the view at once, not a poll interval later
  } catch (e) {
    if (!(e instanceof NeedKey)) $('status').textContent = 'Could not list the models: ' + e.message;
  }
}

function markReady() {
  const m = document.createElement('meta');
  m.id = 'page-ready';
  document.head.appendChild(m);
}

// -- the conversation ------------------------------------------------------------------------------------------

function messageElement(msg) {
  const div = document.createElement('div');
  div.className = 'msg ' + msg.role + (msg.error ? ' error' : '');
  const body = document.createElement('div');
  body.className = 'body';
  div.appendChild(body);
  const meta = document.createElement('div');
  meta.className = 'meta';
  div.appendChild(meta);
  fill(div, msg);
  $('messages').appendChild(div);
  return div;
}

function fill(div, msg) {
  const body = div.querySelector('.body');
  if (msg.role === 'assistant' && !msg.error) renderMarkdown(msg.content, body);
  else body.textContent = msg.content;
  const notes = [];
  if (msg.stopped) notes.push('stopped');
  if (msg.finish) notes.push('finish: ' + msg.finish);
  if (msg.tps !== undefined) notes.push(msg.tps.toFixed(1) + ' tokens/s');
  div.querySelector('.meta').textContent = notes.join(' · ');
  div.classList.toggle('error', !!msg.error);
}

function showConversation() {
  $('messages').replaceChildren();
  conversation.forEach(messageElement);
}

function setRunning(on) {
  $('send').disabled = on;
  $('stop').disabled = !on;
}

async function readStream(r, onChunk) {
  const reader = r.body.getReader();
  const decoder = new TextDecoder();
  let buffer = '';
  for (;;) {
    const {value, done} = await reader.read();
    if (done) return;
    buffer += decoder.decode(value, {stream: true});
    let cut;
    while ((cut = buffer.search(/\r?\n\r?\n/)) >= 0) {
      const event = buffer.slice(0, cut);
      buffer = buffer.slice(cut).replace(/^\r?\n\r?\n/, '');
      const data = event.split(/\r?\n/).filter((l) => l.startsWith('data:')).map((l) => l.slice(5).trim()).join('');
      if (!data) continue;
      if (data === '[DONE]') return;
      onChunk(JSON.parse(data));
    }
  }
}

async function send(text) {
  const model = $('model').value;
  save('model', model);
  const history = conversation.filter((m) => !m.error).map((m) => ({role: m.role, content: m.content}));
  const user = {role: 'user', content: text};
  conversation.push(user);
  messageElement(user);
  const answer = {role: 'assistant', content: ''};
  conversation.push(answer);
  const div = messageElement(answer);
  save('conversation', conversation);
  const controller = new AbortController();
  running = {controller, answer, div};
  setRunning(true);
  $('status').textContent = '';
  const t0 = performance.now();
  let tFirst = null;
  let pieces = 0;
  let usage = null;
  const body = {model, messages: [...history, user], stream: true, stream_options: {include_usage: true},
    temperature: Number($('temperature').value), max_tokens: Math.max(1, Math.floor(Number($('max-tokens').value)))};
  try {
    const r = await api('/v1/chat/completions', {method: 'POST', body: JSON.stringify(body), signal: controller.signal});
    if (!r.ok) throw new Error(await errorText(r));
    await readStream(r, (chunk) => {
      if (chunk.error) throw new Error(chunk.error.message || JSON.stringify(chunk.error));
      if (chunk.usage) usage = chunk.usage;
      for (const c of chunk.choices || []) {
        const piece = c.delta && c.delta.content;
        if (piece) {
          if (tFirst === null) {
            tFirst = performance.now();
            $('ttft').textContent = 'time to first token: ' + ((tFirst - t0) / 1000).toFixed(2) + ' s';
          }
          pieces++;
          answer.content += piece;
        }
        if (c.finish_reason) answer.finish = c.finish_reason;
      }
      fill(div, answer);
    });
  } catch (e) {
    if (e.name === 'AbortError') {
      answer.stopped = true;
    } else if (!(e instanceof NeedKey)) {
      answer.error = true;
      answer.content = (answer.content ? answer.content + '\n' : '') + 'Error: ' + e.message;
    } else {
      answer.error = true;
      answer.content = 'The server needs an API key: give it above, then send again.';
    }
  } finally {
    const n = usage ? usage.completion_tokens : pieces;
    if (tFirst !== null && n > 1) {
      answer.tps = (n - 1) / ((performance.now() - tFirst) / 1000);
      $('tps').textContent = 'tokens/s: ' + answer.tps.toFixed(1);
    }
    fill(div, answer);
    save('conversation', conversation);
    running = null;
    setRunning(false);
    const done = document.createElement('meta');
    done.className = 'answer-done';
    document.head.appendChild(done);
  }
}

// -- the expert view -------------------------------------------------------------------------------------------

const fmt = (n) => n.toLocaleString('en-US');
const rate = (hits, loads, cpu) => (hits + loads + cpu ? (100 * hits / (hits + loads + cpu)).toFixed(1) + ' %' : '-');

function windowBase(latest) {
  const start = latest.t - Number($('window').value);
  let base = samples[0];
  for (const s of samples) if (s.t <= start) base = s;
  return base;
}

function diff(a, b, key) {
  return a[key] - (b ? b[key] : 0);
}

async function poll() {
  if (!$('live').checked || document.visibilityState !== 'visible' || !$('model').value) return;
  let view;
  try {
    const r = await api('/experts?model=' + encodeURIComponent($('model').value));
    if (!r.ok) {
      $('view-state').textContent = 'not read: ' + (await errorText(r));
      return;
    }
    view = await r.json();
  } catch (e) {
    if (!(e instanceof NeedKey)) $('view-state').textContent = 'not read: ' + e.message;
    return;
  }
  if (samples.length && (samples[samples.length - 1].model !== view.model || view.t < samples[samples.length - 1].t)) {
    samples = [];
  }
  samples.push(view);
  const keep = view.t - 300;
  while (samples.length > 2 && samples[1].t <= keep) samples.shift();
  showView(view, windowBase(view));
}

function showView(now, base) {
  const w = {};
  for (const k of ['hits', 'misses', 'cpu_misses', 'bytes_loaded']) w[k] = diff(now.totals, base.totals, k);
  $('win-hits').textContent = fmt(w.hits);
  $('win-misses').textContent = fmt(w.misses);
  $('win-cpu').textContent = fmt(w.cpu_misses);
  $('win-bytes').textContent = fmt(w.bytes_loaded);
  $('win-rate').textContent = rate(w.hits, w.misses, w.cpu_misses);
  const t = now.totals;
  $('total-hits').textContent = fmt(t.hits);
  $('total-misses').textContent = fmt(t.misses);
  $('total-cpu').textContent = fmt(t.cpu_misses);
  $('total-bytes').textContent = fmt(t.bytes_loaded);
  $('total-rate').textContent = rate(t.hits, t.misses, t.cpu_misses);
  $('view-state').textContent = 'steps: ' + fmt(now.steps) + ' · window: ' + (now.t - base.t).toFixed(1) + ' s';
  $('view-state').dataset.steps = String(now.steps);
  if (now.tier) {
    const d = (k) => diff(now.tier, base.tier, k);
    $('tier').textContent = 'host tier (all layers, window): hits ' + fmt(d('hits')) + ', reads ' + fmt(d('misses')) +
      ' (' + (d('bytes_read') / 2 ** 20).toFixed(1) + ' MiB), waited ' + (d('wait_ns') / 1e6).toFixed(1) +
      ' ms; holds ' + (now.tier.bytes_held / 2 ** 20).toFixed(1) + ' MiB';
  } else {
    $('tier').textContent = 'host tier: none';
  }
  showTime(now.time, base.time);
  showLayers(now.layers, base.layers);
  showHeatmap(now.heatmap, base.heatmap);
}

function showTime(now, base) {
  const d = (k) => diff(now, base, k);
  const steps = d('decode_ns') + d('prompt_ns');
  const parts = {compute: d('compute_ns'), loads: d('load_ns'), wait: d('wait_ns')};
  parts.other = Math.max(0, steps - parts.compute - parts.loads - parts.wait);
  const total = Math.max(steps, parts.compute + parts.loads + parts.wait) || 1;
  for (const [k, v] of Object.entries(parts)) $('time-bar').querySelector('.' + k).style.width = (100 * v / total) + '%';
  const ms = (v) => (v / 1e6).toFixed(1) + ' ms';
  $('time-legend').textContent = 'steps ' + ms(steps) + ': experts computing ' + ms(parts.compute) + ', loading ' +
    ms(parts.loads) + ', waiting ' + ms(parts.wait) + ', the rest ' + ms(parts.other);
}

function showLayers(now, base) {
  const rows = now.map((l, i) => {
    const b = base[i] && base[i].layer === l.layer ? base[i] : null;
    const d = (k) => diff(l, b, k);
    const cells = [l.layer, l.mode, rate(d('hits'), d('misses'), d('cpu_misses')), fmt(d('hits')), fmt(d('misses')),
      fmt(d('cpu_misses')), (d('load_ns') / 1e6).toFixed(1), (d('compute_ns') / 1e6).toFixed(1)];
    const tr = document.createElement('tr');
    for (const c of cells) {
      const td = document.createElement('td');
      td.textContent = String(c);
      tr.appendChild(td);
    }
    return tr;
  });
  $('layers').replaceChildren(...rows);
}

function showHeatmap(now, base) {
  const canvas = $('heatmap');
  const ctx = canvas.getContext('2d');
  ctx.clearRect(0, 0, canvas.width, canvas.height);
  if (!now || !now.layers.length) {
    ctx.fillStyle = '#666';
    ctx.fillText('no layer behind the expert cache', 10, 20);
    return;
  }
  const nl = now.layers.length;
  const ne = now.n_expert;
  const cw = canvas.width / ne;
  const ch = canvas.height / nl;
  now.requests.forEach((row, i) => {
    const b = base && base.layers[i] === now.layers[i] ? base.requests[i] : null;
    const d = row.map((v, e) => v - (b ? b[e] : 0));
    const max = Math.max(1, ...d);
    d.forEach((v, e) => {
      const a = v / max;
      ctx.fillStyle = 'rgb(' + Math.round(255 - 220 * a) + ',' + Math.round(255 - 150 * a) + ',' +
        Math.round(255 - 40 * a) + ')';
      ctx.fillRect(e * cw, i * ch, cw, ch);
    });
    ctx.strokeStyle = '#d2452b';
    ctx.lineWidth = Math.max(1, Math.min(cw, ch) / 6);
    for (const e of now.held[i]) ctx.strokeRect(e * cw + 1, i * ch + 1, cw - 2, ch - 2);
  });
}

// -- wiring ----------------------------------------------------------------------------------------------------

function start() {
  $('send-form').addEventListener('submit', (ev) => {
    ev.preventDefault();
    const text = $('input').value;
    if (!text.trim() || running) return;
    $('input').value = '';
    send(text);
  });
  $('input').addEventListener('keydown', (ev) => {
    if (ev.key === 'Enter' && !ev.shiftKey) {
      ev.preventDefault();
      $('send-form').requestSubmit();
    }
  });
  $('stop').addEventListener('click', () => running && running.controller.abort());
  $('clear').addEventListener('click', () => {
    conversation = [];
    save('conversation', conversation);
    showConversation();
  });
  $('save-key').addEventListener('click', useKey);
  $('key').addEventListener('keydown', (ev) => ev.key === 'Enter' && useKey());
  $('change-key').addEventListener('click', () => askKey('Give the API key for this server.'));
  $('window').addEventListener('change', () => samples.length && showView(samples[samples.length - 1],
    windowBase(samples[samples.length - 1])));
  $('model').addEventListener('change', () => { samples = []; save('model', $('model').value); });
  showConversation();
  loadModels();
  setInterval(tick, POLL_MS);
}

let polling = false;

async function tick() {
  if (polling) return; // one poll at a time: a slow answer is not stacked on
  polling = true;
  try {
    await poll();
  } finally {
    polling = false;
  }
}

window.ggmlHybridPage = {renderMarkdown};
start();
