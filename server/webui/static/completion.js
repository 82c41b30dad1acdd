// The completion view: a prompt in, its continuation out (/v1/completions), shown after the prompt as
// highlighted code with each token marked by its origin; with A/B, both runs side by side.

import { codeOf, escapeHtml } from './render.js';
import { abHtml, metaText, replyHtml } from './replyview.js';
import { runTraced } from './run.js';
import { copyText } from './chat.js';

const $ = (id) => document.getElementById(id);

export class Completion {
  constructor(ui) {
    this.ui = ui;
    this.controller = null;
    this.result = null; // {prompt, a, b, seed}
    $('run').addEventListener('click', () => this.run());
    $('run-stop').addEventListener('click', () => this.controller && this.controller.abort());
    $('prompt').addEventListener('keydown', (event) => {
      if (event.key === 'Enter' && (event.ctrlKey || event.metaKey)) { event.preventDefault(); this.run(); }
    });
    $('completion-out').addEventListener('click', (event) => {
      if (!this.result) return;
      if (event.target.classList.contains('copy-code')) copyText(codeOf(event.target));
      const side = event.target.closest('[data-side]');
      const reply = side && side.dataset.side === 'b' && this.result.b ? this.result.b : this.result.a;
      if (event.target.dataset.act === 'copy') copyText(reply.content);
      this.ui.select(reply);
    });
  }

  async run() {
    const prompt = $('prompt').value;
    if (!prompt || this.controller) return;
    let body;
    try {
      body = { ...this.ui.sampling(), prompt };
    } catch (error) {
      this.result = null;
      $('completion-out').innerHTML = `<p class="error">${escapeHtml(error.message)}</p>`;
      return;
    }
    this.controller = new AbortController();
    $('run').hidden = true;
    $('run-stop').hidden = false;
    const update = () => { this.render(); this.ui.refreshPanel(); };
    try {
      await runTraced(false, body, this.ui.abMethod(), this.controller.signal, (a, b, seed) => {
        this.result = { prompt, a, b, seed };
        this.ui.select(a);
        this.render();
      }, update);
    } finally {
      this.controller = null;
      $('run').hidden = false;
      $('run-stop').hidden = true;
      this.render();
    }
  }

  render() {
    const out = $('completion-out');
    if (!this.result) { out.innerHTML = ''; return; }
    const { prompt, a, b, seed } = this.result;
    const done = a.done && (!b || b.done) && !this.controller;
    const actions = done ? '<footer class="actions"><button type="button" data-act="copy">Copy continuation</button></footer>' : '';
    const attrs = done ? ' data-done' : '';
    if (b) {
      out.innerHTML = `<article class="msg assistant ab"${attrs}>${abHtml(a, b, seed, 'code', prompt)}${actions}</article>`;
      return;
    }
    out.innerHTML = `<article class="msg assistant"${attrs}><header class="who">continuation <span class="meta">${escapeHtml(metaText(a))}</span></header>`
      + `<div class="reply" data-side="a">${replyHtml(a, 'code', prompt)}</div>${actions}</article>`;
  }
}
