#!/usr/bin/python3
"""test_openai_http.py -- The router's OpenAI-compatible HTTP API (--http-listen, issue #30):
decode + prefill + router on stories260k, driven by the official `openai` npm package
(tests/e2e/node/openai_client.js; npm ci of tests/e2e/node the first time) and by raw HTTP:

  - completions, plain and streamed: the greedy text, finish reason and usage equal the gRPC
    Generate result for the same prompt (text and token-id prompts); n=2 gives the choices of
    seeds seed and seed+1; stop strings; max_tokens; logprobs (the chosen token's, equal to
    gRPC's); /v1/models; type errors, unknown model, unsupported fields in OpenAI's error shape
  - chat: 400 on stories260k (no chat template); a copy of its model directory with an HF-style
    template in tokenizer_config.json (checked against jinja2 where installed): the reply equals
    gRPC Generate of the rendered text tokenized without added special tokens (one BOS), plain,
    streamed (role first), n=2, logprobs, stop strings; the template's raise_exception is a 400.
    A build without the chat template module answers 501, and only that is checked
  - raw: system_fingerprint in bodies and every chunk ("usage": null in all chunks but the
    usage chunk), OpenAI's ranges of temperature / top_p / penalties as 400 naming the field,
    content parts (text joined with newlines, an image_url part a 400 naming its type);
    n = 2 with logprobs 3, plain and streamed: each choice's logprobs and top_logprobs
    are those of the generation with seed + j alone (gRPC);
    SSE framing (data: lines, blank-line separated, data: [DONE] last), bad JSON, 404,
    405 with Allow, 413 (Content-Length and a chunked upload), /health, /metrics families
  - a client that hangs up mid-stream or while waiting for a plain answer: its calls are
    cancelled (router in flight back to 0, decode's KV blocks free); X-Stainless-Timeout as the
    deadline (504); RESOURCE_EXHAUSTED as 429; no decode instance as 503 (health too);
    PDSERVE_HTTP_LISTEN; draining answers 503; every process exits 0 after SIGTERM (leak-free
    under ASan)

Without node, npm or the npm registry the openai-package part skips (the rest still runs) and
the test says so. usage: test_openai_http.py BIN_DIR SHARED_DIR PROTO_DIR"""
import http.client, json, os, re, shutil, signal, socket, subprocess, sys, time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import e2e_util as eu

H = eu.Harness(sys.argv, log_level="warn")
pb, pbg, check = H.pb, H.pbg, H.check
import grpc

NODE_DIR = os.path.join(HERE, "node")
PROMPT = "Once upon a time"


def node_ready():
    """Returns (node path, None) or (None, why not)."""
    node, npm = shutil.which("node"), shutil.which("npm")
    if not node or not npm:
        return None, "node or npm missing (Debian: apt-get install nodejs npm)"
    ok = lambda: subprocess.run([node, "-e", "require('openai')"], cwd=NODE_DIR, stdout=subprocess.PIPE,
                                stderr=subprocess.STDOUT).returncode == 0
    if not ok():
        r = subprocess.run([npm, "ci", "--no-audit", "--no-fund", "--ignore-scripts"], cwd=NODE_DIR,
                           stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=600)
        if r.returncode != 0 or not ok():
            last = r.stdout.strip().splitlines()[-1] if r.stdout.strip() else "no output"
            return None, "npm ci of the openai package failed (offline?): " + last
    return node, None


# A chat template in the style of HF's (bos_token, raise_exception), on stories260k's weights.
CHAT_TEMPLATE = ("{{ bos_token }}{% for m in messages %}{% if m['role'] == 'system' %}[SYS] {{ m['content'] }}\n"
                 "{% elif m['role'] == 'user' %}[USER] {{ m['content'] }}\n{% elif m['role'] == 'assistant' %}"
                 "[BOT] {{ m['content'] }}{{ eos_token }}\n{% else %}{{ raise_exception('unknown role ' + m['role']) }}"
                 "{% endif %}{% endfor %}{% if add_generation_prompt %}[BOT]{% endif %}")
CHAT_MESSAGES = [{"role": "system", "content": "You tell stories."}, {"role": "user", "content": "Tell me about a cat."}]


def render_reference(messages):
    """The template's text as HF renders it (jinja2 when installed; the same by hand)."""
    by_hand = "<s>[SYS] You tell stories.\n[USER] Tell me about a cat.\n[BOT]"
    try:
        import jinja2.sandbox
    except ImportError:
        return by_hand
    env = jinja2.sandbox.ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
    text = env.from_string(CHAT_TEMPLATE).render(messages=messages, bos_token="<s>", eos_token="</s>",
                                                 add_generation_prompt=True)
    check(text == by_hand, "jinja2 renders the test template as expected")
    return text


def start_router(*args, env=None, tag="router"):
    p = H.start("pdserve-router", *args, tag=tag, env=env)
    line = p.p.stdout.readline()
    if not line.startswith("HTTP_PORT "):
        raise SystemExit("router printed no HTTP_PORT: %r %s" % (line, open(p.log).read()[-2000:]))
    p.hport = int(line.split()[1])
    return p


def request(port, method, path, body=None, headers=None, timeout=60):
    """Returns (status, headers dict (lowercase), body text)."""
    c = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)
    data = body if isinstance(body, (bytes, type(None))) else (body if isinstance(body, str) else json.dumps(body))
    h = {"Content-Type": "application/json"}
    h.update(headers or {})
    c.request(method, path, body=data, headers=h)
    r = c.getresponse()
    text = r.read().decode()
    hdrs = {k.lower(): v for k, v in r.getheaders()}
    c.close()
    return r.status, hdrs, text


