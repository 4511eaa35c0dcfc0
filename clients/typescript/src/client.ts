// MemoryClient: the memory.v1 API bound to one scope, with the glue every
// runtime would otherwise write (clients/README.md is the contract the
// Python, Go and TypeScript clients share).
import { randomUUID } from "node:crypto";
import {
  Client,
  credentials as grpcCredentials,
  Metadata,
  status,
  type CallOptions as GrpcCallOptions,
  type ChannelCredentials,
  type ClientOptions,
  type ClientReadableStream,
  type MethodDefinition,
  type ServiceError,
} from "@grpc/grpc-js";
import { MemoryError, toMemoryError } from "./errors.js";
import {
  AddMemoryRequest,
  CallToolRequest,
  DeleteMemoryRequest,
  DeleteScopeRequest,
  EndSessionRequest,
  ExportMemoriesRequest,
  ForgetUserRequest,
  GetMemoriesRequest,
  InjectForTurnRequest,
  ListToolsRequest,
  MemoryServiceService,
  NotifyCompactionRequest,
  SearchMemoriesRequest,
  Tier,
  UpdateMemoryRequest,
  WatchMemoriesRequest,
  type AddMemoryResponse,
  type DeleteMemoryResponse,
  type DeleteScopeResponse,
  type EndSessionResponse,
  type ExportMemoriesResponse,
  type ForgetUserResponse,
  type GetMemoriesResponse,
  type InjectForTurnResponse,
  type ListToolsResponse,
  type Memory,
  type MemoryEvent,
  type NotifyCompactionResponse,
  type Scope,
  type SearchHit,
  type SearchMemoriesResponse,
  type UpdateMemoryResponse,
} from "./gen/memory/v1/memory.js";

/** When and how often a failed call is tried again (only UNAVAILABLE is). */
export interface RetryPolicy {
  /** Attempts in all, the first included; 1 turns retries off. */
  maxAttempts: number;
  /** The first back-off's ceiling; each back-off is drawn from [0, ceiling]. */
  initialBackoffMs: number;
  /** The ceiling's growth per attempt. */
  multiplier: number;
  /** The ceiling's cap. */
  maxBackoffMs: number;
}

export const DEFAULT_RETRY: Readonly<RetryPolicy> = Object.freeze({
  maxAttempts: 4,
  initialBackoffMs: 50,
  multiplier: 2,
  maxBackoffMs: 2000,
});

/** 10 s for a unary call; a stream as a whole has none unless asked. */
export const DEFAULT_TIMEOUT_MS = 10_000;

export interface MemoryClientOptions {
  /** host:port of the daemon (its gRPC listener). */
  address: string;
  /** Whose memories: agent notes of agentId, the profile of userId. */
  scope: { agentId?: string; userId?: string };
  /** Sent as `authorization: Bearer <token>` on every call. */
  token?: string;
  /** Each unary call's deadline unless the call gives its own (10 s). */
  timeoutMs?: number;
  retry?: Partial<RetryPolicy>;
  /** Send the highest generation this client wrote as min_generation (true). */
  readYourWrites?: boolean;
  /** TLS and so on; plaintext by default (a sidecar on loopback). */
  credentials?: ChannelCredentials;
  /** Passed to grpc-js as they are: channel options, interceptors. */
  grpcOptions?: Partial<ClientOptions>;
}

/** Per-call options: every method takes them last. */
export interface CallOptions {
  /** This call's deadline, retries included; for a stream, the whole stream's. */
  timeoutMs?: number;
}

/** AddMemory's fields beside the content (the scope is the client's). */
export type AddOptions = Partial<Omit<AddMemoryRequest, "scope" | "content">> & CallOptions;
/** UpdateMemory's fields: `id` or `match` (with `tier`), and what changes. */
export type UpdateFields = Partial<Omit<UpdateMemoryRequest, "scope">>;
/** DeleteMemory's fields: `id`, or `match` with `tier`. */
export type DeleteFields = Partial<Omit<DeleteMemoryRequest, "scope">>;
export type ListFields = Partial<Omit<GetMemoriesRequest, "scope" | "minGeneration">>;
export type SearchFields = Partial<
  Omit<SearchMemoriesRequest, "scope" | "query" | "minGeneration">
>;
export type TurnFields = Partial<
  Omit<InjectForTurnRequest, "scope" | "sessionId" | "userMessage" | "minGeneration">
>;
export type ExportFields = Partial<Omit<ExportMemoriesRequest, "scope">>;
export type WatchFields = Partial<Omit<WatchMemoriesRequest, "scope">>;

