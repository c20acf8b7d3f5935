// openai_client.js -- the router's OpenAI-compatible HTTP API driven by the official `openai`
// npm package (a client nobody here wrote), as docs/api.md shows it. Runs a fixed set of
// requests and prints one JSON object with what came back; test_openai_http.py checks it.
//   node openai_client.js BASE_URL MODEL PROMPT PROMPT_IDS_JSON [CHAT_BASE_URL CHAT_MODEL]
// BASE_URL is "http://127.0.0.1:PORT/v1"; PROMPT_IDS_JSON the prompt's token ids ("[1, ...]");
// CHAT_BASE_URL / CHAT_MODEL a router whose model has a chat template (chat requests there).
'use strict';
const OpenAI = require('openai');

const [baseURL, model, prompt, idsJson, chatURL, chatModel] = process.argv.slice(2);
// maxRetries 0: the SDK retries 429 and 5xx by itself, which would hide what the server said.
const client = new OpenAI({ baseURL, apiKey: 'unused', maxRetries: 0, timeout: 60000 });

// An error as the SDK reports it (APIError subclasses carry status and the error object).
function apiError(e) {
  return {
    class: e.constructor.name, status: e.status ?? null, message: e.message,
    type: e.type ?? null, param: e.param ?? null, code: e.code ?? null,
  };
}

async function attempt(fn) {
  try {
    return { ok: true, value: await fn() };
  } catch (e) {
    if (e instanceof OpenAI.APIError) return { ok: false, error: apiError(e) };
    throw e;
  }
}

// Reads a completions stream into {text per index, finish per index, chunks, usage, ids}.
async function drain(stream, chat) {
  const out = { text: {}, finish: {}, chunks: 0, usage: null, ids: new Set(), objects: new Set(),
                logprobs: {}, roles: {}, fingerprints: new Set(), usage_null: 0 };
  for await (const chunk of stream) {
    out.chunks++;
    out.ids.add(chunk.id);
    out.objects.add(chunk.object);
    out.fingerprints.add(chunk.system_fingerprint ?? null);
    if ('usage' in chunk && chunk.usage === null) out.usage_null++;
    if (chunk.usage) out.usage = chunk.usage;
    for (const c of chunk.choices) {
      const piece = chat ? (c.delta.content ?? '') : c.text;
      out.text[c.index] = (out.text[c.index] ?? '') + piece;
      if (chat && c.delta.role) out.roles[c.index] = c.delta.role;
      if (c.finish_reason) out.finish[c.index] = c.finish_reason;
      if (c.logprobs) {
        const l = out.logprobs[c.index] ??
          (out.logprobs[c.index] = { tokens: [], token_logprobs: [], top_logprobs: [] });
        if (chat) {
          for (const t of c.logprobs.content) {
            l.tokens.push(t.token);
            l.token_logprobs.push(t.logprob);
            l.top_logprobs.push(t.top_logprobs);
          }
        } else {
          l.tokens.push(...c.logprobs.tokens);
          l.token_logprobs.push(...c.logprobs.token_logprobs);
          l.top_logprobs.push(...c.logprobs.top_logprobs);
        }
      }
    }
  }
  out.ids = [...out.ids];
  out.objects = [...out.objects];
  out.fingerprints = [...out.fingerprints];
  return out;
}

