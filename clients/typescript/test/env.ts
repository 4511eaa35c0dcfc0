// What the suite reads from its environment: the daemon the pytest wrapper
// (tests/clients/test_typescript_client.py) started, and the cut proxy in
// front of it (tests/clients/cut_proxy.py).
import { randomUUID } from "node:crypto";
import { createConnection } from "node:net";
import type { Interceptor } from "@grpc/grpc-js";
import { InterceptingCall } from "@grpc/grpc-js";
import { MemoryClient, type MemoryClientOptions } from "@memory-sidecar/client";

function required(name: string): string {
  const value = process.env[name];
  if (!value) throw new Error(`${name} is not set: run the suite through its pytest wrapper`);
  return value;
}

/** The daemon's address. */
export const address = (): string => required("MEMORY_SIDECAR_ADDRESS");
/** The cut proxy's address: dial it instead of the daemon to be cut. */
export const cutTarget = (): string => required("MEMORY_SIDECAR_CUT_TARGET");

/**
 * Each call's deadline: the wrapper's bound for a call (tests/waits.py), as
 * the deadline is not what these tests are about and a loaded machine is slow.
 */
export const timeoutMs = Number(process.env["MEMORY_SIDECAR_TEST_TIMEOUT_MS"] ?? 60_000);

/** An agent id of its own per test, so tests sharing a daemon never meet. */
export function agent(prefix: string): string {
  return `${prefix}-${randomUUID().slice(0, 8)}`;
}

export function client(
  agentId: string,
  options: Partial<MemoryClientOptions> = {},
): MemoryClient {
  return new MemoryClient({
    address: address(),
    scope: { agentId, userId: `${agentId}-user` },
    timeoutMs,
    ...options,
  });
}

/** One line to the proxy's control socket, and its answer. */
export function control(command: string): Promise<string> {
  const [host, port] = splitAddress(required("MEMORY_SIDECAR_CUT_CONTROL"));
  return new Promise((resolve, reject) => {
    const socket = createConnection({ host, port });
    let answer = "";
    socket.setEncoding("ascii");
    socket.on("connect", () => socket.write(`${command}\n`));
    socket.on("data", (chunk: string) => {
      answer += chunk;
      if (answer.endsWith("\n")) {
        socket.end();
        resolve(answer.trim());
      }
    });
    socket.on("error", reject);
  });
}

/** How many connections the proxy has cut so far. */
export async function cuts(): Promise<number> {
  return Number(await control("cuts"));
}

function splitAddress(text: string): [string, number] {
  const colon = text.lastIndexOf(":");
  return [text.slice(0, colon), Number(text.slice(colon + 1))];
}

/** A request as it left the client: the method and the message object. */
export interface Sent {
  method: string;
  message: Record<string, unknown>;
  authorization: string[];
}

/** An interceptor that records every request the client sends. */
export function recorder(): { sent: Sent[]; interceptor: Interceptor } {
  const sent: Sent[] = [];
  const interceptor: Interceptor = (options, nextCall) => {
    let authorization: string[] = [];
    return new InterceptingCall(nextCall(options), {
      start(metadata, listener, next) {
        authorization = metadata.get("authorization").map(String);
        next(metadata, listener);
      },
      sendMessage(message: Record<string, unknown>, next) {
        sent.push({ method: options.method_definition.path, message, authorization });
        next(message);
      },
    });
  };
  return { sent, interceptor };
}