/** The two tool shapes model APIs take. */
export type ToolFormat = "openai" | "anthropic";
/** One tool definition, as the model API takes it (parsed JSON). */
export type ToolDefinition = Record<string, unknown>;

/** What a tool call gives back for the model. */
export interface ToolResult {
  /** The text to hand back to the model as the tool's result. */
  text: string;
  /** True when the call did not do what it asked; `text` says why. */
  isError: boolean;
  /** The outcome as an object, for the runtime (CallTool's structured_json). */
  structured: unknown;
  /**
   * The highest generation the call's writes took (0: it wrote nothing);
   * the client's reads wait for it, as for addMemory's.
   */
  generation: number;
}

export interface CallToolOptions extends CallOptions {
  /**
   * The shape the tools were declared in. With "anthropic", a call of
   * `memory` is Claude's memory tool (memory_20250818), as tools("anthropic")
   * declared it in place of the `memory` tool when the daemon offers it.
   */
  format?: ToolFormat;
}

// Tools that only read, so a call of them is retried as any read is.
const READING_TOOLS: ReadonlySet<string> = new Set(["memory_search", "memory_list"]);
const CLAUDE_MEMORY_TOOL = "memory_20250818";
// Reasons for which the daemon says nothing was written: a write without an
// idempotency key may be retried after them, unlike after a cut connection.
const NOTHING_WRITTEN: ReadonlySet<string> = new Set([
  "DATABASE_BUSY",
  "DATABASE_UNAVAILABLE",
]);

/** How a call may be retried. */
type Safety = "read" | "keyed-write" | "write";

type Method<Req, Res> = MethodDefinition<Req, Res>;

/**
 * A client of one daemon, bound to one scope. Every method is async and
 * rejects with a MemoryError (a BudgetError for a budget refusal).
 */
export class MemoryClient {
  readonly scope: Readonly<Scope>;
  private readonly client: Client;
  private readonly token: string | undefined;
  private readonly timeoutMs: number;
  private readonly retry: RetryPolicy;
  private readonly readYourWrites: boolean;
  private generation = 0;

  constructor(options: MemoryClientOptions) {
    this.scope = Object.freeze({
      agentId: options.scope.agentId ?? "",
      userId: options.scope.userId ?? "",
    });
    this.token = options.token;
    this.timeoutMs = options.timeoutMs ?? DEFAULT_TIMEOUT_MS;
    this.retry = { ...DEFAULT_RETRY, ...options.retry };
    this.readYourWrites = options.readYourWrites ?? true;
    this.client = new Client(
      options.address,
      options.credentials ?? grpcCredentials.createInsecure(),
      options.grpcOptions,
    );
  }

  /** The highest generation a write of this client answered (0: none yet). */
  get lastGeneration(): number {
    return this.generation;
  }

  close(): void {
    this.client.close();
  }

  // --- Writes -------------------------------------------------------------

  /**
   * Stores an entry (TIER_MEMORY unless `tier` says otherwise). Without an
   * `idempotencyKey` the client makes one, so that a retry after a cut
   * connection returns the stored entry instead of storing it twice.
   */
  async addMemory(content: string, options: AddOptions = {}): Promise<AddMemoryResponse> {
    const { timeoutMs, ...fields } = options;
    const request = AddMemoryRequest.fromPartial({
      ...fields,
      scope: this.scope,
      content,
      idempotencyKey: fields.idempotencyKey || randomUUID(),
    });
    const response = await this.unary(
      MemoryServiceService.addMemory,
      request,
      "keyed-write",
      timeoutMs,
    );
    this.wrote(response.generation);
    return response;
  }

  /** Changes the fields given on the entry named by `id` or `match`. */
  async updateMemory(
    fields: UpdateFields,
    options: CallOptions = {},
  ): Promise<UpdateMemoryResponse> {
    const request = UpdateMemoryRequest.fromPartial({ ...fields, scope: this.scope });
    const response = await this.unary(
      MemoryServiceService.updateMemory,
      request,
      "write",
      options.timeoutMs,
    );
    this.wrote(response.generation);
    return response;
  }

  /** Removes the entry named by `id` or `match` and gives it back. */
  async deleteMemory(
    fields: DeleteFields,
    options: CallOptions = {},
  ): Promise<DeleteMemoryResponse> {
    const request = DeleteMemoryRequest.fromPartial({ ...fields, scope: this.scope });
    const response = await this.unary(
      MemoryServiceService.deleteMemory,
      request,
      "write",
      options.timeoutMs,
    );
    this.wrote(response.generation);
    return response;
  }

