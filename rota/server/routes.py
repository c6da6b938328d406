"""The route table: every operation of the HTTP API, once. It makes both the app's
Starlette routes and the OpenAPI document (rota/server/openapi.py), so the two cannot drift
apart.
"""

from __future__ import annotations

import functools

import msgspec

from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from rota.server import api, callbacks, cronapi, endpointapi, feeds, operate, secretapi, workflows, workschema
from rota.server.secretapi import SecretDeleted, SecretList, SecretPut, SecretRequest
from rota.server.api import PushRequest, RetireRequest, StateRequest, TokenRequest
from rota.server.gate import OPEN_PATHS  # one list of what needs no token: the gate's
from rota.base.flow import WrittenRule
from rota.core.jobs import BatchRequest, EnqueueRequest
from rota.core.schedules import ScheduleDef
from rota.server.openapi import Op, document
from rota.server.openapi_schemas import (BatchReply, BulkReply, CallbackReply, Directed, Enqueued, ErrorBody, Health,
                                  History, JobDetail, JobList, JobView, LimitCleared, LimitEntry,
                                  LimitList, NewToken, PushReply, ScheduleList, SchedulePut,
                                  ScheduleView,
                                  QueuePaused, Queues, ResultReply, Retired, Revoked, SpecList,
                                  Stats, TokenList, Workers, Workflow, WorkflowCreated,
                                  WorkflowList)
from rota.core.workflow_defs import Composite
from rota.server.operate import BulkRequest

