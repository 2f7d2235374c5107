"""GPU backends: ``nvml`` (pynvml), ``sim`` (the world directory), ``none``."""
