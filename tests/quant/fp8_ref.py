#!/usr/bin/python3
"""fp8_ref.py -- FP8 checkpoints and float64 references for pdserve's FP8 tests (numpy only).

An independent implementation (safetensors, e4m3fn, the decoder forward), written from the
formats' public descriptions, not from pdserve's C code or another project's source.

  fp8_ref.py quantize SRC OUT --scheme S [--kv-scales] [--calib N]
      S: ct-channel-dynamic, ct-tensor-static, ct-weight-only, ct-channel-bf16scale, block,
         dequant-f32 (see SCHEMES below).
  fp8_ref.py ref DIR --cases GOLDEN_JSON --out OUT_JSON [--kv-fp8] [--dtype f64|f32]
                     [--jitter EPS --seed N] [--weights-f32]
      The forward of DIR's checkpoint (float64 unless --dtype f32) applying pdserve's FP8 rules
      (weights dequantized, activations of each quantized linear quantized per token), on the
      prompts of GOLDEN_JSON's cases; writes the same format (last_logits, all_logits for
      prompts <= 33 tokens, 24 greedy ids and margins).
  fp8_ref.py diff A_JSON B_JSON
      Per case: max |logit diff| / std(reference row) over the rows both have (B is the
      reference), and how many greedy tokens agree before the first difference.

Use /usr/bin/python3 (numpy). Everything is CPU and small (the golden models are tiny).
"""
import argparse
import json
import math
import os
import shutil
import struct
import sys

import numpy as np

# ---------------------------------------------------------------------------------------------
# e4m3fn: 1 sign bit, 4 exponent bits (bias 7), 3 mantissa bits; no infinities; S.1111.111 is
# NaN, so the largest finite value is 1.75 * 2^8 = 448. Subnormals (exponent field 0) are
# m/8 * 2^-6, i.e. steps of 2^-9.

FP8_MAX = 448.0
MIN_SCALE = 1.0 / (448.0 * 512.0)  # the smallest dynamic activation scale (pdserve's rule)


def _e4m3_positive_table():
    """Values of the codes 0x00..0x7E (all finite non-negative), increasing with the code."""
    vals = np.zeros(127, dtype=np.float64)
    for code in range(127):
        e = code >> 3
        m = code & 7
        vals[code] = (m / 8.0) * 2.0 ** -6 if e == 0 else (1.0 + m / 8.0) * 2.0 ** (e - 7)
    return vals


E4M3_POS = _e4m3_positive_table()
assert E4M3_POS[126] == 448.0 and E4M3_POS[1] == 2.0 ** -9 and np.all(np.diff(E4M3_POS) > 0)
# Midpoints between neighbouring codes: exact in float64 (a few significant bits each).
E4M3_MID = (E4M3_POS[:-1] + E4M3_POS[1:]) / 2.0


def e4m3_decode(codes):
    """uint8 array -> float64 (exact), by the bit layout."""
    c = np.asarray(codes, dtype=np.uint8).astype(np.int64)
    s = np.where(c & 0x80, -1.0, 1.0)
    e = (c >> 3) & 0xF
    m = (c & 7).astype(np.float64)
    mag = np.where(e == 0, m / 8.0 * 2.0 ** -6, (1.0 + m / 8.0) * np.exp2(e.astype(np.float64) - 7))
    mag = np.where((c & 0x7F) == 0x7F, np.nan, mag)
    return s * mag


def e4m3_encode(x):
    """float array (f32 or f64; taken exactly as float64) -> uint8 codes: round to nearest,
    ties to the even code (even mantissa), saturating to +-448, NaN -> 0x7F/0xFF."""
    x = np.asarray(x, dtype=np.float64)
    a = np.abs(x)
    # idx = number of midpoints strictly below a -> the nearest code, ties resolved below.
    idx = np.searchsorted(E4M3_MID, a, side="left")
    # a equal to a midpoint: searchsorted(left) gives the lower code; take the even one.
    mid_hit = np.zeros(a.shape, dtype=bool)
    inb = idx < len(E4M3_MID)
    mid_hit[inb] = E4M3_MID[idx[inb]] == a[inb]
    idx = np.where(mid_hit & (idx % 2 == 1), idx + 1, idx)
    idx = np.minimum(idx, 126)  # saturate (a > 448 and the 448..480 range)
    code = idx.astype(np.uint8)
    code = np.where(np.signbit(x), code | 0x80, code).astype(np.uint8)
    code = np.where(np.isnan(x), np.uint8(0x7F), code).astype(np.uint8)
    return code


def e4m3_round(x):
    """x -> float64 of e4m3(x) (fake quantization)."""
    return e4m3_decode(e4m3_encode(x))


def _self_test_e4m3():
    # Every code round-trips; midpoints go to the even code; saturation; subnormals.
    codes = np.array([c for c in range(256) if (c & 0x7F) != 0x7F], dtype=np.uint8)
    assert np.array_equal(e4m3_encode(e4m3_decode(codes)), codes)
    assert e4m3_encode(np.array([1000.0]))[0] == 0x7E and e4m3_encode(np.array([-449.0]))[0] == 0xFE
    assert e4m3_encode(np.array([464.0]))[0] == 0x7E  # beyond the last midpoint: saturates
    assert e4m3_decode(e4m3_encode(np.array([1.0 + 1.0 / 16])))[0] == 1.0  # tie -> even (1.0)
    assert e4m3_decode(e4m3_encode(np.array([1.0 + 3.0 / 16])))[0] == 1.25  # tie -> even (1.25)
    assert e4m3_decode(e4m3_encode(np.array([2.0 ** -10])))[0] == 0.0  # tie 0 / 2^-9 -> 0
    assert e4m3_decode(e4m3_encode(np.array([3 * 2.0 ** -10])))[0] == 2.0 ** -8  # tie -> even
    assert e4m3_decode(e4m3_encode(np.array([2.0 ** -10 + 2.0 ** -30])))[0] == 2.0 ** -9
    assert e4m3_encode(np.array([-0.0]))[0] == 0x80


