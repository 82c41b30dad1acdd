// A reply's text as HTML: markdown-ish blocks (fenced code highlighted, inline code), every character
// kept (fence lines are shown dimmed, so the element's text is the reply's text), and each token of the
// speculation trace marked by its origin (class o-draft / o-target, pb on the first token of a pass).

import { highlight, languageOf } from './highlight.js';

const ESCAPES = { '&': '&amp;', '<': '&lt;', '>': '&gt;', '"': '&quot;', "'": '&#39;' };
export const escapeHtml = (text) => text.replace(/[&<>"']/g, (c) => ESCAPES[c]);

const OPEN_FENCE = /^[ \t]*(`{3,}|~{3,})[ \t]*([\w+#.-]*)[^\n`]*$/;
const ORIGIN_TITLE = { draft: 'accepted from the draft tree', target: "the target's own token" };

// [{kind: 'prose' | 'code', start, end, bodyStart, bodyEnd, lang}] covering text, in order
export function blocks(text, mode, lang) {
  if (mode === 'code') return [{ kind: 'code', start: 0, end: text.length, bodyStart: 0, bodyEnd: text.length, lang }];
  if (mode === 'plain') return [{ kind: 'prose', start: 0, end: text.length }];
  const out = [];
  let proseStart = 0;
  let open = null; // the code block being read
  let pos = 0;
  while (pos < text.length) {
    const newline = text.indexOf('\n', pos);
    const lineEnd = newline < 0 ? text.length : newline;
    const next = newline < 0 ? text.length : newline + 1;
    const line = text.slice(pos, lineEnd);
    if (open === null) {
      const m = OPEN_FENCE.exec(line);
      if (m) {
        if (pos > proseStart) out.push({ kind: 'prose', start: proseStart, end: pos });
        open = { kind: 'code', start: pos, bodyStart: next, fence: m[1], lang: m[2] };
      }
    } else if (line.trim().startsWith(open.fence) && line.trim().replace(/[`~]/g, '') === '') {
      out.push({ ...open, bodyEnd: pos, end: next });
      open = null;
      proseStart = next;
    }
    pos = next;
  }
  if (open !== null) out.push({ ...open, bodyStart: Math.min(open.bodyStart, text.length), bodyEnd: text.length, end: text.length });
  else if (text.length > proseStart) out.push({ kind: 'prose', start: proseStart, end: text.length });
  return out;
}

function inlineCode(text, start, end) {
  const ranges = [];
  const re = /`[^`\n]+`/g;
  const part = text.slice(start, end);
  let m;
  while ((m = re.exec(part)) !== null) ranges.push([start + m.index, start + m.index + m[0].length, 'hl-inline']);
  return ranges;
}

// HTML of text[from, to): style ranges ([start, end, cls], ascending, absolute) and marks (ascending,
// absolute {start, end, origin, pass, first, index}) split it into spans; cursor.mark is the first
// mark that may still apply (marks are read once over all blocks).
function spans(text, from, to, styles, marks, cursor) {
  let html = '';
  let i = from;
  let si = 0;
  while (i < to) {
    while (si < styles.length && styles[si][1] <= i) si += 1;
    while (cursor.mark < marks.length && marks[cursor.mark].end <= i) cursor.mark += 1;
    const style = si < styles.length && styles[si][0] <= i ? styles[si] : null;
    const mark = cursor.mark < marks.length && marks[cursor.mark].start <= i ? marks[cursor.mark] : null;
    let next = to;
    if (style) next = Math.min(next, style[1]); else if (si < styles.length) next = Math.min(next, styles[si][0]);
    if (mark) next = Math.min(next, mark.end); else if (cursor.mark < marks.length) next = Math.min(next, marks[cursor.mark].start);
    if (i < cursor.echo) next = Math.min(next, cursor.echo);
    const piece = escapeHtml(text.slice(i, next));
    const classes = [];
    let attrs = '';
    if (i < cursor.echo) classes.push('echo');
    if (style) classes.push(style[2]);
    if (mark) {
      classes.push('t', `o-${mark.origin}`);
      if (mark.first && i === mark.start) classes.push('pb');
      attrs = ` data-pass="${mark.pass}" data-t="${mark.index}" title="pass ${mark.pass}: ${ORIGIN_TITLE[mark.origin]}"`;
    }
    html += classes.length ? `<span class="${classes.join(' ')}"${attrs}>${piece}</span>` : piece;
    i = next;
  }
  return html;
}

// echo: the first characters are the prompt, shown dimmed before the continuation (completions)
export function renderText(text, marks, mode = 'markdown', lang = 'python', echo = 0) {
  const cursor = { mark: 0, echo };
  let html = '';
  for (const block of blocks(text, mode, lang)) {
    if (block.kind === 'prose') {
      html += `<span class="prose">${spans(text, block.start, block.end, inlineCode(text, block.start, block.end), marks, cursor)}</span>`;
      continue;
    }
    const language = languageOf(block.lang || lang);
    const styles = [];
    if (block.bodyStart > block.start) styles.push([block.start, block.bodyStart, 'fence']);
    for (const [s, e, cls] of highlight(text.slice(block.bodyStart, block.bodyEnd), language)) {
      styles.push([block.bodyStart + s, block.bodyStart + e, cls]);
    }
    if (block.end > block.bodyEnd) styles.push([block.bodyEnd, block.end, 'fence']);
    const tag = escapeHtml(block.lang || (mode === 'code' ? lang : ''));
    html += `<div class="code-block" data-lang="${tag}"><button class="copy-code" type="button" aria-label="copy code"></button>`
      + `<pre><code>${spans(text, block.start, block.end, styles, marks, cursor)}</code></pre></div>`;
  }
  return html;
}

// the code of the code block whose copy button was pressed (its fence lines left out)
export function codeOf(button) {
  const code = button.parentElement.querySelector('code');
  const parts = [...code.childNodes].filter((n) => !(n.classList && n.classList.contains('fence')));
  return parts.map((n) => n.textContent).join('');
}
