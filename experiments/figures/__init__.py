"""One script per paper figure (and the studies beside them: memo choice, warm-start spread, task
calibration), each on the Figure scaffold of lib/figlib.py: `python experiments/figures/<name>.py`
trains (or reuses) its runs and writes experiments/results/<name>/. Not shipped in the wheel:
they read the checkout's configs and write its results."""
