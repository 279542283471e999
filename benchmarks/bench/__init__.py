"""The parts of benchmarks/overhead.py, one job each.

    configs    the configurations (a)...(e), their environments, targets, metrics, parameters
    workers    the worker processes (benchmarks/_worker.py) in caller/callee pairs, /proc counters
    sections   the measured sections: latency rounds, serialization, memory, interpreter start-up
    stats      percentiles, medians, per-round ratios and their spread (stdlib only: the workers
               import it too, including config (a)'s `python -S` ones)
    report     the tables, the machine and git description, the JSON result file
    profiling  --profile: per-call counters, in-situ self times, perf, py-spy, cProfile
"""
