// What the page keeps in this browser: conversations and settings in localStorage (never the API key:
// that is sessionStorage, api.js). Replies are kept with their traces, so the marks survive a reload.

import { Reply } from './reply.js';

const CONVERSATIONS = 'specexec.conversations';
const SETTINGS = 'specexec.settings';
const MAX_CONVERSATIONS = 50;

function read(key, fallback) {
  try {
    const value = JSON.parse(localStorage.getItem(key));
    return value === null ? fallback : value;
  } catch {
    return fallback;
  }
}

function write(key, value) {
  try {
    localStorage.setItem(key, JSON.stringify(value));
  } catch { /* storage full or off: the page works without it */ }
}

export function newConversation() {
  return { id: `c${Date.now().toString(36)}${Math.random().toString(36).slice(2, 6)}`, title: 'New chat', messages: [] };
}

export function loadConversations() {
  return read(CONVERSATIONS, []).map((c) => ({
    ...c,
    messages: c.messages.map((m) => (m.role !== 'assistant' ? m : {
      ...m,
      reply: Reply.fromJSON(m.reply),
      compare: m.compare ? { ...m.compare, reply: Reply.fromJSON(m.compare.reply) } : undefined,
    })),
  }));
}

export function saveConversations(conversations) {
  const kept = conversations.filter((c) => c.messages.length).slice(0, MAX_CONVERSATIONS);
  write(CONVERSATIONS, kept);
}

export function loadSettings() {
  return read(SETTINGS, {});
}

export function saveSettings(settings) {
  write(SETTINGS, settings);
}