def is_error_shape(text, status_type=None):
    try:
        e = json.loads(text)["error"]
    except (ValueError, KeyError, TypeError):
        return False
    return set(e) == {"message", "type", "param", "code"} and isinstance(e["message"], str) and \
        (status_type is None or e["type"] == status_type)


def grpc_gen(router, **kw):
    stub = pbg.GenerationStub(grpc.insecure_channel("127.0.0.1:%d" % router.port))
    ids, text, fin, usage, lps, tops = [], "", 0, None, [], []
    for r in stub.Generate(pb.GenerateRequest(**kw), timeout=60):
        ids += list(r.token_ids)
        text += r.text
        lps += [lp.logprob for lp in r.logprobs]
        tops += [[(t.token_id, t.logprob) for t in lp.top] for lp in r.logprobs]
        if r.finish_reason:
            fin, usage = r.finish_reason, r.usage
    return {"ids": ids, "text": text, "finish": {1: "length", 2: "stop", 3: "stop"}.get(fin),
            "usage": usage, "lps": lps, "tops": tops}


def same_values(got, want, tol=1e-4):
    return len(got) == len(want) and all(abs(a - b) < tol for a, b in zip(got, want))


def completions_tops_ok(tops, tokens, lps, g, n):
    """Completions' top_logprobs: per token a dict of the n alternatives' texts (the chosen
    token's included) whose values are gRPC's top n, largest first; the chosen token's text
    with its logprob. Positions where two alternatives share a text (the dict keeps one) may
    have fewer keys. Returns (ok, positions with all n)."""
    full = 0
    if len(tops) != len(g["tops"]):
        return False, 0
    for d, tok, lp, want in zip(tops, tokens, lps, g["tops"]):
        if tok not in d or abs(d[tok] - lp) > 1e-4 or len(d) > n + 1:
            return False, full
        vals = sorted(d.values(), reverse=True)
        wv = [v for _, v in want]
        if len(d) >= n and len(wv) == n:
            extra = [v for v in vals if not any(abs(v - w) < 1e-4 for w in wv)]
            if len(extra) > 1 or (extra and abs(extra[0] - lp) > 1e-4):
                return False, full
            full += 1
    return True, full


def chat_tops_ok(content_tops, tokens, g, n):
    """Chat's top_logprobs: n entries a token, gRPC's values in order, each with the UTF-8
    bytes of its text, the chosen token (when listed) under its own text."""
    if len(content_tops) != len(g["tops"]):
        return False
    for top, tok, chosen, want in zip(content_tops, tokens, g["ids"], g["tops"]):
        if len(top) != n or not same_values([t["logprob"] for t in top], [v for _, v in want]):
            return False
        for t, (wid, _) in zip(top, want):
            if bytes(t["bytes"]) != t["token"].encode() or (wid == chosen and t["token"] != tok):
                return False
    return True


def sampling(temperature=0.0, seed=None):
    return pb.SamplingParams(temperature=temperature, seed=seed) if seed is not None else \
        pb.SamplingParams(temperature=temperature)


def quiet(router, dec):
    s, d = eu.Scrape(router.mport), eu.Scrape(dec.mport)
    return (s.get("pdserve_requests_in_flight") == 0 and s.get("pdserve_http_requests_in_flight") == 0
            and d.get("pdserve_kv_cache_used_blocks") == 0 and d.get("pdserve_sequences_running") == 0)


def raw_stream_then_hang_up(port, body, first_event):
    """POSTs body on a raw socket; with first_event reads until the first SSE event, else
    waits 0.3 s; then closes the socket. Returns what was read."""
    s = socket.create_connection(("127.0.0.1", port), timeout=10)
    data = json.dumps(body).encode()
    s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
              b"Content-Length: %d\r\n\r\n" % len(data) + data)
    got = b""
    if first_event:
        while b"data: " not in got:
            chunk = s.recv(4096)
            if not chunk:
                break
            got += chunk
    else:
        time.sleep(0.3)
    s.close()
    return got.decode(errors="replace")


