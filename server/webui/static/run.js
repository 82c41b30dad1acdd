// One request from the page, traced, and with A/B its twin: the same body (same seed) under another
// method, run after it, so each side's passes and timings are its own.

import { streamJSON } from './api.js';
import { Reply } from './reply.js';

export const CHAT_PATH = '/v1/chat/completions';
export const COMPLETIONS_PATH = '/v1/completions';

export function randomSeed() {
  return Math.floor(Math.random() * 2 ** 31);
}

// Calls onUpdate() at most once per animation frame while chunks arrive, and once at the end.
function throttled(onUpdate) {
  let pending = false;
  return () => {
    if (pending) return;
    pending = true;
    requestAnimationFrame(() => { pending = false; onUpdate(); });
  };
}

export async function stream(chat, body, reply, signal, onUpdate) {
  const update = throttled(onUpdate);
  try {
    await streamJSON(chat ? CHAT_PATH : COMPLETIONS_PATH, { ...body, stream: true }, (chunk) => {
      reply.onChunk(chunk, chat);
      update();
    }, signal);
  } catch (error) {
    reply.error = error.name === 'AbortError' ? 'stopped' : error.message;
  } finally {
    reply.done = true;
    onUpdate();
  }
  return reply;
}

// {a, b, seed}: a runs under the server's method (label 'default'), b (with abMethod) under abMethod; b is null without A/B.
// onStart(a, b) comes before any request, so the caller can show both sides at once.
export async function runTraced(chat, body, abMethod, signal, onStart, onUpdate) {
  const seed = abMethod && body.seed === undefined ? randomSeed() : body.seed;
  const request = seed === undefined ? body : { ...body, seed };
  const a = new Reply('default');
  const b = abMethod ? new Reply(abMethod) : null;
  onStart(a, b, seed);
  await stream(chat, { ...request, specexec: { trace: true } }, a, signal, onUpdate);
  if (b && !(signal && signal.aborted)) {
    await stream(chat, { ...request, specexec: { trace: true, method: abMethod } }, b, signal, onUpdate);
  } else if (b) {
    b.error = 'stopped';
    b.done = true;
  }
  return { a, b, seed };
}

// the A/B line: whether the texts match, and the passes each side needed
export function verdict(a, b, seed) {
  if (!a.done || !b.done) return 'running…';
  if (a.error || b.error) return `not compared: ${a.error || b.error}`;
  const same = a.content === b.content && JSON.stringify(a.toolCalls) === JSON.stringify(b.toolCalls);
  const pa = a.passes.length;
  const pb = b.passes.length;
  const ratio = pa && pb ? ` (${(Math.max(pa, pb) / Math.min(pa, pb)).toFixed(1)}x)` : '';
  const head = same ? '✓ identical text' : '✗ the texts differ';
  const why = !same && ['specinfer', 'rrs'].includes(b.method) && b.method !== a.method
    ? ': sampled trees draw other random numbers (each text is exact in distribution)' : '';
  return `${head}${why} · seed ${seed ?? 'none'} · ${a.method}: ${pa} target passes, ${b.method}: ${pb}${ratio}`;
}
