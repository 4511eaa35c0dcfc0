// What MemoryClient.turn adds to a cached InjectForTurn over the raw
// generated grpc-js stub, on one channel to one daemon: `make bench`
// (bench/client_overhead.py) compiles the package, runs this against the
// daemon it started and puts the figures beside the Python and Go clients'.
//
//   node dist/bench/turn-overhead.js ADDRESS AGENT USER MESSAGE COUNT
//
// Prints one JSON object: each path's p50 and p99 in microseconds, and
// whether every timed call of both hit the session's snapshot.
import { credentials, Metadata } from "@grpc/grpc-js";
import { MemoryClient, memoryv1, type InjectForTurnResponse } from "@memory-sidecar/client";

const [address, agentId, userId, message, countArg] = process.argv.slice(2);
if (countArg === undefined) {
  throw new Error("usage: turn-overhead.js ADDRESS AGENT USER MESSAGE COUNT");
}
const count = Number(countArg);
// As bench.measure.interleaved: warm-up calls, then batches in turn, so both
// paths see the same moments of a noisy machine.
const WARMUP = 50;
const BATCH = 20;
const DEADLINE_MS = 10_000;

const stub = new memoryv1.MemoryServiceClient(address!, credentials.createInsecure());
// The client rides the stub's channel, so both share one connection.
const client = new MemoryClient({
  address: address!,
  scope: { agentId: agentId!, userId: userId! },
  grpcOptions: { channelOverride: stub.getChannel() },
});
// The raw path builds its request once, as a caller of the stub may.
const request = memoryv1.InjectForTurnRequest.fromPartial({
  scope: { agentId: agentId!, userId: userId! },
  sessionId: "ts-raw",
  userMessage: message!,
});
let cached = true;

function raw(): Promise<InjectForTurnResponse> {
  return new Promise((resolve, reject) => {
    const options = { deadline: Date.now() + DEADLINE_MS };
    stub.injectForTurn(request, new Metadata(), options, (error, response) => {
      if (error) reject(error);
      else resolve(response);
    });
  });
}

const throughClient = (): Promise<InjectForTurnResponse> => client.turn("ts-client", message!);

async function timed(call: () => Promise<InjectForTurnResponse>, n: number): Promise<number[]> {
  const out: number[] = [];
  for (let i = 0; i < n; i++) {
    const start = process.hrtime.bigint();
    const response = await call();
    out.push(Number(process.hrtime.bigint() - start) / 1000);
    cached = cached && response.cacheHit;
  }
  return out;
}

// The nearest rank, as bench.measure.pct takes it.
function pct(values: number[], p: number): number {
  const ordered = [...values].sort((a, b) => a - b);
  return ordered[Math.min(ordered.length - 1, Math.round((p / 100) * (ordered.length - 1)))]!;
}

async function main(): Promise<void> {
  try {
    // Each session's first turn builds its snapshot; the warm-up is untimed.
    await timed(raw, WARMUP);
    await timed(throughClient, WARMUP);
    cached = true;
    const stubTimes: number[] = [];
    const clientTimes: number[] = [];
    while (stubTimes.length < count) {
      stubTimes.push(...(await timed(raw, BATCH)));
      clientTimes.push(...(await timed(throughClient, BATCH)));
    }
    const figures = (times: number[]) => ({ p50_us: pct(times, 50), p99_us: pct(times, 99) });
    console.log(JSON.stringify({ stub: figures(stubTimes), client: figures(clientTimes), cached }));
  } finally {
    client.close();
    stub.close();
  }
}

await main();