try:
    common = ["--model", H.model, "--listen", "127.0.0.1:0", "--metrics-port", "0"]
    # A decode step of 10 ms more: long generations last long enough to hang up in.
    dec = H.start("pdserve-decode", *common, tag="decode", env=dict(H.env, PDSERVE_FAULT_STEP_DELAY_MS="10"))
    pre = H.start("pdserve-prefill", *common, tag="prefill")
    inst = ["--prefill", "127.0.0.1:%d" % pre.port, "--decode", "127.0.0.1:%d" % dec.port]
    router = start_router(*common, *inst, "--http-listen", "127.0.0.1:0")
    eu.wait_until(lambda: request(router.hport, "GET", "/health")[0] == 200, 10)
    name = os.path.basename(H.model)
    stub = pbg.GenerationStub(grpc.insecure_channel("127.0.0.1:%d" % router.port))
    prompt_ids = list(stub.Tokenize(pb.TokenizeRequest(text=PROMPT, add_special_tokens=True)).token_ids)

    # ---- chat: a model directory with a chat template (stories260k's weights) ----
    st, _, body = request(router.hport, "POST", "/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}]})
    chat_built = st != 501
    chat = chat_ref = None
    if not chat_built:
        print("chat: this build has no chat template module (501): only that is checked")
    else:
        cdir = os.path.join(H.tmp, "chat-model")
        os.makedirs(cdir)
        for f in ("config.json", "generation_config.json", "tokenizer.json"):
            shutil.copy(os.path.join(H.model, f), cdir)
        tc = json.load(open(os.path.join(H.model, "tokenizer_config.json")))
        tc["chat_template"] = CHAT_TEMPLATE
        json.dump(tc, open(os.path.join(cdir, "tokenizer_config.json"), "w"))
        chat = start_router(*common, *inst, "--model", cdir, "--http-listen", "127.0.0.1:0", tag="router-chat")
        eu.wait_until(lambda: request(chat.hport, "GET", "/health")[0] == 200, 10)
        text = render_reference(CHAT_MESSAGES)
        cstub = pbg.GenerationStub(grpc.insecure_channel("127.0.0.1:%d" % chat.port))
        ids = list(cstub.Tokenize(pb.TokenizeRequest(text=text, add_special_tokens=False)).token_ids)
        check(ids[:1] == [1] and ids[1:2] != [1], "the reference conversation has one BOS (%s...)" % ids[:4])
        chat_ref = {"ids": ids, "greedy": grpc_gen(chat, prompt_token_ids=ids, sampling=sampling(),
                                                   stopping=pb.StoppingCriteria(max_tokens=16), logprobs=3)}
        # gRPC clients chat through GenerateRequest.messages: the same prompt, the same tokens.
        gm = grpc_gen(chat, messages=[pb.ChatMessage(role=m["role"], content=m["content"])
                                      for m in CHAT_MESSAGES],
                      sampling=sampling(), stopping=pb.StoppingCriteria(max_tokens=16), logprobs=1)
        check(gm["ids"] == chat_ref["greedy"]["ids"] and gm["usage"].prompt_tokens == len(ids),
              "gRPC messages: rendered and tokenized as the reference (%d prompt tokens), the "
              "same greedy tokens" % gm["usage"].prompt_tokens)
        try:
            grpc_gen(chat, messages=[pb.ChatMessage(role="tool", content="x")])
            check(False, "gRPC messages: raise_exception in the template is refused")
        except grpc.RpcError as e:
            check(e.code() == grpc.StatusCode.INVALID_ARGUMENT and "unknown role" in e.details(),
                  "gRPC messages: raise_exception -> INVALID_ARGUMENT (%s)" % e.details())
        try:
            grpc_gen(router, messages=[pb.ChatMessage(role="user", content="x")])
            check(False, "gRPC messages without a template are refused")
        except grpc.RpcError as e:
            check(e.code() == grpc.StatusCode.FAILED_PRECONDITION,
                  "gRPC messages on a model without a chat template: FAILED_PRECONDITION (%s)" % e.details())

    # ---- the openai npm package ----
    node, why = node_ready()
    if not node:
        print("openai package part skipped: " + why)
    else:
        extra = ["http://127.0.0.1:%d/v1" % chat.hport, "chat-model"] if chat else []
        r = subprocess.run([node, os.path.join(NODE_DIR, "openai_client.js"),
                            "http://127.0.0.1:%d/v1" % router.hport, name, PROMPT, json.dumps(prompt_ids)] + extra,
                           cwd=NODE_DIR, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, timeout=300)
        try:
            o = json.loads(r.stdout.strip().splitlines()[-1])
        except (ValueError, IndexError):
            o = {"crash": "exit %d: %s %s" % (r.returncode, r.stdout[-2000:], r.stderr[-2000:])}
        check("crash" not in o, "the openai client ran (%s)" % o.get("crash", "ok"))
        o.pop("crash", None)
        ok = lambda k: o.get(k, {}).get("ok") and o[k]["value"]
        err = lambda k: (o.get(k) or {}).get("error") or {}
        g = grpc_gen(router, prompt=PROMPT, sampling=sampling(),
                     stopping=pb.StoppingCriteria(max_tokens=24), logprobs=3)
        check(ok("models") == [name], "models.list() -> [%s] (%s)" % (name, o.get("models")))
        check((ok("model") or {}).get("id") == name, "models.retrieve(%s)" % name)
        v = ok("plain") or {}
        c0 = (v.get("choices") or [{}])[0]
        check(c0.get("text") == g["text"] and c0.get("finish_reason") == g["finish"],
              "completions: the greedy text equals gRPC Generate's (%r / %r)" % (c0.get("text"), g["text"]))
        u = v.get("usage") or {}
        check(u.get("prompt_tokens") == g["usage"].prompt_tokens and u.get("completion_tokens") == len(g["ids"])
              and u.get("total_tokens") == u.get("prompt_tokens", 0) + u.get("completion_tokens", 0),
              "completions: usage %s" % u)
        check(v.get("id", "").startswith("cmpl-") and v.get("object") == "text_completion" and
              v.get("model") == name and isinstance(v.get("created"), int), "completions: id, object, model, created")
        fp = v.get("system_fingerprint")
        check(isinstance(fp, str) and fp != "", "completions: a system_fingerprint (%r)" % fp)
        v = ok("stream") or {}
        check(v.get("fingerprints") == [fp], "streamed: every chunk the same system_fingerprint (%s)" % v.get("fingerprints"))
        check(v.get("chunks", 0) > 1 and v.get("usage_null") == v.get("chunks", 0) - 1,
              "streamed with include_usage: usage null in every chunk but the last (%s of %s)"
              % (v.get("usage_null"), v.get("chunks")))
        check(v.get("text", {}).get("0") == g["text"] and v.get("finish", {}).get("0") == g["finish"],
              "streamed: the same text in %s chunks" % v.get("chunks"))
        check(len(v.get("ids", [])) == 1 and v.get("objects") == ["text_completion"] and
              (v.get("usage") or {}).get("completion_tokens") == len(g["ids"]),
              "streamed: one id, include_usage's final usage chunk (%s)" % v.get("usage"))
        want = [grpc_gen(router, prompt=PROMPT, sampling=sampling(1.0, seed),
                         stopping=pb.StoppingCriteria(max_tokens=12))["text"] for seed in (7, 8)]
        v = ok("n2") or {}
        got = [c.get("text") for c in sorted(v.get("choices", []), key=lambda c: c["index"])]
        check(got == want and (v.get("usage") or {}).get("prompt_tokens") == len(prompt_ids),
              "n=2 (one Generate call with n = 2): choices 0 and 1 are the generations of seed 7 "
              "and 8 (%r)" % got)
        v = ok("n2_stream") or {}
        check([v.get("text", {}).get(k) for k in ("0", "1")] == want, "n=2 streamed: the same two texts")
        gs = grpc_gen(router, prompt=PROMPT, sampling=sampling(),
                      stopping=pb.StoppingCriteria(max_tokens=24, stop=["Lily", "zzz"]))
        c0 = ((ok("stop") or {}).get("choices") or [{}])[0]
        check(c0.get("text") == gs["text"] and c0.get("finish_reason") == "stop" and "Lily" not in gs["text"],
              "stop strings: %r, finish_reason stop" % c0.get("text"))
        v = ok("stop_stream") or {}
        check(v.get("text", {}).get("0") == gs["text"] and v.get("finish", {}).get("0") == "stop",
              "stop string streamed (stop as a string)")
        v = ok("max3") or {}
        check((v.get("usage") or {}).get("completion_tokens") == 3 and v["choices"][0]["finish_reason"] == "length",
              "max_tokens 3: 3 tokens, finish_reason length")
        c0 = ((ok("logprobs") or {}).get("choices") or [{}])[0]
        lp = c0.get("logprobs") or {}
        offs = [sum(len(t.encode()) for t in lp.get("tokens", [])[:k]) for k in range(len(g["ids"]))]
        check(len(lp.get("token_logprobs", [])) == len(g["ids"]) and "".join(lp.get("tokens", [])) == c0.get("text")
              and same_values(lp.get("token_logprobs", []), g["lps"]) and lp.get("text_offset") == offs,
              "logprobs 3: one per token, the tokens spell the text, values equal gRPC's, text_offset")
        tok_ok, full = completions_tops_ok(lp.get("top_logprobs", []), lp.get("tokens", []),
                                           lp.get("token_logprobs", []), g, 3)
        check(tok_ok and full >= len(g["ids"]) // 2,
              "logprobs 3: top_logprobs {text: logprob} of gRPC's 3 alternatives (+ the chosen token), "
              "the chosen token's own text (%d of %d positions with 3 distinct texts)" % (full, len(g["ids"])))
        check(all(max(d.values()) == d[t] for d, t in zip(lp.get("top_logprobs", []), lp.get("tokens", []))),
              "logprobs 3, greedy: the chosen token is the likeliest of its dict")
        v = ok("logprobs0_stream") or {}
        l0 = (v.get("logprobs") or {}).get("0", {})
        check(same_values(l0.get("token_logprobs", []), g["lps"]) and
              all(list(d) == [t] for d, t in zip(l0.get("top_logprobs", []), l0.get("tokens", []))),
              "logprobs 0 streamed: the chosen token's logprob in the chunks, top_logprobs itself only")
        v = ok("logprobs_stream") or {}
        l3 = (v.get("logprobs") or {}).get("0", {})
        check(same_values(l3.get("token_logprobs", []), g["lps"]) and
              completions_tops_ok(l3.get("top_logprobs", []), l3.get("tokens", []),
                                  l3.get("token_logprobs", []), g, 3)[0] and
              "".join(l3.get("tokens", [])) == g["text"],
              "logprobs 3 streamed: the chunks carry their tokens' logprobs and alternatives")
        e = err("logprobs_21")
        check(e.get("status") == 400 and e.get("param") == "logprobs" and e.get("type") == "invalid_request_error",
              "logprobs 21: 400 invalid_request_error naming logprobs (%s)" % e.get("message"))
        c0 = ((ok("token_prompt") or {}).get("choices") or [{}])[0]
        check(c0.get("text") == g["text"], "a token-id prompt gives the same text")
        e = err("bad_type")
        check(e.get("status") == 400 and e.get("param") == "max_tokens" and e.get("type") == "invalid_request_error"
              and e.get("class") == "BadRequestError", "max_tokens as a string: 400 naming the param (%s)" % e)
        e = err("bad_temp")
        check(e.get("status") == 400 and "temperature" in e.get("message", ""), "temperature -1: 400 (%s)" % e.get("message"))
        e = err("temp3")
        check(e.get("status") == 400 and e.get("param") == "temperature",
              "temperature 3: 400 naming temperature (OpenAI's range is 0 - 2) (%s)" % e.get("message"))
        e = err("bad_model")
        check(e.get("status") == 404 and e.get("code") == "model_not_found" and e.get("class") == "NotFoundError",
              "an unknown model: 404 model_not_found")
        e = err("too_long")
        check(e.get("status") == 400 and "maximum length" in e.get("message", ""), "max_tokens over the model length: 400")
        e = err("echo")
        check(e.get("status") == 400 and e.get("param") == "echo", "echo: 400 (not supported)")
        e, es = err("chat"), err("chat_stream")
        if chat_built:
            check(e.get("status") == 400 and e.get("code") == "chat_template_missing" and es.get("status") == 400,
                  "chat on a model without a chat template: 400 (%s)" % e.get("message"))
        else:
            check(e.get("status") == 501 and es.get("status") == 501, "chat in a build without chat templates: 501")

        if chat:
            g = chat_ref["greedy"]
            v = ok("chat_plain") or {}
            c0 = (v.get("choices") or [{}])[0]
            check((c0.get("message") or {}).get("content") == g["text"] and c0["message"].get("role") == "assistant"
                  and c0.get("finish_reason") == g["finish"],
                  "chat: the reply equals gRPC Generate of the template's text (%r)" % g["text"])
            cp = ((ok("chat_parts") or {}).get("choices") or [{}])[0]
            check((cp.get("message") or {}).get("content") == g["text"],
                  "chat with list-form content ([{type: text, text}]): the same reply (%r)"
                  % (cp.get("message") or {}).get("content"))
            check(v.get("id", "").startswith("chatcmpl-") and v.get("object") == "chat.completion" and
                  (v.get("usage") or {}).get("prompt_tokens") == len(chat_ref["ids"]),
                  "chat: id, object, and usage.prompt_tokens = the rendered prompt's tokens (no BOS added)")
            v = ok("chat_stream2") or {}
            check(v.get("text", {}).get("0") == g["text"] and v.get("roles", {}).get("0") == "assistant" and
                  v.get("objects") == ["chat.completion.chunk"] and (v.get("usage") or {}).get("completion_tokens") == len(g["ids"]),
                  "chat streamed: role first, the same reply, the usage chunk")
            want = [grpc_gen(chat, prompt_token_ids=chat_ref["ids"], sampling=sampling(1.0, seed),
                             stopping=pb.StoppingCriteria(max_tokens=10))["text"] for seed in (7, 8)]
            got = [c["message"]["content"] for c in sorted((ok("chat_n2") or {}).get("choices", []), key=lambda c: c["index"])]
            check(got == want, "chat n=2: the generations of seed 7 and 8")
            v = ok("chat_n2_stream") or {}
            check([v.get("text", {}).get(k) for k in ("0", "1")] == want and
                  v.get("roles") == {"0": "assistant", "1": "assistant"} and
                  (v.get("usage") or {}).get("prompt_tokens") == len(chat_ref["ids"]),
                  "chat n=2 streamed: each index its role chunk and seed 7's / 8's reply, the "
                  "prompt counted once in the usage chunk")
            c0 = ((ok("chat_logprobs") or {}).get("choices") or [{}])[0]
            content = (c0.get("logprobs") or {}).get("content") or []
            check(len(content) == len(g["ids"]) and "".join(t["token"] for t in content) == (c0.get("message") or {}).get("content")
                  and same_values([t["logprob"] for t in content], g["lps"])
                  and all(bytes(t["bytes"]).decode() == t["token"] for t in content),
                  "chat logprobs: one per token, gRPC's values, bytes = the token's UTF-8")
            check(chat_tops_ok([t["top_logprobs"] for t in content], [t["token"] for t in content], g, 3) and
                  all(t["top_logprobs"][0]["token"] == t["token"] for t in content),
                  "chat top_logprobs 3: gRPC's 3 alternatives in order with their texts and bytes, the "
                  "greedy token first under its own text")
            v = ok("chat_logprobs_stream") or {}
            l3 = (v.get("logprobs") or {}).get("0", {})
            check(same_values(l3.get("token_logprobs", []), g["lps"]) and
                  chat_tops_ok(l3.get("top_logprobs", []), l3.get("tokens", []), g, 3),
                  "chat top_logprobs 3 streamed: the chunks carry their tokens' logprobs and alternatives")
            c0 = ((ok("chat_logprobs_only") or {}).get("choices") or [{}])[0]
            content = (c0.get("logprobs") or {}).get("content") or []
            check(len(content) == len(g["ids"]) and all(t["top_logprobs"] == [] for t in content),
                  "chat logprobs without top_logprobs: the chosen tokens, no alternatives")
            e = err("chat_top_21")
            check(e.get("status") == 400 and e.get("param") == "top_logprobs",
                  "chat top_logprobs 21: 400 naming top_logprobs (%s)" % e.get("message"))
            gs = grpc_gen(chat, prompt_token_ids=chat_ref["ids"], sampling=sampling(),
                          stopping=pb.StoppingCriteria(max_tokens=16, stop=["big"]))
            c0 = ((ok("chat_stop") or {}).get("choices") or [{}])[0]
            check((c0.get("message") or {}).get("content") == gs["text"] and c0.get("finish_reason") == gs["finish"] == "stop",
                  "chat stop string (%r, %s)" % (gs["text"], gs["finish"]))
            e = err("chat_bad_role")
            check(e.get("status") == 400 and e.get("param") == "messages[0].role", "chat: a role that is not a string: 400")

    if chat:
        st, _, body = request(chat.hport, "POST", "/v1/chat/completions",
                              {"messages": [{"role": "tool", "content": "x"}]})
        check(st == 400 and "unknown role tool" in body, "the template's raise_exception: 400 with its message (%s)" % body[:200])
        st, _, body = request(chat.hport, "POST", "/v1/completions", {"prompt": PROMPT, "max_tokens": 4})
        check(st == 200, "completions on the chat model too")

    # ---- raw HTTP ----
    st, hd, body = request(router.hport, "POST", "/v1/completions",
                           {"prompt": PROMPT, "max_tokens": 8, "temperature": 0, "stream": True,
                            "stream_options": {"include_usage": True}})
    events = body.split("\n\n")
    check(st == 200 and hd.get("content-type") == "text/event-stream" and hd.get("transfer-encoding") == "chunked",
          "SSE: 200, text/event-stream, chunked")
    check(events[-1] == "" and events[-2] == "data: [DONE]" and all(e.startswith("data: ") for e in events[:-1]),
          "SSE: every event a 'data: ' line ended by a blank line, [DONE] last")
    chunks = [json.loads(e[6:]) for e in events[:-2]]
    check(chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] == 8 and
          all("usage" in c and c["usage"] is None for c in chunks[:-1]),
          "SSE: the usage chunk last, \"usage\": null in every other chunk")
    # system_fingerprint (issue #40): "pdserve-<version>-<16 hex>", in plain bodies and every
    # chunk, the same for the same model on every router, another for another model directory
    fp = chunks[0].get("system_fingerprint") or ""
    check(re.fullmatch(r"pdserve-[0-9A-Za-z.]+-[0-9a-f]{16}", fp) is not None and
          all(c.get("system_fingerprint") == fp for c in chunks), "SSE: system_fingerprint %r in every chunk" % fp)
    st, _, body = request(router.hport, "POST", "/v1/completions",
                          {"prompt": PROMPT, "max_tokens": 3, "stream": True})
    chunks = [json.loads(e[6:]) for e in body.split("\n\n") if e.startswith("data: {")]
    check(st == 200 and chunks and all("usage" in c and c["usage"] is None and c.get("system_fingerprint") == fp
                                       for c in chunks),
          "SSE without include_usage: no usage chunk, \"usage\": null and the fingerprint in all %d" % len(chunks))
    st, _, body = request(router.hport, "POST", "/v1/completions", {"prompt": PROMPT, "max_tokens": 2})
    check(st == 200 and json.loads(body).get("system_fingerprint") == fp, "plain: system_fingerprint %s" % fp)
    # OpenAI's ranges: temperature [0, 2], top_p [0, 1], penalties [-2, 2]
    for field, bad in (("temperature", 2.5), ("temperature", -0.5), ("top_p", 1.5), ("presence_penalty", 2.5),
                       ("frequency_penalty", -3)):
        st, _, body = request(router.hport, "POST", "/v1/completions", {"prompt": PROMPT, "max_tokens": 2, field: bad})
        e = json.loads(body).get("error", {}) if st == 400 else {}
        check(st == 400 and e.get("param") == field and e.get("type") == "invalid_request_error",
              "%s %s: 400 invalid_request_error naming it (%s)" % (field, bad, e.get("message")))
    st, _, body = request(router.hport, "POST", "/v1/completions",
                          {"prompt": PROMPT, "max_tokens": 4, "temperature": 2, "top_p": 0, "seed": 1,
                           "presence_penalty": 2, "frequency_penalty": -2})
    g0 = grpc_gen(router, prompt=PROMPT, sampling=sampling(), stopping=pb.StoppingCriteria(max_tokens=4))
    check(st == 200 and json.loads(body)["choices"][0]["text"] == g0["text"],
          "the bounds are accepted; top_p 0 keeps the likeliest token (greedy's text, even at temperature 2)")
    # content parts: text joined, any other part refused by its type
    parts_msgs = [{"role": "user", "content": [{"type": "text", "text": "Look:"},
                                                 {"type": "image_url", "image_url": {"url": "https://x/y.png"}}]}]
    st, _, body = request(router.hport, "POST", "/v1/chat/completions", {"messages": parts_msgs})
    e = json.loads(body).get("error", {}) if st == 400 else {}
    check(st == 400 and e.get("param") == "messages[0].content" and "'image_url'" in e.get("message", "") and
          e.get("code") == "unsupported_content_part", "an image_url part: 400 naming its type (%s)" % e.get("message"))
    if chat:
        st, _, body = request(chat.hport, "POST", "/v1/chat/completions",
                              {"messages": [{"role": "user", "content": "x"}], "max_tokens": 2})
        cfp = json.loads(body).get("system_fingerprint") if st == 200 else None
        check(cfp and cfp != fp and cfp.startswith(fp[:-16]),
              "chat model (another tokenizer_config.json): its own fingerprint %s" % cfp)
        one = [dict(m, content=[{"type": "text", "text": m["content"]}]) for m in CHAT_MESSAGES]
        st, _, body = request(chat.hport, "POST", "/v1/chat/completions",
                              {"messages": one, "max_tokens": 16, "temperature": 0, "logprobs": True, "top_logprobs": 3})
        c0 = (json.loads(body).get("choices") or [{}])[0] if st == 200 else {}
        check((c0.get("message") or {}).get("content") == chat_ref["greedy"]["text"],
              "chat: content as one text part each is the string content (%r)" % (c0.get("message") or {}).get("content"))
        split = [CHAT_MESSAGES[0], {"role": "user", "content": [{"type": "text", "text": "Tell me"},
                                                                 {"type": "text", "text": "about a cat."}]}]
        joined = [CHAT_MESSAGES[0], {"role": "user", "content": "Tell me\nabout a cat."}]
        got = []
        for msgs in (split, joined):
            st, _, body = request(chat.hport, "POST", "/v1/chat/completions",
                                  {"messages": msgs, "max_tokens": 12, "temperature": 0, "stream": True})
            chunks = [json.loads(e[6:]) for e in body.split("\n\n") if e.startswith("data: {")]
            got.append("".join(c["choices"][0]["delta"].get("content", "") for c in chunks if c["choices"]))
            check(st == 200 and all(c.get("system_fingerprint") == cfp and c["usage"] is None for c in chunks),
                  "chat streamed: the fingerprint and \"usage\": null in every chunk")
        check(got[0] == got[1] and got[0], "two text parts are their texts joined by a newline (%r)" % got[0])
    st, hd, body = request(router.hport, "POST", "/v1/completions", {"prompt": PROMPT, "max_tokens": 4})
    check(st == 200 and hd.get("content-type") == "application/json" and len(json.loads(body)["choices"]) == 1,
          "plain: 200 application/json")
    # n choices are one generation (GenerateRequest.n), a batch of prompts one per prompt
    n0 = eu.Scrape(router.mport).get("pdserve_requests_total")
    st, _, body = request(router.hport, "POST", "/v1/completions",
                          {"prompt": [PROMPT, "The cat"], "max_tokens": 4, "n": 3, "seed": 3})
    chs = json.loads(body).get("choices", []) if st == 200 else []
    check(st == 200 and sorted(c["index"] for c in chs) == list(range(6)) and
          eu.Scrape(router.mport).get("pdserve_requests_total") - n0 == 2,
          "2 prompts x n = 3: six choices indexed prompt-major from two Generate calls (%d)" %
          (eu.Scrape(router.mport).get("pdserve_requests_total") - n0))
    # n = 2 with logprobs 3: each choice's logprobs and alternatives are those of the
    # generation with seed + j alone (plain and streamed)
    g2 = [grpc_gen(router, prompt=PROMPT, sampling=sampling(1.0, 13 + j),
                   stopping=pb.StoppingCriteria(max_tokens=8, ignore_eos=True), logprobs=3) for j in range(2)]
    lp_body = {"prompt": PROMPT, "max_tokens": 8, "n": 2, "seed": 13, "temperature": 1.0, "logprobs": 3,
               "ignore_eos": True}
    st, _, body = request(router.hport, "POST", "/v1/completions", lp_body)
    chs = sorted(json.loads(body).get("choices", []), key=lambda c: c["index"]) if st == 200 else []
    per = [(c.get("logprobs") or {}) for c in chs]
    check(st == 200 and len(chs) == 2 and
          all(same_values(per[j].get("token_logprobs", []), g2[j]["lps"]) and len(g2[j]["lps"]) == 8 and
              "".join(per[j].get("tokens", [])) == chs[j]["text"] == g2[j]["text"] and
              completions_tops_ok(per[j].get("top_logprobs", []), per[j].get("tokens", []),
                                  per[j].get("token_logprobs", []), g2[j], 3)[0] for j in range(2)),
          "n = 2, logprobs 3: choice j's text, logprobs and top_logprobs are the generation with "
          "seed 13 + j alone")
    st, _, body = request(router.hport, "POST", "/v1/completions", dict(lp_body, stream=True))
    acc = {}
    for e in body.split("\n\n"):
        if not e.startswith("data: {"):
            continue
        for c in json.loads(e[6:]).get("choices", []):
            a = acc.setdefault(c["index"], {"lps": [], "tops": [], "tokens": []})
            l = c.get("logprobs") or {}
            a["lps"] += l.get("token_logprobs", [])
            a["tops"] += l.get("top_logprobs", [])
            a["tokens"] += l.get("tokens", [])
    check(st == 200 and sorted(acc) == [0, 1] and
          all(same_values(acc[j]["lps"], g2[j]["lps"]) and
              completions_tops_ok(acc[j]["tops"], acc[j]["tokens"], acc[j]["lps"], g2[j], 3)[0]
              for j in range(2)),
          "n = 2, logprobs 3 streamed: each index's chunks carry its own logprobs and alternatives")
    st, _, body = request(router.hport, "POST", "/v1/completions", '{"prompt": "x", ')
    check(st == 400 and is_error_shape(body, "invalid_request_error"), "bad JSON: 400 in OpenAI's error shape")
    st, _, body = request(router.hport, "POST", "/v1/completions", {"prompt": 5})
    check(st == 400 and json.loads(body)["error"]["param"] == "prompt", "prompt 5: 400 param prompt")
    st, _, body = request(router.hport, "POST", "/v1/completions", {"prompt": "x", "stream": "yes"})
    check(st == 400 and json.loads(body)["error"]["param"] == "stream", "stream 'yes': 400 param stream")
    st, _, body = request(router.hport, "POST", "/v1/completions", {"prompt": "x", "max_tokens": 2, "user": "u",
                                                                    "some_future_field": [1, 2]})
    check(st == 200, "unknown fields and user are ignored")
    st, _, body = request(router.hport, "GET", "/v2/nothing")
    check(st == 404 and is_error_shape(body), "unknown path: 404")
    st, hd, body = request(router.hport, "GET", "/v1/completions")
    check(st == 405 and hd.get("allow") == "POST" and is_error_shape(body), "GET /v1/completions: 405, Allow: POST")
    st, hd, _ = request(router.hport, "POST", "/v1/models", {})
    check(st == 405 and "GET" in hd.get("allow", ""), "POST /v1/models: 405")
    s = socket.create_connection(("127.0.0.1", router.hport), timeout=10)
    s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 5000000\r\n\r\n")
    resp = s.recv(65536).decode(errors="replace")
    s.close()
    check(resp.startswith("HTTP/1.1 413"), "Content-Length over 4 MiB: 413 before the body is read")
    s = socket.create_connection(("127.0.0.1", router.hport), timeout=30)
    s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n")
    piece = b"%x\r\n%s\r\n" % (65536, b"a" * 65536)
    try:
        for _ in range(80):  # 5 MiB
            s.sendall(piece)
        s.sendall(b"0\r\n\r\n")
    except OSError:
        pass
    resp = s.recv(65536).decode(errors="replace")
    s.close()
    check(resp.startswith("HTTP/1.1 413"), "a chunked body over 4 MiB: 413")
    st, _, body = request(router.hport, "GET", "/health")
    check(st == 200 and json.loads(body) == {"status": "ok"}, "/health: 200")
    m = eu.Scrape(router.mport)
    check(m.get("pdserve_http_requests_total", endpoint="/v1/completions", code="200") >= 3 and
          m.get("pdserve_http_requests_total", code="413") == 2, "/metrics: pdserve_http_requests_total by endpoint and code")

    # ---- hanging up cancels ----
    m0 = eu.Scrape(router.mport).get("pdserve_requests_total", outcome="cancelled")
    got = raw_stream_then_hang_up(router.hport, {"prompt": PROMPT, "max_tokens": 400, "ignore_eos": True,
                                                 "stream": True}, True)
    t0 = time.time()
    check("data: " in got, "a stream began (the first event arrived)")
    check(eu.wait_until(lambda: quiet(router, dec), 3), "hang-up mid-stream: in flight 0, decode's blocks free "
          "in %.2f s (the generation needed 4 s)" % (time.time() - t0))
    raw_stream_then_hang_up(router.hport, {"prompt": PROMPT, "max_tokens": 400, "ignore_eos": True}, False)
    t0 = time.time()
    check(eu.wait_until(lambda: quiet(router, dec), 3), "hang-up while waiting for a plain answer: the same (%.2f s)"
          % (time.time() - t0))
    check(eu.wait_until(lambda: eu.Scrape(router.mport).get("pdserve_requests_total", outcome="cancelled") == m0 + 2, 3),
          "both counted as cancelled calls")
    t0 = time.time()
    st, _, body = request(router.hport, "POST", "/v1/completions", {"prompt": PROMPT, "max_tokens": 400, "ignore_eos": True},
                          headers={"X-Stainless-Timeout": "1"})
    check(st == 504 and is_error_shape(body, "timeout_error") and time.time() - t0 < 3,
          "X-Stainless-Timeout: 1 -> 504 after %.2f s" % (time.time() - t0))
    check(eu.wait_until(lambda: quiet(router, dec), 3), "after the deadline: nothing left in flight")

    # ---- a router with --max-pending 1 (429) and one with no live instance (503) ----
    env = dict(H.env, PDSERVE_HTTP_LISTEN="127.0.0.1:0")
    busy = start_router(*common, *inst, "--max-pending", "1", env=env, tag="router-busy")
    eu.wait_until(lambda: request(busy.hport, "GET", "/health")[0] == 200, 10)
    slow = socket.create_connection(("127.0.0.1", busy.hport), timeout=10)
    data = json.dumps({"prompt": PROMPT, "max_tokens": 300, "ignore_eos": True, "stream": True}).encode()
    slow.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: %d\r\n\r\n" % len(data) + data)
    got = b""
    while b"data: " not in got:
        chunk = slow.recv(4096)
        if not chunk:
            break
        got += chunk
    check(b"data: " in got, "a stream holds the busy router's one slot")
    m = re.search(rb'"system_fingerprint":"([^"]*)"', got)
    check(m is not None and m.group(1).decode() == fp, "another router of the same model: the same "
          "system_fingerprint (%s)" % (m.group(1).decode() if m else None))
    st, _, body = request(busy.hport, "POST", "/v1/completions", {"prompt": PROMPT, "max_tokens": 2})
    check(st == 429 and is_error_shape(body, "rate_limit_error") and json.loads(body)["error"]["code"] == "rate_limit_exceeded",
          "RESOURCE_EXHAUSTED (--max-pending 1, PDSERVE_HTTP_LISTEN): 429 (%s)" % body[:160])
    slow.close()
    dead = start_router(*common, "--decode", "127.0.0.1:1", "--http-listen", "127.0.0.1:0", tag="router-dead")
    st, _, body = request(dead.hport, "GET", "/health")
    check(st == 503 and is_error_shape(body), "no decode instance: /health 503")
    st, _, body = request(dead.hport, "POST", "/v1/completions", {"prompt": PROMPT, "max_tokens": 2})
    check(st == 503 and is_error_shape(body, "server_error"), "no decode instance: 503 (%s)" % body[:120])
    check(eu.wait_until(lambda: quiet(busy, dec), 3), "the busy router is quiet again")

    # ---- draining: 503 for new requests while the gRPC side still drains ----
    drain = start_router(*common, *inst, "--http-listen", "127.0.0.1:0", "--health-drain-ms", "1500", tag="router-drain")
    eu.wait_until(lambda: request(drain.hport, "GET", "/health")[0] == 200, 10)
    drain.p.send_signal(signal.SIGTERM)
    time.sleep(0.3)
    st, _, _ = request(drain.hport, "GET", "/health")
    st2, _, body = request(drain.hport, "POST", "/v1/completions", {"prompt": PROMPT, "max_tokens": 2})
    check(st == 503 and st2 == 503 and is_error_shape(body), "draining: /health and new requests 503")
    drain.p.wait(timeout=60)  # one SIGTERM only (H.stop signals what still runs)
    H.stop()
finally:
    H.kill_all()
H.finish()
