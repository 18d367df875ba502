"""genartifact FPM self-benchmark: forward-pass metrics (FPM) recorded by an instrumented vLLM scheduler.

* :mod:`genartifact_fpm_bench.fpm` — the FPM record and its wire framing (engine-free).
* :mod:`genartifact_fpm_bench.scheduler` — ``InstrumentedScheduler`` (``scheduler_cls``), which emits one FPM per
  non-empty forward pass to a non-blocking ZMQ PUB stream (``docs/fpm.md``).
"""

__version__ = "0.1.0"
SCHEDULER_QUALNAME = "genartifact_fpm_bench.scheduler.InstrumentedScheduler"
