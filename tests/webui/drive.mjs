// Drives the chat page in headless Chromium (playwright-core over the system's Chromium) and prints what
// it saw as one JSON object; tests/webui/test_webui_browser.py checks it against the server's own
// responses. Usage: node drive.mjs '{"url": ..., "scenario": "page" | "key", "shots": dir, "key": ...}'

import { chromium } from 'playwright-core';

const config = JSON.parse(process.argv[2]);
const FLAGS = ['--headless', '--no-sandbox', '--disable-gpu', '--disable-background-networking',
  '--disable-component-update', '--disable-sync', '--no-first-run', '--disable-dev-shm-usage'];
const REPLY_TIMEOUT = 180000;

const seen = { console: [], pageErrors: [], foreignRequests: [], failedRequests: [] };

function watch(page) {
  const origin = new URL(config.url).origin;
  page.on('console', (m) => { if (m.type() === 'error' || m.type() === 'warning') seen.console.push(`${m.type()}: ${m.text()}`); });
  page.on('pageerror', (e) => seen.pageErrors.push(e.message));
  page.on('request', (r) => { if (!r.url().startsWith(origin) && !r.url().startsWith('data:')) seen.foreignRequests.push(r.url()); });
  page.on('requestfailed', (r) => seen.failedRequests.push(`${r.url()} ${r.failure() && r.failure().errorText}`));
}

// Chromium keeps no body of an event stream for the driver: the page's fetch of /v1/* is teed instead
// (the page still reads its stream as it comes), and each body the page received is kept
function teeResponses() {
  window.__bodies = [];
  const original = window.fetch;
  window.fetch = async (input, init) => {
    const response = await original(input, init);
    const path = new URL(typeof input === 'string' ? input : input.url, location.href).pathname;
    if (!init || init.method !== 'POST' || !path.startsWith('/v1/') || !response.body) return response;
    const [mine, theirs] = response.body.tee();
    const record = { path, status: response.status, request: JSON.parse(init.body), text: '', done: false };
    window.__bodies.push(record);
    new Response(mine).text().then((text) => { record.text = text; record.done = true; },
      () => { record.aborted = true; record.done = true; }); // the page stopped it
    return new Response(theirs, { status: response.status, statusText: response.statusText, headers: response.headers });
  };
}

// the lengths of a reply's text each time the page redrew it while it streamed
function watchStreaming() {
  window.__partial = [];
  new MutationObserver(() => {
    for (const text of document.querySelectorAll('article.assistant:not([data-done]) [data-side=a] .reply-text')) {
      window.__partial.push(text.textContent.length);
    }
  }).observe(document, { subtree: true, childList: true, characterData: true });
}

async function shot(page, name) {
  if (config.shots) await page.screenshot({ path: `${config.shots}/${name}.png` });
}

// what a reply element shows: its text, its token spans, and the panel's numbers
async function observe(page, replySelector) {
  return page.evaluate((selector) => {
    const reply = document.querySelector(selector);
    const text = reply.querySelector('.reply-text');
    const spans = [...text.querySelectorAll('.t')].map((s) => ({
      text: s.textContent, origin: s.classList.contains('o-draft') ? 'draft' : 'target',
      pass: Number(s.dataset.pass), index: Number(s.dataset.t), boundary: s.classList.contains('pb'),
    }));
    const stats = Object.fromEntries([...document.querySelectorAll('#stats [data-stat]')].map((e) => [e.dataset.stat, e.textContent]));
    return {
      text: text.textContent, spans, stats,
      bars: document.querySelectorAll('#chart rect.bar-draft').length,
      toolCalls: [...reply.querySelectorAll('.tool-call')].map((e) => ({
        name: e.querySelector('.tool-name').textContent, arguments: e.querySelector('.tool-args').textContent })),
      errors: [...reply.querySelectorAll('.error')].map((e) => e.textContent),
    };
  }, replySelector);
}

async function settle(page) {
  await page.waitForFunction(() => window.__bodies.every((b) => b.done));
  return page.evaluate(() => window.__bodies.splice(0));
}

async function chat(page, out) {
  await page.fill('#max_tokens', '96');
  await page.fill('#input', 'import os\n\ndef walk(path):');
  await page.click('#send');
  await page.waitForSelector('article.assistant[data-done]', { timeout: REPLY_TIMEOUT });
  out.chat = await observe(page, 'article.assistant .reply');
  out.chat.responses = await settle(page);
  out.chat.partial = await page.evaluate(() => window.__partial.splice(0));
  await shot(page, 'webui-chat');
  await page.check('#mark-passes');
  out.passBoundaries = await page.evaluate(() => {
    const first = document.querySelector('.reply-text .t.pb');
    return first ? getComputedStyle(first).borderLeftStyle : null;
  });
  await page.uncheck('#mark-passes');
  // regenerate: greedy, the same reply again
  await page.click('article.assistant [data-act=regenerate]');
  await page.waitForSelector('article.assistant[data-done]', { timeout: REPLY_TIMEOUT });
  out.regenerated = { text: await page.textContent('article.assistant .reply-text'), articles: await page.locator('#transcript article').count() };
  await settle(page);
  // stop: a long reply ended once its first tokens are shown
  await page.fill('#max_tokens', '900');
  await page.fill('#input', 'class Parser:');
  await page.click('#send');
  await page.waitForSelector('article.assistant:not([data-done]) .reply-text .t', { state: 'attached', timeout: REPLY_TIMEOUT });
  await page.click('#stop');
  await page.waitForSelector('#transcript article:last-child[data-done]', { timeout: REPLY_TIMEOUT });
  out.stopped = await observe(page, '#transcript article:last-child .reply');
  await settle(page);
}

