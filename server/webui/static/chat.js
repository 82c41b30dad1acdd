// The chat view: conversations (sidebar), the transcript, sending, stop, regenerate, copy.

import { escapeHtml, codeOf } from './render.js';
import { abHtml, metaText, replyHtml } from './replyview.js';
import { runTraced } from './run.js';
import { loadConversations, newConversation, saveConversations } from './store.js';

const $ = (id) => document.getElementById(id);

export async function copyText(text) {
  try {
    await navigator.clipboard.writeText(text);
  } catch {
    const area = document.createElement('textarea');
    area.value = text;
    document.body.append(area);
    area.select();
    document.execCommand('copy');
    area.remove();
  }
}

export class Chat {
  constructor(ui) {
    this.ui = ui;
    this.conversations = loadConversations();
    this.current = this.conversations[0] || this.fresh();
    this.controller = null;
    $('new-chat').addEventListener('click', () => { this.current = this.fresh(); this.render(); });
    $('composer').addEventListener('submit', (event) => { event.preventDefault(); this.send(); });
    $('input').addEventListener('keydown', (event) => {
      if (event.key === 'Enter' && !event.shiftKey && !event.isComposing) { event.preventDefault(); this.send(); }
    });
    $('stop').addEventListener('click', () => this.controller && this.controller.abort());
    $('conversations').addEventListener('click', (event) => this.onSidebar(event));
    $('transcript').addEventListener('click', (event) => this.onTranscript(event));
  }

  fresh() {
    const conversation = newConversation();
    this.conversations.unshift(conversation);
    return conversation;
  }

  get busy() { return this.controller !== null; }

  // the request's messages: the system prompt, then the turns (an A/B turn continues with side A)
  history() {
    const system = $('system').value.trim();
    const messages = system ? [{ role: 'system', content: system }] : [];
    for (const m of this.current.messages) {
      if (m.role === 'user') { messages.push({ role: 'user', content: m.content }); continue; }
      const turn = { role: 'assistant', content: m.reply.content || null };
      const calls = m.reply.toolCalls.filter(Boolean);
      if (calls.length) turn.tool_calls = calls;
      messages.push(turn);
    }
    return messages;
  }

  // the request's settings, or null (and the reason shown) when one is not valid
  settings() {
    try {
      return { ...this.ui.sampling(), ...this.ui.tools() };
    } catch (error) {
      this.ui.flash(error.message);
      return null;
    }
  }

  async send() {
    const input = $('input');
    const text = input.value.trim();
    if (!text || this.busy) return;
    const settings = this.settings();
    if (settings === null) return;
    input.value = '';
    this.current.messages.push({ role: 'user', content: text });
    if (this.current.title === 'New chat') this.current.title = text.slice(0, 48);
    await this.reply(settings);
  }

  async regenerate() {
    const messages = this.current.messages;
    if (this.busy || !messages.length || messages[messages.length - 1].role !== 'assistant') return;
    const settings = this.settings();
    if (settings === null) return;
    messages.pop();
    await this.reply(settings);
  }

  async reply(settings) {
    const body = { ...settings, messages: this.history() };
    const message = { role: 'assistant' };
    this.current.messages.push(message);
    this.controller = new AbortController();
    this.setBusy(true);
    let element = null;
    const update = () => {
      element.innerHTML = this.messageInner(message, this.current.messages.length - 1, false);
      this.ui.refreshPanel();
    };
    try {
      await runTraced(true, body, this.ui.abMethod(), this.controller.signal, (a, b, seed) => {
        message.reply = a;
        if (b) message.compare = { method: b.label, seed, reply: b };
        this.ui.select(a);
        element = this.render().lastElementChild; // at once: the reply being written replaces any other
      }, update);
    } finally {
      this.controller = null;
      this.setBusy(false);
      saveConversations(this.conversations);
      this.render();
    }
  }

  setBusy(busy) {
    $('send').hidden = busy;
    $('stop').hidden = !busy;
  }

  messageInner(m, index, last) {
    const mode = this.ui.renderMode();
    if (m.role === 'user') return `<header class="who">you</header><div class="user-text">${escapeHtml(m.content)}</div>`;
    const actions = !this.isDone(m) ? '' : '<footer class="actions"><button type="button" data-act="copy">Copy</button>'
      + (last ? '<button type="button" data-act="regenerate">Regenerate</button>' : '') + '</footer>';
    if (m.compare) {
      return `<header class="who">assistant · A/B</header>${abHtml(m.reply, m.compare.reply, m.compare.seed, mode)}${actions}`;
    }
    return `<header class="who">assistant <span class="meta">${escapeHtml(metaText(m.reply))}</span></header>`
      + `<div class="reply" data-side="a">${replyHtml(m.reply, mode)}</div>${actions}`;
  }

  isDone(m) {
    return m.role === 'assistant' && m.reply.done && (!m.compare || m.compare.reply.done);
  }

  render() {
    const list = $('conversations');
    list.innerHTML = this.conversations.filter((c) => c.messages.length || c === this.current).map((c) => (
      `<li class="${c === this.current ? 'current' : ''}" data-id="${c.id}"><span class="title">${escapeHtml(c.title)}</span>`
      + '<button type="button" class="link" data-act="delete" aria-label="delete conversation">×</button></li>')).join('');
    const transcript = $('transcript');
    const messages = this.current.messages;
    transcript.innerHTML = messages.map((m, i) => (
      `<article class="msg ${m.role}${m.compare ? ' ab' : ''}" data-index="${i}"${this.isDone(m) ? ' data-done' : ''}>`
      + `${this.messageInner(m, i, i === messages.length - 1 && !this.busy)}</article>`
    )).join('') || '<p class="empty-chat">Ask something, or try <code>def quicksort(items):</code> — the built-in pair writes Python.</p>';
    transcript.scrollTop = transcript.scrollHeight;
    return transcript;
  }

  onSidebar(event) {
    const item = event.target.closest('li');
    if (!item || this.busy) return;
    const conversation = this.conversations.find((c) => c.id === item.dataset.id);
    if (event.target.dataset.act === 'delete') {
      this.conversations = this.conversations.filter((c) => c !== conversation);
      if (this.current === conversation) this.current = this.conversations[0] || this.fresh();
      saveConversations(this.conversations);
    } else {
      this.current = conversation;
    }
    this.render();
  }

  onTranscript(event) {
    const article = event.target.closest('article.assistant');
    if (!article) return;
    const message = this.current.messages[Number(article.dataset.index)];
    const side = event.target.closest('[data-side]');
    const reply = side && side.dataset.side === 'b' && message.compare ? message.compare.reply : message.reply;
    const act = event.target.dataset.act;
    if (event.target.classList.contains('copy-code')) copyText(codeOf(event.target));
    else if (act === 'copy') copyText(reply.content);
    else if (act === 'regenerate') this.regenerate();
    this.ui.select(reply);
  }
}