# ---------------------------------------------------------------------------------------------
# safetensors: 8-byte little-endian header length, JSON header {name: {dtype, shape,
# data_offsets [begin, end)} , "__metadata__"}, then the raw little-endian bytes.

_DT_SIZE = {"F64": 8, "F32": 4, "BF16": 2, "F16": 2, "F8_E4M3": 1, "I32": 4, "I64": 8, "U8": 1}


def st_read(path):
    """-> {name: (dtype string, shape list, raw numpy array of the stored type)}"""
    with open(path, "rb") as f:
        blob = f.read()
    (n,) = struct.unpack("<Q", blob[:8])
    hdr = json.loads(blob[8:8 + n].decode("utf-8"))
    base = 8 + n
    out = {}
    for name, t in hdr.items():
        if name == "__metadata__":
            continue
        b, e = t["data_offsets"]
        raw = blob[base + b: base + e]
        dt = t["dtype"]
        npdt = {"F64": "<f8", "F32": "<f4", "BF16": "<u2", "F16": "<f2", "F8_E4M3": "u1",
                "I32": "<i4", "I64": "<i8", "U8": "u1"}[dt]
        arr = np.frombuffer(raw, dtype=npdt).reshape(t["shape"]) if t["shape"] else \
            np.frombuffer(raw, dtype=npdt).reshape(())
        out[name] = (dt, list(t["shape"]), arr)
    return out


def st_read_dir(d):
    """All *.safetensors of a directory (one file or shards) merged."""
    out = {}
    for fn in sorted(os.listdir(d)):
        if fn.endswith(".safetensors"):
            out.update(st_read(os.path.join(d, fn)))
    return out


def to_f64(entry):
    dt, shape, arr = entry
    if dt == "BF16":
        v = (arr.astype(np.uint32) << 16).view(np.float32).astype(np.float64)
    elif dt == "F8_E4M3":
        v = e4m3_decode(arr)
    else:
        v = arr.astype(np.float64)
    return v.reshape(shape) if shape else v.reshape(())


def f32_to_bf16_bits(x):
    """float32 -> bf16 bits, round to nearest even (finite inputs)."""
    u = np.asarray(x, dtype=np.float32).view(np.uint32).astype(np.uint64)
    u = (u + 0x7FFF + ((u >> 16) & 1)) >> 16
    return u.astype(np.uint16)


def st_write(path, tensors):
    """tensors: {name: (dtype string, shape list, numpy array already of the stored type)}"""
    hdr = {"__metadata__": {"format": "pt"}}
    off = 0
    chunks = []
    for name in sorted(tensors):
        dt, shape, arr = tensors[name]
        want = {"F32": "<f4", "BF16": "<u2", "F8_E4M3": "u1", "F16": "<f2"}[dt]
        raw = np.ascontiguousarray(arr, dtype=want).tobytes()
        assert len(raw) == _DT_SIZE[dt] * int(np.prod(shape, dtype=np.int64)), name
        hdr[name] = {"dtype": dt, "shape": list(shape), "data_offsets": [off, off + len(raw)]}
        off += len(raw)
        chunks.append(raw)
    h = json.dumps(hdr, separators=(",", ":")).encode("utf-8")
    h += b" " * ((8 - len(h) % 8) % 8)  # align the data to 8 bytes (spaces are valid JSON)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(h)))
        f.write(h)
        for c in chunks:
            f.write(c)


# ---------------------------------------------------------------------------------------------
# The model (float64, or float32 for the perturbation runs)

LINEARS = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
           "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")


class Cfg:
    def __init__(self, c):
        self.raw = c
        self.arch = (c.get("architectures") or ["?"])[0]
        self.hidden = c["hidden_size"]
        self.inter = c["intermediate_size"]
        self.n_layers = c["num_hidden_layers"]
        self.n_heads = c["num_attention_heads"]
        self.n_kv = c.get("num_key_value_heads") or self.n_heads
        self.head_dim = c.get("head_dim") or self.hidden // self.n_heads
        self.vocab = c["vocab_size"]
        self.eps = c.get("rms_norm_eps", 1e-6)
        self.tied = c.get("tie_word_embeddings", False)
        self.qk_norm = self.arch.startswith("Qwen3")
        rp = c.get("rope_parameters")
        if isinstance(rp, dict):  # transformers 5.x
            self.theta = rp.get("rope_theta", c.get("rope_theta", 10000.0))
            self.rope = dict(rp)
        else:  # rope_theta / rope_scaling
            self.theta = c.get("rope_theta", 10000.0)
            self.rope = dict(c.get("rope_scaling") or {})
        self.rope_type = self.rope.get("rope_type", self.rope.get("type", "default")) or "default"
        self.partial = self.rope.get("partial_rotary_factor", c.get("partial_rotary_factor", 1.0))


