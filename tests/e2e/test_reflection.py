#!/usr/bin/python3
"""test_reflection.py -- gRPC server reflection on pdserve-router (issue #30), on both
grpc.reflection.v1 and v1alpha, with Python stubs generated from our reflection.proto files:
ListServices names the public services (pdserve.v1.Generation, grpc.health.v1.Health, the two
reflection services) and no internal one; FileContainingSymbol("pdserve.v1.Generation") and
FileByFilename("pdserve/v1/generation.proto") return FileDescriptorProtos that
google.protobuf's descriptor_pb2 parses; a descriptor pool built from them knows Generate
(server-streaming, GenerateRequest -> GenerateResponse), and a request built from that pool
alone (as grpcurl does) generates text; unknown symbols and files and the internal protos are
NOT_FOUND (5), an empty request INVALID_ARGUMENT (3); several requests on one stream are
answered in order. With grpcurl installed, `grpcurl list` and a Generate call too.

usage: test_reflection.py BIN_DIR SHARED_DIR PROTO_DIR"""
import os, shutil, subprocess, sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import e2e_util as eu

H = eu.Harness(sys.argv)
check = H.check
import grpc
from google.protobuf import descriptor_pb2, descriptor_pool, message_factory

VERSIONS = ("v1", "v1alpha")
PUBLIC = {"pdserve.v1.Generation", "grpc.health.v1.Health",
          "grpc.reflection.v1.ServerReflection", "grpc.reflection.v1alpha.ServerReflection"}


def reflection_stubs():
    """Compiles our reflection.proto files with protoc + grpc_python_plugin. They are copied
    under pd_reflection_<version>/ first: generated under grpc/reflection/..., the modules
    would import themselves as grpc.reflection.*, which is grpcio's package (the package
    inside the files, hence the method paths, stays grpc.reflection.<version>)."""
    root = os.path.join(H.tmp, "refl")
    files = []
    for v in VERSIONS:
        os.makedirs(os.path.join(root, "pd_reflection_" + v), exist_ok=True)
        dst = os.path.join("pd_reflection_" + v, "reflection.proto")
        shutil.copy(os.path.join(H.proto, "grpc", "reflection", v, "reflection.proto"),
                    os.path.join(root, dst))
        files.append(dst)
    plugin = shutil.which("grpc_python_plugin")
    subprocess.check_call(["protoc", "-I" + root, "--python_out=" + root,
                           "--grpc_python_out=" + root,
                           "--plugin=protoc-gen-grpc_python=" + plugin] + files, cwd=root)
    sys.path.insert(0, root)
    import importlib
    return {v: (importlib.import_module("pd_reflection_%s.reflection_pb2" % v),
                importlib.import_module("pd_reflection_%s.reflection_pb2_grpc" % v))
            for v in VERSIONS}


def ask(stub, rpb, reqs):
    """Sends reqs on one ServerReflectionInfo stream; returns the responses."""
    return list(stub.ServerReflectionInfo(iter(reqs), timeout=20))


def files_of(resp):
    return [descriptor_pb2.FileDescriptorProto.FromString(b)
            for b in resp.file_descriptor_response.file_descriptor_proto]


def generate_via_pool(port, fdps):
    """Builds GenerateRequest / GenerateResponse from the reflected files only and calls
    Generate with them: what grpcurl does with reflection."""
    pool = descriptor_pool.DescriptorPool()
    for fdp in reversed(fdps):  # imports first
        pool.Add(fdp)
    svc = pool.FindServiceByName("pdserve.v1.Generation")
    m = svc.methods_by_name["Generate"]
    factory = message_factory.MessageFactory(pool)
    Req, Resp = factory.GetPrototype(m.input_type), factory.GetPrototype(m.output_type)
    req = Req(prompt="Once upon a time")
    req.stopping.max_tokens = 8
    with grpc.insecure_channel("127.0.0.1:%d" % port) as ch:
        gen = ch.unary_stream("/pdserve.v1.Generation/Generate",
                              request_serializer=Req.SerializeToString,
                              response_deserializer=Resp.FromString)
        out = list(gen(req, timeout=60))
    return m, out