async function abChat(page, out) {
  await page.click('#new-chat');
  await page.check('#ab-on');
  await page.selectOption('#ab-method', 'autoregressive');
  await page.fill('#temperature', '0.7');
  await page.fill('#seed', '1234');
  await page.fill('#max_tokens', '48');
  await page.fill('#input', 'def read_config(path):');
  await page.click('#send');
  await page.waitForSelector('article.assistant.ab[data-done]', { timeout: REPLY_TIMEOUT });
  out.ab = { a: await observe(page, 'article.ab [data-side=a]') }; // the panel shows side A
  await shot(page, 'webui-ab');
  await page.click('article.ab [data-side=b] .reply-text'); // and now side B
  out.ab.b = await observe(page, 'article.ab [data-side=b]');
  out.ab.verdict = await page.textContent('article.ab [data-verdict]');
  out.ab.responses = await settle(page);
  await page.uncheck('#ab-on');
  await page.fill('#temperature', '0');
  await page.fill('#seed', '');
}

async function completion(page, out) {
  await page.click('#mode-completion');
  await page.fill('#max_tokens', '64');
  await page.fill('#prompt', 'class Stack:\n    def __init__(self):\n        self.items = []\n\n    def push(self, item):\n');
  await page.click('#run');
  await page.waitForSelector('#completion-out article[data-done]', { timeout: REPLY_TIMEOUT });
  out.completion = await observe(page, '#completion-out .reply');
  out.completion.prompt = await page.inputValue('#prompt');
  out.completion.responses = await settle(page);
  await shot(page, 'webui-completion');
  await page.click('#mode-chat');
}

// a tool call from a canned stream (the built-in pair's template renders no tools)
async function toolCall(page, out) {
  const chunk = (delta, finish = null) => `data: ${JSON.stringify({ id: 'chatcmpl-x', object: 'chat.completion.chunk', created: 1, model: 'm',
    choices: [{ index: 0, delta, logprobs: null, finish_reason: finish }] })}\n\n`;
  const body = chunk({ role: 'assistant', content: '' })
    + chunk({ tool_calls: [{ index: 0, id: 'call_1', type: 'function', function: { name: 'get_weather', arguments: '' } }] })
    + chunk({ tool_calls: [{ index: 0, function: { arguments: '{"city": ' } }] })
    + chunk({ tool_calls: [{ index: 0, function: { arguments: '"Paris"}' } }] })
    + chunk({}, 'tool_calls') + 'data: [DONE]\n\n';
  await page.route('**/v1/chat/completions', (route) => route.fulfill({ status: 200, contentType: 'text/event-stream', body }));
  await page.click('#new-chat');
  await page.fill('#input', 'weather in Paris?');
  await page.click('#send');
  await page.waitForSelector('article.assistant[data-done]', { timeout: REPLY_TIMEOUT });
  out.tool = await observe(page, 'article.assistant .reply');
  await page.unroute('**/v1/chat/completions');
  await settle(page);
  // a setting that is not valid is said, and nothing is sent
  await page.fill('#seed', '1.5');
  await page.fill('#input', 'def g():');
  await page.click('#send');
  out.invalid = { flash: await page.textContent('.flash'), articles: await page.locator('#transcript article').count() };
  await page.fill('#seed', '');
}

async function keyed(page, out) {
  await page.waitForSelector('#key-dialog[open]');
  await page.fill('#key-input', 'wrong-key');
  await page.click('#key-form button');
  await page.waitForSelector('#key-dialog[open] #key-error:not([hidden])');
  out.keyError = await page.textContent('#key-error');
  await page.fill('#key-input', config.key);
  await page.click('#key-form button');
  await page.waitForSelector('#model[data-ready]');
  out.model = await page.textContent('#model');
  await page.fill('#max_tokens', '16');
  await page.fill('#input', 'def f(x):');
  await page.click('#send');
  await page.waitForSelector('article.assistant[data-done]', { timeout: REPLY_TIMEOUT });
  out.chat = await observe(page, 'article.assistant .reply');
  out.chat.responses = await settle(page);
  out.storage = await page.evaluate(() => ({ session: sessionStorage.getItem('specexec.apiKey'), local: JSON.stringify(localStorage) }));
}

async function main() {
  const browser = await chromium.launch({ executablePath: config.chromium, args: FLAGS });
  const out = {};
  try {
    const page = await browser.newPage({ viewport: { width: 1400, height: 900 } });
    watch(page);
    await page.addInitScript(teeResponses);
    await page.addInitScript(watchStreaming);
    await page.goto(config.url);
    if (config.scenario === 'key') {
      await keyed(page, out);
    } else {
      await page.waitForSelector('#model[data-ready]');
      out.model = await page.textContent('#model');
      await chat(page, out);
      await abChat(page, out);
      await completion(page, out);
      await toolCall(page, out);
    }
  } catch (error) {
    out.failure = String(error && error.stack ? error.stack : error);
  } finally {
    await browser.close();
  }
  out.console = seen.console;
  out.pageErrors = seen.pageErrors;
  out.foreignRequests = seen.foreignRequests;
  out.failedRequests = seen.failedRequests;
  process.stdout.write(JSON.stringify(out));
}

main();
