// The daemon's errors as TypeScript errors: the gRPC code, the ErrorInfo
// reason and metadata (docs/API.md lists them), and a budget refusal's usage
// as numbers.
import { Metadata, status, type ServiceError } from "@grpc/grpc-js";
import { ErrorInfo } from "./gen/google/rpc/error_details.js";
import { Status } from "./gen/google/rpc/status.js";

const ERROR_INFO_TYPE = "type.googleapis.com/google.rpc.ErrorInfo";
const DETAILS_KEY = "grpc-status-details-bin";

/** Why the daemon refused a write for its tier's budget. */
export const BUDGET_REASONS: ReadonlySet<string> = new Set([
  "TIER_BUDGET_EXCEEDED",
  "ENTRY_TOO_LARGE",
]);

/** A failed call: what gRPC said, and the daemon's ErrorInfo when it sent one. */
export class MemoryError extends Error {
  /** The gRPC status code (`status.UNAVAILABLE` and so on). */
  readonly code: status;
  /** ErrorInfo's reason, such as `TIER_BUDGET_EXCEEDED`; "" when none was sent. */
  readonly reason: string;
  /** ErrorInfo's domain: "memory.v1" for the daemon's own errors. */
  readonly domain: string;
  /** ErrorInfo's metadata, as sent (every value a string). */
  readonly metadata: Readonly<Record<string, string>>;
  /** The status message: written for a person (or a model) to read. */
  readonly details: string;

  constructor(
    code: status,
    details: string,
    info: ErrorInfo | undefined,
    options?: { cause?: unknown },
  ) {
    const reason = info?.reason ?? "";
    super(`${status[code] ?? code}${reason ? ` ${reason}` : ""}: ${details}`, options);
    this.name = "MemoryError";
    this.code = code;
    this.reason = reason;
    this.domain = info?.domain ?? "";
    this.metadata = Object.freeze({ ...(info?.metadata ?? {}) });
    this.details = details;
  }

  /** The code's name, such as "FAILED_PRECONDITION". */
  get codeName(): string {
    return status[this.code] ?? String(this.code);
  }
}

/**
 * A write refused for its tier's budget: `TIER_BUDGET_EXCEEDED` (the tier
 * would overflow) or `ENTRY_TOO_LARGE` (the entry alone is longer than the
 * whole budget: removing entries cannot make room).
 */
export class BudgetError extends MemoryError {
  /** "memory" (agent notes) or "user" (user profile). */
  readonly tier: string;
  readonly limitChars: number;
  /** What the tier holds now (TIER_BUDGET_EXCEEDED). */
  readonly usedChars: number | undefined;
  /** What the write needs, its separator included (TIER_BUDGET_EXCEEDED). */
  readonly requestedChars: number | undefined;
  /** The entry's length (ENTRY_TOO_LARGE). */
  readonly entryChars: number | undefined;

  constructor(code: status, details: string, info: ErrorInfo, options?: { cause?: unknown }) {
    super(code, details, info, options);
    this.name = "BudgetError";
    this.tier = info.metadata["tier"] ?? "";
    this.limitChars = number(info.metadata["limit_chars"]) ?? 0;
    this.usedChars = number(info.metadata["used_chars"]);
    this.requestedChars = number(info.metadata["requested_chars"]);
    this.entryChars = number(info.metadata["entry_chars"]);
  }
}

function number(text: string | undefined): number | undefined {
  return text === undefined || text === "" ? undefined : Number(text);
}

function isServiceError(error: unknown): error is ServiceError {
  return (
    error instanceof Error &&
    typeof (error as Partial<ServiceError>).code === "number" &&
    (error as Partial<ServiceError>).metadata instanceof Metadata
  );
}

/** The ErrorInfo a failed call's trailers carry, if any. */
export function errorInfo(metadata: Metadata): ErrorInfo | undefined {
  for (const value of metadata.get(DETAILS_KEY)) {
    if (typeof value === "string") continue;
    let decoded: Status;
    try {
      decoded = Status.decode(value);
    } catch {
      // Trailers a proxy mangled: the code and message still stand.
      continue;
    }
    for (const detail of decoded.details) {
      if (detail.typeUrl === ERROR_INFO_TYPE) return ErrorInfo.decode(detail.value);
    }
  }
  return undefined;
}

/** `error` as a MemoryError (or BudgetError) when gRPC raised it; else as it is. */
export function toMemoryError(error: unknown): unknown {
  if (error instanceof MemoryError || !isServiceError(error)) return error;
  const info = errorInfo(error.metadata);
  if (info !== undefined && BUDGET_REASONS.has(info.reason)) {
    return new BudgetError(error.code, error.details, info, { cause: error });
  }
  return new MemoryError(error.code, error.details, info, { cause: error });
}
