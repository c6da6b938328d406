"""Manual mode: take resize_image jobs by hand. Run it from the repository root; it reads
ROTA_URL and ROTA_TOKEN (a worker token) as `rota worker` does. Ctrl-C stops it."""

import asyncio
import logging
import os
from typing import Any

from rota import Worker


async def resize(args: dict[str, Any]) -> dict[str, Any]:
    await asyncio.sleep(0.1)  # pretend to fetch and resize
    return {"url": args["url"], "width": args["width"]}


async def main() -> None:
    worker = Worker(url=os.environ.get("ROTA_URL", "http://127.0.0.1:8000"),
                    token=os.environ.get("ROTA_TOKEN"), specs_dir="specs", labels=["manual"])
    async with worker.listen("resize_image") as jobs:
        async for job in jobs:  # each job holds a slot until it is reported
            try:
                job.complete(await resize(job.args))
            except Exception as exc:
                job.fail(exc)


if __name__ == "__main__":
    logging.basicConfig(level=logging.INFO)  # the worker's lines: connected, state, ...
    logging.getLogger("rota.worker").setLevel(logging.DEBUG)  # and a line for each job
    asyncio.run(main())
