// The page's calls to this server: the API key (asked for on a 401, kept in sessionStorage only),
// JSON requests and streamed (SSE) requests.

const KEY = 'specexec.apiKey';
let askKey = null; // async (message) -> key, set by the page

export function onKeyNeeded(ask) { askKey = ask; }
export function hasKey() { return Boolean(sessionStorage.getItem(KEY)); }
export function forgetKey() { sessionStorage.removeItem(KEY); }

function headers(json) {
  const out = {};
  if (json) out['Content-Type'] = 'application/json';
  const key = sessionStorage.getItem(KEY);
  if (key) out.Authorization = `Bearer ${key}`;
  return out;
}

export class APIError extends Error {
  constructor(status, message) { super(message); this.status = status; }
}

async function errorOf(response) {
  let message = `${response.status} ${response.statusText}`;
  try {
    const body = await response.json();
    if (body && body.error) message = body.error.message || String(body.error);
  } catch { /* not JSON */ }
  return new APIError(response.status, message);
}

const KEY_ATTEMPTS = 3;

// fetch with the key; a 401 asks for the key and retries (KEY_ATTEMPTS times at most)
async function call(path, init) {
  for (let attempt = 0; ; attempt += 1) {
    const response = await fetch(path, { ...init, headers: headers(init.body !== undefined) });
    if (response.status !== 401 || attempt >= KEY_ATTEMPTS || askKey === null) return response;
    const error = await errorOf(response);
    const key = await askKey(hasKey() ? 'That key was not accepted.' : '');
    if (!key) throw error;
    sessionStorage.setItem(KEY, key);
  }
}

export async function getJSON(path) {
  const response = await call(path, { method: 'GET' });
  if (!response.ok) throw await errorOf(response);
  return response.json();
}

// POST body with stream: true; onChunk(json) for every `data:` event until [DONE]
export async function streamJSON(path, body, onChunk, signal) {
  const response = await call(path, { method: 'POST', body: JSON.stringify(body), signal });
  if (!response.ok) throw await errorOf(response);
  const reader = response.body.getReader();
  const decoder = new TextDecoder();
  let buffer = '';
  for (;;) {
    const { value, done } = await reader.read();
    buffer += decoder.decode(value || new Uint8Array(), { stream: !done });
    let end;
    while ((end = buffer.indexOf('\n\n')) >= 0) {
      const event = buffer.slice(0, end);
      buffer = buffer.slice(end + 2);
      for (const line of event.split('\n')) {
        if (!line.startsWith('data: ')) continue; // `: ping` comments
        const data = line.slice(6);
        if (data === '[DONE]') return;
        onChunk(JSON.parse(data));
      }
    }
    if (done) return;
  }
}

export async function health() {
  try {
    const response = await fetch('/health');
    return response.ok ? 'ok' : ((await response.json()).status || 'down');
  } catch {
    return 'unreachable';
  }
}