def run_version(v, rpb, rpbg, port):
    ch = grpc.insecure_channel("127.0.0.1:%d" % port)
    stub = rpbg.ServerReflectionStub(ch)
    R = rpb.ServerReflectionRequest
    # ListServices.
    r = ask(stub, rpb, [R(host="h", list_services="*")])
    names = {s.name for s in r[0].list_services_response.service} if r else set()
    check(len(r) == 1 and PUBLIC <= names, "%s ListServices: %s" % (v, sorted(names)))
    check(not any("internal" in n for n in names), "%s ListServices: no internal service" % v)
    check(r and r[0].valid_host == "h" and r[0].original_request.list_services == "*",
          "%s: valid_host and original_request echoed" % v)
    # FileContainingSymbol -> a pool that knows Generate; a request from that pool works.
    r = ask(stub, rpb, [R(file_containing_symbol="pdserve.v1.Generation")])
    fdps = files_of(r[0]) if r else []
    check([f.name for f in fdps] == ["pdserve/v1/generation.proto"] and fdps[0].package == "pdserve.v1",
          "%s FileContainingSymbol(pdserve.v1.Generation): %s" % (v, [f.name for f in fdps]))
    if fdps:
        svc = [s for s in fdps[0].service if s.name == "Generation"]
        gm = [m for m in svc[0].method if m.name == "Generate"] if svc else []
        check(gm and gm[0].server_streaming and not gm[0].client_streaming,
              "%s: Generate is server-streaming in the descriptor" % v)
        m, out = generate_via_pool(port, fdps)
        check(m.input_type.full_name == "pdserve.v1.GenerateRequest" and
              m.output_type.full_name == "pdserve.v1.GenerateResponse",
              "%s: the pool's Generate takes %s, answers %s" % (v, m.input_type.full_name,
                                                                 m.output_type.full_name))
        text = "".join(x.text for x in out)
        ntok = sum(len(x.token_ids) for x in out)
        check(ntok == 8 and text and out[-1].finish_reason != 0,
              "%s: Generate with messages built from the reflected descriptors: %d tokens %r"
              % (v, ntok, text))
    # FileByFilename, the health file, the reflection service itself.
    r = ask(stub, rpb, [R(file_by_filename="pdserve/v1/generation.proto"),
                        R(file_containing_symbol="grpc.health.v1.Health.Check"),
                        R(file_containing_symbol="grpc.reflection.%s.ServerReflection" % v)])
    got = [[f.name for f in files_of(x)] for x in r]
    check(got == [["pdserve/v1/generation.proto"], ["grpc/health/v1/health.proto"],
                  ["grpc/reflection/%s/reflection.proto" % v]],
          "%s FileByFilename / symbols of health and reflection: %s" % (v, got))
    # Errors.
    r = ask(stub, rpb, [R(file_containing_symbol="pdserve.v1.NoSuchService"),
                        R(file_containing_symbol="pdserve.internal.v1.Decode"),
                        R(file_by_filename="pdserve/internal/v1/decode.proto"),
                        R(host="only a host"),
                        R(file_containing_extension=rpb.ExtensionRequest(
                            containing_type="pdserve.v1.GenerateRequest", extension_number=100)),
                        R(all_extension_numbers_of_type="pdserve.v1.GenerateRequest")])
    codes = [x.error_response.error_code if x.HasField("error_response") else None for x in r]
    check(codes[:5] == [5, 5, 5, 3, 5], "%s: NOT_FOUND / INVALID_ARGUMENT codes %s" % (v, codes))
    check(len(r) == 6 and "pdserve.v1.NoSuchService" in r[0].error_response.error_message,
          "%s: the message names the symbol (%r)" % (v, r[0].error_response.error_message if r else ""))
    check(len(r) == 6 and r[5].HasField("all_extension_numbers_response") and
          r[5].all_extension_numbers_response.base_type_name == "pdserve.v1.GenerateRequest" and
          list(r[5].all_extension_numbers_response.extension_number) == [],
          "%s: AllExtensionNumbersOfType of a proto3 message: none" % v)
    # Several requests on one stream, answered in order.
    syms = ["pdserve.v1.GenerateRequest", "grpc.health.v1.HealthCheckRequest", "nope.Nope",
            "pdserve.v1.FinishReason", "pdserve.v1.Generation.Tokenize"] * 4
    r = ask(stub, rpb, [R(file_containing_symbol=s) for s in syms])
    check([x.original_request.file_containing_symbol for x in r] == syms and
          [x.HasField("error_response") for x in r] == [s == "nope.Nope" for s in syms],
          "%s: %d requests on one stream answered in order" % (v, len(syms)))
    ch.close()


def run_grpcurl(port):
    tool = shutil.which("grpcurl")
    if not tool:
        print("note: grpcurl is not installed; its checks are skipped")
        return
    addr = "127.0.0.1:%d" % port
    out = subprocess.run([tool, "-plaintext", addr, "list"], capture_output=True, text=True,
                         timeout=60)
    check(out.returncode == 0 and "pdserve.v1.Generation" in out.stdout,
          "grpcurl list: %s" % out.stdout.split())
    out = subprocess.run([tool, "-plaintext", "-d",
                          '{"prompt": "Once upon a time", "stopping": {"max_tokens": 5}}', addr,
                          "pdserve.v1.Generation/Generate"], capture_output=True, text=True,
                         timeout=60)
    check(out.returncode == 0 and "tokenIds" in out.stdout, "grpcurl Generate: %s" %
          (out.stdout or out.stderr)[-300:])


try:
    stubs = reflection_stubs()
    common = ["--model", H.model, "--listen", "127.0.0.1:0", "--metrics-port", "0"]
    dec = H.start("pdserve-decode", *common, tag="decode")
    pre = H.start("pdserve-prefill", *common, tag="prefill")
    router = H.start("pdserve-router", *common, "--prefill", "127.0.0.1:%d" % pre.port,
                     "--decode", "127.0.0.1:%d" % dec.port, tag="router")
    for v in VERSIONS:
        run_version(v, *stubs[v], router.port)
    run_grpcurl(router.port)
    H.stop()
finally:
    H.kill_all()
H.finish()
