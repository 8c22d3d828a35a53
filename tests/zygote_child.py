"""A child for tests/test_zygote.py, run as ``python -m zygote_child ACTION [ARG]`` or forked from a zygote:
prints what it was given, then does ACTION (sleep, exit N, raise, return)."""
import json
import os
import sys
import threading
import time


def preload():
    """Leaves a thread running where ``ZYGOTE_CHILD_THREAD`` is set: a zygote must then refuse to fork."""
    if os.environ.get("ZYGOTE_CHILD_THREAD"):
        threading.Thread(target=time.sleep, args=(600,), daemon=True).start()


if __name__ == "__main__":
    print(json.dumps({"pid": os.getpid(), "argv": sys.argv[1:], "cwd": os.getcwd(),
                      "value": os.environ.get("ZYGOTE_CHILD_VALUE")}), flush=True)
    action = sys.argv[1]
    if action == "sleep":
        time.sleep(600)
    elif action == "exit":
        sys.exit(int(sys.argv[2]))
    elif action == "raise":
        raise ValueError("raised as asked")
