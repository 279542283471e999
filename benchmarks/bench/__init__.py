"""The parts of benchmarks/overhead.py, one job each.

    pairs      the configurations (a)...(l), their environments, and their worker processes
               (benchmarks/_worker.py): caller/callee pairs, or a saturation group of one server and
               four clients; start, pause/resume (SIGSTOP/SIGCONT), shut down or kill
    sections   the measured sections and their targets: latency/throughput rounds (fresh pairs every
               round), server saturation, serialization, memory, interpreter start-up
    procstat   CPU time of processes and threads from /proc, thread groups by name (stdlib only: the
               workers import it too)
    stats      percentiles, medians, per-round ratios and added values against a baseline, with their
               spread (stdlib only: the workers import it too, including config (a)'s `python -S` ones)
    report     the tables, the machine, git and rpc_observe working-copy description, the JSON result file
    profiling  --profile: per-call counters, in-situ self times, perf, py-spy, cProfile
"""
