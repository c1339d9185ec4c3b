"""The API's request bodies as typed models, and the OpenAPI document built from them.

msgspec, not pydantic: the agent protocol (`stalwart.protocol`) is msgspec already, so one library
types the wire end to end, decodes JSON straight into the models (no dict in between) and gives
JSON Schema for OpenAPI; it is also the faster of the two at the controller's hottest route (a
batch of agent events).

The operator's bodies reject unknown fields (a typo is an error that names the field, never a
silently ignored option); the agents' bodies (registration, heartbeat, events) ignore them, so a
newer agent may talk to an older controller during a rolling upgrade. Every string and list has a
bound; the whole body is bounded by `MAX_BODY`.
"""
from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Annotated, Any, Literal

import msgspec
from msgspec import Meta

from stalwart import protocol
from stalwart.security import auth
from stalwart.spec import schema as spec_schema

REF_TEMPLATE = "#/components/schemas/{name}"
JOB_SPEC_REF = REF_TEMPLATE.format(name="JobSpec")
MAX_BODY = protocol.MAX_MESSAGE      # a request's body, and one message of an agent's channel
MAX_EVENTS = protocol.MAX_EVENTS
Text = Annotated[str, Meta(max_length=1000)]
Path_ = Annotated[str, Meta(min_length=1, max_length=4096)]