  /**
   * Erases the scope's tiers (or the one named), as the daemon's `erase`
   * grant allows. Idempotent (a repeat erases nothing), so it is retried.
   */
  async deleteScope(tier: Tier = Tier.TIER_UNSPECIFIED, options: CallOptions = {}) {
    const request = DeleteScopeRequest.fromPartial({ scope: this.scope, tier });
    const response: DeleteScopeResponse = await this.unary(
      MemoryServiceService.deleteScope,
      request,
      "read",
      options.timeoutMs,
    );
    this.wrote(response.erasure?.generation ?? 0);
    return response;
  }

  /** Erases everything stored for a user (the scope's user by default). */
  async forgetUser(
    fields: Partial<ForgetUserRequest> = {},
    options: CallOptions = {},
  ): Promise<ForgetUserResponse> {
    const request = ForgetUserRequest.fromPartial({ userId: this.scope.userId, ...fields });
    const response = await this.unary(
      MemoryServiceService.forgetUser,
      request,
      "read",
      options.timeoutMs,
    );
    this.wrote(response.erasure?.generation ?? 0);
    return response;
  }

  // --- Reads --------------------------------------------------------------

  /** One page of entries (both tiers unless `tier` says otherwise). */
  async getMemories(fields: ListFields = {}, options: CallOptions = {}) {
    const request = GetMemoriesRequest.fromPartial({
      ...fields,
      scope: this.scope,
      minGeneration: this.minGeneration(),
    });
    const response: GetMemoriesResponse = await this.unary(
      MemoryServiceService.getMemories,
      request,
      "read",
      options.timeoutMs,
    );
    return response;
  }

  /** Every entry, page after page (each page's call has its own deadline). */
  async *memories(fields: ListFields = {}, options: CallOptions = {}): AsyncGenerator<Memory> {
    let pageToken = fields.pageToken ?? "";
    do {
      const page = await this.getMemories({ ...fields, pageToken }, options);
      yield* page.memories;
      pageToken = page.nextPageToken;
    } while (pageToken !== "");
  }

  /** One page of the entries matching `query`, best first. */
  async searchMemories(
    query: string,
    fields: SearchFields = {},
    options: CallOptions = {},
  ): Promise<SearchMemoriesResponse> {
    const request = SearchMemoriesRequest.fromPartial({
      ...fields,
      scope: this.scope,
      query,
      minGeneration: this.minGeneration(),
    });
    return this.unary(MemoryServiceService.searchMemories, request, "read", options.timeoutMs);
  }

  /** Every hit of `query` (up to `limit`), page after page. */
  async *searchHits(
    query: string,
    fields: SearchFields = {},
    options: CallOptions = {},
  ): AsyncGenerator<SearchHit> {
    let pageToken = fields.pageToken ?? "";
    do {
      const page = await this.searchMemories(query, { ...fields, pageToken }, options);
      yield* page.hits;
      pageToken = page.nextPageToken;
    } while (pageToken !== "");
  }

  /**
   * The scope's entries as JSONL batches (ExportMemories). After a cut
   * connection it resumes from the cursor of the last batch received, so
   * every line comes once.
   */
  async *exportMemories(
    fields: ExportFields = {},
    options: CallOptions = {},
  ): AsyncGenerator<ExportMemoriesResponse> {
    let cursor = fields.cursor ?? "";
    yield* this.resumable(options.timeoutMs, () =>
      this.stream(
        MemoryServiceService.exportMemories,
        ExportMemoriesRequest.fromPartial({ ...fields, scope: this.scope, cursor }),
      ),
      (batch) => {
        cursor = batch.cursor;
      },
    );
  }

  /**
   * The scope's changes as they happen (WatchMemories), until the caller
   * stops iterating. After a cut connection it resumes after the last event
   * it yielded (its generation, tier and id), so nothing is missed or
   * repeated. With no `afterGeneration`, it starts from now with a SYNC event.
   */
  async *watchMemories(
    fields: WatchFields = {},
    options: CallOptions = {},
  ): AsyncGenerator<MemoryEvent> {
    let resume: WatchFields = {
      afterGeneration: fields.afterGeneration ?? 0,
      afterTier: fields.afterTier ?? Tier.TIER_UNSPECIFIED,
      afterId: fields.afterId ?? "",
    };
    const events = this.resumable(
      options.timeoutMs,
      () =>
        this.stream(
          MemoryServiceService.watchMemories,
          WatchMemoriesRequest.fromPartial({ ...fields, ...resume, scope: this.scope }),
        ),
      ({ event }) => {
        if (event === undefined) return;
        // A tier and id name the event within its generation (an expiry
        // sweep's batch shares one); SYNC and ERASE have no id, and resume
        // after their whole generation.
        resume =
          event.id !== ""
            ? { afterGeneration: event.generation, afterTier: event.tier, afterId: event.id }
            : {
                afterGeneration: event.generation,
                afterTier: Tier.TIER_UNSPECIFIED,
                afterId: "",
              };
      },
    );
    for await (const { event } of events) {
      if (event !== undefined) yield event;
    }
  }

