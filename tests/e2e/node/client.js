// client.js -- pdserve's public API from Node.js with @grpc/grpc-js and @grpc/proto-loader
// (clients nobody here wrote), as docs/api.md shows it: streams one greedy completion and
// prints one JSON line {ok, code, details, token_ids, text, finish_reason}.
//   node client.js TARGET PROTO_DIR CA_FILE|- PROMPT MAX_TOKENS
// CA_FILE "-" connects in plaintext (the test expects that to fail on a TLS port).
'use strict';
const fs = require('fs');
const path = require('path');
const grpc = require('@grpc/grpc-js');
const protoLoader = require('@grpc/proto-loader');

const [target, protoDir, caFile, prompt, maxTokens] = process.argv.slice(2);
const def = protoLoader.loadSync(path.join(protoDir, 'pdserve/v1/generation.proto'), {
  keepCase: true, longs: String, enums: String, defaults: true, oneofs: true,
  includeDirs: [protoDir],
});
const pdserve = grpc.loadPackageDefinition(def).pdserve.v1;
const creds = caFile === '-' ? grpc.credentials.createInsecure()
                             : grpc.credentials.createSsl(fs.readFileSync(caFile));
const client = new pdserve.Generation(target, creds);

const out = { ok: false, code: 0, details: '', token_ids: [], text: '', finish_reason: '' };
const call = client.Generate({
  prompt,
  sampling: { temperature: 0 },
  stopping: { max_tokens: Number(maxTokens) },
}, { deadline: Date.now() + 30000 });
call.on('data', (r) => {
  out.token_ids.push(...r.token_ids);
  out.text += r.text;
  if (r.finish_reason !== 'FINISH_REASON_UNSPECIFIED') out.finish_reason = r.finish_reason;
});
call.on('error', (e) => {
  out.code = e.code;
  out.details = e.details;
});
call.on('status', (s) => {
  out.ok = s.code === grpc.status.OK;
  if (!out.code) out.code = s.code;
  console.log(JSON.stringify(out));
  client.close();
});