def rope_inv_freq(cfg, dt=np.float64):
    """The inverse frequencies with the checkpoint's scaling, computed in dt (float32 only to
    emulate transformers, which computes them in float32)."""
    dim = int(cfg.head_dim * cfg.partial)
    inv = (dt(1.0) / dt(cfg.theta) ** (np.arange(0, dim, 2).astype(dt) / dt(dim))).astype(dt)
    t = cfg.rope_type
    if t == "default":
        return inv
    if t == "linear":
        return (inv / dt(cfg.rope["factor"])).astype(dt)
    if t == "llama3":
        f = cfg.rope["factor"]
        lo, hi = cfg.rope["low_freq_factor"], cfg.rope["high_freq_factor"]
        old = cfg.rope["original_max_position_embeddings"]
        lo_wl, hi_wl = old / lo, old / hi
        wl = (dt(2.0 * math.pi) / inv).astype(dt)
        out = np.where(wl > lo_wl, inv / dt(f), inv).astype(dt)
        smooth = ((dt(old) / wl - dt(lo)) / dt(hi - lo)).astype(dt)
        smoothed = ((dt(1.0) - smooth) * out / dt(f) + smooth * out).astype(dt)
        medium = ~(wl < hi_wl) & ~(wl > lo_wl)
        return np.where(medium, smoothed, out).astype(dt)
    raise SystemExit("rope type %r not supported by this reference" % t)


class QuantLinear:
    """One linear: dequantized weight (float64), bias, how its input rows are quantized."""

    def __init__(self, w, b, act, group, in_scale):
        self.w = w        # [out, in] float64 (dequantized when FP8)
        self.b = b        # [out] or None
        self.act = act    # "none", "dynamic", "static"
        self.group = group  # columns an activation scale covers (in, or 128)
        self.in_scale = in_scale  # static scale (float64 of the stored f32)


def parse_quant(cfg_json):
    """-> dict(method, wstrategy, act, group, ignore, kv) or None (unquantized)."""
    q = cfg_json.get("quantization_config")
    if not q:
        return None
    m = q.get("quant_method")
    if m == "compressed-tensors":
        groups = list((q.get("config_groups") or {}).values())
        if len(groups) != 1 or groups[0].get("targets") != ["Linear"]:
            raise SystemExit("compressed-tensors: one config group targeting Linear expected")
        g = groups[0]
        w = g["weights"]
        ia = g.get("input_activations")
        wstrat = w["strategy"]
        group = None
        if wstrat == "block":
            bs = w.get("block_structure") or [128, 128]
            if list(bs) != [128, 128]:
                raise SystemExit("block_structure %r not supported" % (bs,))
        if ia is None:
            act = "none"
        elif ia.get("dynamic"):
            act = "dynamic"
            if ia.get("strategy") == "group":
                group = ia.get("group_size", 128)
        else:
            act = "static"
            if ia.get("strategy") != "tensor":
                raise SystemExit("static activations other than per tensor not supported")
        if wstrat == "block" and act == "dynamic":
            group = 128
        return dict(method="ct", wstrategy=wstrat, act=act, group=group,
                    ignore=list(q.get("ignore") or []), kv=q.get("kv_cache_scheme") is not None)
    if m == "fp8":
        if q.get("weight_block_size") not in ([128, 128],):
            raise SystemExit("fp8 without weight_block_size [128, 128] not supported")
        if q.get("activation_scheme", "dynamic") != "dynamic":
            raise SystemExit("fp8 block with static activations not supported")
        ign = list(q.get("modules_to_not_convert") or []) + list(q.get("ignored_layers") or [])
        return dict(method="fp8", wstrategy="block", act="dynamic", group=128, ignore=ign,
                    substring_ignore=True, kv=q.get("kv_cache_scheme") is not None)
    raise SystemExit("quant_method %r not supported by this reference" % m)


def _ignored(qc, module):
    for pat in qc["ignore"]:
        if qc.get("substring_ignore"):
            if pat in module:
                return True
        elif pat.startswith("re:"):
            import re
            if re.match(pat[3:], module):
                return True
        elif pat == module or module.endswith("." + pat) or module.split(".")[-1] == pat:
            return True
    return False