  // --- The turn loop ------------------------------------------------------

  /**
   * What to inject before one model call: `systemBlock` (the frozen block,
   * byte-identical from turn to turn until compaction), `turnContext` (the
   * block for this turn), `snapshotGeneration` and `snapshotSha256`.
   */
  async turn(
    session: string,
    message: string,
    fields: TurnFields = {},
    options: CallOptions = {},
  ): Promise<InjectForTurnResponse> {
    const request = InjectForTurnRequest.fromPartial({
      ...fields,
      scope: this.scope,
      sessionId: session,
      userMessage: message,
      minGeneration: this.minGeneration(),
    });
    return this.unary(MemoryServiceService.injectForTurn, request, "read", options.timeoutMs);
  }

  /** ListTools as the daemon answers it. */
  async listTools(options: CallOptions = {}): Promise<ListToolsResponse> {
    const request = ListToolsRequest.fromPartial({ scope: this.scope });
    return this.unary(MemoryServiceService.listTools, request, "read", options.timeoutMs);
  }

  /**
   * The memory tools in the model API's shape: OpenAI function tools, or
   * Anthropic tools with Claude's own memory tool (memory_20250818) in place
   * of the `memory` tool when the daemon offers it (both are named memory).
   */
  async tools(format: ToolFormat, options: CallOptions = {}): Promise<ToolDefinition[]> {
    const listed = await this.listTools(options);
    if (format === "openai") return listed.tools.map((tool) => parse(tool.openaiJson));
    const claude = listed.claudeMemoryTool;
    return listed.tools.flatMap((tool) => {
      if (tool.name === "memory" && claude !== undefined) return [parse(claude.anthropicJson)];
      return [parse(tool.anthropicJson)];
    });
  }

  /**
   * Runs one tool call of the model (its name, and its arguments as an
   * object or the JSON string the model API gave) and gives back the text
   * for the model. Calls of reading tools are retried; writing ones only
   * when the daemon says nothing was written.
   */
  async callTool(
    session: string,
    name: string,
    args: string | Record<string, unknown>,
    options: CallToolOptions = {},
  ): Promise<ToolResult> {
    const tool = options.format === "anthropic" && name === "memory" ? CLAUDE_MEMORY_TOOL : name;
    const argumentsJson = typeof args === "string" ? args : JSON.stringify(args);
    const request = CallToolRequest.fromPartial({
      scope: this.scope,
      sessionId: session,
      name: tool,
      argumentsJson,
    });
    const response = await this.unary(
      MemoryServiceService.callTool,
      request,
      reads(tool, argumentsJson) ? "read" : "write",
      options.timeoutMs,
    );
    // A writing tool's generation counts as addMemory's (0: it wrote nothing).
    this.wrote(response.generation);
    return {
      text: response.text,
      isError: response.isError,
      structured: response.structuredJson ? JSON.parse(response.structuredJson) : {},
      generation: response.generation,
    };
  }

  /** The runtime compacted the session's context: its frozen block may be rebuilt. */
  async notifyCompaction(
    session: string,
    options: CallOptions = {},
  ): Promise<NotifyCompactionResponse> {
    const request = NotifyCompactionRequest.fromPartial({ scope: this.scope, sessionId: session });
    // Idempotent (a repeat invalidates nothing more), so retried as a read.
    return this.unary(MemoryServiceService.notifyCompaction, request, "read", options.timeoutMs);
  }

  /** The session ended: the daemon drops its snapshot. */
  async endSession(session: string, options: CallOptions = {}): Promise<EndSessionResponse> {
    const request = EndSessionRequest.fromPartial({ scope: this.scope, sessionId: session });
    return this.unary(MemoryServiceService.endSession, request, "read", options.timeoutMs);
  }

  // --- Plumbing -----------------------------------------------------------

  private wrote(generation: number): void {
    this.generation = Math.max(this.generation, generation);
  }

