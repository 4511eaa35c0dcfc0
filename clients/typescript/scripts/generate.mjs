// Generates src/gen/ from the proto with protoc and ts-proto (both pinned:
// protoc from the system, ts-proto from devDependencies).
//
//   node scripts/generate.mjs [--out DIR] [--googleapis DIR]
//
// --out: where to write (default src/gen; the freshness test writes to a
// temporary directory and compares). --googleapis: a directory holding
// google/rpc/status.proto and google/rpc/error_details.proto, whose Status
// and ErrorInfo carry the daemon's error reasons. By default they come from
// the googleapis-common-protos package of the Python on PATH (the daemon's
// own dependency), so that no copy of them is kept here.
import { execFileSync } from "node:child_process";
import { existsSync, mkdirSync, readdirSync, rmSync } from "node:fs";
import { dirname, join, resolve } from "node:path";
import { fileURLToPath } from "node:url";
import { parseArgs } from "node:util";

const root = resolve(dirname(fileURLToPath(import.meta.url)), "..");
const protos = resolve(root, "..", "..", "protos");
const { values } = parseArgs({
  options: { out: { type: "string" }, googleapis: { type: "string" } },
});
const out = resolve(values.out ?? join(root, "src", "gen"));
const googleapis = values.googleapis ?? pythonGoogleapis();
if (!existsSync(join(googleapis, "google", "rpc", "status.proto"))) {
  throw new Error(`no google/rpc/status.proto under ${googleapis}`);
}

// Options, each for a reason: grpc-js service clients; `.js` import
// suffixes and esModuleInterop for ESM under NodeNext; Node's Buffer for
// bytes; no JSON methods (the client speaks binary only).
const options = [
  "outputServices=grpc-js",
  "esModuleInterop=true",
  "importSuffix=.js",
  "env=node",
  "outputJsonMethods=false",
];
const plugin = join(root, "node_modules", ".bin", "protoc-gen-ts_proto");
for (const entry of existsSync(out) ? readdirSync(out) : []) {
  rmSync(join(out, entry), { recursive: true });
}
mkdirSync(out, { recursive: true });
execFileSync(
  "protoc",
  [
    `--plugin=protoc-gen-ts_proto=${plugin}`,
    `--ts_proto_out=${out}`,
    `--ts_proto_opt=${options.join(",")}`,
    `-I${protos}`,
    `-I${googleapis}`,
    "memory/v1/memory.proto",
    "google/rpc/status.proto",
    "google/rpc/error_details.proto",
  ],
  { stdio: "inherit" },
);

function pythonGoogleapis() {
  const code =
    "import pathlib, google.rpc.status_pb2 as s; print(pathlib.Path(s.__file__).parents[2])";
  try {
    return execFileSync("python3", ["-c", code], { encoding: "utf8" }).trim();
  } catch {
    throw new Error(
      "google/rpc protos not found: pass --googleapis DIR, or put a Python with " +
        "googleapis-common-protos (the daemon's venv) first on PATH",
    );
  }
}