async function main() {
  const r = {};
  const greedy = { model, prompt, max_tokens: 24, temperature: 0 };
  r.models = await attempt(async () => (await client.models.list()).data.map((m) => m.id));
  r.model = await attempt(() => client.models.retrieve(model));
  r.plain = await attempt(() => client.completions.create(greedy));
  r.stream = await attempt(async () => drain(await client.completions.create(
    { ...greedy, stream: true, stream_options: { include_usage: true } }), false));
  r.n2 = await attempt(() => client.completions.create(
    { model, prompt, max_tokens: 12, temperature: 1.0, n: 2, seed: 7 }));
  r.n2_stream = await attempt(async () => drain(await client.completions.create(
    { model, prompt, max_tokens: 12, temperature: 1.0, n: 2, seed: 7, stream: true }), false));
  r.stop = await attempt(() => client.completions.create({ ...greedy, stop: ['Lily', 'zzz'] }));
  r.stop_stream = await attempt(async () => drain(await client.completions.create(
    { ...greedy, stop: 'Lily', stream: true }), false));
  r.max3 = await attempt(() => client.completions.create({ ...greedy, max_tokens: 3 }));
  r.logprobs = await attempt(() => client.completions.create({ ...greedy, logprobs: 3 }));
  r.logprobs0_stream = await attempt(async () => drain(await client.completions.create(
    { ...greedy, logprobs: 0, stream: true }), false));
  r.logprobs_stream = await attempt(async () => drain(await client.completions.create(
    { ...greedy, logprobs: 3, stream: true }), false));
  r.logprobs_21 = await attempt(() => client.completions.create({ ...greedy, logprobs: 21 }));
  r.token_prompt = await attempt(() => client.completions.create(
    { ...greedy, prompt: JSON.parse(idsJson) }));
  r.bad_type = await attempt(() => client.completions.create({ ...greedy, max_tokens: 'five' }));
  r.bad_temp = await attempt(() => client.completions.create({ ...greedy, temperature: -1 }));
  r.temp3 = await attempt(() => client.completions.create({ ...greedy, temperature: 3 }));
  r.bad_model = await attempt(() => client.completions.create({ ...greedy, model: 'gpt-4o' }));
  r.too_long = await attempt(() => client.completions.create({ ...greedy, max_tokens: 100000 }));
  r.echo = await attempt(() => client.completions.create({ ...greedy, echo: true }));
  r.chat = await attempt(() => client.chat.completions.create(
    { model, messages: [{ role: 'user', content: 'Hello' }], max_completion_tokens: 8 }));
  r.chat_stream = await attempt(async () => drain(await client.chat.completions.create(
    { model, messages: [{ role: 'user', content: 'Hello' }], max_tokens: 8, stream: true }), true));
  if (chatURL) {
    const chat = new OpenAI({ baseURL: chatURL, apiKey: 'unused', maxRetries: 0, timeout: 60000 });
    const messages = [{ role: 'system', content: 'You tell stories.' },
                      { role: 'user', content: 'Tell me about a cat.' }];
    const greedyChat = { model: chatModel, messages, max_completion_tokens: 16, temperature: 0 };
    r.chat_plain = await attempt(() => chat.chat.completions.create(greedyChat));
    // the same messages with list-form content, as the SDKs send multi-part input
    r.chat_parts = await attempt(() => chat.chat.completions.create({ ...greedyChat,
      messages: messages.map((m) => ({ role: m.role, content: [{ type: 'text', text: m.content }] })) }));
    r.chat_stream2 = await attempt(async () => drain(await chat.chat.completions.create(
      { ...greedyChat, stream: true, stream_options: { include_usage: true } }), true));
    r.chat_n2 = await attempt(() => chat.chat.completions.create(
      { model: chatModel, messages, max_tokens: 10, temperature: 1.0, n: 2, seed: 7 }));
    r.chat_n2_stream = await attempt(async () => drain(await chat.chat.completions.create(
      { model: chatModel, messages, max_tokens: 10, temperature: 1.0, n: 2, seed: 7, stream: true,
        stream_options: { include_usage: true } }), true));
    r.chat_logprobs = await attempt(() => chat.chat.completions.create(
      { ...greedyChat, logprobs: true, top_logprobs: 3 }));
    r.chat_logprobs_stream = await attempt(async () => drain(await chat.chat.completions.create(
      { ...greedyChat, logprobs: true, top_logprobs: 3, stream: true }), true));
    r.chat_logprobs_only = await attempt(() => chat.chat.completions.create(
      { ...greedyChat, logprobs: true }));
    r.chat_top_21 = await attempt(() => chat.chat.completions.create(
      { ...greedyChat, logprobs: true, top_logprobs: 21 }));
    r.chat_stop = await attempt(() => chat.chat.completions.create({ ...greedyChat, stop: ['big'] }));
    r.chat_bad_role = await attempt(() => chat.chat.completions.create(
      { model: chatModel, messages: [{ role: 5, content: 'x' }] }));
  }
  console.log(JSON.stringify(r));
}

main().catch((e) => {
  console.log(JSON.stringify({ crash: String(e && e.stack || e) }));
  process.exit(1);
});
