// HTML of replies, shared by the chat and completion views: the marked text, tool calls, errors, a
// one-line summary, and an A/B pair with its verdict.

import { escapeHtml, renderText } from './render.js';
import { verdict } from './run.js';

export function metaText(reply) {
  const s = reply.stats();
  if (!s.passes) return reply.done ? '' : 'waiting for the first pass…';
  const rate = s.tokPerSec ? ` · ${s.tokPerSec.toFixed(1)} tokens/s` : '';
  return `${s.method} · ${s.tokens} tokens in ${s.passes} target passes · ${s.perPass.toFixed(2)} per pass${rate}`;
}

function toolCallsHtml(reply) {
  return reply.toolCalls.filter(Boolean).map((call) => (
    '<div class="tool-call"><span class="tool-label">tool call</span>'
    + `<span class="tool-name">${escapeHtml(call.function.name)}</span>`
    + `<code class="tool-args">${escapeHtml(call.function.arguments)}</code></div>`)).join('');
}

// the reply's text (element .reply-text: its text is the content; with `prompt`, the prompt then the
// content), then its tool calls and error
export function replyHtml(reply, mode, prompt = null) {
  const streaming = reply.done ? '' : '<span class="cursor" aria-hidden="true"></span>';
  let text;
  if (prompt === null) {
    text = renderText(reply.content, reply.visibleMarks, mode);
  } else {
    const marks = reply.visibleMarks.map((m) => ({ ...m, start: m.start + prompt.length, end: m.end + prompt.length }));
    text = renderText(prompt + reply.content, marks, 'code', 'python', prompt.length);
  }
  const empty = reply.done && !reply.content && !reply.toolCalls.length && !reply.error ? ' empty' : '';
  let html = `<div class="reply-text${empty}">${text}${streaming}</div>${toolCallsHtml(reply)}`;
  if (reply.error) html += `<p class="error">${escapeHtml(reply.error)}</p>`;
  if (reply.done && reply.finish === 'length') html += '<p class="note">stopped at max_tokens</p>';
  return html;
}

export function abHtml(a, b, seed, mode, prompt = null) {
  const side = (reply, name) => (
    `<section class="ab-side" data-side="${name}"><h4>${name.toUpperCase()} · ${escapeHtml(reply.method || reply.label)}`
    + `<span class="meta">${escapeHtml(metaText(reply))}</span></h4>${replyHtml(reply, mode, prompt)}</section>`);
  return `<div class="ab-grid">${side(a, 'a')}${side(b, 'b')}</div>`
    + `<p class="verdict" data-verdict>${escapeHtml(verdict(a, b, seed))}</p>`;
}
