// The page: settings, modes, the speculation panel, the API key dialog, the connection; the chat and
// completion views do the rest (chat.js, completion.js).

import { forgetKey, getJSON, hasKey, health, onKeyNeeded } from './api.js';
import { Chat } from './chat.js';
import { Completion } from './completion.js';
import { drawChart, statsHtml } from './panel.js';
import { loadSettings, saveSettings } from './store.js';

const $ = (id) => document.getElementById(id);
const FIELDS = ['system', 'temperature', 'top_p', 'max_tokens', 'seed', 'stop-strings', 'render', 'tools', 'ab-method'];
const CHECKS = ['mark-origin', 'mark-passes', 'ab-on'];

function unescapeStop(text) {
  return text.replace(/\\(n|t|\\)/g, (_, c) => ({ n: '\n', t: '\t', '\\': '\\' })[c]);
}

function number(id, integer = false) {
  const value = $(id).value.trim();
  if (value === '') return undefined;
  const parsed = Number(value);
  if (!Number.isFinite(parsed) || (integer && !Number.isInteger(parsed))) throw new Error(`${id}: not a number`);
  return parsed;
}

const ui = {
  selected: null,
  chat: null,
  completion: null,

  select(reply) {
    this.selected = reply;
    this.refreshPanel();
  },

  refreshPanel() {
    $('stats').innerHTML = statsHtml(this.selected);
    drawChart($('chart'), this.selected);
  },

  sampling() {
    const body = {
      temperature: number('temperature'),
      top_p: number('top_p'),
      max_tokens: number('max_tokens', true),
      seed: number('seed', true),
    };
    const stops = $('stop-strings').value.split('\n').filter((s) => s !== '').map(unescapeStop);
    if (stops.length) body.stop = stops;
    return Object.fromEntries(Object.entries(body).filter(([, v]) => v !== undefined));
  },

  tools() {
    const text = $('tools').value.trim();
    if (!text) return {};
    try {
      return { tools: JSON.parse(text) };
    } catch (error) {
      throw new Error(`tools: not valid JSON (${error.message})`);
    }
  },

  renderMode() { return $('render').value; },
  abMethod() { return $('ab-on').checked ? $('ab-method').value : null; },

  flash(message) { // shown until the transcript is drawn again
    const note = document.createElement('p');
    note.className = 'error flash';
    note.textContent = message;
    $('transcript').append(note);
    note.scrollIntoView();
  },
};

function setMode(mode) {
  for (const button of document.querySelectorAll('.mode')) button.classList.toggle('active', button.dataset.mode === mode);
  $('chat-view').hidden = mode !== 'chat';
  $('completion-view').hidden = mode !== 'completion';
  document.querySelector('.layout').classList.toggle('no-side', mode !== 'chat');
  saveAll({ mode });
}

function applyToggles() {
  document.body.classList.toggle('no-origin', !$('mark-origin').checked);
  document.body.classList.toggle('show-passes', $('mark-passes').checked);
}

function saveAll(extra = {}) {
  const settings = { ...loadSettings(), ...extra };
  for (const id of FIELDS) settings[id] = $(id).value;
  for (const id of CHECKS) settings[id] = $(id).checked;
  saveSettings(settings);
}

function restoreSettings() {
  const settings = loadSettings();
  for (const id of FIELDS) if (typeof settings[id] === 'string') $(id).value = settings[id];
  for (const id of CHECKS) if (typeof settings[id] === 'boolean') $(id).checked = settings[id];
  return settings;
}

function askForKey(message) {
  return new Promise((resolve) => {
    const dialog = $('key-dialog');
    $('key-error').hidden = !message;
    $('key-error').textContent = message;
    $('key-input').value = '';
    dialog.returnValue = '';
    dialog.addEventListener('close', () => {
      resolve(dialog.returnValue === 'ok' ? $('key-input').value.trim() : '');
    }, { once: true });
    dialog.showModal();
  });
}

async function connect() {
  let status = await health();
  while (status !== 'ok') {
    $('health').className = 'health down';
    $('health').title = `/health: ${status}`;
    $('model').textContent = status === 'loading' ? 'loading the model…' : `server ${status}`;
    await new Promise((resolve) => setTimeout(resolve, 2000));
    status = await health();
  }
  $('health').className = 'health ok';
  $('health').title = '/health: ok';
  try {
    const models = await getJSON('/v1/models');
    $('model').textContent = models.data[0].id;
    $('model').dataset.ready = 'true';
  } catch (error) {
    $('model').textContent = error.message;
  }
  $('forget-key').hidden = !hasKey();
}

function main() {
  const settings = restoreSettings();
  applyToggles();
  onKeyNeeded(askForKey);
  ui.chat = new Chat(ui);
  ui.completion = new Completion(ui);
  for (const id of FIELDS) $(id).addEventListener('change', () => saveAll());
  for (const id of CHECKS) $(id).addEventListener('change', () => { applyToggles(); saveAll(); });
  $('render').addEventListener('change', () => ui.chat.render());
  for (const button of document.querySelectorAll('.mode')) button.addEventListener('click', () => setMode(button.dataset.mode));
  $('forget-key').addEventListener('click', () => { forgetKey(); $('forget-key').hidden = true; });
  setMode(settings.mode === 'completion' ? 'completion' : 'chat');
  ui.chat.render();
  ui.refreshPanel();
  connect();
}

main();
