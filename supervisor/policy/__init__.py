"""Pure decision code: restart backoff, the worker lifecycle, reload diffs. No I/O, no clock."""
