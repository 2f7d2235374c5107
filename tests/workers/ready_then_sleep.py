"""Ready at once (sd_notify), then sleep until signalled. Prints its environment of interest."""

import json
import os

from common import forever, notify, say

keys = [
    "CUDA_VISIBLE_DEVICES",
    "CUDA_DEVICE_ORDER",
    "PORT",
    "GPU_SUPERVISOR_WORKER",
    "GPU_SUPERVISOR_GROUP",
    "GPU_SUPERVISOR_INDEX",
    "NOTIFY_SOCKET",
    "WATCHDOG_USEC",
    "MODEL",
]
say("env " + json.dumps({k: os.environ[k] for k in keys if k in os.environ}))
say("argv " + json.dumps(__import__("sys").argv[1:]))
notify("READY=1\nSTATUS=serving")
say("ready")
forever()
