"""Workflows of the example specs: a chain, a group and a batch. Run it from the repository
root while examples/worker.py runs; it reads ROTA_URL and ROTA_TOKEN, as the CLI does."""

from rota import Client, group, step

with Client() as client:
    # A chain: each step runs once the one before it completed, and reads the results of
    # the steps before it in ctx.parent_results (the echo handler sends them back).
    thumbnail = client.chain(
        step("resize_image", url="https://example.com/c.png", width=128),
        step("echo", message="thumbnail ready"),
        name="thumbnail", id="thumbnail-c")
    print(thumbnail.id, thumbnail.result(timeout=30))

    # A group: side by side; its result is {"0": ..., "1": ..., ...}, in the order given.
    sizes = client.group(*(step("resize_image", url="https://example.com/d.png", width=w)
                           for w in (64, 128, 256)), name="sizes")
    print(sizes.id, sizes.result(timeout=30))

    # A batch: a group whose callbacks run once all its jobs are done: on_complete
    # always, on_success if none failed, on_failure if any did.
    welcome = client.batch(
        step("send_email", to="ada@example.com", template="welcome"),
        step("send_email", to="bo@example.com", template="welcome"),
        on_complete=step("echo", message="welcome mails done"), name="welcome")
    print(welcome.id, welcome.wait(timeout=30).state)

    # Nested: rota.group (like rota.chain and rota.batch) builds without sending. Here a
    # chain's first step is a group, so its second reads {"0": {"0": ..., "1": ...}}.
    nested = client.chain(group(step("echo", message="a"), step("echo", message="b")),
                          step("echo", message="both echoed"), name="nested")
    print(nested.id, nested.result(timeout=30))
