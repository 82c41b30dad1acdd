// One streamed reply: its text, tool calls, the speculation trace (token marks and passes) and the
// response's timings; its statistics come from the trace alone, so they can be checked against timings.

export class Reply {
  constructor(label = '') {
    this.label = label; // e.g. the method an A/B side asked for
    this.content = '';
    this.toolCalls = [];
    this.marks = []; // {start, end, origin, pass, first, index}: a token's characters in the raw text
    this.passes = []; // the trace's pass entries, in order
    this.rawLength = 0; // characters of the trace's tokens so far
    this.numTokens = 0;
    this.numDraft = 0;
    this.method = null;
    this.timings = null;
    this.finish = null;
    this.error = null;
    this.done = false;
  }

  onChunk(chunk, chat) {
    if (chunk.error) { this.error = chunk.error.message || String(chunk.error); return; }
    const choice = chunk.choices && chunk.choices[0];
    if (!choice) return; // the usage chunk
    if (chat) {
      const delta = choice.delta || {};
      if (delta.content) this.content += delta.content;
      if (delta.tool_calls) this.addToolCalls(delta.tool_calls);
    } else if (choice.text) {
      this.content += choice.text;
    }
    if (choice.specexec) this.addTrace(choice.specexec);
    if (choice.finish_reason) this.finish = choice.finish_reason;
    if (chunk.timings) this.timings = chunk.timings;
  }

  addToolCalls(entries) {
    for (const entry of entries) {
      let call = this.toolCalls[entry.index];
      if (!call) {
        call = { id: entry.id, type: 'function', function: { name: '', arguments: '' } };
        this.toolCalls[entry.index] = call;
      }
      if (entry.function && entry.function.name) call.function.name += entry.function.name;
      if (entry.function && entry.function.arguments) call.function.arguments += entry.function.arguments;
    }
  }

  addTrace(trace) {
    if (trace.method) this.method = trace.method;
    for (const token of trace.tokens) {
      const length = token.text.length;
      if (length) {
        const last = this.marks[this.marks.length - 1];
        const first = !last || last.pass !== token.pass;
        this.marks.push({ start: this.rawLength, end: this.rawLength + length, origin: token.origin, pass: token.pass, first, index: this.numTokens });
      }
      this.rawLength += length;
      this.numTokens += 1;
      if (token.origin === 'draft') this.numDraft += 1;
    }
    for (const entry of trace.passes) this.passes.push(entry);
  }

  // marks apply to the content only while content is the raw text (tool-call markup is not content)
  get visibleMarks() {
    return this.toolCalls.length ? [] : this.marks;
  }

  stats() {
    const passes = this.passes;
    const count = passes.length;
    const sum = (f) => passes.reduce((total, p) => total + f(p), 0);
    const drafted = sum((p) => p.tree_size - 1);
    // as the server's timings: the first pass (it also wrote the prompt) is the prefill's time
    const decodeMs = count > 1 ? sum((p) => p.step_ms) - passes[0].step_ms : (count ? passes[0].step_ms : 0);
    return {
      method: this.method,
      passes: count,
      tokens: this.numTokens,
      draft: this.numDraft,
      target: this.numTokens - this.numDraft,
      perPass: count ? this.numTokens / count : 0,
      meanTree: count ? sum((p) => p.tree_size) / count : 0,
      acceptance: drafted ? sum((p) => p.accepted) / drafted : null,
      tokPerSec: decodeMs > 0 ? this.numTokens / (decodeMs / 1000) : 0,
      firstTokenMs: count ? passes[0].time_ms : null,
      prefillMs: this.timings ? this.timings.prompt_ms : null,
    };
  }

  // whether the trace agrees with the response's timings (null until they came)
  agreesWithTimings() {
    if (!this.timings) return null;
    const s = this.stats();
    return s.passes === this.timings.target_passes && s.draft === this.timings.draft_tokens_accepted
      && s.tokens === this.timings.predicted_n;
  }

  toJSON() {
    const { label, content, toolCalls, passes, numTokens, numDraft, method, timings, finish, error } = this;
    const marks = this.marks.map((m) => [m.end - m.start, m.origin === 'draft' ? 1 : 0, m.pass, m.index]);
    return { label, content, toolCalls, marks, rawLength: this.rawLength, passes, numTokens, numDraft, method, timings, finish, error };
  }

  static fromJSON(data) {
    const reply = Object.assign(new Reply(), data, { marks: [], done: true });
    let start = 0;
    let lastPass = null;
    for (const [length, draft, pass, index] of data.marks || []) {
      // contiguous: a token without characters has no mark
      reply.marks.push({ start, end: start + length, origin: draft ? 'draft' : 'target', pass, first: pass !== lastPass, index });
      start += length;
      lastPass = pass;
    }
    return reply;
  }
}