  private minGeneration(): number {
    return this.readYourWrites ? this.generation : 0;
  }

  private metadata(): Metadata {
    const metadata = new Metadata();
    if (this.token) metadata.set("authorization", `Bearer ${this.token}`);
    return metadata;
  }

  /** One unary call, retried by the policy within one deadline. */
  private async unary<Req, Res>(
    method: Method<Req, Res>,
    request: Req,
    safety: Safety,
    timeoutMs: number | undefined,
  ): Promise<Res> {
    const deadline = Date.now() + (timeoutMs ?? this.timeoutMs);
    for (let attempt = 1; ; attempt++) {
      try {
        return await this.once(method, request, deadline);
      } catch (raw) {
        const error = toMemoryError(raw);
        if (!(error instanceof MemoryError) || !retryable(error, safety)) throw error;
        const pause = this.backoff(attempt);
        if (attempt >= this.retry.maxAttempts || Date.now() + pause >= deadline) throw error;
        await sleep(pause);
      }
    }
  }

  private once<Req, Res>(method: Method<Req, Res>, request: Req, deadline: number): Promise<Res> {
    return new Promise((resolve, reject) => {
      this.client.makeUnaryRequest(
        method.path,
        method.requestSerialize,
        method.responseDeserialize,
        request,
        this.metadata(),
        { deadline },
        (error: ServiceError | null, response?: Res) => {
          if (error) reject(error);
          else resolve(response as Res);
        },
      );
    });
  }

  private stream<Req, Res>(
    method: Method<Req, Res>,
    request: Req,
  ): (deadline?: number) => ClientReadableStream<Res> {
    return (deadline) => {
      const options: GrpcCallOptions = deadline === undefined ? {} : { deadline };
      return this.client.makeServerStreamRequest(
        method.path,
        method.requestSerialize,
        method.responseDeserialize,
        request,
        this.metadata(),
        options,
      );
    };
  }

  /**
   * A server stream that is opened again after UNAVAILABLE (a cut, a
   * stopping replica) with the request `open` makes from where `received`
   * left it. Attempts count failures in a row: a message received resets
   * them. Leaving the loop early cancels the stream.
   */
  private async *resumable<Res>(
    timeoutMs: number | undefined,
    open: () => (deadline?: number) => ClientReadableStream<Res>,
    received: (message: Res) => void,
  ): AsyncGenerator<Res> {
    const deadline = timeoutMs === undefined ? undefined : Date.now() + timeoutMs;
    let failures = 0;
    for (;;) {
      const call = open()(deadline);
      try {
        for await (const message of call as AsyncIterable<Res>) {
          failures = 0;
          received(message);
          yield message;
        }
        return;
      } catch (raw) {
        const error = toMemoryError(raw);
        if (!(error instanceof MemoryError) || error.code !== status.UNAVAILABLE) throw error;
        failures += 1;
        const pause = this.backoff(failures);
        const late = deadline !== undefined && Date.now() + pause >= deadline;
        if (failures >= this.retry.maxAttempts || late) throw error;
        await sleep(pause);
      } finally {
        call.cancel();
      }
    }
  }

  /** Full jitter: a pause drawn from [0, ceiling], the ceiling growing per attempt. */
  private backoff(attempt: number): number {
    const { initialBackoffMs, multiplier, maxBackoffMs } = this.retry;
    const ceiling = Math.min(maxBackoffMs, initialBackoffMs * multiplier ** (attempt - 1));
    return Math.random() * ceiling;
  }
}

/** Whether a failed call may be sent again (clients/README.md, "Retries"). */
function retryable(error: MemoryError, safety: Safety): boolean {
  if (error.code !== status.UNAVAILABLE) return false;
  // A write with no key may have been stored before the connection broke;
  // only the daemon's word that nothing was written makes a retry safe.
  return safety !== "write" || NOTHING_WRITTEN.has(error.reason);
}

/** Whether a tool call only reads (Claude's memory tool reads with `view`). */
function reads(tool: string, argumentsJson: string): boolean {
  if (READING_TOOLS.has(tool)) return true;
  if (tool !== CLAUDE_MEMORY_TOOL) return false;
  try {
    const args: unknown = JSON.parse(argumentsJson);
    const command = typeof args === "object" && args !== null && "command" in args;
    return command && args.command === "view";
  } catch {
    return false;
  }
}

function parse(json: string): ToolDefinition {
  return JSON.parse(json) as ToolDefinition;
}

function sleep(ms: number): Promise<void> {
  return new Promise((resolve) => setTimeout(resolve, ms));
}