class Body(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """An operator's request body: unknown fields are refused."""


class SubmitJob(Body):
    """A job to run; `spec` is checked field by field by `stalwart.spec.JobSpec` (unknown fields of
    the spec and of its policy are refused with their names, too), and documented by its JSON
    Schema (docs/jobspec.md). It is decoded here as a mapping: `JobSpec.from_dict` also reads what
    JSON Schema gives no single type (a duration's text) and words its refusals for the user.
    `idempotency_key`: a submit sent again with the same key (a retry after a lost answer) returns
    the job the first made."""
    spec: Annotated[dict[str, Any], Meta(extra_json_schema={"$ref": JOB_SPEC_REF})]
    idempotency_key: Annotated[str, Meta(min_length=8, max_length=128, pattern="^[A-Za-z0-9._:-]+$")] | None = None


class MakeJoinToken(Body):
    """A one-time join token: for one machine id (it may enroll again) or, without, any new one."""
    machine: Annotated[str, Meta(min_length=1, max_length=128)] | None = None
    ttl_s: Annotated[float, Meta(gt=0, le=30 * 86400)] = 86400.0


class Enroll(Body):
    """A machine's enrollment (the join token is the request's bearer token)."""


class InjectChaos(Body):
    chaos: Annotated[str, Meta(min_length=1, max_length=1000,
                               description="KIND@machine=M[,rank=R][,KEY=VALUE...] (see `stalwart inject -h`)")]


class CancelJob(Body):
    reason: Text = "cancelled by the user"


class UpdateCode(Body):
    code: Path_
    mode: Literal["lazy", "urgent", "window"] = "lazy"
    window_s: Annotated[float, Meta(gt=0)] | None = None


class AgentEvents(msgspec.Struct, kw_only=True):
    events: Annotated[list[dict[str, Any]], Meta(max_length=MAX_EVENTS)] = []


class Heartbeat(msgspec.Struct, kw_only=True):
    t: float = 0.0
    workers: Any = None


MACHINE_ID, MACHINE_ID_RE = protocol.MACHINE_ID, protocol.MACHINE_ID_RE
PARAMS = {"machine": MACHINE_ID, "incident": "[0-9]{1,15}", "job": "[^/]{1,64}"}
# Query parameters: (name, JSON Schema) per route, all bounded (the fuzzer tries them, the
# handlers check them: `Api._query_int`)
MAX_POINTS = 2000
MAX_WAIT_S = 60.0
QUERY: dict[str, dict[str, Any]] = {
    "since": {"type": "integer", "minimum": 0, "maximum": 2**53 - 1, "default": 0},
    "points": {"type": "integer", "minimum": 1, "maximum": MAX_POINTS, "default": 120},
    "wait": {"type": "number", "minimum": 0, "maximum": MAX_WAIT_S, "default": 0},
    "microbatches": {"type": "integer", "minimum": 1, "maximum": 4096, "default": 8},
}


@dataclass(frozen=True)
class Route:
    method: str
    template: str                        # /api/jobs/{job}: what OpenAPI shows
    handler: str                         # the Api method
    body: type | None = None             # the request model (POST)
    summary: str = ""
    public: bool = False                 # no token needed: stalwart.security.auth.is_public decides
    pattern: re.Pattern = re.compile("")
    query: tuple[str, ...] = ()          # its query parameters (QUERY)

    @classmethod
    def of(cls, method: str, template: str, handler: str, body: type | None = None, summary: str = "",
           param: str = "[^/]+", query: tuple[str, ...] = ()) -> "Route":
        rx = re.sub(r"\{(\w+)\}", lambda m: f"({PARAMS.get(m.group(1), param)})",
                    re.escape(template).replace(r"\{", "{").replace(r"\}", "}"))
        return cls(method, template, handler, body, summary, auth.is_public(template), re.compile(f"^{rx}$"),
                   query)


AGENT_BODIES = (protocol.Registration, AgentEvents, Heartbeat)


def decode(route: Route, raw: bytes) -> Any:
    """The body of a request to `route`, typed (msgspec.ValidationError/DecodeError name the
    problem and the field). An agent's body is Python's JSON, which writes a NaN loss as `NaN`
    (outside strict JSON, and the very value a NaN detector must hear): it is parsed with the
    standard library first, then typed."""
    if route.body is None:
        return None
    if route.body in AGENT_BODIES:
        try:
            obj = json.loads(raw or b"{}")
        except ValueError as e:
            raise msgspec.DecodeError(f"JSON is malformed: {e}") from None
        except RecursionError:
            raise msgspec.DecodeError("JSON is nested too deeply") from None
        # strict=False: JSON object keys are strings, the models' rank maps have int keys
        return msgspec.convert(obj, type=route.body, strict=False)
    return msgspec.json.decode(raw or b"{}", type=route.body)


def openapi(routes: list[Route], version: str) -> dict:
    """An OpenAPI 3.1 document of `routes` (JSON Schema from the models)."""
    models = sorted({r.body for r in routes if r.body is not None}, key=lambda t: t.__name__)
    (schemas_of, components) = msgspec.json.schema_components(models, ref_template=REF_TEMPLATE)
    components.update(spec_schema.components(REF_TEMPLATE)[1])       # JobSpec, Policy: SubmitJob.spec
    refs = dict(zip(models, schemas_of))
    paths: dict[str, dict] = {}
    for r in routes:
        op: dict[str, Any] = {"operationId": r.handler if r.method == "GET" else f"{r.handler}_{r.method.lower()}",
                              "summary": r.summary or r.handler.replace("_", " "),
                              "responses": {"200": {"description": "OK"},
                                            "400": {"description": "invalid request (the message names the field)"},
                                            "404": {"description": "no such job, incident or route"},
                                            "413": {"description": f"body over {MAX_BODY} bytes"},
                                            "500": {"description": "a bug in the controller"}}}
        params = re.findall(r"\{(\w+)\}", r.template)
        if params or r.query:
            op["parameters"] = [{"name": p, "in": "path", "required": True,
                                 "schema": {"type": "integer", "minimum": 0} if p == "incident" else
                                 {"type": "string", "pattern": f"^({PARAMS[p]})$"} if p in PARAMS else
                                 {"type": "string"}}
                                for p in params] + \
                                [{"name": q, "in": "query", "required": False, "schema": QUERY[q]} for q in r.query]
        if r.body is not None:
            op["requestBody"] = {"required": True, "content": {"application/json": {"schema": refs[r.body]}}}
        if not r.public:
            op["responses"]["401"] = {"description": "no or wrong bearer token"}
        else:
            op["security"] = []
        paths.setdefault(r.template, {})[r.method.lower()] = op
    return {"openapi": "3.1.0",
            "info": {"title": "stalwart controller API", "version": version},
            "paths": paths,
            "components": {"schemas": components,
                           "securitySchemes": {"bearer": {"type": "http", "scheme": "bearer"}}},
            "security": [{"bearer": []}]}


ROUTES: list[Route] = [
    Route.of("POST", "/api/agents/{machine}/register", "agent_register", protocol.Registration,
             "an agent (re-)registers with what it runs"),
    Route.of("POST", "/api/agents/{machine}/heartbeat", "agent_heartbeat", Heartbeat, "an agent's heartbeat"),
    Route.of("POST", "/api/agents/{machine}/events", "agent_events", AgentEvents, "a batch of an agent's events"),
    Route.of("POST", "/api/agents/{machine}/enroll", "agent_enroll", Enroll,
             "a machine trades a one-time join token (its bearer token) for its credential"),
    Route.of("POST", "/api/join-tokens", "join_token", MakeJoinToken, "make a one-time join token (operator)"),
    Route.of("GET", "/api/agents/{machine}/commands", "agent_commands", None,
             "an agent's commands (long poll: ?wait=SECONDS)", query=("wait",)),
    Route.of("GET", protocol.CHANNEL_PATH, "agent_channel", None,
             "an agent's channel: a WebSocket (upgrade) carrying its registration, beats and events in "
             "and its commands out, binary frames of MessagePack (stalwart.protocol; 400 without the upgrade)"),
    Route.of("POST", "/api/jobs", "job_submit", SubmitJob, "submit a job"),
    Route.of("GET", "/api/jobs/{job}", "job_status", None, "a job's status and report (job: ID or 'latest')"),
    Route.of("GET", "/api/jobs/{job}/report", "job_status", None, "the same"),
    Route.of("GET", "/api/jobs/{job}/live", "job_live", None,
             "a running job's live progress without its report (an ended job's: its report)"),
    Route.of("POST", "/api/jobs/{job}/inject", "job_inject", InjectChaos, "inject a fault"),
    Route.of("POST", "/api/jobs/{job}/cancel", "job_cancel", CancelJob, "cancel a job"),
    Route.of("POST", "/api/jobs/{job}/versions", "job_update", UpdateCode, "register a code version (hot update)"),
    Route.of("GET", "/api/jobs/{job}/versions", "job_versions", None, "a job's code versions"),
    Route.of("GET", "/api/machines", "machines", None, "the machines and their states"),
    Route.of("GET", "/api/jobs/{job}/dashboard", "job_dashboard", None, "the dashboard's overview"),
    Route.of("GET", "/api/jobs/{job}/series", "job_series", None, "steps and ETTR series (?since=&points=)",
             query=("since", "points")),
    Route.of("GET", "/api/jobs/{job}/incidents/{incident}", "job_incident", None, "one incident in full"),
    Route.of("GET", "/api/jobs/{job}/report.html", "job_report_html", None, "the HTML report"),
    Route.of("GET", "/api/jobs/{job}/whatif", "job_whatif", None,
             "what-if straggler analysis: the step without the slowest rank / machine / stage",
             query=("microbatches",)),
    Route.of("GET", "/metrics", "metrics", None, "Prometheus exposition"),
]
# open routes (stalwart.security.auth.is_public): liveness, this description, the dashboard's page shell
ROUTES += [
    Route.of("GET", "/api/health", "health", None, "liveness"),
    Route.of("GET", "/api/openapi.json", "openapi", None, "this document"),
    Route.of("GET", "/static/{name}", "static", None, "the dashboard's script and style",
             param=r"[A-Za-z0-9_.-]+"),
    Route.of("GET", "/", "dashboard", None, "the dashboard's page"),
]
