"""The stdin loop of the OTel SDK child programs (span_facts_child.py,
batch_child.py): one command a line; "flush" force-flushes the provider and
prints "flushed", "exit" ends the loop, any other runs COMMANDS[cmd](args)
and prints "done"; the provider is shut down (exporting what is left) at the end."""

import os
import sys


def serve(provider, commands: dict) -> None:
    print(f"ready {os.getpid()}", flush=True)
    for line in sys.stdin:
        cmd, *args = line.split()
        if cmd == "flush":
            provider.force_flush()
            print("flushed", flush=True)
        elif cmd == "exit":
            break
        else:
            commands[cmd](args)
            print("done", flush=True)
    provider.shutdown()
