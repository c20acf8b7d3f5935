// bench_tokenizer_hf.js -- HF tokenizers (npm tokenizers, the Node binding of the Rust crate)
// encode throughput on one thread, for comparison with `pdserve-tokenize --bench`: the same
// paragraphs (split after each blank line), the same FNV-1a hash of the ids.
// usage: RAYON_NUM_THREADS=1 TOKENIZERS_PARALLELISM=false node bench_tokenizer_hf.js TOKENIZER_JSON CORPUS [PASSES]
'use strict';
const fs = require('fs');
const { Tokenizer } = require('tokenizers');

async function main() {
  const [jsonPath, corpusPath, passesArg] = process.argv.slice(2);
  if (!jsonPath || !corpusPath) {
    console.error('usage: node bench_tokenizer_hf.js TOKENIZER_JSON CORPUS [PASSES]');
    process.exit(2);
  }
  const passes = parseInt(passesArg || '3', 10);
  let t0 = process.hrtime.bigint();
  const tok = Tokenizer.fromFile(jsonPath);
  const loadMs = Number(process.hrtime.bigint() - t0) / 1e6;
  const text = fs.readFileSync(corpusPath, 'utf8');
  const bytes = Buffer.byteLength(text, 'utf8');
  const docs = [];
  for (let i = 0; i < text.length;) {
    const k = text.indexOf('\n\n', i);
    const j = k < 0 ? text.length : k + 2;
    docs.push(text.slice(i, j));
    i = j;
  }
  const opts = { addSpecialTokens: false };
  const result = { tokenizer: jsonPath, bytes, docs: docs.length, load_ms: loadMs };

  // 1. one encode() per paragraph, awaited in turn (one request at a time, like a server)
  let best = Infinity, tokens = 0, hash = 0;
  for (let pass = 0; pass <= passes; pass++) {
    let h = 2166136261, n = 0;
    t0 = process.hrtime.bigint();
    for (const d of docs) {
      const ids = (await tok.encode(d, null, opts)).getIds();
      n += ids.length;
      for (const id of ids) h = Math.imul(h ^ id, 16777619) >>> 0;
    }
    const dt = Number(process.hrtime.bigint() - t0) / 1e9;
    if (pass > 0 && dt < best) best = dt; // pass 0 warms up
    tokens = n;
    hash = h;
  }
  result.tokens = tokens;
  result.ids_fnv1a = hash;
  result.encode_mb_per_s = +(bytes / 1e6 / best).toFixed(2);

  // 2. encodeBatch over all paragraphs (one thread: RAYON_NUM_THREADS=1 / TOKENIZERS_PARALLELISM=false)
  best = Infinity;
  for (let pass = 0; pass <= passes; pass++) {
    t0 = process.hrtime.bigint();
    const encs = await tok.encodeBatch(docs, opts);
    let n = 0;
    for (const e of encs) n += e.getIds().length;
    const dt = Number(process.hrtime.bigint() - t0) / 1e9;
    if (pass > 0 && dt < best) best = dt;
    if (n !== tokens) throw new Error(`encodeBatch gave ${n} tokens, encode ${tokens}`);
  }
  result.batch_mb_per_s = +(bytes / 1e6 / best).toFixed(2);
  result.mb_per_s = Math.max(result.encode_mb_per_s, result.batch_mb_per_s);
  console.log(JSON.stringify(result));
}

main().catch((e) => {
  console.error(e);
  process.exit(1);
});
