// The speculation panel: a reply's statistics (from its trace) and a chart of tokens per target pass.

import { escapeHtml } from './render.js';

const SVG = 'http://www.w3.org/2000/svg';
const fixed = (value, digits) => (value === null || value === undefined ? '–' : Number(value).toFixed(digits));

function row(name, stat, value, hint = '') {
  const title = hint ? ` title="${escapeHtml(hint)}"` : '';
  return `<tr${title}><th>${name}</th><td data-stat="${stat}">${value}</td></tr>`;
}

export function statsHtml(reply) {
  if (!reply) return '<p class="note">Send a message: its speculation shows here as it streams.</p>';
  const s = reply.stats();
  const rows = [
    row('method', 'method', escapeHtml(s.method || reply.label || '–'), 'the trees the request grew'),
    row('target passes', 'passes', s.passes, 'forward passes of the target over a tree'),
    row('tokens', 'tokens', s.tokens),
    row('from the draft', 'draft', s.draft, "tokens accepted from the draft's tree"),
    row('by the target', 'target', s.target, 'correction or bonus tokens: one per pass at most'),
    row('tokens per pass', 'per-pass', fixed(s.perPass, 2)),
    row('mean tree size', 'tree', fixed(s.meanTree, 1), 'nodes the target scored per pass, root included'),
    row('draft nodes accepted', 'acceptance', s.acceptance === null ? '–' : `${fixed(100 * s.acceptance, 1)}%`,
      'accepted tokens / drafted tree nodes'),
    row('tokens/s', 'tok-s', fixed(s.tokPerSec, 1), 'after the first pass (which also wrote the prompt)'),
    row('first token', 'first-ms', s.firstTokenMs === null ? '–' : `${fixed(s.firstTokenMs, 0)} ms`),
    row('prefill', 'prefill-ms', s.prefillMs === null ? '–' : `${fixed(s.prefillMs, 1)} ms`, "timings.prompt_ms"),
  ];
  const agrees = reply.agreesWithTimings();
  let check = '';
  if (agrees !== null) {
    const t = reply.timings;
    check = `<p class="${agrees ? 'ok' : 'error'}" data-stat="agrees">${agrees ? '✓' : '✗'} timings: `
      + `${t.target_passes} passes, ${t.draft_tokens_accepted} draft tokens, ${t.predicted_n} tokens</p>`;
  }
  return `<table>${rows.join('')}</table>${check}`;
}

export function drawChart(svg, reply) {
  svg.replaceChildren();
  const passes = reply ? reply.passes : [];
  const width = 300;
  const height = 90;
  svg.setAttribute('viewBox', `0 0 ${width} ${height}`);
  if (!passes.length) return;
  const top = Math.max(...passes.map((p) => p.emitted), 1);
  const step = width / Math.max(passes.length, 24);
  const bar = Math.max(step * 0.8, 1);
  const scale = (height - 12) / top;
  const add = (name, attrs) => {
    const el = document.createElementNS(SVG, name);
    for (const [k, v] of Object.entries(attrs)) el.setAttribute(k, v);
    svg.append(el);
    return el;
  };
  passes.forEach((p, i) => {
    const x = i * step;
    const own = p.emitted - p.accepted;
    const draftHeight = p.accepted * scale;
    add('rect', { x, y: height - draftHeight, width: bar, height: draftHeight, class: 'bar-draft' });
    add('rect', { x, y: height - draftHeight - own * scale, width: bar, height: own * scale, class: 'bar-target' });
  });
  const label = add('text', { x: 2, y: 9, class: 'chart-label' });
  label.textContent = `max ${top} tokens/pass · ${passes.length} passes`;
}
