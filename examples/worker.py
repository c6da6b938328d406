"""An example Rota worker for the specs in ../specs. Run it from the repository root:

    rota worker examples.worker:worker --url http://127.0.0.1:8000 --token "$WORKER_TOKEN"
"""

from __future__ import annotations

import asyncio
import shutil
import tempfile
from typing import Any

from rota import JobContext, Worker

worker = Worker(specs_dir="specs", concurrency=10, labels=["example"])


@worker.handler("echo")
async def echo(ctx: JobContext) -> dict[str, Any]:
    reply: dict[str, Any] = {"message": ctx.args["message"]}
    if ctx.parent_results:  # a workflow's step: the results of the steps before it
        reply["after"] = ctx.parent_results
    return reply


@worker.handler("resize_image")
async def resize_image(ctx: JobContext) -> dict[str, Any]:
    ctx.progress(10, "downloading")
    ctx.log(f"source is {ctx.args['url']}")  # kept with the job if enqueued with capture_logs
    if shutil.disk_usage(tempfile.gettempdir()).free < 2**30:
        ctx.alert("disk almost full", "error")  # logged by the server, shown in GET /workers
    await asyncio.sleep(0.1)  # pretend to fetch and resize
    ctx.progress(100, "resized")
    return {"url": ctx.args["url"], "width": ctx.args["width"],
            "format": ctx.args.get("format", "png")}


@worker.handler("send_email")
def send_email(ctx: JobContext) -> dict[str, str]:
    # A plain function runs in the worker's thread pool, so blocking I/O is fine here.
    return {"delivered_to": ctx.args["to"], "template": ctx.args["template"]}
