"""tls_util.py -- Helpers of the TLS end-to-end tests: test certificates made with the
openssl command (a CA, a server certificate for localhost and 127.0.0.1, a client
certificate, a second unrelated CA with its own client certificate), the serial number a TLS
port presents, and the disaggregated stack (prefill + decode + router on stories260k) started
with TLS on the public port and mutual TLS on the internal ports."""
import os, shutil, signal, socket, ssl, subprocess, time

import e2e_util

def _run(args, cwd):
    r = subprocess.run(args, cwd=cwd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    if r.returncode != 0:
        raise SystemExit("openssl failed: %s\n%s" % (" ".join(args), r.stdout))

def _key_and_csr(d, name, cn):
    _run(["openssl", "req", "-new", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1",
          "-nodes", "-keyout", name + ".key", "-out", name + ".csr", "-subj", "/CN=" + cn], d)

def _sign(d, name, ca, serial, ext):
    with open(os.path.join(d, name + ".ext"), "w") as f:
        f.write(ext)
    _run(["openssl", "x509", "-req", "-in", name + ".csr", "-CA", ca + ".pem", "-CAkey", ca + ".key",
          "-set_serial", str(serial), "-days", "2", "-out", name + ".pem", "-extfile", name + ".ext"], d)

def _ca(d, name, cn):
    _run(["openssl", "req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1",
          "-nodes", "-keyout", name + ".key", "-out", name + ".pem", "-subj", "/CN=" + cn,
          "-days", "2", "-addext", "basicConstraints=critical,CA:TRUE",
          "-addext", "keyUsage=critical,keyCertSign,cRLSign"], d)

SERVER_EXT = ("subjectAltName=DNS:localhost,IP:127.0.0.1\nbasicConstraints=CA:FALSE\n"
              "keyUsage=digitalSignature\nextendedKeyUsage=serverAuth\n")
CLIENT_EXT = "basicConstraints=CA:FALSE\nkeyUsage=digitalSignature\nextendedKeyUsage=clientAuth\n"

def make_certs(d):
    """Makes the test PKI in directory d (skips the test without openssl); returns a dict of
    paths: ca, ca2 (unrelated), server/server_key (serial 1001), server2/server2_key (same
    CA, serial 1002), client/client_key (CA), client2/client2_key (signed by ca2)."""
    if not shutil.which("openssl"):
        e2e_util.skip("the openssl command is missing")
    os.makedirs(d, exist_ok=True)
    _ca(d, "ca", "pdserve test CA")
    _ca(d, "ca2", "unrelated test CA")
    for name, ca, serial, ext, cn in (("server", "ca", 1001, SERVER_EXT, "localhost"),
                                      ("server2", "ca", 1002, SERVER_EXT, "localhost"),
                                      ("client", "ca", 2001, CLIENT_EXT, "pdserve-router"),
                                      ("client2", "ca2", 3001, CLIENT_EXT, "intruder")):
        _key_and_csr(d, name, cn)
        _sign(d, name, ca, serial, ext)
    p = lambda n: os.path.join(d, n)
    return {"ca": p("ca.pem"), "ca2": p("ca2.pem"), "server": p("server.pem"),
            "server_key": p("server.key"), "server2": p("server2.pem"), "server2_key": p("server2.key"),
            "client": p("client.pem"), "client_key": p("client.key"),
            "client2": p("client2.pem"), "client2_key": p("client2.key")}

def read(path):
    with open(path, "rb") as f:
        return f.read()

def peer_serial(port, ca, client=None, host="127.0.0.1"):
    """The serial number of the certificate a TLS port presents to a new connection (verified
    with ca; client = (cert, key) for ports that require a client certificate)."""
    ctx = ssl.create_default_context(cafile=ca)
    ctx.set_alpn_protocols(["h2"])
    if client:
        ctx.load_cert_chain(client[0], client[1])
    with socket.create_connection((host, port), timeout=10) as s:
        with ctx.wrap_socket(s, server_hostname=host) as t:
            return int(t.getpeercert()["serialNumber"], 16)

def idle_close_seconds(port, limit, host="127.0.0.1"):
    """Opens a TCP connection, sends nothing, and returns the seconds until the server closes
    it (None if it is still open after limit seconds)."""
    t0 = time.monotonic()
    with socket.create_connection((host, port), timeout=limit) as s:
        try:
            while True:
                data = s.recv(4096)  # a plaintext server may send its SETTINGS first
                if not data:
                    return time.monotonic() - t0
        except socket.timeout:
            return None
        except ConnectionResetError:
            return time.monotonic() - t0

class Stack:
    """prefill + decode + router with TLS on the router's public port (certificate files
    copied into their own directory so that a test can replace them) and mutual TLS on the
    instances' ports (the router presents the client certificate). .rport, .pport, .dport,
    .pub_cert / .pub_key (the router's files), .procs."""
    def __init__(self, bin_dir, tmp, model, certs, env, router_extra=()):
        self.procs = []
        pub = os.path.join(tmp, "router-tls")
        os.makedirs(pub, exist_ok=True)
        self.pub_cert, self.pub_key = os.path.join(pub, "tls.crt"), os.path.join(pub, "tls.key")
        shutil.copy(certs["server"], self.pub_cert)
        shutil.copy(certs["server_key"], self.pub_key)
        inst_tls = ["--tls-cert", certs["server"], "--tls-key", certs["server_key"],
                    "--tls-client-ca", certs["ca"]]
        common = ["--model", model, "--listen", "127.0.0.1:0", "--kv-cache-mb", "64"] + inst_tls
        try:
            self.pre = e2e_util.start(bin_dir, tmp, "pdserve-prefill", common, env, tag="tls-prefill")
            self.procs.append(self.pre.p)
            self.dec = e2e_util.start(bin_dir, tmp, "pdserve-decode", common, env, tag="tls-decode")
            self.procs.append(self.dec.p)
            self.rtr = e2e_util.start(
                bin_dir, tmp, "pdserve-router",
                ["--model", model, "--listen", "127.0.0.1:0", "--load-poll-ms", "100",
                 "--prefill", "127.0.0.1:%d" % self.pre.port, "--decode", "127.0.0.1:%d" % self.dec.port,
                 "--tls-cert", self.pub_cert, "--tls-key", self.pub_key,
                 "--internal-tls-ca", certs["ca"], "--internal-tls-cert", certs["client"],
                 "--internal-tls-key", certs["client_key"]] + list(router_extra),
                env, tag="tls-router")
            self.procs.append(self.rtr.p)
        except BaseException:
            self.stop()
            raise
        self.pport, self.dport, self.rport = self.pre.port, self.dec.port, self.rtr.port

    def terminate(self, timeout=60):
        """SIGTERM to every process (router first); returns their exit codes (None: still
        running after timeout, then killed). Under ASan a leak at exit makes a code non-zero."""
        for p in reversed(self.procs):
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
        codes = []
        for p in reversed(self.procs):
            try:
                codes.append(p.wait(timeout))
            except subprocess.TimeoutExpired:
                codes.append(None)
        self.stop()
        return codes

    def stop(self):
        for p in self.procs:
            if p.poll() is None:
                p.kill()
                p.wait()
