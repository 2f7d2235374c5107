"""The fake ``libnvidia-ml.so.1`` used to test the nvml backend without a GPU."""