BAD = {400: ErrorBody, 413: ErrorBody, 422: ErrorBody}
ROUTES: list[Op] = [
    Op("post", "/jobs", api.enqueue, "Enqueue a job", EnqueueRequest,
     {201: Enqueued, 200: Enqueued, 409: ErrorBody, **BAD}),
    Op("get", "/jobs", operate.list_jobs, "Find jobs, newest first, a page at a time (admin)",
       None, {200: JobList, 400: ErrorBody, 422: ErrorBody}),  # 422: an unknown spec, queue
    Op("post", "/jobs/retry", operate.bulk_retry,
       "Retry discarded and cancelled jobs, by ids or filter (admin)", BulkRequest,
       {200: BulkReply, **BAD}),
    Op("post", "/jobs/cancel", operate.bulk_cancel,
       "Cancel waiting and running jobs, by ids or filter (admin)", BulkRequest,
       {200: BulkReply, **BAD}),
    Op("post", "/jobs/batch", api.enqueue_batch,
       "Enqueue many jobs in one transaction", BatchRequest,
     {200: BatchReply, **BAD}),
    Op("get", "/jobs/{job_id}", api.show_job, "A job, with its logs and why it waits", None,
     {200: JobDetail, 404: ErrorBody}),
    Op("delete", "/jobs/{job_id}", api.cancel_job, "Cancel a job", None,
     {200: JobView, 202: JobView, 404: ErrorBody, 409: ErrorBody}),
    Op("post", "/jobs/{job_id}/retry", api.retry_job, "Put a discarded or cancelled job back", None,
     {200: JobView, 404: ErrorBody, 409: ErrorBody}),
    Op("post", "/jobs/{job_id}/callback", callbacks.callback,
       "A push endpoint's result for a job it answered 202 (its token, not a bearer token)",
       callbacks.CallbackBody, {200: CallbackReply, 403: ErrorBody, 409: ErrorBody, **BAD}),
    Op("post", "/jobs/{job_id}/callback/heartbeat", callbacks.callback_beat,
       "A push endpoint's job runs on: its lease starts again", callbacks.BeatBody,
       {200: CallbackReply, 403: ErrorBody, 409: ErrorBody, **BAD}),
    Op("get", "/jobs/{job_id}/result", api.job_result,
       "A job's result, waiting up to ?wait= seconds", None,
     {200: ResultReply, 202: ResultReply, 400: ErrorBody, 401: ErrorBody, 404: ErrorBody,
      429: ErrorBody}),
    Op("post", "/workflows", workflows.create_workflow,
       "Create a workflow: a chain, group or batch of jobs, nestable, stored whole", Composite,
       {201: WorkflowCreated, 200: WorkflowCreated, 403: ErrorBody, 409: ErrorBody, **BAD}),
    Op("get", "/workflows", workflows.list_workflows,
       "Workflows, newest first, a page at a time (a producer's own)", None,
       {200: WorkflowList, 400: ErrorBody, 422: ErrorBody}),
    Op("get", "/workflows/{workflow_id}", workflows.show_workflow,
       "A workflow, with its steps' states and jobs", None, {200: Workflow, 404: ErrorBody}),
    Op("delete", "/workflows/{workflow_id}", workflows.cancel_workflow,
       "Cancel a workflow: its waiting and running jobs", None,
       {200: Workflow, 404: ErrorBody, 409: ErrorBody}),
    Op("post", "/workflows/{workflow_id}/retry", workflows.retry_workflow,
       "Run a failed workflow again from where it failed (admin)", None,
       {200: Workflow, 404: ErrorBody, 409: ErrorBody}),
    Op("get", "/specs", api.list_specs, "The status quo", None, {200: SpecList}),
    Op("put", "/specs", api.push_specs,
       "Push specs (a deploy)", PushRequest, {200: PushReply, **BAD}),
    Op("post", "/specs/{name}/retire", api.retire_spec,
       "Retire a spec: no new jobs of it", RetireRequest, {200: Retired, 404: ErrorBody, **BAD}),
    Op("get", "/specs/{name}/history", api.spec_history, "Every version pushed for a spec", None,
     {200: History, 404: ErrorBody}),
    Op("get", "/workers", api.list_workers, "Connected workers", None, {200: Workers}),
    Op("get", "/endpoints", endpointapi.list_endpoints, "Push endpoints: each version of a"
       " spec with [execute], its circuit breaker and deliveries in flight (admin)", None,
       {200: endpointapi.Endpoints}),
    Op("post", "/workers/state", api.direct_workers,
       "Quiet or terminate workers by label, or all", StateRequest,
     {200: Directed, **BAD}),
    Op("post", "/workers/{worker_id}/state", api.direct_worker,
       "Quiet or terminate one worker", StateRequest,
     {200: Directed, 202: Directed, 404: ErrorBody, 409: ErrorBody, **BAD}),
    Op("get", "/queues", api.list_queues,
       "Per-queue counts and why jobs wait", None, {200: Queues}),
    Op("post", "/queues/{queue}/pause", operate.pause_queue,
       "Pause a queue: it keeps its jobs and assigns none (admin)", None,
       {200: QueuePaused, 400: ErrorBody, 422: ErrorBody}),
    Op("post", "/queues/{queue}/resume", operate.resume_queue,
       "Resume a paused queue (admin)", None, {200: QueuePaused, 400: ErrorBody,
                                              422: ErrorBody}),
    Op("get", "/limits", operate.list_limits,
       "Every flow-control limit in force, and where it comes from (admin)", None,
       {200: LimitList}),
    Op("put", "/limits/{kind}/{name}", operate.set_limit,
       "Set a queue's or spec's limits, replacing its spec file's until cleared (admin)",
       WrittenRule, {200: LimitEntry, **BAD}),
    Op("delete", "/limits/{kind}/{name}", operate.clear_limit,
       "Clear a limit set at runtime (admin)", None,
       {200: LimitCleared, 404: ErrorBody, 422: ErrorBody}),
    Op("get", "/schedules", cronapi.list_schedules, "Cron schedules, with their last run and"
       " next fire times (admin)", None, {200: ScheduleList}),
    Op("get", "/schedules/{name}", cronapi.show_schedule, "A cron schedule (admin)", None,
       {200: ScheduleView, 400: ErrorBody, 404: ErrorBody}),
    Op("put", "/schedules/{name}", cronapi.put_schedule, "Add or replace a cron schedule"
       " (admin)", ScheduleDef, {200: SchedulePut, 201: SchedulePut, **BAD}),
    Op("delete", "/schedules/{name}", cronapi.delete_schedule, "Delete a cron schedule; its"
       " jobs stay (admin)", None, {200: ScheduleView, 400: ErrorBody, 404: ErrorBody}),
    Op("post", "/schedules/{name}/pause", cronapi.pause_schedule, "Pause a cron schedule:"
       " its ticks make no jobs until resumed (admin)", None,
       {200: ScheduleView, 400: ErrorBody, 404: ErrorBody}),
    Op("post", "/schedules/{name}/resume", cronapi.resume_schedule, "Resume a paused cron"
       " schedule; the ticks of its pause are not caught up (admin)", None,
       {200: ScheduleView, 400: ErrorBody, 404: ErrorBody}),
    Op("post", "/tokens", api.create_token, "Create a token (admin)", TokenRequest,
       {201: NewToken, 409: ErrorBody, **BAD}),
    Op("get", "/tokens", api.list_tokens, "The live tokens, never their secrets (admin)", None,
       {200: TokenList}),
    Op("delete", "/tokens/{token}", api.revoke_token, "Revoke a token by id or name (admin)",
       None, {200: Revoked, 404: ErrorBody}),
    Op("put", "/secrets/{name}", secretapi.put_secret, "Set or rotate an endpoint signing"
       " secret, or generate one (answered this once) when no value is given (admin)",
       SecretRequest, {200: SecretPut, 201: SecretPut, **BAD}),
    Op("get", "/secrets", secretapi.list_secrets, "Signing secrets: names, dates and source"
       " (environment or database), never values (admin)", None, {200: SecretList}),
    Op("delete", "/secrets/{name}", secretapi.delete_secret, "Delete a signing secret from"
       " the database (admin)", None, {200: SecretDeleted, 400: ErrorBody, 404: ErrorBody}),
    Op("get", "/events", feeds.events, "Server-sent events: what happens, as it happens"
       " (admin)", None, {200: None, 400: ErrorBody, 422: ErrorBody, 429: ErrorBody}),
    Op("get", "/stats", feeds.stats, "Counts per minute over the last hour, and the oldest"
       " available job per queue (admin)", None, {200: Stats, 400: ErrorBody}),
    Op("get", "/metrics", feeds.metrics, "Prometheus metrics (admin or metrics scope)", None,
       {200: None}),
    Op("get", "/healthz", api.healthz, "Health (no token needed)", None, {200: Health}),
]
STORED_PATHS = {"/jobs", "/jobs/batch", "/jobs/{job_id}", "/jobs/{job_id}/retry",
                "/jobs/{job_id}/result", "/specs", "/specs/{name}/history", "/queues",
                "/tokens", "/tokens/{token}", "/specs/{name}/retire", "/stats", "/metrics",
                "/jobs/retry", "/jobs/cancel", "/queues/{queue}/pause", "/queues/{queue}/resume",
                "/limits/{kind}/{name}", "/workflows", "/workflows/{workflow_id}",
                "/workflows/{workflow_id}/retry", "/schedules", "/schedules/{name}",
                "/schedules/{name}/pause", "/schedules/{name}/resume", "/secrets",
                "/secrets/{name}"}


@functools.cache
def _encoded() -> bytes:
    return msgspec.json.encode(document(ROUTES, stored=STORED_PATHS, tokenless=OPEN_PATHS))


async def openapi_json(request: Request) -> Response:
    return Response(_encoded(), media_type="application/json")


async def work_schema_json(request: Request) -> Response:
    """The /work frames as a JSON Schema (rota/server/workschema.py)."""
    return Response(workschema.encoded(), media_type="application/schema+json")


# The app's HTTP routes: the table's operations, and the document itself.
routes = [Route(op.path, op.handler, methods=[op.method.upper()]) for op in ROUTES]
routes.append(Route("/openapi.json", openapi_json, methods=["GET"]))
routes.append(Route("/work.schema.json", work_schema_json, methods=["GET"]))