def dequant_weight(tens, module, qc, wdt):
    """The float64 weight of a quantized module (e4m3 value * its scale, exact in float64).
    wdt=np.float32: the product rounded to float32 instead (a perturbation run)."""
    w8 = tens[module + ".weight"]
    assert w8[0] == "F8_E4M3", module
    wq = to_f64(w8)
    out_f, in_f = wq.shape
    if qc["wstrategy"] == "block":
        sname = module + (".weight_scale_inv" if qc["method"] == "fp8" else ".weight_scale")
        s = to_f64(tens[sname])
        assert s.shape == (-(-out_f // 128), -(-in_f // 128)), (sname, s.shape)
        full = np.repeat(np.repeat(s, 128, axis=0), 128, axis=1)[:out_f, :in_f]
    else:
        s = to_f64(tens[module + ".weight_scale"]).reshape(-1)
        if qc["wstrategy"] == "tensor":
            assert s.size == 1, module
            full = np.full((out_f, 1), s[0])
        else:
            assert s.size == out_f, module
            full = s.reshape(out_f, 1)
    if wdt == np.float32:
        return (wq.astype(np.float32) * full.astype(np.float32)).astype(np.float64)
    return wq * full


class Model:
    def __init__(self, d, dtype=np.float64, weights_f32=False):
        with open(os.path.join(d, "config.json")) as f:
            cj = json.load(f)
        self.cfg = cfg = Cfg(cj)
        self.qc = qc = parse_quant(cj)
        self.dt = dtype
        tens = st_read_dir(d)

        def get(name):
            return to_f64(tens[name]).astype(dtype)

        self.embed = get("model.embed_tokens.weight")
        self.lm_head = get("lm_head.weight") if (not cfg.tied and "lm_head.weight" in tens) \
            else self.embed
        self.norm = get("model.norm.weight")
        self.layers = []
        for i in range(cfg.n_layers):
            p = "model.layers.%d." % i
            L = {"in_norm": get(p + "input_layernorm.weight"),
                 "post_norm": get(p + "post_attention_layernorm.weight")}
            if cfg.qk_norm:
                L["q_norm"] = get(p + "self_attn.q_norm.weight")
                L["k_norm"] = get(p + "self_attn.k_norm.weight")
            for ln in LINEARS:
                mod = p + ln
                b = get(mod + ".bias") if mod + ".bias" in tens else None
                if qc is not None and not _ignored(qc, mod) and \
                        tens[mod + ".weight"][0] == "F8_E4M3":
                    w = dequant_weight(tens, mod, qc, np.float32 if weights_f32 else np.float64)
                    in_f = w.shape[1]
                    ins = None
                    if qc["act"] == "static":
                        ins = float(to_f64(tens[mod + ".input_scale"]).reshape(-1)[0])
                    lin = QuantLinear(w.astype(dtype), b, qc["act"], qc["group"] or in_f, ins)
                else:
                    lin = QuantLinear(get(mod + ".weight"), b, "none", 0, None)
                L[ln.split(".")[1]] = lin
            # pdserve fuses q/k/v and gate/up into one linear each: a static input scale is then
            # the largest of the fused modules' input_scale (what vLLM does for fused layers).
            for fused in (("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj")):
                if L[fused[0]].act == "static":
                    s = max(L[n].in_scale for n in fused)
                    for n in fused:
                        L[n].in_scale = s
            L["k_scale"] = float(to_f64(tens[p + "self_attn.k_scale"]).reshape(-1)[0]) \
                if p + "self_attn.k_scale" in tens else 1.0
            L["v_scale"] = float(to_f64(tens[p + "self_attn.v_scale"]).reshape(-1)[0]) \
                if p + "self_attn.v_scale" in tens else 1.0
            self.layers.append(L)
        inv = rope_inv_freq(cfg)
        self.inv_freq = inv
        self.inv_freq32 = rope_inv_freq(cfg, np.float32)
        self.hf_emulate = False
        self.rot_dim = 2 * len(inv)
        self.jitter = 0.0
        self.tie = {}  # position -> nearest-to-a-rounding-boundary distance (note_ties)
        self.guard = 1e-6
        self.rng = None
        self.kv_fp8 = False
        self.observe = None  # calibration: callback(kind, layer, name, array)

    # -- pieces --------------------------------------------------------------------------
    def rmsnorm(self, x, w):
        if self.hf_emulate:  # transformers' RMSNorm: the normalization in float32
            x32 = x.astype(np.float32)
            var = np.mean(x32 * x32, axis=-1, keepdims=True, dtype=np.float32)
            n = x32 * (np.float32(1.0) / np.sqrt(var + np.float32(self.cfg.eps)))
            return n.astype(self.dt) * w
        var = np.mean(x * x, axis=-1, keepdims=True)
        return x / np.sqrt(var + self.dt(self.cfg.eps)) * w

    def quant_act(self, x, lin):
        """pdserve's activation rule: each row, in groups of lin.group columns, becomes
        e4m3(x / s) * s with s = max(amax / 448, 1 / (448 * 512)) (dynamic) or the input scale
        (static). Computed in the model's dtype (float64 for the reference)."""
        if lin.act == "none":
            return x
        dt = self.dt
        out = np.empty_like(x)
        k = x.shape[-1]
        for g0 in range(0, k, lin.group):
            g1 = min(k, g0 + lin.group)
            xs = x[:, g0:g1]
            if lin.act == "dynamic":
                s = np.max(np.abs(xs), axis=1, keepdims=True) / dt(FP8_MAX)
                s = np.maximum(s, dt(MIN_SCALE))
            else:
                s = dt(lin.in_scale)
            q = (xs / s).astype(dt)
            self.note_ties(q)
            out[:, g0:g1] = (e4m3_round(q).astype(dt) * s).astype(dt)
        return out

    def note_ties(self, q):
        """Records, for each row of q (the values e4m3 rounds), the distance of its element
        nearest to a rounding boundary (a midpoint between two e4m3 values), relative to the
        row's largest |value|: a row whose distance is below an implementation's relative error
        may round differently there (and everything after it differs: the FP8 model is
        chaotic at that level). Rows are positions (self.cur_pos)."""
        a = np.abs(np.asarray(q, dtype=np.float64)).reshape(q.shape[0], -1)
        i = np.clip(np.searchsorted(E4M3_MID, a), 1, len(E4M3_MID) - 1)
        d = np.minimum(np.abs(a - E4M3_MID[i - 1]), np.abs(E4M3_MID[i] - a))
        d = np.where(a > E4M3_MID[-1], np.inf, d)  # beyond the last midpoint: saturation
        rel = np.min(d / np.maximum(np.max(a, axis=1, keepdims=True), 1e-300), axis=1)
        for p_, r_ in zip(self.cur_pos, rel):
            self.tie[p_] = min(self.tie.get(p_, np.inf), float(r_))

    def linear(self, x, lin, xq=None):
        if xq is None:
            xq = self.quant_act(x, lin)
        y = xq @ lin.w.T
        if lin.b is not None:
            y = y + lin.b
        return y

    def perturb(self, x):
        if self.jitter:
            x = x * (1.0 + self.jitter * self.rng.standard_normal(x.shape))
        return x

    def rope(self, x, pos):
        """HF rotate_half convention on the first rot_dim dims; x [T, H, D], pos [T]."""
        if self.hf_emulate:  # transformers: inverse frequencies, angles, cos/sin in float32
            ang = pos.astype(np.float32)[:, None] * self.inv_freq32[None, :]
        else:
            ang = pos.astype(np.float64)[:, None] * self.inv_freq[None, :]  # [T, D/2]
        cos = np.cos(ang).astype(self.dt)[:, None, :]
        sin = np.sin(ang).astype(self.dt)[:, None, :]
        h = self.rot_dim // 2
        x1, x2 = x[..., :h], x[..., h:self.rot_dim]
        out = x.copy()
        out[..., :h] = x1 * cos - x2 * sin
        out[..., h:self.rot_dim] = x2 * cos + x1 * sin
        return out

    # -- forward ---------------------------------------------------------------------------
    def forward(self, ids, cache):
        """ids: new tokens (their positions follow the cache's length). cache: list of [K, V]
        per layer ([T, n_kv, D] arrays, as stored: FP8-rounded with --kv-fp8), extended.
        Returns the logits of every new row [T, vocab]."""
        cfg, dt = self.cfg, self.dt
        T = len(ids)
        start = 0 if cache[0] is None else cache[0][0].shape[0]
        pos = np.arange(start, start + T)
        self.cur_pos = pos
        x = self.embed[np.asarray(ids)].astype(dt)
        H, KV, D = cfg.n_heads, cfg.n_kv, cfg.head_dim
        for li, L in enumerate(self.layers):
            h = self.perturb(self.rmsnorm(x, L["in_norm"]))
            if self.observe:
                self.observe("in", li, ("q_proj", "k_proj", "v_proj"), h)
            hq = self.quant_act(h, L["q_proj"])  # one quantization for the fused q/k/v
            q = self.linear(h, L["q_proj"], hq).reshape(T, H, D)
            k = self.linear(h, L["k_proj"], hq).reshape(T, KV, D)
            v = self.linear(h, L["v_proj"], hq).reshape(T, KV, D)
            if cfg.qk_norm:
                q = self.rmsnorm(q, L["q_norm"])
                k = self.rmsnorm(k, L["k_norm"])
            q = self.rope(q, pos)
            k = self.rope(k, pos)
            if self.observe:
                self.observe("kv", li, ("k",), k.reshape(T, -1))
                self.observe("kv", li, ("v",), v.reshape(T, -1))
            if self.kv_fp8:
                ks, vs = dt(L["k_scale"]), dt(L["v_scale"])
                self.note_ties((k / ks).astype(dt))
                self.note_ties((v / vs).astype(dt))
                k = (e4m3_round((k / ks).astype(dt)).astype(dt) * ks).astype(dt)
                v = (e4m3_round((v / vs).astype(dt)).astype(dt) * vs).astype(dt)
            if cache[li] is None:
                cache[li] = [k, v]
            else:
                cache[li] = [np.concatenate([cache[li][0], k]), np.concatenate([cache[li][1], v])]
            K, V = cache[li]
            S = K.shape[0]
            rep = H // KV
            Kh = np.repeat(K, rep, axis=1)  # [S, H, D]
            Vh = np.repeat(V, rep, axis=1)
            sc = np.einsum("thd,shd->hts", q, Kh) / dt(math.sqrt(D))
            mask = np.arange(S)[None, :] > pos[:, None]  # causal
            sc = np.where(mask[None], -np.inf, sc)
            sc = sc - sc.max(axis=-1, keepdims=True)
            p = np.exp(sc)
            p = p / p.sum(axis=-1, keepdims=True)
            a = np.einsum("hts,shd->thd", p, Vh).reshape(T, H * D).astype(dt)
            a = self.perturb(a)
            if self.observe:
                self.observe("in", li, ("o_proj",), a)
            x = x + self.linear(a, L["o_proj"])
            h = self.perturb(self.rmsnorm(x, L["post_norm"]))
            if self.observe:
                self.observe("in", li, ("gate_proj", "up_proj"), h)
            hq = self.quant_act(h, L["gate_proj"])
            g = self.linear(h, L["gate_proj"], hq)
            u = self.linear(h, L["up_proj"], hq)
            m = (g / (1.0 + np.exp(-g)) * u).astype(dt)
            m = self.perturb(m)
            if self.observe:
                self.observe("in", li, ("down_proj",), m)
            x = x + self.linear(m, L["down_proj"])
        x = self.rmsnorm(x, self.norm)
        return (x @ self.lm_head.T).astype(np.float64)

    def run_case(self, prompt, n_greedy, all_rows):
        cache = [None] * self.cfg.n_layers
        self.tie = {}
        logits = self.forward(prompt, cache)
        out = {"prompt_ids": list(map(int, prompt)),
               "last_logits": logits[-1].tolist(),
               "all_logits": logits.tolist() if all_rows else None}
        ids, margins = [], []
        last = logits[-1]
        for _ in range(n_greedy):
            order = np.argsort(-last, kind="stable")  # ties: the lowest id (as torch.argmax)
            t = int(order[0])
            ids.append(t)
            margins.append(float(last[order[0]] - last[order[1]]))
            last = self.forward([t], cache)[-1]
        out["greedy_ids"] = ids
        out["greedy_margins"] = margins
        # Rows before the first position with an activation (or KV) element within guard of an
        # e4m3 rounding boundary: an implementation whose relative error is below guard
        # rounds every element there as this reference does, so its logits of those rows
        # (and the greedy tokens they produce) must match tightly; later rows may differ by
        # as much as the FP8 rounding noise itself.
        n = len(prompt)
        first = min([p_ for p_, d_ in self.tie.items() if d_ < self.guard], default=n + n_greedy)
        out["certain_rows"] = int(min(first, n))
        out["certain_greedy"] = int(min(max(first - (n - 1), 0), n_greedy))
        out["tie_guard"] = self.guard
        return out


# ---------------------------------------------------------------------------------------------
# quantize

SCHEMES = ("ct-channel-dynamic", "ct-tensor-static", "ct-weight-only", "ct-channel-bf16scale",
           "block", "dequant-f32")


def _f32(x):
    return np.asarray(x, dtype=np.float32)


def quant_rows(w32):
    """Per output channel: scale = amax(row) / 448 (float32); codes of e4m3(w / scale) with the
    division in float32."""
    amax = np.max(np.abs(w32), axis=1, keepdims=True).astype(np.float32)
    s = (amax / np.float32(FP8_MAX)).astype(np.float32)
    s = np.where(s > 0, s, np.float32(MIN_SCALE)).astype(np.float32)  # an all-zero row
    return e4m3_encode((w32 / s).astype(np.float32)), s


def quant_tensor(w32):
    amax = np.float32(np.max(np.abs(w32)))
    s = np.float32(amax / np.float32(FP8_MAX))
    if not s > 0:
        s = np.float32(MIN_SCALE)
    return e4m3_encode((w32 / s).astype(np.float32)), np.array([s], dtype=np.float32)


def quant_blocks(w32):
    """128 x 128 blocks (partial edge blocks): scale = amax(block) / 448 (float32)."""
    o, i = w32.shape
    nb_o, nb_i = -(-o // 128), -(-i // 128)
    s = np.zeros((nb_o, nb_i), dtype=np.float32)
    codes = np.zeros((o, i), dtype=np.uint8)
    for bo in range(nb_o):
        for bi in range(nb_i):
            blk = w32[bo * 128:(bo + 1) * 128, bi * 128:(bi + 1) * 128]
            sc = np.float32(np.max(np.abs(blk)) / np.float32(FP8_MAX))
            if not sc > 0:
                sc = np.float32(MIN_SCALE)
            s[bo, bi] = sc
            codes[bo * 128:(bo + 1) * 128, bi * 128:(bi + 1) * 128] = \
                e4m3_encode((blk / sc).astype(np.float32))
    return codes, s


def calib_prompts(vocab, n):
    """n fixed pseudo-random prompts (seeded; not the test cases' prompts, so that test
    activations can exceed a static scale and saturate, as on real traffic)."""
    rng = np.random.default_rng(20240607)
    return [rng.integers(3, vocab, size=L).tolist() for L in (64, 40, 23, 97)[:n]]


def calibrate(src, n_prompts):
    """Per module: max |input| over the calibration prompts (unquantized float64 model); per
    layer: max |k| (after RoPE / k-norm) and max |v|."""
    m = Model(src)
    amax = {}

    def obs(kind, li, names, arr):
        a = float(np.max(np.abs(arr)))
        for n in names:
            key = (li, n)
            amax[key] = max(amax.get(key, 0.0), a)

    m.observe = obs
    for p in calib_prompts(m.cfg.vocab, n_prompts):
        m.forward(p, [None] * m.cfg.n_layers)
    return m.cfg, amax


def cmd_quantize(a):
    src, out, scheme = a.src, a.out, a.scheme
    if scheme not in SCHEMES:
        raise SystemExit("unknown scheme %s (one of %s)" % (scheme, ", ".join(SCHEMES)))
    if a.kv_scales and scheme == "dequant-f32":
        raise SystemExit("--kv-scales needs a quantization_config (not dequant-f32)")
    os.makedirs(out, exist_ok=True)
    with open(os.path.join(src, "config.json")) as f:
        cj = json.load(f)
    if cj.get("quantization_config"):
        raise SystemExit("%s is already quantized" % src)
    tens = st_read_dir(src)
    cfg = Cfg(cj)
    need_calib = scheme == "ct-tensor-static" or a.kv_scales
    amax = calibrate(src, a.calib)[1] if need_calib else {}
    outt = {}
    for name, (dt, shape, arr) in tens.items():
        mod = name[:-len(".weight")] if name.endswith(".weight") else None
        is_lin = mod is not None and mod.startswith("model.layers.") and \
            any(mod.endswith("." + ln) for ln in LINEARS)
        if not is_lin:
            outt[name] = (dt, shape, arr)
            continue
        w32 = to_f64((dt, shape, arr)).astype(np.float32)  # bf16/f32 -> f32 (exact)
        li = int(mod.split(".")[2])
        short = mod.split(".")[-1]
        if scheme in ("ct-channel-dynamic", "ct-weight-only", "ct-channel-bf16scale"):
            codes, s = quant_rows(w32)
            outt[name] = ("F8_E4M3", shape, codes)
            if scheme == "ct-channel-bf16scale":
                outt[mod + ".weight_scale"] = ("BF16", [shape[0], 1], f32_to_bf16_bits(s))
            else:
                outt[mod + ".weight_scale"] = ("F32", [shape[0], 1], s)
        elif scheme == "ct-tensor-static":
            codes, s = quant_tensor(w32)
            outt[name] = ("F8_E4M3", shape, codes)
            outt[mod + ".weight_scale"] = ("F32", [1], s)
            ins = np.float32(np.float32(amax[(li, short)]) / np.float32(FP8_MAX))
            if a.skew_static:  # q/k/v and gate/up differ: exercises the fused modules' max
                ins = np.float32(ins * {"k_proj": 1.5, "v_proj": 0.75, "up_proj": 1.25}.get(
                    short, 1.0))
            outt[mod + ".input_scale"] = ("F32", [1], np.array([ins], dtype=np.float32))
        elif scheme == "block":
            codes, s = quant_blocks(w32)
            outt[name] = ("F8_E4M3", shape, codes)
            outt[mod + ".weight_scale_inv"] = ("F32", list(s.shape), s)
        elif scheme == "dequant-f32":
            codes, s = quant_rows(w32)
            deq = (e4m3_decode(codes).astype(np.float32) * s).astype(np.float32)  # f32 product
            outt[name] = ("F32", shape, deq)
    if a.kv_scales:
        # compressed-tensors (llm-compressor) checkpoints name the attention module's scales
        # model.layers.N.self_attn.k_scale / v_scale (F32, one element); vLLM maps them to
        # its attn.k_scale (older checkpoints wrote k_proj.output_scale / v_proj.output_scale,
        # which vLLM's get_cache_scale renames the same way). The scale applies to the key as
        # the cache stores it: after RoPE (and Qwen3's k-norm); value as projected.
        for li in range(cfg.n_layers):
            for kv in ("k", "v"):
                s = np.float32(np.float32(amax[(li, kv)]) / np.float32(FP8_MAX))
                outt["model.layers.%d.self_attn.%s_scale" % (li, kv)] = \
                    ("F32", [1], np.array([s], dtype=np.float32))
    # Convert non-quantized tensors as they are (bf16 stays bf16).
    st_write(os.path.join(out, "model.safetensors"), outt)

    ch = {"num_bits": 8, "type": "float", "strategy": "channel", "symmetric": True,
          "dynamic": False, "group_size": None, "block_structure": None, "observer": "minmax"}
    tok = {"num_bits": 8, "type": "float", "strategy": "token", "symmetric": True,
           "dynamic": True, "group_size": None, "block_structure": None, "observer": None}
    qc = None
    if scheme.startswith("ct-"):
        w, ia = dict(ch), dict(tok)
        if scheme == "ct-tensor-static":
            w["strategy"] = "tensor"
            ia.update(strategy="tensor", dynamic=False, observer="minmax")
        elif scheme == "ct-weight-only":
            ia = None
        qc = {"quant_method": "compressed-tensors", "format": "float-quantized",
              "quantization_status": "compressed",
              "config_groups": {"group_0": {"targets": ["Linear"], "weights": w,
                                            "input_activations": ia, "output_activations": None,
                                            "format": "float-quantized"}},
              "ignore": ["lm_head"]}
    elif scheme == "block":
        qc = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
              "weight_block_size": [128, 128]}
    if qc is not None and a.kv_scales:
        # compressed-tensors keeps kv_cache_scheme inside quantization_config; the same key is
        # added to the block ("fp8") config for pdserve's tests (vLLM's fp8 method reads the
        # k_scale / v_scale tensors when they are present).
        qc["kv_cache_scheme"] = {"num_bits": 8, "type": "float", "strategy": "tensor",
                                 "dynamic": False, "symmetric": True}
    cj2 = dict(cj)
    if qc is not None:
        cj2["quantization_config"] = qc
    if scheme == "dequant-f32":
        cj2["dtype"] = "float32"
        cj2.pop("torch_dtype", None)
    with open(os.path.join(out, "config.json"), "w") as f:
        json.dump(cj2, f, indent=2)
        f.write("\n")
    for fn in os.listdir(src):
        if fn in ("config.json", "golden.json") or fn.endswith(".safetensors") or \
                fn.endswith(".safetensors.index.json"):
            continue
        p = os.path.join(src, fn)
        if os.path.isfile(p):
            shutil.copyfile(p, os.path.join(out, fn))
    print("%s: %s -> %s" % (scheme, src, out))


# ---------------------------------------------------------------------------------------------
# ref / diff

def cmd_ref(a):
    dt = np.float32 if a.dtype == "f32" else np.float64
    m = Model(a.dir, dtype=dt, weights_f32=a.weights_f32)
    m.kv_fp8 = a.kv_fp8
    m.hf_emulate = a.hf_emulate
    if a.jitter:
        m.jitter = a.jitter
        m.rng = np.random.default_rng(a.seed)
    with open(a.cases) as f:
        g = json.load(f)
    n_greedy = g.get("greedy_new_tokens", 24)
    cases = []
    for c in g["cases"]:
        p = c["prompt_ids"]
        cases.append(m.run_case(p, n_greedy, c.get("all_logits") is not None or len(p) <= 33))
    desc = "pdserve tests/quant/fp8_ref.py, %s forward of %s%s%s" % (
        "float32" if dt == np.float32 else "float64", os.path.basename(os.path.normpath(a.dir)),
        " (quantization_config %s)" % m.qc["method"] if m.qc else "",
        ", FP8 KV cache" if a.kv_fp8 else "")
    with open(a.out, "w") as f:
        json.dump({"model": g.get("model"), "reference": desc, "greedy_new_tokens": n_greedy,
                   "cases": cases}, f)


def diff_json(ga, gb):
    """Per case: (max |a - b| / std(b's row) over rows both have, max |a - b|, greedy tokens
    equal before the first difference, tokens compared)."""
    res = []
    for ca, cb in zip(ga["cases"], gb["cases"]):
        rows = [(ca["last_logits"], cb["last_logits"])]
        if ca.get("all_logits") and cb.get("all_logits"):
            rows += list(zip(ca["all_logits"], cb["all_logits"]))
        rel = absd = 0.0
        for ra, rb in rows:
            ra, rb = np.asarray(ra), np.asarray(rb)
            d = float(np.max(np.abs(ra - rb)))
            absd = max(absd, d)
            rel = max(rel, d / float(np.std(rb)))
        agree = 0
        for x, y in zip(ca["greedy_ids"], cb["greedy_ids"]):
            if x != y:
                break
            agree += 1
        res.append((rel, absd, agree, len(cb["greedy_ids"])))
    return res


def cmd_diff(a):
    with open(a.a) as f:
        ga = json.load(f)
    with open(a.b) as f:
        gb = json.load(f)
    worst = 0.0
    for i, (rel, absd, agree, n) in enumerate(diff_json(ga, gb)):
        print("case %d (%3d tokens): max|d|/std %.3e  max|d| %.3e  greedy %d/%d" %
              (i, len(gb["cases"][i]["prompt_ids"]), rel, absd, agree, n))
        worst = max(worst, rel)
    print("worst max|d|/std %.3e" % worst)


def _ref_cases(d, cases, n_greedy, **kw):
    m = Model(d, dtype=kw.pop("dtype", np.float64), weights_f32=kw.pop("weights_f32", False))
    m.kv_fp8 = kw.pop("kv_fp8", False)
    if kw.get("jitter"):
        m.jitter = kw["jitter"]
        m.rng = np.random.default_rng(kw.get("seed", 1))
    return {"cases": [m.run_case(c["prompt_ids"], n_greedy, c.get("all_logits") is not None)
                      for c in cases]}


def _divergence(ga, gb):
    """(first step where the greedy ids differ or None, b's margin there)."""
    out = []
    for ca, cb in zip(ga["cases"], gb["cases"]):
        step = next((i for i, (x, y) in enumerate(zip(ca["greedy_ids"], cb["greedy_ids"]))
                     if x != y), None)
        out.append((step, cb["greedy_margins"][step] if step is not None else None))
    return out


def cmd_measure(a):
    """For each golden model and checkpoint variant in WORK (made by quantize as
    WORK/<model>.<variant>): the variant's float64 reference against the unquantized golden
    (the quality cost) and perturbed runs of the same reference against it (how much e4m3
    rounding flips move the logits: the tolerance a float32 implementation needs)."""
    models = a.models.split(",")
    for mname in models:
        gdir = os.path.join(a.golden, mname)
        with open(os.path.join(gdir, "golden.json")) as f:
            g = json.load(f)
        cases, ng = g["cases"], g.get("greedy_new_tokens", 24)
        for var in a.variants.split(","):
            d = os.path.join(a.work, "%s.%s" % (mname, var))
            kv = var.endswith("-kv")
            ref = _ref_cases(d, cases, ng, kv_fp8=kv)
            q = diff_json(ref, g)
            dv = _divergence(ref, g)
            print("%-11s %-22s vs unquantized golden: max|d|/std %.3e (max|d| %.3e); greedy "
                  "agree %s; first divergence (step, golden margin) %s" % (
                      mname, var, max(r[0] for r in q), max(r[1] for r in q),
                      "/".join(str(r[2]) for r in q),
                      [(s_, round(m_, 4)) for s_, m_ in dv if s_ is not None]))
            perts = [("f32", dict(dtype=np.float32)), ("w-f32", dict(weights_f32=True))]
            perts += [("jit1e-6/%d" % sd, dict(jitter=1e-6, seed=sd)) for sd in (1, 2, 3)]
            perts += [("jit2^-9/1", dict(jitter=2.0 ** -9, seed=1))]
            for pn, kw in perts:
                r = _ref_cases(d, cases, ng, kv_fp8=kv, **kw)
                q = diff_json(r, ref)
                dv = _divergence(r, ref)
                print("%-11s %-22s   %-10s vs f64 ref: max|d|/std %.3e (max|d| %.3e); greedy "
                      "divergence (step, ref margin) %s" % (
                          mname, var, pn, max(x[0] for x in q), max(x[1] for x in q),
                          [(s_, round(m_, 4)) for s_, m_ in dv if s_ is not None]))
            sys.stdout.flush()


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    q = sub.add_parser("quantize")
    q.add_argument("src")
    q.add_argument("out")
    q.add_argument("--scheme", required=True, choices=SCHEMES)
    q.add_argument("--kv-scales", action="store_true")
    q.add_argument("--calib", type=int, default=4, help="calibration prompts (1..4)")
    q.add_argument("--skew-static", action="store_true",
                   help="ct-tensor-static: k_proj's input_scale x1.5, v_proj's x0.75, "
                        "up_proj's x1.25 (so that the fused modules' scales differ)")
    r = sub.add_parser("ref")
    r.add_argument("dir")
    r.add_argument("--cases", required=True)
    r.add_argument("--out", required=True)
    r.add_argument("--kv-fp8", action="store_true")
    r.add_argument("--dtype", choices=("f64", "f32"), default="f64",
                   help="f32: the whole forward (activation quantization included) in float32")
    r.add_argument("--weights-f32", action="store_true",
                   help="dequantized weights rounded to float32 (a perturbation)")
    r.add_argument("--jitter", type=float, default=0.0,
                   help="relative Gaussian noise on each linear's input (a perturbation)")
    r.add_argument("--seed", type=int, default=1)
    r.add_argument("--hf-emulate", action="store_true",
                   help="validation only: RMSNorm and RoPE in float32 as transformers does")
    d = sub.add_parser("diff")
    d.add_argument("a")
    d.add_argument("b", help="the reference (its rows' std normalizes)")
    me = sub.add_parser("measure")
    me.add_argument("golden", help="the golden directory (model subdirectories)")
    me.add_argument("work", help="where quantize wrote <model>.<variant>")
    me.add_argument("--models", default="llama-tiny,qwen2-tiny,qwen3-tiny")
    me.add_argument("--variants", default="ct-channel-dynamic,ct-tensor-static,ct-weight-only,"
                    "ct-channel-bf16scale,block,dequant-f32,ct-channel-dynamic-kv")
    sub.add_parser("selftest")
    a = ap.parse_args()
    _self_test_e4m3()
    {"quantize": cmd_quantize, "ref": cmd_ref, "diff": cmd_diff, "measure": cmd_measure,
     "selftest": lambda a: print("e4m3 self-test passed")}[a.cmd](a)


if __name__ == "__main__":
    main()
